"""The Redis backend behind Redis Sentinel, through a live failover.

Every test gets its own master, replica and Sentinel (the ``redis_sentinel`` fixture, a
``tests.support.sentinel.RedisSentinelGroup``). The library is given redis-py Sentinel clients,
``Sentinel(...).master_for(name)``, which ask the Sentinel where the master is each time they
open a connection. ``redis_sentinel.admin((host, port))`` talks to one server directly, to see
where a record or a lock really is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import pytest
import redis
from redis.sentinel import Sentinel, SentinelManagedConnection
from redis_support import recording

from celery_idempotent import (
    CommitUnknownError,
    DistributedIdempotencyGuard,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyMismatchError,
    LockAcquisitionError,
    LockLostError,
    Outcome,
    RedisIdempotencyStore,
    RedisLockProvider,
    current_lease,
)
from celery_idempotent.backends.redis.client import same_server
from celery_idempotent.backends.redis.store import RedisAtomicBackend
from celery_idempotent.core.two_step import TwoStepBackend
from tests.support.counting import RoundTrips, command_names
from tests.support.sentinel import RedisSentinelGroup

T = TypeVar("T")

PREFIX = "test:sentinel:"


def make_guard(
    store_client: redis.Redis, lock_client: redis.Redis | None = None, **options: Any
) -> DistributedIdempotencyGuard:
    """A guard over a store on ``store_client`` and locks on ``lock_client`` (default: same)."""
    options.setdefault("key_prefix", PREFIX)
    options.setdefault("retry_base_delay", 0.001)
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(store_client),
        lock_provider=RedisLockProvider(
            store_client if lock_client is None else lock_client, key_prefix=PREFIX
        ),
        **options,
    )


def through_failover(call: Callable[[], T], timeout: float = 20.0) -> T:
    """``call()``, repeated after an :class:`IdempotencyConnectionError` for up to ``timeout``
    seconds: a call in flight while the master changes may fail that way, and only that way."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except IdempotencyConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def counting_connection(trips: RoundTrips) -> type[SentinelManagedConnection]:
    """A Sentinel-managed connection class that reports every send to ``trips``."""

    class CountingSentinelConnection(SentinelManagedConnection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            trips.record(command_names(command))
            super().send_packed_command(command, check_health)

    return CountingSentinelConnection


def count_lookups(sentinel: Sentinel) -> list[str]:
    """The service names ``sentinel`` is asked to find a master for, from now on."""
    lookups: list[str] = []
    discover = sentinel.discover_master

    def counted(service_name: str) -> Any:
        lookups.append(service_name)
        return discover(service_name)

    sentinel.discover_master = counted  # type: ignore[method-assign]
    return lookups


def wait_until(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# =========================================================================== pairing, round trips


@pytest.mark.parametrize("clients", ["one client", "two clients of one Sentinel"])
def test_master_clients_pair_atomically_at_two_and_one_round_trips(
    redis_sentinel: RedisSentinelGroup, clients: str
) -> None:
    trips = RoundTrips()
    sentinel = redis_sentinel.sentinel()
    lookups = count_lookups(sentinel)
    options: dict[str, Any] = {
        "sentinel": sentinel,
        "connection_class": counting_connection(trips),
    }
    store_client = redis_sentinel.master_client(**options)
    lock_client = (
        store_client if clients == "one client" else redis_sentinel.master_client(**options)
    )
    assert (store_client is lock_client) is (clients == "one client")
    assert same_server(store_client, lock_client)
    guard = make_guard(store_client, lock_client, retry_count=0)
    assert isinstance(guard.backend, RedisAtomicBackend)  # one Lua script to claim, one to commit

    # Warm up: connect (the Sentinel names the master), load the two scripts once.
    guard.execute("warm-up", lambda: None)
    assert lookups, "the master was never looked up through the Sentinel"
    lookups.clear()

    calls: list[bool] = []
    first, first_sends = trips.measure(
        lambda: guard.execute("order", recording("v", calls), input=1)
    )
    duplicate, dup_sends = trips.measure(
        lambda: guard.execute("order", recording("x", calls), input=1)
    )
    assert first == 2, first_sends
    assert first_sends == [["EVALSHA"], ["EVALSHA"]]  # claim; commit + release
    assert duplicate == 1, dup_sends
    assert dup_sends == [["EVALSHA"]]
    assert calls == [True]
    assert lookups == []  # the Sentinel is asked per new connection, not per call

    # The record is on the server the Sentinel names as master (and nowhere else yet).
    record = guard.record_key("order")
    assert redis_sentinel.admin(redis_sentinel.master_address()).exists(record) == 1


# =========================================================================== once, replay, mismatch


def test_a_thread_race_runs_the_body_once_and_the_rest_replay(
    redis_sentinel: RedisSentinelGroup,
) -> None:
    sentinel = redis_sentinel.sentinel()
    guards = [
        make_guard(
            redis_sentinel.master_client(sentinel=sentinel),
            retry_count=200,
            retry_base_delay=0.01,
            retry_max_delay=0.05,
        )
        for _ in range(2)
    ]
    assert all(isinstance(guard.backend, RedisAtomicBackend) for guard in guards)
    threads_n = 8
    barrier = threading.Barrier(threads_n)
    calls: list[int] = []
    outcomes: list[Outcome[int]] = []
    failures: list[BaseException] = []

    def body() -> int:
        calls.append(1)
        lease = current_lease()
        assert lease is not None
        time.sleep(0.2)  # long enough for every rival to find the key held
        return lease.fencing_token

    def worker(index: int) -> None:
        guard = guards[index % 2]
        try:
            barrier.wait(10)
            outcomes.append(guard.run("race", body, input={"amount": 5}))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert len(calls) == 1
    assert len(outcomes) == threads_n
    ran = [outcome for outcome in outcomes if not outcome.replayed]
    assert len(ran) == 1
    assert {outcome.value for outcome in outcomes} == {ran[0].fencing_token}
    assert {outcome.fencing_token for outcome in outcomes} == {ran[0].fencing_token}

    # A later call with the same payload replays, another payload is refused; neither runs.
    for guard in guards:
        replay = guard.run("race", lambda: -1, input={"amount": 5})
        assert replay.replayed
        assert replay.value == ran[0].value
        with pytest.raises(IdempotencyMismatchError):
            guard.execute("race", lambda: -1, input={"amount": 6})
    assert len(calls) == 1


# =========================================================================== failover


def test_records_replay_and_new_keys_run_once_across_two_failovers(
    redis_sentinel: RedisSentinelGroup,
) -> None:
    client = redis_sentinel.master_client()
    guard = make_guard(client)
    calls: list[str] = []
    before = [f"before-{index}" for index in range(10)]
    for key in before:
        assert guard.execute(key, recording(key, calls, lambda: "ran"), input=key) == key
    first_master, replica = redis_sentinel.master_address(), redis_sentinel.replica_address()
    # Replicated before the switch: WAIT on the connection that wrote, and on the replica.
    assert client.execute_command("WAIT", 1, 5000) == 1
    assert all(redis_sentinel.admin(replica).exists(guard.record_key(key)) for key in before)

    assert redis_sentinel.failover() == replica
    for key in before:
        outcome = through_failover(partial(guard.run, key, lambda: "again", input=key))
        assert outcome.replayed
        assert outcome.value == key
    assert len(calls) == len(before)  # nothing ran twice

    after = [f"after-{index}" for index in range(5)]
    for key in after:
        outcome = through_failover(
            partial(guard.run, key, recording(key, calls, lambda: "ran"), input=key)
        )
        assert not outcome.replayed
        assert redis_sentinel.admin(replica).exists(guard.record_key(key)) == 1
    with pytest.raises(IdempotencyMismatchError):
        guard.execute(before[0], lambda: "x", input="another payload")
    assert len(calls) == len(before) + len(after)

    # And back: the first master, now a replica, has everything and takes over again.
    assert client.execute_command("WAIT", 1, 5000) == 1
    assert redis_sentinel.failover() == first_master
    for key in before + after:
        outcome = through_failover(partial(guard.run, key, lambda: "again", input=key))
        assert outcome.replayed
        assert outcome.value == key
    assert len(calls) == len(before) + len(after)


def test_a_lease_held_across_a_failover_is_renewed_on_the_new_master_and_commits_once(
    redis_sentinel: RedisSentinelGroup,
) -> None:
    sentinel = redis_sentinel.sentinel()
    guard = make_guard(redis_sentinel.master_client(sentinel=sentinel), lock_ttl=10)
    rival = make_guard(redis_sentinel.master_client(sentinel=sentinel), retry_count=0)
    provider = guard.lock_provider
    assert isinstance(provider, RedisLockProvider)
    lock = guard.lock_resource("held")
    started, proceed = threading.Event(), threading.Event()
    calls: list[int] = []
    result: list[Any] = []

    def body() -> str:
        lease = current_lease()
        assert lease is not None
        calls.append(lease.fencing_token)
        started.set()
        assert proceed.wait(60)
        return "done"

    def holder() -> None:
        try:
            result.append(guard.run("held", body))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert started.wait(10)
        old = redis_sentinel.master_address()
        token = redis_sentinel.admin(old).get(lock)
        assert token is not None

        new = redis_sentinel.failover()  # waits until the replica has the lock, then switches
        assert new != old
        assert redis_sentinel.admin(new).get(lock) == token  # the lease moved with the data

        # Still held on the new master: a rival is refused, it does not run.
        with pytest.raises(LockAcquisitionError):
            through_failover(lambda: rival.execute("held", lambda: "rival"))

        # Let a renewal (every lock_ttl / 3) land on the new master: its TTL goes back up.
        seen = redis_sentinel.admin(new).pttl(lock)
        assert seen > 0
        wait_until(
            "a renewal on the new master", lambda: redis_sentinel.admin(new).pttl(lock) > seen
        )
    finally:
        proceed.set()
        thread.join(60)
    assert not thread.is_alive()
    assert len(calls) == 1
    (outcome,) = result
    record = guard.record_key("held")
    if isinstance(outcome, BaseException):
        # Allowed, because loud: the caller is told that the result is (or may be) not stored.
        # A later call may then run the body again, but never silently.
        assert isinstance(outcome, (LockLostError, IdempotencyConnectionError)), outcome
        if type(outcome) is LockLostError:
            assert redis_sentinel.admin(new).exists(record) == 0
        return
    assert isinstance(outcome, Outcome)
    assert outcome.value == "done"
    assert not outcome.replayed
    assert outcome.fencing_token == calls[0]

    # Committed on the new master, released, and it replays; the body never ran twice.
    assert redis_sentinel.admin(new).exists(record) == 1
    assert redis_sentinel.admin(new).exists(lock) == 0
    replay = through_failover(lambda: rival.run("held", lambda: "rival"))
    assert replay.replayed
    assert replay.value == "done"
    assert len(calls) == 1
    # Fencing tokens keep increasing across the failover.
    later = provider.acquire(lock, 5)
    assert later is not None
    assert later.fencing_token > calls[0]
    assert provider.release(later)


def make_wait_guard(client: redis.Redis, **options: Any) -> DistributedIdempotencyGuard:
    """A guard whose store makes every claim and commit reach one replica (``WAIT 1``).

    ``wait_timeout`` is 1 s, not less: a replica in sync still needs a scheduling slice to
    answer ``REPLCONF GETACK``, and on a loaded two-core machine 0.2 s missed it once (the
    claim failed with "reached 0 of the 1 replica"). Where no replica can answer, the tests
    only wait longer. A wait as long as the lease also pins a fixed bug: the first commit of a
    store was sent as EVALSHA + WAIT, refused with NOSCRIPT, and its WAIT still blocked for the
    whole timeout before the resend, by then after the lease (LockLostError instead of the
    commit landing)."""
    options.setdefault("key_prefix", PREFIX)
    options.setdefault("retry_base_delay", 0.001)
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client, wait_replicas=1, wait_timeout=1.0),
        lock_provider=RedisLockProvider(client, key_prefix=PREFIX),
        **options,
    )


