"""What the Redis lock provider and store share: the client, error translation, the scripts.

Every decision is one Lua script, registered once per client and called by SHA (redis-py's
``Script`` falls back to loading it once when the server does not know it yet). The scripts
are written so that a call retried by the client after a lost reply (redis-py retries on
connection errors) decides the same as the first: a claim by the token that already holds the
lock succeeds again, and a commit that already happened reports success.

The names and formats they read and write (the lock with its lease's deadline, the record
string, the fence key, the tombstone a lease leaves) are those of ``celery_idempotent.keyspace``,
whose docstring says why fencing tokens increase and within which bound.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import TYPE_CHECKING, Any

from celery_idempotent import keyspace
from celery_idempotent.exceptions import (
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyError,
)
from celery_idempotent.urls import redact

if TYPE_CHECKING:
    import redis

__all__ = [
    "ACQUIRE",
    "CLAIM",
    "COMMIT",
    "DROP_FENCE",
    "DROP_QUEUED",
    "EXTEND",
    "FORGET",
    "HOLDER",
    "PUBLISH",
    "PUBLISH_AND_PUSH",
    "READ_KEY",
    "RELEASE",
    "SentinelClientFactory",
    "default_owner_id",
    "import_redis",
    "make_client",
    "new_token",
    "same_server",
    "sentinel_factory_from_broker",
    "translate_errors",
]

INSTALL_HINT = "the Redis backends need the redis package: pip install 'celery-idempotent[redis]'"

#: Defaults for clients built from a URL; options in the URL's query string win. Without a
#: socket timeout a stalled network would block a worker forever instead of failing over.
CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "health_check_interval": 30,
}

# The scripts of layout v2 (see celery_idempotent.keyspace for the names, the record format and
# why fencing tokens increase without a long-lived fence key). Lua numbers are doubles: a token
# in µs since 1970 (about 1.8e15) is exact below 2**53.
#
# A lock's value is "<deadline ms>/<fencing token>/<token>" (keyspace.lock_entry): the lease is
# valid while the server clock is before the deadline; after it, until the key expires, the value
# is a tombstone that keeps the fencing token (keyspace.FENCE_MARGIN_MS). A lock without a
# deadline (0.1.0's "<token>", or "<fencing token>/<token>" from before the tombstones) is held
# while its key exists: its first field, if any, reads as a deadline far in the future.

_SEP = keyspace.LOCK_SEP
_MARGIN = str(int(keyspace.FENCE_MARGIN_MS))

# Sets now (µs) and ms to the server's time. TIME makes a script non-deterministic, which effects
# replication (Redis's default since 5.0) handles: the writes are replicated, not the script.
_TIME = """
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
"""


# Keeps fencing token f (a string) in fence key fk while the server clock is not past it (op
# ">="; a claim, whose lock carries the token past the clock, uses ">"): the key expires when
# the clock passes the token. (Needs now.) The lock's tombstone keeps the token longer (until
# the clock has passed it by the margin); the fence key also floors tokens if the lock is
# deleted by hand while the clock is behind.
def _keep(fk: str, f: str, op: str = ">=") -> str:
    return f"""
if tonumber({f}) {op} now then
  redis.call('set', {fk}, {f})
  redis.call('pexpireat', {fk}, string.format('%d', math.floor(tonumber({f}) / 1000) + 1))
end
"""


# The lock's key lives until the later of its deadline and the clock reaching its token (f, a
# number), plus the margin: so a token is never forgotten before the clock has passed it by the
# margin. px: the lease in ms (a number; 0 for a tombstone).
def _lock_px(f: str, px: str) -> str:
    return f"math.max({px}, math.floor({f} / 1000) - ms) + {_MARGIN}"


# Reads lock value `held` (needs now): returns from the script what `ours` / `theirs` say when
# the lease is valid (held by this very token ARGV[1], whose fencing token is `mine`; by
# another); otherwise sets last to the tombstone's fencing token.
def _held(ours: str, theirs: str) -> str:
    return (
        """
