"""The Lua scripts of a key's lease and record: claim, commit, and the lock provider's own.

Every decision is one Lua script, registered once per client and called by SHA (redis-py's
``Script`` falls back to loading it once when the server does not know it yet). The scripts
are written so that a call retried by the client after a lost reply (redis-py retries on
connection errors) decides the same as the first: a claim by the token that already holds the
lock succeeds again, and a commit that already happened reports success.

The names and formats they read and write (the lock with its lease's deadline, the record
string, the fence key, the tombstone a lease leaves) are those of
``celery_idempotent.backends.redis.keyspace``, whose docstring says why fencing tokens increase
and within which bound. The publish side's
scripts are in ``redis_publish_scripts``, the admin's in ``redis_admin_scripts``; the Lua
fragments they share (``LUA_TIME``, :func:`lua_keep`, :func:`lua_lock_px`) are here.
"""

from __future__ import annotations

from celery_idempotent.backends.redis import keyspace

__all__ = [
    "ACQUIRE",
    "CLAIM",
    "COMMIT",
    "END",
    "EXTEND",
    "HOLDER",
    "LUA_LEASE_VALID",
    "LUA_MARKER",
    "LUA_TIME",
    "MARGIN",
    "RELEASE",
    "SEP",
    "lua_keep",
    "lua_lock_px",
]

# The scripts of layout v2 (see backends.redis.keyspace for the names, the record format and
# why fencing tokens increase without a long-lived fence key). Lua numbers are doubles: a token
# in µs since 1970 (about 1.8e15) is exact below 2**53.
#
# A lock's value is "<deadline ms>/<fencing token>/<token>" (keyspace.lock_entry): the lease is
# valid while the server clock is before the deadline; after it, until the key expires, the value
# is a tombstone that keeps the fencing token (keyspace.FENCE_MARGIN_MS). A lock without a
# deadline (0.1.0's "<token>", or "<fencing token>/<token>" from before the tombstones) is held
# while its key exists: its first field, if any, reads as a deadline far in the future.

SEP = keyspace.LOCK_SEP
MARGIN = str(int(keyspace.FENCE_MARGIN_MS))

# Sets now (µs) and ms to the server's time. TIME makes a script non-deterministic, which effects
# replication (Redis's default since 5.0) handles: the writes are replicated, not the script.
LUA_TIME = """
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
"""


# Keeps fencing token f (a string) in fence key fk while the server clock is not past it (op
# ">="; a claim, whose lock carries the token past the clock, uses ">"): the key expires when
# the clock passes the token. (Needs now.) The lock's tombstone keeps the token longer (until
# the clock has passed it by the margin); the fence key also floors tokens if the lock is
# deleted by hand while the clock is behind.
def lua_keep(fk: str, f: str, op: str = ">=") -> str:
    return f"""
if tonumber({f}) {op} now then
  redis.call('set', {fk}, {f})
  redis.call('pexpireat', {fk}, string.format('%d', math.floor(tonumber({f}) / 1000) + 1))
end
"""


# The lock's key lives until the later of its deadline and the clock reaching its token (f, a
# number), plus the margin: so a token is never forgotten before the clock has passed it by the
# margin. px: the lease in ms (a number; 0 for a tombstone).
def lua_lock_px(f: str, px: str) -> str:
    return f"math.max({px}, math.floor({f} / 1000) - ms) + {MARGIN}"


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
""".replace("{sep}", SEP)
        .replace("{ours}", ours)
        .replace("{theirs}", theirs)
    )


# Hands out the next fencing token for lock KEYS[1] (floored by the server clock, fence key
# value fv and a tombstone's token last) and takes the lock for token ARGV[1] with a lease of
# ARGV[2] ms. Sets fs (the token, a string). (Needs now, ms, fv, last.) The deadline is
# concatenated as a Lua number ("%.14g": exact for ms until the year 5138); the token, 16
# digits, needs string.format. (The common case, a token floored by the clock alone, skips the
# arithmetic: server time per call is what this script is measured by.)
def _take(fk: str) -> str:
    return (
        """
