"""The backends and guards of a worker (or client) process, made once and cached.

:data:`factory` builds the lock provider and store a task's settings name (memory, Redis or
PostgreSQL) and each task's :class:`~celery_idempotent.DistributedIdempotencyGuard` over them;
:meth:`GuardFactory.reset` forgets them all. Both caches are per process: a client made before
a fork must not be shared with the children.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

from celery_idempotent import signals
from celery_idempotent.backends.memory.locks import MemoryLockProvider
from celery_idempotent.backends.memory.store import MemoryIdempotencyStore
from celery_idempotent.backends.redis.client import make_client
from celery_idempotent.backends.redis.locks import RedisLockProvider
from celery_idempotent.backends.redis.store import RedisIdempotencyStore
from celery_idempotent.celery.requeue import MAX_REQUEUE_DELAY
from celery_idempotent.celery.results import result_serialization
from celery_idempotent.core.guard import DistributedIdempotencyGuard, GuardEvent
from celery_idempotent.settings import IdempotencySettings, make_client_from
from celery_idempotent.urls import redact

if TYPE_CHECKING:
    from celery_idempotent.celery.task import IdempotentTask
    from celery_idempotent.core.protocols import IdempotencyStore, LockProvider

__all__ = ["GuardFactory", "backend_label", "factory", "reset_backends"]

Pair = tuple["LockProvider", "IdempotencyStore"]


class _PairKey(NamedTuple):
    """What makes two sets of settings share one (lock provider, store) pair."""

    pid: int  # a client made before a fork must not be shared with the children
    backend: tuple[str, Any]  # ("url", url), or ("client", id(the client or its factory))
    key_prefix: str
    serializer: str
    accept: tuple[str, ...]
    wait: tuple[int, float]  # idempotency_wait_replicas, idempotency_wait_timeout


class _GuardKey(NamedTuple):
    """One guard per task of an app, per process."""

    pid: int
    app: int  # id(app)
    task_name: str


class GuardFactory:
    """Makes and caches, per process, the backends of a set of settings and the guard of each
    task. Thread-safe; :meth:`reset` forgets everything made so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # -> (the client setting or None, (lock provider, store)).
        self._pairs: dict[_PairKey, tuple[Any, Pair]] = {}
        # -> (the settings it was built from, guard). The settings object is cached per app
        # (settings.resolve), so "is" tells a stale entry: an app whose id was reused after
        # garbage collection, or settings re-read after clear_cache().
        self._guards: dict[_GuardKey, tuple[IdempotencySettings, DistributedIdempotencyGuard]]
        self._guards = {}

    def reset(self) -> None:
        """Forget every client and guard made so far (tests; after changing settings)."""
        with self._lock:
            self._pairs.clear()
            self._guards.clear()

    def guard(self, task: IdempotentTask, cfg: IdempotencySettings) -> DistributedIdempotencyGuard:
        """The guard of ``task`` in this process, built once from ``cfg`` (its settings);
        its events are sent as the task's signals (``signals.py``)."""
        ident = _GuardKey(os.getpid(), id(task.app), task.name)
        entry = self._guards.get(ident)
        if entry is not None and entry[0] is cfg:
            return entry[1]
        lock_provider, store = self.backends(task, cfg)
        guard = DistributedIdempotencyGuard(
            store=store,
            lock_provider=lock_provider,
            ttl=cfg.idempotency_ttl,
            lock_ttl=cfg.idempotency_lock_ttl,
            retry_count=cfg.idempotency_retry_count,
            retry_base_delay=cfg.idempotency_retry_base_delay,
            retry_max_delay=MAX_REQUEUE_DELAY,
            key_prefix=cfg.idempotency_key_prefix,
            on_event=_SignalSender(task),
        )
        with self._lock:
            entry = self._guards.get(ident)
            if entry is None or entry[0] is not cfg:
                entry = self._guards[ident] = (cfg, guard)
            return entry[1]

    def backends(self, task: IdempotentTask, cfg: IdempotencySettings) -> Pair:
        """The (lock provider, store) pair of ``cfg`` in this process, with the results of
        ``task``'s app serialized as its result backend serializes them."""
        serializer, accept = result_serialization(task.app.conf)
        source = cfg.idempotency_client
        # A client (or its factory) is keyed by identity; the entry keeps it, so an id reused
        # after it was garbage collected cannot pick up another client's backends.
        ident = _PairKey(
            pid=os.getpid(),
            backend=("client", id(source)) if source is not None else ("url", cfg.backend_url),
            key_prefix=cfg.idempotency_key_prefix,
            serializer=serializer,
            accept=tuple(accept),
            wait=(cfg.idempotency_wait_replicas, cfg.idempotency_wait_timeout),
        )
        with self._lock:
            found = self._pairs.get(ident)
            if found is not None and found[0] is source:
                return found[1]
            pair = _make_pair(cfg, serializer, accept, task_name=task.name)
            self._pairs[ident] = (source, pair)
            return pair


