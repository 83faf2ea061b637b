"""The Sentinel failover campaign (``python -m benchmarks.failover``), one short run of it.

A master, two replicas and three Sentinels on loopback, three worker processes of real guards;
``SENTINEL FAILOVER`` while the bodies run, with ``wait_replicas=2`` (every replica): no
delivery is told its result was stored while the final master lacks it, every delivery ends,
and every execution whose result was not stored was told so. The whole table (0, 1, 2 x
failover and killed master, bodies and commits) is in ``docs/operations/sentinel-cluster.md``.
"""

from __future__ import annotations

import pytest

from benchmarks.failover import run_one

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_with_every_replica_waited_for_a_failover_loses_no_commit() -> None:
    row = run_one(2, "failover-bodies", 6)
    assert row["unfinished_deliveries"] == 0, row
    assert row["commits_lost"] == 0, row
    told = row["told"]
    # An execution beyond the first of its key was answered with an error, never "stored".
    failures = told.get("LockLostError", 0) + told.get("CommitUnknownError", 0)
    assert row["executions"] - (row["keys"] - row["keys_never_run"]) <= failures, row
    assert set(told) <= {"committed", "replayed", "LockLostError", "CommitUnknownError"}, row
