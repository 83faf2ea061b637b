"""The Lua scripts of a key's lease and record: claim, commit, and the lock provider's own.

Every decision is one Lua script, registered once per client and called by SHA (redis-py's
``Script`` falls back to loading it once when the server does not know it yet). The scripts
are written so that a call retried by the client after a lost reply (redis-py retries on
connection errors) decides the same as the first: a claim by the token that already holds the
lock succeeds again, and a commit that already happened reports success.

Each script is one literal, whole, pasteable into ``redis-cli --eval``, its contract (``KEYS``,
``ARGV``, what it returns) in the comment above it. The names and formats they read and write
are ``celery_idempotent.backends.redis.keyspace``'s (the lock's value, the fence key, the
fencing bound; its docstring says why fencing tokens increase) and ``layout``'s (the record and
the queued marker). The publish side's scripts are in ``publish_scripts``, the admin's in
``admin_scripts``.

The conventions every script of the three modules keeps:

- **One KEYS order**: the lock, the record, the fence key, then anything else (the broker's
  queue); a script that needs fewer keys takes them in the same relative order.
- **One spelling per shared piece.** Lua in Redis has no ``require``, and assembling the
  scripts from fragments at import hid their contracts (issue 28), so each script carries
  the pieces it shares with others in full, between ``--[[ shared: <name> ]]`` and
  ``--[[ end: <name> ]]``: the server clock, the lock value's parsing, the lock's taking, the
  tombstone, the fence key's keeping, the queued marker's parsing. ``tests/unit/
  test_redis_scripts.py`` asserts that every copy of a piece is the same text (indentation
  aside), that the server clock is read nowhere else, and that the separators and heads the
  text spells are :data:`~.keyspace.LOCK_SEP`, :data:`~.layout.RECORD_SEP` and the heads
  built from it: each is spelled once in effect, and a copy cannot drift.
- Reply codes of the scripts that return a table are the :class:`enum.IntEnum` s next to them
  (:class:`ClaimReply`, ``publish_scripts.PublishReply``); the same test checks that each
  enum covers exactly the codes its script returns.

Lua numbers are doubles: a fencing token in µs since 1970 (about 1.8e15) is exact below 2**53.

The shared pieces (variables they read and set):

``server clock``
    Sets ``now`` (µs) and ``ms`` (ms, rounded down) to the server's ``TIME``; the script
    declares them. ``TIME`` makes a script non-deterministic, which effects replication
    (Redis's default since 5.0) handles: the writes are replicated, not the script.
``lock value``
    Reads ``held``, a lock's value, a string: ``<deadline ms>/<fencing token>/<token>``
    (``keyspace.lock_entry``), or 0.1.0's ``<random>@<owner id>`` (no deadline: held while its
    key exists; a value without two separators is read as that, held by someone else). Sets
    ``a`` and ``b`` (where the separators are), ``d`` (the deadline, a number; ``nil`` for
    0.1.0's) and ``valid`` (whether the lease is valid at ``now``: before its deadline; a
    tombstone is not). The lease's token is then ``string.sub(held, a + 1)``, its fencing
    token ``string.sub(held, a + 1, b - 1)``, its random token ``string.sub(held, b + 1)``.
``take lock``
    Hands out the next fencing token for the lock ``KEYS[1]`` (floored by ``now``, the fence
    key's value ``fv`` and a tombstone's token ``last``), and takes the lock for the token
    ``ARGV[1]`` with a lease of ``ARGV[2]`` ms; keeps the token in the fence key ``fk`` when it
    is ahead of the clock. Sets ``fs`` (the token, a string). The deadline is concatenated as
    a Lua number ("%.14g": exact for ms until the year 5138); the token, 16 digits, needs
    ``string.format``. (The common case, a token floored by the clock alone, skips the
    arithmetic: server time per call is what the claim is measured by.)
``tombstone``
    Turns the lock ``KEYS[1]`` of the lease token ``ARGV[1]`` and the fencing token ``f`` (a
    number) into a tombstone: the lease ends now, for good (its deadline is 0: a server clock
    that steps back does not revive it), and the token stays.
``keep fence``
    Keeps the fencing token ``fs`` (a string) in the fence key ``fk`` while the server clock is
    not past it: the key expires when the clock passes the token. The lock's tombstone keeps
    the token longer (until the clock has passed it by the margin); the fence key also floors
    tokens if the lock is deleted by hand while the clock is behind.
``queued marker``
    Parses the queued marker ``rec`` (``q|<task id>|<fingerprint>[|<published ms>|<state>]``,
    see ``layout``): sets ``tid``, ``fp``, ``st`` (the state, ``'q'`` for a marker from before
    the states) and ``mbase`` (the marker without its state, for rewriting it); ``tid`` is
    false when ``rec`` is not a well-formed marker.

A lock's key lives until the later of its deadline and the clock reaching its token, plus
:data:`~.keyspace.FENCE_MARGIN_MS` (the ``60000`` in the scripts' ``PX``), so a token is never
forgotten before the clock has passed it by the margin.
"""

