"""The Redis lock provider: owner-safe leases with fencing tokens, one round trip each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_idempotent.backends.redis import client as redis_client
from celery_idempotent.backends.redis import errors as redis_errors
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis import native as native_redis
from celery_idempotent.backends.redis import scripts as redis_scripts
from celery_idempotent.core import green
from celery_idempotent.core.exceptions import IdempotencyConnectionError
from celery_idempotent.core.names import DEFAULT_PREFIX
from celery_idempotent.core.protocols import Lease
from celery_idempotent.core.validate import check_count, check_duration

__all__ = ["RedisLockProvider"]


class RedisLockProvider:
    """Leases on a Redis server (``redis.Redis``, a Sentinel master, or ``RedisCluster``).

    Pass a ready ``client`` or a ``url`` (``redis://``, ``rediss://``, ``unix://``). Each
    acquisition stores a token unique to it (``<random>@<owner_id>``; ``owner_id`` defaults to
    ``host:pid:random``), and extend and release are Lua scripts that act only when the lock
    still holds that token and its lease is valid: a holder whose lease expired can never
    release or extend the next holder's lease, nor its own. A lease ends at a deadline in
    server time kept in the lock (``<deadline ms>/<fencing token>/<token>``), compared with
    the server's ``TIME``: no client clock decides it. After its lease ends (released, or
    past the deadline) the lock stays as a tombstone for ``keyspace.FENCE_MARGIN_MS`` (60 s)
    more, so that the next fencing token is above the last one even if the server clock
    steps back meanwhile.

    Fencing tokens strictly increase per resource: a token is the server's time in µs, or
    one more than the last token the lock (or a fence key) still carries (see
    ``backends.redis.keyspace`` for why no long-lived fence key is needed, and the bound
    on a server clock step back). A lease's ``token`` is ``<fencing token>/<random>@<owner_id>``
    (the lock holds it behind the lease's deadline).

    ``key_prefix`` only scopes :meth:`clear`; resource names come from the guard.
    ``fence_ttl`` is accepted for compatibility with 0.1.0 and no longer used: layout v2
    keeps no fence key for days.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        url: str | None = None,
        owner_id: str | None = None,
        fence_ttl: Any = 7 * 86_400,
        key_prefix: str = DEFAULT_PREFIX,
        wait_replicas: int = 0,
        wait_timeout: Any = 1.0,
    ) -> None:
        self.client = redis_client.make_client(client, url, "RedisLockProvider")
        #: Renewals wait (Redis ``WAIT``, same round trip) until this many replicas have them,
        #: at most ``wait_timeout`` seconds; one that fewer replicas confirm does not count: the
        #: holder never believes in a lease longer than the one a promoted replica would hold.
        #: The Celery adapter passes ``idempotency_wait_replicas`` / ``_timeout``.
        self.wait_replicas = check_count("wait_replicas", wait_replicas)
        self.wait_timeout = check_duration("wait_timeout", wait_timeout)
        if owner_id is not None and (not isinstance(owner_id, str) or not owner_id):
            raise TypeError(f"owner_id must be a non-empty str, not {owner_id!r}")
        self.owner_id = owner_id or redis_client.default_owner_id()
        self.fence_ttl = check_duration("fence_ttl", fence_ttl)
        self.key_prefix = key_prefix
        self._acquire = self.client.register_script(redis_scripts.ACQUIRE)
        self._extend = self.client.register_script(redis_scripts.EXTEND)
        self._release = self.client.register_script(redis_scripts.RELEASE)
        self._holder = self.client.register_script(redis_scripts.HOLDER)

    def __repr__(self) -> str:
        return f"RedisLockProvider(client={self.client!r}, owner_id={self.owner_id!r})"

    @staticmethod
    def fence_key(resource: str) -> str:
        """Where a fencing token of ``resource`` ahead of the server clock is kept."""
        return keyspace.fence_name(resource)

    def acquire(self, resource: str, ttl: float) -> Lease | None:
        """Take ``resource`` for ``ttl`` seconds (one round trip); ``None`` when it is held."""
        ttl = check_duration("ttl", ttl)
        token = redis_client.new_token(self.owner_id)
        with redis_errors.translate_errors(resource, "lock acquire"):
            fence = self._acquire(
                keys=[resource, keyspace.fence_name(resource)], args=[token, redis_client.ms(ttl)]
            )
        number = int(fence)
        if not number:
            return None
        return Lease(
            resource=resource, token=keyspace.lock_value(number, token), fencing_token=number
        )

    def extend(self, lease: Lease, ttl: float) -> bool:
        """Reset the lease to ``ttl`` seconds if it is still ours (one round trip).

        With ``wait_replicas``, a renewal that fewer replicas confirm raises
        :class:`~celery_idempotent.IdempotencyConnectionError` (not counted: the lease keeps
        its former end for the holder, which is what a promoted replica holds)."""
        ttl = check_duration("ttl", ttl)
        keys, args = self._extend_arguments(lease, ttl)
        with redis_errors.translate_errors(lease.resource, "lock extend"):
            if not self.wait_replicas:
                return bool(self._extend(keys=keys, args=args))
            pipe = self.client.pipeline(transaction=False)
            self._extend(keys=keys, args=args, client=pipe)
            pipe.wait(self.wait_replicas, redis_client.ms(self.wait_timeout))
            ours, acked = pipe.execute()
        return self._replicated(lease, bool(ours), int(acked))

    def _replicated(self, lease: Lease, ours: bool, acked: int) -> bool:
        if ours and acked < self.wait_replicas:
            redis_client.rediscover(self.client)
            raise IdempotencyConnectionError(
                lease.resource,
                f"the renewal reached {acked} of the {self.wait_replicas} replica(s) "
                f"wait_replicas asks for within {self.wait_timeout:g}s: not counted (a "
                "promoted replica would hold the lease's former end)",
            )
        return ours

    @staticmethod
    def _extend_arguments(lease: Lease, ttl: float) -> tuple[list[Any], list[Any]]:
        """KEYS and ARGV of the EXTEND script (shared by :meth:`extend` and the renewer)."""
        return (
            [lease.resource, keyspace.fence_name(lease.resource)],
            [lease.token, redis_client.ms(ttl), lease.fencing_token],
        )

    def renewer(self) -> Callable[[Lease, float, float], bool] | None:
        """``renew(lease, ttl, timeout)``: :meth:`extend` for the lease keeper's OS thread.

        It has a connection of its own (with real sockets under gevent or eventlet, so that a
        body blocking the event loop cannot delay it), never retries by itself, and waits at
        most ``timeout`` seconds (the lease's remaining time). ``None`` when the client allows
        no such connection (a Cluster client; under gevent/eventlet also TLS and Sentinel):
        the keeper then calls :meth:`extend`. Call it from one thread only.
        """
        natives = green.natives()
        cache: dict[str | None, Any] = self.__dict__.setdefault("_renewers", {})
        if natives.runtime not in cache:
            caller = native_redis.native_caller_for(self.client, natives)
            cache[natives.runtime] = None if caller is None else self._make_renew(caller)
        found: Callable[[Lease, float, float], bool] | None = cache[natives.runtime]
        return found

    def _make_renew(
        self, caller: native_redis.NativeRedisCaller
    ) -> Callable[[Lease, float, float], bool]:
        def renew(lease: Lease, ttl: float, timeout: float) -> bool:
            keys, args = self._extend_arguments(lease, ttl)
            with redis_errors.translate_errors(lease.resource, "lock extend"):
                if not self.wait_replicas:
                    return bool(caller(redis_scripts.EXTEND, keys, args, timeout))
                wait_ms = max(1, min(redis_client.ms(self.wait_timeout), redis_client.ms(timeout)))
                ours, acked = caller(
                    redis_scripts.EXTEND, keys, args, timeout, wait=(self.wait_replicas, wait_ms)
                )
            if bool(ours) and int(acked) < self.wait_replicas:
                caller.close()  # the next renewal asks the Sentinel for the master again
            return self._replicated(lease, bool(ours), int(acked))

        return renew

    def release(self, lease: Lease, *, unused: bool = False) -> bool:
        """Release the lock if ``lease`` still holds it (one round trip). The lock stays as a
        tombstone that keeps the lease's fencing token (see ``backends.redis.keyspace``);
        ``unused=True`` (a lease under which nothing ran, given back at once) deletes it."""
        with redis_errors.translate_errors(lease.resource, "lock release"):
            return bool(
                self._release(
                    keys=[lease.resource, keyspace.fence_name(lease.resource)],
                    args=[lease.token, lease.fencing_token, "1" if unused else "0"],
                )
            )

    def is_locked(self, resource: str) -> bool:
        """Whether anyone holds ``resource`` now (a lease that has ended is not held, though
        its lock stays a while as a tombstone that keeps its fencing token)."""
        return self.holder(resource) is not None

    def holder(self, resource: str) -> str | None:
        """The current holder's lease token (``<fencing token>/<random>@<owner_id>``; a lock
        taken by 0.1.0 holds ``<random>@<owner_id>``), or ``None`` (one round trip)."""
        with redis_errors.translate_errors(resource, "lock check"):
            value = self._holder(keys=[resource])
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    def clear(self) -> None:
        """Delete every lock under ``key_prefix`` (SCAN in batches, never KEYS)."""
        pattern = redis_client.glob_escape(f"{self.key_prefix}lock:") + "*"
        with redis_errors.translate_errors(self.key_prefix, "lock clear"):
            batch: list[Any] = []
            for name in self.client.scan_iter(match=pattern, count=500):
                # bytes, or str from a client made with decode_responses=True
                text = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
                if text.endswith(keyspace.fence_name("")):
                    continue
                batch.append(name)
                if len(batch) >= 500:
                    self._delete(batch)
                    batch = []
            if batch:
                self._delete(batch)

    def _delete(self, names: list[Any]) -> None:
        # One name per DEL: in a cluster the names live in different slots.
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.delete(name)
        pipe.execute()
