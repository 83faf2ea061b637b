"""``python -m benchmarks.mysql``: the MySQL / MariaDB backend against a plain transaction, beside
the PostgreSQL backend against its own (``benchmarks.pg``'s cases).

One body throughout: ``INSERT`` one payment row. Cases, each run ``--n`` times, interleaved
round by round so that drift hits every case alike:

- ``plain_tx``: the body in a plain PyMySQL transaction (``conn.begin()`` ... ``commit()``), no
  idempotency at all: the floor.
- ``my_first``: the guard on the MySQL backend, a new key each time; the body's INSERT goes
  through ``current_connection()`` and commits with the record.
- ``my_duplicate``: a key already completed (the replay).

Round trips are counted by ``benchmarks.pg.FlightCounter`` (a TCP relay: every burst the client
sends after the server last answered is one; connection set-up is not counted), in a separate
pass; times come from direct connections: p50 and mean per call in microseconds, and the ratio
to ``plain_tx``. The target (issue 26): ``my_first`` costs no round trip more than
``plain_tx``; the run fails (exit 1) when it does. With ``--postgres-url`` (or
``$POSTGRES_URL``, else a private server when ``initdb`` is found) the PostgreSQL benchmark runs
too and both tables are printed, side by side in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pymysql

from benchmarks.pg import FlightCounter
from celery_idempotent import DistributedIdempotencyGuard, MySQLBackend, current_connection
from celery_idempotent.backends.mysql.connections import connect_args


def _connect(url: str) -> Any:
    return pymysql.connect(**connect_args(url), autocommit=True)


def _cases(url: str, table: str) -> dict[str, Callable[[], Any]]:
    payments = f"`{table}_payments`"
    backend = MySQLBackend(url, table=table)
    guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend)
    plain = _connect(url)
    counter = iter(range(10**9))

    def insert(conn: Any, key: str) -> str:
        with conn.cursor() as cur:
            cur.execute(f"INSERT INTO {payments} (k) VALUES (%s)", (key,))  # noqa: S608
        return key

    def plain_tx() -> Any:
        plain.begin()
        try:
            value = insert(plain, f"p{next(counter)}")
        except BaseException:
            plain.rollback()
            raise
        plain.commit()
        return value

    def body(key: str) -> Callable[[], str]:
        return lambda: insert(current_connection(), key)

    guard.execute("dup", body("dup"))

    def my_first() -> Any:
        key = f"g{next(counter)}"
        return guard.execute(key, body(key))

    return {
        "plain_tx": plain_tx,
        "my_first": my_first,
        "my_duplicate": lambda: guard.execute("dup", body("dup")),
    }


def round_trips(url: str, table: str) -> dict[str, float]:
    """Round trips per call of each case (mean of 20 calls after a warm-up call)."""
    parts = urlsplit(url)
    relay = FlightCounter(parts.hostname or "127.0.0.1", parts.port or 3306)
    try:
        cases = _cases(relay.url(url), table)
        found = {}
        for name, case in cases.items():
            case()  # warm: connections made, table checked
            before = relay.flights
            runs = 20
            for _ in range(runs):
                case()
            time.sleep(0.05)
            found[name] = (relay.flights - before) / runs
        return found
    finally:
        relay.close()


def _times(url: str, table: str, n: int) -> dict[str, dict[str, float]]:
    cases = _cases(url, table)
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


def run(url: str, n: int) -> dict[str, dict[str, float]]:
    """The MySQL report: each case's round trips and times."""
    table = f"bench_{uuid.uuid4().hex[:8]}"
    conn = _connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE `{table}_payments` (k VARCHAR(64)) ENGINE=InnoDB")
        trips = round_trips(url, table)
        times = _times(url, table, n)
    finally:
        with conn.cursor() as cur:
            for name in (table, f"{table}_fencing", f"{table}_payments"):
                cur.execute(f"DROP TABLE IF EXISTS `{name}`")
        conn.close()
    return {name: {"trips": trips[name], **times[name]} for name in times}


def _postgres(url: str | None, n: int) -> dict[str, Any] | None:
    """``benchmarks.pg``'s report (PostgreSQL beside Redis), or ``None`` without a server."""
    from benchmarks import pg

    servers: list[Any] = []
    try:
        if not url:
            from celery_idempotent.servers.postgres_server import (
                PostgresServer,
                find_binaries,
            )

            if find_binaries() is None:
                return None
            servers.append(PostgresServer().start())
            url = servers[-1].url
        from celery_idempotent.servers.redis_server import start_private_redis

        redis_server = start_private_redis()
        servers.append(redis_server)
        table = f"bench_{uuid.uuid4().hex[:8]}"
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'CREATE TABLE "{table}_payments" (key text)')
        try:
            trips = pg._round_trips(url, redis_server.url(), table)
            times = pg._times(url, redis_server.url(), table, n)
        finally:
            with psycopg.connect(url, autocommit=True) as conn:
                for name in (table, f"{table}_payments"):
                    conn.execute(f'DROP TABLE IF EXISTS "{name}"')
                conn.execute(f'DROP SEQUENCE IF EXISTS "{table}_fencing"')
        cases = ("plain_tx", "pg_first", "pg_duplicate")
        return {name: {"trips": trips[name]["postgres"], **times[name]} for name in cases}
    finally:
        for server in reversed(servers):
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mysql", description=__doc__)
    parser.add_argument("--mysql-url", default=os.environ.get("MYSQL_URL"))
    parser.add_argument("--postgres-url", default=os.environ.get("POSTGRES_URL"))
    parser.add_argument("--no-postgres", action="store_true", help="MySQL only")
    parser.add_argument("--n", type=int, default=500, help="calls per case")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    server = None
    try:
        url = options.mysql_url
        if not url:
            from celery_idempotent.servers.mysql_server import MySQLServer

            server = MySQLServer().start()
            url = server.url
        report: dict[str, Any] = {"mysql": run(url, options.n)}
    finally:
        if server is not None:
            server.stop()
    if not options.no_postgres:
        report["postgres"] = _postgres(options.postgres_url, options.n)
    mysql = report["mysql"]
    extra = mysql["my_first"]["trips"] - mysql["plain_tx"]["trips"]
    report["extra_round_trips_mysql"] = extra
    if options.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{'database':<10}{'case':<15}{'trips':>7}{'p50 µs':>10}{'mean µs':>10}{'× plain':>9}"
        )
        for database in ("mysql", "postgres"):
            for name, row in (report.get(database) or {}).items():
                print(
                    f"{database:<10}{name:<15}{row['trips']:>7.1f}{row['p50_us']:>10.0f}"
                    f"{row['mean_us']:>10.0f}{row['x_plain']:>9.2f}"
                )
    if extra > 0:
        print(f"MySQL: a first execution cost {extra} round trip(s) more than a plain transaction")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
