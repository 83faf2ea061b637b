"""``python -m benchmarks.pg``: the PostgreSQL backend against a plain transaction and Redis.

One body throughout: ``INSERT`` one payment row. Cases, each run ``--n`` times, interleaved
round by round so that drift hits every case alike:

- ``plain_tx``: the body in a plain psycopg transaction (``with conn.transaction():``), no
  idempotency at all: the floor.
- ``pg_first``: the guard on the PostgreSQL backend, a new key each time; the body's INSERT
  goes through ``current_connection()`` and commits with the record.
- ``pg_duplicate``: a key already completed (the replay).
- ``redis_first``: the guard on the Redis backend, with the same body in its own plain
  transaction (what a body does without the PostgreSQL backend).
- ``redis_duplicate``: a completed key on Redis.

Round trips are counted by a TCP relay in front of each server, in a separate pass: every
burst the client sends after the server last answered is one (a pipelined flight is one);
connection set-up is not counted. Times come from direct connections (no relay): p50 and mean
per call, in microseconds, and the ratio to ``plain_tx``.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis

from celery_idempotent import (
    DistributedIdempotencyGuard,
    PostgresBackend,
    RedisIdempotencyStore,
    RedisLockProvider,
    current_connection,
)


class FlightCounter:
    """A TCP relay that counts round trips: client flights, each answered by the server.

    Server-to-client data is held for ``delay`` seconds before it is passed on, so that a
    client that sends several statements without waiting (psycopg's pipeline mode) has sent
    them all before any answer reaches it: they count as one flight. A flight is a burst the
    client sends after an answer was delivered to it.
    """

    def __init__(self, host: str, port: int, delay: float = 0.02) -> None:
        self.target = (host, port)
        self.delay = delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flights = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def url(self, url: str) -> str:
        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)
        auth = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{self.port}"))

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        answered: dict[socket.socket, bool] = {}
        held: list[tuple[float, socket.socket, bytes]] = []
        while not self._stop:
            now = time.monotonic()
            while held and held[0][0] <= now:
                _, client, data = held.pop(0)
                try:
                    client.sendall(data)
                except OSError:
                    continue
                answered[client] = True
            timeout = 0.05 if not held else max(0.0, held[0][0] - time.monotonic())
            for key, _ in sel.select(timeout=timeout):
                if key.data is None:
                    client, _ = self.listener.accept()
                    upstream = socket.create_connection(self.target)
                    for s in (client, upstream):
                        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sel.register(client, selectors.EVENT_READ, ("c", upstream))
                    sel.register(upstream, selectors.EVENT_READ, ("s", client))
                    answered[client] = False
                    continue
                side, peer = key.data
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    for s in (sock, peer):
                        sel.unregister(s)
                        s.close()
                    continue
                if side == "c":
                    if answered.get(sock):
                        self.flights += 1
                        answered[sock] = False
                    peer.sendall(data)
                else:
                    held.append((time.monotonic() + self.delay, peer, data))

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.listener.close()


def _cases(pg_url: str, redis_url: str, table: str) -> dict[str, Callable[[], Any]]:
    payments = f'"{table}_payments"'
    backend = PostgresBackend(pg_url, table=table)
    pg_guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend)
    client = redis.Redis.from_url(redis_url)
    prefix = f"bench:{table}:"
    redis_guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client),
        lock_provider=RedisLockProvider(client, key_prefix=prefix),
        key_prefix=prefix,
    )
    plain = psycopg.connect(pg_url, autocommit=True)
    counter = iter(range(10**9))

    def insert(conn: Any, key: str) -> str:
        conn.execute(f"INSERT INTO {payments} (key) VALUES (%s)", (key,))  # noqa: S608
        return key

    def plain_tx() -> Any:
        with plain.transaction():
            return insert(plain, f"p{next(counter)}")

    def pg_body(key: str) -> Callable[[], str]:
        return lambda: insert(current_connection(), key)

    def redis_body(key: str) -> Callable[[], str]:
        def run() -> str:
            with plain.transaction():
                return insert(plain, key)

        return run

    pg_guard.execute("dup", pg_body("dup"))
    redis_guard.execute("dup", redis_body("dup"))

    def pg_first() -> Any:
        key = f"g{next(counter)}"
        return pg_guard.execute(key, pg_body(key))

    def redis_first() -> Any:
        key = f"r{next(counter)}"
        return redis_guard.execute(key, redis_body(key))

    return {
        "plain_tx": plain_tx,
        "pg_first": pg_first,
        "pg_duplicate": lambda: pg_guard.execute("dup", pg_body("dup")),
        "redis_first": redis_first,
        "redis_duplicate": lambda: redis_guard.execute("dup", redis_body("dup")),
    }


def _round_trips(pg_url: str, redis_url: str, table: str) -> dict[str, dict[str, float]]:
    pg_parts, rd_parts = urlsplit(pg_url), urlsplit(redis_url)
    pg_relay = FlightCounter(pg_parts.hostname or "127.0.0.1", pg_parts.port or 5432)
    rd_relay = FlightCounter(rd_parts.hostname or "127.0.0.1", rd_parts.port or 6379)
    try:
        cases = _cases(pg_relay.url(pg_url), rd_relay.url(redis_url), table)
        found = {}
        for name, case in cases.items():
            case()  # warm: connections made, scripts loaded
            before = (pg_relay.flights, rd_relay.flights)
            runs = 20
            for _ in range(runs):
                case()
            time.sleep(0.05)
            found[name] = {
                "postgres": (pg_relay.flights - before[0]) / runs,
                "redis": (rd_relay.flights - before[1]) / runs,
            }
        return found
    finally:
        pg_relay.close()
        rd_relay.close()


def _times(pg_url: str, redis_url: str, table: str, n: int) -> dict[str, dict[str, float]]:
    cases = _cases(pg_url, redis_url, table)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for case in cases.values():
        for _ in range(20):
            case()
    for _ in range(n):
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            samples[name].append(time.perf_counter() - start)
    floor = statistics.median(samples["plain_tx"])
    return {
        name: {
            "p50_us": round(statistics.median(values) * 1e6, 1),
            "mean_us": round(statistics.fmean(values) * 1e6, 1),
            "x_plain": round(statistics.median(values) / floor, 2),
        }
        for name, values in samples.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pg", description=__doc__)
    parser.add_argument("--postgres-url", default=os.environ.get("POSTGRES_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--n", type=int, default=500, help="calls per case")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    servers: list[Any] = []
    try:
        pg_url = options.postgres_url
        if not pg_url:
            from celery_idempotent.servers.postgres_server import PostgresServer

            servers.append(PostgresServer().start())
            pg_url = servers[-1].url
        redis_url = options.redis_url
        if not redis_url:
            from celery_idempotent.servers.redis_server import start_private_redis

            server = start_private_redis()
            servers.append(server)
            redis_url = server.url()
        table = f"bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f'CREATE TABLE "{table}_payments" (key text)')
        try:
            trips = _round_trips(pg_url, redis_url, table)
            times = _times(pg_url, redis_url, table, options.n)
        finally:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                for name in (table, f"{table}_payments"):
                    conn.execute(f'DROP TABLE IF EXISTS "{name}"')
                conn.execute(f'DROP SEQUENCE IF EXISTS "{table}_fencing"')
    finally:
        for server in reversed(servers):
            server.stop()
    report = {name: {**trips[name], **times[name]} for name in times}
    if options.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{'case':<16}{'PG trips':>9}{'Redis trips':>12}{'p50 µs':>10}{'mean µs':>10}{'× plain':>9}"
    )
    for name, row in report.items():
        print(
            f"{name:<16}{row['postgres']:>9.1f}{row['redis']:>12.1f}{row['p50_us']:>10.0f}"
            f"{row['mean_us']:>10.0f}{row['x_plain']:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
