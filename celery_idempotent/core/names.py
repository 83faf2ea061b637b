"""The names a key is stored under: ``<prefix>{<key>}`` (its record) and ``<prefix>lock:{<key>}``
(its lock).

Every shipped backend stores a key under these two names: the braces are Redis Cluster's hash
tag (a key's names share one slot), and the PostgreSQL and MySQL backends key their rows by the
same names, so that rows written by an earlier release are found again and one admin layer reads
every backend. The guard hands the names to its backend; what a backend adds of its own (Redis's
fence key, the lock's value, the record's encoding) lives in that backend's package
(``celery_idempotent.backends.redis.keyspace`` for Redis).
"""

from __future__ import annotations

import hashlib

__all__ = [
    "DEFAULT_PREFIX",
    "HEAD_CHARS",
    "LOCK_MARK",
    "MAX_READABLE_KEY",
    "SHORTENED_MARK",
    "lock_name",
    "parse_name",
    "record_name",
    "slot_key",
]

#: What every name starts with unless ``idempotency_key_prefix`` says otherwise.
DEFAULT_PREFIX = "idempotency:"
#: Keys longer than this are shortened in names: a readable head plus a digest.
MAX_READABLE_KEY = 200
#: How many characters of a shortened key stay readable.
HEAD_CHARS = 64
#: A shortened key is ``<head>…#<sha256>``.
SHORTENED_MARK = "…#"
#: What a lock's name has between the prefix and the key's braces.
LOCK_MARK = "lock:"


def slot_key(key: str) -> str:
    """The key as it appears inside names: the part between the braces.

    Short keys without braces stay as they are, so ``redis-cli`` shows them. A key with a brace
    (which would end or nest the hash tag) or longer than ``MAX_READABLE_KEY`` becomes a
    readable head plus the sha256 of the whole key.
    """
    if len(key) <= MAX_READABLE_KEY and "{" not in key and "}" not in key and key:
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (from JSON "\\udcff"): Redis needs bytes
            pass
        else:
            return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    head = key[:HEAD_CHARS].replace("{", "(").replace("}", ")")
    head = head.encode("utf-8", "replace").decode("utf-8")
    return f"{head}{SHORTENED_MARK}{digest}"


def lock_name(prefix: str, key: str) -> str:
    """``{prefix}lock:{<key>}``: the key's lock, in the same Redis Cluster slot as its record."""
    return f"{prefix}{LOCK_MARK}{{{slot_key(key)}}}"


def record_name(prefix: str, key: str) -> str:
    """``{prefix}{<key>}``: where the key's record is stored."""
    return f"{prefix}{{{slot_key(key)}}}"


def parse_name(name: str, prefix: str) -> tuple[str, str] | None:
    """``(kind, slot)`` of a record or lock name under ``prefix``, or ``None`` for another name.

    ``kind`` is ``"record"`` or ``"lock"``; ``slot`` is the key as it appears between the
    braces (the key, or its shortened form). A backend with names of its own (Redis's fence
    keys) parses those first.
    """
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    if rest.startswith(LOCK_MARK + "{") and rest.endswith("}"):
        kind, slot = "lock", rest[len(LOCK_MARK) + 1 : -1]
    elif rest.startswith("{") and rest.endswith("}"):
        kind, slot = "record", rest[1:-1]
    else:
        return None
    if not slot or "{" in slot or "}" in slot:
        return None
    return kind, slot
