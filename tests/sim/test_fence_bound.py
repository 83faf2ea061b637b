"""The fencing bound of layout v2, on the simulated server whose clock a test can step.

The library's own scripts run on :class:`~.server.SimRedis`; each test ends a lease (release,
expiry, commit and record expiry), moves the server clock, and asks for the next token. What
``backends.redis.keyspace`` documents: the next token is above the last one unless the
server clock, after the last key carrying that token expired, steps back further than the
margin (a lock) or to before the token (a record, which lives its TTL past the commit). These
tests pin both sides of that bound, and the case the simulation found before the tombstones:
a step back right after a release.
"""

from __future__ import annotations

import pytest

from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis import scripts as redis_scripts

from .server import SimRedis

MARGIN_S = keyspace.FENCE_MARGIN_MS / 1000
LEASE_MS = 1_000
TTL_MS = 30_000


class Server:
    """A simulated Redis with a world clock the test moves, and one key's names."""

    def __init__(self) -> None:
        self.now = 0.0
        self.redis = SimRedis(lambda: self.now)
        self.lock, self.record = "p:lock:{k}", "p:{k}"
        self.fence = keyspace.fence_name(self.lock)

    def wait(self, seconds: float) -> None:
        self.now += seconds
        self.redis.active_expire()

    def step_clock(self, seconds: float) -> None:
        self.redis.clock_offset += seconds

    def claim(self, token: str) -> int:
        reply = self.redis.eval(
            redis_scripts.CLAIM, [self.lock, self.record, self.fence], [token, LEASE_MS]
        )
        assert reply[0] == 1, reply
        return int(reply[1])

    def commit(self, token: str, fence: int) -> None:
        lease = keyspace.lock_value(fence, token)
        record = keyspace.encode_record(
            name=self.record,
            fencing_token=fence,
            created_at=1.0,
            serializer="json",
            fingerprint=None,
            task_id=None,
            data=b'"v"',
        )
        args = [lease, TTL_MS, record, fence]
        assert (
            self.redis.eval(redis_scripts.COMMIT, [self.lock, self.record, self.fence], args) == 1
        )

    def release(self, token: str, fence: int) -> None:
        lease = keyspace.lock_value(fence, token)
        assert self.redis.eval(redis_scripts.RELEASE, [self.lock, self.fence], [lease, fence]) == 1

    def claim_when_free(self, token: str) -> int:
        """Claim, waiting out a lease that a step back of the clock brought back to life (a
        lease past its deadline that nobody took is valid again while the clock is before
        its deadline)."""
        for _ in range(1200):
            reply = self.redis.eval(
                redis_scripts.CLAIM, [self.lock, self.record, self.fence], [token, LEASE_MS]
            )
            if reply[0] == 1:
                return int(reply[1])
            self.wait(0.1)  # (a lease revived by a step back waits out its deadline)
        raise AssertionError("the lock stayed held")

    def keys(self) -> set[bytes]:
        return {k for k in self.redis.data if self.redis.lookup(k) is not None}


@pytest.fixture
def server() -> Server:
    return Server()


@pytest.mark.parametrize("back", [0.5, 5.0, MARGIN_S - 1])
def test_a_step_back_right_after_a_release_keeps_tokens_increasing(
    server: Server, back: float
) -> None:
    """The case the simulation found: the lock released without a commit, then the server
    clock steps back. Before issue 13's tombstones nothing was left to floor the next token."""
    first = server.claim("a@w")
    server.wait(0.2)
    server.release("a@w", first)
    server.step_clock(-back)
    assert server.claim("b@w") > first


@pytest.mark.parametrize("back", [0.5, 5.0, MARGIN_S - 1])
def test_a_step_back_after_the_lease_expired_keeps_tokens_increasing(
    server: Server, back: float
) -> None:
    first = server.claim("dead@w")  # its holder dies
    server.wait(LEASE_MS / 1000 + 0.5)  # the lease has expired; its lock is a tombstone
    server.step_clock(-back)
    assert server.claim_when_free("b@w") > first


def test_the_lock_lives_until_the_clock_passed_the_token_by_the_margin(server: Server) -> None:
    first = server.claim("dead@w")
    server.wait(LEASE_MS / 1000 + MARGIN_S - 0.01)
    assert server.keys() == {server.lock.encode()}
    server.wait(0.02)
    assert server.keys() == set()  # nothing left: the clock is past the token by the margin
    # A step back of less than the margin from here still leaves the clock past the token...
    server.step_clock(-(MARGIN_S - 0.5))
    assert server.claim("b@w") > first


def test_beyond_the_bound_the_next_token_is_lower(server: Server) -> None:
    """The documented limit, pinned: once the lock is gone, a step back further than the
    margin (and the lease) puts the clock before the token, and only the clock floors it."""
    first = server.claim("dead@w")
    server.wait(LEASE_MS / 1000 + MARGIN_S + 0.01)
    assert server.keys() == set()
    server.step_clock(-(LEASE_MS / 1000 + MARGIN_S + 1.0))
    assert server.claim("b@w") < first


def test_a_step_back_after_the_record_expired(server: Server) -> None:
    """A committed token is carried by the record, which lives its TTL past the commit: a
    step back of less than that after it expired keeps tokens increasing."""
    first = server.claim("a@w")
    server.wait(0.2)
    server.commit("a@w", first)
    assert server.keys() == {server.record.encode()}  # one key after a commit
    server.wait(TTL_MS / 1000 + 0.01)
    assert server.keys() == set()
    server.step_clock(-(TTL_MS / 1000 - 1))
    assert server.claim("b@w") > first


def test_a_step_back_during_the_lease_then_release(server: Server) -> None:
    """The clock steps back an hour while the lease is held: the tombstone keeps its token
    until the clock has passed it by the margin, however the lease then ends."""
    first = server.claim("a@w")
    server.step_clock(-3600)
    server.release("a@w", first)
    server.redis.data.pop(server.fence.encode(), None)  # the tombstone alone floors
    server.wait(1800)  # half an hour later the clock is still behind the token
    assert server.claim("b@w") > first


def test_a_step_back_during_the_lease_then_expiry(server: Server) -> None:
    first = server.claim("a@w")
    server.step_clock(-3600)
    server.redis.data.pop(server.fence.encode(), None)
    # The holder renews once (the renewal pushes the key's life past the token), then dies.
    lease = keyspace.lock_value(first, "a@w")
    assert server.redis.eval(
        redis_scripts.EXTEND, [server.lock, server.fence], [lease, LEASE_MS, first]
    )
    server.redis.data.pop(server.fence.encode(), None)
    server.wait(3600 + MARGIN_S - 5)  # the lease expired long ago; the clock just passed it
    assert server.keys() == {server.lock.encode()}
    server.step_clock(-(MARGIN_S - 10))
    assert server.claim_when_free("b@w") > first
