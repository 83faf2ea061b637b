"""Reading a Redis lease as the scripts do: by the deadline in the lock's value.

Since the fencing tombstones (``backends.redis.keyspace``), a lease that ends without a
commit leaves its lock key behind for ``FENCE_MARGIN_MS`` more, carrying its fencing token:
the key's existence or ``PTTL`` no longer says whether the lease is held. These helpers say it
the way the Lua scripts decide it, so tests assert the lease, not a key.
"""

from __future__ import annotations

from typing import Any

from celery_idempotent.backends.redis import keyspace

#: What :func:`lease_left_ms` returns when no lease is held (as ``PTTL`` does for no key).
NO_LEASE = -2


def server_ms(client: Any) -> int:
    """The Redis server's clock in ms (``TIME``), the clock lock deadlines are in."""
    sec, usec = client.time()
    return (int(sec) * 1_000_000 + int(usec)) // 1000


def lease_left_ms(client: Any, resource: str | bytes) -> int:
    """The ms the lease at ``resource`` has left by the server's clock, or :data:`NO_LEASE`
    when none is held: no key, or a tombstone (released, or past its deadline). A lock without
    a deadline (0.1.0's) is held while its key exists: its ``PTTL``."""
    raw = client.get(resource)
    if raw is None:
        return NO_LEASE
    state = keyspace.parse_lock(raw.decode() if isinstance(raw, bytes) else raw)
    if state.deadline_ms is None:
        return int(client.pttl(resource))
    left = state.deadline_ms - server_ms(client)
    return left if left > 0 else NO_LEASE


def lease_held(client: Any, resource: str | bytes) -> bool:
    """Whether a lease is held at ``resource`` right now (by the server's clock)."""
    return lease_left_ms(client, resource) != NO_LEASE


def is_tombstone(client: Any, name: str | bytes) -> bool:
    """Whether ``name`` is a lock key whose lease has ended (it only keeps a fencing token)."""
    raw = client.get(name)
    if raw is None:
        return False
    try:
        state = keyspace.parse_lock(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return state.deadline_ms is not None and not lease_held(client, name)
