"""The shop's own worker processes (``celery worker``, prefork) against a private Redis."""

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from celery import Celery

from shop.tasks import charge

PROJECT = Path(__file__).resolve().parent.parent


@pytest.fixture
def idempotency_backend():
    return "redis"  # the test process reads what the worker processes store


@pytest.fixture
def worker(idempotency_redis, tmp_path):
    """A ``celery worker`` of the shop (2 prefork processes); yields (client app, log path)."""
    env = dict(
        os.environ,
        SHOP_BROKER_URL=idempotency_redis.url(1),
        SHOP_RESULT_BACKEND=idempotency_redis.url(2),
        SHOP_IDEMPOTENCY_URL=idempotency_redis.url(0),
    )
    log = tmp_path / "worker.log"
    command = [sys.executable, "-m", "celery", "-A", "shop.celery", "worker", "-P", "prefork",
               "-c", "2", "--without-mingle", "--without-gossip", "--loglevel", "INFO",
               "--logfile", str(log)]  # fmt: skip
    process = subprocess.Popen(command, cwd=PROJECT, env=env)
    client = Celery("shop-client", broker=env["SHOP_BROKER_URL"],
                    backend=env["SHOP_RESULT_BACKEND"])  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not client.control.ping(timeout=0.5):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker did not start"
        yield client, log
    finally:
        process.terminate()
        process.wait(30)
        client.close()


def returned(log, task_id):
    """What each delivery of ``task_id`` returned, from the worker's log."""
    pattern = rf"\[{task_id}\] succeeded in [0-9.e-]+s: (.*)"
    return re.findall(pattern, log.read_text())


def test_duplicates_run_once_on_real_workers(worker, idempotency):
    client, log = worker
    ids = [str(uuid.uuid4()) for _ in range(3)]
    for task_id in ids:  # three messages of one charge: new ids, same arguments
        client.send_task("shop.tasks.charge", (42, 999), task_id=task_id)
    redelivered = str(uuid.uuid4())
    for _ in range(2):  # one message delivered twice: the same task id
        client.send_task("shop.tasks.charge", (43, 100), task_id=redelivered)

    results = [client.AsyncResult(task_id).get(timeout=30) for task_id in ids]
    client.AsyncResult(redelivered).get(timeout=30)
    deadline = time.monotonic() + 30
    while len(returned(log, redelivered)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)

    stored = idempotency.stored(charge, (42, 999))
    assert results == [stored.result] * 3  # one charge id: the body ran once
    assert len(set(returned(log, redelivered))) == 1  # both deliveries returned one value
    assert len(returned(log, redelivered)) == 2
    assert idempotency.stored(charge, (43, 100)).fencing_token is not None
    assert not idempotency.is_locked(charge, (42, 999))
