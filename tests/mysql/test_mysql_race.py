"""Processes racing on one MySQL / MariaDB table: each body runs once per key.

8 processes x 50 keys (half of them in another order), and 16 processes on one key at once;
each with the sessions at InnoDB's default REPEATABLE READ and at READ COMMITTED (the guard
sets READ COMMITTED for its own transactions either way: its results must not depend on the
session's level).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from mysql_support import query

from celery_idempotent import MySQLBackend

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("my_race_worker.py")


def race(url: str, table: str, tmp_path: Path, *, workers: int, keys: int, level: str) -> list[Any]:
    MySQLBackend(url, table=table).cleanup()  # creates the table first
    query(url, f"CREATE TABLE `{table}_runs` (k VARCHAR(64), worker INT) ENGINE=InnoDB")
    query(
        url,
        f"CREATE TABLE `{table}_payments` (k VARCHAR(64), worker INT, fence BIGINT) ENGINE=InnoDB",
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), url, table, str(i), str(keys), str(tmp_path), level],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        for i in range(workers)
    ]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < workers:
            failed = [p for p in procs if p.poll() is not None]
            assert not failed, failed[0].communicate()[1].decode()
            assert time.monotonic() < deadline, "workers did not get ready within 60 s"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err.decode()
            reports.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reports


def check(url: str, table: str, reports: list[Any], keys: set[str]) -> None:
    runs = query(url, f"SELECT k FROM `{table}_runs`")
    payments = query(url, f"SELECT k, worker, fence FROM `{table}_payments`")
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
    # Fencing tokens are distinct across keys too (one counter).
    assert len({f for _, _, f in payments}) == len(keys)


LEVELS = ["REPEATABLE READ", "READ COMMITTED"]


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_processes_racing_on_shared_keys_run_each_body_once(
    mysql_url: str, my_table: str, tmp_path: Path, level: str
) -> None:
    reports = race(mysql_url, my_table, tmp_path, workers=8, keys=50, level=level)
    check(mysql_url, my_table, reports, {f"key-{i}" for i in range(50)})


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_many_processes_on_one_key_at_once_run_it_once(
    mysql_url: str, my_table: str, tmp_path: Path, level: str
) -> None:
    reports = race(mysql_url, my_table, tmp_path, workers=16, keys=1, level=level)
    check(mysql_url, my_table, reports, {"key-0"})
