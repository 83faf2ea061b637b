"""The simulated server answers the library like a real Redis does.

The same random sequence of the library's own backend operations (claims, commits, renewals,
releases, record writes, look-ups, deletes) runs against a real Redis and against the
simulated server; every answer and the whole keyspace after every operation must agree, up
to what differs by nature (random lease tokens, fencing tokens and lease deadlines drawn from
two different clocks, TTLs measured a few microseconds apart). This is what lets the
simulation's verdicts stand for the real server.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

import pytest

from celery_idempotent.backends.redis.locks import RedisLockProvider
from celery_idempotent.backends.redis.store import RedisIdempotencyStore
from celery_idempotent.core.fingerprint import lock_resource, record_key
from celery_idempotent.core.protocols import IdempotencyRecord, Lease

from .server import CommandError, SimRedis


class DirectClient:
    """A redis-py-shaped client that answers from a :class:`SimRedis` at once (no network)."""

    def __init__(self, server: SimRedis) -> None:
        self.server = server

    def register_script(self, script: str) -> Any:
        server = self.server

        def call(keys: Any = (), args: Any = (), client: Any = None) -> Any:
            try:
                return server.eval(script, list(keys), list(args))
            except CommandError as exc:
                import redis.exceptions

                raise redis.exceptions.ResponseError(str(exc)) from None

        return call

    def _cmd(self, *args: Any) -> Any:
        encoded = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        try:
            return self.server.command(encoded)
        except CommandError as exc:
            import redis.exceptions

            raise redis.exceptions.ResponseError(str(exc)) from None

    def set(self, name: Any, value: Any, px: Any = None) -> Any:
        extra = [] if px is None else ["PX", px]
        return self._cmd("SET", name, value, *extra)

    def get(self, name: Any) -> Any:
        return self._cmd("GET", name)

    def exists(self, *names: Any) -> Any:
        return self._cmd("EXISTS", *names)

    def delete(self, *names: Any) -> Any:
        return self._cmd("DEL", *names)

    def hmget(self, name: Any, keys: Any, *args: Any) -> Any:
        return self._cmd("HMGET", name, *keys, *args)


_TOKEN = re.compile(r"[0-9a-f]{24}@")
_BIG = re.compile(r"\b1[0-9]{15}\b")
#: A lease's deadline in server ms at the head of a lock's value.
_DEADLINE = re.compile(r"^1[0-9]{12}/")


def _norm(value: Any, tokens: dict[str, str]) -> Any:
    """Random tokens -> T1, T2 ... in order of appearance; µs fencing tokens -> F; a lock's
    ms deadline -> D."""
    if isinstance(value, (list, tuple)):
        return [_norm(v, tokens) for v in value]
    if isinstance(value, dict):
        return {_norm(k, tokens): _norm(v, tokens) for k, v in sorted(value.items())}
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, int) and not isinstance(value, bool) and value > 10**15:
        return "F"
    if isinstance(value, str):
        for tok in _TOKEN.findall(value):
            tokens.setdefault(tok, f"T{len(tokens) + 1}@")
            value = value.replace(tok, tokens[tok])
        return _DEADLINE.sub("D/", _BIG.sub("F", value))
    return value


def _dump(client: Any, names: list[bytes], typer: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        kind = typer(name)
        if kind == "none":
            continue
        if kind == "string":
            value: Any = client.get(name)
        else:
            value = client.hgetall(name) if hasattr(client, "hgetall") else None
        pttl = client.pttl(name) if hasattr(client, "pttl") else None
        out[name.decode()] = (kind, value, "ttl" if pttl and pttl > 0 else pttl)
    return out


class _Side:
    def __init__(self, client: Any, owner: str) -> None:
        self.client = client
        self.locks = RedisLockProvider(client, owner_id=owner)
        self.store = RedisIdempotencyStore(client)
        atomic = self.store.atomic_with(self.locks)
        assert atomic is not None
        self.atomic = atomic
        self.leases: list[Lease | None] = []
        self.tokens: dict[str, str] = {}

    def do(self, op: str, resource: str, rkey: str, arg: Any) -> Any:
        try:
            return self._do(op, resource, rkey, arg)
        except Exception as exc:
            return ("error", type(exc).__name__)

    def _do(self, op: str, resource: str, rkey: str, arg: Any) -> Any:
        if op == "claim":
            claim = self.atomic.claim(resource, rkey, 60.0)
            self.leases.append(claim.lease)
            rec = claim.record
            return (claim.lease is not None, None if rec is None else (rec.result, rec.fingerprint))
        if op == "acquire":
            lease = self.locks.acquire(resource, 60.0)
            self.leases.append(lease)
            return lease is not None
        lease = self.leases[arg % len(self.leases)] if self.leases else None
        if op in ("extend", "release", "commit") and (lease is None or lease.resource != resource):
            return "no lease"
        assert lease is not None or op not in ("extend", "release", "commit")
        if op == "extend":
            return self.locks.extend(lease, 60.0)  # type: ignore[arg-type]
        if op == "release":
            return self.locks.release(lease)  # type: ignore[arg-type]
        if op == "commit":
            rec = IdempotencyRecord([arg, "x"], f"fp{arg}", 1.5, lease.fencing_token)  # type: ignore[union-attr]
            return self.atomic.commit(lease, rkey, rec, 600.0)  # type: ignore[arg-type]
        if op == "set":
            self.store.set(rkey, IdempotencyRecord({"v": arg}, None, 2.5, None), 600.0)
            return None
        if op == "get":
            rec = self.store.get(rkey)
            return None if rec is None else (rec.result, rec.fingerprint, rec.fencing_token)
        if op == "delete":
            return self.store.delete(rkey)
        raise AssertionError(op)


OPS = ("claim", "claim", "acquire", "extend", "release", "commit", "commit", "set", "get", "delete")


@pytest.mark.parametrize("seed", range(4))
def test_sim_server_answers_the_library_like_redis(
    redis_client: Any, key_prefix: str, seed: int
) -> None:
    rng = random.Random(seed)
    sim = SimRedis(time.time)
    sim.clock_offset = 0.0  # the same wall clock as the real server
    real = _Side(redis_client, "fidelity")
    fake = _Side(DirectClient(sim), "fidelity")
    keys = [f"{key_prefix}fid{seed}:{i}" for i in range(2)]
    names: list[bytes] = []
    for k in keys:
        resource = lock_resource("idempotency:", k)
        names += [
            resource.encode(),
            RedisLockProvider.fence_key(resource).encode(),
            record_key("idempotency:", k).encode(),
        ]
    try:
        for step in range(120):
            op = rng.choice(OPS)
            k = rng.choice(keys)
            resource, rkey = lock_resource("idempotency:", k), record_key("idempotency:", k)
            arg = rng.randrange(1000)
            got_real = _norm(real.do(op, resource, rkey, arg), real.tokens)
            got_sim = _norm(fake.do(op, resource, rkey, arg), fake.tokens)
            assert got_sim == got_real, f"step {step}: {op} on {k}"
            dump_real = _norm(
                _dump(redis_client, names, lambda n: redis_client.type(n).decode()), real.tokens
            )
            dump_sim = _norm(
                _dump(_SimView(sim), names, lambda n: sim.command([b"TYPE", n]).text), fake.tokens
            )
            assert dump_sim == dump_real, f"keyspace after step {step}: {op} on {k}"
    finally:
        redis_client.delete(*names)


class _SimView:
    def __init__(self, server: SimRedis) -> None:
        self.server = server

    def get(self, name: bytes) -> Any:
        return self.server.command([b"GET", name])

    def hgetall(self, name: bytes) -> Any:
        flat = self.server.command([b"HGETALL", name])
        return dict(zip(flat[::2], flat[1::2]))

    def pttl(self, name: bytes) -> Any:
        return self.server.command([b"PTTL", name])
