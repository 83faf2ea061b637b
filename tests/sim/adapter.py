"""The one place where the simulation touches the library.

Everything the harness knows about the library goes through here, so that a change of the
library's layout or renewal (issues 11, 12, 13) is an edit of this file, not of the harness:

- :func:`make_guard` builds a real :class:`DistributedIdempotencyGuard` on the real Redis
  lock provider and store, over a :class:`~.world.SimClient`. The Lua scripts are the ones the
  library registers; the simulation never has a copy of them (a mutant edits the text the
  library registers, see :mod:`.mutants`).
- :class:`SimKeeper` runs the library's own renewal decision (``LeaseKeeper._renew``) on the
  process's simulated clock, scheduled the way the keeper thread schedules it (one keeper per
  process, renewals one after the other).
- :class:`Layout` reads a key's state (holder, fencing token, record) out of the simulated
  keyspace for the checker, with the library's own names and record decoder.
- :func:`role_of` names a script by comparing it with the library's constants.
"""

from __future__ import annotations

import contextlib
import heapq
import inspect
import itertools
import json
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Callable

import greenlet

from celery_idempotent.backends.redis import admin_scripts as redis_admin_scripts
from celery_idempotent.backends.redis import publish_scripts as redis_publish_scripts
from celery_idempotent.backends.redis import scripts as redis_scripts
from celery_idempotent.backends.redis.locks import RedisLockProvider
from celery_idempotent.backends.redis.store import RedisIdempotencyStore
from celery_idempotent.core import renewal as lease_renewal
from celery_idempotent.core.fingerprint import lock_resource, record_key
from celery_idempotent.core.guard import DistributedIdempotencyGuard

from .server import Entry, SimRedis
from .world import Process

try:  # layout v2 (issue 13): one module owns names and the record format
    from celery_idempotent.backends.redis import keyspace as _keyspace
except ImportError:  # pragma: no cover - layout v1
    _keyspace = None  # type: ignore[assignment]

__all__ = [
    "FENCE_MARGIN_US",
    "PREFIX",
    "KeyView",
    "Layout",
    "SimKeeper",
    "make_guard",
    "rebind",
    "role_of",
]

PREFIX = "idempotency:"
LAYOUT = "v2" if _keyspace is not None and hasattr(_keyspace, "decode_record") else "v1"
#: How long (server µs) a lock keeps an ended lease's fencing token past the later of the
#: lease's end and the clock reaching the token (0: the layout keeps no tombstone).
FENCE_MARGIN_US = int(getattr(_keyspace, "FENCE_MARGIN_MS", 0)) * 1000


def rebind(fn: Callable[..., Any], **names: Any) -> Any:
    """``fn`` with some of its module globals replaced (same code object: the real code)."""
    glb = dict(fn.__globals__)
    glb.update(names)
    new = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def recompile(fn: Callable[..., Any], edit: Callable[[str], str], **names: Any) -> Any:
    """``fn`` compiled again from its source after ``edit`` (a mutant of the real code)."""
    source = textwrap.dedent(inspect.getsource(fn))
    edited = edit(source)
    if edited == source:
        raise ValueError(f"mutation did not apply to {fn.__qualname__}")
    glb = dict(fn.__globals__)
    glb.update(names)
    ns: dict[str, Any] = {}
    exec(compile(edited, f"<mutant of {fn.__qualname__}>", "exec"), glb, ns)  # noqa: S102
    new = ns[fn.__name__]
    return rebind(new, **names)


# -- scripts --------------------------------------------------------------------------------

_ROLES = {
    "CLAIM": "claim",
    "COMMIT": "commit",
    "EXTEND": "renew",
    "RELEASE": "release",
    "ACQUIRE": "acquire",
    "SET_RECORD": "set_record",
    "READ_KEY": "read_key",
    "PUBLISH": "publish",
    "DROP_QUEUED": "drop_queued",
}


#: The library's modules of Lua scripts (their constants are the scripts it registers).
SCRIPT_MODULES = (redis_scripts, redis_publish_scripts, redis_admin_scripts)


def script_source(const: str) -> str | None:
    """The text of the library's script ``const`` (``"CLAIM"``...), or ``None``."""
    for module in SCRIPT_MODULES:
        src = getattr(module, const, None)
        if isinstance(src, str):
            return src
    return None


