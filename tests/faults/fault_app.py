"""The Celery app of the fault suite, loaded by real ``celery worker`` subprocesses.

The worker builds it from environment variables (:func:`config_from_env`); the test process
builds the same app with :func:`make_app` to send tasks and read results. Every body records
what it did in a *marks* Redis that no fault touches, stamped with the server's ``TIME``:

- ``<ns>runs``: a list of ``"start|<n>|<exec>|<fence>|<pid>|<µs>"`` and ``"end|..."`` entries;
- ``<ns>running``: a hash ``pid -> n`` of bodies running right now (the killer's targets);
- ``<ns>commits``: a list of ``"<key>|<fence>"`` sent by ``idempotency_committed``;
- ``<ns>count:<what>``: counters of deliveries (``task_prerun``), replays, contentions;
- ``<ns>retries``: the class names of the errors Celery retried a task for.

Environment (all strings): ``FAULT_BROKER_URL``, ``FAULT_BACKEND_URL``, ``FAULT_IDEM_URL``,
``FAULT_MARKS_URL``, ``FAULT_NS`` (marks namespace), ``FAULT_PREFIX`` (idempotency key prefix),
``FAULT_LOCK_TTL`` (seconds).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings
from typing import Any

import redis
from celery import Celery, signals

try:
    from celery.exceptions import DuplicateTaskNameWarning
except ImportError:  # celery < 5.4 does not warn about duplicate task names

    class DuplicateTaskNameWarning(UserWarning):  # type: ignore[no-redef]
        """Stands in for the warning that older Celery versions do not have."""


from celery_idempotent import IdempotentTask, current_lease
from celery_idempotent import signals as idem_signals

ENV_KEYS = (
    "FAULT_BROKER_URL",
    "FAULT_BACKEND_URL",
    "FAULT_IDEM_URL",
    "FAULT_MARKS_URL",
    "FAULT_NS",
    "FAULT_PREFIX",
    "FAULT_LOCK_TTL",
)

# KEYS[1] runs  KEYS[2] running   ARGV: kind, n, exec, fence, pid
# The entry carries the server's TIME in µs, so that every process is on one clock.
MARK = """
local t = redis.call('time')
local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('rpush', KEYS[1], string.format('%s|%s|%s|%s|%s|%d',
           ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], us))
if ARGV[1] == 'start' then
  redis.call('hset', KEYS[2], ARGV[5], ARGV[2])
else
  redis.call('hdel', KEYS[2], ARGV[5])