def test_the_window_before_the_old_master_is_demoted(redis_sentinel: RedisSentinelGroup) -> None:
    """After the Sentinel has switched to the new master, a client's idle pooled connection
    still leads to the old one (redis-py asks the Sentinel only when it opens a connection),
    and the old master takes writes until Sentinel demotes it (10-20 s later with Sentinel's
    timing). Without ``wait_replicas`` a key run in that window commits there and the
    demotion throws the record away: the key runs a second time (the README says so). With
    ``wait_replicas=1`` the claim on the old master reaches no replica (its replica is the new
    master), is given back, and fails with IdempotencyConnectionError before the body runs;
    after the demotion the key runs once, on the new master."""
    plain = make_guard(redis_sentinel.master_client())
    waiting = make_wait_guard(redis_sentinel.master_client())
    plain_calls: list[bool] = []
    waiting_calls: list[bool] = []
    plain.execute("warm-up", lambda: None)  # pooled connections to the first master
    waiting.execute("warm-up", lambda: None)
    old = redis_sentinel.master_address()
    new = redis_sentinel.failover(demote=False)

    # Without waiting: acknowledged by the old master only.
    assert plain.execute("plain", recording("v", plain_calls)) == "v"
    assert redis_sentinel.admin(old).exists(plain.record_key("plain")) == 1
    assert redis_sentinel.admin(new).exists(plain.record_key("plain")) == 0

    # With wait_replicas=1: refused before the body, nothing left held on the old master.
    for _ in range(2):
        with pytest.raises(IdempotencyConnectionError, match="reached 0 of the 1 replica"):
            waiting.execute("waiting", recording("w", waiting_calls))
    assert waiting_calls == []
    assert redis_sentinel.admin(old).exists(waiting.lock_resource("waiting")) == 0
    assert redis_sentinel.admin(old).exists(waiting.record_key("waiting")) == 0

    redis_sentinel.demote(old)  # what Sentinel does by itself, later
    assert redis_sentinel.admin(old).exists(plain.record_key("plain")) == 0  # thrown away

    # The plain guard runs its key a second time: the documented limit.
    through_failover(lambda: plain.execute("plain", recording("v", plain_calls)))
    assert plain_calls == [True, True]
    # The waiting guard runs its key once, on the new master, and replays it.
    assert (
        through_failover(lambda: waiting.execute("waiting", recording("w", waiting_calls))) == "w"
    )
    assert waiting.run("waiting", recording("again", waiting_calls)).replayed
    assert waiting_calls == [True]
    assert redis_sentinel.admin(new).exists(waiting.record_key("waiting")) == 1