local f = now
if fv then f = math.max(f, tonumber(fv) + 1) end
if last >= f then f = last + 1 end
local fs = string.format('%d', f)
local px = ARGV[2] + {margin}
if f > now then px = {px} end
redis.call('set', KEYS[1], (ms + ARGV[2]) .. '{sep}' .. fs .. '{sep}' .. ARGV[1], 'PX', px)
if f > now then
  redis.call('set', {fk}, fs)
  redis.call('pexpireat', {fk}, string.format('%d', math.floor(f / 1000) + 1))
end
""".replace("{sep}", SEP)
        .replace("{px}", lua_lock_px("f", "tonumber(ARGV[2])"))
        .replace("{margin}", MARGIN)
        .replace("{fk}", fk)
    )


# Sets live: whether lock value v (a string or false) is the valid lease of lease token ARGV[1]
# ("<deadline>/<ARGV[1]>" before its deadline, or exactly ARGV[1]: a lock from before the
# deadlines). A plain find, not substrings: no copy of the token. (Needs now.)
_LIVE = """
local live = false
if v then
  if v == ARGV[1] then
    live = true
  else
    local p = string.find(v, ARGV[1], 2, true)
    if p and p + #ARGV[1] == #v + 1 and string.byte(v, p - 1) == {sepb} then
      live = (tonumber(string.sub(v, 1, p - 2)) or 0) * 1000 > now
    end
  end
end
""".replace("{sepb}", str(ord(SEP)))

# Turns lock KEYS[1] of lease token ARGV[1] and fencing token f (a number) into a tombstone: the
# lease ends now, for good (its deadline is 0: a server clock that steps back does not revive
# it), and the token stays. (Needs now, ms.)
_TOMBSTONE = """
redis.call('set', KEYS[1], '0{sep}' .. ARGV[1], 'PX', {px})
""".replace("{sep}", SEP).replace("{px}", lua_lock_px("f", "0"))

# Parses queued marker rec ("q|<task id>|<fingerprint>[|<published ms>|<state>]", see
# celery_idempotent.backends.redis.layout): sets tid, fp, st (the state, 'q' for a marker from
# before the states) and mbase (the marker without its state, for rewriting it); tid is false
# when rec is not a well-formed marker.
LUA_MARKER = """
local tid, fp, st, mbase = false, '', 'q', false
local cut = string.find(rec, '{sep}', 3, true)
if cut then
  tid = string.sub(rec, 3, cut - 1)
  local rest = string.sub(rec, cut + 1)
  local c2 = string.find(rest, '{sep}', 1, true)
  if c2 then
    fp = string.sub(rest, 1, c2 - 1)
    st = string.sub(rest, -1)
    mbase = string.sub(rec, 1, -2)
  else
    fp = rest
    mbase = rec .. '{sep}0{sep}'
  end
end
""".replace("{sep}", keyspace.SEP)

# Sets valid: whether lock value `held` (a string or false) is a valid lease now: a lock
# without a deadline (0.1.0's) is held while its key exists; a tombstone is not valid.
LUA_LEASE_VALID = """
local valid = false
if held then
  local a = string.find(held, '{sep}', 1, true)
  local d = a and tonumber(string.sub(held, 1, a - 1))
  if not d then
    valid = true
  else
    local t = redis.call('time')
    valid = d * 1000 > tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
end
""".replace("{sep}", SEP)

# KEYS[1] lock  KEYS[2] fence   ARGV[1] token  ARGV[2] lease ms
# -> fencing token (a string) when taken (or already held by this very token), 0 when held
ACQUIRE = (
    """
local got = redis.call('mget', KEYS[1], KEYS[2])
local held, fv = got[1], got[2]
local now, ms, last = 0, 0, 0
"""
    + LUA_TIME
    + "if held then\n"
    + _held("mine", "0")
    + "end\n"
    + _take("KEYS[2]")
    + """
