"""What a guarded call gives back and reports, and the lease the running body is under.

:class:`Outcome` is what :meth:`DistributedIdempotencyGuard.run
<celery_idempotent.core.guard.DistributedIdempotencyGuard.run>` returns, :class:`GuardEvent` what
it reports to ``on_event``; :func:`current_lease` is readable from inside the body (and from
:func:`celery_idempotent.current_connection`), set by the guard with :func:`running_under`;
:func:`require_lease` is the same lease, typed without ``None``, for code that only runs in a
guarded body.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from celery_idempotent.core.protocols import Lease

__all__ = ["ABSENT", "GuardEvent", "Outcome", "current_lease", "require_lease", "running_under"]

T = TypeVar("T")


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


#: The default of ``input``: no payload given, so no fingerprint is stored or compared.
ABSENT: Any = _Absent()

_current_lease: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_idempotent_lease", default=None
)


def current_lease() -> Lease | None:
    """The lease under which the current guarded body runs, or ``None`` outside of one (a
    direct call of the task's function, a test): use it to ask whether code runs guarded.

    In a body, :func:`require_lease` gives the same lease typed as a :class:`Lease`, so
    ``require_lease().fencing_token`` type-checks without a ``None`` test.
    """
    return _current_lease.get()


def require_lease() -> Lease:
    """The lease under which the current guarded body runs.

    Pass ``require_lease().fencing_token`` to a downstream system that can refuse writes
    carrying a token older than one it has already seen: a body whose lease expired (a
    stalled worker) is then stopped at the door even if it keeps running.

    :raises RuntimeError: outside a guarded body (no lease to fence with): a direct call
        ``task(...)`` of an ``IdempotentTask``, which runs the function plainly, or code that
        the guard did not call. :func:`current_lease` returns ``None`` there instead.
    """
    lease = _current_lease.get()
    if lease is None:
        raise RuntimeError(
            "require_lease() was called outside a guarded body: there is no lease (a direct "
            "call task(...) runs the function without the guard; use .delay(), .apply() or "
            "DistributedIdempotencyGuard.run, or current_lease() to test for None)"
        )
    return lease


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What :meth:`DistributedIdempotencyGuard.run` did: ``value`` came from the store when
    ``replayed``, else from running the body; ``fencing_token`` is the lease's (first run) or
    the stored record's (replay); ``attempts`` counts lock attempts."""

    value: T
    replayed: bool
    fencing_token: int | None
    attempts: int


@dataclass(frozen=True)
class GuardEvent:
    """Reported to ``on_event``: ``kind`` is ``"replay"``, ``"contention"`` (an attempt found
    the key held), ``"committed"`` or ``"lease_lost"``; ``elapsed`` is seconds since execute
    began (guard clock)."""

    kind: str
    key: str
    attempt: int
    elapsed: float
    fencing_token: int | None = None


class running_under:
    """Make ``lease`` the :func:`current_lease` of the block (the guarded body). A class, not
    a generator: it is on the hot path of every guarded call."""

    __slots__ = ("_lease", "_token")

    def __init__(self, lease: Lease) -> None:
        self._lease = lease

    def __enter__(self) -> None:
        self._token = _current_lease.set(self._lease)

    def __exit__(self, *exc_info: object) -> None:
        _current_lease.reset(self._token)
