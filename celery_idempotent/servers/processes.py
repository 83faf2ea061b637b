"""Child processes of a test run or a demo: started in a session of their own, stopped by pid.

The private servers of :mod:`celery_idempotent.servers` (Redis, PostgreSQL) are started with
these, and so are the processes of the example project and of the repository's own tests. A
child runs in a new session, so that Ctrl-C in the terminal reaches only the parent, which then
stops its children in order; a child is stopped by its pid or its process group, never by name.
On Linux a child started from the main thread also gets ``PR_SET_PDEATHSIG``: when the parent
is killed with SIGKILL, its children die with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Optional, Union

__all__ = ["die_with_parent", "free_port", "pid_alive", "spawn", "stop_process", "tail"]

#: Where a child's output goes: a file (appended to), an open file, or ``None`` (discarded).
Output = Optional[Union[Path, IO[Any]]]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (another process may take it before the
    caller binds it: a server that fails with "in use" is started again on another)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGKILL this process when the thread that forked it dies (a ``preexec_fn``)."""
    import ctypes  # noqa: PLC0415 - only in a forked child, on Linux

    pr_set_pdeathsig = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def spawn(
    argv: Sequence[str],
    *,
    output: Output = None,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own, its stdout and stderr both to ``output``.

    ``env`` replaces the environment when given. The child dies with this process on Linux
    (``PR_SET_PDEATHSIG``) when it is started from the main thread: the signal follows the
    thread that forked, so a child forked from another thread would die with that thread.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    preexec = die_with_parent if sys.platform.startswith("linux") and in_main_thread else None
    with contextlib.ExitStack() as stack:
        out: Any = subprocess.DEVNULL
        if isinstance(output, Path):
            out = stack.enter_context(output.open("ab"))
        elif output is not None:
            out = output
        # S603: the program and every argument are the caller's own, not user input.
        return subprocess.Popen(  # noqa: S603
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=None if env is None else dict(env),
            start_new_session=True,
            preexec_fn=preexec,  # noqa: PLW1509 - only from the main thread, see above
        )


def stop_process(
    proc: subprocess.Popen[bytes],
    timeout: float,
    *,
    sig: int = signal.SIGTERM,
    group: bool = False,
) -> None:
    """Send ``sig`` to ``proc``, wait up to ``timeout``, then SIGKILL it, and reap it.

    Only a child that has not been reaped yet is signalled, so a recycled pid is never hit.
    With ``group=True`` the whole process group led by ``proc`` (a child of :func:`spawn` leads
    its own) is SIGKILLed at the end either way: the leader may be gone while its children (a
    worker's pool) are not.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if not group:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signal.SIGKILL)
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file (``""`` when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
