"""The in-memory store under a stream of distinct keys: operations per second and resident memory.

``python -m benchmarks.memory [--keys N]`` prints one JSON object. Run as its own process (the
runner does) so that the resident-memory figures start from a clean heap. Time is a fake clock
that advances ``step`` seconds per stored key, so with ``ttl`` seconds of retention about
``ttl / step`` records are alive at any moment and the rest must be swept.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def measure(keys: int, ttl: float, step: float, live_keys: int) -> dict[str, Any]:
    from celery_idempotent import IdempotencyRecord, MemoryIdempotencyStore

    names = [f"charge:{i}" for i in range(keys)]  # made before the baseline: not the store's
    gc.collect()
    base = rss_bytes()

    clock = FakeClock()
    store = MemoryIdempotencyStore(clock=clock)
    put = store.set
    peak_live = 0
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        put(name, IdempotencyRecord(i, None, clock.now), ttl)
        clock.now += step
        if not i & 0xFFFF:
            peak_live = max(peak_live, len(store))
    set_s = time.perf_counter() - t0
    peak_live = max(peak_live, len(store))
    live_after = len(store)
    gc.collect()
    rss_after = rss_bytes()

    window = max(1, min(live_after, int(ttl / step) - 1))
    get = store.get
    t0 = time.perf_counter()
    hits = 0
    for j in range(keys):
        if get(names[keys - 1 - (j % window)]) is not None:
            hits += 1
    get_s = time.perf_counter() - t0

    # What one live record costs: a store that keeps everything it is given.
    del store
    gc.collect()
    base_live = rss_bytes()
    keeper = MemoryIdempotencyStore(clock=clock)
    for i in range(live_keys):
        keeper.set(names[i], IdempotencyRecord(i, None, clock.now), 1e9)
    gc.collect()
    per_record = (rss_bytes() - base_live) / live_keys

    return {
        "keys": keys,
        "ttl_s": ttl,
        "clock_step_s": step,
        "set_ops_per_s": round(keys / set_s),
        "get_ops_per_s": round(keys / get_s),
        "get_hits": hits,
        "live_records_after": live_after,
        "peak_live_records": peak_live,
        "rss_delta_mib": round((rss_after - base) / 2**20, 1),
        "bytes_per_live_record": round(per_record),
        "live_records_measured_for_size": live_keys,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--ttl", type=float, default=60.0, help="record TTL, fake seconds")
    parser.add_argument("--step", type=float, default=0.001, help="fake seconds per key")
    parser.add_argument("--live-keys", type=int, default=100_000)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.keys, args.ttl, args.step, min(args.live_keys, args.keys))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