from __future__ import annotations

import enum

__all__ = [
    "ACQUIRE",
    "CLAIM",
    "COMMIT",
    "END",
    "EXTEND",
    "HOLDER",
    "RELEASE",
    "ClaimReply",
]


class ClaimReply(enum.IntEnum):
    """The first element of ``CLAIM``'s reply."""

    #: The lock is held by another holder (the record is not looked at).
    HELD = 0
    #: The lock was free and there is no record: the lock is now ours (``{1, fencing token}``).
    TAKEN = 1
    #: The lock was free and a v2 record exists: not taken (``{2, record}``).
    RECORD = 2
    #: The lock was free and a v1 record (a hash) exists: not taken (``{3, v1 fields...}``).
    V1_RECORD = 3
    #: The lock was free and the record's name holds another string (``{4, value}``).
    FOREIGN = 4


# KEYS[1] lock  KEYS[2] fence   ARGV[1] token  ARGV[2] lease ms
# -> fencing token (a string) when taken (or already held by this very token), 0 when held
ACQUIRE = """
local got = redis.call('mget', KEYS[1], KEYS[2])
local held, fv = got[1], got[2]
local fk = KEYS[2]
local now, ms, last = 0, 0, 0
--[[ shared: server clock ]]
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
--[[ end: server clock ]]
if held then
  --[[ shared: lock value ]]
  local a = string.find(held, '/', 1, true)
  local b = a and string.find(held, '/', a + 1, true)
  local d = b and tonumber(string.sub(held, 1, a - 1))
  local valid = not d or d * 1000 > now
  --[[ end: lock value ]]
  if valid then
    if d and string.sub(held, b + 1) == ARGV[1] then return string.sub(held, a + 1, b - 1) end
    return 0
  end
  last = tonumber(string.sub(held, a + 1, b - 1)) or 0
end
--[[ shared: take lock ]]
local f = now
if fv then f = math.max(f, tonumber(fv) + 1) end
if last >= f then f = last + 1 end
local fs = string.format('%d', f)
local px = ARGV[2] + 60000
if f > now then px = math.max(tonumber(ARGV[2]), math.floor(f / 1000) - ms) + 60000 end
redis.call('set', KEYS[1], (ms + ARGV[2]) .. '/' .. fs .. '/' .. ARGV[1], 'PX', px)
if f > now then
  redis.call('set', fk, fs)
  redis.call('pexpireat', fk, string.format('%d', math.floor(f / 1000) + 1))
end
--[[ end: take lock ]]
return fs
"""

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence   ARGV[1] token  ARGV[2] lease ms
# ARGV[3] (optional) a task id: when the lock is taken over that call's own queued marker, the
# marker is deleted in the same step (idempotency_publish_until="started": the call has
# started, a publish may queue one more)
# Lock first, then the store, in one step (one MGET reads the lock, a v2 record and the fence);
# the reply's first element is a ClaimReply:
# -> {0}                  HELD: the lock is held by another holder (the record is not looked at)
# -> {1, fencing token}   TAKEN: the lock was free and there is no record: the lock is now ours
#                         (or was already this very token's)
# -> {2, record}          RECORD: the lock was free and a v2 record exists: not taken
# -> {3, v1 fields...}    V1_RECORD: the lock was free and a v1 record (a hash) exists: not
#                         taken (a hash without a v1 version field is taken over, as 0.1.0 did)
# -> {4, value}           FOREIGN: the lock was free and the record name holds another string
# A queued marker (a call published but not run yet) is not a record: the lock is taken over
# it, and the marker stays until the commit replaces it, in state 'c' (claimed, its TTL kept):
# from then on it lives only while a valid lease holds the lock (SPEC §8, layout.py).
# A key of another type (a list, ...) under the record name fails with WRONGTYPE.
# The server clock is read only when there is a lock to judge or one to take.
CLAIM = """
local got = redis.call('mget', KEYS[1], KEYS[2], KEYS[3])
local held, rec, fv = got[1], got[2], got[3]
local fk = KEYS[3]
local now, ms, last = false, 0, 0
if held then
  --[[ shared: server clock ]]
  local t = redis.call('time')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  ms = math.floor(now / 1000)
  --[[ end: server clock ]]
  --[[ shared: lock value ]]
  local a = string.find(held, '/', 1, true)
  local b = a and string.find(held, '/', a + 1, true)
  local d = b and tonumber(string.sub(held, 1, a - 1))
  local valid = not d or d * 1000 > now
  --[[ end: lock value ]]
  if valid then
    if d and string.sub(held, b + 1) == ARGV[1] then
      return {1, string.sub(held, a + 1, b - 1)}
    end
    return {0}
  end
  last = tonumber(string.sub(held, a + 1, b - 1)) or 0
end
if rec then
  if string.sub(rec, 1, 2) == '2|' then return {2, rec} end
  if string.sub(rec, 1, 2) ~= 'q|' then return {4, rec} end
elseif redis.call('exists', KEYS[2]) == 1 then
  local v1 = redis.call('hmget', KEYS[2], 'v', 'ct', 'enc', 'data', 'fp', 'at', 'fence')
  if v1[1] then return {3, unpack(v1)} end
end
if not now then
  --[[ shared: server clock ]]
  local t = redis.call('time')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  ms = math.floor(now / 1000)
  --[[ end: server clock ]]
end
--[[ shared: take lock ]]
local f = now
if fv then f = math.max(f, tonumber(fv) + 1) end
if last >= f then f = last + 1 end
local fs = string.format('%d', f)
local px = ARGV[2] + 60000
if f > now then px = math.max(tonumber(ARGV[2]), math.floor(f / 1000) - ms) + 60000 end
redis.call('set', KEYS[1], (ms + ARGV[2]) .. '/' .. fs .. '/' .. ARGV[1], 'PX', px)
if f > now then
  redis.call('set', fk, fs)
  redis.call('pexpireat', fk, string.format('%d', math.floor(f / 1000) + 1))
end
--[[ end: take lock ]]
if rec then
  --[[ shared: queued marker ]]
  local tid, fp, st, mbase = false, '', 'q', false
  local cut = string.find(rec, '|', 3, true)
  if cut then
    tid = string.sub(rec, 3, cut - 1)
    local rest = string.sub(rec, cut + 1)
    local c2 = string.find(rest, '|', 1, true)
    if c2 then
      fp = string.sub(rest, 1, c2 - 1)
      st = string.sub(rest, -1)
      mbase = string.sub(rec, 1, -2)
    else
      fp = rest
      mbase = rec .. '|0|'
    end
  end
  --[[ end: queued marker ]]
  if tid and ARGV[3] and ARGV[3] ~= '' and tid == ARGV[3] then
    redis.call('del', KEYS[2])
  elseif tid and st ~= 'c' then
    redis.call('set', KEYS[2], mbase .. 'c', 'KEEPTTL')
  end
end
return {1, fs}
"""

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence
# ARGV[1] the lease's token  ARGV[2] record ttl ms  ARGV[3] the record  ARGV[4] fencing token
# -> 1 committed and released; 0 not the holder (nothing written).
# A resent commit that already went through finds its own record (same fencing token): 1.
# The record carries the token from then on (and the fence key while the server clock is behind
# the token: it stepped back during the lease).
COMMIT = """
local held = redis.call('get', KEYS[1])
local fk, fs = KEYS[3], ARGV[4]
local now, ms = 0, 0
local live = false
if held then
  --[[ shared: server clock ]]
  local t = redis.call('time')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  ms = math.floor(now / 1000)
  --[[ end: server clock ]]
  --[[ shared: lock value ]]
  local a = string.find(held, '/', 1, true)
  local b = a and string.find(held, '/', a + 1, true)
  local d = b and tonumber(string.sub(held, 1, a - 1))
  local valid = not d or d * 1000 > now
  --[[ end: lock value ]]
  live = d and valid and string.sub(held, a + 1) == ARGV[1]
end
if not live then
  local rec = redis.pcall('get', KEYS[2])
  local head = '2|' .. ARGV[4] .. '|'
  if type(rec) == 'string' and string.sub(rec, 1, #head) == head then return 1 end
  return 0
end
redis.call('set', KEYS[2], ARGV[3], 'PX', ARGV[2])
redis.call('del', KEYS[1])
--[[ shared: keep fence ]]
if tonumber(fs) >= now then
  redis.call('set', fk, fs)
  redis.call('pexpireat', fk, string.format('%d', math.floor(tonumber(fs) / 1000) + 1))
end
--[[ end: keep fence ]]
return 1
"""

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence
# ARGV[1] the lease's token  ARGV[2] the delivery's task id ('' for none)  ARGV[3] fencing token
# The commit of idempotency_ttl=0: nothing is stored. While the lease is ours, the lock becomes
# a tombstone (as RELEASE leaves it: the key is free, the fencing token kept) and the queued
# marker naming ARGV[2], if the record name still holds it, is deleted (another call's marker,
# one queued while this body ran, stays).
# -> 1 ended; 0 not the holder (nothing changed).
# A resent END that already went through finds its own tombstone: 1. (Claimed by another in
# between, the lease reads as lost: the guard reports the result as not committed.)
END = """
local held = redis.call('get', KEYS[1])
local fk, fs = KEYS[3], ARGV[3]
local now, ms = 0, 0
local live = false
if held then
  --[[ shared: server clock ]]
  local t = redis.call('time')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  ms = math.floor(now / 1000)
  --[[ end: server clock ]]
  --[[ shared: lock value ]]
  local a = string.find(held, '/', 1, true)
  local b = a and string.find(held, '/', a + 1, true)
  local d = b and tonumber(string.sub(held, 1, a - 1))
  local valid = not d or d * 1000 > now
  --[[ end: lock value ]]
  live = d and valid and string.sub(held, a + 1) == ARGV[1]
end
if not live then
  if held == '0/' .. ARGV[1] then return 1 end
  return 0
end
local f = tonumber(ARGV[3])
--[[ shared: tombstone ]]
redis.call('set', KEYS[1], '0/' .. ARGV[1], 'PX', math.max(0, math.floor(f / 1000) - ms) + 60000)
--[[ end: tombstone ]]
--[[ shared: keep fence ]]
if tonumber(fs) >= now then
  redis.call('set', fk, fs)
  redis.call('pexpireat', fk, string.format('%d', math.floor(tonumber(fs) / 1000) + 1))
end
--[[ end: keep fence ]]
if ARGV[2] ~= '' then
  local mine = 'q|' .. ARGV[2] .. '|'
  local rec = redis.pcall('get', KEYS[2])
  if type(rec) == 'string' and string.sub(rec, 1, #mine) == mine then
    redis.call('del', KEYS[2])
  end
end
return 1
"""

