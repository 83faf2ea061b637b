"""SIGKILL chaos on every pool but prefork (``test_fault_worker_kills.py`` covers prefork).

On threads, solo, gevent and eventlet a worker is one process: SIGKILLing it kills every body
in flight at once. The broker here is RabbitMQ, which puts the unacked messages of a dead
connection back at once (the Redis transport needs a visibility timeout for that, and loses a
message it had just handed to a consumer that dies: a broker property, not the guard's).
Each pool gets its own worker, queue and Redis (locks, records, results, marks); the four run
at the same time: ``KEYS`` keys × 2 messages, short bodies plus ``LONG`` bodies of three
leases (on gevent and eventlet one of them a CPU loop that blocks the event loop), while the
worker is SIGKILLed mid-body and started again. Per key, checked against Redis ``TIME``:

- no two executions overlap: a later run starts after an earlier one ended, or, if that one
  was killed, after both its first lease ran out and the kill;
- at most one commit; both messages return the committed run's result; every key completes;
- no lease lost by a living worker (the long bodies are renewed throughout).

``CELERY_IDEMPOTENT_POOL_CHAOS=<kills>`` runs a longer campaign (more keys, that many kills per
pool) for the README's figures; the default run does 1 kill per pool.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from celery_idempotent.backends.redis.keyspace import decode_record, record_name
from tests.faults.faultlib import (
    Run,
    commits_by_key,
    counter,
    fault_env,
    load_runs,
    lock_names,
    record_figures,
    wait_ready,
)
from tests.support.redis_server import RedisServer

LOCK_TTL = 1.0
CAMPAIGN = int(os.environ.get("CELERY_IDEMPOTENT_POOL_CHAOS") or 0)
KILLS = CAMPAIGN or 1
KEYS = 60 if CAMPAIGN else 16
#: solo runs one body at a time, so fewer keys keep its run as short as the others'
SOLO_KEYS = 30 if CAMPAIGN else 8
LONG = 3  # keys whose body lasts three leases
POOLS = {"threads": 4, "solo": 1, "gevent": 20, "eventlet": 20}
if os.environ.get("CELERY_IDEMPOTENT_CHAOS_POOLS"):  # e.g. "gevent,solo" to look at one
    POOLS = {p: POOLS[p] for p in os.environ["CELERY_IDEMPOTENT_CHAOS_POOLS"].split(",")}
TOLERANCE_US = 5_000


def must_start_after(run: Run, kill_times: list[int]) -> int:
    """When ``run`` stopped holding its key at the earliest (server µs): its end; if it was
    killed, its first lease's end and the first kill after its start, whichever is later."""
    if run.end_us is not None:
        return run.end_us
    first_lease = run.fence + round(LOCK_TTL * 1_000_000) - TOLERANCE_US
    killed_at = min((k for k in kill_times if k > run.start_us), default=first_lease)
    return max(first_lease, killed_at)


