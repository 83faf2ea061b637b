"""Run by ``test_green_first_call.py`` in a subprocess: the first guarded call of a process
patched by gevent or eventlet, with a greenlet that blocks the event loop as soon as it can.

``python green_first_call.py <gevent|eventlet> <guard|probe> <redis url> <prefix>`` prints one
JSON line.

- ``guard`` (the library imported after the patch, as under ``celery worker -P``): a greenlet
  waits, yielding, until the first call's claim has returned, then computes without yielding
  for two leases. The call's body (0.3 s) must keep its lease and commit: nothing between the
  claim and the keeper's taking the lease may switch to the event loop.
- ``probe`` (the library imported before the patch): whether the process's first
  ``renewal.keep`` switches to another greenlet.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from typing import Any

LIB, MODE, URL, PREFIX = sys.argv[1:5]

if MODE == "probe":
    from celery_idempotent.core import renewal

if LIB == "gevent":
    from gevent import monkey

    monkey.patch_all()
    import gevent

    spawn, pause = gevent.spawn, gevent.sleep
else:
    warnings.simplefilter("ignore")  # eventlet's deprecation notice
    import eventlet

    eventlet.monkey_patch()
    spawn, pause = eventlet.spawn, eventlet.sleep

import redis  # noqa: E402

from celery_idempotent import (  # noqa: E402
    DistributedIdempotencyGuard,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from celery_idempotent.core import renewal  # noqa: E402
from celery_idempotent.core.green import runtime  # noqa: E402

LOCK_TTL = 1.0
client = redis.Redis.from_url(URL)
provider = RedisLockProvider(client)
outcome: dict[str, Any] = {"runtime": runtime()}

if MODE == "probe":
    lease = provider.acquire(f"{PREFIX}probe", LOCK_TTL)
    assert lease is not None
    ran: list[bool] = []
    spawn(ran.append, True)  # runs at the first switch to the event loop
    kept = renewal.keep(provider, lease, LOCK_TTL, LOCK_TTL / 3)
    outcome["switched"] = bool(ran)
    renewal.stop(kept)
    provider.release(lease)
    print(json.dumps(outcome))
    sys.exit(0)

guard = DistributedIdempotencyGuard(
    store=RedisIdempotencyStore(client),
    lock_provider=provider,
    lock_ttl=LOCK_TTL,
    key_prefix=PREFIX,
)
claimed: list[float] = []


class SeenClaims:
    """The guard's backend, noting when a claim has returned."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def claim(self, *args: Any) -> Any:
        found = self.backend.claim(*args)
        claimed.append(time.monotonic())
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


guard.backend = SeenClaims(guard.backend)


def blocker() -> float:
    while not claimed:
        pause(0)  # ready to run at every switch to the event loop
    started = time.monotonic()
    while time.monotonic() - started < 2 * LOCK_TTL:  # never yields
        pass
    return started - claimed[0]


def body() -> str:
    time.sleep(0.3)  # yields: the blocker takes the event loop for two leases
    return "done"


blocking = spawn(blocker)
try:
    outcome["call"] = ["ok", guard.execute("first", body)]
except Exception as exc:
    outcome["call"] = [type(exc).__name__, str(exc)]
blocked_after = blocking.wait() if LIB == "eventlet" else blocking.get()
outcome["blocked_after"] = blocked_after
print(json.dumps(outcome))