# KEYS[1] lock  KEYS[2] fence   ARGV[1] the lease's token  ARGV[2] lease ms  ARGV[3] fencing token
# -> 1 extended, 0 not the holder or the lease has ended (nothing changed)
EXTEND = """
local held = redis.call('get', KEYS[1])
if not held then return 0 end
local fk, fs = KEYS[2], ARGV[3]
local now, ms = 0, 0
--[[ shared: server clock ]]
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
--[[ end: server clock ]]
--[[ shared: lock value ]]
local a = string.find(held, '/', 1, true)
local b = a and string.find(held, '/', a + 1, true)
local d = b and tonumber(string.sub(held, 1, a - 1))
local valid = not d or d * 1000 > now
--[[ end: lock value ]]
local live = d and valid and string.sub(held, a + 1) == ARGV[1]
if not live then return 0 end
local f = tonumber(ARGV[3])
redis.call('set', KEYS[1], string.format('%d', ms + ARGV[2]) .. '/' .. ARGV[1], 'PX',
  math.max(tonumber(ARGV[2]), math.floor(f / 1000) - ms) + 60000)
--[[ shared: keep fence ]]
if tonumber(fs) >= now then
  redis.call('set', fk, fs)
  redis.call('pexpireat', fk, string.format('%d', math.floor(tonumber(fs) / 1000) + 1))
end
--[[ end: keep fence ]]
return 1
"""

