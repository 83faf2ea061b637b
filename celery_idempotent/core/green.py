"""Which green runtime (gevent, eventlet) has monkey-patched this process, and the originals.

``celery worker -P gevent|eventlet`` patches the standard library before the app is imported:
``threading.Thread`` becomes a greenlet, locks and ``time.sleep`` yield to the hub, sockets go
through it. Everything of the process then shares one hub, so a body that does not yield (a
CPU loop, a C call) stops every other greenlet, lease renewals included. The lease keeper
therefore runs on a real OS thread, made with the functions saved here, and talks to Redis
through a socket of the real ``socket`` class: Python switches threads every few milliseconds
even while a pure-Python loop runs in the hub's thread.

Nothing here imports gevent or eventlet: a runtime counts only when the process has patched
itself with it, which is asked lazily (the app may import this package before it patches).
"""

from __future__ import annotations

import _thread
import contextlib
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Natives", "natives", "runtime"]


def runtime() -> str | None:
    """``"gevent"`` or ``"eventlet"`` when that library has patched threads or sockets of this
    process, else ``None``."""
    monkey = sys.modules.get("gevent.monkey")
    # A library without these functions (a very old release) counts as not patching.
    if monkey is not None:
        with contextlib.suppress(Exception):
            if monkey.is_module_patched("threading") or monkey.is_module_patched("socket"):
                return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None:
        with contextlib.suppress(Exception):
            if patcher.is_monkey_patched("thread") or patcher.is_monkey_patched("socket"):
                return "eventlet"
    return None


class Natives:
    """The unpatched primitives: OS threads, OS locks, a blocking sleep, real sockets."""

    def __init__(  # noqa: PLR0917 - built in one place, from positional originals
        self,
        runtime: str | None,
        start_new_thread: Callable[..., Any],
        allocate_lock: Callable[[], Any],
        sleep: Callable[[float], None],
        socket_class: type[Any],
        getaddrinfo: Callable[..., Any],
    ) -> None:
        self.runtime = runtime
        self.start_new_thread = start_new_thread
        self.allocate_lock = allocate_lock
        self.sleep = sleep
        self.socket_class = socket_class
        self.getaddrinfo = getaddrinfo


_natives: dict[str | None, Natives] = {}


def natives() -> Natives:
    """The originals for the runtime that patched this process (the standard library's own
    functions when none did)."""
    which = runtime()
    found = _natives.get(which)
    if found is None:
        found = _natives[which] = _originals(which)
    return found


def _originals(which: str | None) -> Natives:
    if which == "gevent":
        from gevent import monkey  # noqa: PLC0415 - only when it patched the process

        get = monkey.get_original
        return Natives(
            which,
            get("_thread", "start_new_thread"),
            get("_thread", "allocate_lock"),
            get("time", "sleep"),
            get("socket", "socket"),
            get("socket", "getaddrinfo"),
        )
    if which == "eventlet":
        from eventlet import patcher  # noqa: PLC0415 - only when it patched the process

        real_thread = patcher.original("_thread")
        real_socket = patcher.original("socket")
        return Natives(
            which,
            real_thread.start_new_thread,
            real_thread.allocate_lock,
            patcher.original("time").sleep,
            real_socket.socket,
            real_socket.getaddrinfo,
        )
    return Natives(
        None,
        _thread.start_new_thread,
        _thread.allocate_lock,
        time.sleep,
        socket.socket,
        socket.getaddrinfo,
    )
