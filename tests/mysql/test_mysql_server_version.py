"""The MySQL backend's server floor: MySQL 8.0.1+ or MariaDB 10.6+ (``SKIP LOCKED``).

An older server is refused at the backend's first use with an error that names the floor and
the server's version, instead of a syntax error in the first claim's ``SKIP LOCKED`` read.
Against the suite's server (``MYSQL_URL``) the test takes the branch that server's version
calls for; ``CIDEM_EXPECT_REFUSED=1`` (the container matrix's MariaDB 10.5 cell) insists on the
refusal, so that cell cannot pass by running a new server instead.
"""

from __future__ import annotations

import os

import pytest
from mysql_support import query

from celery_idempotent import DistributedIdempotencyGuard, IdempotencyConnectionError, MySQLBackend
from celery_idempotent.backends.mysql.sql import check_server, server_version


@pytest.mark.parametrize(
    ("info", "parsed", "refused"),
    [
        ("10.5.23-MariaDB-0+deb11u1", ("mariadb", (10, 5, 23)), True),
        ("5.5.5-10.5.8-MariaDB", ("mariadb", (10, 5, 8)), True),
        ("10.6.0-MariaDB", ("mariadb", (10, 6, 0)), False),
        ("5.5.5-10.11.6-MariaDB-0+deb12u1", ("mariadb", (10, 11, 6)), False),
        ("11.8.3-MariaDB-deb13", ("mariadb", (11, 8, 3)), False),
        ("5.7.44-log", ("mysql", (5, 7, 44)), True),
        ("8.0.0-dmr", ("mysql", (8, 0, 0)), True),
        ("8.0.36", ("mysql", (8, 0, 36)), False),
        ("8.4.3", ("mysql", (8, 4, 3)), False),
    ],
)
def test_the_floor_is_mysql_8_0_1_and_mariadb_10_6(
    info: str, parsed: tuple[str, tuple[int, int, int]], refused: bool
) -> None:
    assert server_version(info) == parsed
    reason = check_server(info)
    if refused:
        assert reason is not None
        assert "SKIP LOCKED" in reason
        assert info in reason
    else:
        assert reason is None


def test_an_unreadable_version_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot read a MySQL / MariaDB server version from 'x'"):
        server_version("x")


def test_the_server_is_refused_at_first_use_only_below_the_floor(
    mysql_url: str, my_table: str
) -> None:
    info = str(query(mysql_url, "SELECT VERSION()")[0][0])
    expect_refused = os.environ.get("CIDEM_EXPECT_REFUSED") == "1"
    reason = check_server(info)
    assert (reason is not None) == expect_refused, (
        f"server {info}: refused={reason is not None}, the run expects refused={expect_refused}"
    )
    backend = MySQLBackend(mysql_url, table=my_table, lock_timeout=0)
    guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend)
    ran: list[int] = []
    try:
        if reason is None:
            assert guard.execute("k", lambda: ran.append(1) or "done") == "done"
            assert ran == [1]
            return
        with pytest.raises(IdempotencyConnectionError) as caught:
            guard.execute("k", lambda: ran.append(1))
        message = str(caught.value)
        assert "MariaDB 10.6+" in message
        assert info in message
        assert ran == []
        # Refused before any DDL: the backend created nothing on the old server.
        tables = query(mysql_url, "SHOW TABLES LIKE %s", my_table)
        assert tables == []
    finally:
        backend.close()