def script_roles() -> dict[str, str]:
    """Script source -> role, from the library's own constants."""
    out: dict[str, str] = {}
    for const, role in _ROLES.items():
        src = script_source(const)
        if src is not None:
            out[src] = role
    return out


def role_of(script: str, roles: dict[str, str]) -> str:
    return roles.get(script, "script?")


def request_token(role: str, keys: list[Any], args: list[Any]) -> str | None:
    """The lease token a script call carries (its first argument for the lease scripts)."""
    if role in ("claim", "commit", "renew", "release", "acquire") and args:
        token = args[0]
        return token.decode() if isinstance(token, bytes) else str(token)
    return None


def holds(holder: str | None, token: str | None) -> bool:
    """Whether the lock's value ``holder`` is the lease of ``token`` (v2 prefixes the fence)."""
    if holder is None or token is None:
        return False
    return holder == token or holder.endswith("/" + token)


def owner_of(token: str) -> str:
    """The owner id in a lock value (``[fence/]random@owner``)."""
    return token.split("@", 1)[1] if "@" in token else token


# -- the keyspace, as the checker sees it -----------------------------------------------------


@dataclass(frozen=True)
class KeyView:
    """One idempotency key's state at the server now (expired entries are absent)."""

    holder: str | None
    holder_expire_ms: int | None
    fence_key: int | None  # the fence key's value (v1: last token; v2: only while ahead)
    record_stamp: int | None  # write stamp: changes with every write of the record
    record_value: Any
    record_fence: int | None
    record_expire_ms: int | None
    record_fp: str | None
    # a queued marker under the record's name: (task id, fingerprint, write stamp, expiry,
    # state: "q" queued, "c" claimed by a delivery, "r" claimed then re-queued)
    marker: tuple[str, str | None, int, int | None, str] | None = None
    # the lock's key exists (a valid lease, or a tombstone that keeps an ended lease's token)
    lock_present: bool = False
    lock_fence: int | None = None  # the fencing token the lock's key carries


_NO_VALUE = object()