local a = string.find(held, '{sep}', 1, true)
local d = a and tonumber(string.sub(held, 1, a - 1))
if not d or d * 1000 > now then
  local n = #held - #ARGV[1]
  if a and n > a and string.sub(held, n) == '{sep}' .. ARGV[1] then
    local mine = string.sub(held, a + 1, n - 1)
    return {ours}
  end
  return {theirs}
end
local b = string.find(held, '{sep}', a + 1, true)
last = tonumber(b and string.sub(held, a + 1, b - 1) or '') or 0
""".replace("{sep}", _SEP)
        .replace("{ours}", ours)
        .replace("{theirs}", theirs)
    )


# Hands out the next fencing token for lock KEYS[1] (floored by the server clock, fence key
# value fv and a tombstone's token last) and takes the lock for token ARGV[1] with a lease of
# ARGV[2] ms. Sets fs (the token, a string). (Needs now, ms, fv, last.)
def _take(fk: str) -> str:
    return (
        """
local f = math.max(now, tonumber(fv or '0') + 1, last + 1)
local fs = string.format('%d', f)
redis.call('set', KEYS[1], string.format('%d', ms + ARGV[2]) .. '{sep}' .. fs .. '{sep}' .. ARGV[1],
           'PX', {px})
""".replace("{sep}", _SEP).replace("{px}", _lock_px("f", "tonumber(ARGV[2])"))
        + _keep(fk, "fs", ">")
    )


# Sets live: whether lock value v (a string or false) is the valid lease of lease token ARGV[1].
# (Needs now.)
_LIVE = """
local live = false
if v then
  if v == ARGV[1] then
    live = true
  else
    local n = #v - #ARGV[1]
    if n > 1 and string.sub(v, n) == '{sep}' .. ARGV[1] then
      live = (tonumber(string.sub(v, 1, n - 1)) or 0) * 1000 > now
    end
  end
end
""".replace("{sep}", _SEP)

# Turns lock KEYS[1] of lease token ARGV[1] and fencing token f (a number) into a tombstone: the
# lease ends now, for good (its deadline is 0: a server clock that steps back does not revive
# it), and the token stays. (Needs now, ms.)
_TOMBSTONE = """
redis.call('set', KEYS[1], '0{sep}' .. ARGV[1], 'PX', {px})
""".replace("{sep}", _SEP).replace("{px}", _lock_px("f", "0"))

# KEYS[1] lock  KEYS[2] fence   ARGV[1] token  ARGV[2] lease ms
# -> fencing token (a string) when taken (or already held by this very token), 0 when held
ACQUIRE = (
    """
local got = redis.call('mget', KEYS[1], KEYS[2])
local held, fv = got[1], got[2]
local now, ms, last = 0, 0, 0
"""
    + _TIME
    + "if held then\n"
    + _held("mine", "0")
    + "end\n"
    + _take("KEYS[2]")
    + """
return fs
"""
)

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence   ARGV[1] token  ARGV[2] lease ms
# Lock first, then the store, in one step (one MGET reads the lock, a v2 record and the fence):
# -> {0}                  the lock is held by another holder (the record is not looked at)
# -> {1, fencing token}   the lock was free and there is no record: the lock is now ours
# -> {2, record}          the lock was free and a v2 record exists: not taken
# -> {3, v1 fields...}    the lock was free and a v1 record (a hash) exists: not taken
#                         (a hash without a v1 version field is taken over, as 0.1.0 did)
# -> {4, value}           the lock was free and the record name holds another string
# A queued marker (a call published but not run yet) is not a record: the lock is taken over
# it, and the marker stays until the commit replaces it.
# A key of another type (a list, ...) under the record name fails with WRONGTYPE.
# The server clock is read only when there is a lock to judge or one to take.
CLAIM = (
    """
local got = redis.call('mget', KEYS[1], KEYS[2], KEYS[3])
local held, rec, fv = got[1], got[2], got[3]
local now, ms, last = false, 0, 0
if held then
"""
    + _TIME
    + _held("{1, mine}", "{0}")
    + """
