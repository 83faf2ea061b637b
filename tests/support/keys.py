"""Keys of a test in a shared Redis: found by prefix with SCAN, never KEYS or FLUSHDB.

The prefix is escaped by the library's own ``glob_escape`` (the one its SCAN walks use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_idempotent.backends.redis.client import glob_escape

if TYPE_CHECKING:
    import redis


def delete_keys_with_prefix(
    client: redis.Redis, prefix: str, *, count: int = 500, cluster_node: bool = False
) -> int:
    """Delete every key starting with ``prefix`` (SCAN, never KEYS or FLUSHDB); the number deleted.

    ``client`` talks to one server. For a node of a Redis Cluster pass ``cluster_node=True``:
    keys are then unlinked one per command (pipelined), since keys of different slots cannot
    share a command there.
    """
    if not prefix:
        raise ValueError("refusing to delete with an empty prefix")
    pattern = glob_escape(prefix) + "*"
    deleted = 0
    batch: list[bytes | str] = []

    def flush() -> int:
        if cluster_node:
            pipe = client.pipeline(transaction=False)
            for key in batch:
                pipe.unlink(key)
            removed = sum(int(n) for n in pipe.execute())
        else:
            removed = int(client.unlink(*batch))
        batch.clear()
        return removed

    for key in client.scan_iter(match=pattern, count=count):
        batch.append(key)
        if len(batch) >= count:
            deleted += flush()
    if batch:
        deleted += flush()
    return deleted
