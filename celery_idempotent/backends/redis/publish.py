"""The publish-side check where kombu's Redis transport pushes the message: one round trip.

When the broker is kombu's Redis transport, ``apply_async`` does not check before it
publishes: it arms a hook for its message (:func:`arm`) and lets Celery publish. kombu builds
the message and picks the list as always; where it would push the message
(``Channel._put``), the hook runs the check instead. On the store's own Redis and database the
check and the push are one script (``PUBLISH_AND_PUSH``: ``PUBLISH``'s decision, then the
``LPUSH`` in the same atomic step as the queued marker, only when the decision is "publish"),
so a checked publish costs the one round trip a plain publish costs. On another Redis (or for a
queue kombu pushes otherwise: a batch, a queue with ``x-expires``, a fanout exchange) the
check runs alone there, then kombu's own push. A duplicate raises :class:`Stopped` out of
kombu's publish, before anything is pushed; the task turns it into the duplicate's result.

The hook is armed per call in a context variable (threads and greenlets do not see each
other's) for one message, the one that carries the call's task id; every other message that
passes through ``Channel._put`` is pushed by kombu's own code, untouched.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from celery_idempotent.backends.redis import client as redis_client
from celery_idempotent.backends.redis.store import PublishDecision, RedisIdempotencyStore
from celery_idempotent.core.exceptions import IdempotencyConnectionError

__all__ = [
    "TESTED_KOMBU",
    "Pending",
    "Stopped",
    "arm",
    "can_fuse",
    "disarm",
    "fused_push",
    "goes_through",
    "install",
    "is_redis_transport",
    "kombu_problem",
    "pending_for",
    "travels_with_push",
]

log = logging.getLogger("celery_idempotent")


@dataclass
class Pending:
    """One armed publish: the check's arguments, and what the check decided (``None`` while
    it has not run, or when Redis could not be reached: published unchecked)."""

    store: RedisIdempotencyStore
    record: str
    lock: str
    task_id: str
    fingerprint: str | None
    publish_ttl: float
    decision: PublishDecision | None = None
    #: ``idempotency_publish_until`` of the call.
    until: str = "completed"
    #: The hook has taken this publish's message (whatever the check decided).
    taken: bool = False
    #: The message was pushed by the check's own script (one round trip for both).
    fused: bool = False
    #: The message reached the broker (by the script or by kombu's own push): a failure
    #: after this point leaves the marker, which names a message that is queued.
    pushed: bool = False


class Stopped(Exception):
    """Raised out of kombu's publish when the check decided not to publish (the decision is
    on the :class:`Pending`); nothing was pushed."""


def travels_with_push(store: Any) -> bool:
    """Whether ``store``'s publish check can travel with kombu's Redis push (one script for
    both): a :class:`RedisIdempotencyStore`; other stores are checked before the publish."""
    return isinstance(store, RedisIdempotencyStore)


def pending_for(
    store: Any,
    record: str,
    lock: str,
    task_id: str,
    *,
    fingerprint: str | None,
    publish_ttl: float,
    until: str = "completed",
) -> Pending:
    """The :class:`Pending` publish of a check by ``store``, which must travel with the push
    (:func:`travels_with_push`); ``TypeError`` naming the store's type otherwise."""
    if not isinstance(store, RedisIdempotencyStore):
        raise TypeError(f"{type(store).__name__} cannot travel with kombu's Redis push")
    return Pending(store, record, lock, task_id, fingerprint, publish_ttl, until=until)


def goes_through(decision: PublishDecision, task_id: str) -> bool:
    """Whether a call is published after ``decision``: "publish", or the very call that
    completed sent again with its task id (it goes through as it does while queued; the worker
    replays it; no marker over the record)."""
    return decision.action == "publish" or (
        decision.action == "completed" and decision.task_id == task_id
    )


_armed: contextvars.ContextVar[Pending | None] = contextvars.ContextVar(
    "celery_idempotent_publish", default=None
)
_install_lock = threading.Lock()
_installed = False


def arm(pending: Pending) -> contextvars.Token[Pending | None]:
    """Check ``pending``'s message where kombu pushes it, in this context."""
    return _armed.set(pending)


def disarm(token: contextvars.Token[Pending | None]) -> None:
    _armed.reset(token)


