"""The keyspace: how an idempotency key is spelled, named in Redis, and stored (layout v2).

This module is the only place that knows these formats. ``IdempotentTask`` builds task keys with
:func:`task_key`, the command line parses them back with :func:`parse_task_key`; the Redis
backends name a key's lock, record and fence with :func:`lock_name`, :func:`record_name` and
:func:`fence_name`, and encode records with :func:`encode_record`; the Lua scripts in
``celery_idempotent.backends.redis.scripts`` (and the publish and admin scripts) take their record
prefixes and the v1 field list from here.

Task keys
---------
``<namespace>:<kind>:<value>``, where the namespace is the task's name and ``kind`` is
``args`` (value: the sha256 of the bound arguments), ``id`` (the task id) or ``key`` (an
explicit or formatted key). The earliest kind marker wins when parsing: an explicit key may
itself contain ``:key:``.

Redis names (layout v2, unchanged from v1)
------------------------------------------
For an idempotency key ``k`` and prefix ``p`` (``{...}`` is the Redis Cluster hash tag, so all
of a key's names live in one slot; ``k`` appears as :func:`slot_key` spells it)::

    p{k}              the record: a string (v2) or a hash (v1), PX = the record's TTL
    p lock:{k}        the lease: "<deadline ms>/<fencing token>/<random>@<owner id>"; after
                      its deadline a tombstone that keeps the token (see below)
    p lock:{k}:fence  the last fencing token, only while the server clock is behind it

After a commit a key has **one** Redis key, the record: the commit writes it and deletes the
lock in one script, and the fence key does not exist (see below).

The record (layout v2)
----------------------
One string, ``2|<fencing token>|<created at>|<serializer>|<fingerprint>|<task id>|<payload>``;
before its body has run, a call published through ``apply_async`` leaves a queued marker
``q|<task id>|<fingerprint>|<published at>|<state>`` under the same name (its state says
whether a delivery claimed it, whose lease it then lives by); 0.1.0 kept a hash (layout v1). Their
encoding and decoding are in ``celery_idempotent.backends.redis.layout``, whose names this module
re-exports (``encode_record``, ``decode_record``, ``RECORD_HEAD``...).

Fencing tokens without a long-lived fence key
---------------------------------------------
A token is server time in µs, floored by the last token the key's keys still carry:
``max(server µs, lock's token + 1, fence key + 1)`` (a claim that finds a record takes no
token). A lock's value is ``<deadline>/<fencing token>/<token>``: the lease is valid while
the server clock (``TIME``, in ms) is before the deadline; the key itself lives
:data:`FENCE_MARGIN_MS` (``M``, 60 s) longer, and at least until the clock is ``M`` past the
token. A lease that ends without a commit (released, or past its deadline) therefore leaves
its lock as a **tombstone** carrying its token (a release writes deadline ``0``: a clock that
steps back never revives it; a lease that merely ran out is valid again if the clock steps
back before its deadline and nobody took the key meanwhile, as an expired Redis key that was
not yet deleted always was). A commit writes the record, which carries the token for the
record's TTL, and deletes the lock, so a completed key is one Redis key.

What holds: a key that carries a token ``T`` disappears only by expiry, and only once the
server clock reads at least ``T + M`` (the lock: released, expired, or its key's own TTL
pushed past the token by a claim or renewal made while the clock was behind it) or
``max(T, commit time + the record's TTL)`` (the record after a commit; the fence key keeps
``T`` until the clock passes it when the clock was behind ``T`` at the commit). So **the next
token is above every earlier one across lease expiry, release, record expiry and any server
clock step backwards, except a step back, after the last such key has expired, of more than
``M`` (a lease that ended without commit) or more than the record's TTL (``T + ttl − now`` at
the commit, if the clock was then behind ``T``)**. A step back while a key still carries the
token is harmless whatever its size: expiry deadlines are absolute server times, which only
move further away.

The fence key is written, as before, while the server clock is behind a token it hands out
or sees released (a step back since the claim); the lock's tombstone covers that case too,
the fence key also covers a lock deleted by hand. A claim reads it on every first execution
(part of the one ``MGET``), so a v1 fence key left by 0.1.0 keeps tokens increasing across the
upgrade too. A lock without a deadline (0.1.0's ``<random>@<owner id>``, or a lock written
before the tombstones, ``<fencing token>/<token>``) is held while its key exists.

What this does not cover: a failover to a replica whose clock is behind the old master's and
that did not receive the keys (the same as for any write the replica did not receive);
deleting keys by hand (``DEL``, the store's ``delete``, ``forget --task --force``; the admin
``forget`` of one key keeps the token in a tombstone); a restart that loses data; and the step
back beyond the bound above (``tests/sim/test_fence_bound.py`` pins both sides of it, and the
simulation's checker asserts every expiry against it).
"""

