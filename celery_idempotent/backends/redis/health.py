"""Checks of a Redis server that can break the promises: its ``maxmemory-policy``.

Every key the library writes (locks, records) has a TTL. Under any ``maxmemory-policy`` other
than ``noeviction`` (``volatile-*`` included: they pick among keys with a TTL) Redis evicts
keys when it reaches ``maxmemory``: an evicted lock lets a duplicate run while the body still
runs, an evicted record lets a completed key run again. The policy is read from ``INFO
memory``, which managed services that disable ``CONFIG`` still answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from celery_idempotent.backends.redis.client import SentinelClientFactory, import_redis

__all__ = ["eviction_policy", "eviction_warning", "health_client"]

SAFE_POLICY = "noeviction"


def eviction_policy(client: Any) -> tuple[str | None, str | None]:
    """``(policy, None)`` as the server reports it, or ``(None, why it could not be read)``.

    A Cluster client asks every primary; the first policy other than ``noeviction`` wins.
    """
    try:
        info = client.info("memory")
    except Exception as exc:  # refused (ACL, a proxy), unreachable: say so, never fail
        return None, f"INFO memory failed: {exc}"
    sections = [info]
    if isinstance(info, dict) and info and all(isinstance(v, dict) for v in info.values()):
        sections = list(info.values())  # RedisCluster: {node: info}
    policies = []
    for section in sections:
        policy = section.get("maxmemory_policy") if isinstance(section, dict) else None
        if isinstance(policy, bytes):
            policy = policy.decode()
        if not isinstance(policy, str) or not policy:
            return None, "INFO memory has no maxmemory_policy field"
        policies.append(policy)
    unsafe = [p for p in policies if p != SAFE_POLICY]
    return (unsafe[0] if unsafe else SAFE_POLICY), None


def eviction_warning(where: str, policy: str | None, error: str | None) -> str | None:
    """The start-up warning for the Redis at ``where``, or ``None`` when its policy is safe."""
    if policy == SAFE_POLICY:
        return None
    if policy is None:
        return (
            f"could not check the maxmemory-policy of the idempotency Redis at {where} "
            f"({error}): unless it is noeviction, Redis may evict a lock or a record under "
            "memory pressure and let a key run twice"
        )
    return (
        f"the idempotency Redis at {where} has maxmemory-policy {policy}: under memory "
        "pressure it may evict a lock or a record (every key this library writes has a TTL, so "
        "volatile-* policies pick them too) and let a key run twice. Set maxmemory-policy "
        "noeviction on it, or keep the idempotency keys on a Redis of their own, apart from "
        "a cache"
    )


@contextlib.contextmanager
def health_client(source: Any, url: str | None) -> Iterator[Any]:
    """A client for one health read (``INFO``) of the Redis that ``source`` (the
    ``idempotency_client`` setting) or else ``url`` names, or ``None`` when there is none to
    read with here: a user's client factory is called once per worker process, by the tasks.

    A URL's client (2 s timeouts) and a Sentinel factory's are made for the read and closed
    after it; a ready client (``source`` itself) is lent as it is and left open.
    """
    if source is None:
        if url is None:
            yield None
            return
        client = import_redis().Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    elif callable(getattr(source, "register_script", None)):
        yield source
        return
    elif isinstance(source, SentinelClientFactory):
        client = source()
    else:
        yield None
        return
    try:
        yield client
    finally:
        client.close()
