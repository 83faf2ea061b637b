"""The Celery app that the worker subprocesses and the test process share.

Configured from the environment (read at import and again by :func:`configure`):

- ``CIDEM_BROKER_URL``: broker (Redis, Sentinel with ``CIDEM_BROKER_MASTER``, or AMQP);
  ``CIDEM_BACKEND_URL``: result backend (Redis);
  ``CIDEM_IDEMPOTENCY_URL``: ``idempotency_url`` (unset: the broker fallback).
- ``CIDEM_PREFIX``: every Redis key of a test session starts with it (idempotency records and
  locks, the kombu broker keys, the result backend keys, the side-effect counters).
- ``CIDEM_QUEUE``: the default queue.

Bodies count their side effects in Redis (``INCR``), so that the test process can see how often
each one really ran, in any worker process.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery

from celery_idempotent import IdempotentTask, current_lease, signals

app = Celery("cidem_app", set_as_current=False)

_clients: dict[int, redis.Redis] = {}


def configure(target: Celery, env: Mapping[str, str]) -> None:
    """Configure ``target`` from ``env`` (see the module doc)."""
    prefix = env.get("CIDEM_PREFIX", "test:cidem:")
    broker = env.get("CIDEM_BROKER_URL", "redis://127.0.0.1:6379/0")
    backend = env.get("CIDEM_BACKEND_URL") or broker
    conf: dict[str, Any] = {
        "broker_url": broker,
        "result_backend": backend,
        "task_default_queue": env.get("CIDEM_QUEUE", "cidem"),
        "result_backend_transport_options": {"global_keyprefix": f"{prefix}celery:"},
        "result_expires": 600,
        "result_serializer": "json",
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
        "idempotency_key_prefix": f"{prefix}idem:",
        "cidem_prefix": prefix,
        "cidem_counter_url": backend,
    }
    if broker.startswith("redis"):
        conf["broker_transport_options"] = {"global_keyprefix": f"{prefix}kombu:"}
    elif broker.startswith("sentinel"):  # CIDEM_BROKER_MASTER: the Sentinel's master name
        conf["broker_transport_options"] = {
            "global_keyprefix": f"{prefix}kombu:",
            "master_name": env["CIDEM_BROKER_MASTER"],
        }
    idem_url = env.get("CIDEM_IDEMPOTENCY_URL")
    if idem_url:
        conf["idempotency_url"] = idem_url
    cluster_nodes = env.get("CIDEM_IDEMPOTENCY_CLUSTER")
    if cluster_nodes:
        conf["idempotency_client"] = _cluster_client_factory(cluster_nodes)
    target.conf.update(conf)


def _cluster_client_factory(nodes: str) -> Any:
    """An ``idempotency_client`` factory for a Redis Cluster (``host:port,host:port``) that
    counts its calls per process in the counter Redis (``fx:client-factory`` hash)."""

    def make() -> Any:
        from redis.cluster import ClusterNode, RedisCluster

        client().hincrby(ckey("client-factory"), str(os.getpid()), 1)
        startup = [
            ClusterNode(h, int(p)) for h, _, p in (n.rpartition(":") for n in nodes.split(","))
        ]
        return RedisCluster(startup_nodes=startup, socket_timeout=5)

    return make


configure(app, os.environ)


# --------------------------------------------------------------------------- side effects


def client() -> redis.Redis:
    """A Redis client for the counters, one per process (never shared across a fork)."""
    pid = os.getpid()
    found = _clients.get(pid)
    if found is None:
        found = _clients[pid] = redis.Redis.from_url(app.conf.cidem_counter_url)
    return found


def ckey(*parts: Any) -> str:
    """A counter key under the session prefix."""
    return app.conf.cidem_prefix + "fx:" + ":".join(str(p) for p in parts)


def bump(*parts: Any) -> int:
    """Count one side effect."""
    return int(client().incr(ckey(*parts)))


def redis_now() -> float:
    """Redis server time in seconds: one clock for every process."""
    sec, usec = client().time()
    return sec + usec / 1_000_000


def token() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- tasks


@app.task(base=IdempotentTask)
def work(tag: str, x: Any, sleep: float = 0.0) -> dict[str, Any]:
    """Key from the arguments."""
    n = bump("work", tag)
    time.sleep(sleep)
    return {"x": x, "run": n, "token": token()}


@app.task(base=IdempotentTask, idempotency_key="task_id")
def work_by_id(tag: str, x: Any, sleep: float = 0.0) -> dict[str, Any]:
    """Key from the task id."""
    n = bump("work_by_id", tag)
    time.sleep(sleep)
    return {"x": x, "run": n, "token": token()}


@app.task(base=IdempotentTask)
def lease_info(tag: str) -> dict[str, Any]:
    lease = current_lease()
    assert lease is not None
    return {"resource": lease.resource, "fencing_token": lease.fencing_token}


@app.task(
    base=IdempotentTask,
    acks_late=True,
    reject_on_worker_lost=True,
    idempotency_lock_ttl=3,
    idempotency_retry_count=0,
    idempotency_retry_base_delay=0.05,
)
def fragile(tag: str, first_duration: float) -> dict[str, Any]:
    """Records its runs as ``start:<t>:<pid>`` / ``end:<t>:<pid>`` (Redis time); the first run
    takes ``first_duration`` seconds (long enough to be killed), later ones 0.2 s."""
    lease = current_lease()
    assert lease is not None
    r = client()
    n = bump("fragile", tag)
    r.rpush(ckey("fragile-runs", tag), f"start:{redis_now()}:{os.getpid()}:{n}")
    r.set(ckey("fragile-lock", tag), lease.resource)
    r.set(ckey("fragile-pid", tag, n), os.getpid())
    time.sleep(first_duration if n == 1 else 0.2)
    r.rpush(ckey("fragile-runs", tag), f"end:{redis_now()}:{os.getpid()}:{n}")
    return {"run": n, "token": token()}


@app.task(base=IdempotentTask, bind=True, max_retries=5, idempotency_lock_ttl=10)
def flaky(self: Any, tag: str, fail_times: int) -> dict[str, Any]:
    """Retries itself ``fail_times`` times (``self.retry``), then succeeds."""
    n = bump("flaky", tag)
    client().rpush(ckey("flaky-times", tag), redis_now())
    if n <= fail_times:
        raise self.retry(countdown=0.05)
    return {"attempts": n, "retries": self.request.retries, "token": token()}


@app.task(
    base=IdempotentTask,
    bind=True,
    autoretry_for=(KeyError,),
    max_retries=3,
    default_retry_delay=0.05,
    retry_jitter=False,
    idempotency_lock_ttl=10,
)
def auto(self: Any, tag: str, x: int, fail_times: int = 1) -> dict[str, Any]:
    """Retried by Celery's ``autoretry_for`` (which wraps ``run``)."""
    n = bump("auto", tag)
    if n <= fail_times:
        raise KeyError("transient")
    return {"attempts": n, "retries": self.request.retries, "token": token()}