from __future__ import annotations

import hashlib
import math
from typing import NamedTuple

from celery_idempotent.backends.redis.layout import (
    DEFAULT_SERIALIZER,
    EXACT_AT,
    MARKER_CLAIMED,
    MARKER_QUEUED,
    MARKER_REQUEUED,
    MARKER_STATES,
    QUEUED_HEAD,
    RECORD_FIELDS,
    RECORD_HEAD,
    RECORD_VERSION,
    SEP,
    V1_RECORD_FIELDS,
    V1_VERSION,
    DecodedRecord,
    Marker,
    can_mark,
    decode_record,
    decode_v1_record,
    encode_record,
    lua_list,
    parse_marker,
    parse_queued,
    queued_value,
    record_head,
)

__all__ = [
    "DEFAULT_SERIALIZER",
    "EXACT_AT",
    "FENCE_MARGIN_MS",
    "KINDS",
    "KIND_MARKERS",
    "LOCK_SEP",
    "MARKER_CLAIMED",
    "MARKER_QUEUED",
    "MARKER_REQUEUED",
    "MARKER_STATES",
    "MAX_READABLE_KEY",
    "QUEUED_HEAD",
    "RECORD_FIELDS",
    "RECORD_HEAD",
    "RECORD_VERSION",
    "SEP",
    "SHORTENED_MARK",
    "V1_RECORD_FIELDS",
    "V1_VERSION",
    "DecodedRecord",
    "LockState",
    "Marker",
    "can_mark",
    "decode_record",
    "decode_v1_record",
    "encode_record",
    "fence_name",
    "lock_entry",
    "lock_name",
    "lock_value",
    "lua_list",
    "parse_lock",
    "parse_lock_value",
    "parse_marker",
    "parse_name",
    "parse_queued",
    "parse_task_key",
    "queued_value",
    "record_head",
    "record_name",
    "slot_for",
    "slot_key",
    "task_key",
    "task_of_slot",
    "with_slot",
]

# --------------------------------------------------------------------------- task keys

#: What follows the namespace in a task key: ``args`` (argument hash), ``id`` (task id),
#: ``key`` (explicit or formatted key).
KINDS = ("args", "id", "key")
#: How each kind appears in a task key; a namespace may not contain one, or a key could not be
#: parsed back.
KIND_MARKERS = tuple(f":{kind}:" for kind in KINDS)
_MARKERS = KIND_MARKERS


def task_key(namespace: str, kind: str, value: str) -> str:
    """``<namespace>:<kind>:<value>``: the idempotency key of a task call."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return f"{namespace}:{kind}:{value}"


def parse_task_key(key: str) -> tuple[str, str, str] | None:
    """``(namespace, kind, value)`` of a task key, or ``None`` when it has no kind marker.

    The earliest marker wins: in ``t:key:a:key:b`` the value is ``a:key:b``.
    """
    best: tuple[int, str] | None = None
    for marker in _MARKERS:
        index = key.find(marker)
        if index > 0 and (best is None or index < best[0]):
            best = (index, marker)
    if best is None:
        return None
    index, marker = best
    return key[:index], marker[1:-1], key[index + len(marker) :]


def task_of_slot(slot: str) -> str | None:
    """The namespace (task name) at the start of a slot, or ``None``.

    A shortened slot whose head ends before the kind marker has no recognisable task.
    """
    parsed = parse_task_key(slot)
    return None if parsed is None else parsed[0]


#: Between a task key and its schedule slot (``idempotency_window``).
SLOT_SEP = "@"


def slot_for(when: float, window: float) -> str:
    """The schedule slot of time ``when`` (epoch seconds): the nearest multiple of ``window``,
    so that two ``celery beat`` instances firing around one boundary share it."""
    slot = math.floor(when / window + 0.5) * window
    if float(slot).is_integer():
        return str(int(slot))
    return repr(round(slot, 6))


def with_slot(key: str, slot: str) -> str:
    """``<key>@<slot>``: a task key scoped to one schedule slot."""
    return f"{key}{SLOT_SEP}{slot}"


# --------------------------------------------------------------------------- Redis names

#: Keys longer than this are shortened in Redis names: a readable head plus a digest.
MAX_READABLE_KEY = 200
#: How many characters of a shortened key stay readable.
HEAD_CHARS = 64
#: A shortened key is ``<head>…#<sha256>``.
SHORTENED_MARK = "…#"
_LOCK = "lock:"
_FENCE = ":fence"


def slot_key(key: str) -> str:
    """The key as it appears inside Redis names: the part between the hash-tag braces.

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
    return f"{prefix}{_LOCK}{{{slot_key(key)}}}"


