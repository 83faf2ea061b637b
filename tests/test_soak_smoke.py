"""The soak command (``python -m benchmarks.soak``) in a short run: what it samples is there.

The figures of the long runs (per pool, plain against idempotent) are in docs/benchmarks.md;
here only that one run of each kind of worker is sampled with every field, deliveries grow,
and the idempotent worker's extra thread (the lease keeper) and Redis connections show up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.worker]


def test_a_short_soak_samples_both_workers(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.soak", "--pools", "prefork"),
            *("--seconds", "14", "--sample", "3", "--json", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    rows = {
        kind: [r for r in result["rows"] if r["kind"] == kind] for kind in ("plain", "idempotent")
    }
    for kind, mine in rows.items():
        assert len(mine) >= 2, (kind, mine)
        assert mine[-1]["deliveries"] > mine[0]["deliveries"] > 0, mine
        for row in mine:
            assert row["rss_main_mib"] > 10
            assert len(row["rss_children_mib"]) == 2  # prefork -c 2
            assert row["threads"] >= 3
            assert row["fds"] > 0
            assert row["redis_clients"] > 0
    # The lease keeper: one more thread in each child running idempotent tasks.
    assert rows["idempotent"][-1]["threads"] >= rows["plain"][-1]["threads"] + 2
    summary = result["summary"]
    assert set(summary) == {"plain", "idempotent"}
