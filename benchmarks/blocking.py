"""How long can a body block its worker's event loop and keep its lease? (gevent, eventlet)

``python -m benchmarks.blocking [--redis-url URL] [--lease 1] [--spin 60]`` starts one process
per library, patched as ``celery worker -P gevent|eventlet`` does, and measures with a real
Redis and the real guard:

- a body that computes in Python without yielding for ``--spin`` seconds (``--lease`` second
  leases), beside a cooperative body of the same length in the same process: whether both keep
  their leases, and the longest gap between two renewals of a lease (the keeper thread's
  renewals are due every ``lease / 3``);
- a body that spends its time in one C call holding the GIL (``sum(range(n))``), for lengths
  around the lease: the longest that kept its lease and the shortest that lost it.

Prints a table and one JSON line per library. Without ``--redis-url`` (or ``REDIS_URL``) a
private server is started (``celery_idempotent.servers.redis_server``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
import warnings
from typing import Any

LIBS = ("gevent", "eventlet")


def _patch(lib: str) -> None:
    if lib == "gevent":
        from gevent import monkey

        monkey.patch_all()
    else:
        warnings.simplefilter("ignore")  # eventlet's deprecation notice
        import eventlet

        eventlet.monkey_patch()


def _child(lib: str, url: str, lease: float, spin: float) -> dict[str, Any]:
    _patch(lib)
    import threading

    import redis

    from celery_idempotent import (
        DistributedIdempotencyGuard,
        LockLostError,
        RedisIdempotencyStore,
        RedisLockProvider,
    )

    client = redis.Redis.from_url(url)
    prefix = f"cibench:{uuid.uuid4().hex[:8]}:"
    gaps: dict[str, float] = {}
    last: dict[str, float] = {}

    class Timed(RedisLockProvider):
        """Records when each lease was renewed (from the keeper thread)."""

        def renewer(self) -> Any:
            inner = super().renewer()
            if inner is None:
                return None

            def renew(lease: Any, ttl: float, timeout: float) -> bool:
                now = time.monotonic()
                prev = last.get(lease.token)
                if prev is not None:
                    gaps[lease.token] = max(gaps.get(lease.token, 0.0), now - prev)
                last[lease.token] = now
                return bool(inner(lease, ttl, timeout))

            return renew

    provider = Timed(client)
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client),
        lock_provider=provider,
        lock_ttl=lease,
        key_prefix=prefix,
    )
    outcome: dict[str, Any] = {}

    def run(name: str, fn: Any) -> None:
        try:
            guard.execute(name, fn)
            outcome[name] = "kept"
        except LockLostError:
            outcome[name] = "lost"

    def cpu() -> None:
        end = time.monotonic() + spin
        while time.monotonic() < end:
            pass

    def coop() -> None:
        time.sleep(spin)

    threads = [threading.Thread(target=run, args=(n, f)) for n, f in (("coop", coop), ("cpu", cpu))]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    result: dict[str, Any] = {
        "lib": lib,
        "lease": lease,
        "python_loop_seconds": spin,
        "python_loop": outcome["cpu"],
        "cooperative_beside_it": outcome["coop"],
        "longest_renewal_gap": round(max(gaps.values(), default=0.0), 3),
    }

    # One C call holding the GIL: calibrate sum(range(n)), then lengths around the lease.
    started = time.perf_counter()
    sum(range(10_000_000))
    per_item = (time.perf_counter() - started) / 10_000_000
    kept, lost = 0.0, None
    for fraction in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.3):
        n = int(lease * fraction / per_item)
        took: list[float] = []

        def c_call(n: int = n, took: list[float] = took) -> None:
            t = time.perf_counter()
            sum(range(n))
            took.append(time.perf_counter() - t)

        name = f"c-{fraction}"
        run(name, c_call)
        result.setdefault("c_calls", []).append([round(took[0], 3), outcome[name]])
        if outcome[name] == "kept":
            kept = max(kept, took[0])
        elif lost is None or took[0] < lost:
            lost = took[0]
    result["c_call_longest_kept"] = round(kept, 3)
    result["c_call_shortest_lost"] = None if lost is None else round(lost, 3)
    for name in client.scan_iter(match=f"{prefix}*"):
        client.delete(name)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.blocking", description=__doc__)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--spin", type=float, default=60.0)
    parser.add_argument("--child", choices=LIBS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.redis_url, args.lease, args.spin)))
        return 0
    server = None
    url = args.redis_url
    if url is None:
        from celery_idempotent.servers.redis_server import start_private_redis

        server = start_private_redis()
        url = server.url()
    try:
        rows = []
        for lib in LIBS:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.blocking",
                    "--child",
                    lib,
                    "--redis-url",
                    url,
                    "--lease",
                    str(args.lease),
                    "--spin",
                    str(args.spin),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        if server is not None:
            server.stop()
    print(f"lease {args.lease:g}s, Python loop {args.spin:g}s")
    print("lib       loop  beside  longest gap  C call kept / lost")
    for r in rows:
        print(
            f"{r['lib']:<9} {r['python_loop']:<5} {r['cooperative_beside_it']:<7} "
            f"{r['longest_renewal_gap']:>8.3f}s  {r['c_call_longest_kept']:.3f}s / "
            f"{r['c_call_shortest_lost']}s"
        )
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