return fs
"""
)

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence   ARGV[1] token  ARGV[2] lease ms
# ARGV[3] (optional) a task id: when the lock is taken over that call's own queued marker, the
# marker is deleted in the same step (idempotency_publish_until="started": the call has
# started, a publish may queue one more)
# Lock first, then the store, in one step (one MGET reads the lock, a v2 record and the fence):
# -> {0}                  the lock is held by another holder (the record is not looked at)
# -> {1, fencing token}   the lock was free and there is no record: the lock is now ours
# -> {2, record}          the lock was free and a v2 record exists: not taken
# -> {3, v1 fields...}    the lock was free and a v1 record (a hash) exists: not taken
#                         (a hash without a v1 version field is taken over, as 0.1.0 did)
# -> {4, value}           the lock was free and the record name holds another string
# A queued marker (a call published but not run yet) is not a record: the lock is taken over
# it, and the marker stays until the commit replaces it, in state 'c' (claimed, its TTL kept):
# from then on it lives only while a valid lease holds the lock (SPEC §8, layout.py).
# A key of another type (a list, ...) under the record name fails with WRONGTYPE.
# The server clock is read only when there is a lock to judge or one to take.
CLAIM = (
    """
local got = redis.call('mget', KEYS[1], KEYS[2], KEYS[3])
local held, rec, fv = got[1], got[2], got[3]
local now, ms, last = false, 0, 0
if held then
"""
    + LUA_TIME
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
    + LUA_TIME
    + "end\n"
    + _take("KEYS[3]")
    + """
if rec then
"""
    + LUA_MARKER
    + """
  if tid and ARGV[3] and ARGV[3] ~= '' and tid == ARGV[3] then
    redis.call('del', KEYS[2])
  elseif tid and st ~= '"""
    + keyspace.MARKER_CLAIMED
    + """' then
    redis.call('set', KEYS[2], mbase .. '"""
    + keyspace.MARKER_CLAIMED
    + """', 'KEEPTTL')
  end
end
return {1, fs}
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
    + LUA_TIME
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
    + lua_keep("KEYS[3]", "ARGV[4]")
    + """
return 1
"""
)

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence
# ARGV[1] the lease's token  ARGV[2] the delivery's task id ('' for none)  ARGV[3] fencing token
# The commit of idempotency_ttl=0: nothing is stored. While the lease is ours, the lock becomes
# a tombstone (as RELEASE leaves it: the key is free, the fencing token kept) and the queued
# marker naming ARGV[2], if the record name still holds it, is deleted (another call's marker,
# one queued while this body ran, stays).
# -> 1 ended; 0 not the holder (nothing changed).
# A resent END that already went through finds its own tombstone: 1. (Claimed by another in
# between, the lease reads as lost: the guard reports the result as not committed.)
END = (
    """
local v = redis.call('get', KEYS[1])
local now, ms = 0, 0
if v then
"""
    + LUA_TIME
    + "end\n"
    + _LIVE
    + """
if not live then
  if v == '0"""
    + SEP
    + """' .. ARGV[1] then return 1 end
  return 0
end
local f = tonumber(ARGV[3])
"""
    + _TOMBSTONE
    + lua_keep("KEYS[3]", "ARGV[3]")
    + """
if ARGV[2] ~= '' then
  local mine = '"""
    + keyspace.QUEUED_HEAD
    + """' .. ARGV[2] .. '"""
    + keyspace.SEP
    + """'
  local rec = redis.pcall('get', KEYS[2])
  if type(rec) == 'string' and string.sub(rec, 1, #mine) == mine then
    redis.call('del', KEYS[2])
  end
end
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
    + LUA_TIME
    + _LIVE
    + """
if not live then return 0 end
local f = tonumber(ARGV[3])
redis.call('set', KEYS[1], string.format('%d', ms + ARGV[2]) .. '"""
    + SEP
    + """' .. ARGV[1], 'PX', """
    + lua_lock_px("f", "tonumber(ARGV[2])")
    + """)
"""
    + lua_keep("KEYS[2]", "ARGV[3]")
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
    + LUA_TIME
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
    + lua_keep("KEYS[2]", "ARGV[2]")
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
    + SEP
    + """', 1, true)
local d = a and tonumber(string.sub(v, 1, a - 1))
if not d then return v end
local t = redis.call('time')
if d * 1000 <= tonumber(t[1]) * 1000000 + tonumber(t[2]) then return false end
local b = string.find(v, '"""
    + SEP
    + """', a + 1, true)
if b and tonumber(string.sub(v, a + 1, b - 1)) then return string.sub(v, a + 1) end
return v
"""
)