def _make_pair(
    cfg: IdempotencySettings, serializer: str, accept: list[str], *, task_name: str
) -> Pair:
    """A new (lock provider, store) pair: PostgreSQL, memory or Redis."""
    source = cfg.idempotency_client
    if source is None and cfg.in_postgres:
        return _postgres_pair(cfg, serializer, accept, task_name=task_name)
    if source is not None:
        client = make_client_from(source, task_name=task_name)
    elif cfg.in_memory:
        client = None
    else:
        client = make_client(None, cfg.backend_url, "idempotency_url")
    if client is None:
        if cfg.idempotency_wait_replicas:
            raise ValueError(
                f"idempotency_wait_replicas (task {task_name}) needs a Redis backend, "
                f"not memory:// (got {cfg.idempotency_wait_replicas}); use 0"
            )
        return MemoryLockProvider(), MemoryIdempotencyStore()
    return (
        RedisLockProvider(
            client,
            key_prefix=cfg.idempotency_key_prefix,
            wait_replicas=cfg.idempotency_wait_replicas,
            wait_timeout=cfg.idempotency_wait_timeout,
        ),
        RedisIdempotencyStore(
            client,
            serializer=serializer,
            accept=accept,
            wait_replicas=cfg.idempotency_wait_replicas,
            wait_timeout=cfg.idempotency_wait_timeout,
        ),
    )


def _postgres_pair(
    cfg: IdempotencySettings, serializer: str, accept: list[str], *, task_name: str
) -> Pair:
    """One PostgreSQL backend serving as lock provider and store (one transaction)."""
    from celery_idempotent.backends import sql_backend_from_url  # noqa: PLC0415 - optional

    if cfg.idempotency_wait_replicas:
        raise ValueError(
            f"idempotency_wait_replicas (task {task_name}) is a Redis setting; PostgreSQL "
            f"replicates commits itself (got {cfg.idempotency_wait_replicas}); use 0"
        )
    backend = sql_backend_from_url(cfg.backend_url, serializer=serializer, accept=accept)
    return backend, backend


_SIGNALS = {
    "replay": signals.idempotency_replayed,
    "contention": signals.idempotency_contended,
    "committed": signals.idempotency_committed,
    "lease_lost": signals.idempotency_lease_lost,
}


class _SignalSender:
    """A guard's ``on_event``: its events as the task's signals, sent for the delivery running
    now; ``wants`` lets the guard skip building an event whose signal has no receiver."""

    __slots__ = ("task",)

    def __init__(self, task: IdempotentTask) -> None:
        self.task = task

    @staticmethod
    def wants(kind: str) -> bool:
        signal = _SIGNALS.get(kind)
        # Celery's Signal.send does nothing without receivers (a dead weak reference still
        # counts here: the event is built and send() finds nobody, as before).
        return signal is None or bool(signal.receivers)

    def __call__(self, event: GuardEvent) -> None:
        _send_signal(self.task, event)


def _send_signal(task: IdempotentTask, event: GuardEvent) -> None:
    """A guard's event as the task's signal, sent for the delivery running now."""
    extra = {"attempt": event.attempt} if event.kind == "contention" else {}
    _SIGNALS[event.kind].send(
        sender=task,
        task_id=task.request.id,
        key=event.key,
        elapsed=event.elapsed,
        fencing_token=event.fencing_token,
        **extra,
    )


def backend_label(cfg: IdempotencySettings) -> str:
    """Where a task's keys live, for logs (no password)."""
    source = cfg.idempotency_client
    if source is None:
        return redact(cfg.backend_url)
    label = getattr(source, "label", None)  # SentinelClientFactory (a Sentinel broker)
    if isinstance(label, str):
        return label
    name = getattr(source, "__qualname__", None) or type(source).__name__
    return f"idempotency_client {name}"


#: The process's one factory.
factory = GuardFactory()


def reset_backends() -> None:
    """Forget every client and guard made so far (tests; after changing settings)."""
    factory.reset()
