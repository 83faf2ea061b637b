"""The app of the migration tests (issue 24): celery-once's, celery-singleton's and
sidekiq-unique-jobs' documented scenarios, each task configured with the mapping that
``docs/recipes/migrating.md`` gives for the peer's option.

Configured from the environment like ``publish_app``: ``MIG_REDIS_URL`` (broker, result
backend, idempotency store), ``MIG_PREFIX`` (every key of the session), ``MIG_QUEUE`` (the
default queue), ``MIG_BROKER_URL`` (another broker, optional). Bodies count their runs in
Redis (``INCR``) and log when they ran (``RPUSH`` of ``start|end``), so a test sees how often
and whether two ever overlapped.

Most tasks differ only in their options and in what their one ``tag`` counts under: those are
one row each, :func:`tagged` (the result ``{"tag", "run"}``) or :func:`counted` (the run);
the others, whose bodies differ, are written out with :func:`task`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_idempotent import IdempotentTask
from celery_idempotent.celery.keys import SLOT_HEADER
from celery_idempotent.keyspace import slot_for

app = Celery("migrate_app", set_as_current=False)
PREFIX = os.environ.get("MIG_PREFIX", "test:mig:")
URL = os.environ.get("MIG_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("MIG_QUEUE", "mig")
#: The "time frame" of celery-singleton's lock_expiry scenario, as idempotency_window.
FRAME = 2.0

#: The broker: the same Redis unless ``MIG_BROKER_URL`` names another (RabbitMQ: the publish
#: side then checks before kombu publishes, instead of in kombu's Redis push).
BROKER = os.environ.get("MIG_BROKER_URL") or URL

app.conf.update(
    broker_url=BROKER,
    result_backend=URL,
    task_default_queue=QUEUE,
    broker_transport_options={"global_keyprefix": f"{PREFIX}kombu:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}celery:"},
    result_expires=600,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    idempotency_url=URL,
    idempotency_key_prefix=f"{PREFIX}idem:",
    # A duplicate delivery re-queued while the first runs comes back soon.
    idempotency_retry_count=1,
    idempotency_retry_base_delay=0.05,
)

_clients: dict[int, redis.Redis] = {}


def client() -> redis.Redis:
    found = _clients.get(os.getpid())
    if found is None:
        found = _clients[os.getpid()] = redis.Redis.from_url(URL)
    return found


def fx(*parts: Any) -> str:
    return PREFIX + "fx:" + ":".join(map(str, parts))


def count(*parts: Any) -> int:
    return int(client().get(fx(*parts)) or 0)


def runs(*parts: Any) -> list[tuple[float, float]]:
    """``(start, end)`` of every run of the body ``parts`` names, in the order they ended."""
    got = client().lrange(fx("log", *parts), 0, -1)
    return [(float(a), float(b)) for a, b in (item.decode().split("|") for item in got)]


def _body(parts: tuple[Any, ...], hold: float) -> int:
    """A body's side effect: counts the run, holds, logs when it ran; returns the run."""
    start = time.time()
    run = int(client().incr(fx(*parts)))
    client().set(fx("running", *parts), run)
    time.sleep(hold)
    client().rpush(fx("log", *parts), f"{start:.6f}|{time.time():.6f}")
    return run


