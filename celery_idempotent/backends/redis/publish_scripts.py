"""The Lua scripts of the publish side: ``apply_async``'s decision, with or without the
broker's push in the same step, and the queued marker's removal (see
``backends.redis.layout`` for the marker, ``celery_idempotent.celery.publish`` for their use).

Each script is one literal, its contract above it, its shared pieces between
``--[[ shared: ... ]]`` markers: the conventions (one ``KEYS`` order, the shared pieces and
what they read and set) are in ``backends.redis.scripts``' docstring.
"""

from __future__ import annotations

import enum

__all__ = [
    "DROP_QUEUED",
    "PUBLISH",
    "PUBLISH_AND_PUSH",
    "REQUEUE_MARKER",
    "PublishReply",
]


class PublishReply(enum.IntEnum):
    """The first element of ``PUBLISH``'s (and ``PUBLISH_AND_PUSH``'s) reply."""

    #: Publish: the marker for the task id is set (or was already its own): ``{1}``.
    PUBLISH = 1
    #: Completed (a v2 record): publish nothing. ``{2, record, record's pttl}``.
    COMPLETED = 2
    #: Completed (a v1 record): publish nothing. ``{3, v1 fields...}``.
    COMPLETED_V1 = 3
    #: Queued or running under another fingerprint: a mismatch. ``{5, task id, fingerprint}``.
    MISMATCH = 5
    #: Queued (running 0) or running (1) as the marker's task id: publish nothing.
    #: ``{6, task id, running, marker's pttl}``.
    QUEUED = 6
    #: Running without a marker, or a foreign value: publish as without the check (the
    #: run-time guard decides). ``{7}``.
    UNCHECKED = 7


# KEYS[1] lock  KEYS[2] record   ARGV[1] task id  ARGV[2] fingerprint ('' for none)
# ARGV[3] publish ttl ms  ARGV[4] "started" (idempotency_publish_until="started"), else ''
# The publish-side decision of apply_async, in one step; the reply's first element is a
# PublishReply:
# -> {1}                  PUBLISH: the marker for ARGV[1] is set (or was already ARGV[1]'s own)
# -> {2, record, pttl}    COMPLETED (v2 record): publish nothing (pttl: the record's ms left)
# -> {3, v1 fields...}    COMPLETED_V1 (v1 record): publish nothing
# -> {5, task id, fp}     MISMATCH: queued or running under another fingerprint
# -> {6, task id, running, pttl}  QUEUED: queued (running 0) or running (1) as the marker's
#                         task id, pttl the marker's ms left: publish nothing
# -> {7}                  UNCHECKED: running without a marker, or a foreign value: publish as
#                         without the check (the run-time guard decides)
# A lock whose lease has ended (a tombstone) is not running. With ARGV[4] "started" a call
# stops a publish only while it is queued: the claim of its delivery ended its marker (CLAIM's
# ARGV[3]), so a marker is a call that has not started; a running call without one gets a
# marker for this call (one running, one queued), and a record ({2}, {3}) is published past
# as {7} (the worker replays it while it lives). A marker a delivery claimed (state 'c') lives
# only while the lock holds a valid lease: after it (a body that ended without a commit, a
# killed worker) it stands for nothing and is replaced (SPEC §8).
# The marker written: "q|<ARGV[1]>|<ARGV[2]>|<server ms>|q".
# The server clock is read only when a lock is judged or a marker written.
PUBLISH = """
local got = redis.call('mget', KEYS[1], KEYS[2])
local held, rec = got[1], got[2]
local started = ARGV[4] == 'started'
local function live()
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
  return valid
end
if rec then
  local head = string.sub(rec, 1, 2)
  if started and head == '2|' then return {7} end
  if head == '2|' then return {2, rec, redis.call('pttl', KEYS[2])} end
  if head ~= 'q|' then return {7} end
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
  if not tid then return {7} end
  local alive = true
  if st == 'c' then alive = live() end
  if alive then
    if tid == ARGV[1] then return {1} end
    if fp ~= '' and ARGV[2] ~= '' and fp ~= ARGV[2] then return {5, tid, fp} end
    local running = 0
    if not started and live() then running = 1 end
    return {6, tid, running, redis.call('pttl', KEYS[2])}
  end
elseif redis.call('exists', KEYS[2]) == 1 then
  if started then return {7} end
  local v1 = redis.pcall('hmget', KEYS[2], 'v', 'ct', 'enc', 'data', 'fp', 'at', 'fence')
  if type(v1) == 'table' and v1[1] then return {3, unpack(v1)} end
  return {7}
end
if live() and not started then return {7} end
local now, ms = 0, 0
--[[ shared: server clock ]]
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
--[[ end: server clock ]]
redis.call('set', KEYS[2], 'q|' .. ARGV[1] .. '|' .. ARGV[2] .. '|' .. string.format('%d', ms)
  .. '|q', 'PX', ARGV[3])
return {1}
"""