def test_wait_replicas_keeps_two_and_one_round_trips(redis_sentinel: RedisSentinelGroup) -> None:
    """``WAIT`` is pipelined with the script: still one round trip per claim and per commit."""
    trips = RoundTrips()
    client = redis_sentinel.master_client(connection_class=counting_connection(trips))
    guard = make_wait_guard(client)
    guard.execute("warm-up", lambda: None)
    calls: list[bool] = []
    first, first_sends = trips.measure(lambda: guard.execute("o", recording("v", calls), input=1))
    dup, dup_sends = trips.measure(lambda: guard.execute("o", recording("x", calls), input=1))
    assert (first, dup) == (2, 1), (first_sends, dup_sends)
    assert first_sends == [["EVALSHA", "WAIT"], ["EVALSHA", "WAIT"]]
    assert dup_sends == [["EVALSHA", "WAIT"]]
    assert calls == [True]
    # the replica has the record as soon as the commit returned
    assert redis_sentinel.admin(redis_sentinel.replica_address()).exists(guard.record_key("o"))


def test_a_commit_no_replica_confirms_is_sent_again_then_reported_unknown(
    redis_sentinel: RedisSentinelGroup,
) -> None:
    """The replica goes away while the body runs: the commit lands on the master but WAIT
    says no replica has it. The guard sends it again (the script answers "stored") until
    ``lock_ttl`` has passed, then raises CommitUnknownError carrying the result."""
    guard = make_wait_guard(redis_sentinel.master_client(), lock_ttl=1.0)
    replica = redis_sentinel.admin(redis_sentinel.replica_address())

    def body() -> str:
        replica.execute_command("REPLICAOF", "NO", "ONE")  # detach: nothing is acked now
        return "charged"

    started = time.monotonic()
    with pytest.raises(CommitUnknownError, match="could not be confirmed") as caught:
        guard.execute("detached", body)
    assert caught.value.result == "charged"
    assert 1.0 <= time.monotonic() - started < 10
    master = redis_sentinel.admin(redis_sentinel.master_address())
    assert master.exists(guard.record_key("detached")) == 1  # on the master, unconfirmed
    assert replica.exists(guard.record_key("detached")) == 0


