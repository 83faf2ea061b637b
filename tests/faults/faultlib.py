"""Helpers of the fault suite: reading the marks, checking exclusivity, a worker environment.

``FIGURES`` collects the numbers each fault test reports (deliveries, kills, restarts, double
executions...); ``tests/faults/conftest.py`` prints them at the end of the run and writes them
to ``$CELERY_IDEMPOTENT_FAULT_FIGURES`` (JSON) when that variable is set.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult

from celery_idempotent.servers.redis_server import forget_pending_results
from tests.faults.fault_app import env_for, make_app
from tests.support.leases import lease_held
from tests.support.redis_server import RedisServer
from tests.support.workers import CeleryWorker

HERE = Path(__file__).parent

#: figures per test, in the order the tests ran: {"worker kills": {"kills": 31, ...}, ...}
FIGURES: dict[str, dict[str, Any]] = {}

#: Tolerance when comparing a killed run's lease end with the next run's start. The claim
#: script sets the lock's PX first (expiry = the script's command time in whole ms + lock_ttl)
#: and reads TIME for the fence after it, so the lease really ends at or up to a few ms
#: *before* ``fence + lock_ttl``; a successor may legitimately start in that gap. Real
#: overlaps (no lock, a lock released early) are hundreds of ms or seconds long.
LEASE_TOLERANCE_US = 5_000


def record_figures(name: str, **figures: Any) -> None:
    """Keep ``figures`` under ``name`` for the end-of-run summary."""
    FIGURES.setdefault(name, {}).update(figures)


# --------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One execution of a body, from its marks: ``end_us`` is ``None`` for a killed run."""

    n: int
    exec_id: str
    fence: int
    pid: int
    start_us: int
    end_us: int | None = None

    def lease_end_us(self, lock_ttl: float) -> int:
        """When this run stopped holding the key, at the latest (server µs).

        A completed run commits after its end mark, so its successor claims after ``end_us``.
        A killed run's lease lasts ``lock_ttl`` from its claim, whose time is the fencing token
        (``max(last + 1, server time in µs)``): bodies here are far shorter than the renewal
        interval, so a killed run was never renewed. The lease's PX counts from the claim
        script's start in whole ms, before TIME is read: the true end lies between the value
        returned here and ``fence + lock_ttl``.
        """
        if self.end_us is not None:
            return self.end_us
        return self.fence + round(lock_ttl * 1_000_000) - LEASE_TOLERANCE_US


def text(value: bytes | str) -> str:
    """A Redis reply as text (clients here return bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def load_runs(client: redis.Redis, ns: str) -> dict[int, list[Run]]:
    """Every run recorded under ``ns``, by key number, in start order."""
    runs: dict[str, Run] = {}
    for raw in client.lrange(f"{ns}runs", 0, -1):
        kind, n, exec_id, fence, pid, us = text(raw).split("|")
        if kind == "start":
            runs[exec_id] = Run(int(n), exec_id, int(fence), int(pid), int(us))
        else:
            runs[exec_id].end_us = int(us)
    by_key: dict[int, list[Run]] = defaultdict(list)
    for run in runs.values():
        by_key[run.n].append(run)
    for each in by_key.values():
        each.sort(key=lambda r: r.start_us)
    return dict(by_key)


def overlaps(runs: dict[int, list[Run]], lock_ttl: float) -> list[tuple[Run, Run]]:
    """Pairs of runs of one key whose holding intervals overlap, or whose fences go backwards."""
    bad: list[tuple[Run, Run]] = []
    for each in runs.values():
        for index, later in enumerate(each):
            for earlier in each[:index]:
                if later.start_us < earlier.lease_end_us(lock_ttl) or later.fence <= earlier.fence:
                    bad.append((earlier, later))
    return bad


def commits_by_key(client: redis.Redis, ns: str) -> dict[str, list[int]]:
    """The fencing tokens each key was committed with (``idempotency_committed``)."""
    found: dict[str, list[int]] = defaultdict(list)
    for raw in client.lrange(f"{ns}commits", 0, -1):
        key, _, fence = text(raw).rpartition("|")
        found[key].append(int(fence))
    return dict(found)


def counter(client: redis.Redis, ns: str, what: str) -> int:
    return int(client.get(f"{ns}count:{what}") or 0)


def wait_ready(results: Iterable[AsyncResult], timeout: float) -> list[AsyncResult]:
    """Wait until every result is ready or ``timeout`` passes; the ones still pending."""
    pending = list(results)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        pending = [r for r in pending if not r.ready()]
        if pending:
            time.sleep(0.2)
    return pending


def lock_names(client: redis.Redis, prefix: str) -> list[bytes]:
    """Locks (not fences) under ``prefix`` whose lease is held right now (a lock whose lease
    ended without a commit stays a while as a tombstone that keeps its fencing token)."""
    return [
        name
        for name in client.scan_iter(match=f"{prefix}lock:*", count=1000)
        if not name.endswith(b":fence") and lease_held(client, name)
    ]


# --------------------------------------------------------------------------- environment


@dataclass
class FaultEnv:
    """Servers, the sending app and the worker(s) of one fault test."""

    config: dict[str, Any]
    app: Celery
    marks: redis.Redis
    idem: redis.Redis
    workers: list[CeleryWorker] = field(default_factory=list)

    @property
    def ns(self) -> str:
        return str(self.config["ns"])

    @property
    def prefix(self) -> str:
        return str(self.config["prefix"])

    @property
    def lock_ttl(self) -> float:
        return float(self.config["lock_ttl"])

    def start_worker(self, *, concurrency: int, queue: str, pool: str = "prefork") -> CeleryWorker:
        worker = CeleryWorker(
            "fault_app",
            pool=pool,
            concurrency=concurrency,
            queues=[queue],
            env=env_for(self.config),
            pythonpath=[HERE],
        )
        self.workers.append(worker)
        worker.start()
        return worker

    def logs(self) -> str:
        return "\n".join(w.log_tail(60) for w in self.workers)


@contextlib.contextmanager
def fault_env(
    *,
    broker: RedisServer,
    idem_url: str,
    lock_ttl: float,
    marks_url: str | None = None,
    visibility_timeout: float | None = None,
    broker_url: str | None = None,
) -> Iterator[FaultEnv]:
    """A :class:`FaultEnv`: broker and results on ``broker`` (db 1 and 2), marks on ``broker``
    (db 3) unless ``marks_url`` is given, locks and records at ``idem_url``. A short
    ``visibility_timeout`` brings back the unacked messages of a worker killed as a whole.
    ``broker_url`` (e.g. RabbitMQ) replaces the Redis broker; results and marks stay on
    ``broker``."""
    tag = uuid.uuid4().hex[:8]
    config: dict[str, Any] = {
        "broker_url": broker_url or broker.url_for(db=1),
        "backend_url": broker.url_for(db=2),
        "idem_url": idem_url,
        "marks_url": marks_url or broker.url_for(db=3),
        "ns": f"marks:{tag}:",
        "prefix": f"faults:{tag}:",
        "lock_ttl": lock_ttl,
    }
    if visibility_timeout is not None:
        config["visibility_timeout"] = visibility_timeout
    app = make_app(**config)
    marks = redis.Redis.from_url(config["marks_url"])
    idem = redis.Redis.from_url(idem_url, socket_timeout=5)
    env = FaultEnv(config=config, app=app, marks=marks, idem=idem)
    try:
        yield env
    finally:
        for worker in env.workers:
            worker.stop(timeout=10)
            worker.remove_log()
        forget_pending_results(app)
        app.close()
        marks.close()
        idem.close()
