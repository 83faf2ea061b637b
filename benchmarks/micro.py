"""Per-call cost against one Redis: µs per call (p50, p99) and round trips per call.

Every case talks to the same server through the same counting client (one connection), and the
cases run interleaved, block by block (``rounds`` × each case ``calls`` calls, the order of the
cases rotated every round), so that whatever else the machine does hits all of them alike.
Each case is warmed up first: connections are open and Lua scripts loaded before anything is
timed or counted.
"""

from __future__ import annotations

import json
import math
import secrets
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from benchmarks._counting import Counter


def payload(i: int) -> dict[str, Any]:
    """What a Celery task typically gets: a few scalars."""
    return {"order_id": i, "amount": 1999, "currency": "EUR"}


RESULT = {"status": "ok"}


def body() -> dict[str, str]:
    return RESULT


@dataclass
class Case:
    name: str
    label: str
    call: Callable[[int], Any]
    # Filled in by the run.
    times_ns: list[int] = field(default_factory=list)
    sends: int = 0
    calls: int = 0
    cpu_ns: int = 0
    server_us: int = 0
    commands: list[str] = field(default_factory=list)


class _LambdaContext:
    """What Powertools reads from a Lambda context: the time left (here: a minute, always).

    ``IdempotencyConfig.register_lambda_context`` is how Powertools' docs have
    ``idempotent_function`` users outside a Lambda handler give it the in-progress expiry;
    without it every call warns and in-progress records never expire before the record TTL.
    """

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 60_000


