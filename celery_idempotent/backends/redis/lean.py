"""The hot path's transport: the claim, commit and publish scripts sent over held connections.

A guarded call is one or two script round trips, and through ``Script.__call__`` each pays
redis-py's whole command path on top of the socket: the pool's lock and bookkeeping at checkout
and release, the readiness check, the retry wrapper's closures, the observability recorder's
calls and timestamps, the response-callback lookup. Measured on a 2-core machine that is tens of
µs of client CPU per round trip, several times what the socket write and the (hiredis) parse of
the reply cost. :class:`LeanScripts` keeps the parts of that path that decide behaviour and
drops the rest:

- **Connections of the process.** Taken once from the client's own pool (``get_connection``),
  so they are of the pool's connection class with its arguments (TLS, ACL credentials,
  ``Sentinel``'s master lookup, the socket timeouts, redis-py's parser: hiredis when installed)
  and ``pool.disconnect()`` (``client.close()``) closes them like any other. They are never
  handed back: a lock-free LIFO stack lends each one to one caller at a time, so a thread (a
  prefork child, a ``threads`` pool thread) keeps reusing the one it just gave back, and under
  gevent or eventlet, whose pools run every task in a new greenlet, the greenlets in flight
  share as many connections as run at once (one per greenlet would connect once per task).
  At most half the pool's ``max_connections`` are held, so that the client's other commands
  always find room; a call that finds none free beyond that goes through the client.
- **What redis-py does around a command, done the same way.** The checkout's ``connect()`` and
  readiness check (a connection with unread data, or closed by the server while idle, is
  reconnected before anything is sent), the connection's own ``Retry`` on the same errors with
  a disconnect between attempts (timeouts, a closed connection, a Redis restart, ``LOADING``;
  ``READONLY`` after a failover, which redis-py's Sentinel connections turn into a connection
  error), ``NOSCRIPT`` answered with ``SCRIPT LOAD`` and the call sent again (what
  ``Script.__call__`` does), the release's check that the pool still owns the connection (a
  Sentinel master that changed), and a disconnect on any exception that interrupts a call, so
  no reply is ever left unread on a connection.

Not taken (:func:`lean_for` returns ``None``, and the script is called through the client as
before): ``RedisCluster`` (its slot routing and ``MOVED``/``ASK`` redirections live in the
client), a ``BlockingConnectionPool`` (its checkout waits for a free connection), a client-side
cache, a single-connection client, redis-py's OpenTelemetry metrics when enabled, a ``Redis``
subclass or instrumentation (APM tracers wrap ``Redis.execute_command``) that replaces
``execute_command`` (checked at every call: a tracer installed later keeps its spans), and
``CELERY_IDEMPOTENT_REDIS_LEAN=0`` in the environment.
"""

from __future__ import annotations

import os
import threading
import types
import weakref
from collections.abc import Sequence
from typing import Any

from celery_idempotent.backends.redis.client import import_redis

__all__ = ["LeanScripts", "lean_for", "why_not_lean"]

#: Set to ``0`` to send every script through redis-py's client, as before the lean path.
ENV_SWITCH = "CELERY_IDEMPOTENT_REDIS_LEAN"


def _text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


class _Plain:
    """Whether a class's ``execute_command`` is redis-py's own (not a subclass's, not wrapped
    by a tracer or a test's spy); one check per function object seen."""

    def __init__(self) -> None:
        redis = import_redis()
        self._file = redis.client.Redis.execute_command.__code__.co_filename
        self._known: set[int] = set()

    def __call__(self, cls: type[Any]) -> bool:
        fn = getattr(cls, "execute_command", None)
        if id(fn) in self._known:
            return True
        code = getattr(fn, "__code__", None)
        plain = (
            type(fn) is types.FunctionType
            and code is not None
            and code.co_filename == self._file
            and code.co_name == "execute_command"
        )
        if plain:
            self._known.add(id(fn))  # functions of a class: alive as long as the process
        return plain


_plain: _Plain | None = None


def _metrics_enabled() -> bool:
    """Whether redis-py's observability (OpenTelemetry metrics, redis-py 7+) records commands:
    then every command goes through the client, so that its metrics stay whole."""
    try:
        from redis.observability import recorder  # noqa: PLC0415 - redis-py 7+ only
    except ImportError:
        return False
    try:
        return recorder._get_or_create_collector() is not None
    except Exception:
        return True