end
if rec then
  if string.sub(rec, 1, """
    + str(len(keyspace.RECORD_HEAD))
    + """) == '"""
    + keyspace.RECORD_HEAD
    + """' then return {2, rec} end
  if string.sub(rec, 1, """
    + str(len(keyspace.QUEUED_HEAD))
    + """) ~= '"""
    + keyspace.QUEUED_HEAD
    + """' then return {4, rec} end
elseif redis.call('exists', KEYS[2]) == 1 then
  local v1 = redis.call('hmget', KEYS[2], """
    + keyspace.lua_list(keyspace.V1_RECORD_FIELDS)
    + """)
  if v1[1] then return {3, unpack(v1)} end
end
if not now then
"""
    + _TIME
    + "end\n"
    + _take("KEYS[3]")
    + """
return {1, fs}
"""
)

# KEYS[1] record  KEYS[2] lock   ARGV[1] task id  ARGV[2] fingerprint ('' for none)
# ARGV[3] publish ttl ms
# The publish-side decision of apply_async, in one step:
# -> {1}                  publish: the marker for ARGV[1] is set (or was already ARGV[1]'s own)
# -> {2, record}          completed (v2 record): publish nothing
# -> {3, v1 fields...}    completed (v1 record): publish nothing
# -> {5, task id, fp}     queued or running under another fingerprint: a mismatch
# -> {6, task id}         queued or running (the marker names the first call): publish nothing
# -> {7}                  running without a marker, or a foreign value: publish as without
#                         the check (the run-time guard decides)
# A lock whose lease has ended (a tombstone) is not running.
PUBLISH = (
    """
local got = redis.call('mget', KEYS[1], KEYS[2])
local rec, held = got[1], got[2]
if rec then
  local head = string.sub(rec, 1, 2)
  if head == '"""
    + keyspace.RECORD_HEAD
    + """' then return {2, rec} end
  if head ~= '"""
    + keyspace.QUEUED_HEAD
    + """' then return {7} end
  local cut = string.find(rec, '"""
    + keyspace.SEP
    + """', 3, true)
  if not cut then return {7} end
  local tid, fp = string.sub(rec, 3, cut - 1), string.sub(rec, cut + 1)
  if tid == ARGV[1] then return {1} end
  if fp ~= '' and ARGV[2] ~= '' and fp ~= ARGV[2] then return {5, tid, fp} end
  return {6, tid}
elseif redis.call('exists', KEYS[1]) == 1 then
  local v1 = redis.pcall('hmget', KEYS[1], """
    + keyspace.lua_list(keyspace.V1_RECORD_FIELDS)
    + """)
  if type(v1) == 'table' and v1[1] then return {3, unpack(v1)} end
  return {7}
end
if held then
  local a = string.find(held, '"""
    + _SEP
    + """', 1, true)
  local d = a and tonumber(string.sub(held, 1, a - 1))
  if not d then return {7} end
  local t = redis.call('time')
  if d * 1000 > tonumber(t[1]) * 1000000 + tonumber(t[2]) then return {7} end
end
redis.call('set', KEYS[1], '"""
    + keyspace.QUEUED_HEAD
    + """' .. ARGV[1] .. '"""
    + keyspace.SEP
    + """' .. ARGV[2], 'PX', ARGV[3])
return {1}
"""
)

# KEYS[1] record  KEYS[2] lock  KEYS[3] the broker's queue (a kombu Redis list)
# ARGV[1..3] as PUBLISH  ARGV[4] the message as kombu's Redis transport pushes it
# PUBLISH's decision (its very text, run as a function), then the message pushed in the same
# step when it says publish ({1}, {7}): one round trip for the check and the broker's LPUSH
# when the broker is this Redis. Replies as PUBLISH; nothing pushed for the others.
PUBLISH_AND_PUSH = (
    "local function decide()\n"
    + PUBLISH
    + """end
local r = decide()
if r[1] == 1 or r[1] == 7 then redis.call('lpush', KEYS[3], ARGV[4]) end
return r
"""
)

