"""``python -m example_project --backend mysql --chaos``: one row per order on MySQL,
the killed bodies' rows repeated on Redis, from one run of the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


def test_demo_mysql_vs_redis_with_kills(mysql_url: str, redis_url: str) -> None:
    kills = 2
    done = subprocess.run(
        [
            sys.executable, "-m", "example_project", "--backend", "mysql", "--chaos",
            "--orders", "8", "--duplicates", "2", "--workers", "1", "--concurrency", "2",
            "--kills", str(kills), "--json",
            "--mysql-url", mysql_url, "--redis-url", redis_url,
        ],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    pg, rd = json.loads(done.stdout)["reports"]
    assert pg["backend"] == "mysql"
    assert rd["backend"] == "redis"
    for report in (pg, rd):
        assert report["kills"] == kills
        assert report["failed_deliveries"] == 0
        assert report["duplicates_agree"]
    # MySQL: exactly one payment row per order, kills or not.
    assert pg["orders_with_rows"] == {"1": 8}
    assert pg["payment_rows"] == 8
    # Redis: every killed body's row stayed, and its rerun added one.
    assert rd["payment_rows"] == 8 + kills
    assert rd["orders_charged_twice_or_more"] == len(rd["killed_orders"]) >= 1
