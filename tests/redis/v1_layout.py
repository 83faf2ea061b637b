"""The Redis scripts of layout v1 (celery-idempotent 0.1.0), copied verbatim.

The upgrade tests write keys with these, as a 0.1.0 worker would, then run the current code
against them: v1 records must replay and held v1 locks must be respected.
"""

RECORD_FIELDS = ("v", "ct", "enc", "data", "fp", "at", "fence")
RECORD_VERSION = "1"

# Shared by ACQUIRE and CLAIM: take the free lock for ARGV[1] with a PX of ARGV[2] and hand out
# the next fencing token: max(last + 1, server time in µs). The time floor keeps tokens
# increasing even after the fence key expired (it lives fence_ttl, not forever, so that keys
# no longer used do not pile up). TIME makes the script non-deterministic: effects replication
# (the default from Redis 7, asked for explicitly on 6.x) replicates the writes, not the script.
_TAKE = """
local function take(lock, fence, token, px, fence_px)
  redis.call('set', lock, token, 'PX', px)
  local t = redis.call('time')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('get', fence) or '0')
  local f = math.max(last + 1, now)
  redis.call('set', fence, string.format('%d', f), 'PX', fence_px)
  return f
end
local function fence_of(fence)
  return tonumber(redis.call('get', fence) or '0')
end
if redis.replicate_commands then redis.replicate_commands() end
"""

# KEYS[1] lock  KEYS[2] fence   ARGV[1] token  ARGV[2] lease ms  ARGV[3] fence ttl ms
# -> fencing token (> 0) when taken (or already held by this very token), 0 when held by another
ACQUIRE = (
    _TAKE
    + """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return fence_of(KEYS[2]) end
if holder then return 0 end
return take(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
"""
)

# KEYS[1] lock  KEYS[2] fence  KEYS[3] record   ARGV as ACQUIRE
# Lock first, then the store, in one step:
# -> {0}                    the lock is held by another holder (the record is not looked at)
# -> {1, fencing token}     the lock was free and there is no record: the lock is now ours
# -> {2, v, ct, enc, data, fp, at, fence}   the lock was free and a record exists: not taken
CLAIM = (
    _TAKE
    + """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return {1, fence_of(KEYS[2])} end
if holder then return {0} end
local rec = redis.call('hmget', KEYS[3], 'v', 'ct', 'enc', 'data', 'fp', 'at', 'fence')
if rec[1] then
  return {2, rec[1], rec[2], rec[3], rec[4], rec[5], rec[6], rec[7]}
end
return {1, take(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])}
"""
)

# KEYS[1] lock  KEYS[2] record   ARGV[1] token  ARGV[2] record ttl ms  ARGV[3..9] RECORD_FIELDS
# -> 1 committed and released; 0 not the holder (nothing written).
# A retry of a commit that already went through finds its own record (same fence): 1.
COMMIT = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then
  local fence = redis.call('hget', KEYS[2], 'fence')
  if fence and fence == ARGV[9] and ARGV[9] ~= '' then return 1 end
  return 0
end
redis.call('del', KEYS[2])
redis.call('hset', KEYS[2], 'v', ARGV[3], 'ct', ARGV[4], 'enc', ARGV[5], 'data', ARGV[6],
           'fp', ARGV[7], 'at', ARGV[8], 'fence', ARGV[9])
redis.call('pexpire', KEYS[2], ARGV[2])
redis.call('del', KEYS[1])
return 1
"""

# KEYS[1] record   ARGV[1] record ttl ms  ARGV[2..8] RECORD_FIELDS
# Replace the record (the store used on its own, without the lock in the same script); one
# script rather than MULTI/EXEC, which RedisCluster clients only support from redis-py 6.1.
SET_RECORD = """
redis.call('del', KEYS[1])
redis.call('hset', KEYS[1], 'v', ARGV[2], 'ct', ARGV[3], 'enc', ARGV[4], 'data', ARGV[5],
           'fp', ARGV[6], 'at', ARGV[7], 'fence', ARGV[8])
redis.call('pexpire', KEYS[1], ARGV[1])
return 1
"""

# KEYS[1] record  KEYS[2] lock  KEYS[3] fence   ARGV: the record's fields to read
# -> {field values, payload size, record pttl, lock holder, lock pttl, last fence, fence pttl}
# One consistent view of a key for the admin command (absent values are nil).
READ_KEY = """
return {redis.call('hmget', KEYS[1], unpack(ARGV)), redis.call('hstrlen', KEYS[1], 'data'),
        redis.call('pttl', KEYS[1]), redis.call('get', KEYS[2]), redis.call('pttl', KEYS[2]),
        redis.call('get', KEYS[3]), redis.call('pttl', KEYS[3])}
"""

# KEYS[1] lock   ARGV[1] token  ARGV[2] lease ms
# -> 1 extended, 0 not the holder (nothing changed)
EXTEND = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] lock   ARGV[1] token
# -> 1 released, 0 not the holder (nothing changed)
RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