class Layout:
    """Where a key's lock, fence and record are, and how to read the record."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.lock = lock_resource(PREFIX, key).encode()
        self.record = record_key(PREFIX, key).encode()
        self.fence = RedisLockProvider.fence_key(lock_resource(PREFIX, key)).encode()

    def view(self, server: SimRedis) -> KeyView:
        lock = server.peek(self.lock)
        fence = server.peek(self.fence)
        rec = server.peek(self.record)
        holder, holder_expire, lock_fence = None, None, None
        if lock is not None:
            holder, holder_expire = lock.value.decode(), lock.expire_ms
            parse = getattr(_keyspace, "parse_lock", None)
            if parse is not None:  # a lease's deadline in the value; after it, a tombstone
                state = parse(holder)
                lock_fence = state.fencing_token
                if state.deadline_ms is not None:
                    live = state.deadline_ms > server.now_ms()
                    holder = state.lease_token if live else None
                    holder_expire = state.deadline_ms if live else None
        marker = None
        if rec is not None and rec.kind == "string" and _keyspace is not None:
            parsed = _keyspace.parse_marker(rec.value)
            if parsed is not None:
                marker = (parsed[0], parsed[1], rec.version, rec.expire_ms, parsed.state)
                rec = None
        value, rfence, fp = (None, None, None) if rec is None else decode_record(rec)
        return KeyView(
            holder=holder,
            holder_expire_ms=holder_expire,
            fence_key=None if fence is None else int(fence.value),
            record_stamp=None if rec is None else rec.version,
            record_value=value,
            record_fence=rfence,
            record_expire_ms=None if rec is None else rec.expire_ms,
            record_fp=fp,
            marker=marker,
            lock_present=lock is not None,
            lock_fence=lock_fence,
        )

    @staticmethod
    def token_forgotten(view: KeyView, role: str) -> bool:
        """Whether nothing at the server floors a ``role`` grant's token by the last one (then
        only the server clock does). Layout v1: the fence key is the only floor (a claim or
        acquire never reads the record's token). Layout v2: the lock, the fence key and, for a
        claim (which reads the record), the record carry it; an acquire (the two-step path,
        whose store may live elsewhere) does not see the record. The lock's key carries it
        while it exists: a valid lease, or a tombstone that keeps an ended lease's token."""
        if LAYOUT == "v1":
            return view.fence_key is None
        if role == "acquire":
            return not view.lock_present and view.fence_key is None
        return not view.lock_present and view.record_stamp is None and view.fence_key is None

    def grant_fence(self, view: KeyView) -> int | None:
        """The fencing token of the holder in ``view``."""
        if view.holder is not None and "/" in view.holder:
            head = view.holder.split("/", 1)[0]
            if head.isdigit():
                return int(head)
        return view.fence_key


def decode_record(entry: Entry) -> tuple[Any, int | None, str | None]:
    """(result value, fencing token, fingerprint) of a stored record, v1 hash or v2 string."""
    if entry.kind == "hash":
        fields = entry.value
        data = fields.get(b"data", b"")
        fence = fields.get(b"fence") or b""
        fp = fields.get(b"fp") or b""
        return _load(data), int(fence) if fence else None, fp.decode() or None
    if _keyspace is not None and hasattr(_keyspace, "decode_record"):
        rec = _keyspace.decode_record(entry.value)
        return _load(rec.data), rec.fencing_token, rec.fingerprint
    raise AssertionError(f"unexpected record {entry!r}")  # pragma: no cover


def _load(data: bytes) -> Any:
    return json.loads(data) if data else None


# -- renewal ----------------------------------------------------------------------------------


class _RenewalNamespace:
    """What ``guard._run_body`` sees as ``renewal``: the real module, with the keeper swapped
    for the process's :class:`SimKeeper` (both the ``keeper().keep(...)`` and the
    ``keep(...)``/``stop(...)`` spellings of the module's API)."""

    def __init__(self, keeper: SimKeeper) -> None:
        self._keeper = keeper

    def __getattr__(self, name: str) -> Any:
        return getattr(lease_renewal, name)

    def keeper(self) -> SimKeeper:
        return self._keeper

    def keep(self, provider: Any, lease: Any, ttl: float, interval: float, **kw: Any) -> Any:
        return self._keeper.keep(provider, lease, ttl, interval, **kw)

    @staticmethod
    def stop(renewal: Any) -> None:
        renewal.cancelled = True


def _params(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


class SimKeeper:
    """The keeper thread of one process, as a greenlet on the simulated clock.

    It keeps the real keeper's shape (a heap of ``(due, seq, Renewal)``, one renewal at a
    time, stopped renewals dropped when due) and calls the real ``LeaseKeeper._renew`` with
    ``time`` bound to the process's clock, so the decision after each renewal reply (lost,
    retry, next due) is the library's. Where the provider offers a ``renewer()`` (a
    connection of the keeper's own), the renewal goes through the library's own ``renew``
    function over a connection of its own in the simulation.
    """

    def __init__(
        self,
        proc: Process,
        renew: Callable[..., Any] | None = None,
        connect: Callable[[float], Any] | None = None,
    ) -> None:
        self.proc = proc
        self._cond = contextlib.nullcontext()
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._wake: Any = None
        self._running = False
        self._relay = False
        self._natives = None
        self._connect = connect  # timeout -> a client of the keeper's own
        self.greenlet: Any = None  # the keeper's own greenlet, once started
        fn = renew or rebind(lease_renewal.LeaseKeeper._renew, time=proc.time)
        self._renew = types.MethodType(fn, self)
        # The keeper's _renew returns the next due time (or None) in the newer keeper, and
        # pushes the renewal back itself in the older one.
        self._returns_due = "due" in _params(fn)
        for helper in ("_lose", "_log"):
            real = getattr(lease_renewal.LeaseKeeper, helper, None)
            if real is not None:
                setattr(self, helper, types.MethodType(rebind(real, time=proc.time), self))
        self._init_renewal = rebind(lease_renewal.Renewal.__init__, time=proc.time)
        self._init_params = _params(lease_renewal.Renewal.__init__)

    def keep(self, provider: Any, lease: Any, ttl: float, interval: float, **kw: Any) -> Any:
        renewal = lease_renewal.Renewal.__new__(lease_renewal.Renewal)
        if "renew" in self._init_params:
            make = getattr(provider, "_make_renew", None)
            renew = kw.get("renew")
            if renew is None and make is not None and self._connect is not None:
                renew = make(self._caller)
            self._init_renewal(renewal, provider, lease, ttl, interval, renew, kw.get("label"))
        else:
            self._init_renewal(renewal, provider, lease, ttl, interval)
        heapq.heappush(self._heap, (self.proc.monotonic() + interval, next(self._seq), renewal))
        if not self._running:
            self._running = True
            self.proc.world.spawn(self.proc, self._run, "keeper")
        elif self._wake is not None:
            self.proc.world.unpark(self._wake, None)
        return renewal

    def _caller(self, script: str, keys: list[Any], args: list[Any], timeout: float) -> Any:
        """The keeper's own connection: one attempt, at most ``timeout`` seconds."""
        assert self._connect is not None
        return self._connect(timeout).register_script(script)(keys=keys, args=args)

    def _run(self) -> None:
        from .world import _Park

        world, proc, heap = self.proc.world, self.proc, self._heap
        self.greenlet = greenlet.getcurrent()
        while True:
            while heap and heap[0][2].cancelled:
                heapq.heappop(heap)
            now = proc.monotonic()
            if heap and heap[0][0] <= now:
                due, _, renewal = heapq.heappop(heap)
                if self._returns_due:
                    next_due = self._renew(renewal, due)
                    if next_due is not None and not renewal.cancelled:
                        heapq.heappush(heap, (next_due, next(self._seq), renewal))
                else:
                    self._renew(renewal)
                continue
            park = _Park(proc, greenlet.getcurrent())
            self._wake = park
            if heap:
                world.at(
                    world.now + (heap[0][0] - now) / proc.rate, lambda p=park: world.unpark(p, None)
                )
            value = world.hub.switch(park)
            self._wake = None
            if isinstance(value, BaseException):
                raise value


# -- the guard --------------------------------------------------------------------------------


@dataclass
class GuardConfig:
    lock_ttl: float = 1.0
    ttl: float = 30.0
    fence_ttl: float = 7 * 86_400.0
    retry_count: int = 3
    retry_base_delay: float = 0.05


def make_guard(
    proc: Process,
    client: Any,
    cfg: GuardConfig,
    keeper: SimKeeper,
    store_client: Any = None,
) -> DistributedIdempotencyGuard:
    """A real guard on the real Redis backends over ``client``, renewing through ``keeper``.

    With a ``store_client`` of its own, the store does not share the lock provider's client,
    so the guard takes its two-step path (lock, then store), as it does for backends on two
    servers, or clients it cannot tell are one server.
    """
    locks = RedisLockProvider(client, owner_id=proc.name, fence_ttl=cfg.fence_ttl)
    store = RedisIdempotencyStore(store_client or client)
    namespace = _RenewalNamespace(keeper)

    # Every method of the guard that reaches for the renewal module sees the simulated keeper,
    # and every one that reads the time module reads the process's clocks.
    swapped = {
        name: rebind(fn, renewal=namespace, time=proc.time)
        for name, fn in vars(DistributedIdempotencyGuard).items()
        if isinstance(fn, types.FunctionType) and {"renewal", "time"} & set(fn.__code__.co_names)
    }
    if not swapped:
        raise AssertionError("the guard no longer calls the renewal module: update the adapter")
    sim_guard = type("SimGuard", (DistributedIdempotencyGuard,), swapped)

    return sim_guard(
        store=store,
        lock_provider=locks,
        ttl=cfg.ttl,
        lock_ttl=cfg.lock_ttl,
        retry_count=cfg.retry_count,
        retry_base_delay=cfg.retry_base_delay,
        clock=proc.wall,
        sleep=proc.guard_sleep,
        random=proc.rng.random,
    )


def forget(client: Any, key: str) -> bool:
    """The explicit forget: the store's ``delete`` of the key's record."""
    store = RedisIdempotencyStore(client)
    return store.delete(record_key(PREFIX, key))


def check_publish(
    client: Any, key: str, task_id: str, fingerprint: str | None, publish_ttl: float
) -> Any:
    """The publish-side decision of ``apply_async``: the real store's ``check_publish`` (the
    library's ``PUBLISH`` script) for ``key``, with the names the guard uses."""
    store = RedisIdempotencyStore(client)
    return store.check_publish(
        record_key(PREFIX, key), lock_resource(PREFIX, key), task_id, fingerprint, publish_ttl
    )
