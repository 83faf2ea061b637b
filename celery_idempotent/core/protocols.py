"""The shapes a backend implements: a lock provider, a store, and optionally both at once.

A user's own backend (SQL, DynamoDB, ...) needs no base class: implementing the methods of
:class:`LockProvider` and :class:`IdempotencyStore` is enough. The guard keeps every other
rule (retries, renewal, fencing checks, mismatch detection) to itself.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from celery_idempotent.core.states import KeyState

__all__ = [
    "AtomicBackend",
    "ChecksPublishes",
    "ChecksPublishesUntil",
    "Claim",
    "EndsMarkerAtClaim",
    "IdempotencyRecord",
    "IdempotencyStore",
    "InspectsKeys",
    "KeepsClaimedMarkers",
    "Lease",
    "LockProvider",
    "PairsAtomically",
    "PublishDecision",
    "check_implements",
    "required_methods",
]


@dataclass(frozen=True)
class Lease:
    """Proof of one acquisition of a lock.

    ``token`` is unique per acquisition: only the lease that carries it may extend or release
    the lock. ``fencing_token`` strictly increases across the successive holders of a resource,
    so a downstream system can refuse a write that carries an older token than one it has seen.
    """

    resource: str
    token: str
    fencing_token: int


@dataclass(frozen=True)
class IdempotencyRecord:
    """A committed result.

    ``fingerprint`` is the payload fingerprint of the call that produced it (``None`` when that
    call gave no ``input``), ``created_at`` the guard clock's time of the commit,
    ``fencing_token`` the token of the lease under which it was committed, and ``task_id``
    the id of the Celery task whose body produced it (``None`` outside Celery).
    """

    result: Any
    fingerprint: str | None
    created_at: float
    fencing_token: int | None = None
    task_id: str | None = None


class Claim(NamedTuple):
    """What an :class:`AtomicBackend` claim found: a new lease, a stored record, or neither.

    Neither means the lock is held by someone else.
    """

    lease: Lease | None
    record: IdempotencyRecord | None


@runtime_checkable
class LockProvider(Protocol):
    """A lock whose holders prove ownership with a token.

    All methods are safe to call from several threads at once. The guard calls only these
    three. A provider may also offer ``is_locked(resource) -> bool`` (whether anyone holds
    ``resource`` now): ``idempotency_status`` and the testing plugin's ``is_locked`` use it
    when it is there, as the bundled providers do.
    """

    def acquire(self, resource: str, ttl: float) -> Lease | None:
        """Take the lock for ``ttl`` seconds, or return ``None`` when another holder has it."""

    def extend(self, lease: Lease, ttl: float) -> bool:
        """Reset the lease's time left to ``ttl`` seconds; ``False`` when it is no longer ours."""

    def release(self, lease: Lease) -> bool:
        """Release the lock if ``lease`` still holds it; ``False`` when it is no longer ours."""