# KEYS[1] record   ARGV[1] task id
# -> 1 when the record name held ARGV[1]'s queued marker and it is deleted, else 0
DROP_QUEUED = (
    """
local mine = '"""
    + keyspace.QUEUED_HEAD
    + """' .. ARGV[1] .. '"""
    + keyspace.SEP
    + """'
local rec = redis.pcall('get', KEYS[1])
if type(rec) == 'string' and string.sub(rec, 1, #mine) == mine then
  return redis.call('del', KEYS[1])
end
return 0
"""
)

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence
# ARGV[1] the lease's token  ARGV[2] record ttl ms  ARGV[3] the record  ARGV[4] fencing token
# -> 1 committed and released; 0 not the holder (nothing written).
# A resent commit that already went through finds its own record (same fencing token): 1.
# The record carries the token from then on (and the fence key while the server clock is behind
# the token: it stepped back during the lease).
COMMIT = (
    """
local v = redis.call('get', KEYS[1])
local now, ms = 0, 0
if v then
"""
    + _TIME
    + "end\n"
    + _LIVE
    + """
if not live then
  local rec = redis.pcall('get', KEYS[2])
  local head = '"""
    + keyspace.RECORD_HEAD
    + """' .. ARGV[4] .. '"""
    + keyspace.SEP
    + """'
  if type(rec) == 'string' and string.sub(rec, 1, #head) == head then return 1 end
  return 0
end
redis.call('set', KEYS[2], ARGV[3], 'PX', ARGV[2])
redis.call('del', KEYS[1])
"""
    + _keep("KEYS[3]", "ARGV[4]")
    + """
return 1
"""
)

# KEYS[1] lock  KEYS[2] fence   ARGV[1] token  ARGV[2] lease ms  ARGV[3] fencing token
# -> 1 extended, 0 not the holder or the lease has ended (nothing changed)
EXTEND = (
    """
local v = redis.call('get', KEYS[1])
if not v then return 0 end
local now, ms = 0, 0
"""
    + _TIME
    + _LIVE
    + """
if not live then return 0 end
local f = tonumber(ARGV[3])
redis.call('set', KEYS[1], string.format('%d', ms + ARGV[2]) .. '"""
    + _SEP
    + """' .. ARGV[1], 'PX', """
    + _lock_px("f", "tonumber(ARGV[2])")
    + """)
"""
    + _keep("KEYS[2]", "ARGV[3]")
    + """
return 1
"""
)

# KEYS[1] lock  KEYS[2] fence   ARGV[1] token  ARGV[2] fencing token
# ARGV[3] "1": a lease under which nothing ran (a claim given back at once): delete the lock
# -> 1 released, 0 not the holder or the lease has ended (nothing changed)
# The lock becomes a tombstone that keeps the fencing token.
RELEASE = (
    """
local v = redis.call('get', KEYS[1])
if not v then return 0 end
local now, ms = 0, 0
"""
    + _TIME
    + _LIVE
    + """
if not live then return 0 end
if ARGV[3] == '1' then
  redis.call('del', KEYS[1])
  return 1
end
local f = tonumber(ARGV[2])
"""
    + _TOMBSTONE
    + _keep("KEYS[2]", "ARGV[2]")
    + """
return 1
"""
)

# KEYS[1] lock   -> the lease token of the lock's valid lease, or false (free, or a tombstone)
HOLDER = (
    """
local v = redis.call('get', KEYS[1])
if not v then return false end
local a = string.find(v, '"""
    + _SEP
    + """', 1, true)
local d = a and tonumber(string.sub(v, 1, a - 1))
if not d then return v end
local t = redis.call('time')
if d * 1000 <= tonumber(t[1]) * 1000000 + tonumber(t[2]) then return false end
local b = string.find(v, '"""
    + _SEP
    + """', a + 1, true)
if b and tonumber(string.sub(v, a + 1, b - 1)) then return string.sub(v, a + 1) end
return v
"""
)

