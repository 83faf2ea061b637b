"""Round trips counted at the client: every write of a request to the socket is one.

redis-py sends a command, or a whole pipeline, with one ``send_packed_command`` call and then
reads the replies, so counting those calls counts round trips (a pipeline of five commands is
one). The connection's handshake (HELLO, AUTH, SELECT, CLIENT SETINFO) is not counted, nor is a
health-check PING (clients made here have no health-check interval anyway).
"""

from __future__ import annotations

import re
from typing import Any

import redis

_NAME = re.compile(rb"^\*\d+\r\n\$\d+\r\n([A-Za-z]+)")


class Counter:
    """Round trips of all counting clients of this process (the benchmark is single-threaded)."""

    sends = 0
    trace: list[str] | None = None  # command names, while a caller wants them

    @classmethod
    def record(cls, command: Any) -> None:
        cls.sends += 1
        if cls.trace is not None:
            first = command if isinstance(command, (bytes, bytearray)) else command[0]
            match = _NAME.match(bytes(first[:64]))
            cls.trace.append(match.group(1).decode().upper() if match else "?")


_classes: dict[type, type] = {}


def _counting(base: type) -> type:
    if base in _classes:
        return _classes[base]

    class CountingConnection(base):  # type: ignore[valid-type, misc]
        _handshaking = False

        def on_connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
            self._handshaking = True
            try:
                return super().on_connect_check_health(*args, **kwargs)
            finally:
                self._handshaking = False

        def send_packed_command(self, command: Any, check_health: bool = True) -> Any:
            if not self._handshaking and check_health:
                Counter.record(command)
            return super().send_packed_command(command, check_health)

    CountingConnection.__name__ = f"Counting{base.__name__}"
    _classes[base] = CountingConnection
    return CountingConnection


def counting_client(url: str, **kwargs: Any) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` whose connections count their round trips."""
    client = redis.Redis.from_url(url, **kwargs)
    pool = client.connection_pool
    pool.connection_class = _counting(pool.connection_class)
    return client
