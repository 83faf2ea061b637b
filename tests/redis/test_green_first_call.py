"""The first guarded call of a gevent or eventlet process keeps its lease from its claim on.

The keeper's log relay is a greenlet started by the first ``renewal.keep`` of a process. Started
with ``threading.Thread.start``, it made that call wait for the greenlet to start, a switch to
the event loop between the claim and the keeper's taking the lease: a body blocking the loop
(a CPU loop) then held the call for as long as it ran, the lease ran out unrenewed, and the
commit was refused (``LockLostError``; seen in ``tests/faults/test_fault_pools.py`` on
eventlet, for the short body that a worker started first after a restart).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.redis]

SCRIPT = Path(__file__).with_name("green_first_call.py")
CASES = [(lib, mode) for lib in ("gevent", "eventlet") for mode in ("guard", "probe")]


@pytest.fixture(scope="module")
def outcomes(redis_url: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Every case at once, each in a process of its own (the first call is once a process)."""
    procs = {}
    for lib, mode in CASES:
        prefix = f"test:green-first-{uuid.uuid4().hex[:8]}:"
        procs[(lib, mode)] = subprocess.Popen(
            [sys.executable, str(SCRIPT), lib, mode, redis_url, prefix],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    found = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"{case}: exit {proc.returncode}\n{err}"
        found[case] = json.loads(out.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("lib", ["gevent", "eventlet"])
def test_the_first_call_keeps_its_lease_while_a_body_blocks_the_loop(
    outcomes: dict[tuple[str, str], dict[str, Any]], lib: str
) -> None:
    outcome = outcomes[(lib, "guard")]
    assert outcome["runtime"] == lib
    assert outcome["call"] == ["ok", "done"], outcome["call"]
    # the loop was blocked after the claim had returned, while the body waited
    assert outcome["blocked_after"] >= 0


@pytest.mark.parametrize("lib", ["gevent", "eventlet"])
def test_the_first_keep_of_a_process_never_switches_to_the_event_loop(
    outcomes: dict[tuple[str, str], dict[str, Any]], lib: str
) -> None:
    outcome = outcomes[(lib, "probe")]
    assert outcome["runtime"] == lib
    assert outcome["switched"] is False
