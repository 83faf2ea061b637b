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

The SQL servers have cells of their own (:data:`SQL_SERVERS`): a server container from one
Debian release's SQL image (``images.ensure_sql``: its ``postgresql-<major>`` or its MariaDB),
its port published on 127.0.0.1 only, and the SQL subset (:data:`SQL_SUBSET`: the SQL backends'
shared contract, the store contract every backend passes, the backend's own tests) run by the
host's Python with ``POSTGRES_URL`` / ``MYSQL_URL`` naming it. MariaDB 10.5 (bullseye) is below
the documented floor (10.6: ``SKIP LOCKED``): its cell runs the server-version test, which
asserts that the backend refuses that server at first use with an error naming the floor.

``python -m tests.containers matrix`` runs every cell and prints the tables (``--cell
sql:mariadb-10.11`` for one SQL cell); ``pytest -m matrix`` (``tests/containers/test_matrix.py``)
runs each Python x server cell as a test, ``pytest -m sql_matrix`` (``test_sql_matrix.py``)
each SQL cell.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.containers.images import ROOT, SQL_DISTROS, ensure, ensure_sql

__all__ = [
    "CELLS",
    "CORE_SUBSET",
    "PYTHONS",
    "SERVERS",
    "SQL_SERVERS",
    "SQL_SUBSET",
    "CellResult",
    "run_cell",
    "run_sql_cell",
]

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

#: SQL server -> (the release whose SQL image has it, the dialect, the version prefix it reports).
SQL_SERVERS = {
    "postgresql-13": ("bullseye", "postgres", "13."),
    "postgresql-15": ("bookworm", "postgres", "15."),
    "postgresql-17": ("trixie", "postgres", "17."),
    "mariadb-10.5": ("bullseye", "mysql", "10.5."),
    "mariadb-10.11": ("bookworm", "mysql", "10.11."),
    "mariadb-11.8": ("trixie", "mysql", "11.8."),
}
#: The servers below the documented floor: their cell checks the refusal, not the contract.
REFUSED_SQL = {"mariadb-10.5"}
#: Per dialect: the SQL backends' shared contract, the store contract, the backend's own tests.
SQL_SUBSET = {
    "postgres": (
        "tests/postgres/test_postgres_sql_contract.py",
        "tests/postgres/test_postgres_contract.py",
        "tests/postgres/test_postgres_backend.py",
    ),
    "mysql": (
        "tests/mysql/test_mysql_sql_contract.py",
        "tests/mysql/test_mysql_contract.py",
        "tests/mysql/test_mysql_backend.py",
        "tests/mysql/test_mysql_server_version.py",
    ),
}
#: What a refused server's cell runs (``CIDEM_EXPECT_REFUSED`` makes the test insist on it).
REFUSED_SUBSET = ("tests/mysql/test_mysql_server_version.py",)


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


# The server's start, as the container's command: a data directory made in /tmp by the
# release's own tools, listening on every address of the container (only its published port on
# the host's 127.0.0.1 reaches it), trust / a password-holding user for the host's tests.
_POSTGRES_START = (
    "{bin}/initdb -D /tmp/pg -A trust -U postgres -E UTF8 --no-locale >/tmp/initdb.log"
    " && echo 'host all all 0.0.0.0/0 trust' >> /tmp/pg/pg_hba.conf"
    " && exec {bin}/postgres -D /tmp/pg -c listen_addresses='*' -c max_connections=300"
    " -c fsync=off -c synchronous_commit=off -k /tmp"
)
_MARIADB_START = (
    "mariadb-install-db --no-defaults --datadir=/tmp/db --auth-root-authentication-method=normal"
    " >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; };"
    " mariadbd --no-defaults --datadir=/tmp/db --port=3306 --bind-address=0.0.0.0"
    " --socket=/tmp/db.sock --skip-name-resolve --max-connections=300 --skip-log-bin"
    " --innodb-flush-log-at-trx-commit=2 --innodb-buffer-pool-size=64M & pid=$!;"
    " for i in $(seq 600); do [ -S /tmp/db.sock ] && break; sleep 0.1; done;"
    " mariadb -uroot -S /tmp/db.sock -e \"CREATE USER 'cidem'@'%' IDENTIFIED BY 'cidem';"
    " GRANT ALL ON *.* TO 'cidem'@'%' WITH GRANT OPTION; CREATE DATABASE cidem;"
    " CREATE USER 'ready'@'%'\" || exit 1; wait $pid"
)


def _sql_ready(dialect: str, url: str) -> str | None:
    """The server's version once it answers ``url`` (and, for MariaDB, the set-up is done)."""
    try:
        if dialect == "postgres":
            import psycopg

            with psycopg.connect(url, connect_timeout=2, autocommit=True) as conn:
                row = conn.execute("SELECT current_setting('server_version')::text").fetchone()
        else:
            import pymysql

            from celery_idempotent.backends.mysql.connections import connect_args

            conn = pymysql.connect(**{**connect_args(url), "connect_timeout": 2})
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT VERSION(), (SELECT COUNT(*) FROM mysql.user "
                                "WHERE user = 'ready')")  # fmt: skip
                    found = cur.fetchone()
                row = (found[0],) if found and found[1] else None
            finally:
                conn.close()
    except Exception:
        return None
    if not row:
        return None
    value = row[0]
    # psycopg hands back bytes from an SQL_ASCII database (initdb's default without a locale)
    return value.decode() if isinstance(value, bytes) else str(value)


def run_sql_cell(server: str, *, root: Path = ROOT, timeout: float = 900) -> CellResult:
    """Run :data:`SQL_SUBSET` (or, for a refused server, :data:`REFUSED_SUBSET`) on the host
    against a ``server`` container (one of :data:`SQL_SERVERS`)."""
    distro, dialect, prefix = SQL_SERVERS[server]
    image = ensure_sql(SQL_DISTROS[distro])
    name = f"cidem-sql-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    if dialect == "postgres":
        major = server.split("-", 1)[1]
        command = _POSTGRES_START.format(bin=f"/usr/lib/postgresql/{major}/bin")
        user, port = "postgres", 5432
    else:
        command, user, port = _MARIADB_START, "nobody", 3306
    try:
        _docker(
            "run", "-d", "--name", name, "--user", user, "-p", f"127.0.0.1::{port}",
            "--tmpfs", "/tmp:exec,mode=1777", image, "sh", "-c", command,
        )  # fmt: skip
        host_port = _docker("port", name, f"{port}/tcp").splitlines()[0].rsplit(":", 1)[1]
        if dialect == "postgres":
            url = f"postgresql://postgres@127.0.0.1:{host_port}/postgres"
        else:
            url = f"mysql://cidem:cidem@127.0.0.1:{host_port}/cidem"
        version = None
        deadline = time.monotonic() + 180
        while version is None:
            if time.monotonic() > deadline:
                logs = _docker("logs", name, check=False, timeout=30)
                raise RuntimeError(f"{server} ({image}) did not start: {logs[-2000:]}")
            time.sleep(0.5)
            version = _sql_ready(dialect, url)
        if not version.startswith(prefix):
            raise RuntimeError(f"{image} reports {server} version {version!r}")
        refused = server in REFUSED_SQL
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in {"REDIS_URL", "POSTGRES_URL", "MYSQL_URL", "CIDEM_EXPECT_REFUSED"}
        }
        env.update(CELERY_IDEMPOTENT_STRICT="1")
        env["POSTGRES_URL" if dialect == "postgres" else "MYSQL_URL"] = url
        if refused:
            env["CIDEM_EXPECT_REFUSED"] = "1"
        subset = REFUSED_SUBSET if refused else SQL_SUBSET[dialect]
        with tempfile.TemporaryDirectory(prefix="cidem-sql-") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                 f"--junitxml={out}/junit.xml", *subset],
                check=False, capture_output=True, text=True, timeout=timeout, cwd=root, env=env,
            )  # fmt: skip
            counts = _counts(Path(out) / "junit.xml")
    finally:
        _docker("rm", "-f", name, check=False)
    failed, errors, skipped = counts["failures"], counts["errors"], counts["skipped"]
    xfailed = counts["xfailed"]
    return CellResult(
        python=f"{platform.python_version()} (host)",
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


def sql_table(results: list[CellResult]) -> str:
    """The SQL cells as a Markdown table: server, version, what ran, passed (failed)."""
    lines = ["| Server | Release | Version | Subset | Result |", "|---|---|---|---|---|"]
    for result in results:
        distro = SQL_SERVERS[result.server][0]
        subset = "refusal" if result.server in REFUSED_SQL else "SQL contract"
        mark = "pass" if result.ok else "FAIL"
        failed = result.failed + result.errors
        lines.append(
            f"| {result.server} | {distro} | {result.server_version} | {subset} | "
            f"{mark}: {result.passed} passed, {failed} failed |"
        )
    return "\n".join(lines)


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
    """Run ``cells`` (every cell, the SQL ones too, by default) and print the tables;
    an SQL cell is ``("sql", server)``."""
    results, sql_results = [], []
    chosen = cells or [*CELLS, *(("sql", server) for server in SQL_SERVERS)]
    for python, server in chosen:
        if python == "sql":
            result = run_sql_cell(server)
            sql_results.append(result)
        else:
            result = run_cell(python, server)
            results.append(result)
        print(f"{result.python} x {server} ({result.server_version}): {result.passed} passed, "
              f"{result.failed} failed, {result.errors} errors, {result.skipped} skipped, "
              f"{result.xfailed} xfailed "
              f"in {result.seconds} s", flush=True)  # fmt: skip
        if not result.ok:
            print(result.output_tail, flush=True)
    if results:
        print(table(results))
    if sql_results:
        print(sql_table(sql_results))
    every = results + sql_results
    if report is not None:
        report.write_text(json.dumps([asdict(r) for r in every], indent=2))
    return 0 if all(r.ok for r in every) else 1
