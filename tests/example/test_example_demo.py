"""``python -m example_project``, run as a user runs it: a subprocess with real workers.

Each run uses ``--quick --json`` and its own ``TMPDIR``; the figures come from the JSON summary
(the last line on stdout). After every run: no process it started is alive (checked by pid) and
its temporary directory is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(180)]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp)
    env.pop("REDIS_URL", None)  # the default path: an embedded redis-server
    for name in list(env):
        if name.startswith("EXAMPLE_"):
            del env[name]
    return env


def _tmp(tmp_path: Path) -> Path:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp


def run_demo(tmp: Path, *args: str, timeout: float = 120) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "example_project", "--quick", "--json", *args],
        cwd=ROOT,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no JSON on stdout; stderr:\n{proc.stderr}"
    return proc.returncode, json.loads(lines[-1]), proc.stderr


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def assert_cleaned_up(summary: dict[str, Any], tmp: Path, *, forked: bool = True) -> None:
    """``forked``: prefork, whose pool processes are children of the workers."""
    cleanup = summary["cleanup"]
    started = cleanup["started"]
    assert started["workers"], cleanup
    assert len(started["pool"]) >= (2 if forked else 0), cleanup
    assert cleanup["left_running"] == []
    # Our own check, by pid: a pid reused since by an unrelated process does not count.
    for pid in [*started["workers"], *started["pool"]]:
        assert not (_alive(pid) and "example_project" in _cmdline(pid)), pid
    if started["redis"] is not None:
        assert not (_alive(started["redis"]) and "redis-server" in _cmdline(started["redis"]))
    assert cleanup["workdir_removed"]
    assert list(tmp.iterdir()) == [], "temporary files left behind"


def assert_exactly_once(summary: dict[str, Any]) -> None:
    assert summary["ok"], summary["checks"]
    assert summary["double_executions"] == 0
    assert summary["overlapping_bodies"] == 0
    assert summary["distinct_keys"] == 4 * summary["orders"]
    assert summary["executions"] == summary["distinct_keys"]
    assert summary["missing_executions"] == 0
    assert summary["replays"] > 0
    # Every published message ended with one execution or one replay, except the refused ones
    # (and a killed delivery that Celery acked because a copy with its id had succeeded).
    finished = summary["executions"] + summary["replays"] + summary["mismatches_refused"]
    assert finished + summary["killed_messages_acked"] == summary["messages_published"]
    assert summary["mismatches_sent"] == 4
    assert summary["mismatches_refused"] == summary["mismatches_sent"]
    assert summary["inconsistent_results"] == 0
    assert summary["wrong_amounts_charged"] == 0
    assert summary["unexpected_failures"] == {}


def test_quick_run_is_exactly_once(tmp_path: Path) -> None:
    tmp = _tmp(tmp_path)
    status, summary, stderr = run_demo(tmp)
    assert status == 0, stderr
    assert_exactly_once(summary)
    assert summary["mail_retries"] >= 1
    assert summary["chaos"]["killed"] == []
    assert "embedded redis-server" in summary["settings"]["redis"]
    assert "OK: every order, charge, email and shipment happened exactly once" in stderr
    assert_cleaned_up(summary, tmp)


def test_every_other_pool_runs_the_demo_exactly_once(tmp_path: Path) -> None:
    """``--pool threads|solo|gevent|eventlet``, the four runs at once (prefork: above)."""
    pools = ("threads", "solo", "gevent", "eventlet")
    tmps = {pool: tmp_path / pool for pool in pools}
    for tmp in tmps.values():
        tmp.mkdir()
    with ThreadPoolExecutor(max_workers=len(pools)) as executor:
        futures = {
            pool: executor.submit(run_demo, tmps[pool], "--pool", pool, timeout=170)
            for pool in pools
        }
        outcomes = {pool: future.result() for pool, future in futures.items()}
    for pool, (status, summary, stderr) in outcomes.items():
        assert status == 0, f"{pool}: {stderr}"
        assert summary["settings"]["pool"] == pool
        assert_exactly_once(summary)
        assert_cleaned_up(summary, tmps[pool], forked=False)


def test_chaos_kill_mid_charge_is_still_exactly_once(tmp_path: Path) -> None:
    tmp = _tmp(tmp_path)
    status, summary, stderr = run_demo(tmp, "--chaos")
    assert status == 0, stderr
    assert_exactly_once(summary)
    chaos = summary["chaos"]
    assert chaos["error"] is None
    assert len(chaos["killed"]) == chaos["kills_requested"] == 1
    killed = chaos["killed"][0]
    assert killed["pid"] in summary["cleanup"]["started"]["pool"]
    # Killed in the middle of the gateway call, before the card was charged.
    assert 0 < killed["hung_for"] < 5
    # A replacement pool process was forked for the killed one.
    assert len(summary["cleanup"]["started"]["pool"]) >= 5
    assert_cleaned_up(summary, tmp)


def test_without_idempotency_the_demo_sees_double_executions(tmp_path: Path) -> None:
    # The negative control: the same load with the kill switch off must be caught.
    tmp = _tmp(tmp_path)
    status, summary, stderr = run_demo(tmp, "--without-idempotency")
    assert status == 1, stderr
    assert not summary["ok"]
    assert summary["double_executions"] > 0
    assert summary["executions"] > summary["distinct_keys"]
    assert summary["mismatches_refused"] == 0
    assert_cleaned_up(summary, tmp)


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_given_servers_and_their_keys_are_cleaned(
    tmp_path: Path, broker: str, redis_url: str, request: pytest.FixtureRequest
) -> None:
    import redis

    extra = ["--redis-url", redis_url]
    if broker == "amqp":
        extra += ["--broker-url", request.getfixturevalue("rabbitmq_url")]
    tmp = _tmp(tmp_path)
    status, summary, stderr = run_demo(tmp, *extra)
    assert status == 0, stderr
    assert_exactly_once(summary)
    assert summary["cleanup"]["started"]["redis"] is None
    assert_cleaned_up(summary, tmp)
    namespace = summary["namespace"]
    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match=f"{namespace}*", count=1000)) == []
        assert list(client.scan_iter(match=f"*{namespace}.tasks*", count=1000)) == []
    finally:
        client.close()


def test_ctrl_c_stops_every_process_and_removes_the_files(tmp_path: Path) -> None:
    tmp = _tmp(tmp_path)
    proc = subprocess.Popen(
        # Long enough that Ctrl-C lands in the middle of the bursts.
        [sys.executable, "-m", "example_project", "--json", "--orders", "400"],
        cwd=ROOT,
        env=_env(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:
            if " sent " in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["error"] == "interrupted"
    assert_cleaned_up(summary, tmp)


def test_help_documents_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "example_project", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    for flag in (
        "--quick",
        "--chaos",
        "--redis-url",
        "--broker-url",
        "--json",
        "--orders",
        "--pool",
    ):
        assert flag in out
    refused = subprocess.run(
        [sys.executable, "-m", "example_project", "--chaos", "--pool", "gevent"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 2
    assert "--chaos kills prefork pool processes" in refused.stderr
