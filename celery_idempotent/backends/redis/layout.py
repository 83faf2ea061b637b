"""The record of layout v2 and its neighbours under the record's name: how each is spelled.

``celery_idempotent.backends.redis.keyspace`` owns the Redis names and re-exports these. The Lua
scripts spell the record heads, :data:`RECORD_SEP` and the v1 field list in their text;
``tests/unit/test_redis_scripts.py`` checks them against the constants here.

The record (layout v2)
----------------------
One string, ``|``-separated, the payload last so that it may hold any byte::

    2|<fencing token>|<created at>|<serializer>|<fingerprint>|<task id>|<payload>

``2`` is the layout version (and says "completed"). ``created at`` is the guard clock's time
of the commit; the guard stamps whole µs, written as their difference from the fencing token
(itself server µs, so the difference is small; without a fencing token, in full); any other
float is written exactly, as ``~`` and its ``repr``. The serializer is kombu's
name for the codec the payload was written with (empty for ``json``), which gives its content
type and encoding. A fingerprint that the record's own name ends with (keys made from the
arguments: ``<task>:args:<fingerprint>``) is written ``=<its length>``. Absent values are
empty. A string costs Redis one allocation where a hash of seven fields costs a listpack, or a
dict of seven entries once any value passes 64 bytes; these abbreviations keep a completed key
at or below the bytes Powertools' Redis layer spends on one (see the benchmarks).

Before its body has run, a call published through ``apply_async`` leaves a **queued marker**
under the record's name (issue 12): ``q|<task id>|<fingerprint>|<published at>|<state>``, with
``PX`` = ``idempotency_publish_ttl``; ``published at`` is the server's clock in ms, ``state``
one of :data:`MARKER_STATES` (issue 22, SPEC §8: one life cycle):

- ``q``: published, no delivery has claimed the key yet;
- ``c``: a delivery claimed the key over it (the claim sets the state, keeping the TTL). From
  then on the marker lives only as long as that delivery's lease: a claimed marker whose lock
  holds no valid lease (released without a commit, or run out: a killed worker) stands for
  nothing, and the publish side, the admin and the claim treat the key as free;
- ``r``: claimed, then its message went back to the queue (``self.retry()`` published,
  ``Reject(requeue=True)``): queued again, for ``idempotency_publish_ttl``.

The commit replaces the marker with the record in the same ``SET``; a body that fails for good
deletes it; a lost message lets it expire. So a key is, under its one record name: absent,
queued, completed. ``q|<task id>|<fingerprint>`` (written before issue 22) reads as state
``q`` with no publish time.

Layout v1 (0.1.0) kept the record as a hash with the fields of :data:`V1_RECORD_FIELDS` and a
fence key for 7 days after every acquisition. A v1 record is still read (the scripts look for
a hash where they expect a string) and replayed; a held v1 lock (``<random>@<owner id>``) is a
lock held by someone else; a v1 fence key floors the next token like a v2 one.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "DEFAULT_SERIALIZER",
    "EXACT_AT",
    "MARKER_CLAIMED",
    "MARKER_QUEUED",
    "MARKER_REQUEUED",
    "MARKER_STATES",
    "QUEUED_HEAD",
    "RECORD_FIELDS",
    "RECORD_HEAD",
    "RECORD_SEP",
    "RECORD_VERSION",
    "V1_RECORD_FIELDS",
    "V1_VERSION",
    "DecodedRecord",
    "Marker",
    "can_mark",
    "decode_record",
    "decode_v1_record",
    "encode_record",
    "lua_list",
    "parse_marker",
    "parse_queued",
    "queued_value",
    "record_head",
]

# --------------------------------------------------------------------------- the record

RECORD_VERSION = "2"
#: The record's fields, in their order in the string; the payload is last.
RECORD_FIELDS = ("version", "fence", "at", "serializer", "fingerprint", "task_id", "data")
RECORD_SEP = "|"
_RECORD_SEP_B = RECORD_SEP.encode()
#: A completed v2 record starts with this; the scripts test it.
RECORD_HEAD = RECORD_VERSION + RECORD_SEP
#: Layout v1 (0.1.0): a hash with these fields (v: "1"; ct, enc: content type and encoding;
#: data; fp: fingerprint; at: created at; fence: fencing token).
V1_RECORD_FIELDS = ("v", "ct", "enc", "data", "fp", "at", "fence")
V1_VERSION = "1"


def lua_list(names: tuple[str, ...]) -> str:
    """``'a', 'b'``: names as Lua string literals, as the scripts spell a field list."""
    return ", ".join("'" + name + "'" for name in names)


class DecodedRecord(NamedTuple):
    """A record's fields as stored (text), the payload as bytes; ``None`` for absent."""

    fencing_token: int | None
    created_at: float
    serializer: str | None
    content_type: str | None
    encoding: str | None
    fingerprint: str | None
    task_id: str | None
    data: bytes
    version: str


