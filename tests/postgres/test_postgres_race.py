"""8 processes x 50 keys racing on one PostgreSQL table: each body runs once per key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from celery_idempotent import PostgresBackend

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("pg_race_worker.py")
WORKERS = 8
KEYS = 50


@pytest.mark.slow
def test_processes_racing_on_shared_keys_run_each_body_once(
    postgres_url: str, pg_table: str, tmp_path: Path
) -> None:
    PostgresBackend(postgres_url, table=pg_table).cleanup()  # creates the table first
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{pg_table}_runs" (key text, worker int)')
        conn.execute(f'CREATE TABLE "{pg_table}_payments" (key text, worker int, fence bigint)')
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), postgres_url, pg_table, str(i), str(KEYS), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        for i in range(WORKERS)
    ]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < WORKERS:
            failed = [p for p in procs if p.poll() is not None]
            assert not failed, failed[0].communicate()[1].decode()
            assert time.monotonic() < deadline, "workers did not get ready within 60 s"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err.decode()
            reports.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            runs = conn.execute(f'SELECT key FROM "{pg_table}_runs"').fetchall()
            payments = conn.execute(
                f'SELECT key, worker, fence FROM "{pg_table}_payments"'
            ).fetchall()
            conn.execute(f'DROP TABLE "{pg_table}_runs"')

    keys = {f"key-{i}" for i in range(KEYS)}
    # Every body ran once: one execution and one committed payment per key.
    assert Counter(key for (key,) in runs) == Counter(dict.fromkeys(keys, 1))
    assert Counter(key for key, _, _ in payments) == Counter(dict.fromkeys(keys, 1))
    ran = Counter(key for report in reports for key in report["ran"])
    assert ran == Counter(dict.fromkeys(keys, 1))
    # Every process agrees on every key's result, which names the one run (worker, token).
    for key in keys:
        values = {report["results"][key] for report in reports}
        assert len(values) == 1, (key, values)
        owner = next((w, f) for k, w, f in payments if k == key)
        assert values == {f"worker-{owner[0]}:{owner[1]}"}
    # Fencing tokens are distinct across keys too (one sequence).
    assert len({f for _, _, f in payments}) == KEYS
