"""The keyspace every backend shares: how an idempotency key is spelled.

``IdempotentTask`` builds task keys with :func:`task_key`, the command line parses them back with
:func:`parse_task_key`, and a periodic task scopes its key to a schedule window with
:func:`slot_for` and :func:`with_slot`. What a backend stores a key under is the backend's:
the names every shipped backend uses are in ``celery_idempotent.core.names``, and what Redis
adds (the fence key, the lock's value, the record's encoding) in
``celery_idempotent.backends.redis.keyspace`` and ``layout``.

Task keys
---------
``<namespace>:<kind>:<value>``, where the namespace is the task's name and ``kind`` is
``args`` (value: the sha256 of the bound arguments), ``id`` (the task id) or ``key`` (an
explicit or formatted key). The earliest kind marker wins when parsing: an explicit key may
itself contain ``:key:``.
"""

from __future__ import annotations

import math

__all__ = [
    "KINDS",
    "KIND_MARKERS",
    "SLOT_SEP",
    "parse_task_key",
    "slot_for",
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
