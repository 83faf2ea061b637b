"""Prometheus metrics from the library's signals (``pip install 'celery-idempotent[prometheus]'``).

Call :func:`install` once, in the module that defines the Celery app (the worker and the
publishing processes import it)::

    from celery_idempotent.contrib import prometheus

    prometheus.install()

Every signal of :mod:`celery_idempotent.signals` becomes a counter labelled by task (never by
key: keys are unbounded), and the guard's time a histogram:

=================================================  ===========================================
metric                                             counts
=================================================  ===========================================
``celery_idempotency_committed_total{task}``       bodies that ran and committed their result
``celery_idempotency_replayed_total{task}``        duplicates answered with the stored result
``celery_idempotency_contended_total{task}``       lock attempts that found the key held
``celery_idempotency_lease_lost_total{task}``      bodies whose lease was lost (alert on it)
``celery_idempotency_publish_stopped_total``       duplicates stopped at publish (``state``)
``celery_idempotency_mismatch_refused_total``      calls refused for another payload (``where``)
``celery_idempotency_backend_unreachable_total``   backend errors (``where``: worker, publish)
``celery_idempotency_seconds{task,outcome}``       guard time of committed and replayed calls
=================================================  ===========================================

**Prefork needs prometheus-client's multiprocess mode.** Each pool child is a process of its
own with its own counters; a scrape of one process sees only its own. Set
``PROMETHEUS_MULTIPROC_DIR`` to an empty directory in the worker's environment *before it
starts* (prometheus-client reads it when it is imported), and serve the metrics from the main
worker process with :func:`serve`, which sums the children's files
(``MultiProcessCollector``). A child that exits is marked dead (``worker_process_shutdown``)
so its live gauges go; its counters stay counted. Threads, solo, gevent and eventlet pools are
one process: :func:`serve` then serves the process's own registry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["Metrics", "install", "registry_for_scrape", "serve"]

_installed: Metrics | None = None


@dataclass(frozen=True)
class Metrics:
    """The metrics :func:`install` made (prometheus-client objects)."""

    committed: Any
    replayed: Any
    contended: Any
    lease_lost: Any
    publish_stopped: Any
    mismatch_refused: Any
    backend_unreachable: Any
    seconds: Any


def _client() -> Any:
    try:
        import prometheus_client  # noqa: PLC0415 - optional dependency
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "celery_idempotent.contrib.prometheus needs prometheus-client: "
            "pip install 'celery-idempotent[prometheus]'"
        ) from exc
    return prometheus_client


def _multiprocess() -> Any:
    import importlib  # noqa: PLC0415

    return importlib.import_module("prometheus_client.multiprocess")


def install(registry: Any = None, *, namespace: str = "celery_idempotency") -> Metrics:
    """Create the metrics (in ``registry``, default: prometheus-client's) and connect them to
    the library's signals; idempotent per process (a second call returns the first's)."""
    global _installed  # noqa: PLW0603 - one set of receivers per process
    if _installed is not None:
        return _installed
    from celery import signals as celery_signals  # noqa: PLC0415

    from celery_idempotent import signals  # noqa: PLC0415

    client = _client()
    kw: dict[str, Any] = {"namespace": namespace}
    if registry is not None:
        kw["registry"] = registry
    m = Metrics(
        committed=client.Counter("committed", "Bodies that ran and committed", ["task"], **kw),
        replayed=client.Counter("replayed", "Duplicates given the stored result", ["task"], **kw),
        contended=client.Counter("contended", "Lock attempts that found it held", ["task"], **kw),
        lease_lost=client.Counter("lease_lost", "Bodies whose lease was lost", ["task"], **kw),
        publish_stopped=client.Counter(
            "publish_stopped", "Duplicates stopped at publish", ["task", "state"], **kw
        ),
        mismatch_refused=client.Counter(
            "mismatch_refused", "Calls refused for another payload", ["task", "where"], **kw
        ),
        backend_unreachable=client.Counter(
            "backend_unreachable", "Idempotency backend errors", ["task", "where"], **kw
        ),
        seconds=client.Histogram(
            "seconds", "Guard time of committed and replayed calls", ["task", "outcome"], **kw
        ),
    )

    def committed(sender: Any, elapsed: float = 0.0, **_: Any) -> None:
        m.committed.labels(sender.name).inc()
        m.seconds.labels(sender.name, "committed").observe(elapsed)

    def replayed(sender: Any, elapsed: float = 0.0, **_: Any) -> None:
        m.replayed.labels(sender.name).inc()
        m.seconds.labels(sender.name, "replayed").observe(elapsed)

    def contended(sender: Any, **_: Any) -> None:
        m.contended.labels(sender.name).inc()

    def lease_lost(sender: Any, **_: Any) -> None:
        m.lease_lost.labels(sender.name).inc()

    def publish_stopped(sender: Any, state: str = "", **_: Any) -> None:
        m.publish_stopped.labels(sender.name, state).inc()

    def mismatch(sender: Any, where: str = "", **_: Any) -> None:
        m.mismatch_refused.labels(sender.name, where).inc()

    def unreachable(sender: Any, where: str = "", **_: Any) -> None:
        m.backend_unreachable.labels(sender.name, where).inc()

    def child_exited(pid: int | None = None, **_: Any) -> None:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            _multiprocess().mark_process_dead(pid or os.getpid())

    for signal, receiver in (
        (signals.idempotency_committed, committed),
        (signals.idempotency_replayed, replayed),
        (signals.idempotency_contended, contended),
        (signals.idempotency_lease_lost, lease_lost),
        (signals.idempotency_publish_stopped, publish_stopped),
        (signals.idempotency_mismatch_refused, mismatch),
        (signals.idempotency_backend_unreachable, unreachable),
        (celery_signals.worker_process_shutdown, child_exited),
    ):
        signal.connect(receiver, weak=False)
    _installed = m
    return m


def registry_for_scrape() -> Any:
    """The registry to expose: in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) a fresh one
    that sums every process's files, else prometheus-client's default registry."""
    client = _client()
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return client.REGISTRY
    registry = client.CollectorRegistry()
    _multiprocess().MultiProcessCollector(registry)
    return registry


def serve(port: int, addr: str = "0.0.0.0") -> Any:  # noqa: S104 - a metrics endpoint
    """Serve :func:`registry_for_scrape` over HTTP on ``port`` (call it in the worker's main
    process, e.g. from a ``worker_ready`` receiver); returns prometheus-client's server."""
    return _client().start_http_server(port, addr=addr, registry=registry_for_scrape())
