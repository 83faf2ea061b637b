"""``idempotency_publish_until="started"`` on MySQL / MariaDB with a real worker
(``tests/support/sql_started_workers.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.sql_started_workers import (  # noqa: F401 - collected here against MySQL / MariaDB
    st,
    st_env,
    test_a_window_keys_the_mode_by_slot,
    test_one_running_one_queued_a_third_refused,
    test_publish_ttl_and_forget_free_a_queued_key,
    test_status_names_the_running_call_and_the_queued_one,
    test_with_a_ttl_the_queued_call_replays_the_first,
    worker,
)

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def started_url(mysql_url: str) -> Iterator[str]:
    table = f"st_{uuid.uuid4().hex[:8]}"
    yield f"{mysql_url}{'&' if '?' in mysql_url else '?'}table={table}"
    from tests.mysql.conftest import drop_table

    drop_table(mysql_url, table)