# KEYS[1] lock  KEYS[2] record  KEYS[3] the broker's queue (a kombu Redis list)
# ARGV[1..4] as PUBLISH  ARGV[5] the message as kombu's Redis transport pushes it
# PUBLISH's decision (its very text, run as a function: tests/unit/test_redis_scripts.py
# asserts it is PUBLISH's, byte for byte), then the message pushed in the same step when it
# says publish ({1}, {7}): one round trip for the check and the broker's LPUSH when the broker
# is this Redis. Replies as PUBLISH; nothing pushed for the others.
PUBLISH_AND_PUSH = """local function decide()

local got = redis.call('mget', KEYS[1], KEYS[2])
local held, rec = got[1], got[2]
local started = ARGV[4] == 'started'
local function live()
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
  return valid
end
if rec then
  local head = string.sub(rec, 1, 2)
  if started and head == '2|' then return {7} end
  if head == '2|' then return {2, rec, redis.call('pttl', KEYS[2])} end
  if head ~= 'q|' then return {7} end
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
  if not tid then return {7} end
  local alive = true
  if st == 'c' then alive = live() end
  if alive then
    if tid == ARGV[1] then return {1} end
    if fp ~= '' and ARGV[2] ~= '' and fp ~= ARGV[2] then return {5, tid, fp} end
    local running = 0
    if not started and live() then running = 1 end
    return {6, tid, running, redis.call('pttl', KEYS[2])}
  end
elseif redis.call('exists', KEYS[2]) == 1 then
  if started then return {7} end
  local v1 = redis.pcall('hmget', KEYS[2], 'v', 'ct', 'enc', 'data', 'fp', 'at', 'fence')
  if type(v1) == 'table' and v1[1] then return {3, unpack(v1)} end
  return {7}
end
if live() and not started then return {7} end
local now, ms = 0, 0
--[[ shared: server clock ]]
local t = redis.call('time')
now = tonumber(t[1]) * 1000000 + tonumber(t[2])
ms = math.floor(now / 1000)
--[[ end: server clock ]]
redis.call('set', KEYS[2], 'q|' .. ARGV[1] .. '|' .. ARGV[2] .. '|' .. string.format('%d', ms)
  .. '|q', 'PX', ARGV[3])
return {1}
end
local r = decide()
if r[1] == 1 or r[1] == 7 then redis.call('lpush', KEYS[3], ARGV[5]) end
return r
"""

# [KEYS[1] lock]  KEYS[#KEYS] record   ARGV[1] task id
# -> 1 when the record name held ARGV[1]'s queued marker and it is deleted, else 0
# With the lock (two keys): a marker a delivery claimed is kept while that delivery's lease is
# valid (a revoked redelivery must not end the marker of the delivery that runs the body).
DROP_QUEUED = """
local mine = 'q|' .. ARGV[1] .. '|'
local rec = redis.pcall('get', KEYS[#KEYS])
if type(rec) == 'string' and string.sub(rec, 1, #mine) == mine then
  if #KEYS == 2 then
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
    local held = st == 'c' and redis.call('get', KEYS[1])
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
      if valid then return 0 end
    end
  end
  return redis.call('del', KEYS[#KEYS])
end
return 0
"""

# KEYS[1] record   ARGV[1] task id  ARGV[2] publish ttl ms
# -> 1 when the record name held ARGV[1]'s queued marker, now in state 'r' (re-queued: its
#    message went back to the queue, a published retry or a requeue) for ARGV[2] ms; else 0.
# Called by the delivery that claimed it, while its lease is still valid: no publish can see
# the marker dead in between.
REQUEUE_MARKER = """
local mine = 'q|' .. ARGV[1] .. '|'
local rec = redis.pcall('get', KEYS[1])
if type(rec) ~= 'string' or string.sub(rec, 1, #mine) ~= mine then return 0 end
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
redis.call('set', KEYS[1], mbase .. 'r', 'PX', ARGV[2])
return 1
"""
