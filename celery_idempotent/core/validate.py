"""Argument checks shared by the guard, the backends and the settings.

Messages name the option and the bad value, as Python's own errors for bad arguments do.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any

__all__ = ["check_count", "check_delay", "check_duration", "check_ttl"]


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of seconds or a datetime.timedelta, "
            f"not {type(value).__name__} ({value!r})"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float is a bad argument, not a crash
        seconds = math.inf
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    return seconds


def check_duration(name: str, value: Any) -> float:
    """A positive duration in seconds (int, float or timedelta) as a float."""
    seconds = _seconds(name, value)
    if seconds <= 0:
        raise ValueError(f"{name} must be greater than 0 seconds, got {value!r}")
    return seconds


def check_ttl(name: str, value: Any) -> float:
    """A record's time to live in seconds: greater than 0, or exactly 0 (nothing is kept once
    the body ends: the key frees as soon as the body commits)."""
    seconds = _seconds(name, value)
    if seconds < 0:
        raise ValueError(
            f"{name} must be 0 (remember nothing once the body ends) or more seconds, got {value!r}"
        )
    return seconds


def check_delay(name: str, value: Any) -> float:
    """A delay in seconds that may be 0 (no wait)."""
    seconds = _seconds(name, value)
    if seconds < 0:
        raise ValueError(f"{name} must be 0 or more seconds, got {value!r}")
    return seconds


def check_count(name: str, value: Any) -> int:
    """A whole number that is 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if value < 0:
        raise ValueError(f"{name} must be 0 or more, got {value!r}")
    return value
