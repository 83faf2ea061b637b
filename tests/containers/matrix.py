"""The Python x server matrix: the core subset of this suite, run inside containers.

Each cell is a real run: a server container (``redis-server`` or ``valkey-server`` from one
Debian release's base image) and a test container (another release's worker image: its Python,
this project's wheel, Celery and pytest from the wheelhouse) on a docker network made for the
cell (``internal``: no route out), with the checkout's ``tests/`` and ``setup.cfg`` mounted
read-only and ``REDIS_URL`` naming the server. The subset is :data:`CORE_SUBSET`: the guard's
rules and life cycle, the Redis scripts (the backend and the contract suite every backend
passes), and one real ``celery worker`` (a subprocess in the container) on that server.

Tests of the subset that start servers of their own (``redis_server_factory``, Sentinel, Cluster,
the TCP proxy) are deselected in the container (``matrix_plugin``): they would run the test
image's own ``redis-server``, not the cell's. The cell checks the server's version too.

``python -m tests.containers matrix`` runs every cell and prints the table;
``pytest -m matrix`` (``tests/containers/test_matrix.py``) runs each cell as a test.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.containers.images import ROOT, ensure

__all__ = ["CELLS", "CORE_SUBSET", "PYTHONS", "SERVERS", "CellResult", "run_cell"]

CORE_SUBSET = (
    "tests/unit/test_guard_rules.py",
    "tests/unit/test_guard_lifecycle.py",
    "tests/redis/test_redis_backend.py",
    "tests/redis/test_redis_contract.py",
    "tests/celery/test_task_workers.py::test_same_arguments_under_ten_task_ids_run_once",
    "tests/celery/test_task_workers.py::test_one_task_id_published_ten_times_runs_once",
)

#: Python version -> the Debian release whose worker image has it.
PYTHONS = {"3.9": "bullseye", "3.11": "bookworm", "3.13": "trixie"}
#: Server -> (the release whose base image has it, the binary, the version prefix it reports).
SERVERS = {
    "redis-6.0": ("bullseye", "redis-server", "6.0."),
    "redis-7.0": ("bookworm", "redis-server", "7.0."),
    "redis-8": ("trixie", "redis-server", "8."),
    "valkey-8": ("trixie", "valkey-server", "8."),
}
CELLS = [(python, server) for python in PYTHONS for server in SERVERS]


@dataclass
class CellResult:
    """One cell's run: the counts from the in-container run's JUnit report."""

    python: str
    server: str
    server_version: str
    passed: int
    failed: int
    errors: int
    skipped: int
    xfailed: int
    seconds: float
    exit_code: int
    output_tail: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.failed == 0 and self.errors == 0 and self.passed > 0


def _docker(*argv: str, check: bool = True, timeout: float = 900) -> str:
    proc = subprocess.run(
        ["docker", *argv], check=False, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(argv)} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def _counts(report: Path) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "xfailed": 0}
    if not report.exists():
        return counts
    root = ET.parse(report).getroot()  # noqa: S314  (our own run's report)
    for suite in [root] if root.tag == "testsuite" else list(root):
        for name in ("tests", "failures", "errors", "skipped"):
            counts[name] += int(suite.get(name, 0))
        for skipped in suite.iter("skipped"):
            if skipped.get("type") == "pytest.xfail":
                counts["xfailed"] += 1
    counts["skipped"] -= counts["xfailed"]
    return counts


def run_cell(python: str, server: str, *, root: Path = ROOT, timeout: float = 900) -> CellResult:
    """Run :data:`CORE_SUBSET` with ``python``'s image against a ``server`` container."""
    python_distro = PYTHONS[python]
    server_distro, binary, prefix = SERVERS[server]
    images = ensure(sorted({python_distro, server_distro}), root)
    worker_image = images.worker[python_distro]
    server_image = images.base[server_distro]
    name = f"cidem-matrix-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    _docker("network", "create", "--internal", name)
    try:
        _docker(
            "run", "-d", "--name", f"{name}-server", "--network", name,
            "--network-alias", "server", server_image,
            binary, "--save", "", "--appendonly", "no", "--protected-mode", "no",
        )  # fmt: skip
        version = ""
        for _ in range(100):
            probe = _docker(
                "exec", f"{name}-server", binary.replace("server", "cli"), "INFO", "server",
                check=False,
            )  # fmt: skip
            found = [
                ln
                for ln in probe.splitlines()
                if ln.startswith(("redis_version:", "valkey_version:"))
            ]
            if found:
                version = found[-1].split(":", 1)[1].strip()
                break
            time.sleep(0.1)
        if not version.startswith(prefix):
            raise RuntimeError(f"{server_image} {binary} reports version {version!r}")
        with tempfile.TemporaryDirectory(prefix="cidem-matrix-") as out:
            argv = [
                "run", "--rm", "--name", f"{name}-tests", "--network", name,
                "-v", f"{root / 'tests'}:/src/tests:ro",
                "-v", f"{root / 'setup.cfg'}:/src/setup.cfg:ro",
                "-v", f"{out}:/out",
                "-w", "/src",
                "-e", "REDIS_URL=redis://server:6379/0",
                "-e", "CELERY_IDEMPOTENT_STRICT=1",
                "-e", "PYTHONPATH=/src",
                "-e", f"CIDEM_MATRIX_SERVER={server}",
                worker_image,
                "python", "-m", "pytest", "-q", "-p", "tests.containers.matrix_plugin",
                "--junitxml=/out/junit.xml", *CORE_SUBSET,
            ]  # fmt: skip
            proc = subprocess.run(
                ["docker", *argv], check=False, capture_output=True, text=True, timeout=timeout
            )
            counts = _counts(Path(out) / "junit.xml")
    finally:
        _docker("rm", "-f", f"{name}-server", f"{name}-tests", check=False)
        _docker("network", "rm", name, check=False)
    failed, errors, skipped = counts["failures"], counts["errors"], counts["skipped"]
    xfailed = counts["xfailed"]
    return CellResult(
        python=python,
        server=server,
        server_version=version,
        passed=counts["tests"] - failed - errors - skipped - xfailed,
        failed=failed,
        errors=errors,
        skipped=skipped,
        xfailed=xfailed,
        seconds=round(time.monotonic() - started, 1),
        exit_code=proc.returncode,
        output_tail=(proc.stdout + proc.stderr)[-3000:],
    )