# KEYS[1] record  KEYS[2] lock  KEYS[3] fence   ARGV[1] "1": the whole payload, else its head
# One consistent view of a key for the admin command (absent values are nil):
# -> {record type, record (string, or v1 fields), record size, record pttl, lock's lease token,
#     lease ms left, fence, fence pttl}
# A lock whose lease has ended (a tombstone) reads as no lock.
READ_KEY = (
    """
local kind = redis.call('type', KEYS[1])['ok']
local rec, size = false, 0
if kind == 'string' then
  size = redis.call('strlen', KEYS[1])
  if ARGV[1] == '1' then rec = redis.call('get', KEYS[1])
  else rec = redis.call('getrange', KEYS[1], 0, 1023) end
elseif kind == 'hash' then
  rec = redis.call('hmget', KEYS[1], """
    + keyspace.lua_list(keyspace.V1_RECORD_FIELDS)
    + """)
  size = redis.call('hstrlen', KEYS[1], 'data')
  if ARGV[1] ~= '1' then rec[4] = '' end
end
local lv, lt = redis.call('get', KEYS[2]), redis.call('pttl', KEYS[2])
if lv then
  local a = string.find(lv, '"""
    + _SEP
    + """', 1, true)
  local d = a and tonumber(string.sub(lv, 1, a - 1))
  local b = d and string.find(lv, '"""
    + _SEP
    + """', a + 1, true)
  if b and tonumber(string.sub(lv, a + 1, b - 1)) then
    local t = redis.call('time')
    local left = d - math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
    if left > 0 then lv, lt = string.sub(lv, a + 1), left else lv, lt = false, -2 end
  end
end
return {kind, rec, size, redis.call('pttl', KEYS[1]), lv, lt,
        redis.call('get', KEYS[3]), redis.call('pttl', KEYS[3])}
"""
)

# KEYS[1] fence   -> 1 deleted, 0 kept (absent, or the server clock is not past its token)
DROP_FENCE = """
local t = redis.call('time')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local f = tonumber(redis.call('get', KEYS[1]) or '0')
if f > 0 and f < now then return redis.call('del', KEYS[1]) end
return 0
"""

# KEYS[1] record  KEYS[2] lock  KEYS[3] fence   ARGV[1] the lock's lease token as read ('' for
# none)  ARGV[2] "1": also a held lock  ARGV[3] "1": also the fence key
# Forget a key (the admin command): the record; the lock only if it still holds the lease that
# was shown; the fence key only once the server clock has passed it. The highest fencing token
# the record or the lock carried stays in the lock as a tombstone (until the clock has passed
# it by the margin; a lock held by someone else is left alone), and in the fence key while it
# is ahead of the clock.
# -> {record deleted, lock deleted, fence deleted}
FORGET = (
    """
local now, ms = 0, 0
"""
    + _TIME
    + """
local out = {0, 0, 0}
local last = 0
local rec = redis.pcall('get', KEYS[1])
if type(rec) == 'string' and string.sub(rec, 1, """
    + str(len(keyspace.RECORD_HEAD))
    + """) == '"""
    + keyspace.RECORD_HEAD
    + """' then
  local e = string.find(rec, '"""
    + keyspace.SEP
    + """', """
    + str(len(keyspace.RECORD_HEAD) + 1)
    + """, true)
  last = tonumber(string.sub(rec, """
    + str(len(keyspace.RECORD_HEAD) + 1)
    + """, e - 1)) or 0
end
out[1] = redis.call('del', KEYS[1])
local lv = redis.call('get', KEYS[2])
if ARGV[2] == '1' and ARGV[1] ~= '' and lv and (lv == ARGV[1]
    or string.sub(lv, -#ARGV[1] - 1) == '"""
    + _SEP
    + """' .. ARGV[1]) then
  local cut = string.find(ARGV[1], '"""
    + _SEP
    + """', 1, true)
  if cut then last = math.max(last, tonumber(string.sub(ARGV[1], 1, cut - 1)) or 0) end
  out[2] = redis.call('del', KEYS[2])
  lv = false
end
if last > 0 and not lv and last + """
    + _MARGIN
    + """ * 1000 > now then
  local f = last
  redis.call('set', KEYS[2], '0"""
    + _SEP
    + """' .. string.format('%d', last) .. '"""
    + _SEP
    + """', 'PX', """
    + _lock_px("f", "0")
    + """)
end
local fv = tonumber(redis.call('get', KEYS[3]) or '0')
if ARGV[3] == '1' and fv > 0 and fv <= now then out[3] = redis.call('del', KEYS[3]) end
if last > fv then
  local ls = string.format('%d', last)
"""
    + _keep("KEYS[3]", "ls")
    + """
end
return out
"""
)


