"""SPEC §8's life cycle on PostgreSQL (issue 22): the queued marker is the key's row there
(issue 25's publish side), and a delivery that ends without a commit frees the key at once,
as on Redis. Every row of ``tests/celery/test_lifecycle.py``'s matrix, with a real prefork
worker, the Redis broker and the idempotency backend on PostgreSQL, under early ack and
``acks_late`` + ``task_reject_on_worker_lost``; each cell is checked against the same table by
the same row function.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.celery import test_lifecycle as lcm
from tests.postgres.conftest import drop_table
from tests.support.workers import WorkerGroup, start_workers

# A campaign of its own (minutes of real workers): .ci/run runs it after the README's command.
pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.redis, pytest.mark.campaign]

_cells: dict[tuple[str, str], lcm.Cell] = {}

ROWS = lcm.ROWS


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    """The PostgreSQL matrix, printed at the end of the module (``pytest -s``)."""
    yield
    cols = [a for a in lcm.ACKS if any(k[0] == a for k in _cells)]
    if not cols:
        return
    lines = ["| how the message ends | " + " | ".join(f"postgres / {a}" for a in cols) + " |"]
    lines.append("|---|" + "---|" * len(cols))
    for row in lcm.ROWS:
        cells = [_cells.get((a, row)) for a in cols]
        shown = [
            "-"
            if c is None
            else f"{c.executions} run(s); {c.key_after}; re-submission: {c.resubmission}"
            for c in cells
        ]
        lines.append(f"| {row} | " + " | ".join(shown) + " |")
    print("\nSPEC §8 life-cycle matrix on PostgreSQL:\n" + "\n".join(lines))


@pytest.fixture(scope="module", params=["early", "late_reject"])
def pg_column(
    request: pytest.FixtureRequest, redis_url: str, postgres_url: str
) -> Iterator[tuple[ModuleType, str, WorkerGroup]]:
    acks = str(request.param)
    session = uuid.uuid4().hex[:8]
    table = f"lc_{session}"
    env = {
        "LC_REDIS_URL": redis_url,
        "LC_PREFIX": f"test:lcpg-{session}:",
        "LC_ACKS": acks,
        "LC_QUEUE": f"lcpg-{acks}-{session}",
        "LC_IDEM_URL": f"{postgres_url}?table={table}",
    }
    app = lcm._load(env)
    group = start_workers(
        1,
        "lifecycle_app",
        env=env,
        pythonpath=[lcm.APPS_DIR],
        pool="prefork",
        concurrency=2,
        queues=[env["LC_QUEUE"]],
    )
    try:
        yield app, acks, group
        import psycopg

        with psycopg.connect(postgres_url, autocommit=True) as conn:  # the records are rows
            (rows,) = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone() or (0,)
        assert rows > 0
    finally:
        group.stop()
        for worker in group:
            worker.remove_log()
        lcm._unload()
        drop_table(postgres_url, table)


@pytest.mark.parametrize("row", ROWS)
def test_life_cycle_on_postgresql(pg_column: tuple[ModuleType, str, WorkerGroup], row: str) -> None:
    app, acks, group = pg_column
    from celery_idempotent import PostgresBackend

    assert isinstance(app.returns.idempotency_guard().store, PostgresBackend)
    # Runs the row and checks its cell against the table.
    try:
        _cells[acks, row] = lcm._RUN[row](app, "redis", acks)
    except AssertionError:
        print(group[0].log_tail(80))  # the worker's side, for the failure report
        raise