def build_cases(client: redis.Redis, prefix: str) -> tuple[list[Case], dict[str, str]]:
    """The cases, each set up (duplicates have their record stored) and ready to call, and
    the competitors' cases left out because their package is not installed (name: reason)."""
    from celery_idempotent import DistributedIdempotencyGuard
    from celery_idempotent.backends.redis.locks import RedisLockProvider
    from celery_idempotent.backends.redis.store import RedisAtomicBackend, RedisIdempotencyStore

    cases: list[Case] = []

    # -- the floor -------------------------------------------------------------------------
    cases.append(Case("ping", "PING (one round trip, the floor)", lambda i: client.ping()))

    # A script round trip with the shape of our claim (3 keys, 3 args) that does nothing: what
    # redis-py and the server's EVALSHA cost before our Lua does any work.
    noop = client.register_script("return 0")
    cases.append(
        Case(
            "evalsha_floor",
            "EVALSHA of a no-op script, 3 keys 3 args",
            lambda i: noop(
                keys=[f"{prefix}f:{i}", f"{prefix}f:{i}:x", f"{prefix}g:{i}"],
                args=["t", 10_000, 604_800_000],
            ),
        )
    )

    # -- ours ------------------------------------------------------------------------------
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client),
        lock_provider=RedisLockProvider(client),
        key_prefix=f"{prefix}ci:",
    )
    paired = isinstance(guard.backend, RedisAtomicBackend)
    assert paired, "the store and lock provider should pair atomically"

    def guard_first(i: int) -> Any:
        return guard.execute(f"charge:{i}", body, input=payload(i))

    guard.execute("charge:dup", body, input=payload(-1))

    def guard_dup(i: int) -> Any:
        return guard.execute("charge:dup", body, input=payload(-1))

    cases.append(Case("guard_first", "celery-idempotent guard, first execution", guard_first))
    cases.append(Case("guard_duplicate", "celery-idempotent guard, duplicate", guard_dup))

    # Our two scripts alone, called with ready-made arguments: what the guard costs without
    # any of our Python (key names, tokens, fingerprint, encoding, decoding, renewal).
    from celery_idempotent.backends.redis import scripts as redis_scripts

    # Sent as the guard sends them (the store's transport: the lean path where the client takes
    # it), so that "guard minus scripts" is the guard's own Python.
    send = RedisIdempotencyStore(client).run_script
    claim_script = client.register_script(redis_scripts.CLAIM)
    commit_script = client.register_script(redis_scripts.COMMIT)

    def claim(keys: list[Any], args: list[Any]) -> Any:
        return send(claim_script, keys, args)

    def commit(keys: list[Any], args: list[Any]) -> Any:
        return send(commit_script, keys, args)

    ms = [10_000]

    def scripts_first(i: int) -> Any:
        lock, rec = f"{prefix}s:lock:{{{i}}}", f"{prefix}s:{{{i}}}"
        fence = f"{lock}:fence"
        token = claim(keys=[lock, rec, fence], args=["token", *ms])[1]
        value = b"2|" + token + b"|27||" + b"f" * 64 + b'||{"status": "ok"}'
        return commit(keys=[lock, rec, fence], args=[token + b"/token", 86_400_000, value, token])

    scripts_first(-1)
    dup_keys = [f"{prefix}s:lock:{{-1}}", f"{prefix}s:{{-1}}", f"{prefix}s:lock:{{-1}}:fence"]
    cases.append(Case("scripts_first", "  its CLAIM + COMMIT scripts alone, first", scripts_first))
    cases.append(
        Case(
            "scripts_duplicate",
            "  its CLAIM script alone, duplicate",
            lambda i: claim(keys=dup_keys, args=["other", *ms]),
        )
    )

    # The guard with both scripts answered in-process (no Redis, no redis-py): our own Python
    # per call (key names, fingerprint, token, encoding and decoding, lease keeper, outcome),
    # the part of "client time beyond the round trips" that is the library's.
    def offline_guard(claim_reply: list[Any], name: str) -> DistributedIdempotencyGuard:
        offline = DistributedIdempotencyGuard(
            store=RedisIdempotencyStore(client),
            lock_provider=RedisLockProvider(client),
            key_prefix=f"{prefix}{name}:",
        )
        atomic: Any = offline.backend
        atomic.store._lean = None  # the replies below are called as scripts, not sent
        atomic._claim = lambda keys, args: claim_reply
        atomic.store._commit = lambda keys, args: 1
        return offline

    from celery_idempotent import fingerprint_payload

    fp = fingerprint_payload(payload(-1)).encode()
    stored = [2, b"2|1796000000000000|27||" + fp + b'||{"status": "ok"}']
    py_first = offline_guard([1, b"1796000000000000"], "pf")
    py_dup = offline_guard(stored, "pd")
    cases.append(
        Case(
            "guard_python_first",
            "  its Python alone (scripts answered in-process), first",
            lambda i: py_first.execute(f"charge:{i}", body, input=payload(i)),
        )
    )
    cases.append(
        Case(
            "guard_python_duplicate",
            "  its Python alone (scripts answered in-process), duplicate",
            lambda i: py_dup.execute("charge:dup", body, input=payload(-1)),
        )
    )

    # -- naive: lock, GET, SET, unlock with plain redis-py -----------------------------------
    def naive(key: str) -> Any:
        lock = f"{prefix}naive:lock:{key}"
        record = f"{prefix}naive:{key}"
        token = secrets.token_hex(12)
        if not client.set(lock, token, nx=True, px=10_000):
            raise RuntimeError("naive: lock held")
        try:
            stored = client.get(record)
            if stored is not None:
                return json.loads(stored)
            value = body()
            client.set(record, json.dumps(value), ex=86_400)
            return value
        finally:
            client.delete(lock)

    naive("dup")
    cases.append(
        Case("naive_first", "naive SET NX / GET / SET / DEL, first", lambda i: naive(f"k{i}"))
    )
    cases.append(
        Case("naive_duplicate", "naive SET NX / GET / SET / DEL, duplicate", lambda i: naive("dup"))
    )

    missing: dict[str, str] = {}
    for names, make in (
        (("powertools_first", "powertools_duplicate"), _powertools_cases),
        (("celery_once",), _celery_once_cases),
    ):
        try:
            cases.extend(make(client, prefix))
        except ImportError as exc:  # the bench extra is not installed
            for name in names:
                missing[name] = f"not installed: {exc} (pip install -e '.[bench]')"

    # -- redis-py Lock ---------------------------------------------------------------------
    def lock_cycle(i: int) -> None:
        lock = client.lock(f"{prefix}rl:{i}", timeout=10)
        if not lock.acquire(blocking=False):
            raise RuntimeError("redis-py lock held")
        lock.release()

    cases.append(Case("redis_py_lock", "redis-py Lock acquire + release", lock_cycle))

    return cases, missing


