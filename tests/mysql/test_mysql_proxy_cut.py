"""The proxy cut mid-body (``tests/support/sql_proxy_cut.py``) on MySQL: the server rolls the
cut worker's transaction back, rows and claim together; the next holder runs once."""

from __future__ import annotations

import pytest

from tests.support.sql_proxy_cut import (  # noqa: F401 - collected here against MySQL
    test_cut_mid_body_rolls_back_and_the_next_holder_runs_once,
)

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def sql_table(my_table: str) -> str:
    return my_table
