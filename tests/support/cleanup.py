"""A safety net: every server, cluster, Sentinel group and proxy still open at exit is closed."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from typing import Any

_LIVE: set[Any] = set()
_LIVE_LOCK = threading.Lock()
_OWNER_PID = os.getpid()


def close_at_exit(obj: Any) -> None:
    """Call ``obj.close()`` at interpreter exit unless :func:`forget_at_exit` is called first."""
    with _LIVE_LOCK:
        _LIVE.add(obj)


def forget_at_exit(obj: Any) -> None:
    """``obj`` was closed: nothing to do for it at exit."""
    with _LIVE_LOCK:
        _LIVE.discard(obj)


@atexit.register
def _close_all() -> None:
    """Safety net: close every proxy, cluster and server still open at interpreter exit.

    Only in the process that imported this module: a forked child (a worker pool) that runs
    atexit handlers must not stop the parent's servers.
    """
    if os.getpid() != _OWNER_PID:
        return
    with _LIVE_LOCK:
        live = list(_LIVE)
    for obj in live:
        with contextlib.suppress(Exception):
            obj.close()
