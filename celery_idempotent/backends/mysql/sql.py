"""The MySQL / MariaDB backend's tables: their DDL and the SQL of every step.

:mod:`celery_idempotent.backends.mysql` runs these statements; nothing here opens a
connection. A row holds a record as the PostgreSQL backend's does
(:func:`~celery_idempotent.backends.sql.records.record_columns`,
:func:`~celery_idempotent.backends.sql.records.decode_row`, shared).

Every timestamp is the server's ``UTC_TIMESTAMP(6)``: it does not depend on a session's
``time_zone``, so workers whose sessions differ still agree when a record expires.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_idempotent.backends.sql.records import DEFAULT_TABLE, check_table

__all__ = [
    "DEFAULT_TABLE",
    "FENCED",
    "LOCK_ERRORS",
    "MAX_KEY",
    "SAVEPOINT_GONE",
    "AdminStatements",
    "Statements",
    "check_server",
    "check_table",
    "ddl",
    "error_code",
    "lock_seconds",
    "markers_ddl",
    "quote_table",
]

#: The longest key a row holds (characters): the primary key is ``VARCHAR(700)`` in
#: ``utf8mb4`` (2,800 bytes, under InnoDB's 3,072-byte index limit).
MAX_KEY = 700
#: A lock wait that ran out (``innodb_lock_wait_timeout``; MariaDB's ``NOWAIT`` too), MySQL's
#: ``NOWAIT`` refusal, and a deadlock (InnoDB rolled the whole transaction back).
LOCK_ERRORS = frozenset({1205, 3572, 1213})
#: ``Result consisted of more than one row``: raised on purpose by
#: :attr:`Statements.fenced` when the commit's UPDATE found no row of this lease.
FENCED = 1172
#: ``SAVEPOINT does not exist``: the claim's savepoint (:attr:`Statements.mark`) is gone, so
#: the guard's transaction ended inside the body (a raw COMMIT, ROLLBACK or DDL, and maybe a
#: new BEGIN): the commit is refused.
SAVEPOINT_GONE = 1305
#: Where an expired or never-written row's ``expires_at`` points (DATETIME's first year).
PAST = "1000-01-01 00:00:00"


#: The oldest servers the backend runs on: ``SKIP LOCKED`` (the claim's free-row read, the
#: sweep, the admin's listing) arrived in MySQL 8.0.1 and MariaDB 10.6.
MIN_MYSQL = (8, 0, 1)
MIN_MARIADB = (10, 6, 0)


def server_version(info: str) -> tuple[str, tuple[int, int, int]]:
    """``("mariadb" | "mysql", (major, minor, patch))`` of a server's version string
    (``SELECT VERSION()``, the handshake's ``server_version``), e.g. ``10.11.6-MariaDB-0+deb12u1``
    or ``8.0.36``; MariaDB 10's replication prefix ``5.5.5-`` is skipped."""
    text = info.strip()
    flavour = "mariadb" if "mariadb" in text.lower() else "mysql"
    if flavour == "mariadb" and text.startswith("5.5.5-"):
        text = text[len("5.5.5-") :]
    numbers = []
    for part in text.split("-", 1)[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    if len(numbers) < 2:
        raise ValueError(f"cannot read a MySQL / MariaDB server version from {info!r}")
    major, minor, patch = (*numbers, 0, 0)[:3]
    return flavour, (major, minor, patch)


def check_server(info: str) -> str | None:
    """Why the server whose version string is ``info`` is refused (it lacks ``SKIP LOCKED``),
    or ``None`` if it is new enough: MySQL 8.0.1+, MariaDB 10.6+."""
    flavour, version = server_version(info)
    floor = MIN_MARIADB if flavour == "mariadb" else MIN_MYSQL
    if version >= floor:
        return None
    name = "MariaDB" if flavour == "mariadb" else "MySQL"
    need = ".".join(map(str, floor if floor[2] else floor[:2]))
    return (
        f"the MySQL backend needs MySQL 8.0.1+ or MariaDB 10.6+ (for SELECT ... FOR UPDATE "
        f"SKIP LOCKED); this server is {name} {'.'.join(map(str, version))} ({info}), "
        f"older than {name} {need}"
    )


def quote_table(table: str) -> str:
    """``table`` (``name`` or ``database.name``) quoted for MySQL."""
    return ".".join(f"`{part}`" for part in table.split("."))


def _names(table: str) -> tuple[str, str, str]:
    """(database part with its dot or '', table name, fencing table's quoted name)."""
    name = table.rsplit(".", maxsplit=1)[-1]
    schema = table[: -len(name)]
    return schema, name, quote_table(schema + name + "_fencing")


def ddl(table: str = DEFAULT_TABLE) -> str:
    """The SQL that creates the backend's two tables (idempotent: ``IF NOT EXISTS``), for
    teams that run DDL themselves (``celery -A app idempotency sql --url mysql://...``).

    ``<table>_fencing`` holds no rows: its ``AUTO_INCREMENT`` counter draws the fencing
    tokens (never rolled back, persisted across restarts by MySQL 8 and MariaDB 10.2.4+).
    Do not ``TRUNCATE`` it: that resets the counter, and tokens would start again from 1.
    """
    check_table(table)
    _schema, name, fencing = _names(table)
    t = quote_table(table)
    return (
        f"CREATE TABLE IF NOT EXISTS {t} (\n"
        f"    `key`            VARCHAR({MAX_KEY}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin "
        "NOT NULL,\n"
        "    state            VARCHAR(16) NOT NULL,   -- 'completed' (committed rows)\n"
        "    fencing_token    BIGINT,\n"
        "    fingerprint      TEXT,\n"
        "    content_type     VARCHAR(255),\n"
        "    content_encoding VARCHAR(64),\n"
        "    result           LONGBLOB,\n"
        "    created_at       DOUBLE,\n"
        "    expires_at       DATETIME(6) NOT NULL,   -- UTC\n"
        "    PRIMARY KEY (`key`),\n"
        f"    INDEX `{name}_expires_at` (expires_at)\n"
        ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;\n"
        f"CREATE TABLE IF NOT EXISTS {fencing} (\n"
        "    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY\n"
        ") ENGINE=InnoDB;\n" + markers_ddl(table)
    )


def markers_ddl(table: str = DEFAULT_TABLE) -> str:
    """The SQL that creates ``table``'s marker table (``<table>_markers``, idempotent) of
    ``idempotency_publish_until="started"``, as on PostgreSQL
    (:func:`celery_idempotent.backends.postgres.sql.markers_ddl`): one row per key and slot,
    ``queued`` or ``running``. Created at the first use of the mode."""
    check_table(table)
    schema, name, _ = _names(table)
    return (
        f"CREATE TABLE IF NOT EXISTS {quote_table(schema + name + '_markers')} (\n"
        f"    `key`        VARCHAR({MAX_KEY}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin "
        "NOT NULL,\n"
        "    slot         VARCHAR(16) CHARACTER SET ascii NOT NULL,   -- 'queued' or 'running'\n"
        "    task_id      VARCHAR(255) NOT NULL,\n"
        "    fingerprint  TEXT,\n"
        "    created_at   DOUBLE,                 -- the publisher's (starter's) clock\n"
        "    expires_at   DATETIME(6) NOT NULL,   -- UTC\n"
        "    PRIMARY KEY (`key`, slot),\n"
        f"    INDEX `{name}_markers_expires_at` (expires_at)\n"
        ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;\n"
    )


def error_code(exc: BaseException | None) -> int | None:
    """The MySQL error number of ``exc`` (PyMySQL, mysqlclient, or Django's wrapper of
    either: its ``__cause__``), or ``None``."""
    for each in (exc, getattr(exc, "__cause__", None)):
        args = getattr(each, "args", None)
        if args and isinstance(args[0], int):
            return args[0]
    return None


def lock_seconds(timeout: float) -> int:
    """``innodb_lock_wait_timeout`` for a wait of ``timeout`` seconds: whole seconds, rounded
    up (0: no wait, on MariaDB; MySQL waits at least 1 second)."""
    whole = int(timeout)
    return whole if whole == timeout else whole + 1


class Statements:
    """The SQL of one table (``%s`` parameters, as PyMySQL and Django's engine take them)."""

    def __init__(self, table: str) -> None:
        t = quote_table(table)
        schema, name, fencing = _names(table)
        self.table = table
        self.fencing = fencing
        now = "UTC_TIMESTAMP(6)"
        fields = "state, fingerprint, content_type, content_encoding, result, created_at, "
        fields += "fencing_token"
        # The guard's statements need READ COMMITTED, set for each of its transactions (the
        # body's writes share it, as on PostgreSQL, whose default it is): under InnoDB's
        # REPEATABLE READ the sweep's range scan of expires_at would take gap locks, and
        # every first claim inserts its row into that range (expires_at = PAST), so claims
        # would queue behind a sweep. The claim's own reads are locking reads of one primary
        # key, which see the latest committed row at any level.
        self.isolation = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
        # lock_timeout for the claim only; the body's statements get the session's own back.
        self.wait = (
            "SET @celery_idem_wait = @@SESSION.innodb_lock_wait_timeout, "
            "SESSION innodb_lock_wait_timeout = %s"
        )
        self.wait_reset = (
            "SET SESSION innodb_lock_wait_timeout = "
            "COALESCE(@celery_idem_wait, @@SESSION.innodb_lock_wait_timeout)"
        )
        # The key's row, inserted when missing, exclusively locked either way: ON DUPLICATE
        # KEY UPDATE takes an X lock on an existing row (INSERT IGNORE would take a shared
        # one, and two duplicates each holding it would deadlock on the way to X). A holder's
        # row (or its uncommitted insert) makes this wait, at most innodb_lock_wait_timeout.
        self.insert = (
            f"INSERT INTO {t} (`key`, state, fencing_token, expires_at) "
            f"VALUES (%s, 'running', 0, '{PAST}') ON DUPLICATE KEY UPDATE `key` = `key`"
        )
        # A new fencing token, drawn after the row lock is ours (successive holders draw in
        # order): the fencing table's AUTO_INCREMENT, whose row is deleted again at once.
        self.draw = f"INSERT INTO {fencing} () VALUES ()"
        self.drop = f"DELETE FROM {fencing} WHERE id = LAST_INSERT_ID()"
        # Claim: the row is ours unless it holds an unexpired record.
        self.claim = (
            f"UPDATE {t} SET state = 'running', fencing_token = LAST_INSERT_ID() "
            f"WHERE `key` = %s AND (state <> 'completed' OR expires_at <= {now})"
        )
        # Lock only (LockProvider.acquire): the row whatever it holds.
        self.lock = f"UPDATE {t} SET fencing_token = LAST_INSERT_ID() WHERE `key` = %s"
        # The claim's mark in its transaction: a savepoint lives only as long as the
        # transaction, so the commit's RELEASE of it fails when the body ended the guard's
        # transaction and began another ("COMMIT; BEGIN": in a transaction again, the status
        # flag alone cannot tell). It runs first, before the UPDATE could wait on a row lock.
        self.mark = "SAVEPOINT celery_idempotent_claim"
        self.unmark = "RELEASE SAVEPOINT celery_idempotent_claim"
        self.token = "SELECT LAST_INSERT_ID()"  # noqa: S105 - SQL, not a password
        self.select = (
            f"SELECT {fields} FROM {t} WHERE `key` = %s AND state = 'completed' "
            f"AND expires_at > {now}"
        )
        # Commit: only the lease's own row. No row: `fenced` raises (a SELECT ... INTO of two
        # rows), which stops the statements sent with it, so the COMMIT after it never runs
        # and the body's writes are rolled back with the claim.
        self.commit = (
            f"UPDATE {t} SET state = 'completed', fingerprint = %s, content_type = %s, "
            "content_encoding = %s, result = %s, created_at = %s, "
            f"expires_at = {now} + INTERVAL ROUND(%s * 1000000) MICROSECOND "
            "WHERE `key` = %s AND fencing_token = %s"
        )
        self.fenced = (
            "SELECT 1 FROM (SELECT 1 UNION ALL SELECT 2) AS two WHERE ROW_COUNT() < 1 "
            "INTO @celery_idem_fenced"
        )
        # After a lost reply: did this lease's commit land? (With the session check below.)
        self.verify = f"SELECT state, fencing_token FROM {t} WHERE `key` = %s"
        self.session = "SELECT COUNT(*) > 0 FROM information_schema.PROCESSLIST WHERE ID = %s"
        values = (
            "state = 'completed', fencing_token = %s, fingerprint = %s, content_type = %s, "
            "content_encoding = %s, result = %s, created_at = %s, "
            f"expires_at = {now} + INTERVAL ROUND(%s * 1000000) MICROSECOND"
        )
        self.upsert = f"INSERT INTO {t} SET `key` = %s, {values} ON DUPLICATE KEY UPDATE {values}"
        self.delete = (
            f"DELETE FROM {t} WHERE `key` = %s AND state = 'completed' AND expires_at > {now}"
        )
        self.delete_any = f"DELETE FROM {t} WHERE `key` = %s"
        self.probe = f"SELECT 1 FROM {t} WHERE `key` = %s FOR UPDATE NOWAIT"
        # The sweep, in two steps of one transaction (a DELETE cannot skip locked rows):
        # the oldest expired rows no claim holds, then those rows.
        self.expired = (
            f"SELECT `key` FROM {t} WHERE expires_at < {now} ORDER BY expires_at LIMIT %s "
            "FOR UPDATE SKIP LOCKED"
        )
        # The publish side's check (ChecksPublishes.check_publish), as the PostgreSQL backend's
        # one statement decides it, in one flight of a transaction of its own (MySQL has no
        # data-modifying CTE: user variables carry the steps' findings). A queued marker is a
        # row in state 'queued' whose result holds the task id (utf-8), whose fingerprint is
        # the call's and which expires after the publish ttl; a claim takes it as a free row,
        # a commit overwrites it with the record.
        #   seen:    the row as committed (a consistent read: never waits)
        #   free:    the row if no transaction holds it (SKIP LOCKED: never waits), now ours
        #   decide:  'completed', 'own' (this task id's live marker), 'queued', 'running' (a
        #            row held without a live marker: published unchecked) or 'mark'
        #   put:     the marker, when 'mark'; onto an existing row only if `free` locked it
        #            (a row that appeared since `seen` is left alone: the caller asks again).
        #            The insert may wait for a key's first claim (its row not committed):
        #            past lock_timeout that is "publish unchecked"
        #   result:  the decision, whether the marker is this call's now, and what was seen
        found = "@ci_state, @ci_fp, @ci_ct, @ci_ce, @ci_res, @ci_ca, @ci_fence"
        self.publish_reset = (
            "SET @ci_state = NULL, @ci_fp = NULL, @ci_ct = NULL, @ci_ce = NULL, "
            "@ci_res = NULL, @ci_ca = NULL, @ci_fence = NULL, @ci_live = NULL, @ci_ttl = NULL, "
            "@ci_free = NULL, @ci_d = NULL"
        )
        self.publish_seen = (
            f"SELECT {fields}, expires_at > {now}, "
            f"TIMESTAMPDIFF(MICROSECOND, {now}, expires_at) / 1e6 FROM {t} WHERE `key` = %s "
            f"INTO {found}, @ci_live, @ci_ttl"
        )
        self.publish_free = (
            f"SELECT `key` FROM {t} WHERE `key` = %s FOR UPDATE SKIP LOCKED INTO @ci_free"
        )
        self.publish_decide = (
            "SET @ci_d = CASE WHEN @ci_state IS NULL THEN 'mark' "
            "WHEN @ci_live AND @ci_state = 'completed' THEN 'completed' "
            "WHEN @ci_live AND @ci_state = 'queued' THEN "
            "IF(@ci_res = CAST(%s AS BINARY), 'own', 'queued') "
            "WHEN @ci_free IS NULL THEN 'running' ELSE 'mark' END"
        )
        keep = "@ci_free IS NULL"
        self.publish = (
            f"INSERT INTO {t} (`key`, state, fingerprint, content_type, content_encoding, "
            "result, created_at, expires_at) SELECT %s, 'queued', %s, NULL, NULL, "
            f"CAST(%s AS BINARY), %s, {now} + INTERVAL ROUND(%s * 1000000) MICROSECOND "
            "FROM DUAL WHERE @ci_d = 'mark' ON DUPLICATE KEY UPDATE "
            f"state = IF({keep}, state, 'queued'), "
            f"fingerprint = IF({keep}, fingerprint, VALUES(fingerprint)), "
            f"content_type = IF({keep}, content_type, NULL), "
            f"content_encoding = IF({keep}, content_encoding, NULL), "
            f"result = IF({keep}, result, VALUES(result)), "
            f"created_at = IF({keep}, created_at, VALUES(created_at)), "
            f"expires_at = IF({keep}, expires_at, VALUES(expires_at))"
        )
        self.publish_result = (
            f"SELECT @ci_d, (SELECT COUNT(*) FROM {t} WHERE `key` = %s AND state = 'queued' "
            f"AND result = CAST(%s AS BINARY)) * (@ci_d = 'mark'), {found}, @ci_ttl"
        )
        self.queued = (
            f"SELECT result, TIMESTAMPDIFF(MICROSECOND, {now}, expires_at) / 1e6 FROM {t} "
            f"WHERE `key` = %s AND state = 'queued' AND expires_at > {now}"
        )
        self.drop_queued = (
            f"DELETE FROM {t} WHERE `key` = %s AND state = 'queued' AND result = CAST(%s AS BINARY)"
        )
        self.schema = schema.rstrip(".")
        self.exists = (
            "SELECT COUNT(*) = 2 FROM information_schema.TABLES WHERE "
            "TABLE_SCHEMA = COALESCE(NULLIF(%s, ''), DATABASE()) AND TABLE_NAME IN (%s, %s)"
        )
        self.exists_params: tuple[Any, ...] = (self.schema, name, name + "_fencing")
        self._started(t, schema, name, now)

    def _started(self, t: str, schema: str, name: str, now: str) -> None:
        """The statements of ``idempotency_publish_until="started"`` on the marker table, as
        the PostgreSQL backend's (same names); none waits for a key's row."""
        self.markers = schema + name + "_markers"
        m = quote_table(self.markers)
        live = f"expires_at > {now}"
        self.markers_exists = (
            "SELECT COUNT(*) = 1 FROM information_schema.TABLES WHERE "
            "TABLE_SCHEMA = COALESCE(NULLIF(%s, ''), DATABASE()) AND TABLE_NAME = %s"
        )
        self.markers_exists_params: tuple[Any, ...] = (self.schema, name + "_markers")
        # The publish check, in one flight of a transaction of its own (see the PostgreSQL
        # statement): a live record (a consistent read: never waits); the queued slot taken
        # when there is no record and it is free (expires_at is assigned last: the other
        # assignments read the old value); then whose the slot is (after the upsert our own
        # row version: the winner's marker).
        self.started_rec = (
            f"SELECT COUNT(*) FROM {t} WHERE `key` = %s AND state = 'completed' AND {live} "
            "INTO @ci_rec"
        )
        gone = f"expires_at <= {now}"
        self.started_put = (
            f"INSERT INTO {m} (`key`, slot, task_id, fingerprint, created_at, expires_at) "
            f"SELECT %s, 'queued', %s, %s, %s, {now} + INTERVAL ROUND(%s * 1000000) MICROSECOND "
            "FROM DUAL WHERE @ci_rec = 0 ON DUPLICATE KEY UPDATE "
            f"task_id = IF({gone}, VALUES(task_id), task_id), "
            f"fingerprint = IF({gone}, VALUES(fingerprint), fingerprint), "
            f"created_at = IF({gone}, VALUES(created_at), created_at), "
            f"expires_at = IF({gone}, VALUES(expires_at), expires_at)"
        )
        self.started_seen = (
            f"SELECT @ci_rec > 0, q.task_id, q.fingerprint, "
            f"TIMESTAMPDIFF(MICROSECOND, {now}, q.expires_at) / 1e6 FROM (SELECT 1) AS one "
            f"LEFT JOIN {m} AS q ON q.`key` = %s AND q.slot = 'queued' AND q.{live}"
        )
        self.start_queued = f"DELETE FROM {m} WHERE `key` = %s AND slot = 'queued' AND task_id = %s"
        self.start_running = (
            f"INSERT INTO {m} (`key`, slot, task_id, fingerprint, created_at, expires_at) "
            f"VALUES (%s, 'running', %s, NULL, %s, {now} + INTERVAL ROUND(%s * 1000000) "
            "MICROSECOND) ON DUPLICATE KEY UPDATE task_id = VALUES(task_id), "
            "created_at = VALUES(created_at), expires_at = VALUES(expires_at)"
        )
        self.end_started = f"DELETE FROM {m} WHERE `key` = %s AND task_id = %s"
        self.started_slots = (
            "SELECT slot, task_id, fingerprint, created_at, "
            f"TIMESTAMPDIFF(MICROSECOND, {now}, expires_at) / 1e6 FROM {m} "
            f"WHERE `key` = %s AND {live}"
        )
        self.forget_markers = f"DELETE FROM {m} WHERE `key` = %s"
        self.count_markers_like = (
            f"SELECT COUNT(*) FROM {m} WHERE `key` LIKE %s AND slot = 'queued' AND {live}"
        )
        self.forget_markers_like = f"DELETE FROM {m} WHERE `key` LIKE %s AND slot = 'queued'"
        self.cleanup_markers = (
            f"DELETE FROM {m} WHERE expires_at < {now} ORDER BY expires_at LIMIT %s"
        )

    def delete_keys(self, keys: Sequence[str]) -> list[tuple[str, tuple[str]]]:
        """One ``DELETE`` by primary key per key (the sweep's second step): ``key IN (...)``
        may be planned as a scan on a small table, which would wait on the rows a running
        claim holds; a primary-key lookup touches only its own row, locked by us already."""
        return [(self.delete_any, (key,)) for key in keys]


class AdminStatements:
    """The SQL of the admin's reads and deletes (``inspect``, ``forget``, ``stats``) on one
    table: MySQL's / MariaDB's text, run by
    :class:`~celery_idempotent.backends.sql.admin.SqlAdmin` (the same logic as on
    PostgreSQL, whose ``sql.py`` holds its own text)."""

    #: Whether a queued row says if a delivery claimed it (no ``requeue_marker`` here).
    says_claimed = False

    def __init__(self, table: str) -> None:
        t = quote_table(table)
        now = "UTC_TIMESTAMP(6)"
        self.table = table
        self.row = (
            "SELECT state, fencing_token, fingerprint, content_type, content_encoding, "
            f"LENGTH(result), created_at, TIMESTAMPDIFF(MICROSECOND, {now}, expires_at) / 1e6, "
            f"result FROM {t} WHERE `key` = %s"
        )
        self.count = f"SELECT count(*) FROM {t} WHERE `key` LIKE %s"
        self.free = f"SELECT `key` FROM {t} WHERE `key` LIKE %s FOR UPDATE SKIP LOCKED"
        self.live = (
            f"SELECT `key`, state = 'completed' AND expires_at > {now} FROM {t} WHERE `key` LIKE %s"
        )
        # InnoDB's SKIP LOCKED skips a row only against a conflicting lock: an exclusive one
        # sees every row a running body holds.
        self.unheld = f"SELECT `key` FROM {t} WHERE `key` LIKE %s FOR UPDATE SKIP LOCKED"
        self._probe = f"SELECT `key` FROM {t} WHERE `key` = %s FOR UPDATE NOWAIT"
        self._delete = f"DELETE FROM {t} WHERE `key` = %s"

    def forget_row(self, row: str, lock_timeout: float) -> list[tuple[str, tuple[Any, ...]]]:
        """Delete one row unless a running body holds it (``NOWAIT``: then
        :meth:`lock_refused`); the last statement's count is the rows deleted."""
        del lock_timeout  # NOWAIT: a held row is refused at once
        return [(self._probe, (row,)), (self._delete, (row,))]

    def delete_keys(self, keys: Sequence[str]) -> list[tuple[str, tuple[Any, ...]]]:
        """One ``DELETE`` by primary key per key (see :meth:`Statements.delete_keys`)."""
        return [(self._delete, (key,)) for key in keys]

    @staticmethod
    def lock_refused(exc: BaseException) -> bool:
        """Whether ``exc`` says a running body holds the row (a lock wait refused)."""
        return error_code(exc) in LOCK_ERRORS
