"""Run by ``test_green_renewal.py`` in a subprocess: guarded bodies in a process patched by
gevent or eventlet, with the lease keeper's renewals going (or not) through the event loop.

``python green_body.py <gevent|eventlet> <patch-first|import-first> <redis url> <prefix>``
prints one JSON line: each body's outcome and what was logged.

- ``patch-first``: the library is imported after the patch, as under ``celery worker -P``;
- ``import-first``: it is imported (and a guard made) before the patch, as when an app module
  imports ``celery_idempotent`` before it calls ``monkey_patch()`` itself.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from typing import Any

LIB, ORDER, URL, PREFIX = sys.argv[1:5]


def patch() -> None:
    if LIB == "gevent":
        from gevent import monkey

        monkey.patch_all()
    else:
        warnings.simplefilter("ignore")  # eventlet's deprecation notice
        import eventlet

        eventlet.monkey_patch()


if ORDER == "import-first":
    import celery_idempotent  # noqa: F401
    from celery_idempotent.core import renewal  # noqa: F401

    patch()
else:
    patch()

import threading  # noqa: E402 - patched (or not) above

import redis  # noqa: E402

from celery_idempotent import (  # noqa: E402
    DistributedIdempotencyGuard,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from celery_idempotent.core.green import runtime  # noqa: E402


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


handler = Lines()
logging.getLogger("celery_idempotent").addHandler(handler)
logging.getLogger("celery_idempotent").setLevel(logging.INFO)

client = redis.Redis.from_url(URL)
provider = RedisLockProvider(client)
store = RedisIdempotencyStore(client)


def guard(lock_ttl: float) -> DistributedIdempotencyGuard:
    return DistributedIdempotencyGuard(
        store=store, lock_provider=provider, lock_ttl=lock_ttl, key_prefix=PREFIX
    )


outcome: dict[str, Any] = {"runtime": runtime()}


def run(name: str, lock_ttl: float, fn: Any) -> None:
    try:
        outcome[name] = ["ok", guard(lock_ttl).execute(name, fn)]
    except Exception as exc:
        outcome[name] = [type(exc).__name__, str(exc)]


def cooperative() -> str:
    time.sleep(3.0)  # yields to the event loop
    return "coop"


def cpu_loop() -> int:
    end, loops = time.monotonic() + 3.0, 0
    while time.monotonic() < end:  # never yields
        loops += 1
    return loops


# A 1 s lease; both bodies run 3 s in one process (one event loop), the CPU loop starting
# while the cooperative body waits.
threads = [
    threading.Thread(target=run, args=("coop", 1.0, cooperative)),
    threading.Thread(target=run, args=("cpu", 1.0, cpu_loop)),
]
for thread in threads:
    thread.start()
    time.sleep(0.2)
for thread in threads:
    thread.join()


def c_call() -> float:
    started = time.monotonic()
    sum(range(100_000_000))  # one C call that keeps the GIL for about a second
    return time.monotonic() - started


# What cannot be covered: a 0.5 s lease and a C call holding the GIL for about twice that.
run("gil", 0.5, c_call)
time.sleep(1.0)  # a late line of the keeper thread is written by the next flush
from celery_idempotent.core.renewal import flush_log  # noqa: E402

flush_log()
outcome["log"] = handler.lines
print(json.dumps(outcome))