def is_redis_transport(transport_cls: Any) -> bool:
    """Whether ``transport_cls`` is kombu's Redis transport (or Sentinel's, a subclass) and
    its channel pushes through the hook (installed here): a subclass whose channel overrides
    ``_put`` or ``_put_fanout`` would push past the check, so it is checked first instead."""
    try:
        kombu_redis = _kombu_redis()
    except ImportError:  # pragma: no cover - redis-py is a dependency of the Redis backends
        return False
    if not (isinstance(transport_cls, type) and issubclass(transport_cls, kombu_redis.Transport)):
        return False
    channel = getattr(transport_cls, "Channel", None)
    return install() and all(
        getattr(getattr(channel, name, None), "_celery_idempotent_hook", False)
        for name in ("_put", "_put_fanout")
    )


def install() -> bool:
    """Wrap kombu's Redis ``Channel._put`` and ``_put_fanout`` once per process (a wrapper
    that calls kombu's own unless this context armed a check for the message); ``False`` when
    kombu's Redis transport cannot be imported. A kombu whose ``_put`` is not the one the
    fused script was written against (:func:`kombu_problem`) is wrapped all the same, and
    every check then runs alone before kombu's own push (a WARNING says why)."""
    global _installed, _fuse_problem  # noqa: PLW0603 - once per process
    if _installed:
        return True
    try:
        kombu_redis = _kombu_redis()
    except ImportError:  # pragma: no cover
        return False
    with _install_lock:
        if not _installed:
            _fuse_problem = kombu_problem(kombu_redis)
            if _fuse_problem is not None:
                log.warning(
                    "celery-idempotent: publish-side checks take their own round trip before "
                    "kombu's push: %s",
                    _fuse_problem,
                )
            channel = kombu_redis.Channel
            setattr(channel, "_put", _hook(channel._put, fusable=True))  # noqa: B010
            setattr(channel, "_put_fanout", _hook(channel._put_fanout, fusable=False))  # noqa: B010
            batch = getattr(kombu_redis, "PublishBatch", None)  # kombu >= 5.7
            if isinstance(batch, type) and all(
                callable(getattr(batch, name, None)) for name in ("publish", "flush", "discard")
            ):
                _watch_batches(batch)
            _installed = True
    return True


#: The parameters of kombu's ``Channel._put`` that the fused script reproduces (kombu 5.5 to
#: 5.7: the list of the message's priority, ``LPUSH``-ed, JSON as the module's ``dumps``).
_PUT_PARAMETERS = ("self", "queue", "message", "kwargs")
#: Why kombu's ``_put`` is not reproduced by the script (set by :func:`install`).
_fuse_problem: str | None = None


def kombu_problem(module: Any, version: str | None = None) -> str | None:
    """Why the store's script cannot push for ``module`` (kombu's ``kombu.transport.redis``),
    or ``None``: kombu's ``version`` (``kombu.__version__`` by default) is one the fused push
    was tested with (:data:`TESTED_KOMBU`), and its ``Channel._put(self, queue, message,
    **kwargs)`` and the helpers the script's list name and encoding come from are there.
    ``tests/celery`` pins the rest: the script pushes what kombu's own ``_put`` pushes, byte
    for byte, on every kombu of the version matrix (tox)."""
    untested = _untested_kombu(version)
    if untested is not None:
        return untested
    channel: Any = getattr(module, "Channel", None)
    try:
        signature = inspect.signature(inspect.unwrap(channel._put))
    except (AttributeError, TypeError, ValueError):
        return "kombu's Redis transport has no Channel._put"
    parameters = list(signature.parameters.values())
    if (
        tuple(parameter.name for parameter in parameters) != _PUT_PARAMETERS
        or parameters[-1].kind is not inspect.Parameter.VAR_KEYWORD
    ):
        return f"kombu's Channel._put{signature} is not _put(self, queue, message, **kwargs)"
    for name in ("_get_message_priority", "_q_for_pri"):
        if not callable(getattr(channel, name, None)):
            return f"kombu's Redis Channel has no {name}"
    if not callable(getattr(module, "dumps", None)):
        return "kombu.transport.redis has no dumps"
    return None


