"""The same checks through a real Celery worker running in the test process."""

import uuid

import pytest
from celery.contrib.testing.worker import start_worker
from celery_idempotent import IdempotencyMismatchError, IdempotentTask

from shop.celery import app
from shop.tasks import charge, send_receipt


@pytest.fixture(scope="session")
def celery_config():
    # Celery's in-memory broker polls once a second unless told otherwise.
    return {"broker_transport_options": {"polling_interval": 0.01}}


@pytest.fixture(scope="session")
def celery_worker_parameters():
    return {"perform_ping_check": False}


def test_with_celerys_own_fixtures(celery_app, celery_worker, idempotency):
    @celery_app.task(base=IdempotentTask, idempotency_key="order:{order_id}")
    def ship(order_id, address):
        return f"parcel {order_id} to {address} {uuid.uuid4().hex}"

    celery_worker.reload()  # the worker learns the task defined in the test

    twice = idempotency.redeliver(ship, (5, "Main St 1"))
    idempotency.deliver_twice(ship, (6, "Elm St 2"))
    with pytest.raises(IdempotencyMismatchError):
        idempotency.deliver(ship, (5, "Elm St 2"))

    assert idempotency.executions(ship) == 2
    assert twice.result.startswith("parcel 5 to Main St 1")


@pytest.fixture(scope="module")
def shop_worker():
    app.conf.broker_transport_options = {"polling_interval": 0.01}
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        yield


@pytest.fixture
def through_shop_worker(shop_worker, idempotency):
    idempotency.through_worker = True  # a worker started here, not by celery_worker
    return idempotency


def test_the_shop_through_a_worker(through_shop_worker):
    idempotency = through_shop_worker
    twice = idempotency.redeliver(charge, (42, 999))
    idempotency.deliver_twice(charge, (43, 500), key="checkout-43")
    receipts = idempotency.redeliver(send_receipt, (42,))

    assert twice.record.result == twice.result
    assert receipts.result.startswith("receipt 42 ")
    assert idempotency.executions(charge) == 2
    assert not idempotency.is_locked(charge, (42, 999))
