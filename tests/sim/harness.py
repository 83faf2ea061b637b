"""Plans, runs and shrinks simulated schedules.

A :class:`Plan` is everything a run depends on besides its seed: the workers and their calls,
the bodies (how long, whether they fail), the faults and when they strike, the network's
loss and delay rates, the guard's settings. :func:`make_plan` draws one from a seed;
:func:`run_plan` runs it, checking the invariants after every step, and returns a
:class:`Result`. The same plan and seed always give the same run, step for step, so a failing
seed is a reproducible bug report; :func:`shrink` makes its plan as small as it can while it
still fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import greenlet

from celery_idempotent.core.exceptions import (
    CommitUnknownError,
    IdempotencyConnectionError,
    IdempotencyMismatchError,
    LockAcquisitionError,
    LockLostError,
)
from celery_idempotent.core.guard import current_lease

from . import adapter
from .checker import Checker, Violation, reset_aliases, short
from .server import SimRedis
from .world import Killed, Network, Process, SimClient, World

__all__ = ["Plan", "Publish", "Result", "make_plan", "make_publish_plan", "run_plan", "shrink"]

FAULT_KINDS = (
    "pause",
    "crash",
    "partition",
    "restart",
    "clock",
    "skew",
    "forget",
)


@dataclass
class Call:
    key: int
    duration: float  # body seconds (true time)
    fails: bool = False


@dataclass
class Fault:
    at: float
    kind: str
    target: int = 0  # worker index, or key index for forget
    span: float = 0.0  # pause / partition / down time / restart delay
    delta: float = 0.0  # clock step (s), skew offset (s)
    rate: float = 1.0  # skew: the worker clock's new rate
    mode: str = "aof"  # restart: aof / none / snapshot


@dataclass
class Publish:
    """A standalone publish (``apply_async``'s decision) of ``key`` as ``task_id``."""

    at: float
    key: int
    task_id: str
    fingerprint: str | None = None
    duration: float = 0.1  # the body of the delivered message, when it is published


@dataclass
class Plan:
    seed: int
    keys: int
    workers: list[list[Call]]
    faults: list[Fault]
    net: dict[str, float]
    socket_timeout: float = 0.5
    client_retries: int = 1
    lock_ttl: float = 1.0
    ttl: float = 30.0
    fence_ttl: float = 7 * 86_400.0
    snapshot_every: float = 0.0
    horizon: float = 120.0
    split: bool = False  # store and lock provider on two clients: the guard's two-step path
    publishes: list[Publish] = field(default_factory=list)
    publish_ttl: float = 30.0

    def size(self) -> int:
        return (
            sum(len(w) for w in self.workers)
            + len(self.faults)
            + len(self.publishes)
            + self.keys
            + sum(1 for k, v in self.net.items() if v and k != "max_delay")
        )

    def describe(self) -> str:
        lines = [
            f"plan seed={self.seed}: {self.keys} key(s), {len(self.workers)} worker(s), "
            f"lock_ttl={self.lock_ttl}s ttl={self.ttl}s fence_ttl={self.fence_ttl:g}s "
            f"socket_timeout={self.socket_timeout}s client_retries={self.client_retries}"
            + (" two-step (store and lock apart)" if self.split else ""),
            f"  network: {self.net}",
        ]
        for i, calls in enumerate(self.workers):
            text = ", ".join(
                f"k{c.key}({c.duration:.2f}s{' fails' if c.fails else ''})" for c in calls
            )
            lines.append(f"  w{i}: {text}")
        for p in self.publishes:
            lines.append(
                f"  publish at {p.at:.3f}s: k{p.key} as {p.task_id} (fingerprint "
                f"{p.fingerprint}, publish_ttl {self.publish_ttl:g}s)"
            )
        for f in self.faults:
            lines.append(f"  fault at {f.at:.3f}s: {fault_text(f)}")
        return "\n".join(lines)


def fault_text(f: Fault) -> str:
    if f.kind == "pause":
        return f"pause w{f.target} for {f.span:.3f}s"
    if f.kind == "crash":
        return f"crash w{f.target}, restarted after {f.span:.3f}s"
    if f.kind == "partition":
        return f"cut w{f.target} from Redis for {f.span:.3f}s"
    if f.kind == "restart":
        return f"Redis restart ({f.mode}), down {f.span:.3f}s"
    if f.kind == "clock":
        return f"Redis clock steps {f.delta:+.3f}s"
    if f.kind == "skew":
        return f"w{f.target} clock {f.delta:+.1f}s, rate {f.rate:.3f}"
    if f.kind == "forget":
        return f"forget k{f.target}"
    return f.kind


def make_plan(
    seed: int, *, faults: tuple[str, ...] = FAULT_KINDS, split: bool | None = None
) -> Plan:
    """Draw a plan from ``seed``: small (a few keys, workers, calls), dense in faults."""
    rng = random.Random(f"plan-{seed}")
    lock_ttl = 1.0
    keys = rng.choice((1, 1, 2, 3))
    n_workers = rng.choice((2, 2, 3, 4))
    workers = []
    for _ in range(n_workers):
        calls = []
        for _ in range(rng.randint(1, 4)):
            duration = rng.choice(
                (rng.uniform(0, 0.2), rng.uniform(0, lock_ttl), rng.uniform(lock_ttl, 3 * lock_ttl))
            )
            calls.append(Call(rng.randrange(keys), round(duration, 4), rng.random() < 0.1))
        workers.append(calls)
    persistence = rng.choice(("aof", "aof", "none", "snapshot"))
    fault_list = []
    n_faults = rng.choice((0, 1, 2, 3, 4, 6))
    horizon_hint = 6.0
    for _ in range(n_faults):
        kind = rng.choice(faults)
        at = round(rng.uniform(0, horizon_hint), 4)
        w = rng.randrange(n_workers)
        if kind == "pause":
            f = Fault(at, kind, w, span=round(rng.uniform(0.3, 3.5) * lock_ttl, 4))
        elif kind == "crash":
            f = Fault(at, kind, w, span=round(rng.uniform(0.05, 2.0), 4))
        elif kind == "partition":
            f = Fault(at, kind, w, span=round(rng.uniform(0.1, 3.0) * lock_ttl, 4))
        elif kind == "restart":
            mode = rng.choice((persistence, "aof")) if persistence != "aof" else "aof"
            f = Fault(at, kind, span=round(rng.uniform(0.01, 2.5), 4), mode=mode)
        elif kind == "clock":
            f = Fault(at, kind, delta=round(rng.choice((-1, 1)) * rng.uniform(0.05, 3.0), 4))
        elif kind == "skew":
            f = Fault(
                at,
                kind,
                w,
                delta=round(rng.uniform(-3600, 3600), 1),
                rate=round(rng.uniform(0.8, 1.25), 3),
            )
        else:
            f = Fault(at, "forget", rng.randrange(keys))
        fault_list.append(f)
    fault_list.sort(key=lambda f: f.at)
    loss = rng.choice((0.0, 0.0, 0.01, 0.05, 0.2))
    net = {
        "request_loss": loss if rng.random() < 0.7 else 0.0,
        "reply_loss": loss if rng.random() < 0.7 else 0.0,
        "delay": rng.choice((0.0, 0.0, 0.02, 0.1)),
        "max_delay": rng.choice((0.3, 1.5)),
    }
    if split is None:
        split = False
    return Plan(
        seed=seed,
        keys=keys,
        workers=workers,
        faults=fault_list,
        net=net,
        socket_timeout=rng.choice((0.25, 0.5, 2.0)),
        client_retries=rng.choice((0, 1, 1, 2)),
        lock_ttl=lock_ttl,
        ttl=rng.choice((30.0, 30.0, 2.5)),
        fence_ttl=rng.choice((7 * 86_400.0, 7 * 86_400.0, 2.0)),
        snapshot_every=rng.choice((0.5, 2.0)) if persistence == "snapshot" else 0.0,
        split=split,
    )


def make_two_step_plan(seed: int) -> Plan:
    """A plan for the guard's two-step path (store and lock apart: lock proof, then write),
    with every fault but the two that no guard can control there: the client library's own
    resends and network delays, either of which can deliver the write after the lease ran
    out (see the README's Reliability section)."""
    plan = make_plan(seed, split=True)
    return dataclasses.replace(plan, client_retries=0, net={**plan.net, "delay": 0.0})


def make_publish_plan(seed: int) -> Plan:
    """A plan whose guard workers run interleaved with standalone publishes (the library's
    ``PUBLISH`` decision) of the same keys: new task ids, the same task id sent again, and
    fingerprints that agree or not. The publishes are drawn from a stream of their own, so
    the rest of the plan is :func:`make_plan`'s for that seed."""
    plan = make_plan(seed)
    rng = random.Random(f"publish-{seed}")
    pubs: list[Publish] = []
    for i in range(rng.randint(2, 6)):
        if pubs and rng.random() < 0.2:  # the same call published again (a client resend)
            prev = rng.choice(pubs)
            at = round(rng.uniform(0, 6.0), 4)
            pubs.append(dataclasses.replace(prev, at=at))
            continue
        fp = rng.choice(("fa", "fa", "fb", None))
        at = round(rng.choice((rng.uniform(0, 0.5), rng.uniform(0, 6.0))), 4)
        duration = round(rng.uniform(0, 2 * plan.lock_ttl), 4)
        pubs.append(Publish(at, rng.randrange(plan.keys), f"t{i}", fp, duration))
    pubs.sort(key=lambda p: p.at)
    return dataclasses.replace(plan, publishes=pubs, publish_ttl=rng.choice((30.0, 2.0)))


@dataclass
class Result:
    plan: Plan
    violation: Violation | None
    trace: list[tuple[float, str, str]]
    steps: int = 0
    checks: int = 0
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    publishes: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    unfinished: int = 0
    late_starts: int = 0
    excused_fences: int = 0
    excused_by: Counter[str] = field(default_factory=Counter)
    reruns_after_loss: int = 0

    @property
    def failed(self) -> bool:
        return self.violation is not None

    def format_trace(self, last: int | None = None) -> str:
        rows = self.trace if last is None else self.trace[-last:]
        return "\n".join(f"{t:9.4f}s  {who:<8} {what}" for t, who, what in rows)


class BodyFailed(Exception):
    """What a failing simulated body raises."""


class _Worker:
    def __init__(self, index: int, calls: list[Call]) -> None:
        self.index = index
        self.calls = calls
        self.next_call = 0
        self.attempts = 0
        self.incarnation = 0
        self.proc: Process | None = None
        self.body: Any = None
        self.keeper: Any = None
        self.done = False


class _Run:
    """One run of a plan: the observer the simulated clients report to."""

    def __init__(self, plan: Plan, mutant: Any, trace: bool) -> None:
        reset_aliases()
        self.plan = plan
        self.mutant = mutant
        self.world = World(plan.seed)
        self.world.tracing = trace
        self.server = SimRedis(lambda: self.world.now, "aof")
        self.net = Network(random.Random(f"net-{plan.seed}"), plan.net)
        self.key_names = [f"k{i}" for i in range(plan.keys)]
        self.checker = Checker(self.key_names, self.server)
        self.roles = adapter.script_roles()
        self.edited: dict[str, str] = {}
        self.cfg = adapter.GuardConfig(
            lock_ttl=plan.lock_ttl, ttl=plan.ttl, fence_ttl=plan.fence_ttl
        )
        self.workers = [_Worker(i, calls) for i, calls in enumerate(plan.workers)]
        self.result = Result(plan, None, self.world.trace)
        self.violation: Violation | None = None
        self.value_seq = 0
        self.publishes_done = 0

    # -- observer ---------------------------------------------------------------------------

    def _request_info(self, client: SimClient, request: tuple[str, Any]) -> tuple[str, Any]:
        """(role, lease token) of a request, classified in the sending greenlet."""
        kind, body = request
        if client.role is not None:  # the admin's requests (an explicit forget)
            return client.role, None
        w = getattr(client, "worker", None)
        if kind == "eval":
            script, keys, args = body
            role = adapter.role_of(script, self.roles)
            token = adapter.request_token(role, keys, args)
            if role == "renew" and w is not None and w.keeper.greenlet is not greenlet.getcurrent():
                role = "commit"  # the two-step commit proves its lease with an extend
        else:
            role, token = str(body[0]).lower(), None
        if token is None and w is not None and w.body is not None:
            # A plain write of the two-step path (a script or a SET, by layout) is made on
            # behalf of the body's lease.
            token = w.body.token
        return role, token

    def apply(self, client: SimClient, request: tuple[str, Any], info: tuple[str, Any]) -> Any:
        role, token = info
        proc = client.proc.name
        self.result.requests += 1
        self.checker.now = self.world.now
        kind, body = request
        try:
            if kind == "eval":
                script, keys, args = body
                if self.mutant is not None and self.mutant.script_edit is not None:
                    edited = self.edited.get(script)
                    if edited is None:
                        edited = self.edited[script] = self.mutant.script_edit(script)
                    script = edited
                before = self._publish_before(role, keys)
                reply = self.server.eval(script, keys, args)
                if before is not None:
                    key, view = before
                    task_id, fp = (_text(a) for a in args[:2])
                    decision = self.checker.publish_applied(
                        proc, key, (task_id, fp or None), view, reply
                    )
                    self.result.publishes[f"script:{decision}"] += 1
            else:
                reply = self.server.command([_arg(a) for a in body])
        finally:
            self.checker.after_request(proc, role, token)
        if self.world.tracing:
            self.world.log(
                proc,
                f"{role} {self._keyname(request)} {short(token) if token else ''}"
                f" -> {_reply_text(reply)}",
            )
        self._last_reply = reply
        return reply

    def _publish_before(self, role: str, keys: list[Any]) -> tuple[str, Any] | None:
        """(key, its state) just before a publish script runs, for the checker."""
        if role != "publish" or not self.server.up:
            return None
        key = self._keyname(("eval", (None, keys, None)))
        if key not in self.checker.keys:
            return None
        return key, self.checker.keys[key].layout.view(self.server)

    def sending(self, client: SimClient, request: tuple[str, Any]) -> tuple[str, Any]:
        """Called in the sending greenlet: what the request is, for the checker."""
        info = self._request_info(client, request)
        self.checker.before_request(client.proc.name, *info)
        return info

    def describe(self, request: tuple[str, Any], info: tuple[str, Any]) -> str:
        """A request as the trace names it: its role, key and lease."""
        role, token = info
        return f"{role} {self._keyname(request)} {short(token) if token else ''}".rstrip()

    def delivered(
        self, client: SimClient, request: tuple[str, Any], reply: Any, info: tuple[str, Any]
    ) -> None:
        self.checker.reply_delivered(info[0], info[1], reply)

    def _keyname(self, request: tuple[str, Any]) -> str:
        kind, body = request
        keys = body[1] if kind == "eval" else body[1:2]
        for name in keys:
            text = name.decode() if isinstance(name, bytes) else str(name)
            for k in self.key_names:
                if "{" + k + "}" in text:
                    return k
        return "?"

    # -- workers ----------------------------------------------------------------------------

    def start_worker(self, w: _Worker) -> None:
        name = f"w{w.index}.{w.incarnation}"
        proc = Process(self.world, name, random.Random(f"{self.plan.seed}-{name}"))
        w.proc = proc
        client = SimClient(
            self.world,
            proc,
            self.server,
            self.net,
            socket_timeout=self.plan.socket_timeout,
            retries=self.plan.client_retries,
            observer=self,
        )
        client.worker = w
        store_client = None
        if self.plan.split:
            store_client = SimClient(
                self.world,
                proc,
                self.server,
                self.net,
                socket_timeout=self.plan.socket_timeout,
                retries=self.plan.client_retries,
                observer=self,
            )
            store_client.worker = w
        renew = self.mutant.renew(proc) if self.mutant is not None else None

        def connect(timeout: float) -> SimClient:
            own = SimClient(
                self.world,
                proc,
                self.server,
                self.net,
                socket_timeout=timeout,
                retries=0,
                observer=self,
            )
            own.worker = w
            return own

        keeper = adapter.SimKeeper(proc, renew, connect)
        w.keeper = keeper
        guard = adapter.make_guard(proc, client, self.cfg, keeper, store_client)
        if self.mutant is not None and self.mutant.guard_edit is not None:
            guard = self.mutant.guard_edit(guard)
        self.world.spawn(proc, lambda: self._worker_main(w, proc, guard), "main")

    def _worker_main(self, w: _Worker, proc: Process, guard: Any) -> None:
        world = self.world
        while w.next_call < len(w.calls):
            call = w.calls[w.next_call]
            key = self.key_names[call.key]
            self.value_seq += 1
            value = f"{key}:{proc.name}:{self.value_seq}"
            started = world.now
            holder: dict[str, Any] = {"body": None, "exc": None}

            def fn(
                call: Call = call, key: str = key, value: str = value, holder: Any = holder
            ) -> str:
                lease = current_lease()
                assert lease is not None
                body = self.checker.body_start(proc.name, key, lease.token, lease.fencing_token)
                holder["body"] = w.body = body
                world.log(proc.name, f"body {key} starts (fence {lease.fencing_token})")
                proc.sleep_local(call.duration / 2 * proc.rate)
                proc.sleep_local(call.duration / 2 * proc.rate)
                if call.fails:
                    self.checker.body_end(body, "raised")
                    world.log(proc.name, f"body {key} raises")
                    exc = BodyFailed(value)
                    holder["exc"] = exc
                    raise exc
                self.checker.body_end(body, "returned", value)
                world.log(proc.name, f"body {key} returns {value}")
                return value

            requeue = False
            try:
                out = guard.run(key, fn, input={"key": key})
            except Killed:
                raise
            except BodyFailed as exc:
                if exc is not holder["exc"]:
                    raise self.checker.violated(
                        "failed-body", f"{proc.name}: not the body's exception"
                    ) from exc
                self._result(proc, key, started, holder, kind="raised", value=exc)
            except CommitUnknownError as exc:
                self._result(proc, key, started, holder, kind="unknown", value=exc)
            except LockLostError as exc:
                self._result(proc, key, started, holder, kind="lost", value=exc)
            except (LockAcquisitionError, IdempotencyConnectionError) as exc:
                if holder["body"] is not None:
                    raise self.checker.violated(
                        "report", f"{proc.name}: {type(exc).__name__} after the body ran"
                    ) from exc
                world.log(proc.name, f"{key}: {type(exc).__name__}, re-queued")
                self.result.outcomes["requeued"] += 1
                requeue = True
            except IdempotencyMismatchError as exc:
                raise self.checker.violated(
                    "replay", f"{proc.name}: unexpected mismatch: {exc}"
                ) from exc
            else:
                kind = "replay" if out.replayed else "fresh"
                self._result(proc, key, started, holder, kind=kind, value=out.value)
            w.body = None
            if requeue and w.attempts < 40:
                w.attempts += 1
                proc.sleep_local(proc.rng.uniform(0.05, 0.5))
                continue
            w.next_call += 1
            w.attempts = 0
        w.done = True

    def _result(
        self,
        proc: Process,
        key: str,
        started: float,
        holder: dict[str, Any],
        *,
        kind: str,
        value: Any,
    ) -> None:
        self.result.outcomes[kind] += 1
        self.world.log(proc.name, f"{key}: call ends: {kind} {value!r}")
        self.checker.call_result(proc.name, key, started, holder["body"], kind=kind, value=value)

    # -- publishers ----------------------------------------------------------------------

    def start_publish(self, i: int, pub: Publish) -> None:
        proc = Process(self.world, f"p{i}", random.Random(f"{self.plan.seed}-p{i}"))
        client = SimClient(
            self.world,
            proc,
            self.server,
            self.net,
            socket_timeout=self.plan.socket_timeout,
            retries=self.plan.client_retries,
            observer=self,
        )
        key = self.key_names[pub.key]

        def run() -> None:
            try:
                decision = adapter.check_publish(
                    client, key, pub.task_id, pub.fingerprint, self.plan.publish_ttl
                )
            except IdempotencyConnectionError as exc:
                self.world.log(proc.name, f"publish {key} as {pub.task_id} failed: {exc!r}")
                self.result.publishes["failed"] += 1
                return
            finally:
                self.publishes_done += 1
            action = "unchecked" if decision.unchecked else decision.action
            self.world.log(proc.name, f"publish {key} as {pub.task_id}: {action}")
            self.result.publishes[action] += 1
            if decision.action == "publish":
                # The message is delivered: a worker of its own runs it through the guard.
                w = _Worker(len(self.workers), [Call(pub.key, pub.duration)])
                self.workers.append(w)
                self.start_worker(w)

        self.world.spawn(proc, run, "publish")

    # -- faults -----------------------------------------------------------------------------

    def inject(self, f: Fault) -> None:
        world, server = self.world, self.server
        self.result.faults[f.kind if f.kind != "restart" else f"restart-{f.mode}"] += 1
        world.log("fault", fault_text(f))
        if f.kind in ("pause", "crash", "partition", "skew"):
            w = self.workers[f.target]
            proc = w.proc
            if proc is None or proc.dead or w.done:
                return  # not started yet, or crashed and not yet back
            if f.kind == "pause":
                proc.frozen_until = max(proc.frozen_until, world.now + f.span)
            elif f.kind == "partition":
                self.net.partitioned[proc.node] = world.now + f.span
            elif f.kind == "skew":
                proc.offset += f.delta
                proc.set_rate(f.rate)
            else:
                if w.body is not None and w.body.state == "running":
                    self.checker.body_end(w.body, "killed")
                w.body = None
                proc.kill()
                w.incarnation += 1
                world.at(world.now + f.span, lambda: self.start_worker(w))
        elif f.kind == "restart":
            server.crash()

            def up() -> None:
                server.start(f.mode, self._snapshot_index())
                world.log("fault", f"Redis up again ({f.mode})")
                self.checker.restart(f.mode)

            world.at(world.now + f.span, up)
        elif f.kind == "clock":
            server.clock_offset += f.delta
            self.checker.clock_step(f.delta)
        elif f.kind == "forget":
            admin = Process(world, f"admin{len(self.result.faults)}", random.Random(0))
            client = SimClient(
                world,
                admin,
                server,
                self.net,
                socket_timeout=0.5,
                retries=0,
                observer=self,
                role="forget",
            )
            key = self.key_names[f.target]

            def run_forget() -> None:
                try:
                    adapter.forget(client, key)
                except Exception as exc:  # a lost forget is a forget that did not happen
                    world.log(admin.name, f"forget failed: {exc!r}")

            world.spawn(admin, run_forget, "forget")

    def _active_expiry(self) -> None:
        # Redis deletes expired keys in a background cycle (10 times a second); until then a
        # key whose time has come is only invisible, and a clock step back revives it.
        if self.server.up:
            self.server.active_expire()
        self.world.at(self.world.now + 0.1, self._active_expiry)

    def _snapshot_index(self) -> int:
        snaps = self.server.snapshots
        if not snaps:
            return -1
        return random.Random(f"snap-{self.plan.seed}-{len(snaps)}").randrange(len(snaps))

    def _snapshots(self) -> None:
        if self.server.up:
            self.server.snapshot()
        self.world.at(self.world.now + self.plan.snapshot_every, self._snapshots)

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> Result:
        logger = logging.getLogger("celery_idempotent")
        disabled, logger.disabled = logger.disabled, True
        try:
            return self._run()
        finally:
            logger.disabled = disabled

    def _run(self) -> Result:
        world = self.world
        for w in self.workers:
            self.start_worker(w)
        for f in self.plan.faults:
            world.at(f.at, lambda f=f: self.inject(f))
        for i, pub in enumerate(self.plan.publishes):
            world.at(pub.at, lambda i=i, pub=pub: self.start_publish(i, pub))
        if self.plan.snapshot_every:
            world.at(0.0, self._snapshots)
        world.at(0.05, self._active_expiry)

        checker = self.checker

        def after_step() -> None:
            if checker.first is not None:
                raise checker.first
            checker.tick(world.now)

        world.after_step = after_step
        try:
            world.run(
                self.plan.horizon,
                stop=lambda: (
                    all(w.done for w in self.workers)
                    and self.publishes_done == len(self.plan.publishes)
                ),
            )
        except Violation:
            pass
        except Exception as exc:  # the library raised what no rule expects, or a harness bug
            import traceback

            self.checker.violated(
                "error",
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip(),
            )
        finally:
            self._teardown()
        if self.checker.first is not None:
            self.result.violation = self.checker.first
            world.log("CHECK", f"VIOLATION {self.checker.first}")
        self.result.steps = world.steps
        self.result.checks = self.checker.checks
        self.result.late_starts = self.checker.late_starts
        self.result.excused_fences = self.checker.excused_fences
        self.result.excused_by = self.checker.excused_by
        self.result.reruns_after_loss = self.checker.reruns_after_loss
        for why, n in self.checker.marker_ends.items():
            self.result.publishes[f"marker {why}"] += n
        if self.checker.first is None:
            self.result.unfinished = sum(1 for w in self.workers if not w.done)
        return self.result

    def _teardown(self) -> None:
        # Unwind every greenlet still parked, so none is left for the garbage collector.
        for w in self.workers:
            if w.proc is not None and not w.proc.dead:
                with contextlib.suppress(Violation):
                    w.proc.kill()


def _arg(a: Any) -> bytes:
    if isinstance(a, bytes):
        return a
    return str(a).encode()


def _text(a: Any) -> str:
    return a.decode() if isinstance(a, bytes) else str(a)


def _reply_text(reply: Any) -> str:
    if isinstance(reply, list):
        return (
            "[" + ", ".join(_reply_text(r) for r in reply[:3]) + (", …]" if len(reply) > 3 else "]")
        )
    if isinstance(reply, bytes):
        text = reply.decode(errors="replace")
        return text if len(text) < 30 else text[:27] + "…"
    return repr(reply)


def run_plan(plan: Plan, mutant: Any = None, *, trace: bool = True) -> Result:
    """Run ``plan`` once; the result carries the first violation, if any."""
    return _Run(plan, mutant, trace).run()


def shrink(plan: Plan, mutant: Any = None, *, budget: int = 300, rule: str | None = None) -> Result:
    """The smallest plan found (removing faults, calls, workers, network faults) that still
    breaks the same rule; greedy, at most ``budget`` runs."""
    best = run_plan(plan, mutant)
    if best.violation is None:
        return best
    rule = rule or best.violation.rule
    runs = 0

    def fails(candidate: Plan) -> Result | None:
        nonlocal runs
        runs += 1
        res = run_plan(candidate, mutant, trace=False)
        if res.violation is not None and res.violation.rule == rule:
            return run_plan(candidate, mutant)
        return None

    changed = True
    while changed and runs < budget:
        changed = False
        for candidate in _smaller(best.plan):
            if runs >= budget:
                break
            res = fails(candidate)
            if res is not None:
                best = res
                changed = True
                break
    return best


def _smaller(plan: Plan) -> Any:
    for i in range(len(plan.publishes)):
        yield dataclasses.replace(plan, publishes=plan.publishes[:i] + plan.publishes[i + 1 :])
    for i in range(len(plan.faults)):
        yield dataclasses.replace(plan, faults=plan.faults[:i] + plan.faults[i + 1 :])
    for k, v in plan.net.items():
        if v and k != "max_delay":
            yield dataclasses.replace(plan, net={**plan.net, k: 0.0})
    for wi, calls in enumerate(plan.workers):
        if len(plan.workers) > 1:
            workers = plan.workers[:wi] + plan.workers[wi + 1 :]
            faults = [_renumber(f, wi) for f in plan.faults if not _targets(f, wi)]
            yield dataclasses.replace(plan, workers=workers, faults=faults)
        for ci in range(len(calls)):
            if len(calls) > 1:
                new = [list(c) for c in plan.workers]
                del new[wi][ci]
                yield dataclasses.replace(plan, workers=new)
    for k, v in plan.net.items():
        if v > 0.01 and k not in ("max_delay",):
            yield dataclasses.replace(plan, net={**plan.net, k: round(v / 4, 4)})
    if plan.keys > 1:
        for key in range(plan.keys):
            workers = [
                [dataclasses.replace(c, key=c.key - (c.key > key)) for c in calls if c.key != key]
                for calls in plan.workers
            ]
            if all(workers):
                faults = [
                    dataclasses.replace(f, target=f.target - (f.target > key))
                    if f.kind == "forget"
                    else f
                    for f in plan.faults
                    if not (f.kind == "forget" and f.target == key)
                ]
                pubs = [
                    dataclasses.replace(p, key=p.key - (p.key > key))
                    for p in plan.publishes
                    if p.key != key
                ]
                yield dataclasses.replace(
                    plan, keys=plan.keys - 1, workers=workers, faults=faults, publishes=pubs
                )
    if plan.client_retries:
        yield dataclasses.replace(plan, client_retries=0)
    if plan.socket_timeout > 0.25:
        yield dataclasses.replace(plan, socket_timeout=0.25)
    for wi, calls in enumerate(plan.workers):
        for ci, c in enumerate(calls):
            if c.fails:
                new = [list(x) for x in plan.workers]
                new[wi][ci] = dataclasses.replace(c, fails=False)
                yield dataclasses.replace(plan, workers=new)


def _targets(f: Fault, wi: int) -> bool:
    return f.kind in ("pause", "crash", "partition", "skew") and f.target == wi


def _renumber(f: Fault, removed: int) -> Fault:
    if f.kind in ("pause", "crash", "partition", "skew") and f.target > removed:
        return dataclasses.replace(f, target=f.target - 1)
    return f


@dataclass
class Campaign:
    schedules: int = 0
    failures: list[Result] = field(default_factory=list)
    steps: int = 0
    checks: int = 0
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    publishes: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    unfinished: int = 0
    late_starts: int = 0
    excused_fences: int = 0
    excused_by: Counter[str] = field(default_factory=Counter)
    reruns_after_loss: int = 0
    seconds: float = 0.0

    def add(self, res: Result) -> None:
        self.schedules += 1
        self.steps += res.steps
        self.checks += res.checks
        self.requests += res.requests
        self.faults.update(res.faults)
        self.outcomes.update(res.outcomes)
        self.publishes.update(res.publishes)
        self.unfinished += res.unfinished
        self.late_starts += res.late_starts
        self.excused_fences += res.excused_fences
        self.excused_by.update(res.excused_by)
        self.reruns_after_loss += res.reruns_after_loss
        if res.failed:
            self.failures.append(res)

    def summary(self) -> str:
        secs = max(self.seconds, 1e-9)
        total_faults = sum(self.faults.values())
        return (
            f"{self.schedules} schedules, {self.steps} steps, {self.requests} Redis requests, "
            f"{total_faults} faults injected, {self.checks} invariant checks in "
            f"{self.seconds:.1f}s CPU ({self.schedules / secs:.0f} schedules/s, "
            f"{self.checks / secs:.0f} checks/s); {len(self.failures)} failing\n"
            f"  faults: {dict(sorted(self.faults.items()))}\n"
            f"  call outcomes: {dict(sorted(self.outcomes.items()))}\n"
            + (
                f"  publish decisions: {dict(sorted(self.publishes.items()))}\n"
                if self.publishes
                else ""
            )
            + f"  documented outcomes: {self.reruns_after_loss} completed keys ran again after a "
            f"restart lost their record; {self.excused_fences} lower fencing tokens once no "
            f"key carried the last one (a restart lost it, a forget, or it expired and the "
            f"server clock then stepped back further than the documented margin: "
            f"{dict(sorted(self.excused_by.items()))})\n"
            f"  bodies started on a lease that had already lapsed (no valid lease; commit "
            f"refused): {self.late_starts}; workers unfinished at the horizon: {self.unfinished}"
        )


def campaign(
    seeds: Any,
    mutant: Any = None,
    *,
    stop_at_first: bool = False,
    make: Callable[[int], Plan] = make_plan,
    deadline: float | None = None,
) -> Campaign:
    """Run the plans of ``seeds`` (without traces); failures are kept for replay."""
    out = Campaign()
    start = time.process_time()
    for seed in seeds:
        res = run_plan(make(seed), mutant, trace=False)
        out.add(res)
        if res.failed and stop_at_first:
            break
        if deadline is not None and time.process_time() - start > deadline:
            break
    out.seconds = time.process_time() - start
    return out