def table(results: list[CellResult]) -> str:
    """The matrix as a Markdown table: passed (failed) per Python x server."""
    lines = ["| Python | " + " | ".join(SERVERS) + " |", "|---" * (len(SERVERS) + 1) + "|"]
    by_cell = {(r.python, r.server): r for r in results}
    for python, distro in PYTHONS.items():
        cells = []
        for server in SERVERS:
            result = by_cell.get((python, server))
            if result is None:
                cells.append("-")
            else:
                mark = "pass" if result.ok else "FAIL"
                failed = result.failed + result.errors
                xfailed = f", {result.xfailed} xfailed" if result.xfailed else ""
                cells.append(f"{mark}: {result.passed} passed, {failed} failed{xfailed}")
        lines.append(f"| {python} ({distro}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(cells: list[tuple[str, str]] | None = None, report: Path | None = None) -> int:
    results = []
    for python, server in cells or CELLS:
        result = run_cell(python, server)
        results.append(result)
        print(f"{python} x {server} ({result.server_version}): {result.passed} passed, "
              f"{result.failed} failed, {result.errors} errors, {result.skipped} skipped, "
              f"{result.xfailed} xfailed "
              f"in {result.seconds} s", flush=True)  # fmt: skip
        if not result.ok:
            print(result.output_tail, flush=True)
    print(table(results))
    if report is not None:
        report.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.ok for r in results) else 1