def record_name(prefix: str, key: str) -> str:
    """``{prefix}{<key>}``: where the key's record is stored."""
    return f"{prefix}{{{slot_key(key)}}}"


def fence_name(lock: str) -> str:
    """The fence key of a lock (any resource name): ``<lock>:fence``, same hash slot."""
    return f"{lock}{_FENCE}"


def parse_name(name: str, prefix: str) -> tuple[str, str] | None:
    """``(kind, slot)`` of a Redis name under ``prefix``, or ``None`` for a foreign name.

    ``kind`` is ``"record"``, ``"lock"`` or ``"fence"``; ``slot`` is the key as it appears
    between the hash-tag braces (the key, or its shortened form).
    """
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    if rest.startswith(_LOCK + "{"):
        body = rest[len(_LOCK) + 1 :]
        if body.endswith("}" + _FENCE):
            kind, slot = "fence", body[: -len(_FENCE) - 1]
        elif body.endswith("}"):
            kind, slot = "lock", body[:-1]
        else:
            return None
    elif rest.startswith("{") and rest.endswith("}"):
        kind, slot = "record", rest[1:-1]
    else:
        return None
    if not slot or "{" in slot or "}" in slot:
        return None
    return kind, slot


# --------------------------------------------------------------------------- the lock

#: Between the fields of a lock's value: the lease's deadline, its fencing token, its token.
LOCK_SEP = "/"
#: How long a lock keeps the fencing token of a lease that ended without a commit (released,
#: or past its deadline), counted from the later of the lease's end and the server clock
#: passing the token: a server clock that steps back less than this after that still floors
#: the next token above it (see "Fencing tokens" above). In ms.
FENCE_MARGIN_MS = 60_000


def lock_value(fencing_token: int | str, token: str) -> str:
    """A lease's full token: ``<fencing token>/<token>`` (what :class:`Lease` carries; the
    lock stores it behind the lease's deadline, see :func:`lock_entry`)."""
    return f"{fencing_token}{LOCK_SEP}{token}"


def lock_entry(deadline_ms: int, lease_token: str) -> str:
    """What a lock stores: ``<deadline in server ms>/<lease token>``. The lease is valid while
    the server clock is before the deadline; after it the value is a tombstone that keeps the
    fencing token until the key expires."""
    return f"{int(deadline_ms)}{LOCK_SEP}{lease_token}"


class LockState(NamedTuple):
    """A lock's value, parsed. ``deadline_ms`` is ``None`` for a lock without one (0.1.0's
    ``<token>``, or ``<fencing token>/<token>`` written before issue 13's fix): such a lock is
    held while its key exists."""

    deadline_ms: int | None
    fencing_token: int | None
    lease_token: str
    owner: str

    def held(self, now_ms: float) -> bool:
        """Whether the lease is valid at server time ``now_ms`` (a tombstone is not)."""
        return self.deadline_ms is None or self.deadline_ms > now_ms


def parse_lock(value: str) -> LockState:
    """The fields of a lock's value, in any of its three spellings (see :class:`LockState`)."""
    deadline: int | None = None
    fence: int | None = None
    lease = value
    head, sep, rest = value.partition(LOCK_SEP)
    if sep and head.isdigit():
        second, sep2, tail = rest.partition(LOCK_SEP)
        if sep2 and second.isdigit():
            deadline, fence = int(head), int(second)
            lease = rest
            rest = tail
        else:
            fence = int(head)
        token = rest
    else:
        token = value
    owner = token.split("@", 1)[1] if "@" in token else token
    return LockState(deadline, fence, lease, owner)


def parse_lock_value(value: str) -> tuple[int | None, str]:
    """``(fencing token, owner id)`` of a lock's value (or of a lease token); a v1 lock has no
    fencing token."""
    state = parse_lock(value)
    return state.fencing_token, state.owner
