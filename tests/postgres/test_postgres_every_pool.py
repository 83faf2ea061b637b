"""The PostgreSQL backend under real ``celery worker -P threads|solo|gevent|eventlet``.

One worker per pool, all started at once (gevent and eventlet monkey-patch the process the way
``celery worker -P gevent`` does, before the app is imported). Each worker shows, on keys of
its own:

- duplicates with the same arguments (4 keys x 3 deliveries) and with the same task id run the
  body once per key and all get the identical stored result;
- the body's row, inserted through ``current_connection()``, is committed exactly once per key;
- bodies that run at once each hold a PostgreSQL session of their own (never one shared between
  threads or greenlets), and on every pool but solo several did run at once;
- a duplicate arriving while the first body runs waits on the key's row lock (the first body
  sees it waiting, from the server's ``pg_blocking_pids``) and ends with the stored result.
  Under gevent/eventlet that wait must yield to the event loop: a wait that blocked the loop
  would freeze the first body until the claim gave up, so it would never see a waiter. (It
  did on eventlet, whose patching psycopg does not detect, until the backend switched psycopg
  to a wait through the patched ``select``; and the claims that then timed out exposed
  psycopg's prepared-statement bookkeeping in aborted pipelines, see
  ``test_a_claim_that_times_out_leaves_its_connection_usable``.)
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import psycopg
import pytest
import redis

from tests.support.workers import CeleryWorker

HERE = Path(__file__).resolve().parent
TIMEOUT = 60
LOCK_TIMEOUT = 1.5  # a claim waits this long for the key's holder, then backs off
POOLS = {"threads": 6, "solo": 1, "gevent": 6, "eventlet": 6}
KEYS = 4
DUPLICATES = 3
STALL = 0.6

pytestmark = [pytest.mark.worker, pytest.mark.redis]


@pytest.fixture(scope="module")
def pool_app(postgres_url: str, redis_url: str) -> Iterator[tuple[ModuleType, dict[str, str]]]:
    """The app module, its table (and payments table) of this module's own."""
    table = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{table}_payments" '
            "(tag text, kind text, x text, run int, pid int, backend int)"
        )
    sep = "&" if "?" in postgres_url else "?"
    env = {
        "PG_BROKER_URL": redis_url,
        "PG_IDEMPOTENCY_URL": f"{postgres_url}{sep}table={table}&lock_timeout={LOCK_TIMEOUT}",
        "PG_DATA_URL": postgres_url,
        "PG_TABLE": table,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the test process loads the same app as the workers
    sys.path.insert(0, str(HERE))
    import pg_pool_app

    importlib.reload(pg_pool_app)
    yield pg_pool_app, env
    pg_pool_app.app.close()
    marks = redis.Redis.from_url(redis_url)
    for key in marks.scan_iter(match=f"{table}:*"):
        marks.delete(key)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '10s'")
        conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        conn.execute(f'DROP SEQUENCE IF EXISTS "{table}_fencing"')
        conn.execute(f'DROP TABLE IF EXISTS "{table}_payments"')


@pytest.fixture(scope="module")
def pool_workers(
    pool_app: tuple[ModuleType, dict[str, str]],
) -> Iterator[dict[str, CeleryWorker]]:
    """One worker per pool, each on a queue of its own, all started at once."""
    _, env = pool_app

    def start(pool: str) -> CeleryWorker:
        queue = f"pgpool-{pool}-{uuid.uuid4().hex[:6]}"
        worker = CeleryWorker(
            "pg_pool_app",
            pool=pool,
            concurrency=POOLS[pool],
            queues=[queue],
            env=env,
            pythonpath=[HERE],
        )
        worker.queue = queue  # type: ignore[attr-defined]
        return worker.start()

    with ThreadPoolExecutor(max_workers=len(POOLS)) as executor:
        futures = {pool: executor.submit(start, pool) for pool in POOLS}
        workers = {}
        try:
            for pool, future in futures.items():
                workers[pool] = future.result()
        except BaseException:
            for future in futures.values():
                if future.exception() is None:
                    future.result().stop()
            raise
    yield workers
    for worker in workers.values():  # warm shutdowns at once: gevent/eventlet take seconds
        worker.signal(signal.SIGTERM)
    for worker in workers.values():
        worker.stop()
        worker.remove_log()


def payments(app: ModuleType, tag: str) -> list[tuple[str, str, int, int]]:
    with psycopg.connect(os.environ["PG_DATA_URL"], autocommit=True) as conn:
        return conn.execute(
            f'SELECT kind, x, run, pid FROM "{app.TABLE}_payments" WHERE tag = %s ORDER BY 1, 2',
            (tag,),
        ).fetchall()


def duplicates_scenario(app: ModuleType, worker: CeleryWorker) -> None:
    """Duplicates by arguments and by task id, then a duplicate of a running body."""
    queue = worker.queue  # type: ignore[attr-defined]
    tag = f"{worker.pool}-{uuid.uuid4().hex[:8]}"
    m = redis.Redis.from_url(app.BROKER)
    sent = {
        x: [app.pay.apply_async((tag, x, STALL), queue=queue) for _ in range(DUPLICATES)]
        for x in range(KEYS)
    }
    task_id = f"same-{tag}"
    by_id = [
        app.pay_by_id.apply_async((tag, 99, STALL), task_id=task_id, queue=queue)
        for _ in range(DUPLICATES)
    ]
    for x, results in sent.items():
        values = [r.get(timeout=TIMEOUT) for r in results]
        assert values == [values[0]] * DUPLICATES, (x, values)
        assert values[0]["run"] == 1, values[0]
        assert values[0]["pid"] == worker.pid, values[0]  # no pool process: the worker's own
        assert int(m.get(f"{app.TABLE}:pay:runs:{tag}:{x}")) == 1, x
    id_values = [r.get(timeout=TIMEOUT) for r in by_id]
    assert id_values == [id_values[0]] * DUPLICATES, id_values
    assert int(m.get(f"{app.TABLE}:pay_by_id:runs:{tag}:99")) == 1

    # Exactly one committed row per key, written by the run that returned the stored result.
    rows = payments(app, tag)
    expected = [("pay", str(x), 1) for x in range(KEYS)] + [("pay_by_id", "99", 1)]
    assert [r[:3] for r in rows] == expected, rows

    # One session per running body; several bodies at once except on solo.
    assert m.get(f"{app.TABLE}:shared:{tag}") is None, "a session was shared by two bodies"
    most = int(m.get(f"{app.TABLE}:most:{tag}"))
    if worker.pool == "solo":
        assert most == 1
    else:
        assert most >= 2, "the bodies never ran at once: the test shows nothing"

    # A duplicate of a running body waits on its row, then gets its stored result.
    hold_tag = f"{tag}-hold"
    patience = 0.5 if worker.pool == "solo" else 10.0
    first = app.hold.apply_async((hold_tag, patience), queue=queue)
    deadline = time.monotonic() + TIMEOUT
    while not m.exists(f"{app.TABLE}:hold:started:{hold_tag}"):
        assert time.monotonic() < deadline, "the holding body never started"
        time.sleep(0.02)
    # Published as a duplicate delivery would arrive (the publish-side check would stop it
    # and answer with the running call's result).
    duplicate = app.hold.apply_async(
        (hold_tag, patience), queue=queue, idempotency_on_duplicate_publish="publish"
    )
    value = first.get(timeout=TIMEOUT)
    assert duplicate.get(timeout=TIMEOUT) == value
    assert value["run"] == 1
    assert int(m.get(f"{app.TABLE}:hold:runs:{hold_tag}")) == 1
    if worker.pool != "solo":  # solo takes the duplicate only once the first body is over
        assert value["saw_waiter"], (
            "the first body never saw the duplicate's claim waiting on its row: the wait "
            "blocked the worker (or never happened)"
        )
    assert [r[:3] for r in payments(app, hold_tag)] == [("hold", "0", 1)]
    log = worker.log()
    assert "raised unexpected" not in log, log


def test_the_postgres_backend_on_every_pool(
    pool_app: tuple[ModuleType, dict[str, str]], pool_workers: dict[str, CeleryWorker]
) -> None:
    """Every pool's worker at once, each with keys of its own."""
    app, _ = pool_app
    with ThreadPoolExecutor(max_workers=len(pool_workers)) as executor:
        futures = {
            pool: executor.submit(duplicates_scenario, app, worker)
            for pool, worker in pool_workers.items()
        }
        failed = {}
        for pool, future in futures.items():
            try:
                future.result()
            except Exception as exc:
                failed[pool] = f"{type(exc).__name__}: {exc}"
    assert not failed, failed
