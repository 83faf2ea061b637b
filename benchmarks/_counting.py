"""The benchmark's round trips: a process-wide tally over :mod:`tests.support.counting`.

What counts as a round trip is that module's (one send of a command or a whole pipeline; the
handshake and health-check PINGs left out), with the same connection class. Only the tally is
the benchmark's own: a class-level count and, while a caller wants it, the name of each send's
first command, so that a timed loop pays an increment and a short regex per send, never the
full parse the tests' recorder makes.
"""

from __future__ import annotations

from typing import Any

import redis

from tests.support.counting import HANDSHAKE, counting_connection, first_command


class Counter:
    """Round trips of all counting clients of this process (the benchmark is single-threaded)."""

    sends = 0
    trace: list[str] | None = None  # command names, while a caller wants them

    @classmethod
    def record(cls, command: Any) -> None:
        name = first_command(command)
        if name in HANDSHAKE:
            return
        cls.sends += 1
        if cls.trace is not None:
            cls.trace.append(name)


def counting_client(url: str, **kwargs: Any) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` whose connections count their round trips."""
    client = redis.Redis.from_url(url, **kwargs)
    pool = client.connection_pool
    pool.connection_class = counting_connection(pool.connection_class, Counter.record)
    return client
