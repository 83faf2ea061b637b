"""Run by ``test_redis_lean.py`` in a subprocess: the lean path under gevent or eventlet.

``python green_lean.py <gevent|eventlet> <redis url> <prefix>`` prints one JSON line. The
process is patched first (as ``celery worker -P gevent|eventlet`` patches it), then 40
greenlets run 15 guarded calls each at once, every one a first execution and then a
duplicate, on one store: greenlets switch in the middle of every round trip, so a connection
lent to two of them at once would hand one the other's reply.
"""

from __future__ import annotations

import json
import sys
import warnings

LIB, URL, PREFIX = sys.argv[1:4]

if LIB == "gevent":
    from gevent import monkey

    monkey.patch_all()
    import gevent

    def spawn_all(fns: list) -> None:  # type: ignore[type-arg]
        gevent.joinall([gevent.spawn(fn) for fn in fns], raise_error=True)

else:
    warnings.simplefilter("ignore")
    import eventlet

    eventlet.monkey_patch()

    def spawn_all(fns: list) -> None:  # type: ignore[type-arg]
        pool = eventlet.GreenPool(len(fns))
        threads = [pool.spawn(fn) for fn in fns]
        for thread in threads:
            thread.wait()


import redis  # noqa: E402 - after the patch, as in a worker

from celery_idempotent import DistributedIdempotencyGuard  # noqa: E402
from celery_idempotent.backends.redis.locks import RedisLockProvider  # noqa: E402
from celery_idempotent.backends.redis.store import RedisIdempotencyStore  # noqa: E402

client = redis.Redis.from_url(URL)
shared: list[str] = []  # a send on a connection whose previous reply was not read yet


class Exclusive(client.connection_pool.connection_class):  # type: ignore[misc, name-defined]
    """Notes a send made while another caller's reply is still owed on this connection."""

    inflight = False

    def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
        if check_health:
            if self.inflight:
                shared.append(repr(command)[:40])
            self.inflight = True
        return super().send_packed_command(command, check_health)

    def read_response(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return super().read_response(*args, **kwargs)
        finally:
            self.inflight = False

    def disconnect(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.inflight = False
        return super().disconnect(*args, **kwargs)


client.connection_pool.connection_class = Exclusive
store = RedisIdempotencyStore(client)
guard = DistributedIdempotencyGuard(
    store=store,
    lock_provider=RedisLockProvider(client, key_prefix=PREFIX),
    key_prefix=PREFIX,
    retry_count=0,
)
wrong: list[str] = []


def work(g: int) -> None:
    for i in range(15):
        key = f"g{g}-{i}"
        if guard.run(key, lambda g=g, i=i: [g, i]).value != [g, i]:
            wrong.append(key)
        if guard.run(key, lambda: "again").value != [g, i]:
            wrong.append(key)


spawn_all([lambda g=g: work(g) for g in range(40)])
lean = store._lean
print(
    json.dumps(
        {
            "lean": lean is not None,
            "wrong": wrong,
            "shared": shared,
            "held": None if lean is None else lean._held,
        }
    )
)
