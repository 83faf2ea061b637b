"""``python -m benchmarks.publish_pg``: publish throughput with the publish-side check on
PostgreSQL, next to the same check on Redis and a plain ``apply_async``.

A Redis broker queue that no worker consumes (a private ``redis-server`` unless
``--redis-url``), and PostgreSQL from ``--postgres-url`` (or ``POSTGRES_URL``; a table of the
run's own, dropped at the end). Kinds, blocks of ``--calls`` publishes taking turns, the order
rotated every round:

- ``plain``: ``@app.task``;
- ``redis``: ``base=IdempotentTask``, keys on the broker's Redis (check and push: one script);
- ``postgres``: ``base=IdempotentTask``, ``idempotency_url = postgresql://...``: the check is
  one statement in one pipelined flight (BEGIN, the statement, COMMIT), then kombu's push;
- ``postgres_duplicate``: the ``postgres`` task with the same arguments each time: every
  publish but the first is stopped by the check (no message).

Reported: publishes per second, the ratio to plain (over all rounds, and the median of the
per-round ratios), and the PostgreSQL flights per checked publish (counted at the backend).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

KINDS = ("plain", "redis", "postgres", "postgres_duplicate")


def run(redis_url: str, postgres_url: str, *, rounds: int, calls: int) -> dict[str, Any]:
    """Publishes per second of each kind, ratios to plain, and PostgreSQL flights."""
    import psycopg
    from celery import Celery

    from celery_idempotent import IdempotentTask
    from celery_idempotent.backends.postgres.connections import PsycopgTransactions
    from celery_idempotent.celery.factory import reset_backends

    session = uuid.uuid4().hex[:8]
    prefix = f"pubpg:{session}:"
    table = f"bench_pub_{session}"
    queue = f"{prefix}q"

    def app_for(name: str, **conf: Any) -> Celery:
        app = Celery(name, broker=redis_url, backend=redis_url, set_as_current=False)
        app.conf.update(
            task_default_queue=queue,
            broker_connection_retry_on_startup=True,
            broker_transport_options={"global_keyprefix": f"{prefix}kombu:"},
            idempotency_key_prefix=f"{prefix}idem:",
            idempotency_publish_ttl=600,
            task_acks_late=True,
            task_reject_on_worker_lost=True,
            **conf,
        )
        return app

    redis_app = app_for("bench_pub_redis", idempotency_url=redis_url)
    pg_app = app_for("bench_pub_pg", idempotency_url=f"{postgres_url}?table={table}")

    @redis_app.task(name="bench.plain", shared=False)
    def plain(i: int) -> int:
        return i

    @redis_app.task(name="bench.checked", base=IdempotentTask, shared=False)
    def on_redis(i: int) -> int:
        return i

    @pg_app.task(name="bench.checked", base=IdempotentTask, shared=False)
    def on_postgres(i: int) -> int:
        return i

    tasks = {"plain": plain, "redis": on_redis, "postgres": on_postgres}
    tasks["postgres_duplicate"] = on_postgres
    flights = {"n": 0}
    send = PsycopgTransactions._send

    def counted(self: Any, conn: Any, statements: Any) -> Any:
        flights["n"] += 1
        return send(self, conn, statements)

    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    pg_flights = dict.fromkeys(KINDS, 0)
    counter = 0
    reset_backends()
    PsycopgTransactions._send = counted  # type: ignore[method-assign]
    try:
        for warm in range(50):
            for kind, task in tasks.items():
                task.apply_async((-1 if kind == "postgres_duplicate" else 10**9 + warm,))
        for r in range(rounds):
            order = list(KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)])
            for kind in order:
                task = tasks[kind]
                before = flights["n"]
                t0 = time.perf_counter()
                for _ in range(calls):
                    counter += 1
                    task.apply_async((-1 if kind == "postgres_duplicate" else counter,))
                seconds[kind].append(time.perf_counter() - t0)
                pg_flights[kind] += flights["n"] - before
    finally:
        PsycopgTransactions._send = send  # type: ignore[method-assign]
        reset_backends()
        redis_app.close()
        pg_app.close()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
            conn.execute(f'DROP SEQUENCE IF EXISTS "{table}_fencing"')
        import redis

        client = redis.Redis.from_url(redis_url)
        for name in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(name)
        client.close()
    n = rounds * calls
    total = {kind: sum(seconds[kind]) for kind in KINDS}
    out: dict[str, Any] = {"publishes_per_kind": n, "rounds": rounds, "calls": calls}
    for kind in KINDS:
        per_round = [p / c for p, c in zip(seconds["plain"], seconds[kind])]
        out[kind] = {
            "per_s": round(n / total[kind]),
            "us": round(total[kind] / n * 1e6, 1),
            "ratio": round(total["plain"] / total[kind], 3),
            "ratio_median_of_rounds": round(statistics.median(per_round), 3),
            "postgres_flights_per_publish": pg_flights[kind] / n,
        }
    return out


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Publish throughput, {result['publishes_per_kind']:,} apply_async per kind "
        f"({result['rounds']} rounds × {result['calls']}):",
        "",
        "| publish | per s | µs per call | vs plain | vs plain, median of rounds "
        "| PostgreSQL flights |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        row = result[kind]
        lines.append(
            f"| {kind} | {row['per_s']:,} | {row['us']} | {row['ratio']} | "
            f"{row['ratio_median_of_rounds']} | {row['postgres_flights_per_publish']:g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.publish_pg", description=__doc__)
    parser.add_argument("--postgres-url", default=os.environ.get("POSTGRES_URL"))
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print the JSON result too")
    args = parser.parse_args(argv)
    if not args.postgres_url:
        parser.error("--postgres-url (or POSTGRES_URL) is needed")
    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if not url:
            from celery_idempotent.servers.redis_server import start_private_redis

            url = stack.enter_context(start_private_redis()).url()
        result = run(url, args.postgres_url, rounds=args.rounds, calls=args.calls)
    print(render(result))
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
