"""SQLBackend: the protocol steps of a backend on one SQL table, whichever the dialect.

The steps of each protocol method (claim, acquire, extend, release, get, set, delete, commit,
the publish check and its markers, the lost-reply check, the sweep's schedule) over a
dialect's transactions class. A dialect (:class:`~celery_idempotent.PostgresBackend`,
:class:`~celery_idempotent.MySQLBackend`) is three things on top of this class: its SQL text
(``self.sql``, a ``Statements`` of its ``sql`` module, and the hooks below that put its
statements in order), how its driver's errors read (:meth:`SQLBackend._is_lock_error`,
:meth:`SQLBackend._commit_refusal`) and its connections (a transactions class after this one
in the bases: ``_begin``, ``_run``, ``_rollback``, ``_finish``, ``_alive``, ``autocommit``,
``_connection_of``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from celery_idempotent import transactions
from celery_idempotent.backends.sql.connections import Transaction, ended_by_body, split_url
from celery_idempotent.backends.sql.records import (
    DEFAULT_TABLE,
    check_table,
    decode_row,
    record_columns,
)
from celery_idempotent.core.codec import ResultCodec
from celery_idempotent.core.exceptions import IdempotencyConnectionError, IdempotencyKeyHeldError
from celery_idempotent.core.protocols import Claim, IdempotencyRecord, Lease, PublishDecision
from celery_idempotent.core.states import KeyState
from celery_idempotent.core.validate import check_duration, check_ttl
from celery_idempotent.urls import redact

__all__ = ["SQLBackend", "Statement"]

log = logging.getLogger("celery_idempotent")

#: One statement and its parameters, as the transactions classes run them.
Statement = tuple[str, Sequence[Any]]

#: Pauses (seconds) before a marker change that skipped its row is tried again, while a plain
#: read still shows the marker it was meant for. Those changes never wait for a row lock
#: (``SKIP LOCKED``: a running body holds its row for as long as it runs), so a probe that
#: held the row for a moment (``is_locked``: a status read, the CLI's ``inspect``) made them
#: skip it, and a dead call's marker then blocked its key for ``idempotency_publish_ttl``
#: (seen in the PostgreSQL life-cycle matrix under load). A body's lock outlasts them all
#: (0.155 s): the change is then left to that body's end, as before.
MARKER_RETRY_DELAYS = (0.005, 0.01, 0.02, 0.04, 0.08)


class SQLBackend:
    """Locks and records in one SQL table; the record commits in the body's transaction.

    Not used on its own: a dialect subclasses it together with its transactions class (this
    class first, so that its ``__init__`` runs and then the transactions class's) and fills
    in the hooks. The keywords are the same on every dialect: ``url`` (its query may carry
    ``table`` and ``lock_timeout``, as defaults of the keywords), ``table`` (``schema.table``
    allowed), ``lock_timeout`` (seconds a claim waits for a key's current holder before it
    counts as one failed lock attempt), ``serializer`` and ``accept`` (kombu serializer
    names), ``create_table`` (``False``: never run DDL), ``cleanup_interval`` (seconds at
    least between two bounded sweeps of at most ``cleanup_batch`` expired rows) and
    ``max_idle`` (connections kept open for reuse per process).
    """

    #: The driver this class connects with; a subclass on Django's connection says ``django``
    #: (then no URL is needed and no driver is imported).
    driver: ClassVar[str] = ""
    #: The SQL dialect (the CLI picks its admin module by it).
    dialect: ClassVar[str] = ""
    #: ``lock_timeout`` when neither the keyword nor the URL gives one.
    default_lock_timeout: ClassVar[float] = 0.5

    #: The dialect's statements (a ``Statements`` of its ``sql`` module).
    sql: Any
    _open: dict[str, Transaction]

    if TYPE_CHECKING:  # the dialect's transactions class (a later base) provides these

        def _begin(
            self, key: str, statements: Sequence[Statement]
        ) -> tuple[Transaction, list[Any]]:
            """Open a transaction and run ``statements`` in it."""

        def _run(
            self, tx: Transaction, statements: Sequence[Statement], *, commit: bool
        ) -> list[Any]:
            """Run ``statements`` in ``tx`` (and COMMIT, when asked)."""

        def _rollback(self, tx: Transaction) -> None:
            """Roll ``tx`` back."""

        def _finish(self, tx: Transaction) -> None:
            """``tx`` was committed: its connection goes back to the pool."""

        def _alive(self, tx: Transaction) -> bool:
            """Whether ``tx`` is still open on a healthy connection (no I/O)."""

        def autocommit(self, statements: Sequence[Statement]) -> list[Any]:
            """Run ``statements`` in a transaction of their own and commit."""

        def _connection_of(self, tx: Transaction) -> Any:
            """The connection the body is handed (``current_connection()``)."""

        def close(self) -> None:
            """Close this process's idle connections."""

    def __init__(
        self,
        url: str | None = None,
        *,
        table: str | None = None,
        lock_timeout: Any = None,
        serializer: str = "json",
        accept: Iterable[str] | None = ("json",),
        create_table: bool = True,
        cleanup_interval: Any = 60.0,
        cleanup_batch: int = 500,
        max_idle: int = 8,
    ) -> None:
        options: dict[str, str] = {}
        given = url
        if url is not None:
            url, options = split_url(url)
        self.url = url
        self.table = check_table(
            table if table is not None else options.get("table", DEFAULT_TABLE)
        )
        timeout = lock_timeout if lock_timeout is not None else options.get("lock_timeout")
        if timeout is None:
            timeout = self.default_lock_timeout
        if isinstance(timeout, str):
            try:
                timeout = float(timeout)
            except ValueError:
                raise ValueError(f"lock_timeout must be seconds, got {timeout!r}") from None
        self.lock_timeout = self._check_lock_timeout(timeout)
        self.cleanup_interval = check_duration("cleanup_interval", cleanup_interval)
        if not isinstance(cleanup_batch, int) or cleanup_batch < 1:
            raise ValueError(f"cleanup_batch must be a positive int, got {cleanup_batch!r}")
        if not isinstance(max_idle, int) or max_idle < 0:
            raise ValueError(f"max_idle must be an int >= 0, got {max_idle!r}")
        if not isinstance(create_table, bool):
            raise TypeError(f"create_table must be True or False, got {create_table!r}")
        self.cleanup_batch = cleanup_batch
        self.max_idle = max_idle
        self.create_table = create_table
        self.codec = ResultCodec(serializer, accept)
        self.serializer = serializer
        self.accept = self.codec.accept
        self.sql = self._statements(self.table)
        super().__init__()  # the transactions class's
        self._next_cleanup = time.monotonic() + self.cleanup_interval * _jitter()
        # lease token -> backend pid of a commit whose reply was lost
        self._unconfirmed: dict[str, int | None] = {}
        # row -> (task id, publish ttl) of a marker to queue again once this process's
        # transaction on the row has ended (requeue_marker)
        self._requeue_after: dict[str, tuple[str, float]] = {}
        # whether the marker table of idempotency_publish_until="started" is there (None:
        # not looked yet), and when it was last found missing (looked again after a while)
        self._markers_ready: bool | None = None
        self._markers_missing_at = 0.0
        self._check_driver(given)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url or '')!r}, table={self.table!r})"

    # -- the dialect's hooks --------------------------------------------------------------------

    def _check_lock_timeout(self, seconds: float) -> float:
        """``lock_timeout`` checked (an error names what is wrong), in seconds."""
        return check_duration("lock_timeout", seconds)

    def _statements(self, table: str) -> Any:
        """The dialect's ``Statements`` for ``table``."""
        raise NotImplementedError

    def _check_driver(self, url: str | None) -> None:
        """Fail at construction, with the install line or what is wrong with ``url`` (as
        given), when this class's own driver (not Django's) cannot connect."""
        raise NotImplementedError

    def _is_lock_error(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the driver's "a lock waited past ``lock_timeout``"."""
        raise NotImplementedError

    def _claim_statements(self, row: str, lock_only: bool) -> list[Statement]:
        """The statements of a claim of ``row`` (a lock only: no record look-up)."""
        raise NotImplementedError

    def _claim_begin(
        self, row: str, statements: Sequence[Statement], lock_only: bool, ttl: float = 0.0
    ) -> tuple[Transaction, list[Any]]:
        """Open the claim's transaction with its ``statements`` (``ttl``: the lease's)."""
        return self._begin(row, statements)

    def _claim_result(
        self, tx: Transaction, results: Sequence[Any]
    ) -> tuple[int | None, Sequence[Any]]:
        """From a claim's results: the fencing token when the row is ours (else ``None``),
        and the rows of the record look-up."""
        raise NotImplementedError

    def _probe_statements(self, row: str) -> list[Statement]:
        """The statements of :meth:`is_locked`: a lock error when a transaction holds
        ``row``."""
        raise NotImplementedError

    def _probe_held(self, results: Sequence[Any]) -> bool:
        """From :meth:`_probe_statements`' results (no lock error): whether the unlocked row
        still holds the key (PostgreSQL: a claimed marker within its lease)."""
        return False

    def _waiting(self, statement: Statement) -> list[Statement]:
        """``statement`` waiting at most ``lock_timeout`` for a row's lock: the wait set
        before it (one statement, so its result is the second), reset after it if need be."""
        raise NotImplementedError

    def _upsert(self, row: str, record: IdempotencyRecord, ttl: float) -> Statement:
        """The statement of :meth:`set`: ``record`` into ``row`` for ``ttl`` seconds."""
        raise NotImplementedError

    def _commit_statements(self, tx: Transaction, params: Sequence[Any]) -> list[Statement]:
        """The statements of a commit in ``tx``; ``params`` are the commit's (the record's
        columns, ttl, row, fencing token)."""
        raise NotImplementedError

    def _commit_refusal(self, exc: BaseException) -> str | None:
        """What a commit's error says: ``"fenced"`` (the row is not the lease's: nothing
        committed), ``"ended"`` (the body ended the guard's transaction) or ``None``."""
        raise NotImplementedError

    def _ended(self, tx: Transaction) -> bool | None:
        """Whether the body left the guard's transaction (no I/O): ``None`` while it is still
        in it (or the connection is lost: not the body's doing), ``False`` when it ended it,
        ``True`` when a failed statement aborted it."""
        raise NotImplementedError

    def _publish_statement(self, values: Mapping[str, Any]) -> list[Any]:
        """The publish check's statements in a transaction of their own; the decision's row.
        ``values``: ``key`` (the row), ``tid``, ``fp``, ``now`` and ``ttl``."""
        raise NotImplementedError

    def _quoted_table(self) -> str:
        """The table's name quoted for the dialect's SQL."""
        raise NotImplementedError

    def cleanup(self, limit: int | None = None) -> int:
        """Delete at most ``limit`` (``cleanup_batch``) expired rows, oldest first, skipping
        rows a claim holds; returns how many were deleted. Uses the ``expires_at`` index."""
        raise NotImplementedError

    # -- lock provider ------------------------------------------------------------------------

    def _row(self, key: str) -> str:
        """The row of a record key ``P{K}``: the key itself."""
        return key

    def _lock_row(self, resource: str) -> str:
        """The row of a lock resource: ``P lock:{K}`` shares the row of the record ``P{K}``.

        A prefix ``P`` has no braces (the settings and the guard refuse them), so the first
        ``{`` opens the key, and the ``lock:`` just before it is the lock's, whatever ``P``
        holds (``"mylock:"`` included). A resource of another shape is a row of its own.
        """
        at = resource.find("{")
        if at >= 5 and resource[at - 5 : at] == "lock:":
            return resource[: at - 5] + resource[at:]
        return resource

    def _claim(self, resource: str, row: str, lock_only: bool, ttl: float = 0.0) -> Claim:
        statements = self._claim_statements(row, lock_only)
        try:
            tx, results = self._claim_begin(row, statements, lock_only, ttl)
        except Exception as exc:
            if self._is_lock_error(exc):
                return Claim(None, None)  # held (or a deadlock, rolled back): one failed attempt
            raise
        token, found = self._claim_result(tx, results)
        if token is not None:
            lease = Lease(resource, uuid.uuid4().hex, token)
            tx.lease = lease
            self._open[lease.token] = tx
            transactions.register(lease.token, self._connection_of(tx))
            return Claim(lease, None)
        self._rollback(tx)
        if found:
            return Claim(None, decode_row(self.codec, row, found[0]))
        return Claim(None, None)  # deleted meanwhile: try again

    def acquire(self, resource: str, ttl: float) -> Lease | None:
        """Lock ``resource``'s row in a new transaction (``ttl`` is checked, not used: the
        lease lasts as long as the transaction); ``None`` when held past ``lock_timeout``."""
        check_duration("ttl", ttl)
        return self._claim(resource, self._lock_row(resource), lock_only=True).lease

    def extend(self, lease: Lease, ttl: float) -> bool:
        """``True`` while the lease's transaction is open on a healthy connection (no I/O)."""
        check_duration("ttl", ttl)
        tx = self._open.get(lease.token)
        return tx is not None and self._alive(tx)

    def release(self, lease: Lease) -> bool:
        """Roll back the lease's transaction (the body's writes with it)."""
        tx = self._open.pop(lease.token, None)
        if tx is None:
            return False
        tx.lent = transactions.lent(lease.token)
        transactions.unregister(lease.token)
        alive = self._alive(tx)
        self._rollback(tx)
        self._requeue_pending(tx.key)
        return alive

    def is_locked(self, resource: str) -> bool:
        """Whether a transaction holds ``resource``'s row (or is inserting it) now, or the
        unlocked row still holds the key (PostgreSQL: a claimed marker within its lease, a
        delivery's claim in flight or one whose transaction died with its client)."""
        row = self._lock_row(resource)
        try:
            tx, results = self._begin(row, self._probe_statements(row))
        except Exception as exc:
            if self._is_lock_error(exc):
                return True
            raise
        self._rollback(tx)
        return self._probe_held(results)

    def clear(self) -> None:
        """Roll back this process's open transactions and delete every row of the table."""
        for token in list(self._open):
            tx = self._open.get(token)
            if tx is not None and tx.lease is not None:
                self.release(tx.lease)
        self.autocommit([(f"DELETE FROM {self._quoted_table()}", ())])

    # -- store ----------------------------------------------------------------------------------

    def get(self, key: str) -> IdempotencyRecord | None:
        """The unexpired completed record of ``key`` (not waiting for a running holder)."""
        rows = self.autocommit([(self.sql.select, (self._row(key),))])[0]
        return decode_row(self.codec, key, rows[0]) if rows else None

    def set(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        """Store ``record`` for ``ttl`` seconds in a transaction of its own."""
        ttl = check_duration("ttl", ttl)
        self.autocommit([self._upsert(self._row(key), record, ttl)])

    def delete(self, key: str) -> bool:
        """Delete ``key``'s completed record; ``True`` when there was one. A row that a
        running body's transaction holds is waited for at most ``lock_timeout``, then
        :class:`~celery_idempotent.IdempotencyKeyHeldError` (nothing deleted)."""
        try:
            done = self.autocommit(self._waiting((self.sql.delete, (self._row(key),))))
        except Exception as exc:
            if self._is_lock_error(exc):
                raise IdempotencyKeyHeldError(
                    key, None, None, "a running body's transaction holds the key's row"
                ) from exc
            raise
        return bool(done[1])

    # -- publish side (ChecksPublishes) --------------------------------------------------------

    def checks_publishes(self) -> bool:
        """Whether this backend's SQL has the publish-side statement (a dialect without it
        leaves every publish to the run-time guard)."""
        return hasattr(self.sql, "publish")

    def check_publish(
        self,
        record: str,
        lock: str,
        task_id: str,
        fingerprint: str | None,
        publish_ttl: float,
        *,
        until: str = "completed",
    ) -> PublishDecision:
        """Decide a publish of ``task_id`` in one flight: the key's row holds a live record
        (``completed``), a live queued marker of another call (``queued``, or ``mismatch``
        under another fingerprint; also while that call runs, as a running delivery's row
        shows its marker to other sessions until it commits), or neither: then the marker is
        set and the answer is ``publish``. A row that a running delivery holds without a
        marker (it was published unchecked) and an insert that waited past ``lock_timeout``
        are ``publish`` unchecked: the guard decides at run time. ``lock`` names the same
        row. See each dialect's ``Statements.publish``. ``until="started"``
        (``idempotency_publish_until``): the marker table's check, :meth:`_check_started`."""
        ttl = check_duration("publish_ttl", publish_ttl)
        row = self._row(record)
        if until == "started":
            return self._check_started(record, row, str(task_id), fingerprint, ttl)
        values = {
            "key": row,
            "tid": str(task_id),
            "fp": fingerprint,
            "now": time.time(),
            "ttl": ttl,
        }
        for _ in range(3):  # a concurrent publisher or commit won between read and insert
            try:
                found = self._publish_statement(values)
            except Exception as exc:
                if self._is_lock_error(exc):
                    return PublishDecision("publish", unchecked=True)
                if isinstance(exc, (ConnectionError, OSError)) or _is_operational(exc):
                    raise IdempotencyConnectionError(record, f"publish check: {exc}") from exc
                raise
            decision = self._publish_decision(row, fingerprint, found[0])
            if decision is not None:
                return decision
        return PublishDecision("publish", unchecked=True)

    # -- idempotency_publish_until="started": the marker table ----------------------------------

    #: Whether ``check_publish(..., until="started")`` and the start and end of a call's
    #: markers (:meth:`start_marker`, :meth:`end_marker`) are supported (a capability).
    publishes_until_started = True

    def markers_ready(self, *, create: bool = True) -> bool:
        """Whether the marker table of ``idempotency_publish_until="started"`` exists;
        created first when missing, with ``create`` and ``create_table`` (an install from
        before the mode has none). ``create`` without ``create_table``: a clear error naming
        the DDL to run. A table found missing is looked for again after 30 s."""
        if self._markers_ready:
            return True
        recent = time.monotonic() - self._markers_missing_at < 30.0
        if not create and self._markers_ready is False and recent:
            return False
        params = self.sql.markers_exists_params
        found = bool(self.autocommit([(self.sql.markers_exists, params)])[0][0][0])
        if not found and create:
            if getattr(self, "alias", None) is not None:  # django://, on Django's connection
                from celery_idempotent.backends.sql.django_backend import (  # noqa: PLC0415
                    app_installed,
                )

                if app_installed():
                    raise IdempotencyConnectionError(
                        None,
                        f"the marker table {self.sql.markers} of idempotency_publish_until="
                        "'started' does not exist: with celery_idempotent.contrib.django "
                        "installed the backend runs no DDL; run `manage.py migrate "
                        "celery_idempotent` (its 0002_markers creates it)",
                    )
            if not self.create_table:
                raise IdempotencyConnectionError(
                    None,
                    f"the marker table {self.sql.markers} of idempotency_publish_until="
                    "'started' does not exist and create_table=False: run the DDL of "
                    "'celery -A <app> idempotency sql' first (its CREATE TABLE IF NOT EXISTS "
                    f"{self.sql.markers} and index)",
                )
            self._create_markers()
            found = True
        self._markers_ready = found
        if not found:
            self._markers_missing_at = time.monotonic()
        return found

    def _create_markers(self) -> None:
        """Run the marker table's DDL (the dialect's)."""
        raise NotImplementedError

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
        """:meth:`check_publish` as ``idempotency_publish_until=until`` says (the
        :class:`~celery_idempotent.core.protocols.ChecksPublishesUntil` capability)."""
        return self.check_publish(record, lock, task_id, fingerprint, publish_ttl, until=until)

    def _check_started(
        self, record: str, row: str, task_id: str, fingerprint: str | None, ttl: float
    ) -> PublishDecision:
        """The publish check of ``idempotency_publish_until="started"``: a live queued marker
        of another call stops the publish (``queued``; ``mismatch`` under another fingerprint,
        as a queued key does in the other mode); else a live record is published past
        (unchecked: the worker replays it); otherwise this call's marker takes the key's one
        queued slot and the answer is ``publish``. A running call has no queued marker (its
        delivery ended it as the body started), so one more can queue behind it. Touches the
        marker table only (the key's row is read, never waited for)."""
        self.markers_ready()
        values = {"key": row, "tid": task_id, "fp": fingerprint, "now": time.time(), "ttl": ttl}
        try:
            found = self._started_statement(values)
        except Exception as exc:
            if isinstance(exc, (ConnectionError, OSError)) or _is_operational(exc):
                raise IdempotencyConnectionError(record, f"publish check: {exc}") from exc
            raise
        completed, first, stored_fp, left = found
        if first is None:
            return PublishDecision("publish", unchecked=True)  # past a record (or no answer)
        if first == task_id:
            return PublishDecision("publish", unchecked=completed)
        ttl_left = None if left is None else max(0.0, float(left))
        if fingerprint and stored_fp and stored_fp != fingerprint:
            return PublishDecision(
                "mismatch", first, None, stored_fp, state=KeyState.QUEUED, ttl_left=ttl_left
            )
        return PublishDecision("queued", first, state=KeyState.QUEUED, ttl_left=ttl_left)

    def _started_statement(self, values: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
        """The publish check of ``idempotency_publish_until="started"`` in a transaction of
        its own: (a live record, the queued slot's task id, its fingerprint, its seconds
        left). ``values``: ``key`` (the row), ``tid``, ``fp``, ``now`` and ``ttl``."""
        raise NotImplementedError

    def start_marker(self, record: str, task_id: str, ttl: float) -> None:
        """A body starts (its delivery holds the key's row): its queued marker ends, and the
        key's running slot names ``task_id`` for ``ttl`` seconds at most (what the admin
        reports while the row is held). One flight of its own, before the body runs."""
        row = self._row(record)
        self.markers_ready()
        self.autocommit(
            [
                (self.sql.start_queued, (row, task_id)),
                (self.sql.start_running, (row, task_id, time.time(), check_duration("ttl", ttl))),
            ]
        )

    def end_marker(self, record: str, task_id: str) -> None:
        """The delivery of ``task_id`` ended (the body ran, or a record was replayed): the
        slots that name it end (its running slot; its queued marker, on a replay)."""
        if self.markers_ready(create=False):
            self.autocommit([(self.sql.end_started, (self._row(record), task_id))])

    def started_slots(self, record: str) -> dict[str, tuple[str, float | None, float]]:
        """The live slots of ``record`` in the marker table: ``{slot: (task id, age, ttl)}``
        (``age``: seconds since the publish or the start, by that process's clock)."""
        if not self.markers_ready(create=False):
            return {}
        rows = self.autocommit([(self.sql.started_slots, (self._row(record),))])[0]
        now = time.time()
        found: dict[str, tuple[str, float | None, float]] = {}
        for slot, task_id, _fp, created_at, ttl in rows:
            age = None if created_at is None else max(0.0, now - float(created_at))
            found[str(slot)] = (str(task_id), age, max(0.0, float(ttl)))
        return found

    def forget_markers(self, record: str) -> int:
        """Delete every marker row of ``record`` (forget); how many there were."""
        if not self.markers_ready(create=False):
            return 0
        return int(self.autocommit([(self.sql.forget_markers, (self._row(record),))])[0])

    def forget_markers_like(self, like: str, *, dry_run: bool = False) -> int:
        """Delete (``dry_run``: count) the queued markers whose key is ``LIKE like`` (a
        running slot stays: it is read only while its key's row is held, and replaced)."""
        if not self.markers_ready(create=False):
            return 0
        if dry_run:
            return int(self.autocommit([(self.sql.count_markers_like, (like,))])[0][0][0])
        return int(self.autocommit([(self.sql.forget_markers_like, (like,))])[0])

    def _publish_decision(
        self, row: str, fingerprint: str | None, found: Sequence[Any]
    ) -> PublishDecision | None:
        decided, written = found[0], int(found[1])
        state, stored_fp, ctype, encoding, data, created_at, fence = found[2:9]
        left = None if found[9] is None else max(0.0, float(found[9]))
        if decided == "completed":
            stored = decode_row(
                self.codec, row, (state, stored_fp, ctype, encoding, data, created_at, fence)
            )
            return PublishDecision(
                "completed",
                None,
                stored,
                stored.fingerprint,
                state=KeyState.COMPLETED,
                ttl_left=left,
            )
        if decided == "own":
            return PublishDecision("publish")
        if decided == "queued":
            first = bytes(data).decode("utf-8", "replace") if data is not None else None
            # A claimed marker stops a publish only while its delivery holds the row.
            running = state == "claimed"
            shown, ttl = (KeyState.RUNNING, None) if running else (KeyState.QUEUED, left)
            if fingerprint and stored_fp and stored_fp != fingerprint:
                return PublishDecision(
                    "mismatch", first, None, stored_fp, state=shown, ttl_left=ttl
                )
            return PublishDecision("queued", first, state=shown, ttl_left=ttl)
        if decided == "running":
            return PublishDecision("publish", unchecked=True)
        return PublishDecision("publish") if written else None

    def queued_marker(self, record: str) -> tuple[str, float] | None:
        """``(task id, seconds left)`` of ``record``'s live queued marker, else ``None``."""
        if not self.checks_publishes():
            return None
        rows = self.autocommit([(self.sql.queued, (self._row(record),))])[0]
        if not rows:
            return None
        data, ttl = rows[0]
        return bytes(data).decode("utf-8", "replace"), float(ttl)

    def queued_marker_info(self, record: str) -> tuple[str, float, float | None, bool] | None:
        """``(task id, seconds left, age, claimed)`` of ``record``'s live queued marker, else
        ``None``: ``age`` is seconds since its publish (the publisher's clock), ``claimed``
        whether a delivery claimed it before it was queued again (a published retry,
        ``Reject(requeue=True)``). ``None`` on a dialect whose statements lack it."""
        statement = getattr(self.sql, "queued_info", None)
        if statement is None or not self.checks_publishes():
            return None
        rows = self.autocommit([(statement, (self._row(record),))])[0]
        if not rows:
            return None
        data, ttl, created_at, claimed = rows[0]
        age = None if created_at is None else max(0.0, time.time() - float(created_at))
        return bytes(data).decode("utf-8", "replace"), float(ttl), age, bool(claimed)

    def requeue_marker(self, record: str, task_id: str, publish_ttl: float) -> bool:
        """The running delivery of ``task_id`` went back to the queue (a published retry,
        ``Reject(requeue=True)``): its claimed marker is queued again for ``publish_ttl``
        seconds. While this process's transaction holds the row the change waits for that
        transaction to end (it would roll the change back, or wait on itself)."""
        ttl = check_duration("publish_ttl", publish_ttl)
        row = self._row(record)
        if any(tx.key == row for tx in list(self._open.values())):
            self._requeue_after[row] = (str(task_id), ttl)
            return True
        return self._requeue_now(row, str(task_id), ttl)

    def _requeue_now(self, row: str, task_id: str, ttl: float) -> bool:
        change: Statement = (self.sql.requeue_marker, (ttl, row, task_id))
        done = bool(self.autocommit([change])[0])
        check = getattr(self.sql, "claimed_named", None)
        return done or (check is not None and self._marker_retry(change, (check, (row, task_id))))

    def _marker_retry(self, change: Statement, check: Statement) -> bool:
        """Try ``change`` again after :data:`MARKER_RETRY_DELAYS` while ``check`` (a plain
        read, which never waits) still finds the row it is meant for; whether it was made."""
        for delay in MARKER_RETRY_DELAYS:
            if not self.autocommit([check])[0]:
                return False  # changed or gone meanwhile: nothing left to do
            time.sleep(delay)
            if self.autocommit([change])[0]:
                return True
        return False

    def _requeue_pending(self, row: str) -> None:
        pending = self._requeue_after.pop(row, None)
        if pending is not None:
            try:
                self._requeue_now(row, *pending)
            except Exception as exc:  # the key is then free: an extra message at most
                log.warning("could not re-queue the marker of %s: %r", row, exc)

    def drop_queued(self, record: str, task_id: str) -> bool:
        """Delete ``task_id``'s queued marker row of ``record``; ``False`` when the row holds
        something else (a record committed since, another call's marker) or is gone."""
        row = self._row(record)
        statements: list[Statement] = [(self.sql.drop_queued, (row, str(task_id)))]
        try:
            if self.markers_ready(create=False):  # a marker of the "started" mode
                statements.append((self.sql.start_queued, (row, str(task_id))))
            done = self.autocommit(statements)
            check = getattr(self.sql, "marker_named", None)
            if not done[0] and check is not None:
                done[0] = self._marker_retry(statements[0], (check, (row, str(task_id))))
        except Exception as exc:
            if isinstance(exc, (ConnectionError, OSError)) or _is_operational(exc):
                raise IdempotencyConnectionError(record, f"queued marker delete: {exc}") from exc
            raise
        return any(bool(each) for each in done)

    def atomic_with(self, lock_provider: Any) -> SQLBackend | None:
        """Itself when ``lock_provider`` is this very backend: claim and commit in one step."""
        return self if lock_provider is self else None

    # -- atomic backend ---------------------------------------------------------------------------

    def claim(self, resource: str, key: str, ttl: float) -> Claim:
        """Lock ``key``'s row in a new transaction, unless it holds an unexpired record (then
        that record, no lease); ``Claim(None, None)`` when held past ``lock_timeout``."""
        ttl = check_duration("ttl", ttl)
        return self._claim(resource, self._row(key), lock_only=False, ttl=ttl)

    def commit(self, lease: Lease, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        """Write the record into the lease's transaction and COMMIT it (with the body's
        writes). ``False`` when the lease is no longer ours. A connection error raises
        ``ConnectionError`` (the outcome is open); called again after one, it answers from
        the database whether this lease's record was committed. ``ttl == 0``
        (``idempotency_ttl=0``): the row is written already expired, so nothing is kept."""
        ttl = check_ttl("ttl", ttl)
        row = self._row(key)
        tx = self._open.get(lease.token)
        if tx is None:
            pending = self._unconfirmed.pop(lease.token, None)
            if pending is None:
                return False
            try:
                return self._verify(lease, row, pending)
            except ConnectionError:
                self._unconfirmed[lease.token] = pending
                raise
        ended = self._ended(tx)
        if ended is not None:
            self.release(lease)
            raise ended_by_body(aborted=ended)
        if not self._alive(tx):
            self.release(lease)
            return False
        params = (*record_columns(self.codec, key, record), ttl, row, lease.fencing_token)
        tx.lent = transactions.lent(lease.token)
        try:
            self._run(tx, self._commit_statements(tx, params), commit=True)
        except ConnectionError:
            self._forget(lease, tx)  # the verification runs on another connection
            self._unconfirmed[lease.token] = tx.pid
            raise
        except Exception as exc:
            self._forget(lease, tx)
            self._rollback(tx)
            self._requeue_pending(tx.key)
            refusal = self._commit_refusal(exc)
            if refusal == "fenced":
                return False  # the row is not this lease's: nothing committed
            if refusal == "ended":
                raise ended_by_body(aborted=False) from exc
            raise
        self._forget(lease, tx)
        self._finish(tx)
        self._requeue_after.pop(tx.key, None)  # the record replaced the marker
        self._maybe_cleanup()
        return True

    def _forget(self, lease: Lease, tx: Transaction) -> None:
        tx.lent = tx.lent or transactions.lent(lease.token)
        self._open.pop(lease.token, None)
        transactions.unregister(lease.token)

    def _verify(self, lease: Lease, row: str, pid: int | None) -> bool:
        """After a lost commit reply: the record is there with this lease's token (True),
        or the server has ended the session that sent the commit without it (False); while
        that session still exists the outcome is open (ConnectionError)."""
        rows, alive = self.autocommit([(self.sql.verify, (row,)), (self.sql.session, (pid,))])
        if rows and rows[0][0] == "completed" and rows[0][1] == lease.fencing_token:
            return True
        if alive and alive[0][0]:
            raise ConnectionError("the session that sent the commit is still open on the server")
        return False

    def _maybe_cleanup(self) -> None:
        now = time.monotonic()
        if now < self._next_cleanup:
            return
        self._next_cleanup = now + self.cleanup_interval * _jitter()
        try:
            self.cleanup()
        except Exception as exc:  # never fail a committed delivery over housekeeping
            log.warning(
                "celery-idempotent: sweeping expired rows of %s failed: %r", self.table, exc
            )


def _is_operational(exc: BaseException) -> bool:
    """A driver's "the server or the connection failed" (psycopg's, PyMySQL's or Django's)."""
    return any(cls.__name__ in ("OperationalError", "InterfaceError") for cls in type(exc).__mro__)


def _jitter() -> float:
    import random  # noqa: PLC0415

    return 0.5 + random.random()  # noqa: S311 - spreads the sweeps of many processes


def statements_of(script: str) -> list[str]:
    """The statements of a DDL script (``;`` at a line's end ends one)."""
    return [each.strip() for each in script.split(";\n") if each.strip()]