def _powertools_cases(client: redis.Redis, prefix: str) -> list[Case]:
    """AWS Powertools idempotency with its Redis persistence layer, outside Lambda."""
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
        CachePersistenceLayer,
    )

    config = IdempotencyConfig(expires_after_seconds=86_400)
    config.register_lambda_context(_LambdaContext())
    with warnings.catch_warnings():
        # Powertools 3.x: the recommended name is an alias of a class marked deprecated.
        warnings.simplefilter("ignore", DeprecationWarning)
        layer = CachePersistenceLayer(client=client)

    @idempotent_function(
        data_keyword_argument="order",
        persistence_store=layer,
        config=config,
        key_prefix=f"{prefix}pt",
    )
    def charge(order: dict[str, Any]) -> dict[str, str]:
        return body()

    charge(order=payload(-1))
    return [
        Case(
            "powertools_first",
            "Powertools idempotency (Redis), first",
            lambda i: charge(order=payload(i)),
        ),
        Case(
            "powertools_duplicate",
            "Powertools idempotency (Redis), duplicate",
            lambda i: charge(order=payload(-1)),
        ),
    ]


def _celery_once_cases(client: redis.Redis, prefix: str) -> list[Case]:
    """celery-once: QueueOnce's key, then its Redis backend's lock and unlock."""
    from celery_once.backends.redis import Redis as OnceRedis
    from celery_once.helpers import queue_once_key

    once = OnceRedis.__new__(OnceRedis)  # its __init__ makes a global client from a URL
    once._redis = client
    once.blocking = False
    once.blocking_timeout = 1

    def once_cycle(i: int) -> None:
        key = queue_once_key(f"{prefix}once.charge", payload(i))
        once.raise_or_lock(key, timeout=3600)
        once.clear_lock(key)

    return [Case("celery_once", "celery-once raise_or_lock + clear_lock", once_cycle)]


def run(
    client: redis.Redis, prefix: str, *, rounds: int, calls: int, warmup: int = 50
) -> dict[str, dict[str, Any]]:
    """Run every case ``rounds`` × ``calls`` times, interleaved; a summary per case."""
    cases, missing = build_cases(client, prefix)
    results = _run(client, cases, rounds=rounds, calls=calls, warmup=warmup)
    for name, reason in missing.items():
        results[name] = {"skipped": reason}
    return results


def _server_usec(client: redis.Redis) -> dict[str, int]:
    """Microseconds the server spent per command name so far (INFO commandstats)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["usec"]) for name, v in stats.items()}


def _run(
    client: redis.Redis, cases: list[Case], *, rounds: int, calls: int, warmup: int
) -> dict[str, dict[str, Any]]:
    perf = time.perf_counter_ns
    cpu = time.thread_time_ns
    next_i = dict.fromkeys((c.name for c in cases), 1_000_000)  # warm-up keys: 1e6 and up
    for case in cases:
        for _ in range(warmup):
            case.call(next_i[case.name])
            next_i[case.name] += 1
        # One traced call: which commands a call sends (their server time is what we read).
        Counter.trace = []
        case.call(next_i[case.name])
        next_i[case.name] += 1
        case.commands = Counter.trace
        Counter.trace = None
    for case in cases:
        next_i[case.name] = 0
    for r in range(rounds):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]
        for case in order:
            call = case.call
            times = case.times_ns
            i = next_i[case.name]
            before = _server_usec(client)
            sends = Counter.sends
            cpu0 = cpu()
            for j in range(i, i + calls):
                t0 = perf()
                call(j)
                times.append(perf() - t0)
            case.cpu_ns += cpu() - cpu0
            case.sends += Counter.sends - sends
            after = _server_usec(client)
            # Commands run by a script count in their own stats too: only the names sent by
            # the client (EVALSHA for a script) are summed.
            for name in {c.lower() for c in case.commands}:
                case.server_us += after.get(name, 0) - before.get(name, 0)
            case.calls += calls
            next_i[case.name] = i + calls
    return {c.name: summarize(c) for c in cases}


def percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return float(sorted_values[k])


def summarize(case: Case) -> dict[str, Any]:
    values = sorted(case.times_ns)
    n = case.calls or 1
    return {
        "label": case.label,
        "calls": case.calls,
        "p50_us": round(percentile(values, 50) / 1000, 1),
        "p99_us": round(percentile(values, 99) / 1000, 1),
        "mean_us": round(sum(values) / n / 1000, 1),
        "round_trips": case.sends / n,
        "client_cpu_us": round(case.cpu_ns / n / 1000, 1),
        "server_us": round(case.server_us / n, 1),
        "commands": case.commands,
    }
