"""``python -m benchmarks.publish_ttl``: the figures behind ``idempotency_publish_ttl``'s default.

Since issue 22 a queued marker that a delivery has claimed lives only as long as that
delivery's lease; ``idempotency_publish_ttl`` bounds only a marker that **no delivery has
claimed yet**. So the TTL has to outlive the longest an unclaimed message that will still be
delivered can wait, and a TTL shorter than that costs one extra message per identical publish
made after the marker expired (the worker's guard replays it: never a second execution).
With real ``celery worker`` processes and a private ``redis-server`` this measures:

1. **queue time** of a backlog: ``--backlog`` idempotent no-op tasks published at once to one
   prefork worker (publish to start of the body; the throughput says how long a backlog 3600 s
   covers);
2. **redelivery of a whole killed worker** (SIGKILL of its main process and children):
   on the Redis broker, the claimed message (``acks_late``) and a prefetched message no
   delivery claimed (early ack) come back only after kombu's ``visibility_timeout``
   (``--visibility``, 3600 s by default in kombu) once another worker restores them; on
   RabbitMQ (``--rabbitmq-url``) the broker re-queues the unacked message as soon as the
   connection drops;
3. **what a shorter TTL costs**: a call published with ``idempotency_publish_ttl=1`` to a
   queue no worker consumes yet, the identical call again after the marker expired (two
   messages), then a worker: one execution, the second message replayed.

Prints one line per figure and, with ``--json PATH``, writes them there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """One ``celery worker`` of ``benchmarks.publish_ttl_app`` in its own process group."""

    def __init__(self, env: dict[str, str], queue: str, concurrency: int = 1) -> None:
        self.log = tempfile.NamedTemporaryFile(suffix=".log", delete=False)  # noqa: SIM115
        full = {**os.environ, **env}
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full.get("PYTHONPATH")]))
        command = [
            *(sys.executable, "-m", "celery", "-A", "benchmarks.publish_ttl_app", "worker"),
            *("-P", "prefork", "-c", str(concurrency), "-Q", queue),
            *("-n", f"pt-{uuid.uuid4().hex[:6]}@%h", "-l", "info"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        ]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            command,
            cwd=str(ROOT),
            env=full,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds from the start until the worker logged ``ready``."""
        deadline = time.monotonic() + timeout
        while b" ready." not in Path(self.log.name).read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start:\n" + Path(self.log.name).read_text())
            time.sleep(0.05)
        return time.monotonic() - self.started

    def kill(self) -> None:
        """SIGKILL the whole worker: its main process and every pool child at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def _app(env: dict[str, str]) -> ModuleType:
    os.environ.update(env)
    from celery_idempotent import settings
    from celery_idempotent.celery.factory import reset_backends

    sys.modules.pop("benchmarks.publish_ttl_app", None)
    settings.clear_cache()
    reset_backends()
    return importlib.import_module("benchmarks.publish_ttl_app")


def _wait(what: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return got


def queue_time(base: dict[str, str], backlog: int) -> dict[str, Any]:
    app = _app(base)
    queue = f"pt-backlog-{uuid.uuid4().hex[:6]}"
    worker = Worker(base, queue, concurrency=2)
    try:
        worker.wait_ready()
        tags = [f"b{uuid.uuid4().hex[:8]}-{i}" for i in range(backlog)]
        published = {}
        for tag in tags:
            published[tag] = time.time()
            app.noop.apply_async((tag,), queue=queue)
        _wait(lambda: all(app.started(t) for t in tags[-5:]), 300)
        _wait(lambda: all(app.started(t) for t in tags), 60)
        waits = sorted(app.started(t)[0] - published[t] for t in tags)
        span = max(app.started(t)[0] for t in tags) - min(published.values())
    finally:
        worker.stop()
    return {
        "backlog": backlog,
        "queue_time_p50_s": round(statistics.median(waits), 3),
        "queue_time_p95_s": round(waits[int(0.95 * (len(waits) - 1))], 3),
        "queue_time_max_s": round(waits[-1], 3),
        "throughput_per_s": round(backlog / span, 1),
        "backlog_3600s_covers": int(3600 * backlog / span),
    }


def redis_redelivery(base: dict[str, str], visibility: float) -> dict[str, Any]:
    """A whole worker killed: when do the claimed and the prefetched message come back?"""
    out: dict[str, Any] = {"visibility_timeout_s": visibility}
    for acks_late in (True, False):
        env = {**base, "PT_VISIBILITY": str(visibility), "PT_ACKS_LATE": "1" if acks_late else ""}
        app = _app(env)
        queue = f"pt-redis-{uuid.uuid4().hex[:6]}"
        first = Worker(env, queue)
        first.wait_ready()
        running, waiting = f"r{uuid.uuid4().hex[:8]}", f"w{uuid.uuid4().hex[:8]}"
        app.sleeps_once.apply_async((running,), queue=queue)
        app.noop.apply_async((waiting,), queue=queue)
        _wait(lambda r=running, a=app: a.started(r), 30)
        time.sleep(0.5)  # early ack: the second message is reserved (prefetched) meanwhile
        marker = app.noop.idempotency_status((waiting,))
        killed = time.time()
        first.kill()
        second = Worker(env, queue)
        try:
            ready = second.wait_ready()
            if acks_late:
                _wait(lambda r=running, a=app: len(a.started(r)) == 2, visibility + 60)
                out["claimed_message_back_after_s"] = round(app.started(running)[1] - killed, 2)
            else:
                _wait(lambda w=waiting, a=app: a.started(w), visibility + 60)
                out["prefetched_unclaimed_back_after_s"] = round(
                    app.started(waiting)[0] - killed, 2
                )
                out["prefetched_marker_while_away"] = {
                    "state": str(marker.state),
                    "claimed": marker.claimed,
                }
                # Early ack: the killed run's message was acked, nothing brings it back.
                out["early_ack_killed_message_redelivered"] = len(app.started(running)) > 1
            out.setdefault("second_worker_ready_after_s", round(ready, 2))
        finally:
            second.stop()
            first.stop()
    return out


def rabbitmq_redelivery(base: dict[str, str], rabbitmq_url: str) -> dict[str, Any]:
    env = {**base, "PT_BROKER_URL": rabbitmq_url, "PT_ACKS_LATE": "1"}
    app = _app(env)
    queue = f"pt-amqp-{uuid.uuid4().hex[:6]}"
    worker = Worker(env, queue)
    try:
        worker.wait_ready()
        tag = f"a{uuid.uuid4().hex[:8]}"
        app.sleeps_once.apply_async((tag,), queue=queue)
        _wait(lambda: app.started(tag), 30)
        with app.app.connection_for_write() as conn:
            channel = conn.default_channel

            def ready_count() -> int:
                return int(channel.queue_declare(queue, passive=True).message_count)

            assert ready_count() == 0  # unacked, held by the worker
            killed = time.monotonic()
            worker.kill()
            _wait(lambda: ready_count() == 1, 30)
            back = time.monotonic() - killed
            channel.queue_delete(queue)
    finally:
        worker.stop()
    return {"claimed_message_back_after_s": round(back, 3)}


def shorter_ttl_cost(base: dict[str, str]) -> dict[str, Any]:
    app = _app(base)
    queue = f"pt-short-{uuid.uuid4().hex[:6]}"
    tag = f"s{uuid.uuid4().hex[:8]}"
    client = app.app.connection_for_write().default_channel.client
    one = app.noop.apply_async((tag,), queue=queue, idempotency_publish_ttl=1)
    same = app.noop.apply_async((tag,), queue=queue, idempotency_publish_ttl=1)
    _wait(lambda: app.noop.idempotency_status((tag,)).state == "absent", 10)  # marker expired
    two = app.noop.apply_async((tag,), queue=queue, idempotency_publish_ttl=1)
    messages = int(client.llen(queue))
    worker = Worker(base, queue)
    try:
        worker.wait_ready()
        values = (one.get(timeout=60), two.get(timeout=60))
    finally:
        worker.stop()
    return {
        "publishes": 3,
        "stopped_at_publish_while_marker_lived": same.id == one.id,
        "messages_in_queue": messages,
        "executions": len(app.started(tag)),
        "results": list(values),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.publish_ttl", description=__doc__)
    p.add_argument("--backlog", type=int, default=400, help="tasks published at once (400)")
    p.add_argument("--visibility", type=float, default=10.0, help="Redis visibility_timeout (10)")
    p.add_argument(
        "--rabbitmq-url",
        default=os.environ.get("RABBITMQ_URL"),
        help="RabbitMQ for the redelivery figure (default: $RABBITMQ_URL; none: skipped)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)

    from celery_idempotent.servers.redis_server import start_private_redis

    server = start_private_redis()
    base = {"PT_REDIS_URL": server.url(), "PT_BROKER_URL": "", "PT_ACKS_LATE": ""}
    figures: dict[str, Any] = {}
    try:
        for name, run in (
            ("shorter_ttl_cost", lambda: shorter_ttl_cost(base)),
            ("queue_time", lambda: queue_time(base, args.backlog)),
            ("redis_whole_worker_killed", lambda: redis_redelivery(base, args.visibility)),
        ):
            figures[name] = run()
            print(name, json.dumps(figures[name]), flush=True)
        if args.rabbitmq_url:
            figures["rabbitmq_whole_worker_killed"] = rabbitmq_redelivery(base, args.rabbitmq_url)
            print(
                "rabbitmq_whole_worker_killed",
                json.dumps(figures["rabbitmq_whole_worker_killed"]),
                flush=True,
            )
    finally:
        server.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
