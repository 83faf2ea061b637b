"""Exactly once in effect across real processes: 8 workers x 50 shared keys, started together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

pytestmark = pytest.mark.redis

WORKER = Path(__file__).with_name("race_worker.py")
ROOT = Path(__file__).resolve().parents[2]
WORKERS = 8
KEYS = 50


@pytest.mark.parametrize("path", ["atomic", "split"])
def test_processes_racing_on_shared_keys_run_each_body_once(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, path: str
) -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                redis_url,
                key_prefix,
                str(i),
                str(KEYS),
                path,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        for i in range(WORKERS)
    ]
    try:
        # The barrier: every worker has built its guard and loaded the scripts, then all go.
        deadline = time.monotonic() + 30
        while int(redis_client.get(f"{key_prefix}ready") or 0) < WORKERS:
            failed = [p for p in procs if p.poll() is not None]
            assert not failed, failed[0].communicate()[1].decode()
            assert time.monotonic() < deadline, "workers did not get ready within 30 s"
            time.sleep(0.01)
        redis_client.rpush(f"{key_prefix}go", *["go"] * WORKERS)
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err.decode()
            reports.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    keys = [f"key-{index}" for index in range(KEYS)]
    counters = redis_client.mget([f"{key_prefix}count:{key}" for key in keys])
    assert counters == [b"1"] * KEYS, "a body ran more than once (or never) for some key"
    for key in keys:
        seen = {report["results"][key] for report in reports}
        assert len(seen) == 1, f"{key}: processes got different results {seen}"
        assert seen.pop().endswith(":1")
    runs = [key for report in reports for key in report["ran"]]
    assert sorted(runs) == sorted(keys), "each key's body ran in exactly one process"
    # The workers really competed: the bodies were spread over several processes.
    assert sum(1 for report in reports if report["ran"]) >= 2
    # ... and found keys held by one another (a lock attempt refused, then a replay).
    assert sum(report["contended"] for report in reports) > 0
