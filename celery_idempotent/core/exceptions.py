"""The exceptions of celery-idempotent.

One root, every error carrying the idempotency key it concerns::

    IdempotencyError                  .key
    ├── LockAcquisitionError          .attempts      the key stayed locked through every attempt
    ├── IdempotencyAbortedError       .attempts      the abort event was set before the body ran
    ├── IdempotencyMismatchError      .stored_fingerprint, .fingerprint
    ├── IdempotencyKeyMissingError    .task, .field  a key format field (or key callable) gave None
    ├── DuplicatePublishError         .task_id       a publish found its key done, queued or running
    ├── IdempotencyKeyHeldError       .holder, .lease_left  forget refused: a body runs now
    ├── LockLostError                 .result        body ran, lease lost: not committed
    │   └── CommitUnknownError        .result        body ran, commit sent but never confirmed
    ├── IdempotencyBackendError                      a store or lock failed (chains the cause)
    │   └── IdempotencyConnectionError               the backend could not be reached
    ├── RecordDecodeError             .content_type  stored record refused (not accepted, corrupt)
    └── ResultEncodeError             .result        the serializer refused the body's result

Every exception keeps all of its data in ``args``, in the order of its constructor's parameters.
Celery's result backend rebuilds an exception as ``cls(*args)`` (JSON result serializer) and
pickle does the same, so ``AsyncResult.get()`` raises the same class with the same attributes.
An error with fields of its own declares them once, as a dataclass (``key``, its fields,
``message``): the constructor, the attributes and ``args`` all come from that declaration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CommitUnknownError",
    "DuplicatePublishError",
    "IdempotencyAbortedError",
    "IdempotencyBackendError",
    "IdempotencyConnectionError",
    "IdempotencyError",
    "IdempotencyKeyHeldError",
    "IdempotencyKeyMissingError",
    "IdempotencyMismatchError",
    "LockAcquisitionError",
    "LockLostError",
    "RecordDecodeError",
    "ResultEncodeError",
]


class IdempotencyError(Exception):
    """Root of every error this library raises. ``key`` is the idempotency key concerned."""

    def __init__(self, key: str | None = None, message: str | None = None) -> None:
        super().__init__(key, message)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        text = self.message or self._describe()
        return f"{text} (key={self.key!r})" if self.key is not None else text

    def __post_init__(self) -> None:
        # A dataclass subclass's generated __init__ ends here: its fields, in order, are args.
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        Exception.__init__(self, *(getattr(self, f.name) for f in fields))

    def _describe(self) -> str:
        return self.__class__.__name__

    def with_key(self, key: str) -> IdempotencyError:
        """The same error (class and fields) naming ``key`` instead."""
        return type(self)(key, *self.args[1:])


@dataclass(eq=False, repr=False)
class LockAcquisitionError(IdempotencyError):
    """The key's lock was held by someone else through every attempt.

    ``attempts`` is how many acquisition attempts were made (``1 + retry_count``). It is the
    IETF draft's 409 Conflict: the same key is being processed; retrying later is safe.
    """

    key: str | None = None
    attempts: int = 0
    message: str | None = None

    def _describe(self) -> str:
        return f"lock still held by another holder after {self.attempts} attempt(s)"


@dataclass(eq=False, repr=False)
class IdempotencyAbortedError(IdempotencyError):
    """The ``abort`` event was set before the body started; no lock is left held."""

    key: str | None = None
    attempts: int = 0
    message: str | None = None

    def _describe(self) -> str:
        return f"aborted after {self.attempts} lock attempt(s)"


@dataclass(eq=False, repr=False)
class IdempotencyMismatchError(IdempotencyError):
    """The key was used before with another payload (the IETF draft's 422).

    ``stored_fingerprint`` is the fingerprint stored with the result, ``fingerprint`` the one of
    this call's ``input``. The body was not run.
    """

    key: str | None = None
    stored_fingerprint: str | None = None
    fingerprint: str | None = None
    message: str | None = None

    def _describe(self) -> str:
        return (
            "idempotency key reused with a different payload "
            f"(stored fingerprint {self.stored_fingerprint}, this call {self.fingerprint})"
        )


@dataclass(eq=False, repr=False)
class IdempotencyKeyMissingError(IdempotencyError):
    """A call has no idempotency key: a field of the key's format string is ``None``
    (``"user:{user_id}"`` called with ``user_id=None``), or the key callable returned ``None``.

    Without this error every such call would share one key (``user:None``) and a second user
    would get the first one's result. ``key`` is the key's template (or ``None`` for a
    callable), ``task`` the task's name, ``field`` the field that was ``None`` (``None`` for a
    callable). The body was not run. ``idempotency_missing_key="run"`` runs such calls
    unguarded instead.
    """

    key: str | None = None
    task: str | None = None
    field: str | None = None
    message: str | None = None

    def _describe(self) -> str:
        if self.field is None:
            return f"the idempotency_key callable of task {self.task} returned None: no key"
        return (
            f"the idempotency key of task {self.task} is missing: its field {self.field!r} "
            "is None (set idempotency_missing_key='run' to run such calls unguarded)"
        )


@dataclass(eq=False, repr=False)
class DuplicatePublishError(IdempotencyError):
    """``apply_async`` (or ``delay``) of a call whose key is already completed, queued or
    running, with ``idempotency_on_duplicate_publish="raise"``: nothing was published.

    ``task_id`` is the id of the first call's task (``None`` when it is not known: a record
    written by 0.1.0). ``state`` is what that call is: ``"queued"``, ``"running"`` or
    ``"completed"``. ``ttl_left`` is how many seconds at most the key stays blocked: the
    record's time left (completed), or the queued marker's (queued; it ends sooner when the
    call runs and ends without a record: a failure, ``idempotency_ttl=0``); ``None`` when not
    known (a running call, whose marker lives as long as its lease; a record of 0.1.0, one
    without a TTL; a backend that does not say).
    """

    key: str | None = None
    task_id: str | None = None
    message: str | None = None
    state: str | None = None
    ttl_left: float | None = None

    def _describe(self) -> str:
        state = f" and is {self.state}" if self.state else ""
        frees = (
            f"; the key frees in {self.ttl_left:.1f} s at most" if self.ttl_left is not None else ""
        )
        return (
            f"a call with this idempotency key was already published as task {self.task_id}"
            f"{state}: nothing was published (idempotency_on_duplicate_publish='raise'){frees}"
        )


@dataclass(eq=False, repr=False)
class IdempotencyKeyHeldError(IdempotencyError):
    """``forget`` refused: the key's lock is held, so a delivery is running its body now.

    Deleting the lock would let a duplicate run the body at the same time. ``holder`` is the
    owner id of the lease, ``lease_left`` its seconds left. Pass ``force=True`` (the CLI's
    ``--force``) when the holder is known to be dead; its lease also expires by itself.
    """

    key: str | None = None
    holder: str | None = None
    lease_left: float | None = None
    message: str | None = None

    def _describe(self) -> str:
        return f"the key's lock is held by {self.holder}: a delivery is running its body now"


@dataclass(eq=False, repr=False)
class LockLostError(IdempotencyError):
    """The body ran, but its lease was lost before the result could be committed.

    Nothing was stored: another holder may own the key now. ``result`` is what the body
    returned, so the caller can compensate (refund, undo) or decide to keep it.
    """

    key: str | None = None
    result: Any = None
    message: str | None = None

    def _describe(self) -> str:
        return "lease lost while the body ran; the result was not committed"


class CommitUnknownError(LockLostError):
    """The body ran and its commit was sent, but no answer came back within ``lock_ttl``.

    The result may or may not be stored (a lost reply, not a refused commit): look the key up
    (a replay tells) before compensating. ``result`` is what the body returned.
    """

    def _describe(self) -> str:
        return "the commit could not be confirmed; the result may or may not be stored"


class IdempotencyBackendError(IdempotencyError):
    """A store or lock backend failed. The original exception is chained as ``__cause__``."""


class IdempotencyConnectionError(IdempotencyBackendError):
    """The backend could not be reached (connection refused, timeout, authentication)."""


@dataclass(eq=False, repr=False)
class RecordDecodeError(IdempotencyError):
    """A stored record was refused: its content type is not accepted, or it is corrupt.

    It is never loaded: a record planted with a content type outside the accept list (pickle,
    for one) is reported, not deserialized.
    """

    key: str | None = None
    content_type: str | None = None
    message: str | None = None

    def _describe(self) -> str:
        return f"stored record refused (content type {self.content_type!r})"


@dataclass(eq=False, repr=False)
class ResultEncodeError(IdempotencyError):
    """The serializer refused the body's result; nothing was stored and the lock was released.

    ``result`` is what the body returned: its side effects happened, so the caller may need it.
    """

    key: str | None = None
    result: Any = None
    message: str | None = None

    def _describe(self) -> str:
        return f"the result serializer refused a result of type {type(self.result).__name__}"
