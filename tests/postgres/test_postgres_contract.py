"""The backend contract (``tests/redis/test_redis_contract.py``) run against PostgreSQL.

The tests are imported from the Redis suite and run here with this directory's ``backend``
fixture: one :class:`PostgresBackend` serving as lock provider and store (the atomic path).
A lease here is a transaction: it has no TTL, so the two tests that time a lease running out
by itself (``test_lease_expires_after_its_ttl``, ``test_extend_keeps_the_lease``) do not
apply and are not imported; nor is
``test_expired_holder_cannot_overwrite_the_next_holders_record``, whose next holder writes
its record with ``store.set`` from inside the first holder's body: here that write waits for
the row lock the next holder itself still holds (the guard never does this; its commit goes
through the lease's own transaction). Where the Redis suite makes a lease run out early
(``expire_lease``), this backend's analogue is used: the server terminates the holder's
session (``pg_terminate_backend``), which rolls its transaction back.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from redis_support import Backend
from test_redis_contract import (  # noqa: F401 - collected here against PostgreSQL
    test_abort_before_the_first_attempt_leaves_nothing,
    test_acquire_gives_a_lease_and_refuses_while_held,
    test_bad_lease_ttl_is_refused,
    test_clear_drops_every_lock,
    test_every_acquisition_has_its_own_token,
    test_exception_is_not_stored_and_propagates,
    test_falsy_results_are_replayed,
    test_fencing_tokens_increase_through_the_guard,
    test_fencing_tokens_strictly_increase_across_holders,
    test_held_key_gives_lock_acquisition_error,
    test_keys_do_not_share_results,
    test_lock_is_held_during_the_body_and_released_after,
    test_lock_released_when_the_body_raises,
    test_lost_lease_noticed_at_commit_commits_nothing,
    test_lost_lease_noticed_by_renewal_commits_nothing,
    test_mismatch_refuses_another_payload,
    test_one_lease_among_threads_racing,
    test_record_expires_after_ttl,
    test_record_stored_without_input_is_not_compared,
    test_release_only_by_the_holder,
    test_renewal_keeps_the_lease_of_a_long_body,
    test_replay_without_running_the_body_again,
    test_store_bad_ttl_is_refused,
    test_store_get_set_delete,
    test_store_records_expire,
)

from celery_idempotent import PostgresBackend


def terminate_holder(url: str, backend: PostgresBackend, resource: str) -> None:
    """End the session whose transaction holds ``resource`` (what a lease expiry is here)."""
    pids = [
        tx.pid for tx in list(backend._open.values()) if tx.lease and tx.lease.resource == resource
    ]
    assert pids, f"no open transaction holds {resource}"
    with psycopg.connect(url, autocommit=True) as conn:
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
        ).fetchone() != (0,):
            assert time.monotonic() < deadline, "terminated sessions did not end"
            time.sleep(0.01)


@pytest.fixture
def backend(postgres_url: str, pg_backend: PostgresBackend) -> Backend:
    # A failed attempt waits lock_timeout for the holder; the suite's rates of attempts
    # (renewal test: 20 refusals in 1.5 s) assume attempts that fail about as fast as Redis's.
    pg_backend.lock_timeout = 0.01

    def expire_lease(resource: str) -> None:
        terminate_holder(postgres_url, pg_backend, resource)

    return Backend(
        name="postgres",
        provider=pg_backend,
        store=pg_backend,
        prefix="test:pg:",
        atomic=True,
        expire_lease=expire_lease,
    )


def _unused(*_: Any) -> None:  # pragma: no cover - keeps the imports above referenced
    pass
