"""A private, throw-away MariaDB (or MySQL) server (the tests, the demo, the benchmark).

The server binary is looked up in ``MYSQL_BIN_DIR``, on ``PATH`` and in ``/usr/sbin``
(Debian's ``mariadb-server-core`` installs ``/usr/sbin/mariadbd``): ``mariadbd`` first, then
``mysqld``. The data directory is created with ``mariadb-install-db`` (or ``mysqld
--initialize-insecure`` for MySQL) in a temporary directory, the server listens on
127.0.0.1 on a free port and a socket inside that directory, and everything is deleted on
stop. As root the server runs as ``nobody`` (mariadbd refuses root without ``--user``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from celery_idempotent.servers.processes import free_port

__all__ = ["MySQLServer", "find_server"]


def find_server() -> tuple[Path, str] | None:
    """(the server binary, ``"mariadb"`` or ``"mysql"``), or ``None``."""
    dirs = [os.environ["MYSQL_BIN_DIR"]] if os.environ.get("MYSQL_BIN_DIR") else []
    dirs += [*os.environ.get("PATH", "").split(os.pathsep), "/usr/sbin", "/usr/local/sbin"]
    for name, flavour in (("mariadbd", "mariadb"), ("mysqld", "mysql")):
        for each in dirs:
            path = Path(each) / name
            if each and path.is_file() and os.access(path, os.X_OK):
                # Debian's mysqld is a link to mariadbd
                return path, "mariadb" if path.resolve().name == "mariadbd" else flavour
    return None


class MySQLServer:
    """``with MySQLServer() as db: db.url`` -- initialize, start, and on exit stop and delete.

    ``db.url`` is ``mysql://root@127.0.0.1:<port>/test`` (database ``test``, created at
    start; root has no password on a private server).
    """

    def __init__(self, *, max_connections: int = 300) -> None:
        self.max_connections = max_connections
        self.port = 0
        self.root: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.flavour = ""

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/test"

    def start(self, timeout: float = 90.0) -> MySQLServer:
        found = find_server()
        if found is None:
            raise RuntimeError(
                "no MySQL or MariaDB server binary (mariadbd, mysqld) found: install "
                "mariadb-server (Debian: apt-get install mariadb-server-core), set "
                "MYSQL_BIN_DIR, or give MYSQL_URL"
            )
        binary, self.flavour = found
        self.root = Path(tempfile.mkdtemp(prefix="cidem-mysql-"))
        data = self.root / "data"
        data.mkdir()
        user = None
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            user = "nobody"
            nobody = pwd.getpwnam("nobody")
            for path in (self.root, data):
                os.chown(path, nobody.pw_uid, nobody.pw_gid)
        log = self.root / "server.log"
        user_args = [f"--user={user}"] if user else []
        if self.flavour == "mariadb":
            install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
            if install is None:
                raise RuntimeError("mariadb-install-db not found (it ships with mariadbd)")
            init = [install, "--no-defaults", f"--datadir={data}",
                    "--auth-root-authentication-method=normal", "--skip-test-db",
                    f"--basedir={binary.parent.parent}", *user_args]  # fmt: skip
        else:
            init = [str(binary), "--no-defaults", "--initialize-insecure",
                    f"--datadir={data}", *user_args]  # fmt: skip
        done = subprocess.run(init, capture_output=True, check=False)  # noqa: S603
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"initializing MySQL failed: {done.stderr.decode()[-2000:]}")
        self.port = free_port()
        sock = self.root / "mysql.sock"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - our own arguments
                [str(binary), "--no-defaults", f"--datadir={data}", f"--port={self.port}",
                 "--bind-address=127.0.0.1", f"--socket={sock}", f"--pid-file={self.root / 'pid'}",
                 f"--max-connections={self.max_connections}", "--skip-name-resolve",
                 "--innodb-flush-log-at-trx-commit=2", "--innodb-buffer-pool-size=64M",
                 "--innodb-log-file-size=48M", "--skip-log-bin", *user_args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = log.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"the MySQL server exited: {text}")
            if self._ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the MySQL server did not start in {timeout}s")

    def _ready(self) -> bool:
        import pymysql  # noqa: PLC0415

        try:
            conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2)
        except pymysql.err.MySQLError:
            return False
        try:
            with conn.cursor() as cur:
                cur.execute("CREATE DATABASE IF NOT EXISTS test")
        finally:
            conn.close()
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)  # a clean shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> MySQLServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