def import_redis() -> Any:
    """The ``redis`` module, or an ImportError that says what to install."""
    try:
        import redis  # noqa: PLC0415 - optional dependency, imported on first use
    except ImportError as exc:  # pragma: no cover - the test environment has redis
        raise ImportError(INSTALL_HINT) from exc
    return redis


def make_client(client: Any, url: str | None, what: str) -> redis.Redis:
    """The given client, or one made from ``url``; exactly one of the two must be given."""
    redis_mod = import_redis()
    if client is not None and url is not None:
        raise TypeError(f"{what}: pass client= or url=, not both")
    if client is not None:
        if not callable(getattr(client, "register_script", None)):
            raise TypeError(
                f"{what}: client must be a redis-py client (redis.Redis, a Sentinel master, "
                f"redis.cluster.RedisCluster), not {type(client).__name__}"
            )
        return client  # type: ignore[no-any-return]
    if url is None:
        raise TypeError(f"{what}: pass client= (a redis-py client) or url= (redis://...)")
    if not isinstance(url, str):
        raise TypeError(f"{what}: url must be a str, not {type(url).__name__} ({url!r})")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"{what}: url must start with redis://, rediss:// or unix://, got {redact(url)!r}"
        )
    return redis_mod.Redis.from_url(url, **CLIENT_DEFAULTS)  # type: ignore[no-any-return]


def same_server(a: Any, b: Any) -> bool:
    """Whether two redis-py clients talk to the same server (or deployment) and database."""
    return why_not_same_server(a, b) is None


def _cluster_nodes(client: Any) -> set[str]:
    try:
        return {str(node.name) for node in client.get_nodes()}
    except Exception:  # a client that cannot list its nodes
        return set()


def _sentinels(pool: Any) -> set[tuple[Any, Any]]:
    manager = getattr(pool, "sentinel_manager", None)
    found = set()
    for sentinel in getattr(manager, "sentinels", None) or ():
        kwargs = getattr(getattr(sentinel, "connection_pool", None), "connection_kwargs", {})
        found.add((kwargs.get("host"), kwargs.get("port")))
    return found


def why_not_same_server(a: Any, b: Any) -> str | None:
    """``None`` when two redis-py clients reach the same data (the same client, pool, server
    and database; two ``RedisCluster`` clients that know a node in common; two Sentinel
    masters of one service watched by a Sentinel in common, same database), else why not.
    """
    if a is b:
        return None
    cluster_a = getattr(a, "nodes_manager", None) is not None
    cluster_b = getattr(b, "nodes_manager", None) is not None
    if cluster_a or cluster_b:
        if not (cluster_a and cluster_b):
            return "one client is a RedisCluster client and the other is not"
        nodes_a, nodes_b = _cluster_nodes(a), _cluster_nodes(b)
        if nodes_a & nodes_b:
            return None
        return (
            f"the two RedisCluster clients know no node in common ({sorted(nodes_a)[:3]} and "
            f"{sorted(nodes_b)[:3]}): pass one client to both, or clients of one cluster"
        )
    pool_a = getattr(a, "connection_pool", None)
    pool_b = getattr(b, "connection_pool", None)
    if pool_a is None or pool_b is None:
        return "a client has no connection pool to compare"
    if pool_a is pool_b:
        return None
    kw_a = getattr(pool_a, "connection_kwargs", {}) or {}
    kw_b = getattr(pool_b, "connection_kwargs", {}) or {}
    # A Sentinel pool names no host or port: its service and its Sentinels decide.
    service_a = getattr(pool_a, "service_name", None)
    service_b = getattr(pool_b, "service_name", None)
    if service_a or service_b:
        if service_a != service_b:
            return f"Sentinel services differ ({service_a!r} and {service_b!r})"
        if kw_a.get("db") != kw_b.get("db"):
            return f"databases differ ({kw_a.get('db')} and {kw_b.get('db')})"
        if getattr(pool_a, "sentinel_manager", None) is getattr(pool_b, "sentinel_manager", None):
            return None
        if _sentinels(pool_a) & _sentinels(pool_b):
            return None
        return f"the two Sentinel clients of {service_a!r} share no Sentinel"
    keys = ("host", "port", "db", "path", "username")
    differ = [k for k in keys if kw_a.get(k) != kw_b.get(k)]
    if differ:
        shown = ", ".join(f"{k} {kw_a.get(k)!r} and {kw_b.get(k)!r}" for k in differ)
        return f"the clients point at different servers or databases ({shown})"
    if type(a) is not type(b):
        return f"the clients are of different types ({type(a).__name__}, {type(b).__name__})"
    return None


