"""pytest-celery's setup, with the worker container configured for celery-idempotent."""

import pytest
from celery import Celery

from celery_idempotent.testing import ledger
from tests.containers.example import shop_tasks


@pytest.fixture
def celery_broker(celery_redis_broker):
    # One setup: a Redis broker (pytest-celery runs every broker it can import by default).
    return celery_redis_broker


@pytest.fixture
def default_worker_tasks(default_worker_tasks):
    return {*default_worker_tasks, shop_tasks}


@pytest.fixture
def default_worker_signals(default_worker_signals):
    # The ledger records, in the idempotency store, what the guard did in the container.
    return {*default_worker_signals, ledger}


@pytest.fixture
def default_worker_app(celery_setup_app, default_redis_backend):
    # The settings pytest-celery writes into the worker container's app: the keys go to
    # database 1 of the backend's Redis, by its name on the setup's network; late acks so that
    # a message whose worker died is delivered again.
    app = Celery(celery_setup_app.main)
    app.conf.update(
        idempotency_url=f"redis://{default_redis_backend.hostname}:6379/1",
        task_acks_late=True,
    )
    return app


@pytest.fixture
def idempotency_store(default_redis_backend):
    # The same Redis, as the test's own process reaches it (the port docker published).
    return f"redis://127.0.0.1:{default_redis_backend.port}/1"
