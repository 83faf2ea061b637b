"""The Lua scripts of the admin layer (``celery_idempotent.admin``, the command line): one
consistent read of a key, and its forgetting, deciding as a running guard would.
"""

from __future__ import annotations

from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis.scripts import LUA_TIME, MARGIN, SEP, lua_keep, lua_lock_px

__all__ = ["DROP_FENCE", "FORGET", "READ_KEY"]

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
    + SEP
    + """', 1, true)
  local d = a and tonumber(string.sub(lv, 1, a - 1))
  local b = d and string.find(lv, '"""
    + SEP
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
    + LUA_TIME
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
    + SEP
    + """' .. ARGV[1]) then
  local cut = string.find(ARGV[1], '"""
    + SEP
    + """', 1, true)
  if cut then last = math.max(last, tonumber(string.sub(ARGV[1], 1, cut - 1)) or 0) end
  out[2] = redis.call('del', KEYS[2])
  lv = false
end
if last > 0 and not lv and last + """
    + MARGIN
    + """ * 1000 > now then
  local f = last
  redis.call('set', KEYS[2], '0"""
    + SEP
    + """' .. string.format('%d', last) .. '"""
    + SEP
    + """', 'PX', """
    + lua_lock_px("f", "0")
    + """)
end
local fv = tonumber(redis.call('get', KEYS[3]) or '0')
if ARGV[3] == '1' and fv > 0 and fv <= now then out[3] = redis.call('del', KEYS[3]) end
if last > fv then
  local ls = string.format('%d', last)
"""
    + lua_keep("KEYS[3]", "ls")
    + """
end
return out
"""
)