def decodes_responses(client: Any) -> bool:
    """Whether the client turns replies into ``str`` (``decode_responses=True``)."""
    get_encoder = getattr(client, "get_encoder", None)
    if get_encoder is None:
        return False
    return bool(getattr(get_encoder(), "decode_responses", False))


def default_owner_id() -> str:
    """``host:pid:random``: who holds a lock, as shown by ``celery idempotency inspect``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def new_token(owner_id: str) -> str:
    """A token unique to one acquisition, naming its owner."""
    return f"{secrets.token_hex(12)}@{owner_id}"


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds for PX, never 0 (PX 0 is an error)."""
    return max(1, round(seconds * 1000))


_ERROR_CLASSES: tuple[tuple[type[BaseException], ...], type[BaseException]] | None = None

#: Error replies that mean "this server cannot take the write now, try again": a master without
#: enough replicas (``min-replicas-to-write``), a replica (a demoted master), a cluster or a
#: replica link that is down, a server loading its data. Nothing was written: they are
#: reported as :class:`IdempotencyConnectionError`, like an unreachable server, so that a
#: delivery that had not started its body is re-queued instead of failing.
TRANSIENT_REPLIES = ("NOREPLICAS", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "LOADING")


def _error_classes() -> tuple[tuple[type[BaseException], ...], type[BaseException]]:
    """(connection-level errors, any other redis-py error), looked up once."""
    global _ERROR_CLASSES  # noqa: PLW0603 - a cache filled on first use
    if _ERROR_CLASSES is None:
        exceptions = import_redis().exceptions
        _ERROR_CLASSES = (
            (
                exceptions.ConnectionError,
                exceptions.TimeoutError,
                exceptions.AuthenticationError,
                exceptions.ReadOnlyError,
                exceptions.TryAgainError,
                exceptions.ClusterDownError,
                ConnectionError,
                TimeoutError,
            ),
            exceptions.RedisError,
        )
    return _ERROR_CLASSES


def is_transient_reply(exc: BaseException) -> bool:
    """Whether a redis-py error is a transient refusal (see :data:`TRANSIENT_REPLIES`); the
    code may follow a script error's own text, so the first words are searched."""
    words = str(exc)[:200].replace(":", " ").split()
    return any(word in TRANSIENT_REPLIES for word in words[:12])


class translate_errors:
    """``with translate_errors(key, op):`` turns redis-py exceptions into the library's,
    chaining the original.

    A class, not a ``@contextmanager`` generator: it wraps every Redis call, two per guarded
    call, and a generator-based context manager costs several times more to enter and exit.
    """

    __slots__ = ("key", "op")

    def __init__(self, key: str, op: str) -> None:
        self.key = key
        self.op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # Returns None: an exception is never swallowed, only replaced.
        if exc is None or isinstance(exc, IdempotencyError):
            return
        connection_errors, redis_error = _error_classes()
        if isinstance(exc, connection_errors) or (
            isinstance(exc, redis_error) and is_transient_reply(exc)
        ):
            raise IdempotencyConnectionError(self.key, f"Redis {self.op} failed: {exc}") from exc
        if isinstance(exc, redis_error):
            raise IdempotencyBackendError(self.key, f"Redis {self.op} failed: {exc}") from exc