MIN_REPLICAS = {"extra_config": ["min-replicas-to-write 1", "min-replicas-max-lag 10"]}


@pytest.mark.parametrize("redis_sentinel", [MIN_REPLICAS], indirect=True, ids=["min-replicas"])
def test_min_replicas_to_write_refuses_the_window_instead_of_losing_commits(
    redis_sentinel: RedisSentinelGroup,
) -> None:
    """With ``min-replicas-to-write 1`` (the README's advice) a master without a replica
    refuses the scripts' writes: in the window of the previous test the old master (its
    replica was promoted) and the new one (no replica yet) both refuse, so nothing is
    acknowledged that the demotion could throw away. The price: no writes until the old master
    is a replica again."""
    client = redis_sentinel.master_client()
    guard = make_guard(client)
    calls: list[bool] = []
    guard.execute("warm-up", lambda: None)
    old = redis_sentinel.master_address()
    new = redis_sentinel.failover(demote=False)

    for _ in range(2):
        with pytest.raises(IdempotencyBackendError, match="NOREPLICAS"):
            guard.execute("window", recording("v", calls))
    assert calls == []  # refused at the claim: the body never ran
    record = guard.record_key("window")
    assert redis_sentinel.admin(old).exists(record) == 0
    assert redis_sentinel.admin(new).exists(record) == 0

    redis_sentinel.demote(old)
    assert through_failover(lambda: guard.execute("window", recording("v", calls))) == "v"
    assert guard.run("window", recording("x", calls)).replayed
    assert calls == [True]
    assert redis_sentinel.admin(new).exists(record) == 1


