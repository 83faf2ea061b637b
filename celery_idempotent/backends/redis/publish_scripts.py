"""The Lua scripts of the publish side: ``apply_async``'s decision, with or without the
broker's push in the same step, and the queued marker's removal (see
``backends.redis.keyspace`` for the marker, ``celery_idempotent.celery.publish`` for their use).
"""

from __future__ import annotations

from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis.scripts import LUA_LEASE_VALID, LUA_MARKER, SEP

__all__ = [
    "DROP_QUEUED",
    "PUBLISH",
    "PUBLISH_AND_PUSH",
    "REQUEUE_MARKER",
]

# KEYS[1] record  KEYS[2] lock   ARGV[1] task id  ARGV[2] fingerprint ('' for none)
# ARGV[3] publish ttl ms  ARGV[4] "started" (idempotency_publish_until="started"), else ''
# The publish-side decision of apply_async, in one step:
# -> {1}                  publish: the marker for ARGV[1] is set (or was already ARGV[1]'s own)
# -> {2, record, pttl}    completed (v2 record): publish nothing (pttl: the record's ms left)
# -> {3, v1 fields...}    completed (v1 record): publish nothing
# -> {5, task id, fp}     queued or running under another fingerprint: a mismatch
# -> {6, task id, running, pttl}  queued (running 0) or running (1) as the marker's task id,
#                         pttl the marker's ms left: publish nothing
# -> {7}                  running without a marker, or a foreign value: publish as without
#                         the check (the run-time guard decides)
# A lock whose lease has ended (a tombstone) is not running. With ARGV[4] "started" a call
# stops a publish only while it is queued: the claim of its delivery ended its marker (CLAIM's
# ARGV[3]), so a marker is a call that has not started; a running call without one gets a
# marker for this call (one running, one queued), and a record ({2}, {3}) is published past
# as {7} (the worker replays it while it lives). A marker a delivery claimed (state 'c') lives
# only while the lock holds a valid lease: after it (a body that ended without a commit, a
# killed worker) it stands for nothing and is replaced (SPEC §8).
# The marker written: "q|<ARGV[1]>|<ARGV[2]>|<server ms>|q".
PUBLISH = (
    """
local got = redis.call('mget', KEYS[1], KEYS[2])
local rec, held = got[1], got[2]
local started = ARGV[4] == 'started'
local function live()
  if not held then return false end
  local a = string.find(held, '"""
    + SEP
    + """', 1, true)
  local d = a and tonumber(string.sub(held, 1, a - 1))
  if not d then return true end
  local t = redis.call('time')
  return d * 1000 > tonumber(t[1]) * 1000000 + tonumber(t[2])
end
if rec then
  local head = string.sub(rec, 1, 2)
  if started and head == '"""
    + keyspace.RECORD_HEAD
    + """' then return {7} end
  if head == '"""
    + keyspace.RECORD_HEAD
    + """' then return {2, rec, redis.call('pttl', KEYS[1])} end
  if head ~= '"""
    + keyspace.QUEUED_HEAD
    + """' then return {7} end
"""
    + LUA_MARKER
    + """
  if not tid then return {7} end
  local alive = true
  if st == '"""
    + keyspace.MARKER_CLAIMED
    + """' then alive = live() end
  if alive then
    if tid == ARGV[1] then return {1} end
    if fp ~= '' and ARGV[2] ~= '' and fp ~= ARGV[2] then return {5, tid, fp} end
    local running = 0
    if not started and live() then running = 1 end
    return {6, tid, running, redis.call('pttl', KEYS[1])}
  end
elseif redis.call('exists', KEYS[1]) == 1 then
  if started then return {7} end
  local v1 = redis.pcall('hmget', KEYS[1], """
    + keyspace.lua_list(keyspace.V1_RECORD_FIELDS)
    + """)
  if type(v1) == 'table' and v1[1] then return {3, unpack(v1)} end
  return {7}
end
if live() and not started then return {7} end
local t = redis.call('time')
local pms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('set', KEYS[1], '"""
    + keyspace.QUEUED_HEAD
    + """' .. ARGV[1] .. '"""
    + keyspace.SEP
    + """' .. ARGV[2] .. '"""
    + keyspace.SEP
    + """' .. string.format('%d', pms) .. '"""
    + keyspace.SEP
    + keyspace.MARKER_QUEUED
    + """', 'PX', ARGV[3])
return {1}
"""
)

# KEYS[1] record  KEYS[2] lock  KEYS[3] the broker's queue (a kombu Redis list)
# ARGV[1..4] as PUBLISH  ARGV[5] the message as kombu's Redis transport pushes it
# PUBLISH's decision (its very text, run as a function), then the message pushed in the same
# step when it says publish ({1}, {7}): one round trip for the check and the broker's LPUSH
# when the broker is this Redis. Replies as PUBLISH; nothing pushed for the others.
PUBLISH_AND_PUSH = (
    "local function decide()\n"
    + PUBLISH
    + """end
local r = decide()
if r[1] == 1 or r[1] == 7 then redis.call('lpush', KEYS[3], ARGV[5]) end
return r
"""
)

# KEYS[1] record  [KEYS[2] lock]   ARGV[1] task id
# -> 1 when the record name held ARGV[1]'s queued marker and it is deleted, else 0
# With KEYS[2]: a marker a delivery claimed is kept while that delivery's lease is valid (a
# revoked redelivery must not end the marker of the delivery that runs the body).
DROP_QUEUED = (
    """
local mine = '"""
    + keyspace.QUEUED_HEAD
    + """' .. ARGV[1] .. '"""
    + keyspace.SEP
    + """'
local rec = redis.pcall('get', KEYS[1])
if type(rec) == 'string' and string.sub(rec, 1, #mine) == mine then
  if KEYS[2] then
"""
    + LUA_MARKER
    + """
    if st == '"""
    + keyspace.MARKER_CLAIMED
    + """' then
      local held = redis.call('get', KEYS[2])
"""
    + LUA_LEASE_VALID
    + """
      if valid then return 0 end
    end
  end
  return redis.call('del', KEYS[1])
end
return 0
"""
)

# KEYS[1] record   ARGV[1] task id  ARGV[2] publish ttl ms
# -> 1 when the record name held ARGV[1]'s queued marker, now in state 'r' (re-queued: its
#    message went back to the queue, a published retry or a requeue) for ARGV[2] ms; else 0.
# Called by the delivery that claimed it, while its lease is still valid: no publish can see
# the marker dead in between.
REQUEUE_MARKER = (
    """
local mine = '"""
    + keyspace.QUEUED_HEAD
    + """' .. ARGV[1] .. '"""
    + keyspace.SEP
    + """'
local rec = redis.pcall('get', KEYS[1])
if type(rec) ~= 'string' or string.sub(rec, 1, #mine) ~= mine then return 0 end
"""
    + LUA_MARKER
    + """
redis.call('set', KEYS[1], mbase .. '"""
    + keyspace.MARKER_REQUEUED
    + """', 'PX', ARGV[2])
return 1
"""
)
