"""The simulated world: one true clock, an event heap, processes made of greenlets, a network.

Everything runs on one OS thread. Each simulated process (a worker incarnation, the admin)
runs the library's real code in greenlets; whenever that code talks to Redis, sleeps or
reads a clock, it reaches this module, which parks the greenlet and returns to the event
loop. The loop pops the next event (true time, then insertion order), so a run is a pure
function of its plan and seed: it replays exactly.

A process can be frozen (a stop-the-world pause: nothing of it runs, its timers fire late) or
killed (its greenlets get :class:`Killed`, which no ``except Exception`` catches, and no
request it sends afterwards reaches anything).
"""

from __future__ import annotations

import contextlib
import heapq
import random
from collections.abc import Callable
from typing import Any

import greenlet
import redis.exceptions

from .server import CommandError, SimRedis

__all__ = ["Killed", "Network", "Process", "SimClient", "World"]


class Killed(BaseException):
    """Thrown into the greenlets of a crashed process: unwinds them without any effect."""


class _Park:
    __slots__ = ("done", "g", "proc", "value")

    def __init__(self, proc: Process, g: greenlet.greenlet) -> None:
        self.proc = proc
        self.g = g
        self.done = False
        self.value: Any = None


class World:
    """The event loop and the true clock (seconds)."""

    def __init__(self, seed: int) -> None:
        self.now = 0.0
        self.seed = seed
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.hub = greenlet.getcurrent()
        self.steps = 0
        self.after_step: Callable[[], None] = lambda: None
        self.trace: list[tuple[float, str, str]] = []
        self.tracing = True

    def log(self, who: str, what: str) -> None:
        if self.tracing:
            self.trace.append((self.now, who, what))

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn))

    def run(self, until: float, stop: Callable[[], bool] = lambda: False) -> None:
        heap = self._heap
        while heap and not stop():
            t, _, fn = heapq.heappop(heap)
            if t > until:
                heapq.heappush(heap, (t, 0, fn))
                break
            self.now = t
            fn()
            self.steps += 1
            self.after_step()

    # -- parking greenlets ------------------------------------------------------------------

    def park(self, proc: Process, timeout: float | None = None, on_timeout: Any = None) -> Any:
        """Suspend the calling greenlet until :meth:`unpark` (or ``timeout`` true seconds,
        then the value is ``on_timeout``). A value that is an exception is raised."""
        g = greenlet.getcurrent()
        if proc.dead:
            raise Killed
        park = _Park(proc, g)
        if timeout is not None:
            self.at(self.now + timeout, lambda: self.unpark(park, on_timeout))
        value = self.hub.switch(park)
        if isinstance(value, BaseException):
            raise value
        return value

    def unpark(self, park: _Park, value: Any) -> None:
        if park.done:
            return
        park.done = True
        park.value = value
        if greenlet.getcurrent() is self.hub:
            self._resume(park)
        else:  # never switch between two simulated greenlets: only the hub resumes them
            self.at(self.now, lambda: self._resume(park))

    def _resume(self, park: _Park) -> None:
        proc = park.proc
        if proc.dead or park.g.dead:
            return
        if proc.frozen_until > self.now:
            self.at(proc.frozen_until, lambda: self._resume(park))
            return
        self._switch(park.g, park.value)

    def _switch(self, g: greenlet.greenlet, value: Any) -> None:
        g.switch(value)  # back in the hub when the greenlet parks again or finishes

    def spawn(self, proc: Process, fn: Callable[[], None], name: str) -> None:
        """Start ``fn`` in a new greenlet of ``proc`` at the current time."""

        def body(_: Any = None) -> None:
            with contextlib.suppress(Killed):
                fn()

        g = greenlet.greenlet(body, parent=self.hub)
        proc.greenlets.append(g)
        self.at(self.now, lambda: None if proc.dead else self._switch(g, None))


class Process:
    """A simulated OS process: its clocks, its greenlets, pause and death."""

    def __init__(self, world: World, name: str, rng: random.Random) -> None:
        self.world = world
        self.name = name
        self.node = name.split(".", 1)[0]
        self.rng = rng
        self.dead = False
        self.frozen_until = 0.0
        self.greenlets: list[greenlet.greenlet] = []
        # local clocks: wall = true * rate + offset; monotonic = true * rate + mono_base
        self.rate = 1.0
        self.offset = 1_700_000_000.0
        self.mono_base = 1000.0
        self.time = _TimeModule(self)

    def wall(self) -> float:
        return self.world.now * self.rate + self.offset

    def monotonic(self) -> float:
        return self.world.now * self.rate + self.mono_base

    def set_rate(self, rate: float) -> None:
        """Change the clock rate without a jump in the local clocks."""
        now = self.world.now
        self.offset += now * (self.rate - rate)
        self.mono_base += now * (self.rate - rate)
        self.rate = rate

    def sleep_local(self, seconds: float) -> None:
        if seconds > 0:
            self.world.park(self, seconds / self.rate)
        elif self.dead:
            raise Killed

    def guard_sleep(self, delay: float, abort: Any) -> bool:
        """The guard's ``sleep``: no abort event is used in the simulation."""
        self.sleep_local(delay)
        return False

    def kill(self) -> None:
        self.dead = True
        for g in self.greenlets:
            if not g.dead and g is not greenlet.getcurrent():
                # a greenlet that had not started yet passes it on to the hub
                with contextlib.suppress(Killed):
                    g.throw(Killed)


class _TimeModule:
    """What ``time`` is to library code run in a process: its local clocks."""

    def __init__(self, proc: Process) -> None:
        self.monotonic = proc.monotonic
        self.time = proc.wall


