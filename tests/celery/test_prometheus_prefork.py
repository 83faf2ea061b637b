"""The Prometheus recipe under prefork: prometheus-client's multiprocess mode sums what every
pool child counted, and one scrape of the main process sees all of it.

Messages are sent with ``send_task`` (no publish-side check), so the duplicates reach the
workers: six orders committed, each sent three times (twelve replays), one order sent again
with another amount (a mismatch refused in the worker)."""

from __future__ import annotations

import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.support.keys import delete_keys_with_prefix
from tests.support.ports import free_port
from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker

pytest.importorskip("prometheus_client", reason="pip install prometheus-client")

APPS = Path(__file__).resolve().parent / "apps"

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def prom(redis_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    session = uuid.uuid4().hex[:8]
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    env = {
        "PROM_REDIS_URL": redis_url,
        "PROM_PREFIX": f"test:prom-{session}:",
        "PROM_QUEUE": f"prom-{session}",
        "PROM_PORT": str(free_port()),
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
    }
    worker = CeleryWorker(
        "prom_app",
        pool="prefork",
        concurrency=2,
        queues=[env["PROM_QUEUE"]],
        env=env,
        pythonpath=[APPS],
    )
    worker.start()
    client = Celery("prom-client", broker=redis_url, backend=redis_url, set_as_current=False)
    client.conf.update(
        broker_transport_options={"global_keyprefix": f"{env['PROM_PREFIX']}kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{env['PROM_PREFIX']}celery:"},
    )
    try:
        yield {"env": env, "worker": worker, "client": client, "dir": multiproc}
    finally:
        worker.stop()
        client.close()
        import redis

        r = redis.Redis.from_url(redis_url)
        delete_keys_with_prefix(r, env["PROM_PREFIX"])
        r.close()


def scrape(port: str) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(celery_idempotency_\w+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def test_counts_from_every_pool_child_are_summed(prom: dict[str, Any]) -> None:
    client, queue = prom["client"], prom["env"]["PROM_QUEUE"]
    orders = [f"o{i}" for i in range(6)]
    sent = [
        client.send_task("prom.charge", (order, 10), queue=queue)
        for _ in range(3)
        for order in orders
    ]
    values = [result.get(timeout=60) for result in sent]
    assert sorted({amount for amount, _ in values}) == [10]
    pids = {pid for _, pid in values}
    assert len(pids) == 2, values  # both children ran (or replayed) calls
    mismatch = client.send_task("prom.charge", ("o0", 99), queue=queue)
    with pytest.raises(Exception, match=r"fingerprint|mismatch|Mismatch"):
        mismatch.get(timeout=60)

    task = '{task="prom.charge"}'
    want = {
        f"celery_idempotency_committed_total{task}": 6.0,
        f"celery_idempotency_replayed_total{task}": 12.0,
        'celery_idempotency_mismatch_refused_total{task="prom.charge",where="worker"}': 1.0,
        'celery_idempotency_seconds_count{outcome="committed",task="prom.charge"}': 6.0,
    }

    def counted() -> bool:
        found = scrape(prom["env"]["PROM_PORT"])
        return all(found.get(name) == value for name, value in want.items())

    wait_for(counted, timeout=20, what=f"the scrape to show {want}")
    files = list(prom["dir"].glob("*.db"))
    per_child = {f.name.rsplit("_", 1)[-1] for f in files}
    assert len(per_child) >= 2, files  # each child wrote its own file: the sum is real
