"""The Redis keyspace: what a key's names hold in Redis (layout v2).

The names themselves (``<prefix>{<key>}``, ``<prefix>lock:{<key>}``) are every backend's, in
``celery_idempotent.core.names``; this module adds what only Redis has: the fence key, the
lock's value (:data:`LOCK_SEP` between its fields) and the fencing bound, and re-exports the
record's and the queued marker's formats from ``layout``, where they are encoded (with
``layout.RECORD_SEP``). The Lua scripts (``scripts``, ``publish_scripts``, ``admin_scripts``)
spell these formats in their text, each whole; ``tests/unit/test_redis_scripts.py`` checks that
the separators, heads and field names they spell are the ones defined here and in ``layout``.

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
upgrade too. A lock without a deadline (0.1.0's ``<random>@<owner id>``, the only one a release
wrote) is held while its key exists.

What this does not cover: a failover to a replica whose clock is behind the old master's and
that did not receive the keys (the same as for any write the replica did not receive);
deleting keys by hand (``DEL``, the store's ``delete``, ``forget --task --force``; the admin
``forget`` of one key keeps the token in a tombstone); a restart that loses data; and the step
back beyond the bound above (``tests/sim/test_fence_bound.py`` pins both sides of it, and the
simulation's checker asserts every expiry against it).
"""

from __future__ import annotations

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
    RECORD_SEP,
    RECORD_VERSION,
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
from celery_idempotent.core import names as _names
from celery_idempotent.core.names import (
    HEAD_CHARS,
    LOCK_MARK,
    MAX_READABLE_KEY,
    SHORTENED_MARK,
    lock_name,
    record_name,
    slot_key,
)

__all__ = [
    "DEFAULT_SERIALIZER",
    "EXACT_AT",
    "FENCE_MARGIN_MS",
    "HEAD_CHARS",
    "LOCK_SEP",
    "MARKER_CLAIMED",
    "MARKER_QUEUED",
    "MARKER_REQUEUED",
    "MARKER_STATES",
    "MAX_READABLE_KEY",
    "QUEUED_HEAD",
    "RECORD_FIELDS",
    "RECORD_HEAD",
    "RECORD_SEP",
    "RECORD_VERSION",
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
    "parse_lease_token",
    "parse_lock",
    "parse_lock_value",
    "parse_marker",
    "parse_name",
    "parse_queued",
    "queued_value",
    "record_head",
    "record_name",
    "slot_key",
]

_FENCE = ":fence"


def fence_name(lock: str) -> str:
    """The fence key of a lock (any resource name): ``<lock>:fence``, same hash slot."""
    return f"{lock}{_FENCE}"


def parse_name(name: str, prefix: str) -> tuple[str, str] | None:
    """``(kind, slot)`` of a Redis name under ``prefix``, or ``None`` for a foreign name.

    ``kind`` is ``"record"``, ``"lock"`` or ``"fence"``; ``slot`` is the key as it appears
    between the hash-tag braces (the key, or its shortened form).
    """
    if name.startswith(prefix + LOCK_MARK + "{") and name.endswith("}" + _FENCE):
        slot = name[len(prefix) + len(LOCK_MARK) + 1 : -len(_FENCE) - 1]
        if not slot or "{" in slot or "}" in slot:
            return None
        return "fence", slot
    return _names.parse_name(name, prefix)


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
    """A lock's value, parsed. ``deadline_ms`` is ``None`` only for 0.1.0's ``<token>``, the one
    lock value without a deadline a release wrote: such a lock is held while its key exists."""

    deadline_ms: int | None
    fencing_token: int | None
    lease_token: str
    owner: str

    def held(self, now_ms: float) -> bool:
        """Whether the lease is valid at server time ``now_ms`` (a tombstone is not)."""
        return self.deadline_ms is None or self.deadline_ms > now_ms


def _owner(token: str) -> str:
    return token.split("@", 1)[1] if "@" in token else token


def parse_lease_token(token: str) -> tuple[int | None, str]:
    """``(fencing token, owner id)`` of a lease's token: ``<fencing token>/<random>@<owner>``
    (what :class:`Lease` carries and ``READ_KEY`` reports), or 0.1.0's ``<random>@<owner>``,
    which has no fencing token."""
    head, sep, rest = token.partition(LOCK_SEP)
    if sep and head.isdigit():
        return int(head), _owner(rest)
    return None, _owner(token)


def parse_lock(value: str) -> LockState:
    """The fields of a lock's value: ``<deadline ms>/<fencing token>/<token>`` (see
    :func:`lock_entry`), or 0.1.0's ``<token>``.

    Raises ``ValueError`` for a value that starts like the first and is not (no release wrote
    ``<fencing token>/<token>`` into a lock: that is a lease's token, :func:`parse_lease_token`).
    """
    head, sep, rest = value.partition(LOCK_SEP)
    if not (sep and head.isdigit()):
        return LockState(None, None, value, _owner(value))  # 0.1.0
    fence, sep2, token = rest.partition(LOCK_SEP)
    if not (sep2 and fence.isdigit()):
        raise ValueError(
            f"not a lock value: {value!r} (expected <deadline ms>{LOCK_SEP}<fencing token>"
            f"{LOCK_SEP}<token>, or 0.1.0's <token>)"
        )
    return LockState(int(head), int(fence), rest, _owner(token))


def parse_lock_value(value: str) -> tuple[int | None, str]:
    """``(fencing token, owner id)`` of a lock's value or of a lease's token (three fields
    are a lock's value, see :func:`parse_lock`; otherwise :func:`parse_lease_token`)."""
    head, sep, rest = value.partition(LOCK_SEP)
    fence, sep2, _ = rest.partition(LOCK_SEP)
    if sep and head.isdigit() and sep2 and fence.isdigit():
        state = parse_lock(value)
        return state.fencing_token, state.owner
    return parse_lease_token(value)
