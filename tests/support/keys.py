"""Keys of a test in a shared Redis: found by prefix with SCAN, never KEYS or FLUSHDB."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis


_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")


def escape_glob(text: str) -> str:
    """Escape Redis glob metacharacters (``* ? [ ] \\``) so ``text`` matches only itself.

    Braces are not special to Redis globs: ``"test:ab:lock:{k}"`` needs no escaping for them.
    """
    return _GLOB_SPECIAL.sub(r"\\\1", text)


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
    pattern = escape_glob(prefix) + "*"
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
