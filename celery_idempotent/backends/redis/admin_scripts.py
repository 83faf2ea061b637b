"""The Lua scripts of the admin layer (``celery_idempotent.admin``, the command line): one
consistent read of a key, and its forgetting, deciding as a running guard would.

Each script is one literal, its contract above it, its shared pieces between
``--[[ shared: ... ]]`` markers: the conventions (one ``KEYS`` order, the shared pieces and
what they read and set) are in ``backends.redis.scripts``' docstring.
"""

from __future__ import annotations

__all__ = ["DROP_FENCE", "FORGET", "READ_KEY"]

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence   ARGV[1] "1": the whole payload, else its head
# One consistent view of a key for the admin command (absent values are nil):
# -> {record type, record (string, or v1 fields), record size, record pttl, lock's lease token,
#     lease ms left, fence, fence pttl}
# A lock whose lease has ended (a tombstone) reads as no lock; 0.1.0's lock (no deadline) as
# its whole value with its key's pttl.
READ_KEY = """
local kind = redis.call('type', KEYS[2])['ok']
local rec, size = false, 0
if kind == 'string' then
  size = redis.call('strlen', KEYS[2])
  if ARGV[1] == '1' then rec = redis.call('get', KEYS[2])
  else rec = redis.call('getrange', KEYS[2], 0, 1023) end
elseif kind == 'hash' then
  rec = redis.call('hmget', KEYS[2], 'v', 'ct', 'enc', 'data', 'fp', 'at', 'fence')
  size = redis.call('hstrlen', KEYS[2], 'data')
  if ARGV[1] ~= '1' then rec[4] = '' end
end
local held, lt = redis.call('get', KEYS[1]), redis.call('pttl', KEYS[1])
if held then
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
  if not valid then held, lt = false, -2
  elseif d then held, lt = string.sub(held, a + 1), d - ms end
end
return {kind, rec, size, redis.call('pttl', KEYS[2]), held, lt,
        redis.call('get', KEYS[3]), redis.call('pttl', KEYS[3])}
"""

# KEYS[1] fence   -> 1 deleted, 0 kept (absent, or the server clock is not past its token)
DROP_FENCE = """
local now, ms = 0, 0
--[[ shared: server clock ]]
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
--[[ end: server clock ]]
local f = tonumber(redis.call('get', KEYS[1]) or '0')
if f > 0 and f < now then return redis.call('del', KEYS[1]) end
return 0
"""

# KEYS[1] lock  KEYS[2] record  KEYS[3] fence   ARGV[1] the lock's lease token as read ('' for
# none)  ARGV[2] "1": also a held lock  ARGV[3] "1": also the fence key
# Forget a key (the admin command): the record; the lock only if it still holds the lease that
# was shown; the fence key only once the server clock has passed it. The highest fencing token
# the record or the lock carried stays in the lock as a tombstone (until the clock has passed
# it by the margin; a lock held by someone else is left alone), and in the fence key while it
# is ahead of the clock.
# -> {record deleted, lock deleted, fence deleted}
FORGET = """
local fk = KEYS[3]
local now, ms = 0, 0
--[[ shared: server clock ]]
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
--[[ end: server clock ]]
local out = {0, 0, 0}
local last = 0
local rec = redis.pcall('get', KEYS[2])
if type(rec) == 'string' and string.sub(rec, 1, 2) == '2|' then
  local e = string.find(rec, '|', 3, true)
  last = tonumber(string.sub(rec, 3, e - 1)) or 0
end
out[1] = redis.call('del', KEYS[2])
local held = redis.call('get', KEYS[1])
if ARGV[2] == '1' and ARGV[1] ~= '' and held then
  --[[ shared: lock value ]]
  local a = string.find(held, '/', 1, true)
  local b = a and string.find(held, '/', a + 1, true)
  local d = b and tonumber(string.sub(held, 1, a - 1))
  local valid = not d or d * 1000 > now
  --[[ end: lock value ]]
  if held == ARGV[1] or (d and string.sub(held, a + 1) == ARGV[1]) then
    local cut = string.find(ARGV[1], '/', 1, true)
    if cut then last = math.max(last, tonumber(string.sub(ARGV[1], 1, cut - 1)) or 0) end
    out[2] = redis.call('del', KEYS[1])
    held = false
  end
end
if last > 0 and not held and last + 60000 * 1000 > now then
  local f = last
  redis.call('set', KEYS[1], '0/' .. string.format('%d', last) .. '/', 'PX',
    math.max(0, math.floor(f / 1000) - ms) + 60000)
end
local fv = tonumber(redis.call('get', fk) or '0')
if ARGV[3] == '1' and fv > 0 and fv <= now then out[3] = redis.call('del', fk) end
if last > fv then
  local fs = string.format('%d', last)
  --[[ shared: keep fence ]]
  if tonumber(fs) >= now then
    redis.call('set', fk, fs)
    redis.call('pexpireat', fk, string.format('%d', math.floor(tonumber(fs) / 1000) + 1))
  end
  --[[ end: keep fence ]]
end
return out
"""
