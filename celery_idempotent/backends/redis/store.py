"""The Redis store: one string per record (layout v2), results through kombu's serializers.

Results are encoded with kombu (as Celery's result backend encodes them) and decoded only with
an explicit accept list: JSON unless the user accepts more. A record whose content type is not
accepted (a pickle planted by whoever can write to the Redis) raises ``RecordDecodeError`` and
is never deserialized.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from celery_idempotent.backends.redis import client as redis_client
from celery_idempotent.backends.redis import errors as redis_errors
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis import lean as redis_lean
from celery_idempotent.backends.redis import publish_scripts as redis_publish_scripts
from celery_idempotent.backends.redis import scripts as redis_scripts
from celery_idempotent.backends.redis.locks import RedisLockProvider
from celery_idempotent.backends.redis.publish_scripts import PublishReply
from celery_idempotent.backends.redis.scripts import ClaimReply
from celery_idempotent.core.codec import ResultCodec, serializer_info
from celery_idempotent.core.exceptions import (
    IdempotencyBackendError,
    IdempotencyConnectionError,
    RecordDecodeError,
)
from celery_idempotent.core.protocols import Claim, IdempotencyRecord, Lease, PublishDecision
from celery_idempotent.core.states import KeyState
from celery_idempotent.core.validate import check_count, check_duration

__all__ = ["PublishDecision", "RedisAtomicBackend", "RedisIdempotencyStore", "claims_end_marker"]

log = logging.getLogger("celery_idempotent")


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _seconds_left(pttl: Any) -> float | None:
    """A PTTL reply as seconds (``None`` for a name without a TTL, or gone: -1, -2)."""
    value = int(pttl)
    return value / 1000 if value >= 0 else None


class RedisIdempotencyStore:
    """Committed results in Redis, each one string (layout v2) with a server-side TTL.

    Pass a ready ``client`` or a ``url``. ``serializer`` is a kombu serializer name (``"json"``,
    ``"msgpack"``, ``"yaml"``, ``"pickle"``) used to store results; ``accept`` lists the
    serializer names or content types a stored result may be loaded from. Pickle is loaded only
    when ``accept`` names it.

    Paired with a :class:`RedisLockProvider` on the same server (see :meth:`atomic_with`), the
    guard claims and commits in one round trip each.

    ``wait_replicas`` (0: off) makes every write wait, with Redis ``WAIT``, until that many
    replicas have it, for at most ``wait_timeout`` seconds; ``WAIT`` travels in the same
    round trip. A claim that took the lock but did not reach them is given back and fails
    with :class:`IdempotencyConnectionError` before the body runs; a commit that did not
    reach them fails the same way, which the guard answers by sending the commit again until
    it is confirmed or ``lock_ttl`` has passed (then ``CommitUnknownError``). This closes the
    window in which a master that Sentinel has already replaced, but not yet demoted, takes a
    claim or a commit that its demotion throws away. Not with ``RedisCluster`` clients.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        url: str | None = None,
        serializer: str = "json",
        accept: Iterable[str] | None = ("json",),
        wait_replicas: int = 0,
        wait_timeout: Any = 1.0,
    ) -> None:
        self.client = redis_client.make_client(client, url, "RedisIdempotencyStore")
        self.wait_replicas = check_count("wait_replicas", wait_replicas)
        self.wait_timeout = check_duration("wait_timeout", wait_timeout)
        self._loaded: set[str] = set()  # SHAs of scripts loaded by eval_and_wait
        if self.wait_replicas and getattr(self.client, "nodes_manager", None) is not None:
            raise ValueError(
                "RedisIdempotencyStore: wait_replicas is not supported with a RedisCluster "
                f"client (got wait_replicas={wait_replicas!r}); use 0"
            )
        self.codec = ResultCodec(serializer, accept)
        self.accept = self.codec.accept
        self.serializer = serializer
        if redis_client.decodes_responses(self.client):
            binary = self.codec.binary_serializers()
            if binary:
                raise ValueError(
                    f"RedisIdempotencyStore: the client decodes responses to str "
                    f"(decode_responses=True), which cannot carry the binary payloads of "
                    f"{', '.join(binary)}; pass a client with decode_responses=False"
                )
        self._commit = self.client.register_script(redis_scripts.COMMIT)
        self._publish = self.client.register_script(redis_publish_scripts.PUBLISH)
        self._publish_and_push = self.client.register_script(redis_publish_scripts.PUBLISH_AND_PUSH)
        self._drop_queued = self.client.register_script(redis_publish_scripts.DROP_QUEUED)
        self._requeue_marker = self.client.register_script(redis_publish_scripts.REQUEUE_MARKER)
        # The claim, commit and publish scripts' transport (see backends/redis/lean.py); None:
        # through the client (Cluster, a blocking pool, an instrumented client ...).
        self._lean = redis_lean.lean_for(self.client)

    def run_script(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """``script(keys=keys, args=args)`` (a script registered on this store's client), on
        the lean path when the client can take it: the same reply, the same errors."""
        lean = self._lean
        if lean is None:
            return script(keys=keys, args=args)
        return lean(script, keys, args)

    def __repr__(self) -> str:
        wait = f", wait_replicas={self.wait_replicas}" if self.wait_replicas else ""
        return (
            f"RedisIdempotencyStore(client={self.client!r}, serializer={self.serializer!r}{wait})"
        )

    # -- replication ------------------------------------------------------------------------

    def _wait_ms(self) -> int:
        return redis_client.ms(self.wait_timeout)

    def check_replicated(self, key: str, acked: Any, what: str) -> None:
        """Raise :class:`IdempotencyConnectionError` when ``acked`` (WAIT's reply) is below
        ``wait_replicas``."""
        if int(acked) < self.wait_replicas:
            redis_client.rediscover(self.client)
            raise IdempotencyConnectionError(
                key,
                f"the {what} reached {int(acked)} of the {self.wait_replicas} replica(s) "
                f"wait_replicas asks for within {self.wait_timeout:g}s: this master may be "
                "about to lose it (a failover, a replica down)",
            )

    def eval_and_wait(self, script: Any, keys: list[Any], args: list[Any]) -> tuple[Any, Any]:
        """Run ``script`` and ``WAIT`` in one round trip: (the script's reply, WAIT's reply).

        ``EVALSHA`` is sent as it is (a pipeline given the ``Script`` itself would ask
        ``SCRIPT EXISTS`` first, a round trip more); a server that does not know the script
        yet gets it loaded once, then the pair is sent again.

        Each script is loaded once (``SCRIPT LOAD``) before this store first sends it: an
        ``EVALSHA`` refused with ``NOSCRIPT`` still leaves its ``WAIT`` to block for
        ``wait_timeout`` when no replica can answer, and that wasted wait could outlast the
        lease before the script is sent again (a first commit after a replica went away would
        then find its lease gone). A new master after a failover may still lack a script: the
        resend below covers that rarer case.
        """
        if script.sha not in self._loaded:
            script.sha = self.client.script_load(script.script)
            self._loaded.add(script.sha)
        for attempt in (0, 1):
            pipe = self.client.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.wait(self.wait_replicas, self._wait_ms())
            reply, acked = pipe.execute(raise_on_error=False)
            if (
                isinstance(reply, redis_client.import_redis().exceptions.NoScriptError)
                and not attempt
            ):
                script.sha = self.client.script_load(script.script)
                continue
            for value in (reply, acked):
                if isinstance(value, Exception):
                    raise value
            return reply, acked
        raise AssertionError("unreachable")  # pragma: no cover

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, key: str, record: IdempotencyRecord) -> bytes:
        """The stored form of ``record`` (see ``backends.redis.keyspace``);
        ResultEncodeError if the serializer refuses the result."""
        data = self.codec.dumps(key, record.result)
        return keyspace.encode_record(
            name=key,
            fencing_token=record.fencing_token,
            created_at=record.created_at,
            serializer=self.serializer,
            fingerprint=record.fingerprint,
            task_id=record.task_id,
            data=data,
        )

    def decode(self, key: str, value: Any) -> IdempotencyRecord:
        """A record from its stored form (a v2 string); RecordDecodeError if refused."""
        if isinstance(value, str):  # a client with decode_responses=True
            value = value.encode("utf-8", "surrogateescape")
        try:
            fields = keyspace.decode_record(value, key)
        except ValueError as exc:
            raise RecordDecodeError(key, None, f"corrupt record: {exc}") from exc
        info = serializer_info(fields.serializer)
        if info is None:
            raise RecordDecodeError(
                key,
                None,
                f"stored result was written with serializer {fields.serializer!r}, which kombu "
                "does not know here; it was not loaded",
            )
        return self._load(
            key, fields._replace(content_type=info.content_type, encoding=info.content_encoding)
        )

    def decode_v1(self, key: str, values: Sequence[Any]) -> IdempotencyRecord:
        """A record from the values of a layout-v1 hash (0.1.0); RecordDecodeError if refused."""
        if len(values) != len(keyspace.V1_RECORD_FIELDS) or any(v is None for v in values):
            raise RecordDecodeError(key, None, "stored record is incomplete or not ours")
        if _text(values[0]) != keyspace.V1_VERSION:
            raise RecordDecodeError(key, _text(values[1]), f"unknown record version {values[0]!r}")
        try:
            fields = keyspace.decode_v1_record(list(values))
        except ValueError as exc:
            raise RecordDecodeError(key, _text(values[1]), f"corrupt record: {exc}") from exc
        return self._load(key, fields)

    def _load(self, key: str, fields: keyspace.DecodedRecord) -> IdempotencyRecord:
        result = self.codec.loads(key, fields.content_type, fields.encoding, fields.data)
        return IdempotencyRecord(
            result=result,
            fingerprint=fields.fingerprint,
            created_at=fields.created_at,
            fencing_token=fields.fencing_token,
            task_id=fields.task_id,
        )

    # -- IdempotencyStore -------------------------------------------------------------------

    def get(self, key: str) -> IdempotencyRecord | None:
        """The record under ``key``, or ``None`` (one round trip; two for a v1 record)."""
        wrong_type = redis_client.import_redis().exceptions.ResponseError
        with redis_errors.translate_errors(key, "store get"):
            try:
                try:
                    value = self.client.get(key)
                except wrong_type as exc:
                    if "WRONGTYPE" not in str(exc):
                        raise
                    values = self.client.hmget(key, list(keyspace.V1_RECORD_FIELDS))
                    if all(v is None for v in values):
                        return None
                    return self.decode_v1(key, values)
            except UnicodeDecodeError as exc:  # binary payload on a decoding client
                raise RecordDecodeError(key, None, f"undecodable record: {exc}") from exc
        if value is None:
            return None
        return self.decode(key, value)

    def set(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        """Replace the record under ``key``, for ``ttl`` seconds (one round trip)."""
        ttl = check_duration("ttl", ttl)
        value = self.encode(key, record)
        with redis_errors.translate_errors(key, "store set"):
            if not self.wait_replicas:
                self.client.set(key, value, px=redis_client.ms(ttl))
                return
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, value, px=redis_client.ms(ttl))
            pipe.wait(self.wait_replicas, self._wait_ms())
            _, acked = pipe.execute()
        self.check_replicated(key, acked, "record")

    def delete(self, key: str) -> bool:
        """Delete the record under ``key``; ``True`` when there was one."""
        with redis_errors.translate_errors(key, "store delete"):
            return bool(self.client.delete(key))

    # -- the publish side (IdempotentTask.apply_async) --------------------------------------

    def check_publish(
        self,
        record: str,
        lock: str,
        task_id: str,
        fingerprint: str | None,
        publish_ttl: float,
        *,
        push: tuple[str, bytes | str] | None = None,
        until: str = "completed",
    ) -> PublishDecision:
        """Decide a publish in one round trip (the ``PUBLISH`` script): set the queued marker
        for ``task_id`` and say "publish", or say why not (see :class:`PublishDecision`).

        ``push``: ``(list name, message)`` of a broker on this Redis: when the decision is
        "publish", the message is ``LPUSH``-ed in the same script (``PUBLISH_AND_PUSH``).
        ``until``: ``idempotency_publish_until`` (``"started"``: stopped only while queued)."""
        args: list[Any] = [
            task_id,
            fingerprint or "",
            redis_client.ms(publish_ttl),
            "started" if until == "started" else "",
        ]
        with redis_errors.translate_errors(record, "publish check"):
            if push is None:
                reply = self.run_script(self._publish, [lock, record], args)
            else:
                reply = self.run_script(
                    self._publish_and_push, [lock, record, push[0]], [*args, push[1]]
                )
        status = int(reply[0])
        if status == PublishReply.PUBLISH:
            return PublishDecision("publish")
        if status == PublishReply.COMPLETED:
            stored = self.decode(record, reply[1])
            return PublishDecision(
                "completed",
                stored.task_id,
                stored,
                stored.fingerprint,
                state=KeyState.COMPLETED,
                ttl_left=_seconds_left(reply[2]),
            )
        if status == PublishReply.COMPLETED_V1:
            stored = self.decode_v1(record, reply[1:])
            return PublishDecision(
                "completed", None, stored, stored.fingerprint, state=KeyState.COMPLETED
            )
        if status == PublishReply.MISMATCH:
            return PublishDecision("mismatch", _text(reply[1]), None, _text(reply[2]))
        if status == PublishReply.QUEUED:
            # A running call's marker lives as long as its lease (renewed): no time is known.
            running = bool(int(reply[2]))
            return PublishDecision(
                "queued",
                _text(reply[1]),
                state=KeyState.RUNNING if running else KeyState.QUEUED,
                ttl_left=None if running else _seconds_left(reply[3]),
            )
        if status != PublishReply.UNCHECKED:
            raise IdempotencyBackendError(record, f"the publish check replied {reply!r}")
        return PublishDecision("publish", unchecked=True)

    def check_publish_until(
        self,
        record: str,
        lock: str,
        task_id: str,
        fingerprint: str | None,
        publish_ttl: float,
        *,
        until: str,
    ) -> PublishDecision:
        """:meth:`check_publish` with ``until`` (the ``ChecksPublishesUntil`` capability)."""
        return self.check_publish(record, lock, task_id, fingerprint, publish_ttl, until=until)

    def drop_unclaimed(self, record: str, lock: str, task_id: str) -> bool:
        """:meth:`drop_queued` with ``lock`` (the ``KeepsClaimedMarkers`` capability)."""
        return self.drop_queued(record, task_id, lock=lock)

    def key_client(self) -> Any:
        """This store's client (the ``InspectsKeys`` capability: the admin layer reads it)."""
        return self.client

    def drop_queued(self, record: str, task_id: str, *, lock: str | None = None) -> bool:
        """Delete ``task_id``'s queued marker under ``record``; ``False`` when it is not there
        (committed since, expired, or another call's). With ``lock`` (the key's lock name), a
        marker that a delivery claimed is kept while that delivery's lease is valid."""
        keys = [record] if lock is None else [lock, record]
        with redis_errors.translate_errors(record, "queued marker delete"):
            return bool(self.run_script(self._drop_queued, keys, [task_id]))

    def requeue_marker(self, record: str, task_id: str, publish_ttl: float) -> bool:
        """Put ``task_id``'s claimed marker back to queued (state ``r``) for ``publish_ttl``
        seconds: its message went back to the queue (a published retry, a requeue). Called
        by the claiming delivery while its lease is valid. ``False``: no such marker."""
        args: list[Any] = [task_id, redis_client.ms(publish_ttl)]
        with redis_errors.translate_errors(record, "queued marker requeue"):
            return bool(self.run_script(self._requeue_marker, [record], args))

    # -- pairing ----------------------------------------------------------------------------

    def atomic_with(self, lock_provider: Any) -> RedisAtomicBackend | None:
        """A one-round-trip claim/commit pair when ``lock_provider`` is a
        :class:`RedisLockProvider` on the same server or deployment (Cluster, Sentinel
        service), else ``None``: the guard then calls the lock provider and the store one
        after the other, and a WARNING says why."""
        reason = self.pairing_problem(lock_provider)
        if reason is None:
            return RedisAtomicBackend(self, lock_provider)
        log.warning(
            "celery-idempotent: claims and commits take 2-4 round trips each instead of one "
            "script: %s",
            reason,
        )
        return None

    def pairing_problem(self, lock_provider: Any) -> str | None:
        """Why ``lock_provider`` and this store cannot decide in one script, or ``None``."""
        if not isinstance(lock_provider, RedisLockProvider):
            return (
                f"the lock provider is a {type(lock_provider).__name__}, not a "
                "RedisLockProvider on this store's Redis"
            )
        return redis_client.why_not_same_server(self.client, lock_provider.client)