_LONG = {
    "idempotency_lock_ttl": 2,
    "idempotency_retry_count": 0,
    "idempotency_retry_base_delay": 0.05,
}


@app.task(
    base=IdempotentTask,
    max_retries=1,
    default_retry_delay=0.1,
    idempotency_on_locked="retry",
    **_LONG,
)
def long_retry(tag: str, duration: float) -> dict[str, Any]:
    """A body longer than max_retries x countdown; duplicates re-queue (not counted)."""
    n = bump("long_retry", tag)
    time.sleep(duration)
    return {"run": n, "token": token()}


@app.task(base=IdempotentTask, idempotency_on_locked="raise", **_LONG)
def long_raise(tag: str, duration: float) -> dict[str, Any]:
    n = bump("long_raise", tag)
    time.sleep(duration)
    return {"run": n, "token": token()}


@app.task(base=IdempotentTask, idempotency_on_locked="ignore", **_LONG)
def long_ignore(tag: str, duration: float) -> dict[str, Any]:
    n = bump("long_ignore", tag)
    time.sleep(duration)
    return {"run": n, "token": token()}


@app.task(base=IdempotentTask, bind=True, **_LONG)
def held(self: Any, tag: str, duration: float, fail: bool) -> int:
    """Records the headers of the delivery that runs it; ``fail`` stores nothing."""
    n = bump("held", tag)
    headers = json.dumps(self.request.headers or {}, default=str)
    client().set(ckey("held-headers", tag, n), headers)
    time.sleep(duration)
    if fail:
        raise RuntimeError("the first holder fails: nothing is stored")
    return n


