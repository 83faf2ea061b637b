"""One racing process of ``test_mysql_race.py``: run the guard over shared keys, as JSON.

Usage: ``python my_race_worker.py URL TABLE WORKER_ID N_KEYS DIR [ISOLATION]``

As ``tests/postgres/pg_race_worker.py``: builds its backend and guard, touches
``DIR/ready-<id>`` and waits for ``DIR/go``. Each body inserts one payment row through
``current_connection()`` (it commits with the record, or not at all) and one row into
``<TABLE>_runs`` on a connection of its own (autocommit: it counts executions, including any
that a rollback would hide). ``ISOLATION``, when given, is the session's own level (the
guard sets READ COMMITTED for its transactions whatever it is). Prints ``{"results": {key:
value}, "ran": [...]}``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import pymysql

from celery_idempotent import (
    DistributedIdempotencyGuard,
    MySQLBackend,
    current_connection,
    current_lease,
)
from celery_idempotent.backends.mysql.connections import connect_args


def main(argv: list[str]) -> int:
    url, table, worker, n_keys, where, *rest = argv
    worker_id, count = int(worker), int(n_keys)
    backend = MySQLBackend(url, table=table, lock_timeout=1)
    guard = DistributedIdempotencyGuard(
        store=backend,
        lock_provider=backend,
        retry_count=400,
        retry_base_delay=0.002,
        retry_max_delay=0.02,
    )
    side = pymysql.connect(**connect_args(url), autocommit=True)
    if rest:
        # The session's own level: the guard's transactions must not depend on it.
        conn = backend._get()
        with conn.cursor() as cur:
            cur.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {rest[0]}")
        backend._put(conn)
        backend.max_idle = 1
    keys = [f"key-{index}" for index in range(count)]
    if worker_id % 2:
        random.Random(worker_id).shuffle(keys)
    results: dict[str, str] = {}
    ran: list[str] = []
    Path(where, f"ready-{worker_id}").touch()
    deadline = time.monotonic() + 60
    while not Path(where, "go").exists():
        if time.monotonic() > deadline:
            print("no go signal within 60 s", file=sys.stderr)
            return 2
        time.sleep(0.005)
    for key in keys:

        def body(key: str = key) -> str:
            lease = current_lease()
            assert lease is not None
            with side.cursor() as cur:
                cur.execute(f"INSERT INTO `{table}_runs` VALUES (%s, %s)", (key, worker_id))
            with current_connection().cursor() as cur:
                cur.execute(
                    f"INSERT INTO `{table}_payments` VALUES (%s, %s, %s)",
                    (key, worker_id, lease.fencing_token),
                )
            time.sleep(0.002)  # hold the row a little: widen the window for the others
            return f"worker-{worker_id}:{lease.fencing_token}"

        outcome = guard.run(key, body, input={"key": key})
        results[key] = outcome.value
        if not outcome.replayed:
            ran.append(key)
    print(json.dumps({"results": results, "ran": ran, "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
