"""Back-off between lock attempts, and a wait that an abort event cuts short.

Jitter matters here: the workers that compete for a key were usually woken by the same event
(a redelivery burst, a user's double click), and without jitter they would retry in lockstep.
"""

from __future__ import annotations

import random as _random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["ExponentialJitterBackoff", "Jitter", "Sleep", "event_sleep"]

#: ``sleep(delay, abort)`` waits ``delay`` seconds and returns ``True`` when ``abort`` ended
#: the wait early. Inject a fake one in tests so that no test of back-off really sleeps.
Sleep = Callable[[float, "threading.Event | None"], bool]


def event_sleep(delay: float, abort: threading.Event | None) -> bool:
    """Sleep ``delay`` seconds; an ``abort`` event that is set wakes the sleep at once."""
    if abort is None:
        if delay > 0:
            time.sleep(delay)
        return False
    return abort.wait(delay) if delay > 0 else abort.is_set()


#: How a back-off's jitter is applied (see :class:`ExponentialJitterBackoff`).
Jitter = Literal["add", "none", "equal"]


@dataclass(frozen=True)
class ExponentialJitterBackoff:
    """Exponential back-off, ``base * 2**retry``, with a jitter and an optional cap per wait.

    ``retry`` is 0-based. ``jitter`` says how the randomness enters:

    - ``"add"`` (the guard's lock attempts): ``base * 2**retry + uniform(0, base)``, capped
      at ``max_delay``. The wait before the first retry is ``base + uniform(0, base)``.
    - ``"none"`` (the guard's commit resends): ``base * 2**retry``, capped.
    - ``"equal"`` (the task's re-queue countdown): ``base * 2**retry`` capped, then times
      ``0.5 + uniform(0, 1) / 2``.

    ``base=0`` never waits.
    """

    base: float
    max_delay: float | None = None
    random: Callable[[], float] = _random.random
    jitter: Jitter = "add"

    def __post_init__(self) -> None:
        if self.jitter not in ("add", "none", "equal"):
            raise ValueError(f"jitter must be 'add', 'none' or 'equal', got {self.jitter!r}")

    def delay(self, retry: int) -> float:
        """The wait before retry number ``retry`` (0-based)."""
        if self.base <= 0:
            return 0.0
        # 2**retry overflows a float long before any sane retry count; cap the exponent.
        delay = self.base * (2.0 ** min(retry, 62))
        if self.jitter == "equal":
            if self.max_delay is not None:
                delay = min(delay, self.max_delay)
            return delay * (0.5 + self.random() / 2)
        if self.jitter == "add":
            delay += self.random() * self.base
        if self.max_delay is not None:
            delay = min(delay, self.max_delay)
        return delay
