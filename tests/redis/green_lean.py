"""Run by ``test_redis_lean.py`` in a subprocess: the lean path under gevent or eventlet.

``python green_lean.py <gevent|eventlet> <redis url> <prefix> [double-lend]`` prints one JSON
line. The
process is patched first (as ``celery worker -P gevent|eventlet`` patches it), then 40
greenlets run 15 guarded calls each at once, every one a first execution and then a
duplicate, on one store: greenlets switch in the middle of every round trip, so a connection
lent to two of them at once would hand one the other's reply.

Switches only in the middle of a round trip would hide such a lend: a greenlet woken by its
reply gives its connection back and takes the top of the stack, the one it just gave back,
so a stack that kept lent connections on it (or held one twice) would still hand each
greenlet its own. As in a worker, where each task starts in a new greenlet and bodies do
I/O, greenlets here also start their calls after a timer (a seeded random sleep) and sleep
in their bodies: a greenlet then takes a connection while others are in flight. And a
connection lent twice is caught whatever the timing: every use of a connection (readiness
check, send, read, connect, disconnect) by a greenlet other than the one whose request is
in flight on it is noted, not only a second send (the second borrower's readiness check
would see the first one's reply pending and reconnect, hiding the send).

``double-lend`` runs a mutant of the lean path (as the simulation's mutants do: the source
edited as it is loaded, never the file): a connection lent stays on the stack, so it can be
lent again while in use. The test runs it to show that this script catches it.
"""

from __future__ import annotations

import json
import random
import sys
import time
import warnings

from greenlet import getcurrent

LIB, URL, PREFIX = sys.argv[1:4]
MUTANT = sys.argv[4] if len(sys.argv) > 4 else ""

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

if MUTANT:
    import inspect
    import textwrap

    from celery_idempotent.backends.redis import lean as lean_module

    if MUTANT != "double-lend":
        raise SystemExit(f"unknown mutant {MUTANT!r}")
    source = textwrap.dedent(inspect.getsource(lean_module.LeanScripts.__call__))
    edited = source.replace("conn = free.pop()", "conn = free[-1]")
    if edited == source:
        raise SystemExit("mutant double-lend: LeanScripts.__call__ has no 'free.pop()' now")
    namespace: dict = {}  # type: ignore[type-arg]
    exec(compile(edited, lean_module.__file__, "exec"), vars(lean_module), namespace)  # noqa: S102
    lean_module.LeanScripts.__call__ = namespace["__call__"]  # type: ignore[method-assign]

client = redis.Redis.from_url(URL)
shared: list[str] = []  # a send on a connection whose previous reply was not read yet


class Exclusive(client.connection_pool.connection_class):  # type: ignore[misc, name-defined]
    """Notes any use of this connection by a greenlet other than the one whose request is in
    flight on it (sent, its reply not read yet)."""

    owner = None  # the greenlet whose reply is owed on this connection

    def _check(self, what: str) -> None:
        if self.owner is not None and self.owner is not getcurrent():
            shared.append(f"{what} by another greenlet while a reply is owed")

    def can_read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._check("can_read")
        return super().can_read(*args, **kwargs)

    def connect(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._check("connect")
        return super().connect(*args, **kwargs)

    def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
        if check_health:
            self._check(f"send {repr(command)[:40]}")
            self.owner = getcurrent()
        return super().send_packed_command(command, check_health)

    def read_response(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._check("read_response")
        try:
            return super().read_response(*args, **kwargs)
        finally:
            self.owner = None

    def disconnect(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._check("disconnect")
        self.owner = None
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
errors: list[str] = []


def body(value: list[int]) -> list[int]:
    time.sleep(0)  # a body's I/O: other greenlets run while this one holds its lease
    return value


def work(g: int) -> None:
    rng = random.Random(g)  # seeded: the same interleavings from run to run, as near as can be
    for i in range(15):
        key = f"g{g}-{i}"
        time.sleep(rng.random() * 0.002)  # the next task starts on a timer, not on a reply
        try:
            if guard.run(key, lambda g=g, i=i: body([g, i])).value != [g, i]:
                wrong.append(key)
            if guard.run(key, lambda: "again").value != [g, i]:
                wrong.append(key)
        except Exception as exc:  # a reply read by the wrong caller, a socket read twice ...
            errors.append(f"{key}: {exc!r}"[:200])


spawn_all([lambda g=g: work(g) for g in range(40)])
lean = store._lean
print(
    json.dumps(
        {
            "lean": lean is not None,
            "wrong": wrong,
            "errors": errors,
            "shared": shared,
            "held": None if lean is None else lean._held,
        }
    )
)
