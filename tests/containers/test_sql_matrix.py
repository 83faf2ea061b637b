"""The matrix's SQL cells (``matrix.run_sql_cell``), each a test: ``pytest -m sql_matrix``.

PostgreSQL 13 / 15 / 17 and MariaDB 10.5 / 10.11 / 11.8 from Debian's packages, each server in
a container of its own, the SQL subset run on the host against it. A marker of their own
(deselected by default, as ``matrix`` is): six cells take longer than the few minutes ``.ci/run``
gives the container matrix.
"""

from __future__ import annotations

import pytest

from tests.containers.conftest import docker_available
from tests.containers.matrix import REFUSED_SQL, SQL_SERVERS, run_sql_cell

pytestmark = [
    pytest.mark.docker,
    pytest.mark.sql_matrix,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


@pytest.mark.parametrize("server", list(SQL_SERVERS))
def test_the_sql_contract_passes(server: str) -> None:
    """The SQL subset (``matrix.SQL_SUBSET``) on the host against ``server`` in a container;
    MariaDB 10.5, below the floor, must be refused at first use (its cell's only test)."""
    reason = docker_available()
    if reason is not None:
        pytest.skip(reason)
    result = run_sql_cell(server)
    print(
        f"{server} ({result.server_version}): {result.passed} passed, {result.failed} failed, "
        f"{result.errors} errors, {result.skipped} skipped in {result.seconds} s"
    )
    assert result.ok, result.output_tail
    assert result.skipped == 0, result.output_tail
    assert result.xfailed == 0, result.output_tail
    if server in REFUSED_SQL:
        # the version test's refusal branch (CIDEM_EXPECT_REFUSED) and its parsing cases
        assert result.passed >= 10, result.output_tail
    else:
        # the shared SQL contract, the store contract and the backend's own tests
        assert result.passed >= 60, result.output_tail