def task(name: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """The decorator of the idempotent task ``mig.<name>`` with ``options``."""
    return app.task(base=IdempotentTask, shared=False, name=f"mig.{name}", **options)


def _named(fn: Callable[..., Any], name: str, doc: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


def tagged(name: str, doc: str, counts: str | None = None, **options: Any) -> Any:
    """The task ``mig.<name>(tag, hold=0.0)``: one run of the body counted under ``counts``
    (the name when not given) and ``tag``; returns ``{"tag": tag, "run": n}``."""
    what = counts or name

    def run(tag: str, hold: float = 0.0) -> dict[str, Any]:
        return {"tag": tag, "run": _body((what, tag), hold)}

    return task(name, **options)(_named(run, name, doc))


def counted(name: str, doc: str, *, hold: bool = True, **options: Any) -> Any:
    """The task ``mig.<name>(tag, hold=0.0)`` (``mig.<name>(tag)`` when not ``hold``): one run
    of the body counted under the name and ``tag``; returns the run's number."""
    if hold:

        def run(tag: str, hold: float = 0.0) -> int:
            return _body((name, tag), hold)

    else:

        def run(tag: str) -> int:  # type: ignore[misc]
            return _body((name, tag), 0.0)

    return task(name, **options)(_named(run, name, doc))


# --------------------------------------------------------------------------- celery-once

default = tagged("default", "No mapping: this library's defaults (results replayed for a day).")
once = tagged(
    "once",
    "``base=QueueOnce``: not twice at the same time, again afterwards; AlreadyQueued.",
    idempotency_ttl=0,
    idempotency_on_duplicate_publish="raise",
)
graceful = tagged(
    "graceful", '``once={"graceful": True}``: a duplicate publish is no error.', idempotency_ttl=0
)
unlock_before_run = tagged(
    "unlock_before_run",
    '``once={"unlock_before_run": True}``: one call running and at most one more queued.',
    counts="ubr",
    idempotency_ttl=0,
    idempotency_publish_until="started",
)
started_remembers = tagged(
    "started_remembers",
    '``idempotency_publish_until="started"`` with the default ``idempotency_ttl``.',
    counts="sr",
    idempotency_publish_until="started",
)


@task(
    "keys_a",
    idempotency_key="a:{a}",
    idempotency_fingerprint=None,
    idempotency_ttl=0,
    idempotency_on_duplicate_publish="raise",
)
def keys_a(a: int, b: int, hold: float = 0.0) -> int:
    """``once={"keys": ["a"]}``: only ``a`` makes the key; ``b`` may differ."""
    _body(("keys_a", a), hold)
    return a + b


@task(
    "keys_none",
    idempotency_key="the-only-one",
    idempotency_fingerprint=None,
    idempotency_ttl=0,
    idempotency_on_duplicate_publish="raise",
)
def keys_none(a: int, b: int, hold: float = 0.0) -> int:
    """``once={"keys": []}``: one call at a time, whatever the arguments."""
    _body(("keys_none",), hold)
    return a + b


@task(
    "retrying",
    bind=True,
    max_retries=3,
    idempotency_ttl=0,
    idempotency_on_duplicate_publish="raise",
)
def retrying(self: Any, tag: str) -> str:
    """celery-once's ``test_retry``: the key stays taken while the task retries."""
    if _body(("retrying", tag), 0.0) == 1:
        raise self.retry(countdown=1.0)
    return f"{tag} after {self.request.retries} retry"


@task("fails", idempotency_ttl=0)
def fails(tag: str) -> None:
    """The lock clears when the task raises."""
    _body(("fails", tag), 0.0)
    raise ValueError(f"{tag} failed")


@task("in_memory", idempotency_url="memory://", idempotency_ttl=0)
def in_memory(tag: str) -> str:
    """``celery_once.backends.File`` mapped to ``memory://``: no publish-side check."""
    _body(("in_memory", tag), 0.0)
    return tag


# --------------------------------------------------------------------------- celery-singleton


@task("singleton", idempotency_ttl=0)
def singleton(*args: Any, **kwargs: Any) -> str:
    """``base=Singleton``: one queued or running per name and arguments, again afterwards."""
    _body(("singleton", repr(args), repr(sorted(kwargs.items()))), float(kwargs.get("hold", 0)))
    return "I just woke up"


@task(
    "unique_on_user",
    idempotency_key="user:{username}",
    idempotency_fingerprint=None,
    idempotency_ttl=0,
)
def unique_on_user(username: str, otherarg: Any = None, hold: float = 0.0) -> str:
    """``unique_on=["username"]``: only the user makes the key."""
    _body(("unique_on_user", username), hold)
    return f"{username} {otherarg}"


@task(
    "unique_on_defaults",
    idempotency_key="ab:{a}:{b}",
    idempotency_fingerprint=None,
    idempotency_ttl=0,
)
def unique_on_defaults(a: int, b: int = 5, c: Any = None) -> int:
    """``unique_on=["a", "b"]`` with ``b`` left to its default."""
    _body(("unique_on_defaults", a, b), 0.0)
    return a + b


@task(
    "unique_on_empty", idempotency_key="name-only", idempotency_fingerprint=None, idempotency_ttl=0
)
def unique_on_empty(x: int) -> int:
    """``unique_on=[]``: the task name only."""
    _body(("unique_on_empty",), 0.0)
    return x


@task("singleton_raise", idempotency_ttl=0, idempotency_on_duplicate_publish="raise")
def singleton_raise(username: str, hold: float = 0.0) -> str:
    """``raise_on_duplicate=True``: ``DuplicateTaskError`` with ``.task_id``."""
    _body(("singleton_raise", username), hold)
    return username


time_frame = counted(
    "time_frame",
    '``lock_expiry`` as "one call per time frame": ``idempotency_window``.',
    hold=False,
    idempotency_window=FRAME,
    idempotency_ttl=FRAME * 3,
)


# --------------------------------------------------------------------------- re-scheduling


@task("resched_same", bind=True)
def resched_same(self: Any, tag: str) -> int:
    """Re-schedules itself with the same arguments (celery-singleton #53): swallowed."""
    run = _body(("resched_same", tag), 0.0)
    if run < 3:
        client().rpush(fx("resched_ids", tag), self.apply_async((tag,), countdown=0.2).id)
    return run


@task("resched_step", bind=True, idempotency_key="poll:{tag}:{step}")
def resched_step(self: Any, tag: str, step: int = 0) -> int:
    """Re-schedules itself with the next step: each step a key of its own."""
    run = _body(("resched_step", tag), 0.0)
    if step < 2:
        self.apply_async((tag, step + 1), countdown=0.2)
    return run


@task("resched_started", bind=True, idempotency_ttl=0, idempotency_publish_until="started")
def resched_started(self: Any, tag: str) -> int:
    """Re-schedules itself with the same arguments: its own claim ended its marker, so the
    call it publishes is the one more that may wait."""
    run = _body(("resched_started", tag), 0.0)
    if run < 3:
        self.apply_async((tag,), countdown=0.2)
    return run


@task("resched_slot", bind=True, idempotency_window=1.0)
def resched_slot(self: Any, tag: str) -> int:
    """Re-schedules itself one window later, with the slot of when it is due."""
    run = _body(("resched_slot", tag), 0.0)
    if run < 3:
        due = time.time() + 1.0
        self.apply_async((tag,), countdown=1.0, headers={SLOT_HEADER: slot_for(due, 1.0)})
    return run


# --------------------------------------------------------------------------- sidekiq-unique-jobs

while_executing = counted(
    "while_executing",
    "``lock: :while_executing``: every push enqueued, never two running at once.",
    idempotency_ttl=0,
    idempotency_on_duplicate_publish="publish",
)
until_expired = counted(
    "until_expired",
    "``lock: :until_expired, lock_ttl: ...``: taken until its TTL, even after the run.",
    hold=False,
    idempotency_ttl=1.5,
)
reject_duplicate = counted(
    "reject_duplicate",
    "``on_conflict: :reject`` (server side): a duplicate delivery goes to the dead set.",
    idempotency_ttl=0,
    idempotency_on_locked="reject",
)
