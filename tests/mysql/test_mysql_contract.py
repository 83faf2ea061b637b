"""The backend contract (``tests/redis/test_redis_contract.py``) run against MySQL / MariaDB.

The same tests as ``tests/postgres/test_postgres_contract.py`` imports, for the same reasons
(a lease here is a transaction too: the two tests that time a lease running out by itself do
not apply, nor does the one whose next holder writes with ``store.set`` from inside the first
holder's body). Where the Redis suite makes a lease run out early (``expire_lease``), the
server ends the holder's session (``KILL``), which rolls its transaction back.
"""

from __future__ import annotations

from typing import Any

import pytest
from mysql_support import kill_holder
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

from celery_idempotent import MySQLBackend


@pytest.fixture
def backend(mysql_url: str, my_backend: MySQLBackend) -> Backend:
    my_backend.lock_timeout = 0  # a failed attempt fails at once (MariaDB), as on Redis

    def expire_lease(resource: str) -> None:
        kill_holder(mysql_url, my_backend, resource)

    return Backend(
        name="mysql",
        provider=my_backend,
        store=my_backend,
        prefix="test:my:",
        atomic=True,
        expire_lease=expire_lease,
    )


def _unused(*_: Any) -> None:  # pragma: no cover - keeps the imports above referenced
    pass
