"""Publish throughput: ``apply_async`` of an ``IdempotentTask`` (publish-side check on) against
the same call of a plain task, to a Redis broker queue that no worker consumes.

Both tasks take distinct arguments each call (every publish is a first one: the check sets a
queued marker, then the message is published). Blocks alternate between the two kinds, the
order rotated per round. The idempotency client counts its round trips: the check is one.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery

from benchmarks._counting import Counter, counting_client


def run(url: str, prefix: str, *, rounds: int, calls: int) -> dict[str, Any]:
    """Publishes per second of each kind, their ratio, and round trips per checked publish."""
    from celery_idempotent import IdempotentTask
    from celery_idempotent.task import reset_backends

    queue = f"{prefix}publish"
    idem = counting_client(url)
    app = Celery("cibench_publish", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_serializer="json",
        broker_connection_retry_on_startup=True,
        broker_transport_options={"global_keyprefix": f"{prefix}kombu:"},
        idempotency_client=idem,
        idempotency_key_prefix=f"{prefix}pub:",
        idempotency_publish_ttl=600,
    )

    @app.task(name="cibench.publish.plain", shared=False)
    def plain(i: int, tag: str) -> int:
        return i

    @app.task(name="cibench.publish.idempotent", base=IdempotentTask, shared=False)
    def idempotent(i: int, tag: str) -> int:
        return i

    reset_backends()
    seconds = {"plain": 0.0, "idempotent": 0.0}
    trips = 0
    counter = 0
    tasks = {"plain": plain, "idempotent": idempotent}
    for warm in range(50):
        plain.apply_async((warm, "warm"))
        idempotent.apply_async((warm, "warm"))
    for r in range(rounds):
        order = ["plain", "idempotent"] if r % 2 == 0 else ["idempotent", "plain"]
        for kind in order:
            task = tasks[kind]
            before = Counter.sends
            t0 = time.perf_counter()
            for _ in range(calls):
                counter += 1
                task.apply_async((counter, "run"))
            seconds[kind] += time.perf_counter() - t0
            if kind == "idempotent":
                trips += Counter.sends - before
    n = rounds * calls
    out = {
        "publishes_per_kind": n,
        "plain_per_s": round(n / seconds["plain"]),
        "idempotent_per_s": round(n / seconds["idempotent"]),
        "ratio": round(seconds["plain"] / seconds["idempotent"], 3),
        "idempotency_round_trips_per_publish": trips / n,
    }
    reset_backends()
    app.close()
    idem.close()
    return out
