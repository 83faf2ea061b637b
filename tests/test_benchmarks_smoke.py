"""The benchmark runs in its quick mode and counts the round trips that SPEC §4 promises.

Times are never asserted, only what is deterministic: which cases ran and how many round trips
each call took (counted at the client). The competitors' cases need the ``bench`` extra; without
it they are reported as skipped, which is what is checked then.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OURS = {
    "ping": 1,
    "evalsha_floor": 1,
    "guard_first": 2,
    "guard_duplicate": 1,
    "naive_first": 4,
    "naive_duplicate": 3,
    "redis_py_lock": 2,
    "guard_python_first": 0,  # the scripts answered in-process: no Redis at all
    "guard_python_duplicate": 0,
}
COMPETITORS = ("powertools_first", "powertools_duplicate", "celery_once")


def test_quick_benchmark_reports_the_promised_round_trips(redis_url, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--redis-url", redis_url, "--output", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())

    per_call = result["per_call"]
    for name, round_trips in OURS.items():
        assert per_call[name]["round_trips"] == round_trips, name
        assert per_call[name]["calls"] > 0
    assert per_call["guard_first"]["commands"] == ["EVALSHA", "EVALSHA"]
    assert per_call["guard_duplicate"]["commands"] == ["EVALSHA"]
    for name in COMPETITORS:
        case = per_call[name]
        if "skipped" in case:
            assert "not installed" in case["skipped"]
        else:
            assert case["round_trips"] >= 1
            assert case["calls"] > 0

    verdicts = {t["target"]: t["pass"] for t in result["targets"]}
    assert verdicts["round trips, first execution"] is True
    assert verdicts["round trips, duplicate"] is True

    # The publish side: the check is one round trip at the idempotency client; on the broker's
    # Redis it travels with the push (as many requests as a plain publish: EVALSHA for LPUSH),
    # on another database it is a request of its own before kombu's LPUSH.
    publish = result["publish"]
    assert publish["idempotency_round_trips_per_publish"] == 1
    assert publish["fused"] == {"checked": True, "two_step": False}
    requests = publish["redis_requests_per_publish"]
    assert requests["checked"] == requests["plain"]
    assert requests["two_step"] == requests["plain"] + 1
    commands = publish["commands_of_one_publish"]
    assert "LPUSH" in commands["plain"]
    assert "EVALSHA" in commands["checked"]
    assert "LPUSH" not in commands["checked"]
    assert commands["two_step"].index("EVALSHA") < commands["two_step"].index("LPUSH")
    assert verdicts["round trips of the publish-side check"] is True

    memory = result["memory_store"]
    assert memory["live_records_after"] < memory["keys"] / 2  # expired records were swept
    assert "end_to_end" not in result  # the quick mode starts no worker
    assert "| celery-idempotent guard, first execution | 2 |" in proc.stdout