def glob_escape(text: str) -> str:
    """``text`` as a literal in a SCAN MATCH pattern."""
    out = []
    for ch in text:
        if ch in "*?[]\\":
            out.append("\\")
        out.append(ch)
    return "".join(out)


class SentinelClientFactory:
    """Makes a ``Sentinel(...).master_for(master_name)`` client, the way kombu's Redis
    transport does for a ``sentinel://`` broker: every ``sentinel://host:port`` of the URL is a
    Sentinel; the database, user and password of the first apply to the master;
    ``sentinel_kwargs`` (e.g. the Sentinels' own password) and ``min_other_sentinels`` come from
    the transport options. Called once per worker process, like any ``idempotency_client``.
    """

    def __init__(
        self,
        sentinels: list[tuple[str, int]],
        master_name: str,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        sentinel_kwargs: dict[str, Any] | None = None,
        min_other_sentinels: int = 0,
    ) -> None:
        self.sentinels = sentinels
        self.master_name = master_name
        self.db = db
        self.username = username
        self.password = password
        self.sentinel_kwargs = dict(sentinel_kwargs or {})
        self.min_other_sentinels = min_other_sentinels

    def __call__(self) -> Any:
        sentinel = import_redis().sentinel.Sentinel(
            self.sentinels,
            min_other_sentinels=self.min_other_sentinels,
            sentinel_kwargs=self.sentinel_kwargs or None,
            socket_timeout=CLIENT_DEFAULTS["socket_timeout"],
            socket_connect_timeout=CLIENT_DEFAULTS["socket_connect_timeout"],
        )
        return sentinel.master_for(
            self.master_name,
            db=self.db,
            username=self.username,
            password=self.password,
            **CLIENT_DEFAULTS,
        )

    @property
    def label(self) -> str:
        """Where it points, without passwords."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"sentinel://{hosts} master {self.master_name!r} db {self.db}"

    def __repr__(self) -> str:
        return f"SentinelClientFactory({self.label})"


def sentinel_factory_from_broker(
    broker_url: str, transport_options: dict[str, Any] | None
) -> SentinelClientFactory:
    """A :class:`SentinelClientFactory` for a kombu ``sentinel://`` broker URL (``;``-separated
    Sentinels) and its ``broker_transport_options``; ValueError naming what is missing."""
    from urllib.parse import unquote, urlsplit  # noqa: PLC0415 - only for Sentinel brokers

    options = transport_options or {}
    master_name = options.get("master_name")
    if not master_name or not isinstance(master_name, str):
        raise ValueError(
            "broker_url is a sentinel:// URL but broker_transport_options has no 'master_name' "
            "(kombu needs it too): set broker_transport_options = {'master_name': 'mymaster'}, "
            "or set idempotency_client"
        )
    sentinels: list[tuple[str, int]] = []
    first = None
    for part in (p.strip() for p in broker_url.split(";")):
        if not part:
            continue
        parts = urlsplit(part)
        if parts.scheme != "sentinel":
            raise ValueError(
                f"broker_url mixes sentinel:// with {parts.scheme}:// URLs ({redact(part)!r})"
            )
        first = first or parts
        sentinels.append((parts.hostname or "127.0.0.1", parts.port or 26379))
    if first is None:
        raise ValueError(f"broker_url names no Sentinel: {redact(broker_url)!r}")
    path = (first.path or "/").strip("/")
    try:
        db = int(path) if path else 0
    except ValueError:
        raise ValueError(f"broker_url: database {path!r} is not a number") from None
    return SentinelClientFactory(
        sentinels,
        master_name,
        db=db,
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
        sentinel_kwargs=options.get("sentinel_kwargs"),
        min_other_sentinels=int(options.get("min_other_sentinels") or 0),
    )