@app.task(base=IdempotentTask)
def add(x: int, y: int, tag: str) -> int:
    """Chain step: the previous step's result comes first."""
    bump("add", tag, x, y)
    return x + y


@app.task(base=IdempotentTask)
def total(values: list[int], tag: str) -> int:
    """Chord callback."""
    bump("total", tag)
    return sum(values)


@app.task(base=IdempotentTask)
def collect(values: list[Any], tag: str) -> list[Any]:
    """Chord callback over dicts: their tokens."""
    bump("collect", tag)
    return [v["token"] for v in values]


@app.task(
    base=IdempotentTask,
    idempotency_key="task_id",
    idempotency_on_locked="raise",
    idempotency_retry_count=0,
)
def fact(tag: str, n: int) -> int:
    """Calls itself directly: those inner calls are plain function calls."""
    bump("fact", tag)
    return 1 if n <= 1 else n * fact(tag, n - 1)


@app.task(base=IdempotentTask)
def charge(tag: str, order_id: int, amount: int) -> dict[str, Any]:
    n = bump("charge", tag)
    return {"charged": amount, "run": n, "token": token()}


@app.task(base=IdempotentTask)
def refund(tag: str, order_id: int, amount: int) -> dict[str, Any]:
    n = bump("refund", tag)
    return {"refunded": amount, "run": n, "token": token()}


@app.task(base=IdempotentTask)
def with_defaults(tag: str, x: int, y: int = 5) -> dict[str, Any]:
    n = bump("with_defaults", tag)
    return {"sum": x + y, "run": n, "token": token()}


@app.task(base=IdempotentTask)
def pair(tag: str, a: Any, b: Any) -> tuple[Any, Any]:
    """Returns a tuple: JSON delivers a list, the first time and on replay."""
    bump("pair", tag)
    return (a, b)


@app.task(base=IdempotentTask, bind=True)
def show_request(self: Any, tag: str) -> dict[str, Any]:
    return {
        "headers": self.request.headers,
        "idempotency_key": getattr(self.request, "idempotency_key", None),
    }


@app.task(base=IdempotentTask)
def steal(tag: str) -> str:
    """Loses its lease: deletes its own lock, as an expiry plus another claim would."""
    lease = current_lease()
    assert lease is not None
    bump("steal", tag)
    client().delete(lease.resource)
    return token()


@app.task(
    base=IdempotentTask, idempotency_on_locked="raise", **{**_LONG, "idempotency_retry_count": 2}
)
def contend(tag: str, duration: float) -> str:
    bump("contend", tag)
    time.sleep(duration)
    return token()


@app.task(base=IdempotentTask)
def boom(tag: str) -> str:
    """Its signal receivers raise (see below); the task must not notice."""
    bump("boom", tag)
    return token()


# --------------------------------------------------------------------------- every pool

# A 1 s lease: a body of 3 s outlives it three times over, so it keeps its key only while its
# lease is renewed.
_SHORT_LEASE = {
    "idempotency_lock_ttl": 1,
    "idempotency_retry_count": 0,
    "idempotency_retry_base_delay": 0.05,
}


def mark(kind: str, tag: str, n: int, what: str) -> None:
    """Append ``<what>:<Redis time>:<pid>:<n>`` to the runs of ``kind``/``tag``."""
    client().rpush(ckey(f"{kind}-runs", tag), f"{what}:{redis_now()}:{os.getpid()}:{n}")


