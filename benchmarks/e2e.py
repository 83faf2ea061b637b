"""End to end through a real worker: a no-op task, plain versus ``base=IdempotentTask``.

One ``celery worker`` subprocess (prefork, 2 processes by default) uses the benchmark's Redis as
broker, result backend and idempotency store. Each block publishes ``tasks`` tasks as one group
and waits for all their results; blocks of the three kinds take turns, round after round, each
kind first in a third of the rounds:

- ``plain``: ``@app.task``, distinct arguments;
- ``idempotent_first``: ``@app.task(base=IdempotentTask)``, arguments never seen before;
- ``idempotent_duplicate``: the same task with the arguments of the previous round's first
  block, so every delivery replays a stored result.

Throughput is tasks per second from the first publish to the last result. Redis's own CPU
(``INFO cpu``, user + system, read before and after each block) is summed per kind: the server
CPU per task, broker, result backend and store included, what a user sizes their Redis by. On a
shared server (``--redis-url``) everybody's load is in it; the private server has only ours.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def available() -> bool:
    """Whether ``IdempotentTask`` can be imported (the case needs it)."""
    try:
        import celery_idempotent.celery.task  # noqa: F401
    except ImportError:
        return False
    return True


def _env(url: str, queue: str, prefix: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CI_BENCH_REDIS_URL=url, CI_BENCH_QUEUE=queue, CI_BENCH_PREFIX=prefix)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


#: The CPU-bound neighbour of the loaded variant: a pure-Python loop, one process per core.
NEIGHBOUR = "while True: pass"


@contextlib.contextmanager
def neighbours(count: int) -> Any:
    """``count`` CPU-bound processes on this machine's cores for the duration of the block
    (the condition of a busy worker host: the worker, Redis and the producer compete with
    them for the CPU), stopped and reaped afterwards whatever happens."""
    procs = [
        subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(10)


def run(
    url: str,
    prefix: str,
    *,
    rounds: int,
    tasks: int,
    pool: str = "prefork",
    concurrency: int = 2,
    load: int = 0,
) -> dict[str, Any]:
    """The end-to-end case; ``load``: CPU-bound neighbours running meanwhile (0: none)."""
    queue = prefix.rstrip(":").replace(":", ".")
    if load:
        # Its own queue and keys: the quiet run's leftovers cannot be taken for this one's.
        queue += ".loaded"
        prefix = f"{prefix}loaded:"
    env = _env(url, queue, prefix)
    # The app module reads its configuration from the environment at import.
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

    if e2e_app.IdempotentTask is None:
        return {"skipped": "celery_idempotent.celery.task is not importable"}
    command = [
        *(sys.executable, "-m", "celery", "-A", "benchmarks.e2e_app", "worker"),
        *("-P", pool, "-c", str(concurrency), "-Q", queue, "-n", f"{queue}@%h", "-l", "warning"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat"),
    ]
    with tempfile.TemporaryFile() as log:
        worker = subprocess.Popen(
            command, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT
        )
        import redis

        server = redis.Redis.from_url(url)
        try:
            with neighbours(load) if load else contextlib.nullcontext():
                seconds, counts, blocks = _measure(
                    e2e_app, worker, rounds, tasks, concurrency, server_cpu=server_cpu(server)
                )
        except BaseException:
            log.seek(0)
            tail = log.read()[-4000:].decode("utf-8", "replace")
            print(f"end-to-end run failed; the worker's last output:\n{tail}", file=sys.stderr)
            raise
        finally:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(10)
            with contextlib.suppress(Exception):
                e2e_app.app.close()
            server.close()

    tps = {k: counts[k] / seconds[k] for k in seconds}
    # Rounds are short and their blocks adjacent: the median of the per-round ratios is what
    # a load burst on a shared machine disturbs least.
    per_round = {
        kind: [round(b / p, 3) for b, p in zip(blocks[kind], blocks["plain"])]
        for kind in ("idempotent_first", "idempotent_duplicate")
    }
    cpu = {k: blocks.pop(f"redis_cpu_s:{k}") for k in list(seconds)}
    by_command: dict[str, Any] = {k: blocks.pop(f"redis_commands:{k}") for k in list(seconds)}
    cpu_us = {k: round(sum(cpu[k]) * 1e6 / counts[k], 1) for k in seconds}
    cpu_rounds = {
        kind: [round(b / p, 3) for b, p in zip(cpu[kind], cpu["plain"]) if p > 0]
        for kind in ("idempotent_first", "idempotent_duplicate")
    }
    return {
        # Redis server CPU (INFO cpu) per task, by kind, and the idempotent kinds' ratios to
        # plain: all rounds together, and the median of the per-round ratios.
        "redis_cpu_us_per_task": cpu_us,
        # Where it goes: calls and µs per task by command (INFO commandstats: execution only;
        # INFO cpu minus their sum is reading, parsing and answering requests, and the rest).
        "redis_commands_per_task": by_command,
        "redis_cpu_ratio_first": round(cpu_us["idempotent_first"] / cpu_us["plain"], 3),
        "redis_cpu_ratio_duplicate": round(cpu_us["idempotent_duplicate"] / cpu_us["plain"], 3),
        "redis_cpu_ratio_first_median_of_rounds": statistics.median(cpu_rounds["idempotent_first"]),
        "redis_cpu_ratio_duplicate_median_of_rounds": statistics.median(
            cpu_rounds["idempotent_duplicate"]
        ),
        "pool": pool,
        "concurrency": concurrency,
        "neighbours": load,
        "rounds": rounds,
        "tasks_per_block": tasks,
        "tasks_per_second": {k: round(v, 1) for k, v in tps.items()},
        "blocks_tasks_per_second": blocks,
        "ratio_first": round(tps["idempotent_first"] / tps["plain"], 3),
        "ratio_duplicate": round(tps["idempotent_duplicate"] / tps["plain"], 3),
        "ratio_per_round": per_round,
        "ratio_first_median_of_rounds": statistics.median(per_round["idempotent_first"]),
        "ratio_duplicate_median_of_rounds": statistics.median(per_round["idempotent_duplicate"]),
    }


def server_cpu(client: Any) -> Any:
    """A function giving the Redis server's CPU seconds so far (``INFO cpu``: user + system,
    of every thread of the server) and its ``INFO commandstats`` (``{command: (calls,
    usec)}``: what each command's execution cost, without reading and parsing requests)."""

    def read() -> tuple[float, dict[str, tuple[int, int]]]:
        info = client.info("cpu")
        stats = client.info("commandstats")
        commands = {
            name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in stats.items()
        }
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"]), commands

    return read


def _per_task_commands(
    deltas: list[dict[str, tuple[int, int]]], tasks: int
) -> dict[str, dict[str, float]]:
    """Calls and µs per task by command over the blocks of one kind (``INFO commandstats``)."""
    total: dict[str, list[int]] = {}
    for delta in deltas:
        for name, (calls, usec) in delta.items():
            entry = total.setdefault(name, [0, 0])
            entry[0] += calls
            entry[1] += usec
    return {
        name: {"calls": round(calls / tasks, 2), "us": round(usec / tasks, 1)}
        for name, (calls, usec) in sorted(total.items(), key=lambda kv: -kv[1][1])
        if calls
    }


def _measure(
    e2e_app: Any,
    worker: subprocess.Popen[bytes],
    rounds: int,
    tasks: int,
    concurrency: int,
    *,
    server_cpu: Any = None,
) -> tuple[dict[str, float], dict[str, int], dict[str, list[float]]]:
    from celery import group
    from celery.exceptions import TimeoutError as CeleryTimeoutError

    plain, idem = e2e_app.plain, e2e_app.idempotent

    def gather(task: Any, args: range | list[int], timeout: float = 300) -> list[Any]:
        values: list[Any] = (
            group(task.s(i) for i in args).apply_async().get(timeout=timeout, interval=0.005)
        )
        if values != list(args):
            raise RuntimeError(f"{task.name}: wrong results")
        return values

    # Worker up, each child warm: connections made, scripts loaded.
    first = plain.delay(-1)
    deadline = time.monotonic() + 60
    while True:
        try:
            first.get(timeout=1)
            break
        except CeleryTimeoutError:
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited with {worker.returncode}") from None
            if time.monotonic() > deadline:
                raise
    warm = [-(10**6) - i for i in range(16 * concurrency)]
    gather(idem, warm, 60)
    gather(idem, warm, 60)
    gather(plain, warm, 60)

    seconds = {"plain": 0.0, "idempotent_first": 0.0, "idempotent_duplicate": 0.0}
    counts = dict.fromkeys(seconds, 0)
    blocks: dict[str, list[float]] = {k: [] for k in seconds}
    # Redis CPU seconds of each block, under "redis_cpu_s:<kind>" (run() takes them out).
    blocks.update({f"redis_cpu_s:{k}": [] for k in seconds})
    read_cpu = server_cpu or (lambda: (0.0, {}))
    commands: dict[str, list[dict[str, tuple[int, int]]]] = {k: [] for k in seconds}
    # Duplicates replay the first executions of the round before (round 0's are seeded
    # untimed), so that every kind can take every place in the rotation.
    previous = range(-tasks - 10**5, -(10**5))
    gather(idem, previous)
    for r in range(rounds):
        args = range(r * tasks, (r + 1) * tasks)
        kinds = [
            ("plain", plain, args),
            ("idempotent_first", idem, args),
            ("idempotent_duplicate", idem, previous),
        ]
        shift = r % len(kinds)
        for kind, task, a in kinds[shift:] + kinds[:shift]:
            c0, s0 = read_cpu()
            t0 = time.perf_counter()
            gather(task, a)
            elapsed = time.perf_counter() - t0
            c1, s1 = read_cpu()
            blocks[f"redis_cpu_s:{kind}"].append(c1 - c0)
            commands[kind].append(
                {
                    name: (calls - s0.get(name, (0, 0))[0], usec - s0.get(name, (0, 0))[1])
                    for name, (calls, usec) in s1.items()
                    if name != "info"  # the reads around the block
                }
            )
            seconds[kind] += elapsed
            counts[kind] += len(a)
            blocks[kind].append(round(len(a) / elapsed, 1))
        previous = args
    e2e_app.app.close()
    blocks.update(  # type: ignore[dict-item]
        {f"redis_commands:{k}": _per_task_commands(v, counts[k]) for k, v in commands.items()}
    )
    return seconds, counts, blocks