#: The task id whose queued marker a claim in this context ends when it takes the lock
#: (``idempotency_publish_until="started"``; see :func:`claims_end_marker`).
_claim_ends: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "celery_idempotent_claim_ends", default=None
)


@contextlib.contextmanager
def claims_end_marker(task_id: str | None) -> Iterator[None]:
    """Within the block, a claim that takes the lock also deletes ``task_id``'s queued marker,
    in the same script (the call has started: ``idempotency_publish_until="started"``)."""
    token = _claim_ends.set(task_id)
    try:
        yield
    finally:
        _claim_ends.reset(token)


class RedisAtomicBackend:
    """Claim (lock + look up) and commit (store + release) as one Lua script each."""

    def __init__(self, store: RedisIdempotencyStore, locks: RedisLockProvider) -> None:
        self.store = store
        self.locks = locks
        self._claim = store.client.register_script(redis_scripts.CLAIM)
        self._end = store.client.register_script(redis_scripts.END)

    def ending_marker(self, task_id: str) -> contextlib.AbstractContextManager[None]:
        """:func:`claims_end_marker` (the ``EndsMarkerAtClaim`` capability)."""
        return claims_end_marker(task_id)

    def claim(self, resource: str, key: str, ttl: float) -> Claim:
        """See :class:`~celery_idempotent.core.protocols.AtomicBackend` (one round trip)."""
        ends = _claim_ends.get()
        token = redis_client.new_token(self.locks.owner_id, ends or None)
        keys = [resource, key, keyspace.fence_name(resource)]
        args: list[Any] = [token, redis_client.ms(ttl)]
        if ends:
            args.append(ends)
        acked: Any = None
        with redis_errors.translate_errors(key, "claim"):
            try:
                if self.store.wait_replicas:
                    reply, acked = self.store.eval_and_wait(self._claim, keys, args)
                else:
                    reply = self.store.run_script(self._claim, keys, args)
            except UnicodeDecodeError as exc:  # only a found record carries a payload
                raise RecordDecodeError(key, None, f"undecodable record: {exc}") from exc
        status = int(reply[0])
        if status == ClaimReply.TAKEN:
            fence = int(reply[1])
            lease = Lease(resource, keyspace.lock_value(fence, token), fence)
            if acked is not None and int(acked) < self.store.wait_replicas:
                # Taken on a server whose replicas do not have it: give it back (a master
                # about to be demoted would lose it anyway) before anything runs under it.
                # Nothing ran under its token, so none is kept (no tombstone).
                with contextlib.suppress(Exception):  # else it expires within ttl
                    self.locks.release(lease, unused=True)
                self.store.check_replicated(key, acked, "claim")
            return Claim(lease, None)
        if status == ClaimReply.RECORD:
            return Claim(None, self.store.decode(key, reply[1]))
        if status == ClaimReply.V1_RECORD:
            return Claim(None, self.store.decode_v1(key, reply[1:]))
        if status == ClaimReply.FOREIGN:
            raise IdempotencyBackendError(
                key,
                f"the record's name {key!r} holds a value that is not a celery-idempotent "
                "record (WRONGTYPE for layout v2); it was left alone and nothing ran",
            )
        if status != ClaimReply.HELD:
            raise IdempotencyBackendError(key, f"the claim replied {reply!r}")
        return Claim(None, None)

    def commit(self, lease: Lease, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        """See :class:`~celery_idempotent.core.protocols.AtomicBackend` (one round trip).
        ``ttl == 0``: the ``END`` script (nothing stored, the delivery's queued marker ended)."""
        keys = [lease.resource, key, keyspace.fence_name(lease.resource)]
        script = self.store._commit
        args: list[Any]
        if ttl:
            value = self.store.encode(key, record)
            args = [lease.token, redis_client.ms(ttl), value, lease.fencing_token]
        else:
            script = self._end
            args = [lease.token, record.task_id or "", lease.fencing_token]
        with redis_errors.translate_errors(key, "commit"):
            if not self.store.wait_replicas:
                return bool(self.store.run_script(script, keys, args))
            reply, acked = self.store.eval_and_wait(script, keys, args)
        if reply:
            self.store.check_replicated(key, acked, "commit")
        return bool(reply)
