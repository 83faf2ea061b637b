"""Helpers of the MySQL suite (imported as ``mysql_support``: a name nothing else has)."""

from __future__ import annotations

from typing import Any


def connect(url: str) -> Any:
    """A plain PyMySQL connection (autocommit) to ``url``, for the tests' own reads."""
    import pymysql

    from celery_idempotent.backends.mysql.connections import connect_args

    return pymysql.connect(**connect_args(url.split("?", maxsplit=1)[0]), autocommit=True)


def query(url: str, sql: str, *params: Any) -> list[Any]:
    conn = connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params or None)
            return list(cur.fetchall()) if cur.description else []
    finally:
        conn.close()


def kill_holder(url: str, backend: Any, resource: str) -> None:
    """End the session whose transaction holds ``resource`` (what a lease expiry is here)."""
    import time

    ids = [
        tx.pid for tx in list(backend._open.values()) if tx.lease and tx.lease.resource == resource
    ]
    assert ids, f"no open transaction holds {resource}"
    import pymysql

    for ident in ids:
        try:
            query(url, f"KILL {int(ident)}")
        except pymysql.err.OperationalError as exc:
            if exc.args[0] != 1094:  # an earlier holder of this resource, killed already
                raise
    deadline = time.monotonic() + 10
    marks = ", ".join(["%s"] * len(ids))
    while query(
        url, f"SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID IN ({marks})", *ids
    ) != [(0,)]:
        assert time.monotonic() < deadline, "killed sessions did not end"
        time.sleep(0.01)
