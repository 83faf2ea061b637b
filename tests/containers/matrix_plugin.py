"""Loaded (``-p``) in the matrix's test containers only: keep the run on the cell's server.

Tests that start servers of their own (private ``redis-server`` processes, a Sentinel group, a
Cluster, a TCP proxy in front of a private server) would run the test image's ``redis-server``,
not the server the cell is about, so they are deselected, and reported as such.
"""

from __future__ import annotations

import pytest

OWN_SERVERS = {"redis_server_factory", "redis_sentinel", "redis_cluster", "tcp_proxy"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        (drop if names & OWN_SERVERS else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