def why_not_lean(client: Any) -> str | None:
    """Why the scripts of ``client`` cannot take the lean path, or ``None`` when they can."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}:
        return f"{ENV_SWITCH} turns it off"
    redis = import_redis()
    if not isinstance(client, redis.Redis) or isinstance(client, redis.client.Pipeline):
        return f"the client is a {type(client).__name__}, not a redis.Redis"
    if getattr(client, "connection", None) is not None:
        return "a single-connection client"
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, redis.ConnectionPool) or isinstance(pool, redis.BlockingConnectionPool):
        return f"its pool is a {type(pool).__name__}"
    bound = getattr(pool, "max_connections", None)
    if isinstance(bound, int) and bound < 2:
        return f"its pool has room for {bound} connection(s)"
    if getattr(pool, "cache", None) is not None:
        return "a client-side cache"
    if _metrics_enabled():
        return "redis-py's metrics are enabled"
    return None


#: Every :class:`LeanScripts` of the process, told by :func:`_after_fork_in_child` that a
#: fork's child must not use the parent's connections.
_instances: weakref.WeakSet[LeanScripts] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for instance in list(_instances):
        instance._forget_parent()


if hasattr(os, "register_at_fork"):  # every fork made by Python (os.fork, billiard, ...)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def lean_for(client: Any) -> LeanScripts | None:
    """A :class:`LeanScripts` over ``client``'s pool, or ``None`` when the client cannot take
    the lean path (see :func:`why_not_lean`)."""
    global _plain  # noqa: PLW0603 - made once, on the first Redis client
    if why_not_lean(client) is not None:
        return None
    if _plain is None:
        _plain = _Plain()
    return LeanScripts(client, _plain)


class LeanScripts:
    """Runs a registered ``redis.commands.core.Script`` (its ``sha`` and ``script``) on a
    connection held by this process; see the module docstring for what is kept of redis-py's
    command path. Thread- and greenlet-safe: a connection is used by one caller at a time."""

    def __init__(self, client: Any, plain: _Plain) -> None:
        redis = import_redis()
        self._client = client
        self._plain = plain
        self._pool = client.connection_pool
        self._free: list[Any] = []
        self._pid = os.getpid()
        bound = getattr(self._pool, "max_connections", None)
        self._limit = bound // 2 if isinstance(bound, int) else 1 << 62
        self._held = 0  # connections taken from the pool by this process
        self._lock = threading.Lock()
        self._no_script = redis.exceptions.NoScriptError
        self._connection_error = redis.exceptions.ConnectionError
        self._owns = getattr(self._pool, "owns_connection", None)
        maint = getattr(self._pool, "maint_notifications_enabled", None)
        # The pool's own rule: with maintenance notifications (RESP3 pushes) pending data is
        # expected, and the checkout does not treat it as a dirty connection (a closed one
        # still is: can_read raises).
        self._check_ready = not (callable(maint) and maint())
        # A fork's child is told by the at-fork hook (no getpid() system call per call);
        # where there is no hook, each call compares the pid.
        self._check_pid = not hasattr(os, "register_at_fork")
        _instances.add(self)

    def _forget_parent(self) -> None:
        """In a fork's child: the parent's connections are its sockets; forget them, never
        close them (redis-py's pool does the same after a fork)."""
        self._free = []
        self._held = 0
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"LeanScripts({self._client!r})"

    def __call__(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """``script(keys=keys, args=args)``, with the same reply and the same errors."""
        if not self._plain(type(self._client)):
            return script(keys=keys, args=args)  # instrumented: through execute_command
        if self._check_pid and self._pid != os.getpid():
            self._forget_parent()
        free = self._free
        try:
            conn = free.pop()
        except IndexError:
            conn = self._checkout()
            if conn is None:  # as many held as the bound allows, all in use
                return script(keys=keys, args=args)
        try:
            reply = self._run(conn, script, keys, args)
        except BaseException:
            # Whatever interrupted the call (an error, a timeout, a greenlet killed), no reply
            # may be left unread: the next call would read it as its own.
            conn.disconnect()
            free.append(conn)
            raise
        if self._owns is not None and not self._owns(conn):
            conn.disconnect()  # the pool's release does this (a Sentinel master replaced)
        free.append(conn)
        return reply

    def _checkout(self) -> Any:
        """A connection from the pool to hold, or ``None`` when the bound is reached."""
        with self._lock:
            if self._held >= self._limit:
                return None
            self._held += 1
        try:
            try:
                return self._pool.get_connection()
            except TypeError:  # redis-py < 5.3 requires a command name
                return self._pool.get_connection("EVALSHA")
        except BaseException:
            with self._lock:
                self._held -= 1
            raise

    def _ready(self, conn: Any) -> None:
        """What the pool's ``get_connection`` checks before lending a connection: connected,
        and nothing waiting on the socket (a reply left unread, or the server's FIN)."""
        if conn._sock is None:
            conn.connect()
            return
        try:
            dirty = conn.can_read() and self._check_ready
        except (self._connection_error, TimeoutError, OSError):
            dirty = True  # closed by the server, or broken
        if dirty:
            conn.disconnect()
            conn.connect()
            if conn.can_read() and self._check_ready:
                raise self._connection_error("Connection not ready")

    def _run(self, conn: Any, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        self._ready(conn)
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)

        def send() -> Any:
            conn.send_command(*command)
            return conn.read_response()

        def fail(_error: BaseException) -> None:
            conn.disconnect()

        try:
            return conn.retry.call_with_retry(send, fail)
        except self._no_script:
            # Script.__call__: the server does not know it (restarted, failed over, flushed):
            # load it, then send the call again.
            def load() -> Any:
                conn.send_command("SCRIPT", "LOAD", script.script)
                return conn.read_response()

            script.sha = _text(conn.retry.call_with_retry(load, fail))
            command = ("EVALSHA", script.sha, len(keys), *keys, *args)
            return conn.retry.call_with_retry(send, fail)
