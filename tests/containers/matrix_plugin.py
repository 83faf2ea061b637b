"""Loaded (``-p``) in the matrix's test containers only: keep the run on the cell's server.

Tests that start servers of their own (private ``redis-server`` processes, a Sentinel group, a
Cluster, a TCP proxy in front of a private server) would run the test image's ``redis-server``,
not the server the cell is about, so they are deselected, and reported as such.

On Redis 6.0 (``CIDEM_MATRIX_SERVER=redis-6.0``, below the documented floor of 6.2) with kombu
5.7 or later, the tests that start a ``celery worker`` are expected to fail, strictly: kombu's
Redis transport sends ``ZRANGE ... BYSCORE LIMIT`` (Redis 6.2+) and the worker does not start.
The library's own scripts pass there; the broker is what needs 6.2.
"""

from __future__ import annotations

import os

import pytest

from tests.support.workers import WorkerError


def _kombu_needs_redis_62() -> bool:
    import kombu

    major, minor = (int(part) for part in kombu.__version__.split(".")[:2])
    return (major, minor) >= (5, 7)


OWN_SERVERS = {"redis_server_factory", "redis_sentinel", "redis_cluster", "tcp_proxy"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        (drop if names & OWN_SERVERS else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if os.environ.get("CIDEM_MATRIX_SERVER") == "redis-6.0" and _kombu_needs_redis_62():
        reason = "kombu >= 5.7's Redis transport needs Redis 6.2+ (ZRANGE BYSCORE LIMIT)"
        for item in items:
            if item.nodeid.startswith("tests/celery/"):
                item.add_marker(pytest.mark.xfail(strict=True, raises=WorkerError, reason=reason))
