"""A Redis connection for the lease keeper's thread: its own socket, a bound on every attempt.

The keeper renews leases from a real OS thread (see :mod:`celery_idempotent.core.green`). It must
not share the body's connection pool: under gevent or eventlet those sockets belong to the hub
of the worker's main thread, and a body that blocks that hub would block the renewals too. So
each Redis lock provider gets one extra connection, used only by the keeper thread:

- under gevent/eventlet it is made with the real ``socket`` class (for TCP and unix-socket
  connections; TLS, Sentinel and Cluster clients are not supported there, and their renewals
  stay on the hub: the worker says so at start);
- it never retries on its own (redis-py's default retries with back-off could make a renewal
  arrive after the lease ran out): the keeper decides when to try again;
- every attempt, connecting included, is bounded by a timeout the keeper passes: the lease's
  remaining time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Sequence
from typing import Any

from celery_idempotent.backends.redis.client import import_redis
from celery_idempotent.core.green import Natives

__all__ = ["NativeRedisCaller", "native_caller_for"]


def _tcp_connect(self: Any) -> Any:
    """redis-py's ``Connection._connect`` with the real socket functions."""
    natives: Natives = self._cidem_natives
    err: OSError | None = None
    for family, socktype, proto, _, address in natives.getaddrinfo(
        self.host, self.port, self.socket_type, socket.SOCK_STREAM
    ):
        sock = None
        try:
            sock = natives.socket_class(family, socktype, proto)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.socket_keepalive:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for opt, value in (self.socket_keepalive_options or {}).items():
                    sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            sock.settimeout(self.socket_connect_timeout)
            sock.connect(address)
            sock.settimeout(self.socket_timeout)
        except OSError as exc:
            err = exc
            if sock is not None:
                sock.close()
        else:
            return sock
    if err is not None:
        raise err
    raise OSError("getaddrinfo returned an empty list")


def _unix_connect(self: Any) -> Any:
    """redis-py's ``UnixDomainSocketConnection._connect`` with the real socket class."""
    natives: Natives = self._cidem_natives
    sock = natives.socket_class(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(self.socket_connect_timeout)
    try:
        sock.connect(self.path)
    except OSError:
        sock.close()
        raise
    sock.settimeout(self.socket_timeout)
    return sock


def _connection_class(base: type[Any], natives: Natives) -> type[Any] | None:
    """``base`` itself when no green runtime patched sockets; else a subclass that connects
    with real sockets, or ``None`` when ``base`` cannot be given one (TLS, Sentinel, own
    ``_connect``)."""
    if natives.runtime is None:
        return base
    connection = import_redis().connection
    unix = connection.UnixDomainSocketConnection
    if issubclass(base, connection.SSLConnection):
        return None
    if issubclass(base, unix) and base._connect is unix._connect:
        connect = _unix_connect
    elif (
        issubclass(base, connection.Connection) and base._connect is connection.Connection._connect
    ):
        connect = _tcp_connect
    else:
        return None
    return type(f"Native{base.__name__}", (base,), {"_connect": connect, "_cidem_natives": natives})


class NativeRedisCaller:
    """Runs one script at a time over a connection of its own; used by one thread only."""

    def __init__(self, connection_class: type[Any], kwargs: dict[str, Any]) -> None:
        self._connection_class = connection_class
        self._kwargs = kwargs
        self._connection: Any = None
        self._pid = 0
        self._shas: dict[str, str] = {}

    def __call__(
        self,
        script: str,
        keys: Sequence[Any],
        args: Sequence[Any],
        timeout: float,
        *,
        wait: tuple[int, int] | None = None,
    ) -> Any:
        """``EVALSHA`` (after ``SCRIPT LOAD`` when the server does not know the script yet),
        waiting at most ``timeout`` seconds to connect and at most ``timeout`` seconds for the
        reply. With ``wait`` (replicas, ms), ``WAIT`` follows in the same round trip and the
        reply is (the script's, WAIT's). Errors propagate (redis-py's), after the connection
        is dropped: the next call connects afresh."""
        redis_mod = import_redis()
        conn = self._connect_for(timeout)
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()  # noqa: S324 - the script's name in Redis

        def send() -> None:
            conn.send_command("EVALSHA", sha, len(keys), *keys, *args)
            if wait is not None:
                conn.send_command("WAIT", *wait)

        def read() -> Any:
            try:
                reply = conn.read_response()
            except redis_mod.exceptions.NoScriptError:
                if wait is not None:
                    conn.read_response()  # WAIT's reply to the refused script
                raise
            return reply if wait is None else (reply, conn.read_response())

        try:
            send()
            try:
                return read()
            except redis_mod.exceptions.NoScriptError:
                # SCRIPT LOAD, not EVAL: the ACL the README recommends allows only the first.
                conn.send_command("SCRIPT", "LOAD", script)
                conn.read_response()
                send()
                return read()
        except BaseException:
            self._drop()
            raise

    def _connect_for(self, timeout: float) -> Any:
        if self._connection is None or self._pid != os.getpid():
            # A connection made before a fork belongs to the parent: forget it, never close it
            # (closing would shut the parent's socket down).
            self._connection = self._connection_class(**self._kwargs)
            self._pid = os.getpid()
        conn = self._connection
        conn.socket_timeout = timeout
        conn.socket_connect_timeout = timeout
        sock = getattr(conn, "_sock", None)
        if sock is None:
            conn.connect()
            sock = getattr(conn, "_sock", None)
        if sock is not None:
            sock.settimeout(timeout)
        return conn

    def _drop(self) -> None:
        conn, self._connection = self._connection, None
        if conn is not None and self._pid == os.getpid():
            with contextlib.suppress(Exception):  # it is being thrown away anyway
                conn.disconnect()

    def close(self) -> None:
        """Close the connection (it is made again on the next call)."""
        self._drop()


def native_caller_for(client: Any, natives: Natives) -> NativeRedisCaller | None:
    """A :class:`NativeRedisCaller` to the server of ``client`` (a ``redis.Redis``), or ``None``
    when one cannot be made for it: a Cluster client, or under gevent/eventlet a TLS or Sentinel
    connection."""
    pool = getattr(client, "connection_pool", None)
    base = getattr(pool, "connection_class", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if pool is None or not isinstance(base, type) or not isinstance(kwargs, dict):
        return None
    if getattr(pool, "service_name", None) and natives.runtime is not None:
        return None  # Sentinel: the master's address comes through the hub's connections
    connection_class = _connection_class(base, natives)
    if connection_class is None:
        return None
    from redis.backoff import NoBackoff  # noqa: PLC0415 - redis is optional
    from redis.retry import Retry  # noqa: PLC0415

    kwargs = {
        **kwargs,
        # The keeper decides when to try again; a retry inside redis-py could send the renewal
        # after the lease ran out.
        "retry": Retry(NoBackoff(), 0),
        "retry_on_timeout": False,
        "health_check_interval": 0,
    }
    kwargs.pop("retry_on_error", None)
    return NativeRedisCaller(connection_class, kwargs)