#: The kombu releases whose private ``Channel._put`` the fused push reproduces, tested by the
#: version matrix (``tox -e lowest,celery55,celery56,latest``): from 5.5.2 (the floor) up to,
#: not including, 5.8. setup.cfg gives kombu no upper bound, so that a kombu release (a fix
#: Celery needs) installs; a kombu outside this range is not trusted blindly: the publish side
#: then checks in a round trip of its own and kombu pushes the message itself (a WARNING at
#: the first publish says so). Widen it once the matrix has run the new kombu.
TESTED_KOMBU = ((5, 5, 2), (5, 8))


def _untested_kombu(version: str | None) -> str | None:
    if version is None:
        import kombu  # noqa: PLC0415 - a dependency of Celery

        version = str(kombu.__version__)
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:3])
    low, high = TESTED_KOMBU
    if low <= numbers < high:
        return None
    tested = f"{'.'.join(map(str, low))} up to (not including) {'.'.join(map(str, high))}"
    return (
        f"kombu {version} is not one this release of celery-idempotent was tested with "
        f"({tested}), so its private Channel._put is not reproduced"
    )


def _kombu_redis() -> Any:
    from kombu.transport import redis as kombu_redis  # noqa: PLC0415 - optional

    return kombu_redis


def can_fuse(channel: Any, store: RedisIdempotencyStore) -> bool:
    """Whether ``channel`` (kombu's Redis transport) reaches ``store``'s Redis and database,
    so that the store's script can push the channel's messages (cached on the channel)."""
    cache = channel.__dict__.setdefault("_celery_idempotent_fuses", {})
    found = cache.get(id(store.client))
    if found is None or found[0] is not store.client:
        # A client over the channel's own pool (kombu publishes with one of these).
        broker = redis_client.import_redis().Redis(connection_pool=channel.pool)
        found = cache[id(store.client)] = (
            store.client,
            redis_client.why_not_same_server(store.client, broker) is None,
        )
    return bool(found[1])


