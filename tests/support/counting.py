"""Round trips counted at the client, for the tests and the benchmarks alike.

One round trip is one send of a request: redis-py writes a command, or a whole pipeline, with
one ``send_packed_command`` call and then reads the replies, so a pipeline of five commands is
one. Two kinds of send are not the caller's round trips and are never counted: the connection's
set-up (a send made only of :data:`HANDSHAKE` commands: HELLO, AUTH, SELECT, CLIENT SETNAME and
SETINFO, READONLY), and redis-py's own health-check PING (sent with ``check_health=False``).

:func:`counting_connection` makes the connection class that reports each send;
:class:`RoundTrips` is the tests' recorder (every send with its command names, thread-safe);
the benchmarks keep a cheaper process-wide tally over the same connection class
(``benchmarks/_counting.py``: no full parse inside a timed loop).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import redis

__all__ = [
    "HANDSHAKE",
    "RoundTrips",
    "command_names",
    "counting_client",
    "counting_connection",
    "first_command",
]

#: Commands of connection set-up: not round trips of the library's operations.
HANDSHAKE = frozenset({"HELLO", "AUTH", "SELECT", "CLIENT", "READONLY"})

_FIRST = re.compile(rb"^\*\d+\r\n\$\d+\r\n([A-Za-z]+)")

C = TypeVar("C", bound=type)


def _joined(packed: Any) -> bytes:
    if isinstance(packed, (bytes, bytearray, memoryview, str)):
        packed = [packed]
    return b"".join(chunk.encode() if isinstance(chunk, str) else bytes(chunk) for chunk in packed)


def command_names(packed: Any) -> list[str]:
    """The command names in one packed RESP send (several for a pipeline)."""
    data = _joined(packed)
    names: list[str] = []
    pos = 0
    while pos < len(data):
        assert data[pos : pos + 1] == b"*", f"not a RESP array at {pos}: {data[pos : pos + 20]!r}"
        end = data.index(b"\r\n", pos)
        count = int(data[pos + 1 : end])
        pos = end + 2
        for index in range(count):
            end = data.index(b"\r\n", pos)
            length = int(data[pos + 1 : end])
            arg = data[end + 2 : end + 2 + length]
            pos = end + 2 + length + 2
            if index == 0:
                names.append(arg.decode().upper())
    return names


def first_command(packed: Any) -> str:
    """The name of the first command of one packed send (``"?"`` if it cannot be read): cheap
    enough for a timed loop, unlike :func:`command_names`."""
    first = packed if isinstance(packed, (bytes, bytearray, memoryview, str)) else packed[0]
    head = first[:64].encode() if isinstance(first, str) else bytes(first[:64])
    match = _FIRST.match(head)
    return match.group(1).decode().upper() if match else "?"


def counting_connection(base: C, on_send: Callable[[Any], None]) -> C:
    """A subclass of the connection class ``base`` that hands each packed send to ``on_send``,
    except redis-py's health-check PINGs (the caller leaves the handshake out by its names)."""

    class CountingConnection(base):  # type: ignore[misc, valid-type]
        def send_packed_command(self, command: Any, check_health: bool = True) -> Any:
            if check_health:
                on_send(command)
            return super().send_packed_command(command, check_health)

    CountingConnection.__name__ = f"Counting{base.__name__}"
    return CountingConnection  # type: ignore[return-value]


class RoundTrips:
    """Every write to the server that carries a command, as the client sends it.

    One send is one round trip: a pipeline packs all its commands into a single send. Sends made
    only of connection set-up commands (:data:`HANDSHAKE`) are not recorded.
    """

    def __init__(self) -> None:
        self.sends: list[list[str]] = []
        self._lock = threading.Lock()

    def record(self, names: list[str]) -> None:
        if names and not set(names) <= HANDSHAKE:
            with self._lock:
                self.sends.append(names)

    def record_packed(self, packed: Any) -> None:
        """:meth:`record` of one packed send (what :func:`counting_connection` hands over)."""
        self.record(command_names(packed))

    def reset(self) -> None:
        with self._lock:
            self.sends.clear()

    @property
    def count(self) -> int:
        return len(self.sends)

    def measure(self, fn: Callable[[], Any]) -> tuple[int, list[list[str]]]:
        """Round trips made by ``fn()`` (and the commands of each)."""
        self.reset()
        fn()
        sends = list(self.sends)
        return len(sends), sends


def counting_client(url: str, trips: RoundTrips, **kwargs: Any) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` whose connections report every send to ``trips``."""
    import redis

    client = redis.Redis.from_url(url, **kwargs)
    pool = client.connection_pool
    pool.connection_class = counting_connection(pool.connection_class, trips.record_packed)
    return client
