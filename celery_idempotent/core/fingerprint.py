"""Payload fingerprints (the names of a key's lock and record live in ``core.names``).

``fingerprint_payload`` hashes a canonical encoding of what Celery users pass as arguments, so
the same payload gives the same fingerprint in any process, on any Python version, in any dict
order; anything it cannot encode canonically is refused with a ``TypeError`` naming the type
(``str(obj)`` would silently collide: two objects with the same ``repr`` are not the same
payload).
"""

from __future__ import annotations

import datetime as _dt
import enum
import hashlib
import math
import uuid
from decimal import Decimal
from typing import Any

from celery_idempotent.core import names

__all__ = [
    "KeyLabel",
    "fingerprint_payload",
    "key_digest",
    "lock_resource",
    "record_key",
    "slot_key",
]

MAX_READABLE_KEY = names.MAX_READABLE_KEY


def fingerprint_payload(payload: Any) -> str:
    """The sha256 (hex) of ``payload``'s canonical encoding.

    Accepted: ``str``, ``int``, ``float``, ``bool``, ``None``, ``list``, ``tuple``, ``dict``,
    ``uuid.UUID``, ``decimal.Decimal``, ``datetime.datetime``, ``datetime.date``, ``enum.Enum``
    and ``bytes``, nested in any way. Canonical means: dict keys in any order hash alike; a
    tuple hashes like a list (JSON turns one into the other); a float with an integral value
    hashes like the int (``10.0`` and ``10``); ``Decimal('1.50')`` like ``Decimal('1.5')``; an
    aware datetime like the same instant in UTC. ``True`` is not ``1``, and ``"1"`` is not ``1``.

    Raises ``TypeError`` naming the type of the first value it cannot encode, and ``ValueError``
    for a container that contains itself.
    """
    out: list[bytes] = []
    _encode(payload, out, set())
    return hashlib.sha256(b"".join(out)).hexdigest()


def _text(tag: bytes, text: str, out: list[bytes]) -> None:
    data = text.encode("utf-8", "surrogatepass")
    out.append(b"%s%d:%s" % (tag, len(data), data))


def _encode(obj: Any, out: list[bytes], active: set[int]) -> None:
    # Order matters: bool before int, Enum before str and int (IntEnum, StrEnum), datetime
    # before date (a datetime is a date).
    t = type(obj)
    if obj is None:
        out.append(b"N")
    elif obj is True:
        out.append(b"T")
    elif obj is False:
        out.append(b"F")
    elif t is str:
        _text(b"s", obj, out)
    elif t is int:
        out.append(b"i%d;" % obj)
    elif isinstance(obj, enum.Enum):
        _text(b"e", f"{t.__module__}.{t.__qualname__}", out)
        _encode(obj.value, out, active)
    elif isinstance(obj, float):
        if math.isfinite(obj) and obj.is_integer():
            out.append(b"i%d;" % int(obj))
        else:
            _text(b"f", repr(float(obj)), out)
    elif isinstance(obj, (list, tuple, dict)):
        ident = id(obj)
        if ident in active:
            raise ValueError(f"cannot fingerprint a {t.__name__} that contains itself")
        active.add(ident)
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                kb: list[bytes] = []
                _encode(k, kb, active)
                vb: list[bytes] = []
                _encode(v, vb, active)
                items.append((b"".join(kb), b"".join(vb)))
            items.sort()
            out.append(b"{%d:" % len(items))
            for kbytes, vbytes in items:
                out.append(kbytes)
                out.append(vbytes)
            out.append(b"}")
        else:
            out.append(b"[%d:" % len(obj))
            for item in obj:
                _encode(item, out, active)
            out.append(b"]")
        active.discard(ident)
    elif isinstance(obj, str):
        _text(b"s", str(obj), out)
    elif isinstance(obj, int):
        out.append(b"i%d;" % int(obj))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        out.append(b"b%d:%s" % (len(data), data))
    elif isinstance(obj, uuid.UUID):
        _text(b"u", str(obj), out)
    elif isinstance(obj, Decimal):
        if obj.is_finite():
            value = obj.normalize()
            # normalize() gives 1E+1 for 10; render it without exponent when integral.
            text = format(value, "f") if value == value.to_integral_value() else str(value)
        else:
            text = str(obj)
        _text(b"d", text, out)
    elif isinstance(obj, _dt.datetime):
        if obj.tzinfo is not None and obj.utcoffset() is not None:
            _text(b"z", obj.astimezone(_dt.timezone.utc).replace(tzinfo=None).isoformat(), out)
        else:
            _text(b"t", obj.isoformat(), out)
    elif isinstance(obj, _dt.date):
        _text(b"D", obj.isoformat(), out)
    else:
        raise TypeError(
            f"cannot fingerprint a value of type {t.__module__}.{t.__qualname__}: "
            "pass str, int, float, bool, None, list, tuple, dict, UUID, Decimal, datetime, "
            "date, Enum or bytes, or give the guard a fingerprint_fn of your own"
        )


def key_digest(key: str) -> str:
    """A short hash of ``key`` for log lines: keys built from arguments may hold personal data,
    and logs must never carry argument values."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class KeyLabel:
    """``key #<key_digest(key)>`` for a log line, worked out only when the line is written
    (the lease keeper keeps one per running body, and almost never logs it)."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __str__(self) -> str:
        return f"key #{key_digest(self.key)}"


# The names are spelled in celery_idempotent.core.names; these stay importable from here, as in
# 0.1.0.
slot_key = names.slot_key
lock_resource = names.lock_name
record_key = names.record_name
