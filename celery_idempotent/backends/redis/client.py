"""Redis clients for the backends: made from a URL or given, Sentinel masters made the way
kombu makes them, and whether two clients reach the same data (which lets the store and the
lock provider decide in one script).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
from typing import TYPE_CHECKING, Any

from celery_idempotent.urls import redact

if TYPE_CHECKING:
    import redis

__all__ = [
    "CLIENT_DEFAULTS",
    "INSTALL_HINT",
    "SentinelClientFactory",
    "decodes_responses",
    "default_owner_id",
    "describe_client",
    "glob_escape",
    "import_redis",
    "make_client",
    "ms",
    "new_token",
    "same_server",
    "sentinel_factory_from_broker",
    "task_of_token",
    "why_not_same_server",
]

INSTALL_HINT = "the Redis backends need the redis package: pip install 'celery-idempotent[redis]'"

#: Defaults for clients built from a URL; options in the URL's query string win. Without a
#: socket timeout a stalled network would block a worker forever instead of failing over.
CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "health_check_interval": 30,
}


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


def rediscover(client: Any) -> None:
    """After a write that fewer replicas confirmed than asked: on a Sentinel client, drop the
    pool's idle connections, so that the next command asks the Sentinel for the master (an
    old master keeps taking writes on connections made before a failover until it is
    demoted). Connections in use are left to their commands; other clients: nothing."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None and getattr(pool, "service_name", None):
        with contextlib.suppress(Exception):  # a hint only; the next command reconnects
            pool.disconnect(inuse_connections=False)


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


#: Between a token's random part and the task id it carries (see :func:`new_token`).
TASK_SEP = "~"
_TASK_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def new_token(owner_id: str, task_id: str | None = None) -> str:
    """A token unique to one acquisition, naming its owner; with ``task_id`` (a claim in
    ``idempotency_publish_until="started"``, whose marker the claim ends) it names the running
    call too, ``<random>~<task id>@<owner>``, so that the admin can tell the running call from
    the one queued behind it. A task id with other characters than letters, digits and
    ``_.:-`` is not carried. Tokens are only ever compared whole."""
    if task_id is not None and _TASK_ID.match(task_id):
        return f"{secrets.token_hex(12)}{TASK_SEP}{task_id}@{owner_id}"
    return f"{secrets.token_hex(12)}@{owner_id}"


def task_of_token(token: str) -> str | None:
    """The task id a lease's token or lock's value carries (:func:`new_token`), else ``None``."""
    random = token.rsplit("/", 1)[-1].split("@", 1)[0]
    _, sep, task_id = random.partition(TASK_SEP)
    return task_id if sep and task_id else None


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds for PX, never 0 (PX 0 is an error)."""
    return max(1, round(seconds * 1000))


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


def describe_client(client: Any) -> str:
    """Where an ``idempotency_client`` points, for the output (no password)."""
    pool: Any = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service:
        return f"sentinel master {service!r} (db {pool.connection_kwargs.get('db', 0)})"
    if getattr(client, "nodes_manager", None) is not None:  # RedisCluster
        names = sorted(node.name for node in client.get_primaries())
        more = ", ..." if len(names) > 3 else ""
        return f"cluster of {len(names)} primaries ({', '.join(names[:3])}{more})"
    kwargs = getattr(pool, "connection_kwargs", {}) or {}
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    if "host" in kwargs:
        return f"redis://{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return type(client).__name__
