"""Walking a prefix's names with SCAN (``forget --task``, ``forget --all``, ``stats``, and
:func:`celery_idempotent.admin.forget_all`): counted, sampled or deleted in pipelined batches,
each name checked exactly against the task it should belong to."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from celery_idempotent.backends.redis import admin_scripts as redis_admin_scripts
from celery_idempotent.backends.redis import client as redis_client
from celery_idempotent.backends.redis import scripts as redis_scripts
from celery_idempotent.backends.redis.keyspace import HEAD_CHARS, SHORTENED_MARK, parse_name
from celery_idempotent.keyspace import task_of_slot

__all__ = [
    "SAMPLE",
    "KeySpace",
    "Progress",
    "Scan",
    "count_task",
    "decode_name",
    "delete_task",
    "scan_names",
    "tagged_task",
]

#: How many names a count samples (a dry run lists them).
SAMPLE = 10
#: A progress line's sink (the CLI's stderr), or ``None``: silent.
Progress = Callable[[str], None]


class KeySpace(Protocol):
    """Where the names are: a redis-py client and the key prefix."""

    @property
    def client(self) -> Any: ...

    @property
    def prefix(self) -> str: ...


def tagged_task(task: str) -> str:
    """How ``task`` appears in slots: braces become parentheses (such keys are shortened)."""
    return task.replace("{", "(").replace("}", ")")


def _scan_pattern(prefix: str, task: str | None) -> str:
    """SCAN MATCH for every name under ``prefix``, or for ``task``'s records and locks.

    ``<prefix>*{<task>:*`` with prefix and task glob-escaped: one walk of the keyspace finds
    ``<prefix>{...}`` and ``<prefix>lock:{...}``; callers check each name exactly. For a task
    name of 64 characters or more, the pattern holds only the part that survives shortening.
    """
    if task is None:
        return redis_client.glob_escape(prefix) + "*"
    head = ("{" + tagged_task(task) + ":")[: HEAD_CHARS + 1]
    return redis_client.glob_escape(prefix) + "*" + redis_client.glob_escape(head) + "*"


def decode_name(name: Any) -> str:
    return name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else str(name)


@dataclass
class Scan:
    """What a scan found (or deleted)."""

    records: int = 0
    locks: int = 0
    fences: int = 0
    #: Names under the prefix that are not records, locks or fences.
    other: int = 0
    #: Shortened names that may belong to the task but cannot be told apart.
    unattributed: int = 0
    scanned: int = 0
    sample: list[str] = field(default_factory=list)


def scan_names(
    space: KeySpace,
    task: str | None,
    batch_size: int,
    scan: Scan,
    *,
    fences: bool = False,
) -> Iterator[tuple[str, str, bytes]]:
    """``(kind, task, raw name)`` of every record and lock (and fence, with ``fences``)
    under the prefix, or of ``task``'s only: SCAN in batches (see :func:`_scan_pattern`),
    each name then checked exactly.

    ``kind`` is ``"record"``, ``"lock"`` (a held one: the tombstone a lease leaves when it
    ends is skipped, it expires by itself) or ``"fence"``; the task is ``"(shortened)"`` for a
    shortened key whose head ends before the end of its kind marker (counted in
    ``scan.unattributed``, and never yielded for a ``task``), ``"(no task)"`` for a key that is
    not task-namespaced (a guard used directly).
    """
    tagged = None if task is None else tagged_task(task)
    pattern = _scan_pattern(space.prefix, task)
    holder = space.client.register_script(redis_scripts.HOLDER)
    for raw in space.client.scan_iter(match=pattern, count=batch_size):
        scan.scanned += 1
        parsed = parse_name(decode_name(raw), space.prefix)
        if parsed is None:
            scan.other += 1
            continue
        kind, slot = parsed
        if kind == "fence" and not fences:
            continue
        owner = task_of_slot(slot)
        shortened = SHORTENED_MARK in slot
        if owner is None and shortened:
            # A shortened name is a task's only when its head holds the whole namespace and
            # kind marker (``<task>:<kind>:``). A head that ends inside them (``<task>:ke``,
            # or ``<task>:v2:ar`` of a task named ``<task>:v2``) may be another task's: it is
            # counted as unattributed and left alone (issue 22).
            scan.unattributed += 1
            if tagged is not None:
                continue
        if tagged is not None and owner != tagged:
            continue
        if kind == "lock" and holder(keys=[raw]) is None:
            continue  # a lease that has ended: a tombstone that keeps its fencing token a while
        yield kind, owner or ("(shortened)" if shortened else "(no task)"), raw


def count_task(
    space: KeySpace,
    task: str,
    batch_size: int,
    force: bool,
    fences: bool = False,
    *,
    progress: Progress | None = None,
) -> Scan:
    """Count a task's records and held locks (and fences); SCAN may count a key twice while
    Redis resizes its table; the deletion that follows counts exactly."""
    found = Scan()
    names = scan_names(space, task, batch_size, found, fences=fences)
    for matched, (kind, _, raw) in enumerate(names, 1):
        if kind == "record":
            found.records += 1
        elif kind == "fence":
            found.fences += 1
            continue  # not sampled: a fence is not what a user forgets
        else:
            found.locks += 1
        if len(found.sample) < SAMPLE and (force or kind == "record"):
            found.sample.append(decode_name(raw))
        if progress is not None and matched % batch_size == 0:
            progress(f"counting: {matched} key(s) of {task} so far")
    return found


def delete_task(
    space: KeySpace,
    task: str,
    batch_size: int,
    force: bool,
    fences: bool = False,
    *,
    progress: Progress | None = None,
) -> Scan:
    """Delete a task's records (with ``force`` its held locks, with ``fences`` its fences)
    in pipelined batches."""
    done = Scan()
    batch: list[tuple[str, bytes]] = []
    batches = 0

    drop_fence = space.client.register_script(redis_admin_scripts.DROP_FENCE)

    def flush() -> None:
        nonlocal batches
        # One DEL per name: on a cluster the names live in different slots. A fence key is
        # deleted by a script of its own, only once the server clock has passed it (fence
        # keys are rare in layout v2: 0.1.0's, or a token ahead of a clock that stepped back).
        pipe = space.client.pipeline(transaction=False)
        for kind, raw in batch:
            if kind != "fence":
                pipe.delete(raw)
        replies = iter(pipe.execute())
        results = [
            drop_fence(keys=[raw]) if kind == "fence" else next(replies) for kind, raw in batch
        ]
        for (kind, _), gone in zip(batch, results):
            if gone and kind == "record":
                done.records += 1
            elif gone and kind == "fence":
                done.fences += 1
            elif gone:
                done.locks += 1
        batch.clear()
        batches += 1

    for kind, _, raw in scan_names(space, task, batch_size, done, fences=fences):
        if kind == "lock" and not force:
            continue
        batch.append((kind, raw))
        if len(batch) >= batch_size:
            flush()
            if progress is not None:
                progress(
                    f"deleting: batch {batches}, {done.records + done.locks + done.fences} "
                    f"key(s) deleted ({done.scanned} scanned)"
                )
    if batch:
        flush()
    return done