# KEYS[1] lock  KEYS[2] fence   ARGV[1] the lease's token  ARGV[2] fencing token
# ARGV[3] "1": a lease under which nothing ran (a claim given back at once): delete the lock
# -> 1 released, 0 not the holder or the lease has ended (nothing changed)
# The lock becomes a tombstone that keeps the fencing token.
RELEASE = """
local held = redis.call('get', KEYS[1])
if not held then return 0 end
local fk, fs = KEYS[2], ARGV[2]
local now, ms = 0, 0
--[[ shared: server clock ]]
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
--[[ end: server clock ]]
--[[ shared: lock value ]]
local a = string.find(held, '/', 1, true)
local b = a and string.find(held, '/', a + 1, true)
local d = b and tonumber(string.sub(held, 1, a - 1))
local valid = not d or d * 1000 > now
--[[ end: lock value ]]
local live = d and valid and string.sub(held, a + 1) == ARGV[1]
if not live then return 0 end
if ARGV[3] == '1' then
  redis.call('del', KEYS[1])
  return 1
end
local f = tonumber(ARGV[2])
--[[ shared: tombstone ]]
redis.call('set', KEYS[1], '0/' .. ARGV[1], 'PX', math.max(0, math.floor(f / 1000) - ms) + 60000)
--[[ end: tombstone ]]
--[[ shared: keep fence ]]
if tonumber(fs) >= now then
  redis.call('set', fk, fs)
  redis.call('pexpireat', fk, string.format('%d', math.floor(tonumber(fs) / 1000) + 1))
end
--[[ end: keep fence ]]
return 1
"""

# KEYS[1] lock
# -> the lease token ("<fencing token>/<token>") of the lock's valid lease, 0.1.0's whole value
#    for its lock (held while it exists), or false (free, or a tombstone)
HOLDER = """
local held = redis.call('get', KEYS[1])
if not held then return false end
local now, ms = 0, 0
--[[ shared: server clock ]]
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
--[[ end: server clock ]]
--[[ shared: lock value ]]
local a = string.find(held, '/', 1, true)
local b = a and string.find(held, '/', a + 1, true)
local d = b and tonumber(string.sub(held, 1, a - 1))
local valid = not d or d * 1000 > now
--[[ end: lock value ]]
if not valid then return false end
if d then return string.sub(held, a + 1) end
return held
"""