end
return us
"""


class Marks:
    """The marks client of one process (made again after a fork: clients do not survive it)."""

    def __init__(self, url: str, ns: str) -> None:
        self.url = url
        self.ns = ns
        self._pid = -1
        self._client: redis.Redis | None = None
        self._script: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> redis.Redis:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = redis.Redis.from_url(self.url, socket_timeout=10)
                self._script = self._client.register_script(MARK)
                self._pid = os.getpid()
            return self._client

    def mark(self, kind: str, n: int, exec_id: str, fence: int) -> int:
        client = self.client
        return int(
            self._script(
                keys=[f"{self.ns}runs", f"{self.ns}running"],
                args=[kind, n, exec_id, fence, os.getpid()],
                client=client,
            )
        )

    def incr(self, what: str) -> None:
        self.client.incr(f"{self.ns}count:{what}")

    def push(self, name: str, value: str) -> None:
        self.client.rpush(f"{self.ns}{name}", value)


def make_app(
    *,
    broker_url: str,
    backend_url: str,
    idem_url: str,
    marks_url: str,
    ns: str,
    prefix: str,
    lock_ttl: float,
    visibility_timeout: float = 3600,
    in_worker: bool = False,
) -> Celery:
    """The fault suite's app: the task ``faults.work`` on the given servers.

    ``in_worker`` connects the signal receivers that count deliveries, commits and replays;
    the test process, which only sends tasks, leaves them off.
    """
    app = Celery("fault_app", broker=broker_url, backend=backend_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": visibility_timeout,
            # a short visibility timeout is only useful if unacked messages are looked at often
            # (and a worker killed while it held the restore mutex must not stop restores for
            # the mutex's default 300 s)
            **(
                {
                    "unacked_restore_interval": 1,
                    "unacked_restore_throttle": 1,
                    "unacked_mutex_expire": max(1, int(visibility_timeout)),
                }
                if visibility_timeout < 60
                else {}
            ),
        },
        # A result collected after its test's private Redis stopped unsubscribes on the way
        # out; Celery before 5.6 retries that 20 times a second apart, per result.
        result_backend_transport_options={"retry_policy": {"max_retries": 1}},
        worker_hijack_root_logger=False,
        idempotency_url=idem_url,
        idempotency_key_prefix=prefix,
        idempotency_lock_ttl=lock_ttl,
        idempotency_retry_count=2,
        idempotency_retry_base_delay=0.05,
    )
    marks = Marks(marks_url, ns)

    def run_body(n: int, duration: float, cpu: bool = False) -> dict[str, Any]:
        lease = current_lease()
        if lease is None:
            raise RuntimeError("the body ran outside of a guard")
        exec_id = uuid.uuid4().hex[:12]
        marks.mark("start", n, exec_id, lease.fencing_token)
        if cpu:  # computes without yielding to an event loop (gevent, eventlet)
            end = time.monotonic() + duration
            while time.monotonic() < end:
                pass
        else:
            time.sleep(duration)
        marks.mark("end", n, exec_id, lease.fencing_token)
        return {"n": n, "exec": exec_id, "fence": lease.fencing_token}

    @app.task(base=IdempotentTask, shared=False, name="faults.work", idempotency_key="work:{n}")
    def work(n: int, duration: float, cpu: bool = False) -> dict[str, Any]:
        return run_body(n, duration, cpu)

    def on_prerun(sender: Any = None, **kwargs: Any) -> None:
        if sender is not None and sender.name.startswith("faults."):
            marks.incr("deliveries")

    def on_retry(sender: Any = None, reason: Any = None, **kwargs: Any) -> None:
        exc = getattr(reason, "exc", None) or reason
        marks.push("retries", type(exc).__name__)

    def on_committed(
        sender: Any = None, key: str = "", fencing_token: Any = None, **kw: Any
    ) -> None:
        marks.push("commits", f"{key}|{fencing_token}")

    def on_replayed(sender: Any = None, **kwargs: Any) -> None:
        marks.incr("replays")

    def on_contended(sender: Any = None, **kwargs: Any) -> None:
        marks.incr("contentions")

    def on_lease_lost(sender: Any = None, key: str = "", **kwargs: Any) -> None:
        marks.push("lease_lost", key)

    finalize_quietly(app)
    if not in_worker:
        return app
    # Strong references: these closures live as long as the app.
    signals.task_prerun.connect(on_prerun, weak=False)
    signals.task_retry.connect(on_retry, weak=False)
    idem_signals.idempotency_committed.connect(on_committed, weak=False)
    idem_signals.idempotency_replayed.connect(on_replayed, weak=False)
    idem_signals.idempotency_contended.connect(on_contended, weak=False)
    idem_signals.idempotency_lease_lost.connect(on_lease_lost, weak=False)
    return app


def finalize_quietly(app: Celery) -> None:
    """Finalize ``app`` without the other suites' name clashes.

    Finalizing registers every shared task (``@app.task`` without ``shared=False``) defined so
    far in this process, other test modules' included; their duplicate names are theirs, not
    this app's (whose tasks are all ``shared=False``).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DuplicateTaskNameWarning)
        app.finalize(auto=True)


def config_from_env(environ: Any = os.environ) -> dict[str, Any]:
    """:func:`make_app`'s arguments from ``FAULT_*`` variables."""
    missing = [name for name in ENV_KEYS if name not in environ]
    if missing:
        raise RuntimeError(f"fault_app needs the environment variables {', '.join(missing)}")
    return {
        "broker_url": environ["FAULT_BROKER_URL"],
        "backend_url": environ["FAULT_BACKEND_URL"],
        "idem_url": environ["FAULT_IDEM_URL"],
        "marks_url": environ["FAULT_MARKS_URL"],
        "ns": environ["FAULT_NS"],
        "prefix": environ["FAULT_PREFIX"],
        "lock_ttl": float(environ["FAULT_LOCK_TTL"]),
        "visibility_timeout": float(environ.get("FAULT_VISIBILITY_TIMEOUT", 3600)),
    }


def env_for(config: dict[str, Any]) -> dict[str, str]:
    """The ``FAULT_*`` variables that make :func:`config_from_env` return ``config``."""
    return {f"FAULT_{name.upper()}": str(value) for name, value in config.items()}


if os.environ.get("FAULT_BROKER_URL"):  # in a worker: ``celery -A fault_app worker``
    app = make_app(**config_from_env(), in_worker=True)
