"""The stage of one run: Redis (given or embedded), the workers, the app; set up and torn down.

Every process started here is stopped by its pid or process group, and the temporary
directory is removed, whatever happened in between (:meth:`Stage.close`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from celery_idempotent.servers.processes import pid_alive, tail
from celery_idempotent.servers.redis_server import PrivateRedis, forget_pending_results
from example_project.demo.console import Console, redact_url
from example_project.demo.options import Options
from example_project.demo.processes import Worker, start_redis

__all__ = ["DemoError", "Stage"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class DemoError(RuntimeError):
    """The run could not be carried out (a worker died, a timeout)."""


class Stage:
    """Redis, the workers and this process's app, for one run under ``namespace``."""

    def __init__(self, options: Options, console: Console, namespace: str) -> None:
        self.opts = options
        self.console = console
        self.namespace = namespace
        self.workdir: Path | None = None
        self.logdir = Path(options.log_dir).resolve() if options.log_dir else None
        self.redis: PrivateRedis | None = None
        self.workers: list[Worker] = []
        self.pool_pids: set[int] = set()
        self.app: Any = None
        self.tasks: Any = None
        self.world: Any = None
        self.started = time.monotonic()
        self.urls: dict[str, str] = {}
        self.redis_info = ""

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- set-up ----------------------------------------------------------------------------

    def setup(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="example-shop-"))
        if self.logdir is not None:
            self.logdir.mkdir(parents=True, exist_ok=True)
        opts = self.opts
        if opts.redis_url:
            redis_url = opts.redis_url
            urls = {"broker": opts.broker_url or redis_url, "results": redis_url,
                    "idempotency": redis_url}  # fmt: skip
            self.redis_info = f"Redis {redact_url(redis_url)} (given)"
        else:
            self.redis = start_redis(self.workdir, logdir=self.logdir)
            # One database each, as recommended: purging the broker never forgets what ran.
            urls = {"broker": opts.broker_url or self.redis.url(0), "results": self.redis.url(1),
                    "idempotency": self.redis.url(2)}  # fmt: skip
            self.redis_info = (
                f"embedded redis-server {self.redis.version()} (pid {self.redis.pid}, "
                f"{self.redis.binary}) on {self.redis.url()}"
            )
        self.urls = urls
        self.console.info(self.redis_info)
        env = {
            "EXAMPLE_BROKER_URL": urls["broker"],
            "EXAMPLE_RESULT_BACKEND": urls["results"],
            "EXAMPLE_IDEMPOTENCY_URL": urls["idempotency"],
            "EXAMPLE_LEDGER_URL": urls["idempotency"],
            "EXAMPLE_NAMESPACE": self.namespace,
            "EXAMPLE_LOCK_TTL": str(opts.lock_ttl),
            "EXAMPLE_LATENCY": str(opts.latency),
            "EXAMPLE_MAIL_RETRY_BASE": "0.2",
            "EXAMPLE_REMOTE_CONTROL": "0",
            "EXAMPLE_IDEMPOTENCY_ENABLED": "0" if opts.without_idempotency else "1",
        }
        # This process publishes with the same settings the workers read.
        os.environ.update(env)
        worker_env = dict(os.environ)
        worker_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        from example_project import settings, tasks
        from example_project.celery import app
        from example_project.shop import world

        if self.namespace != settings.NAMESPACE:
            raise DemoError("example_project.settings was imported before the demo configured it")
        self.app = app
        self.tasks = tasks
        self.world = world()
        for i in range(opts.workers):
            worker = Worker(
                f"w{i + 1}-{self.namespace}",
                pool=opts.pool,
                concurrency=opts.concurrency,
                queue=settings.task_default_queue,
                env=worker_env,
                workdir=self.workdir,
                logdir=self.logdir,
                loglevel="INFO" if self.logdir else "WARNING",
            )
            worker.start()
            self.workers.append(worker)
        pids = ", ".join(str(w.pid) for w in self.workers)
        self.console.info(
            f"{opts.workers} celery workers, pool {opts.pool} × {opts.concurrency} "
            f"(pids {pids}), "
            f"broker {redact_url(urls['broker'])}"
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_workers()
            ready = self.world.client.scard(self.world.key("ready"))
            if ready >= len(self.workers):
                self.refresh_pool_pids()
                return
            self.console.progress(
                f"[{self.elapsed():5.1f}s] starting workers: {ready}/{len(self.workers)} ready"
            )
            time.sleep(0.1)
        raise DemoError(f"workers not ready after {timeout:.0f}s:\n{self.worker_logs()}")

    def check_workers(self) -> None:
        for worker in self.workers:
            if not worker.alive():
                raise DemoError(f"worker {worker.name} exited early:\n{tail(worker.log)}")

    def worker_logs(self) -> str:
        return "\n".join(f"--- {w.name} ---\n{tail(w.log)}" for w in self.workers)

    def refresh_pool_pids(self) -> None:
        self.pool_pids |= {int(p) for p in self.world.client.smembers(self.world.key("pids"))}

    # -- tear-down -----------------------------------------------------------------------------

    def close(self, task_ids: Iterable[str], *, quick: bool = False) -> dict[str, Any]:
        """Stop everything this run started, remove its files; report what was left running.

        On a Redis that is not ours, this run's keys go too, with the results of ``task_ids``.
        """
        if self.world is not None:
            with contextlib.suppress(Exception):
                self.refresh_pool_pids()  # replacements of killed processes included
        for worker in self.workers:  # all at once, then wait for each
            worker.terminate()
        for worker in self.workers:
            worker.stop(timeout=3.0 if quick else 10.0)
        if self.redis is None and self.world is not None:
            try:
                self._delete_keys(task_ids)
            except Exception as exc:  # the report matters more; say what is left
                self.console.info(f"warning: could not delete this run's keys: {exc!r}")
        if self.app is not None:
            # Before Redis stops: a result collected afterwards would hang the exit.
            forget_pending_results(self.app)
        if self.redis is not None:
            self.redis.stop()
        if self.app is not None:
            with contextlib.suppress(Exception):
                self.app.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        redis_pid = self.redis.pid if self.redis else None
        worker_pids = [w.pid for w in self.workers if w.pid]
        started: dict[str, Any] = {
            "redis": redis_pid,
            "workers": worker_pids,
            "pool": sorted(self.pool_pids),
        }
        every = [p for p in (redis_pid, *worker_pids, *self.pool_pids) if p]
        return {
            "started": started,
            "left_running": [p for p in every if pid_alive(p)],
            "workdir": str(self.workdir) if self.workdir else None,
            "workdir_removed": self.workdir is None or not self.workdir.exists(),
        }

    def _delete_keys(self, task_ids: Iterable[str]) -> None:
        """On a Redis that is not ours: delete this run's keys, results and queue."""
        import redis

        from example_project import settings

        client = self.world.client
        for key in client.scan_iter(match=f"{self.namespace}:*", count=1000):
            client.unlink(key)
        ids = sorted(task_ids)
        results = redis.Redis.from_url(self.urls["results"])
        try:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                results.unlink(*[self.app.backend.get_key_for_task(i) for i in chunk])
        finally:
            results.close()
        queue = settings.task_default_queue
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        if self.urls["broker"].startswith(("redis://", "rediss://", "unix://")):
            # Kombu's Redis transport keeps the queue's bindings (and priority lists) in keys
            # named after the queue and its exchange, which share this run's unique name.
            broker = redis.Redis.from_url(self.urls["broker"])
            try:
                for key in broker.scan_iter(match=f"*{queue}*", count=1000):
                    broker.unlink(key)
            finally:
                broker.close()