def _hook(original: Any, *, fusable: bool) -> Any:
    def put(channel: Any, queue_or_exchange: str, message: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _armed.get()
        if pending is None or not _is_the_message(message, pending):
            return original(channel, queue_or_exchange, message, *args, **kwargs)
        if pending.decision is not None:
            # Checked already: kombu pushes the message to another queue bound to the
            # exchange, or retries the publish after a connection error. The same decision.
            if not goes_through(pending.decision, pending.task_id):  # pragma: no cover
                raise Stopped(pending.decision.action)
            result = original(channel, queue_or_exchange, message, *args, **kwargs)
            pending.pushed = True
            return result
        pending.taken = True
        push = None
        if fusable and not args and kwargs.get("_publish_batch") is None:
            push = fused_push(channel, queue_or_exchange, message, pending.store)
        try:
            decision = pending.store.check_publish(
                pending.record,
                pending.lock,
                pending.task_id,
                pending.fingerprint,
                pending.publish_ttl,
                push=push,
                until=pending.until,
            )
        except IdempotencyConnectionError as exc:
            # Publishing without the check is safe (the worker's guard decides); kombu's push
            # then fails (and kombu's retry checks again) or goes through as a plain publish.
            log.warning("publish-side check skipped, Redis unreachable: %s", exc)
            result = original(channel, queue_or_exchange, message, *args, **kwargs)
            pending.pushed = True
            return result
        pending.decision = decision
        if decision.action == "publish" and push is not None:
            pending.pushed = pending.fused = True
            return None
        if goes_through(decision, pending.task_id):
            result = original(channel, queue_or_exchange, message, *args, **kwargs)
            pending.pushed = True
            batch = kwargs.get("_publish_batch")
            if (
                isinstance(batch, _watched_batches)
                and decision.action == "publish"
                and not decision.unchecked
            ):
                _batch_marks(batch, "current").append(pending)
            return result
        raise Stopped(decision.action)

    put.__wrapped__ = original  # type: ignore[attr-defined]
    put._celery_idempotent_hook = True  # type: ignore[attr-defined]
    put.__name__ = getattr(original, "__name__", "put")
    put.__doc__ = original.__doc__
    return put


def fused_push(
    channel: Any, queue: str, message: Any, store: RedisIdempotencyStore
) -> tuple[str, Any] | None:
    """``(list name, encoded message)`` that kombu's ``Channel._put`` would ``LPUSH`` for
    ``message`` to ``queue`` (its priority's list, under ``global_keyprefix``), when the
    store's script can push it instead: kombu's transport is the one this was written against
    (:func:`kombu_problem`), the channel reaches the store's Redis and database, and the queue
    has no ``x-expires`` (kombu pushes those with a ``PEXPIRE`` of every priority's list).
    ``None``: the check runs alone and kombu pushes the message itself."""
    if _fuse_problem is not None:
        return None
    expires = getattr(channel, "_expires", None)  # kombu >= 5.7 only
    if expires and queue in expires:
        return None
    try:
        if not can_fuse(channel, store):
            return None
        priority = channel._get_message_priority(message, reverse=False)
        name = channel._q_for_pri(queue, priority)
        name = (channel.global_keyprefix or "") + name
    except (AttributeError, TypeError, ValueError) as exc:  # a kombu this was not written for
        log.warning("publish-side check and push not fused (kombu's channel: %r)", exc)
        return None
    return (name, _kombu_redis().dumps(message))  # a message kombu cannot encode: raised


class _NoBatches:
    """What :data:`_watched_batches` is while kombu has no ``PublishBatch`` (before 5.7)."""


#: kombu's Redis ``PublishBatch`` once wrapped (a batch of another class is not tracked).
_watched_batches: type = _NoBatches


def _batch_marks(batch: Any, which: str) -> list[Pending]:
    """The checks whose messages ``batch`` buffers: ``"current"``, the message being
    published now; ``"buffered"``, the earlier ones not flushed yet."""
    found: list[Pending] | None = batch.__dict__.get(f"_celery_idempotent_{which}")
    if found is None:
        found = batch.__dict__[f"_celery_idempotent_{which}"] = []
    return found


def _drop_marks(marks: list[Pending]) -> None:
    """Remove the queued markers of messages a batch did not push (discarded, or its flush
    failed: delivery uncertain; a marker kept for a lost message would block its key for
    ``idempotency_publish_ttl``, a marker dropped for a pushed one costs a replay at most)."""
    while marks:
        pending = marks.pop()
        try:
            pending.store.drop_queued(pending.record, pending.task_id)
        except Exception as exc:  # it expires after idempotency_publish_ttl
            log.warning("could not remove the queued marker of %s: %r", pending.task_id, exc)


def _watch_batches(cls: Any) -> None:
    """Wrap kombu's Redis ``PublishBatch`` (``Producer.batch()``, kombu >= 5.7), which pushes
    its messages when it flushes: a checked message's marker is dropped when the batch
    discards the message or fails to flush it, and kept once a flush pushed it."""
    publish, flush, discard = cls.publish, cls.flush, cls.discard

    def watched_publish(self: Any, message: Any, **kwargs: Any) -> Any:
        current = _batch_marks(self, "current")
        current.clear()
        try:
            result = publish(self, message, **kwargs)
        except BaseException:
            _drop_marks(current)  # not buffered, or reset with the pipeline
            raise
        if getattr(self, "_buffered", 1):  # still buffered: flushed later, or discarded
            _batch_marks(self, "buffered").extend(current)
        current.clear()
        return result

    def watched_flush(self: Any, *args: Any, **kwargs: Any) -> Any:
        buffered = _batch_marks(self, "buffered")
        try:
            result = flush(self, *args, **kwargs)
        except BaseException:
            _drop_marks(buffered)
            raise
        buffered.clear()
        return result

    def watched_discard(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return discard(self, *args, **kwargs)
        finally:
            _drop_marks(_batch_marks(self, "buffered"))

    for name, wrapper, original in (
        ("publish", watched_publish, publish),
        ("flush", watched_flush, flush),
        ("discard", watched_discard, discard),
    ):
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__doc__ = original.__doc__
        setattr(cls, name, wrapper)
    global _watched_batches  # noqa: PLW0603 - once per process, under the install lock
    _watched_batches = cls


def _is_the_message(message: Any, pending: Pending) -> bool:
    headers = message.get("headers") if isinstance(message, dict) else None
    return isinstance(headers, dict) and headers.get("id") == pending.task_id