def _clean(value: str | None, what: str) -> str:
    if value is None:
        return ""
    if RECORD_SEP in value:
        raise ValueError(f"{what} must not contain {RECORD_SEP!r}: {value!r}")
    return value


#: Marks a created-at written in full (``repr`` of the float), not as whole µs.
EXACT_AT = "~"
#: The serializer an empty serializer field stands for.
DEFAULT_SERIALIZER = "json"


def encode_record(
    *,
    name: str,
    fencing_token: int | None,
    created_at: float,
    serializer: str,
    fingerprint: str | None,
    task_id: str | None,
    data: bytes,
) -> bytes:
    """The v2 record string stored under ``name`` (see the module docstring). A task id
    holding ``|`` is dropped."""
    tid = "" if task_id is None or RECORD_SEP in task_id else task_id
    stamp = float(created_at)
    micros = round(stamp * 1_000_000)
    if micros / 1_000_000 == stamp:  # a whole number of µs (the guard stamps those)
        at = str(micros - int(fencing_token or 0))
    else:  # anything else, exactly
        at = EXACT_AT + repr(stamp)
    fp = _clean(fingerprint, "fingerprint")
    if fp and name.endswith(fp + "}"):
        fp = f"={len(fp)}"
    head = RECORD_SEP.join(
        (
            RECORD_VERSION,
            "" if fencing_token is None else str(int(fencing_token)),
            at,
            "" if serializer == DEFAULT_SERIALIZER else _clean(serializer, "serializer"),
            fp,
            tid,
            "",
        )
    )
    return head.encode("utf-8", "surrogatepass") + data


def record_head(fencing_token: int) -> str:
    """How a v2 record committed under ``fencing_token`` starts (a resent commit finds it)."""
    return f"{RECORD_HEAD}{int(fencing_token)}{RECORD_SEP}"


def decode_record(value: bytes, name: str | None = None) -> DecodedRecord:
    """The fields of a v2 record string stored under ``name`` (needed only to spell out a
    fingerprint abbreviated as ``=<length>``); ``ValueError`` when it is not one."""
    parts = value.split(_RECORD_SEP_B, len(RECORD_FIELDS) - 1)
    if len(parts) != len(RECORD_FIELDS) or parts[0] != RECORD_VERSION.encode():
        raise ValueError("not a layout-v2 record")
    _, fence_b, at_b, ser, fp_b, tid, data = parts
    fence = int(fence_b) if fence_b else None
    at_text = at_b.decode()
    if at_text.startswith(EXACT_AT):
        created_at = float(at_text[len(EXACT_AT) :])
    else:
        created_at = (int(at_text) + (fence or 0)) / 1_000_000
    fp = fp_b.decode("utf-8", "surrogatepass")
    if fp.startswith("="):
        length = int(fp[1:])
        if name is None or not name.endswith("}") or len(name) < length + 1:
            raise ValueError("the fingerprint is in the record's name, which was not given")
        fp = name[-1 - length : -1]
    return DecodedRecord(
        fencing_token=fence,
        created_at=created_at,
        serializer=ser.decode() or DEFAULT_SERIALIZER,
        content_type=None,
        encoding=None,
        fingerprint=fp or None,
        task_id=tid.decode("utf-8", "surrogatepass") or None,
        data=data,
        version=RECORD_VERSION,
    )


#: A queued marker starts with this; the scripts test it.
QUEUED_HEAD = "q" + RECORD_SEP