def chaos(pool: str, server: RedisServer, broker_url: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    keys = SOLO_KEYS if pool == "solo" else KEYS
    long = 1 if pool == "solo" else LONG  # solo runs them one after the other
    concurrency = POOLS[pool]
    started = time.monotonic()
    with fault_env(
        broker=server, idem_url=server.url_for(db=0), lock_ttl=LOCK_TTL, broker_url=broker_url
    ) as env:
        queue = f"pool-chaos-{pool}-{uuid.uuid4().hex[:8]}"
        worker = env.start_worker(concurrency=concurrency, queue=queue, pool=pool)
        try:
            work = env.app.tasks["faults.work"]
            green = pool in ("gevent", "eventlet")
            calls = {
                n: (3 * LOCK_TTL, green and n == 0) if n < long else (rng.uniform(0.1, 0.4), False)
                for n in range(keys)
            }
            order = list(range(keys)) + rng.sample(range(keys), keys)
            results = [(n, work.apply_async((n, *calls[n]), queue=queue)) for n in order]

            kill_times: list[int] = []
            kills_mid_body = 0
            logs: list[str] = []
            for _ in range(KILLS):
                time.sleep(rng.uniform(1.5, 3.0))
                if env.marks.hlen(f"{env.ns}running"):
                    kills_mid_body += 1
                sec, usec = env.marks.time()
                kill_times.append(sec * 1_000_000 + usec)
                worker.kill()
                logs.append(worker.log())
                worker = env.start_worker(concurrency=concurrency, queue=queue, pool=pool)
            pending = wait_ready([r for _, r in results], timeout=120)
            logs.append(worker.log())
            assert not pending, f"{pool}: {len(pending)} tasks never finished\n{env.logs()}"

            values: dict[int, set[tuple[str, int]]] = {}
            for n, result in results:
                value = result.get(timeout=5)
                values.setdefault(n, set()).add((value["exec"], value["fence"]))
            assert sorted(values) == list(range(keys))
            split = {n: v for n, v in values.items() if len(v) != 1}
            assert not split, f"{pool}: keys whose messages got different results: {split}"

            runs = load_runs(env.marks, env.ns)
            double = [
                (earlier, later)
                for each in runs.values()
                for i, later in enumerate(each)
                for earlier in each[:i]
                if later.start_us < must_start_after(earlier, kill_times)
                or later.fence <= earlier.fence
            ]
            assert not double, f"{pool}: {len(double)} overlapping executions: {double[:3]}"
            commits = commits_by_key(env.marks, env.ns)
            twice = {key: fences for key, fences in commits.items() if len(fences) > 1}
            assert not twice, f"{pool}: keys committed more than once: {twice}"
            for n, ((exec_id, fence),) in values.items():
                done = [r for r in runs[n] if r.exec_id == exec_id]
                assert done, f"{pool}: key {n}: the returned run has no start mark"
                assert done[0].end_us is not None, f"{pool}: key {n}: returned a killed run"
                name = record_name(env.prefix, f"faults.work:key:work:{n}")
                raw = env.idem.get(name)
                assert raw is not None, f"{pool}: key {n}: no committed record"
                assert decode_record(raw, name).fencing_token == fence
            lost = env.marks.llen(f"{env.ns}lease_lost")
            assert lost == 0, f"{pool}: {lost} lease(s) lost by a living worker"
            assert not any(" lost: " in text for text in logs), f"{pool}: a lost-lease line"
            long_done = [r for n in range(long) for r in runs[n] if r.end_us is not None]
            assert len(long_done) == long, f"{pool}: bodies of three leases that completed"
            assert all(r.end_us - r.start_us >= 3 * LOCK_TTL * 1e6 * 0.95 for r in long_done)

            time.sleep(LOCK_TTL + 0.2)
            assert lock_names(env.idem, env.prefix) == []
            executions = sum(len(each) for each in runs.values())
            return {
                "keys": keys,
                "messages": len(results),
                "deliveries": counter(env.marks, env.ns, "deliveries"),
                "kills": len(kill_times),
                "kills_mid_body": kills_mid_body,
                "executions": executions,
                "executions_per_key": round(executions / keys, 3),
                "max_executions_of_a_key": max(len(each) for each in runs.values()),
                "runs_killed_mid_body": sum(
                    1 for each in runs.values() for r in each if r.end_us is None
                ),
                "completed_runs_of_three_leases": len(long_done),
                "lost_leases": lost,
                "double_executions": len(double),
                "double_commits": len(twice),
                "seconds": round(time.monotonic() - started, 1),
            }
        finally:
            worker.stop()
            with env.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)


@pytest.mark.worker
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkilled_workers_of_every_pool_never_run_a_key_twice_at_once(
    redis_server_factory: Callable[..., RedisServer], rabbitmq_url: str
) -> None:
    servers = {pool: redis_server_factory() for pool in POOLS}
    with ThreadPoolExecutor(max_workers=len(POOLS)) as executor:
        futures = {
            pool: executor.submit(chaos, pool, servers[pool], rabbitmq_url, seed)
            for seed, pool in enumerate(POOLS)
        }
        figures = {pool: future.result() for pool, future in futures.items()}

    for pool, found in figures.items():
        assert found["kills"] == KILLS
        record_figures(
            f"worker kills ({pool}, whole worker SIGKILLed, RabbitMQ, lock_ttl {LOCK_TTL:g}s)",
            **found,
        )
    assert sum(f["kills_mid_body"] for f in figures.values()) >= len(POOLS) - 1
    assert sum(f["runs_killed_mid_body"] for f in figures.values()) >= len(POOLS) - 1
