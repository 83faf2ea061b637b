"""A worker warns at start when the idempotency Redis may evict keys, and says so when it
cannot tell; ``celery idempotency stats`` shows the policy.

Every key the library writes has a TTL, so any ``maxmemory-policy`` but ``noeviction`` can
evict a lock or a record under memory pressure and let a key run twice.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from celery_idempotent.backends.redis.health import eviction_policy, eviction_warning
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup

EVICTION_LINE = "has maxmemory-policy allkeys-lru"


@pytest.mark.worker
@pytest.mark.redis
def test_a_worker_on_an_evicting_redis_warns_once_at_start(
    cidem: ModuleType,
    worker_factory: Callable[..., WorkerGroup],
    redis_server_factory: Callable[..., RedisServer],
    tag: str,
) -> None:
    lru = redis_server_factory(extra_config={"maxmemory-policy": "allkeys-lru"})
    group = worker_factory(
        1, pool="solo", queues=[f"evict-{tag}"], env={"CIDEM_IDEMPOTENCY_URL": lru.url}
    )
    try:
        wait_for(lambda: "idempotent task(s)" in group[0].log(), what="the start-up summary")
        wait_for(lambda: EVICTION_LINE in group[0].log(), timeout=5, what="the warning")
        lines = [ln for ln in group[0].log().splitlines() if "maxmemory-policy" in ln]
        assert len(lines) == 1, lines  # one Redis, one line, however many tasks use it
        assert "WARNING" in lines[0]
        assert "set maxmemory-policy noeviction" in lines[0].lower()
        assert lru.url.split("//")[1].split("/")[0] in lines[0]  # names the server
    finally:
        group.stop()


def test_the_policy_is_read_from_info_memory_and_only_noeviction_passes() -> None:
    class Client:
        def __init__(self, reply: Any) -> None:
            self.reply = reply

        def info(self, section: str) -> Any:
            assert section == "memory"
            if isinstance(self.reply, Exception):
                raise self.reply
            return self.reply

    assert eviction_policy(Client({"maxmemory_policy": "noeviction"})) == ("noeviction", None)
    for policy in ("allkeys-lru", "volatile-ttl", "volatile-lru", "allkeys-random"):
        found, error = eviction_policy(Client({"maxmemory_policy": policy}))
        assert (found, error) == (policy, None)
        warning = eviction_warning("redis://h:1/0", found, error)
        assert warning is not None
        assert f"redis://h:1/0 has maxmemory-policy {policy}" in warning
    # a Cluster client answers per node: one evicting primary is enough to warn
    cluster = Client(
        {"n1": {"maxmemory_policy": "noeviction"}, "n2": {"maxmemory_policy": "volatile-lru"}}
    )
    assert eviction_policy(cluster) == ("volatile-lru", None)
    assert eviction_warning("x", "noeviction", None) is None
    refused = eviction_policy(Client(PermissionError("NOPERM this user has no permissions")))
    assert refused[0] is None
    assert "NOPERM" in str(refused[1])
    text = eviction_warning("redis://h:1/0", *refused)
    assert text is not None
    assert text.startswith("could not check the maxmemory-policy of the idempotency Redis at")
    missing = eviction_policy(Client({"used_memory": 1}))
    assert missing[0] is None
    assert "maxmemory_policy" in str(missing[1])
