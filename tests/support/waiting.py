"""Waiting in a test for something other processes do: poll, and fail with what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["wait_for"]


def wait_for(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that; fail the test
    (naming ``what``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)
