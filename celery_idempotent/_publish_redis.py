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
import logging
import threading
from dataclasses import dataclass
from typing import Any

from celery_idempotent import redis_client
from celery_idempotent.exceptions import IdempotencyConnectionError
from celery_idempotent.stores.redis import PublishDecision, RedisIdempotencyStore

__all__ = [
    "Pending",
    "Stopped",
    "arm",
    "can_fuse",
    "disarm",
    "goes_through",
    "install",
    "is_redis_transport",
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
    #: The hook has taken this publish's message (whatever the check decided).
    taken: bool = False
    #: The message was pushed by the check's own script (one round trip for both).
    fused: bool = False


class Stopped(Exception):
    """Raised out of kombu's publish when the check decided not to publish (the decision is
    on the :class:`Pending`); nothing was pushed."""


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
    """Whether ``transport_cls`` is kombu's Redis transport (or Sentinel's, a subclass)."""
    try:
        from kombu.transport import redis as kombu_redis  # noqa: PLC0415 - optional
    except ImportError:  # pragma: no cover - redis-py is a dependency of the Redis backends
        return False
    return isinstance(transport_cls, type) and issubclass(transport_cls, kombu_redis.Transport)


def install() -> bool:
    """Wrap kombu's Redis ``Channel._put`` and ``_put_fanout`` once per process (a wrapper
    that calls kombu's own unless this context armed a check for the message); ``False`` when
    kombu's Redis transport cannot be imported."""
    global _installed  # noqa: PLW0603 - once per process
    if _installed:
        return True
    try:
        from kombu.transport import redis as kombu_redis  # noqa: PLC0415 - optional
    except ImportError:  # pragma: no cover
        return False
    with _install_lock:
        if not _installed:
            channel = kombu_redis.Channel
            setattr(channel, "_put", _hook(channel._put, fusable=True))  # noqa: B010
            setattr(channel, "_put_fanout", _hook(channel._put_fanout, fusable=False))  # noqa: B010
            _installed = True
    return True


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
        if pending is None or pending.taken or not _is_the_message(message, pending):
            return original(channel, queue_or_exchange, message, *args, **kwargs)
        pending.taken = True
        push = None
        if (
            fusable
            and not args
            and kwargs.get("_publish_batch") is None
            and not (channel._expires and queue_or_exchange in channel._expires)
            and can_fuse(channel, pending.store)
        ):
            priority = channel._get_message_priority(message, reverse=False)
            name = channel._q_for_pri(queue_or_exchange, priority)
            push = ((channel.global_keyprefix or "") + name, _dumps(message))
        try:
            decision = pending.store.check_publish(
                pending.record,
                pending.lock,
                pending.task_id,
                pending.fingerprint,
                pending.publish_ttl,
                push=push,
            )
        except IdempotencyConnectionError as exc:
            # Publishing without the check is safe (the worker's guard decides); kombu's push
            # then fails or goes through as a plain publish would.
            log.warning("publish-side check skipped, Redis unreachable: %s", exc)
            return original(channel, queue_or_exchange, message, *args, **kwargs)
        pending.decision = decision
        if decision.action == "publish" and push is not None:
            pending.fused = True
            return None
        if goes_through(decision, pending.task_id):
            return original(channel, queue_or_exchange, message, *args, **kwargs)
        raise Stopped(decision.action)

    put.__wrapped__ = original  # type: ignore[attr-defined]
    put.__name__ = getattr(original, "__name__", "put")
    put.__doc__ = original.__doc__
    return put


def _dumps(message: Any) -> Any:
    """The message as kombu's Redis transport pushes it (``kombu.utils.json.dumps``)."""
    from kombu.utils import json as kombu_json  # noqa: PLC0415 - kombu's own encoding

    encode: Any = kombu_json.dumps
    return encode(message)


def _is_the_message(message: Any, pending: Pending) -> bool:
    headers = message.get("headers") if isinstance(message, dict) else None
    return isinstance(headers, dict) and headers.get("id") == pending.task_id
