"""What a completed key leaves in Redis: keys and bytes per key, and server time per call.

For celery-idempotent and Powertools' Redis layer, side by side on one server: ``n`` completed
keys each (the same 3-field payload and result), keys counted with ``DBSIZE`` and memory with
``INFO memory`` (``used_memory``) before and after, then a projection of the steady-state
memory for a stream of 10⁶ keys a day with each library's default TTLs.

Each library names the keys its default way, under the run's prefix: ours as ``IdempotentTask``
does for a task ``bench.charge`` keyed by its arguments (``idempotency:{bench.charge:args:<sha256
of the arguments>}``), Powertools' as it does outside Lambda for a function ``charge``
(``test-func.charge#<md5 of the payload>``).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.micro import _LambdaContext, body, payload

#: 10⁶ keys a day, as the issue sizes it.
KEYS_PER_DAY = 1_000_000
#: celery-idempotent's default record TTL (idempotency_ttl).
OUR_TTL_S = 86_400
#: Powertools' default (IdempotencyConfig.expires_after_seconds).
POWERTOOLS_TTL_S = 3_600


def _used(client: redis.Redis) -> tuple[int, int]:
    info = client.info("memory")
    return int(info["used_memory"]), int(client.dbsize())


def _measure(client: redis.Redis, n: int, fill: Callable[[int], Any]) -> dict[str, Any]:
    for i in range(50):  # warm up: scripts loaded, connection open, allocator settled
        fill(10_000_000 + i)
    mem0, keys0 = _used(client)
    t0 = time.perf_counter()
    for i in range(n):
        fill(i)
    seconds = time.perf_counter() - t0
    mem1, keys1 = _used(client)
    return {
        "keys": n,
        "redis_keys_per_key": round((keys1 - keys0) / n, 3),
        "bytes_per_key": round((mem1 - mem0) / n, 1),
        "seconds": round(seconds, 2),
    }


def _ours(client: redis.Redis, prefix: str) -> Callable[[int], Any]:
    from celery_idempotent import DistributedIdempotencyGuard, fingerprint_payload
    from celery_idempotent.backends.redis.locks import RedisLockProvider
    from celery_idempotent.backends.redis.store import RedisIdempotencyStore
    from celery_idempotent.keyspace import task_key

    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client),
        lock_provider=RedisLockProvider(client),
        key_prefix=f"{prefix}idempotency:",  # the default prefix, under the run's
    )

    def fill(i: int) -> Any:
        data = payload(i)
        fp = fingerprint_payload(data)
        return guard.execute(task_key("bench.charge", "args", fp), body, input=data)

    return fill


def _powertools(client: redis.Redis, prefix: str) -> Callable[[int], Any]:
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
        CachePersistenceLayer,
    )

    config = IdempotencyConfig(expires_after_seconds=OUR_TTL_S)
    config.register_lambda_context(_LambdaContext())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        layer = CachePersistenceLayer(client=client)

    @idempotent_function(
        data_keyword_argument="order",
        persistence_store=layer,
        config=config,
        key_prefix=f"{prefix}test-func.charge",  # its default outside Lambda, under the run's
    )
    def charge(order: dict[str, Any]) -> dict[str, str]:
        return body()

    return lambda i: charge(order=payload(i))


def run(
    client: redis.Redis, prefix: str, *, n: int, databases: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Keys and bytes per completed key for both, and the projected steady-state memory.

    ``databases``: two empty databases of the server, one per library (a private server's),
    so that both grow their key tables alike; else both share ``client``'s database and the
    second one to run finds larger tables already paid for.
    """
    out: dict[str, Any] = {"keys_per_day": KEYS_PER_DAY, "databases": databases}
    kwargs = client.connection_pool.connection_kwargs
    clients = [client, client]
    if databases is not None:
        clients = [
            redis.Redis(host=kwargs.get("host"), port=kwargs.get("port"), db=db) for db in databases
        ]
        for each in clients:
            assert each.dbsize() == 0, "the databases given must be empty"
    ours = _measure(clients[0], n, _ours(clients[0], prefix))
    ours["ttl_s"] = OUR_TTL_S
    out["celery_idempotent"] = ours
    try:
        theirs = _measure(clients[1], n, _powertools(clients[1], prefix))
    except ImportError as exc:
        out["powertools"] = {"skipped": f"not installed: {exc} (pip install -e '.[bench]')"}
    else:
        theirs["ttl_s"] = POWERTOOLS_TTL_S
        out["powertools"] = theirs
    for name in ("celery_idempotent", "powertools"):
        entry = out[name]
        if "bytes_per_key" not in entry:
            continue
        alive = KEYS_PER_DAY * entry["ttl_s"] / 86_400
        entry["projected_gb_default_ttl"] = round(alive * entry["bytes_per_key"] / 1e9, 3)
        entry["projected_gb_1_day_ttl"] = round(KEYS_PER_DAY * entry["bytes_per_key"] / 1e9, 3)
    if databases is not None:
        for each in clients:
            each.flushdb()
            each.close()
    if "bytes_per_key" in out["powertools"]:
        out["bytes_ratio"] = round(ours["bytes_per_key"] / out["powertools"]["bytes_per_key"], 3)
    return out


def key_examples(prefix: str) -> dict[str, str]:
    """How each library names one key (for the note under the table)."""
    data = payload(1)
    md5 = hashlib.md5(json.dumps(data, sort_keys=True).encode()).hexdigest()  # noqa: S324
    from celery_idempotent import fingerprint_payload
    from celery_idempotent.core.names import record_name
    from celery_idempotent.keyspace import task_key

    key = task_key("bench.charge", "args", fingerprint_payload(data))
    return {
        "celery_idempotent": record_name(f"{prefix}idempotency:", key),
        "powertools": f"{prefix}test-func.charge#{md5}",
    }
