"""What Redis holds for one idempotency key, read in one script: :class:`KeyInfo`.

:func:`read_key` reads a key's record (without its payload unless asked), lock and fence key
with the ``READ_KEY`` script, so the view is consistent and works on a Redis Cluster client.
:mod:`celery_idempotent.admin` turns it into a status, or deletes what it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_idempotent import keyspace as task_keys
from celery_idempotent.backends.redis import admin_scripts as redis_admin_scripts
from celery_idempotent.backends.redis import client as redis_client
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis.keyspace import fence_name, lock_name, record_name
from celery_idempotent.core.codec import serializer_info
from celery_idempotent.core.states import IN_PROGRESS, KeyState

if TYPE_CHECKING:
    import redis

__all__ = ["KeyInfo", "read_key"]


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)


def _ttl(pttl: Any) -> float | None:
    """Seconds left from a PTTL reply; ``None`` for a missing key or one without expiry."""
    value = int(pttl)
    return value / 1000 if value >= 0 else None


def _int(value: Any) -> int | None:
    text = _text(value)
    try:
        return int(text) if text else None
    except ValueError:
        return None


@dataclass
class KeyInfo:
    """What Redis holds for one idempotency key, read in one round trip (one script).

    ``state`` is ``"completed"`` (a record exists), ``"in_progress"`` (no record, the lock is
    held) or ``"absent"``. The payload is not read unless asked for (``raw``); ``size`` is its
    length in bytes. ``last_fence`` is the highest fencing token the key's keys carry (record,
    lock, fence key); ``fence_ttl`` the fence key's time left (it exists only while the server
    clock is behind a token, or for up to 7 days after 0.1.0 wrote it).
    """

    key: str
    record_name: str
    lock_name: str
    fence_name: str
    record: dict[str, Any] | None
    record_ttl: float | None
    lock_token: str | None
    lock_ttl: float | None
    last_fence: int | None
    fence_ttl: float | None
    #: The stored record, payload included (only when read ``with_data``): the v2 string, or
    #: the values of the v1 hash's fields.
    raw: Any = None
    #: The record's layout: ``"2"``, or ``"1"`` for a record written by 0.1.0.
    layout: str | None = None
    #: The fencing token of the lease that holds the lock now.
    lease_fence: int | None = None
    #: The fence key's value (``None``: there is no fence key).
    fence_value: int | None = None
    #: The task id of the call a queued marker stands for (published, not committed yet).
    queued_task_id: str | None = None
    #: The queued marker's time left (``idempotency_publish_ttl`` at most).
    queued_ttl: float | None = None
    #: When the queued call was published (epoch seconds, the server's clock), where the
    #: marker says (``None``: a marker written before issue 22).
    queued_at: float | None = None
    #: Whether a delivery ever claimed the key over the marker (``"c"`` claimed now, ``"r"``
    #: claimed then re-queued), or ``None`` without a marker.
    queued_claimed: bool | None = None
    #: The task id of a claimed marker whose delivery's lease has ended without a commit (a
    #: body that failed, a killed worker): it stands for nothing, the key is free (SPEC §8).
    dead_marker_task_id: str | None = None

    @property
    def queued_behind(self) -> bool:
        """Whether the queued marker is a call waiting behind the running one: no delivery
        claimed it and the lock is held (``idempotency_publish_until="started"``: the running
        call's claim ended its own marker)."""
        return (
            self.lock_token is not None
            and self.queued_task_id is not None
            and self.queued_claimed is False
        )

    @property
    def running_task_id(self) -> str | None:
        """The task id of the call whose body runs (the lock is held): the claimed marker's,
        or, with a call queued behind it, the one its lease's token carries; ``None`` when
        neither says."""
        if self.lock_token is None:
            return None
        if self.queued_behind or self.queued_task_id is None:
            return redis_client.task_of_token(self.lock_token)
        return self.queued_task_id

    def queued_age(self, now: float) -> float | None:
        """Seconds since the queued call was published (``None``: unknown or no marker)."""
        if self.queued_at is None or self.queued_task_id is None:
            return None
        return max(0.0, now - self.queued_at)

    @property
    def state(self) -> str:
        """``"completed"``, ``"in_progress"``, ``"queued"`` (published, its body not started)
        or ``"absent"``."""
        if self.record is not None:
            return KeyState.COMPLETED
        if self.lock_token is not None:
            return IN_PROGRESS
        if self.queued_task_id is not None:
            return KeyState.QUEUED
        return KeyState.ABSENT

    @property
    def holder(self) -> str | None:
        """The owner id of the lock's holder (the token after ``@``), or ``None``."""
        if self.lock_token is None:
            return None
        return keyspace.parse_lease_token(self.lock_token)[1]

    def age(self, now: float) -> float | None:
        """Seconds since the record was committed, by the committing worker's clock."""
        at = (self.record or {}).get("committed_at")
        # Records stamped by a custom (non-epoch) guard clock have no meaningful age.
        if at is None or at < 1e9:
            return None
        return max(0.0, now - float(at))

    def as_json(self, now: float) -> dict[str, Any]:
        """A JSON-ready description (seconds as floats, ``None`` for what does not exist)."""
        record = None
        if self.record is not None:
            record = {
                "name": self.record_name,
                **self.record,
                "age": self.age(now),
                "ttl": self.record_ttl,
            }
        return {
            "key": self.key,
            "task": task_keys.task_of_slot(self.key),
            "state": self.state,
            "record": record,
            "lock": {
                "name": self.lock_name,
                "held": self.lock_token is not None,
                "holder": self.holder,
                "ttl": self.lock_ttl,
                "task_id": self.running_task_id,
            },
            "fence": {"name": self.fence_name, "last": self.last_fence, "ttl": self.fence_ttl},
            "queued": None
            if self.queued_task_id is None
            else {
                "task_id": self.queued_task_id,
                "ttl": self.queued_ttl,
                "age": self.queued_age(now),
                "claimed": self.queued_claimed,
            },
        }


def read_key(client: redis.Redis, prefix: str, key: str, *, with_data: bool = False) -> KeyInfo:
    """Read the record (without its payload unless ``with_data``), lock and fence of ``key``.

    ``key`` is the namespaced key (``<task>:key:payment-42``); the names are derived as the
    guard derives them. One script (``READ_KEY``): the three names share a hash slot, so this
    also works on a Redis Cluster client (with any redis-py), and the view is consistent.
    Records of layout v1 (0.1.0) are read as well.
    """
    rname = record_name(prefix, key)
    lname = lock_name(prefix, key)
    fname = fence_name(lname)
    read = client.register_script(redis_admin_scripts.READ_KEY)
    reply = read(keys=[lname, rname, fname], args=["1" if with_data else "0"])
    kind, rec, size, rttl, token, lttl, fence, fttl = reply
    kind = _text(kind)
    record: dict[str, Any] | None = None
    layout: str | None = None
    raw: Any = None
    queued: keyspace.Marker | None = None
    if kind == "string" and rec is not None:
        value = rec.encode("utf-8", "surrogateescape") if isinstance(rec, str) else bytes(rec)
        queued = keyspace.parse_marker(value)
        try:
            fields = keyspace.decode_record(value, rname)
        except ValueError:
            fields = None
        if fields is not None:
            layout, raw = keyspace.RECORD_VERSION, value if with_data else None
            info = serializer_info(fields.serializer)
            header = len(value) - len(fields.data)
            record = {
                "version": layout,
                # kombu's content type for the serializer, or its name itself when unknown
                "content_type": info.content_type if info else fields.serializer,
                "encoding": info.content_encoding if info else None,
                "size": int(size) - header,
                "fingerprint": fields.fingerprint,
                "committed_at": fields.created_at,
                "fencing_token": fields.fencing_token,
                "task_id": fields.task_id,
            }
    elif kind == "hash" and rec:
        meta = dict(zip(keyspace.V1_RECORD_FIELDS, rec))
        if any(v is not None for v in rec):
            layout, raw = keyspace.V1_VERSION, list(rec) if with_data else None
            at = _text(meta["at"])
            try:
                committed_at = float(at) if at else None
            except ValueError:
                committed_at = None
            record = {
                "version": _text(meta["v"]),
                "content_type": _text(meta["ct"]),
                "encoding": _text(meta["enc"]),
                "size": int(size),
                "fingerprint": _text(meta["fp"]) or None,
                "committed_at": committed_at,
                "fencing_token": _int(meta["fence"]),
                "task_id": None,
            }
    lock_token = _text(token)
    dead: str | None = None
    if queued is not None and queued.state == keyspace.MARKER_CLAIMED and lock_token is None:
        # Claimed, and the lock holds no valid lease: the delivery ended without a commit.
        dead, queued = queued.task_id, None
    lease_fence = keyspace.parse_lease_token(lock_token)[0] if lock_token else None
    fence_key = _int(fence)
    known = [
        f
        for f in (fence_key, lease_fence, (record or {}).get("fencing_token"))
        if isinstance(f, int)
    ]
    return KeyInfo(
        key=key,
        record_name=rname,
        lock_name=lname,
        fence_name=fname,
        record=record,
        record_ttl=_ttl(rttl) if record is not None else None,
        lock_token=lock_token,
        lock_ttl=_ttl(lttl) if token is not None else None,
        last_fence=max(known) if known else None,
        fence_ttl=_ttl(fttl) if fence is not None else None,
        raw=raw,
        layout=layout,
        lease_fence=lease_fence,
        fence_value=fence_key,
        queued_task_id=None if queued is None else queued.task_id,
        queued_ttl=_ttl(rttl) if queued is not None else None,
        queued_at=None
        if queued is None or queued.published_ms is None
        else queued.published_ms / 1000.0,
        queued_claimed=None if queued is None else queued.ever_claimed,
        dead_marker_task_id=dead,
    )
