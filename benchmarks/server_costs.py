"""Where Redis server time goes: our scripts step by step, and plain commands, in µs per call.

Each probe runs ``n`` times on fresh keys and reads ``INFO commandstats`` before and after (the
EVALSHA row for scripts, the command's row for plain commands). Plain commands are counted by
Redis for their execution only; a command called from Lua also pays for the script around it
and for converting arguments and replies between Lua and Redis, which is what the difference
between the two columns shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

#: Lua probes: (name, what it does, script). KEYS[1..3] are fresh names, ARGV[1] a 60-byte
#: value, ARGV[2] a lease in ms.
LUA_PROBES: tuple[tuple[str, str, str], ...] = (
    ("noop", "EVALSHA of `return 0` (3 keys, 2 args)", "return 0"),
    ("get_missing", "+ one GET of a missing key", "redis.call('get', KEYS[1]) return 0"),
    (
        "mget3_missing",
        "+ one MGET of 3 missing keys",
        "redis.call('mget', KEYS[1], KEYS[2], KEYS[3]) return 0",
    ),
    ("exists_missing", "+ one EXISTS of a missing key", "redis.call('exists', KEYS[1]) return 0"),
    ("time", "+ one TIME", "redis.call('time') return 0"),
    (
        "set_px_new",
        "+ one SET PX of a new key (kept)",
        "redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 0",
    ),
    (
        "set_px_del",
        "+ one SET PX of a new key, then DEL it",
        "redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) redis.call('del', KEYS[1]) return 0",
    ),
)

VALUE = "x" * 60


def _usec(client: redis.Redis, name: str) -> tuple[int, int]:
    stats = client.info("commandstats").get(f"cmdstat_{name}", {})
    return int(stats.get("usec", 0)), int(stats.get("calls", 0))


def _per_call(client: redis.Redis, name: str, n: int, call: Callable[[int], Any]) -> float:
    usec0, calls0 = _usec(client, name)
    for i in range(n):
        call(i)
    usec1, calls1 = _usec(client, name)
    return round((usec1 - usec0) / max(1, calls1 - calls0), 2)


def run(client: redis.Redis, prefix: str, *, n: int = 5000) -> dict[str, Any]:
    """µs per call of each probe, and of our CLAIM (first execution and duplicate) and COMMIT."""
    from celery_idempotent.backends.redis import scripts as redis_scripts

    out: dict[str, Any] = {"calls": n, "lua": {}, "plain": {}, "scripts": {}}
    for round_ in range(2):  # the second round is reported: scripts loaded, tables warm
        for name, label, source in LUA_PROBES:
            script = client.register_script(source)

            def call(i: int, script: Any = script, name: str = name, r: int = round_) -> Any:
                base = f"{prefix}sc:{r}:{name}:{i}"
                return script(keys=[f"{base}:a", f"{base}:b", f"{base}:c"], args=[VALUE, 10_000])

            out["lua"][name] = {"label": label, "us": _per_call(client, "evalsha", n, call)}
            _forget(client, f"{prefix}sc:")
    out["plain"]["set_px_new"] = _per_call(
        client,
        "set",
        n,
        lambda i: client.set(f"{prefix}sc:plain:{i}", VALUE, px=10_000),
    )
    out["plain"]["get_missing"] = _per_call(
        client, "get", n, lambda i: client.get(f"{prefix}sc:missing:{i}")
    )

    _forget(client, f"{prefix}sc:")
    claim = client.register_script(redis_scripts.CLAIM)
    commit = client.register_script(redis_scripts.COMMIT)
    names = [
        (f"{prefix}sc:lock:{{{i}}}", f"{prefix}sc:{{{i}}}", f"{prefix}sc:lock:{{{i}}}:fence")
        for i in range(n)
    ]
    fences: list[bytes] = []
    out["scripts"]["claim_first"] = _per_call(
        client,
        "evalsha",
        n,
        lambda i: fences.append(claim(keys=list(names[i]), args=["token@o", 10_000])[1]),
    )

    def do_commit(i: int) -> Any:
        fence = fences[i]
        record = b"2|" + fence + b'|27||=64||{"status": "ok"}'
        return commit(keys=list(names[i]), args=[fence + b"/token@o", 86_400_000, record, fence])

    out["scripts"]["commit"] = _per_call(client, "evalsha", n, do_commit)
    out["scripts"]["claim_duplicate"] = _per_call(
        client, "evalsha", n, lambda i: claim(keys=list(names[i]), args=["other@o", 10_000])
    )
    _forget(client, f"{prefix}sc:")
    return out


def _forget(client: redis.Redis, prefix: str) -> None:
    """Delete the probes' keys now: keys left to expire would shrink the memory of whatever
    is measured next."""
    batch = list(client.scan_iter(match=prefix.replace("*", r"\*") + "*", count=1000))
    for start in range(0, len(batch), 1000):
        client.delete(*batch[start : start + 1000])