@app.task(base=IdempotentTask, **_SHORT_LEASE)
def coop(tag: str, duration: float) -> dict[str, Any]:
    """Waits cooperatively (``time.sleep`` yields under gevent/eventlet), like an HTTP call."""
    n = bump("coop", tag)
    mark("coop", tag, n, "start")
    time.sleep(duration)
    mark("coop", tag, n, "end")
    return {"run": n, "token": token()}


@app.task(base=IdempotentTask, **_SHORT_LEASE)
def spin(tag: str, duration: float) -> dict[str, Any]:
    """Computes for ``duration`` seconds without yielding to an event loop (a CPU loop)."""
    n = bump("spin", tag)
    mark("spin", tag, n, "start")
    end = time.monotonic() + duration
    loops = 0
    while time.monotonic() < end:
        loops += 1
    mark("spin", tag, n, "end")
    return {"run": n, "loops": loops, "token": token()}


_LIMITED = {
    "idempotency_lock_ttl": 2,
    "idempotency_retry_count": 0,
    "idempotency_retry_base_delay": 0.05,
}


def _limited_body(kind: str, tag: str, first_duration: float) -> dict[str, Any]:
    """The first run takes ``first_duration`` seconds (long enough to be cut), later ones
    0.1 s; each records its start and end (Redis time) and its fencing token."""
    lease = current_lease()
    assert lease is not None
    n = bump(kind, tag)
    client().set(ckey(f"{kind}-fence", tag, n), lease.fencing_token)
    mark(kind, tag, n, "start")
    time.sleep(first_duration if n == 1 else 0.1)
    mark(kind, tag, n, "end")
    return {"run": n, "token": token()}


@app.task(base=IdempotentTask, **_LIMITED)
def victim(tag: str, first_duration: float) -> dict[str, Any]:
    """Revoked with ``terminate=True`` while it runs."""
    return _limited_body("victim", tag, first_duration)


@app.task(base=IdempotentTask, time_limit=1.5, **_LIMITED)
def hard_limited(tag: str, first_duration: float) -> dict[str, Any]:
    """Killed by its hard ``time_limit`` when the first run outlasts it."""
    return _limited_body("hard_limited", tag, first_duration)


@app.task(base=IdempotentTask, soft_time_limit=1.0, **_LIMITED)
def soft_limited(tag: str, first_duration: float) -> dict[str, Any]:
    """Interrupted by ``SoftTimeLimitExceeded`` when the first run outlasts the soft limit."""
    return _limited_body("soft_limited", tag, first_duration)


# --------------------------------------------------------------------------- signals

SIGNALS = {
    "replayed": signals.idempotency_replayed,
    "contended": signals.idempotency_contended,
    "committed": signals.idempotency_committed,
    "lease_lost": signals.idempotency_lease_lost,
}


def _make_receiver(kind: str) -> Any:
    def receiver(sender: Any = None, **kwargs: Any) -> None:
        key = kwargs.get("key")
        record = {
            "sender": getattr(sender, "name", None),
            "pid": os.getpid(),
            **{k: v for k, v in kwargs.items() if k != "signal"},
        }
        pipe = client().pipeline()
        pipe.incr(ckey("sig", kind, key))
        pipe.rpush(ckey("sigdata", kind, key), json.dumps(record, default=str))
        pipe.execute()

    receiver.__name__ = f"count_{kind}"
    return receiver


def _raising_receiver(sender: Any = None, **kwargs: Any) -> None:
    if getattr(sender, "name", "").endswith(".boom"):
        raise RuntimeError("a receiver that fails")


for _kind, _signal in SIGNALS.items():
    _signal.connect(_raising_receiver, weak=False)
    _signal.connect(_make_receiver(_kind), weak=False)
    _signal.connect(_raising_receiver, weak=False, dispatch_uid=f"raise-after-{_kind}")