# =========================================================================== same_server


def test_same_server_tells_sentinel_services_apart(
    redis_sentinel: RedisSentinelGroup, caplog: pytest.LogCaptureFixture
) -> None:
    sentinel = redis_sentinel.sentinel()
    main = redis_sentinel.master_client(sentinel=sentinel)
    same = redis_sentinel.master_client(sentinel=sentinel)
    other_service = redis_sentinel.master_client(sentinel=sentinel, service_name="other-master")
    other_db = redis_sentinel.master_client(sentinel=sentinel, db=1)
    other_sentinel = redis_sentinel.master_client(sentinel=redis_sentinel.sentinel())
    host, port = redis_sentinel.master_address()
    direct = redis.Redis(host=host, port=port)
    try:
        assert same_server(main, same)
        # Another Sentinel object watching the same Sentinels, service and database: the same
        # deployment (issue 13), so the guard keeps its one-script path.
        assert same_server(main, other_sentinel)
        assert same_server(other_sentinel, main)
        assert isinstance(make_guard(main, other_sentinel).backend, RedisAtomicBackend)
        for other in (other_service, other_db, direct):
            assert not same_server(main, other)
            assert not same_server(other, main)
            assert RedisIdempotencyStore(main).atomic_with(RedisLockProvider(other)) is None
        assert isinstance(make_guard(main, other_service).backend, TwoStepBackend)
    finally:
        direct.close()

    # A Sentinel client and a direct client of today's master cannot be proven the same
    # deployment: the guard then calls the lock and the store one after the other (still
    # correct), and says so at construction.
    direct = redis.Redis(host=host, port=port)
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="celery_idempotent"):
            guard = make_guard(main, direct)
        assert isinstance(guard.backend, TwoStepBackend)
        assert "instead of one script" in caplog.text
        assert "Sentinel services differ" in caplog.text
        calls: list[bool] = []
        assert guard.execute("split", recording("v", calls), input=1) == "v"
        assert guard.run("split", recording("x", calls), input=1).replayed
        with pytest.raises(IdempotencyMismatchError):
            guard.execute("split", recording("x", calls), input=2)
        assert calls == [True]
    finally:
        direct.close()