class Network:
    """Faults of the links between processes and the server."""

    def __init__(self, rng: random.Random, profile: dict[str, float]) -> None:
        self.rng = rng
        self.p_request_loss = profile.get("request_loss", 0.0)
        self.p_reply_loss = profile.get("reply_loss", 0.0)
        self.p_delay = profile.get("delay", 0.0)
        self.max_delay = profile.get("max_delay", 1.0)
        self.partitioned: dict[str, float] = {}  # process name -> cut until (true time)

    def latency(self) -> float:
        if self.p_delay and self.rng.random() < self.p_delay:
            return self.rng.uniform(0.05, self.max_delay)
        return self.rng.uniform(0.0001, 0.002)

    def cut(self, proc: Process, now: float) -> bool:
        return self.partitioned.get(proc.node, 0.0) > now


class SimClient:
    """The surface of a ``redis.Redis`` client that the library uses, over the simulation.

    Every command is one request: it may be lost on the way, be applied and lose its reply,
    be delayed, or find the server down; the caller then gets redis-py's ``TimeoutError`` or
    ``ConnectionError`` as a real client would. ``retries`` resends a command after such an
    error, as redis-py's ``Retry`` does (so a script can be applied twice).
    """

    def __init__(
        self,
        world: World,
        proc: Process,
        server: SimRedis,
        net: Network,
        *,
        socket_timeout: float,
        retries: int,
        observer: Any,
        role: str | None = None,
    ) -> None:
        self.world = world
        self.proc = proc
        self.server = server
        self.net = net
        self.socket_timeout = socket_timeout
        self.retries = retries
        self.observer = observer
        self.role = role  # what the checker calls its plain commands (e.g. "forget")
        self.worker: Any = None  # the simulated worker this client belongs to

    def __repr__(self) -> str:
        return f"SimClient({self.proc.name})"

    # -- redis-py surface -----------------------------------------------------------------

    def register_script(self, script: str) -> _Script:
        return _Script(self, script)

    def execute_command(self, *args: Any) -> Any:
        return self._call(("cmd", list(args)))

    def get(self, name: Any) -> Any:
        return self.execute_command("GET", name)

    def exists(self, *names: Any) -> Any:
        return self.execute_command("EXISTS", *names)

    def set(self, name: Any, value: Any, px: Any = None) -> Any:
        extra = [] if px is None else ["PX", px]
        return self.execute_command("SET", name, value, *extra)

    def delete(self, *names: Any) -> Any:
        return self.execute_command("DEL", *names)

    def hmget(self, name: Any, keys: Any, *args: Any) -> Any:
        fields = list(keys) if isinstance(keys, (list, tuple)) else [keys]
        return self.execute_command("HMGET", name, *fields, *args)

    def hgetall(self, name: Any) -> Any:
        flat = self.execute_command("HGETALL", name)
        return dict(zip(flat[::2], flat[1::2]))

    def pttl(self, name: Any) -> Any:
        return self.execute_command("PTTL", name)

    def scan_iter(self, match: Any = None, count: Any = None) -> Any:
        args: list[Any] = ["SCAN", 0]
        if match is not None:
            args += ["MATCH", match]
        return iter(self.execute_command(*args)[1])

    # -- one request ----------------------------------------------------------------------

    def _call(self, request: tuple[str, Any]) -> Any:
        attempt = 0
        while True:
            try:
                return self._once(request)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if attempt >= self.retries:
                    raise
                attempt += 1
                self.world.log(self.proc.name, f"client retry {attempt}")
                self.proc.sleep_local(0.008 * attempt)

    def _once(self, request: tuple[str, Any]) -> Any:
        world, proc, net, server = self.world, self.proc, self.net, self.server
        if proc.dead:
            raise Killed
        g = greenlet.getcurrent()
        park = _Park(proc, g)
        info = self.observer.sending(self, request)
        what = self.observer.describe(request, info) if self.world.tracing else ""

        def fail(exc: BaseException) -> None:
            world.unpark(park, exc)

        if not server.up:
            world.at(world.now + 0.0005, lambda: fail(redis.exceptions.ConnectionError("refused")))
        elif net.cut(proc, world.now) or net.rng.random() < net.p_request_loss:
            world.log(proc.name, f"request lost: {what}")
        else:
            sent_epoch = server.epoch

            def deliver() -> None:
                if not server.up or server.epoch != sent_epoch:
                    world.at(
                        world.now + 0.0005,
                        lambda: fail(redis.exceptions.ConnectionError("reset by peer")),
                    )
                    return
                try:
                    reply: Any = self.observer.apply(self, request, info)
                except CommandError as exc:
                    reply = redis.exceptions.ResponseError(str(exc))
                if net.cut(proc, world.now) or net.rng.random() < net.p_reply_loss:
                    world.log(proc.name, f"reply lost: {what}")
                    return

                def arrive() -> None:
                    if park.done:
                        return
                    if server.epoch != sent_epoch:
                        fail(redis.exceptions.ConnectionError("reset by peer"))
                        return
                    world.unpark(park, reply)

                world.at(world.now + net.latency(), arrive)

            world.at(world.now + net.latency(), deliver)
        world.at(
            world.now + self.socket_timeout,
            lambda: fail(redis.exceptions.TimeoutError("Timeout reading from socket")),
        )
        value = world.hub.switch(park)
        if isinstance(value, BaseException):
            raise value
        self.observer.delivered(self, request, value, info)  # the library's code has it now
        return value


class _Script:
    """What ``client.register_script`` returns: called with ``keys`` and ``args``."""

    def __init__(self, client: SimClient, script: str) -> None:
        self.client = client
        self.script = script
        self.sha = "sim"

    def __call__(self, keys: Any = (), args: Any = (), client: Any = None) -> Any:
        return (client or self.client)._call(("eval", (self.script, list(keys), list(args))))
