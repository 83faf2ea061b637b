"""A redelivered message runs the task once, in a pytest-celery worker container."""

import pytest

from celery_idempotent.testing import ledger

pytestmark = pytest.mark.docker


def test_a_redelivered_task_runs_once(celery_setup, idempotency_store):
    app, queue = celery_setup.app, celery_setup.worker.worker_queue
    first = app.send_task("shop.charge", args=(42, 999), queue=queue)
    # The broker hands the same message out again (same task id), as after a lost ack.
    again = app.send_task("shop.charge", args=(42, 999), task_id=first.id, queue=queue)

    assert first.get(timeout=60) == {"order": 42, "charged": 999}
    # Both deliveries share one task id, hence one result: wait for the second's ledger entry.
    entries = ledger.wait_for_entries(idempotency_store, 2, task="shop.charge", timeout=60)
    assert [entry["event"] for entry in entries] == ["committed", "replayed"]
    assert ledger.executions(idempotency_store, "shop.charge") == 1
    assert again.get(timeout=60) == {"order": 42, "charged": 999}