def can_mark(task_id: str) -> bool:
    """Whether a queued marker can name ``task_id`` (it must not contain the separator)."""
    return bool(task_id) and RECORD_SEP not in task_id


#: A queued marker's state: published, no delivery claimed it yet.
MARKER_QUEUED = "q"
#: A delivery claimed the key over the marker: it lives only while that delivery's lease does.
MARKER_CLAIMED = "c"
#: Claimed, then the message went back to the queue (a published retry, a requeue).
MARKER_REQUEUED = "r"
#: Every state a queued marker can be in (its last field).
MARKER_STATES = (MARKER_QUEUED, MARKER_CLAIMED, MARKER_REQUEUED)


class Marker(NamedTuple):
    """A queued marker, parsed (see the module docstring)."""

    task_id: str
    fingerprint: str | None
    #: When the call was published, server ms (``None``: a marker from before issue 22).
    published_ms: int | None
    #: One of :data:`MARKER_STATES`.
    state: str

    @property
    def ever_claimed(self) -> bool:
        """Whether a delivery has claimed the key over this marker."""
        return self.state != MARKER_QUEUED


def queued_value(
    task_id: str,
    fingerprint: str | None,
    published_ms: int | None = None,
    state: str = MARKER_QUEUED,
) -> str:
    """The queued marker of a call published as ``task_id`` (see :func:`can_mark`); the
    publish script writes it, with the server's clock."""
    if not can_mark(task_id):
        raise ValueError(f"a queued marker cannot name task id {task_id!r}")
    if state not in MARKER_STATES:
        raise ValueError(f"a queued marker's state is one of {MARKER_STATES}, got {state!r}")
    fp = _clean(fingerprint, "fingerprint")
    fields = (task_id, fp, str(int(published_ms or 0)), state)
    return QUEUED_HEAD + RECORD_SEP.join(fields)


def parse_marker(value: bytes | str) -> Marker | None:
    """The fields of a queued marker, or ``None`` when ``value`` is not one."""
    if isinstance(value, bytes):
        if not value.startswith(QUEUED_HEAD.encode()):
            return None
        value = value.decode("utf-8", "surrogatepass")
    text = value
    if not text.startswith(QUEUED_HEAD):
        return None
    task_id, _, rest = text[len(QUEUED_HEAD) :].partition(RECORD_SEP)
    fields = rest.split(RECORD_SEP)
    fingerprint = fields[0] or None
    if len(fields) >= 3 and fields[-1] in MARKER_STATES:
        published = int(fields[1]) if fields[1].isdigit() and int(fields[1]) > 0 else None
        return Marker(task_id, fingerprint, published, fields[-1])
    return Marker(task_id, fingerprint, None, MARKER_QUEUED)


def parse_queued(value: bytes | str) -> tuple[str, str | None] | None:
    """``(task id, fingerprint)`` of a queued marker, or ``None`` when ``value`` is not one."""
    marker = parse_marker(value)
    return None if marker is None else (marker.task_id, marker.fingerprint)


def decode_v1_record(values: list[bytes | str | None]) -> DecodedRecord:
    """The fields of a v1 record hash (values of :data:`V1_RECORD_FIELDS`); ValueError."""
    if len(values) != len(V1_RECORD_FIELDS) or any(v is None for v in values):
        raise ValueError("stored record is incomplete or not ours")
    text = [v.decode("utf-8") if isinstance(v, bytes) else v for v in values[:3]]
    version, ctype, encoding = text
    if version != V1_VERSION:
        raise ValueError(f"unknown record version {version!r}")
    data, fp, at, fence = values[3:]
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fp_t = fp.decode("utf-8") if isinstance(fp, bytes) else fp
    at_t = at.decode("utf-8") if isinstance(at, bytes) else at
    fence_t = fence.decode("utf-8") if isinstance(fence, bytes) else fence
    return DecodedRecord(
        fencing_token=int(fence_t) if fence_t else None,
        created_at=float(at_t or "nan"),
        serializer=None,
        content_type=ctype,
        encoding=encoding,
        fingerprint=fp_t or None,
        task_id=None,
        data=raw or b"",
        version=V1_VERSION,
    )
