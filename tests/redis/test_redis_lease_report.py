"""The lease-lost warning says only what happened (issue 30, item 5).

The false alarm of the 15-minute soaks, reproduced on a real Redis: a renewal was under way
when the body ended; the commit released the lock before that renewal reached Redis, which then
answered "not held". The keeper logged ``lost ... deleted or taken over ... its result will not
be committed`` although the commit had stored the result with that very fencing token. Here the
renewal is held (in the keeper thread, before it is sent) until the commit is done, so the
order is the soak's every time.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_idempotent import (
    DistributedIdempotencyGuard,
    LockLostError,
    RedisIdempotencyStore,
    RedisLockProvider,
    current_lease,
)
from celery_idempotent.core.outcome import GuardEvent
from celery_idempotent.core.protocols import Lease


class HeldRenewals(RedisLockProvider):
    """A lock provider whose renewals, once started, wait for ``go`` before they are sent."""

    def __init__(self, client: Any, **options: Any) -> None:
        super().__init__(client, **options)
        self.entered = threading.Event()
        self.go = threading.Event()
        self.answers: list[bool] = []

    def renewer(self) -> Callable[[Lease, float, float], bool] | None:
        real = super().renewer()
        assert real is not None

        def renew(lease: Lease, ttl: float, timeout: float) -> bool:
            self.entered.set()
            assert self.go.wait(10)
            ours = real(lease, ttl, 5.0)
            self.answers.append(ours)
            return ours

        return renew


def lost_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " lost" in r.getMessage()]


def test_a_renewal_answered_after_the_commit_is_not_reported_as_a_loss(
    redis_client: redis.Redis, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_idempotent")
    locks = HeldRenewals(redis_client, key_prefix=key_prefix)
    store = RedisIdempotencyStore(redis_client)
    events: list[str] = []

    def on_event(event: GuardEvent) -> None:
        events.append(event.kind)
        if event.kind == "committed":
            locks.go.set()  # now let the renewal reach Redis: the lock is gone

    guard = DistributedIdempotencyGuard(
        store=store,
        lock_provider=locks,
        key_prefix=key_prefix,
        lock_ttl=1.0,
        renew_interval=0.05,
        on_event=on_event,
    )
    tokens: list[int] = []

    def body() -> str:
        tokens.append(current_lease().fencing_token)  # type: ignore[union-attr]
        assert locks.entered.wait(5), "a renewal started while the body ran"
        return "paid"

    assert guard.execute("k", body) == "paid"
    deadline = threading.Event()
    for _ in range(200):
        if locks.answers:
            break
        deadline.wait(0.01)
    assert locks.answers == [False], "the renewal reached Redis after the commit"
    record = store.get(guard.record_key("k"))
    assert record is not None
    assert record.fencing_token == tokens[0]
    assert events == ["committed"]
    assert lost_lines(caplog) == []


def test_a_lease_lost_while_the_body_ran_is_still_reported_once(
    redis_client: redis.Redis, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The other side: the lock really is taken while the body runs; the renewal's answer
    comes once the body has ended (it ended first). The commit is refused, and one line says
    the result is not committed."""
    caplog.set_level(logging.WARNING, logger="celery_idempotent")
    locks = HeldRenewals(redis_client, key_prefix=key_prefix)
    store = RedisIdempotencyStore(redis_client)
    guard = DistributedIdempotencyGuard(
        store=store, lock_provider=locks, key_prefix=key_prefix, lock_ttl=1.0, renew_interval=0.05
    )

    def body() -> str:
        assert locks.entered.wait(5)
        redis_client.delete(guard.lock_resource("k"))  # taken away (a forced release)
        return "paid"

    released = threading.Timer(0.05, locks.go.set)
    released.start()
    with pytest.raises(LockLostError):
        guard.execute("k", body)
    released.join()
    assert store.get(guard.record_key("k")) is None
    lines = lost_lines(caplog)
    assert len(lines) == 1, lines
    # Whichever saw the loss first says it: the guard ("... not committed") or, when the
    # renewal's refusal arrived while the body still ran, the keeper ("... will not be
    # committed"). Either way, one line, and it says the result is not committed.
    assert re.search(r"not (be )?committed", lines[0]), lines[0]
