"""The metrics example in ``celery_idempotent.signals``' docstring runs as written."""

from __future__ import annotations

import re
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from cliadmin_app import GATES, STARTED

from celery_idempotent import signals


class FakeStatsClient:
    """``statsd.StatsClient`` as the example uses it: ``incr`` and ``timing`` (ms)."""

    def __init__(self, host: str, port: int, prefix: str | None = None) -> None:
        self.prefix = prefix
        self.calls: list[tuple[str, str, float]] = []

    def incr(self, stat: str, count: int = 1) -> None:
        self.calls.append(("incr", stat, count))

    def timing(self, stat: str, delta: float) -> None:
        self.calls.append(("timing", stat, delta))


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The docstring's example, executed with a fake ``statsd``; disconnected afterwards."""
    doc = signals.__doc__ or ""
    block = re.search(r"::\n\n((?:    .*\n|\n)+)", doc)
    assert block, "no code block in the signals docstring"
    code = "\n".join(line[4:] for line in block.group(1).splitlines())
    monkeypatch.setitem(sys.modules, "statsd", types.SimpleNamespace(StatsClient=FakeStatsClient))
    namespace: dict[str, Any] = {}
    exec(compile(code, "signals-example", "exec"), namespace)  # noqa: S102 - our own docstring
    try:
        yield namespace
    finally:
        for name, signal in (
            ("on_committed", signals.idempotency_committed),
            ("on_replayed", signals.idempotency_replayed),
            ("on_contended", signals.idempotency_contended),
            ("on_lease_lost", signals.idempotency_lease_lost),
        ):
            signal.disconnect(namespace[name])


def test_the_metrics_example_counts_and_times(
    example: dict[str, Any], cli_app: Celery, key_prefix: str
) -> None:
    metrics: FakeStatsClient = example["metrics"]
    charge = cli_app.tasks["cliadmin.charge"]
    charge.apply((1, 10)).get()
    charge.apply((1, 10)).get()  # a duplicate: replayed

    gate = f"metrics-{key_prefix}"
    GATES[gate], STARTED[gate] = threading.Event(), threading.Event()
    hold = cli_app.tasks["cliadmin.hold"]
    deliveries = [threading.Thread(target=hold.apply, args=((gate,),)) for _ in range(2)]
    deliveries[0].start()
    assert STARTED[gate].wait(10)
    deliveries[1].start()  # a duplicate while the first holds the key: contention
    deadline = time.monotonic() + 10
    while ("incr", "contended.cliadmin.hold", 1) not in metrics.calls:
        assert time.monotonic() < deadline, metrics.calls
        time.sleep(0.01)
    GATES[gate].set()
    for delivery in deliveries:
        delivery.join(10)

    stats = [(kind, stat) for kind, stat, _ in metrics.calls]
    assert stats[:4] == [
        ("incr", "committed.cliadmin.charge"),
        ("timing", "committed.cliadmin.charge"),
        ("incr", "replayed.cliadmin.charge"),
        ("timing", "replayed.cliadmin.charge"),
    ]
    assert stats.count(("incr", "committed.cliadmin.hold")) == 1
    assert stats.count(("incr", "replayed.cliadmin.hold")) == 1  # the duplicate, once free
    assert all(delta >= 0 for kind, _, delta in metrics.calls if kind == "timing")