@runtime_checkable
class IdempotencyStore(Protocol):
    """Where committed results live, each with a time to live."""

    def get(self, key: str) -> IdempotencyRecord | None:
        """The unexpired record stored under ``key``, or ``None``."""

    def set(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        """Store ``record`` under ``key`` for ``ttl`` seconds."""

    def delete(self, key: str) -> bool:
        """Remove the record; ``True`` when there was one."""


class PublishDecision(NamedTuple):
    """What a store's ``check_publish`` decided (see :class:`ChecksPublishes`).

    ``action``: ``"publish"`` (the marker is set, or the check could not decide: ``unchecked``),
    ``"completed"`` (``record`` holds the stored result), ``"queued"`` (queued or running as
    ``task_id``) or ``"mismatch"`` (queued or running with ``stored_fingerprint``).
    ``state`` says which :class:`~celery_idempotent.KeyState` stopped the publish:
    ``COMPLETED``, ``QUEUED`` or ``RUNNING`` (``None``: the store does not tell queued from
    running), ``ttl_left`` the seconds the record or the queued marker has left (``None``: not
    known).
    """

    action: str
    task_id: str | None = None
    record: IdempotencyRecord | None = None
    stored_fingerprint: str | None = None
    unchecked: bool = False
    state: KeyState | None = None
    ttl_left: float | None = None


@runtime_checkable
class ChecksPublishes(Protocol):
    """A store that can stop a duplicate at publish (``apply_async``): the capability the
    publish side asks for (the Redis store and the PostgreSQL backend have it; a store
    without it leaves every publish to the run-time guard).

    ``check_publish`` decides in one round trip whether the call is published: the key's
    ``record`` name is completed (its record), queued or running under another task id (that
    id, or a mismatch of fingerprints), or free, in which case it sets a "queued" marker
    naming ``task_id`` that lives ``publish_ttl`` seconds (until a delivery commits a record
    over it or :meth:`drop_queued` removes it). ``lock`` is the key's lock resource. A check
    that cannot decide says "publish" with ``unchecked=True`` (the guard decides at run time).
    A store may also offer ``checks_publishes() -> bool``: ``False`` withdraws the capability
    (a subclass whose backend cannot make the check).
    """

    def check_publish(
        self, record: str, lock: str, task_id: str, fingerprint: str | None, publish_ttl: float
    ) -> PublishDecision:
        """Decide a publish of ``task_id`` (see the class docstring)."""

    def drop_queued(self, record: str, task_id: str) -> bool:
        """Remove ``task_id``'s queued marker of ``record``; ``False`` when it is not there."""


@runtime_checkable
class ChecksPublishesUntil(Protocol):
    """A store whose publish check can also stop a duplicate only while its call is queued
    (``idempotency_publish_until="started"``): the capability that setting needs (the Redis
    store has it; a task with that setting over a store without it is refused at publish).

    ``check_publish_until`` is :meth:`ChecksPublishes.check_publish` with ``until``, the
    setting's value: ``"completed"`` decides as ``check_publish`` does; ``"started"`` lets a
    publish through once the queued call's delivery has claimed the key. The claim that ends
    the marker is the backend's (:class:`EndsMarkerAtClaim`), or the delivery's as its body
    starts when the lock and the store claim apart.
    """

    def check_publish_until(
        self,
        record: str,
        lock: str,
        task_id: str,
        fingerprint: str | None,
        publish_ttl: float,
        *,
        until: str,
    ) -> PublishDecision:
        """Decide a publish of ``task_id`` as ``idempotency_publish_until=until`` says."""


@runtime_checkable
class KeepsClaimedMarkers(Protocol):
    """A store whose queued marker, once a delivery claimed it, lives as long as that
    delivery's lease (the Redis store): a discarded message (revoked, expired) ends its
    marker with :meth:`drop_unclaimed`, which keeps one that a live delivery holds. A store
    without it ends the marker with ``drop_queued`` (PostgreSQL: the row the running body
    holds is not touched by it)."""

    def drop_unclaimed(self, record: str, lock: str, task_id: str) -> bool:
        """Remove ``task_id``'s queued marker of ``record`` unless a delivery that claimed it
        still holds a valid lease on ``lock``; ``False`` when nothing was removed."""


@runtime_checkable
class EndsMarkerAtClaim(Protocol):
    """An :class:`AtomicBackend` whose claim can end a call's queued marker in the step that
    takes the lock (``idempotency_publish_until="started"``: the call has started). The Redis
    pair has it (the ``CLAIM`` script)."""

    def ending_marker(self, task_id: str) -> AbstractContextManager[None]:
        """Within the block, a claim in this context that takes the lock also ends
        ``task_id``'s queued marker, in the same step."""


@runtime_checkable
class InspectsKeys(Protocol):
    """A store whose keys the admin layer (:mod:`celery_idempotent.admin`) reads straight
    from its server, every name of a key in one round trip, and forgets with a script that
    compares the lease it read (the Redis store). Other stores are read and forgotten through
    the guard's protocols (``admin.status_from_guard``)."""

    def key_client(self) -> Any:
        """The client the admin layer reads and deletes this store's keys with."""


class AtomicBackend(Protocol):
    """A lock provider and a store that can decide in one step (one Redis round trip).

    A store offers it through ``store.atomic_with(lock_provider)`` when it shares the lock
    provider's server. The semantics are those of the separate calls, lock first, then store:

    - ``claim``: if the lock is free and a record exists, return the record (no lease taken);
      if the lock is free and no record exists, take the lock; if the lock is held, neither.
    - ``commit``: store the record and release the lock, only while ``lease`` still holds it;
      ``False`` (and nothing written) otherwise. ``ttl == 0`` (``idempotency_ttl=0``) stores
      nothing: the commit proves the lease and releases the lock, so the key is free at once
      (the next claim runs the body again); a resend after a lost reply still reports ``True``.
    """

    def claim(self, resource: str, key: str, ttl: float) -> Claim: ...

    def commit(self, lease: Lease, key: str, record: IdempotencyRecord, ttl: float) -> bool: ...


@runtime_checkable
class PairsAtomically(Protocol):
    """A store that can offer an :class:`AtomicBackend` for a lock provider it shares a server
    with (``None`` when it cannot: another server, another kind of provider). The guard then
    claims and commits through that one backend."""

    def atomic_with(self, lock_provider: Any) -> AtomicBackend | None:
        """The atomic backend of this store and ``lock_provider``, or ``None``."""


def required_methods(protocol: type) -> tuple[str, ...]:
    """The methods ``protocol`` declares, in declaration order (what the guard checks for)."""
    return tuple(
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and callable(value)
    )


def check_implements(name: str, obj: Any, protocol: type) -> None:
    """Raise ``TypeError`` unless ``obj`` (the argument ``name``) has every method of
    ``protocol`` (no base class needed: the methods are what counts)."""
    methods = required_methods(protocol)
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(
            f"{name} must implement {', '.join(methods)}; "
            f"{type(obj).__name__} lacks {', '.join(missing)}"
        )
