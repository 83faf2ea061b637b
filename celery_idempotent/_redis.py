"""What the Redis lock provider and store share: the client, error translation, the scripts.

Every decision is one Lua script, registered once per client and called by SHA (redis-py's
``Script`` falls back to loading it once when the server does not know it yet). The scripts
are written so that a call retried by the client after a lost reply (redis-py retries on
connection errors) decides the same as the first: a claim by the token that already holds the
lock succeeds again, and a commit that already happened reports success.

Key layout for an idempotency key ``k`` and prefix ``p`` (``{...}`` is the Redis Cluster hash
tag, so all three live in one slot)::

    p lock:{k}          string: the holder's token ("<random>@<owner_id>"), PX = lease
    p lock:{k}:fence    string: the last fencing token handed out, PX = fence_ttl
    p {k}               hash: the committed record (see RECORD_FIELDS), PX = record ttl
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import TYPE_CHECKING, Any

from celery_idempotent.exceptions import (
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyError,
)

if TYPE_CHECKING:
    import redis

__all__ = [
    "ACQUIRE",
    "CLAIM",
    "COMMIT",
    "EXTEND",
    "READ_KEY",
    "RECORD_FIELDS",
    "RELEASE",
    "SET_RECORD",
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

#: Hash fields of a record, in the order the scripts read and write them.
#: v: format version; ct/enc/data: kombu's (content type, encoding, payload); fp: fingerprint
#: ("" for none); at: guard clock at commit; fence: fencing token of the committing lease.
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
            f"{what}: url must start with redis://, rediss:// or unix://, got {_redact(url)!r}"
        )
    return redis_mod.Redis.from_url(url, **CLIENT_DEFAULTS)  # type: ignore[no-any-return]


def _redact(url: str) -> str:
    """The URL without its password, for error messages."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url


def same_server(a: Any, b: Any) -> bool:
    """Whether two redis-py clients talk to the same server and database."""
    if a is b:
        return True
    pool_a = getattr(a, "connection_pool", None)
    pool_b = getattr(b, "connection_pool", None)
    if pool_a is None or pool_b is None:
        return False
    if pool_a is pool_b:
        return True
    # A Sentinel pool names no host or port: its service and its Sentinel manager decide.
    if getattr(pool_a, "service_name", None) or getattr(pool_b, "service_name", None):
        return (
            getattr(pool_a, "service_name", None) == getattr(pool_b, "service_name", None)
            and getattr(pool_a, "sentinel_manager", None)
            is getattr(pool_b, "sentinel_manager", None)
            and pool_a.connection_kwargs.get("db") == pool_b.connection_kwargs.get("db")
        )
    keys = ("host", "port", "db", "path", "username")
    kw_a, kw_b = pool_a.connection_kwargs, pool_b.connection_kwargs
    return type(a) is type(b) and all(kw_a.get(k) == kw_b.get(k) for k in keys)


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
                f"broker_url mixes sentinel:// with {parts.scheme}:// URLs ({_redact(part)!r})"
            )
        first = first or parts
        sentinels.append((parts.hostname or "127.0.0.1", parts.port or 26379))
    if first is None:
        raise ValueError(f"broker_url names no Sentinel: {_redact(broker_url)!r}")
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
