"""Where an end-to-end task's CPU goes: µs per task by process, plain against guarded.

``python -m benchmarks.e2e_cpu [--redis-url URL] [--rounds 8] [--tasks 300]``

The end-to-end case of ``python -m benchmarks`` gives throughput ratios; on a shared machine
they move by several percent from run to run. This tool runs the same worker (prefork, 2
processes, one Redis as broker, result backend and store) and the same blocks, and reads what
each block cost in CPU time: the worker's main process and its children (``/proc``), this
process (the producer, ``time.process_time``), and Redis (``INFO cpu``, the whole server: on a
shared server others' load is in it), with the children's context switches. Besides plain,
first executions and duplicates, two floors run: a plain task that makes one no-op script round
trip through redis-py (what a duplicate cannot avoid) and one that makes two (a first
execution). A guarded kind's children CPU above its floor is what the library's own Python
costs per task in a worker.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import e2e

_CLK = os.sysconf("SC_CLK_TCK")
KINDS = ("plain", "first", "duplicate", "plain_1_script", "plain_2_scripts")


def _proc_cpu(pid: int) -> tuple[float, int, int]:
    """(user + system seconds, voluntary, involuntary context switches) of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLK
    switches = {"voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in switches:
            switches[name] = int(value)
    return cpu, switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"]


def _worker_cpu(pid: int) -> list[float]:
    """[main CPU s, children CPU s, children voluntary, children involuntary switches]."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    main = _proc_cpu(pid)[0]
    out = [main, 0.0, 0.0, 0.0]
    for child in children:
        try:
            cpu, vol, invol = _proc_cpu(int(child))
        except FileNotFoundError:  # pragma: no cover - a child replaced meanwhile
            continue
        out[1] += cpu
        out[2] += vol
        out[3] += invol
    return out


def run(url: str, prefix: str, *, rounds: int, tasks: int, load: int = 0) -> dict[str, Any]:
    import redis
    from celery import group

    queue = prefix.rstrip(":").replace(":", ".")
    env = e2e._env(url, queue, prefix)
    os.environ.update(
        {k: env[k] for k in ("CI_BENCH_REDIS_URL", "CI_BENCH_QUEUE", "CI_BENCH_PREFIX")}
    )
    sys.modules.pop("benchmarks.e2e_app", None)
    # Not "from benchmarks import e2e_app": that finds the package's attribute, the module of
    # an earlier run (its queue, its closed app), and imports nothing.
    # The earlier run's tasks are still registered under the same names (Celery 5.7 warns).
    import celery.exceptions

    duplicate = getattr(celery.exceptions, "DuplicateTaskNameWarning", None)
    with warnings.catch_warnings():
        if duplicate is not None:
            warnings.simplefilter("ignore", duplicate)
        e2e_app: Any = importlib.import_module("benchmarks.e2e_app")

    server = redis.Redis.from_url(url)
    tasks_of = {
        "plain": e2e_app.plain,
        "first": e2e_app.idempotent,
        "duplicate": e2e_app.idempotent,
        "plain_1_script": e2e_app.plain_1_script,
        "plain_2_scripts": e2e_app.plain_2_scripts,
    }

    def redis_cpu() -> float:
        info = server.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def gather(task: Any, args: range) -> None:
        values = group(task.s(i) for i in args).apply_async().get(timeout=300, interval=0.005)
        if values != list(args):
            raise RuntimeError(f"{task.name}: wrong results")

    command = [
        *(sys.executable, "-m", "celery", "-A", "benchmarks.e2e_app", "worker"),
        *("-P", "prefork", "-c", "2", "-Q", queue, "-n", f"{queue}@%h", "-l", "warning"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat"),
    ]
    sums = {
        k: dict.fromkeys(("wall", "main", "children", "vol", "invol", "producer", "redis"), 0.0)
        for k in KINDS
    }
    per_round: dict[str, list[float]] = {k: [] for k in KINDS}
    count = dict.fromkeys(KINDS, 0)
    with tempfile.TemporaryFile() as log, contextlib.ExitStack() as stack:
        worker = subprocess.Popen(
            command, cwd=str(e2e.ROOT), env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            e2e_app.plain.delay(-1).get(timeout=60)
            warm = range(-(10**6) - 32, -(10**6))
            for kind in KINDS:
                gather(tasks_of[kind], warm)
            previous = range(-tasks - 10**5, -(10**5))
            gather(e2e_app.idempotent, previous)
            stack.enter_context(e2e.neighbours(load))
            for r in range(rounds):
                args = range(r * tasks, (r + 1) * tasks)
                order = list(KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)])
                for kind in order:
                    a = previous if kind == "duplicate" else args
                    w0, p0, r0, t0 = (
                        _worker_cpu(worker.pid),
                        time.process_time(),
                        redis_cpu(),
                        time.perf_counter(),
                    )
                    gather(tasks_of[kind], a)
                    t1 = time.perf_counter()
                    w1, p1, r1 = _worker_cpu(worker.pid), time.process_time(), redis_cpu()
                    s = sums[kind]
                    s["wall"] += t1 - t0
                    for name, before, after in zip(("main", "children", "vol", "invol"), w0, w1):
                        s[name] += after - before
                    s["producer"] += p1 - p0
                    s["redis"] += r1 - r0
                    count[kind] += len(a)
                    per_round[kind].append(len(a) / (t1 - t0))
                previous = args
        finally:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(10)
            e2e_app.app.close()
    result: dict[str, Any] = {
        "rounds": rounds,
        "tasks_per_block": tasks,
        "neighbours": load,
        "kinds": {},
    }
    for kind in KINDS:
        s, n = sums[kind], count[kind]
        result["kinds"][kind] = {
            "tasks_per_second": round(n / s["wall"], 1),
            "ratio_median_of_rounds": round(
                statistics.median(b / p for b, p in zip(per_round[kind], per_round["plain"])), 3
            ),
            "us_per_task": {
                name: round(1e6 * s[name] / n, 1)
                for name in ("main", "children", "producer", "redis")
            },
            "children_switches_per_task": {
                "voluntary": round(s["vol"] / n, 2),
                "involuntary": round(s["invol"] / n, 2),
            },
        }
    return result


def render(result: dict[str, Any]) -> str:
    kinds = result["kinds"]
    plain_children = kinds["plain"]["us_per_task"]["children"]
    lines = [
        f"{result['rounds']} rounds × {result['tasks_per_block']} tasks, CPU µs per task "
        "(/proc clock ticks; Redis: the whole server)"
        + (f", {result['neighbours']} CPU-bound neighbours" if result.get("neighbours") else ""),
        f"{'kind':16} {'tasks/s':>8} {'ratio':>6} {'main':>6} {'children':>9} {'+plain':>7} "
        f"{'producer':>9} {'redis':>6} {'cs vol':>7} {'cs inv':>7}",
    ]
    for kind, k in kinds.items():
        us = k["us_per_task"]
        lines.append(
            f"{kind:16} {k['tasks_per_second']:8.0f} {k['ratio_median_of_rounds']:6.3f} "
            f"{us['main']:6.0f} {us['children']:9.0f} {us['children'] - plain_children:+7.0f} "
            f"{us['producer']:9.0f} {us['redis']:6.0f} "
            f"{k['children_switches_per_task']['voluntary']:7.2f} "
            f"{k['children_switches_per_task']['involuntary']:7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e_cpu", description=__doc__)
    p.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="the one Redis (default: $REDIS_URL, else a private server started for the run)",
    )
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tasks", type=int, default=300)
    p.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="N CPU-bound neighbour processes during the measured rounds (default 0)",
    )
    p.add_argument("--output", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    import redis

    from celery_idempotent.servers.redis_server import start_private_redis

    prefix = f"cibench:{secrets.token_hex(4)}:"
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(start_private_redis()).url()
        try:
            result = run(url, prefix, rounds=args.rounds, tasks=args.tasks, load=args.load)
        finally:
            client = redis.Redis.from_url(url)
            for name in client.scan_iter(match=prefix.replace("[", "\\[") + "*", count=1000):
                client.unlink(name)
            client.close()
    result["loadavg"] = list(os.getloadavg())
    print(render(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
