"""A worker's process tree, read from ``/proc`` (no psutil): its pool children, its group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

__all__ = ["children_of", "group_members", "kill_group"]


def _living_pids(field: int, value: int) -> list[int] | None:
    """Living PIDs whose ``/proc/<pid>/stat`` field ``field`` (after the command name: 1 is
    the parent pid, 2 the process group) equals ``value``; ``None`` without ``/proc``."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - not Linux
        return None
    found: list[int] = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # "pid (comm) S ppid pgrp ...": comm may hold spaces and parentheses; split after ')'
        fields = stat.rsplit(b")", 1)[1].split()
        if int(fields[field]) == value and fields[0] not in (b"Z", b"X"):
            found.append(int(entry))
    return sorted(found)


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (living ones only), by scanning ``/proc``."""
    found = _living_pids(1, pid)
    return _children_ps(pid) if found is None else found


def group_members(pgid: int) -> list[int]:
    """Living PIDs in process group ``pgid`` (a worker and its pool share one)."""
    return _living_pids(2, pgid) or []


def _children_ps(pid: int) -> list[int]:  # pragma: no cover - not Linux
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    return sorted(int(p) for p in out.split())


def kill_group(pgid: int, timeout: float = 5.0) -> None:
    """SIGKILL process group ``pgid`` and wait until none of its members is alive."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.01)
