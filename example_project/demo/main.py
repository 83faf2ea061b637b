"""``python -m example_project``: the run, its report, its exit status, Ctrl-C and SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

from example_project.demo.console import Console
from example_project.demo.options import parse_args
from example_project.demo.report import render
from example_project.demo.run import Demo
from example_project.demo.stage import DemoError

__all__ = ["main"]

EXIT_OK = 0
EXIT_DOUBLE_EXECUTION = 1
EXIT_FAILED = 3
EXIT_INTERRUPTED = 130


class Interrupted(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


@contextlib.contextmanager
def _signals_as_interrupts() -> Iterator[None]:
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python keeps that.
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_term),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while tearing down: a second Ctrl-C must not leave orphans."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    console = Console(sys.stderr)
    demo = Demo(opts, console)
    summary: dict[str, Any] = {"ok": False}
    status = EXIT_FAILED
    error: str | None = None
    try:
        with _signals_as_interrupts():
            summary = demo.run()
        status = (
            EXIT_OK
            if summary["ok"]
            else (EXIT_DOUBLE_EXECUTION if summary["double_executions"] else EXIT_FAILED)
        )
    except KeyboardInterrupt:
        console.done()
        console.info("interrupted: stopping the workers and Redis")
        status = EXIT_INTERRUPTED
        error = "interrupted"
    except DemoError as exc:
        console.done()
        error = str(exc)
        console.info(f"error: {exc}")
    except Exception as exc:  # a bug or an unreachable server: report it, still clean up
        console.done()
        error = repr(exc)
        traceback.print_exc()
    finally:
        with _shielded():
            cleanup = demo.close(quick=status != EXIT_OK)
    summary["cleanup"] = cleanup
    summary["wall_seconds"] = round(time.monotonic() - demo.started, 2)
    summary["exit_status"] = status
    if error is not None:
        summary["error"] = error
    if status in (EXIT_OK, EXIT_DOUBLE_EXECUTION) or "checks" in summary:
        report = render(summary, cleanup)
        print(report, file=sys.stderr if opts.json else sys.stdout, flush=True)
    if cleanup["left_running"]:
        console.info(f"warning: processes still running: {cleanup['left_running']}")
        if status == EXIT_OK:
            status = EXIT_FAILED
            summary["exit_status"] = status
    if opts.json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    return status
