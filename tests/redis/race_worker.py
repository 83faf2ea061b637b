"""One racing process of ``test_redis_race.py``: run the guard over shared keys, report as JSON.

Usage: ``python race_worker.py URL PREFIX WORKER_ID N_KEYS PATH``

``PATH`` is ``atomic`` (the Redis lock provider and store on one client) or ``split`` (on two
clients, ``atomic_with`` off). The process builds its guard and loads the scripts, says it is
ready (``INCR <prefix>ready``), and waits on ``BLPOP <prefix>go`` so that every worker starts at
once. Each body ``INCR``s the key's counter, its only side effect, and returns who ran it with
the counter's value. Prints ``{"results": {key: value}, "ran": [keys it ran], "contended": n}``
(``n``: how many keys it found held by another worker at least once).
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import redis

from celery_idempotent import (
    DistributedIdempotencyGuard,
    RedisIdempotencyStore,
    RedisLockProvider,
    current_lease,
)
from celery_idempotent.backends.redis.store import RedisAtomicBackend


class SplitStore(RedisIdempotencyStore):
    def atomic_with(self, lock_provider: Any) -> None:
        return None


def main(argv: list[str]) -> int:
    url, prefix, worker, n_keys, path = argv
    worker_id, count = int(worker), int(n_keys)
    client = redis.Redis.from_url(url)
    provider = RedisLockProvider(client, key_prefix=prefix)
    store = RedisIdempotencyStore(client) if path == "atomic" else SplitStore(url=url)
    guard = DistributedIdempotencyGuard(
        store=store,
        lock_provider=provider,
        key_prefix=prefix,
        lock_ttl=10,
        retry_count=200,
        retry_base_delay=0.002,
        retry_max_delay=0.02,
    )
    assert isinstance(guard.backend, RedisAtomicBackend) is (path == "atomic")
    # Load the scripts now, so that the race is not staggered by first-use SCRIPT LOADs.
    guard.execute(f"warm-up-{worker_id}", lambda: None)

    keys = [f"key-{index}" for index in range(count)]
    if worker_id % 2:
        # Half walk the keys in step (head-on contention), half in an order of their own.
        random.Random(worker_id).shuffle(keys)
    results: dict[str, Any] = {}
    ran: list[str] = []
    contended = 0

    client.incr(f"{prefix}ready")
    if client.blpop([f"{prefix}go"], timeout=30) is None:
        print("no go signal within 30 s", file=sys.stderr)
        return 2

    for key in keys:

        def body(key: str = key) -> str:
            value = client.incr(f"{prefix}count:{key}")
            assert current_lease() is not None
            time.sleep(0.002)  # hold the lock a little: widen the window for the others
            return f"worker-{worker_id}:{value}"

        outcome = guard.run(key, body, input={"key": key})
        results[key] = outcome.value
        if not outcome.replayed:
            ran.append(key)
        if outcome.attempts > 1:
            contended += 1
    report = {"results": results, "ran": ran, "contended": contended}
    json.dump(report, sys.stdout)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
