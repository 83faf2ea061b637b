"""What the demo prints while it runs: progress on stderr, one rewritten line on a terminal."""

from __future__ import annotations

import threading
import time
from typing import TextIO

from celery_idempotent.urls import redact

__all__ = ["Console", "redact_url"]


def redact_url(url: str | None) -> str:
    """``url`` without its password, for the console (``""`` for none)."""
    if not url:
        return ""
    return redact(url)


class Console:
    """Progress on stderr (one rewritten line on a TTY, a line a second otherwise)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._last_plain = 0.0
        self._width = 0
        self._lock = threading.Lock()

    def info(self, text: str) -> None:
        with self._lock:
            self._clear()
            print(text, file=self.stream, flush=True)

    def progress(self, text: str, *, force: bool = False) -> None:
        with self._lock:
            if self.tty:
                pad = max(0, self._width - len(text))
                self.stream.write("\r" + text + " " * pad)
                self.stream.flush()
                self._width = len(text)
            elif force or time.monotonic() - self._last_plain >= 1.0:
                print(text, file=self.stream, flush=True)
                self._last_plain = time.monotonic()

    def done(self) -> None:
        with self._lock:
            if self.tty and self._width:
                self.stream.write("\n")
                self.stream.flush()
                self._width = 0

    def _clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
