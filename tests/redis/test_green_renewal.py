"""Lease renewal in a process patched by gevent or eventlet (the guard alone, no Celery).

One process, one event loop: a body that computes without yielding for three leases must
cost neither its own lease nor that of a cooperative body running beside it, whether the
library was imported after the patch (``celery worker -P gevent|eventlet``) or before it.
A C call that holds the GIL for longer than the lease still costs its lease: then the commit
is refused and the loss is logged once, with its cause.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.redis]

SCRIPT = Path(__file__).with_name("green_body.py")
CASES = [
    (lib, order) for lib in ("gevent", "eventlet") for order in ("patch-first", "import-first")
]


@pytest.fixture(scope="module")
def outcomes(redis_url: str) -> dict[tuple[str, str], dict]:
    """Every case at once, each in its own process (they take about 5 s each)."""
    procs = {}
    for lib, order in CASES:
        prefix = f"test:green-{uuid.uuid4().hex[:8]}:"
        procs[(lib, order)] = subprocess.Popen(
            [sys.executable, str(SCRIPT), lib, order, redis_url, prefix],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    found = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{case}: exit {proc.returncode}\n{err}"
        found[case] = json.loads(out.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize(("lib", "order"), CASES)
def test_a_blocking_body_keeps_its_lease_and_its_neighbours(
    outcomes: dict[tuple[str, str], dict], lib: str, order: str
) -> None:
    outcome = outcomes[(lib, order)]
    assert outcome["runtime"] == lib
    assert outcome["coop"] == ["ok", "coop"]
    assert outcome["cpu"][0] == "ok", outcome["cpu"]
    assert outcome["cpu"][1] > 1000  # it really looped
    # the only lost lease of the run is the C call's (next test)
    assert sum(" lost: " in line for line in outcome["log"]) == 1, outcome["log"]


@pytest.mark.parametrize(("lib", "order"), CASES)
def test_a_c_call_holding_the_gil_loses_its_lease_and_says_why_once(
    outcomes: dict[tuple[str, str], dict], lib: str, order: str
) -> None:
    outcome = outcomes[(lib, order)]
    assert outcome["gil"][0] == "LockLostError", outcome["gil"]
    lost = [line for line in outcome["log"] if " lost: " in line]
    assert len(lost) == 1, outcome["log"]  # once, though both keeper and commit saw it
    assert lost[0].startswith("WARNING celery-idempotent: lease of key #")
    assert "no longer held" in lost[0]
    assert "no longer held" in outcome["gil"][1]  # the error carries the cause too
