"""The publish-side check on MySQL / MariaDB: the tests shared with PostgreSQL
(``tests/support/sql_publish_side.py``), in one flight (one multi-statement query), and what is
MySQL's own: a body that fails leaves the marker until the worker drops it.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.sql_publish_side import (  # noqa: F401 - collected here against MySQL
    LOCK,
    REC,
    SqlPublish,
    check,
    test_a_lost_message_blocks_the_key_for_publish_ttl_only,
    test_a_running_body_published_unchecked_is_left_to_the_guard,
    test_decisions_through_a_keys_life,
    test_status_and_forget_see_the_marker,
    test_the_backend_has_the_capability,
    test_the_check_is_one_flight,
    test_threads_publishing_one_key_at_once_make_one_publish,
)


@pytest.fixture
def sqlpub(my_backend: Any) -> SqlPublish:
    # One multi-statement query of 11 (the transaction's own too); no wait for the running
    # body's row lock (the backend's lock_timeout is 0 here: a 1 s bound).
    return SqlPublish(my_backend, quick=1.0, flight=11, claims_marker=False)


def test_a_failed_body_leaves_the_marker_until_the_worker_drops_it(my_backend: Any) -> None:
    assert check(my_backend, "t-1").action == "publish"
    claim = my_backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    my_backend.release(claim.lease)  # the body raised: rolled back, the marker is back
    assert check(my_backend, "t-2").action == "queued"
    assert my_backend.drop_queued(REC, "t-other") is False  # only its own marker
    assert my_backend.drop_queued(REC, "t-1") is True
    assert check(my_backend, "t-2").action == "publish"  # free at once
