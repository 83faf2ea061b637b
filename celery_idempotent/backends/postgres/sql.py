"""The PostgreSQL backend's table: its DDL, the SQL of every step, and how a row holds a record.

:mod:`celery_idempotent.backends.postgres` runs these statements; nothing here opens a connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_idempotent.backends.sql.records import (
    DEFAULT_TABLE,
    check_table,
    decode_row,
    record_columns,
)

__all__ = [
    "DEFAULT_TABLE",
    "DIVISION_BY_ZERO",
    "ENDED_MARK",
    "INVALID_TEXT_REPRESENTATION",
    "LOCK_NOT_AVAILABLE",
    "PUBLISH_PARAMS",
    "STARTED_PARAMS",
    "AdminStatements",
    "Statements",
    "check_table",
    "ddl",
    "decode_row",
    "is_pg_error",
    "markers_ddl",
    "markers_table",
    "quote_table",
    "record_columns",
]

LOCK_NOT_AVAILABLE = "55P03"
DIVISION_BY_ZERO = "22012"
INVALID_TEXT_REPRESENTATION = "22P02"
#: In the error :attr:`Statements.same_transaction` raises when the transaction changed.
ENDED_MARK = "celery-idempotent: the guard's transaction was ended in the body"


def quote_table(table: str) -> str:
    """``table`` (``name`` or ``schema.name``) quoted for SQL."""
    return ".".join(f'"{part}"' for part in table.split("."))


def ddl(table: str = DEFAULT_TABLE) -> str:
    """The SQL that creates the backend's table, index and sequence (idempotent: ``IF NOT
    EXISTS``), for teams that run DDL themselves (``celery -A app idempotency sql``)."""
    check_table(table)
    name = table.rsplit(".", maxsplit=1)[-1]
    schema = table[: -len(name)]
    t = quote_table(table)
    return (
        f"CREATE TABLE IF NOT EXISTS {t} (\n"
        "    key              text PRIMARY KEY,\n"
        "    state            text NOT NULL,          -- 'completed' (committed rows)\n"
        "    fencing_token    bigint,\n"
        "    fingerprint      text,\n"
        "    content_type     text,\n"
        "    content_encoding text,\n"
        "    result           bytea,\n"
        "    created_at       double precision,\n"
        "    expires_at       timestamptz NOT NULL\n"
        ");\n"
        f'CREATE INDEX IF NOT EXISTS "{name}_expires_at" ON {t} (expires_at);\n'
        f"CREATE SEQUENCE IF NOT EXISTS {quote_table(schema + name + '_fencing')};\n"
        + markers_ddl(table)
    )


def markers_table(table: str) -> str:
    """The name of ``table``'s marker table (``<table>_markers``, same schema)."""
    name = table.rsplit(".", maxsplit=1)[-1]
    return table[: -len(name)] + name + "_markers"


def markers_ddl(table: str = DEFAULT_TABLE) -> str:
    """The SQL that creates ``table``'s marker table (idempotent), the markers of
    ``idempotency_publish_until="started"``: one row per key and slot, ``queued`` (a call
    published whose body has not started) and ``running`` (the call whose body runs: its
    task id, for the admin). The publish check of that mode reads and writes only these rows,
    so it never waits for the key's row, which a running body holds locked. Created at the
    first use of the mode (an install from before it has no such table; ``create_table=False``
    needs this DDL run first: ``celery -A app idempotency sql``)."""
    check_table(table)
    m = markers_table(table)
    name = m.rsplit(".", maxsplit=1)[-1]
    return (
        f"CREATE TABLE IF NOT EXISTS {quote_table(m)} (\n"
        "    key              text NOT NULL,\n"
        "    slot             text NOT NULL,          -- 'queued' or 'running'\n"
        "    task_id          text NOT NULL,\n"
        "    fingerprint      text,\n"
        "    created_at       double precision,       -- the publisher's (starter's) clock\n"
        "    expires_at       timestamptz NOT NULL,\n"
        "    PRIMARY KEY (key, slot)\n"
        ");\n"
        f'CREATE INDEX IF NOT EXISTS "{name}_expires_at" ON {quote_table(m)} (expires_at);\n'
    )


def is_pg_error(exc: BaseException, code: str) -> bool:
    """Whether ``exc`` (or, under Django, its cause) is the PostgreSQL error ``code``."""
    for each in (exc, exc.__cause__):
        if each is not None and (
            getattr(each, "sqlstate", None) == code or getattr(each, "pgcode", None) == code
        ):
            return True
    return False


class Statements:
    """The SQL of one table."""

    def __init__(self, table: str) -> None:
        t = quote_table(table)
        name = table.rsplit(".", maxsplit=1)[-1]
        schema = table[: -len(name)]
        self.table = table
        self.seq = f"{schema}{name}_fencing"
        fields = "state, fingerprint, content_type, content_encoding, result, created_at, "
        fields += "fencing_token"
        self.lock_timeout = "SELECT set_config('lock_timeout', %s, true)"
        self.lock_timeout_reset = "SET LOCAL lock_timeout TO DEFAULT"
        # A row to lock: inserted when missing (visible only to this transaction until it
        # commits). A concurrent insert of the same key makes this wait for that transaction
        # (lock_timeout applies); an existing row is left alone, unlocked.
        self.insert = (
            f"INSERT INTO {t} (key, state, fencing_token, expires_at) "
            "VALUES (%s, 'running', 0, '-infinity') ON CONFLICT (key) DO NOTHING"
        )
        # Claim: lock the row (waiting for its holder) unless it holds an unexpired record;
        # the token is drawn after the lock is ours, so successive holders draw in order.
        self.claim = (
            f"UPDATE {t} SET state = 'running', fencing_token = nextval('{self.seq}') "
            "WHERE key = %s AND (state <> 'completed' OR expires_at <= statement_timestamp()) "
            "RETURNING fencing_token, txid_current()"
        )
        # Lock only (LockProvider.acquire): the row whatever it holds.
        self.lock = (
            f"UPDATE {t} SET fencing_token = nextval('{self.seq}') WHERE key = %s "
            "RETURNING fencing_token, txid_current()"
        )
        # Sent first in a commit's flight: an error unless the transaction is still the one
        # the claim was made in (its id, from the claim's RETURNING). A body that sent COMMIT
        # or ROLLBACK and then BEGIN (raw SQL) is in a new transaction: the row lock and
        # whatever it wrote before are gone, so nothing may commit as if they were not. The
        # error is a cast of a text that depends on a volatile call (so the planner cannot
        # fold it away): 22P02 with ENDED_MARK in its message, in the server's log too.
        mark = ENDED_MARK.replace("'", "''")
        self.same_transaction = (
            f"SELECT ('{mark} (transaction ' || coalesce(txid_current_if_assigned()::text, "
            "'none') || ')')::int WHERE txid_current_if_assigned() IS DISTINCT FROM %s"
        )
        self.select = (
            f"SELECT {fields} FROM {t} WHERE key = %s AND state = 'completed' "
            "AND expires_at > statement_timestamp()"
        )
        # Commit: only the lease's own row; no row -> division by zero, which aborts the
        # transaction so that the COMMIT sent with it commits nothing (body's writes included).
        self.commit = (
            f"WITH done AS (UPDATE {t} SET state = 'completed', fingerprint = %s, "
            "content_type = %s, content_encoding = %s, result = %s, created_at = %s, "
            "expires_at = statement_timestamp() + make_interval(secs => %s) "
            "WHERE key = %s AND fencing_token = %s RETURNING 1) "
            "SELECT 1 / (SELECT count(*)::int FROM done)"
        )
        # After a lost reply: did this lease's commit land? (With the session check below.)
        self.verify = f"SELECT state, fencing_token FROM {t} WHERE key = %s"
        self.session = "SELECT count(*) > 0 FROM pg_stat_activity WHERE pid = %s"
        self.upsert = (
            f"INSERT INTO {t} (key, state, fencing_token, fingerprint, content_type, "
            "content_encoding, result, created_at, expires_at) VALUES (%s, 'completed', "
            "%s, %s, %s, %s, %s, %s, "
            "statement_timestamp() + make_interval(secs => %s)) ON CONFLICT (key) DO UPDATE "
            "SET state = 'completed', fencing_token = EXCLUDED.fencing_token, "
            "fingerprint = EXCLUDED.fingerprint, content_type = EXCLUDED.content_type, "
            "content_encoding = EXCLUDED.content_encoding, result = EXCLUDED.result, "
            "created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at"
        )
        self.delete = (
            f"DELETE FROM {t} WHERE key = %s AND state = 'completed' "
            "AND expires_at > statement_timestamp()"
        )
        self.delete_any = f"DELETE FROM {t} WHERE key = %s"
        # Whether a transaction holds the row (55P03) or, unlocked, the row is a claimed
        # marker whose lease has not run out (see claim_marker): the key is held either way.
        self.probe = (
            f"SELECT state = 'claimed' AND expires_at > statement_timestamp() FROM {t} "
            "WHERE key = %s FOR UPDATE NOWAIT"
        )
        self.cleanup = (
            f"DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} "
            "WHERE expires_at < statement_timestamp() ORDER BY expires_at LIMIT %s "
            "FOR UPDATE SKIP LOCKED))"
        )
        # The publish side's decision (ChecksPublishes.check_publish) as one statement, so it
        # is one round trip in autocommit. A queued marker is a row in state 'queued' whose
        # result column holds the task id (utf-8), whose fingerprint is the call's and which
        # expires after the publish ttl; a claim takes such a row as it takes a free one, a
        # commit overwrites it with the record. What the statement sees:
        #   seen:  the row as committed (an MVCC read: never waits)
        #   free:  the row if no transaction holds it (SKIP LOCKED: never waits), now ours
        #   cfg:   lock_timeout for the insert, which may wait for a key's first claim (its
        #          row inserted, not committed yet): past it, 55P03 and the caller decides
        #          "publish unchecked"; synchronous_commit off in a transaction of its own
        #          (no WAL flush wait: a marker a server crash loses only lets a duplicate
        #          through to the run-time guard, which replays it)
        # decide: 'completed' (a live record), 'own' (a live marker of this task id), 'queued'
        # (a live marker of another: queued, or running as that call), 'running' (held by a
        # transaction without a live marker or record: a call published without the check),
        # or 'mark' (set the marker: the row is free, expired or absent). 'mark' with no row
        # written means a concurrent publisher or commit won between the read and the
        # insert: the caller checks again. Parameters: see PUBLISH_PARAMS.
        self.publish = (
            "WITH cfg AS (SELECT current_setting('lock_timeout') AS before, "
            "set_config('lock_timeout', %s, true) AS v, set_config('synchronous_commit', "
            "COALESCE(%s, current_setting('synchronous_commit')), true) AS sc), "
            f"seen AS (SELECT state, fingerprint, content_type, content_encoding, result, "
            "created_at, fencing_token, expires_at > statement_timestamp() AS live, "
            f"extract(epoch FROM expires_at - statement_timestamp()) AS ttl FROM {t} "
            "WHERE key = %s), "
            f"free AS (SELECT key FROM {t} WHERE key = %s FOR UPDATE SKIP LOCKED), "
            "decide AS (SELECT CASE "
            "WHEN NOT EXISTS (SELECT 1 FROM seen) THEN 'mark' "
            "WHEN (SELECT live AND state = 'completed' FROM seen) THEN 'completed' "
            "WHEN (SELECT live AND state = 'queued' FROM seen) "
            "OR ((SELECT state = 'claimed' FROM seen) "
            "AND (NOT EXISTS (SELECT 1 FROM free) OR (SELECT live FROM seen))) "
            "THEN CASE WHEN "
            "(SELECT result FROM seen) = convert_to(%s, 'UTF8') THEN 'own' ELSE 'queued' END "
            "WHEN NOT EXISTS (SELECT 1 FROM free) THEN 'running' "
            "ELSE 'mark' END AS d FROM cfg), "
            f"put AS (INSERT INTO {t} AS r (key, state, fingerprint, content_type, "
            "content_encoding, result, created_at, expires_at) "
            "SELECT %s, 'queued', %s, NULL, NULL, convert_to(%s, 'UTF8'), "
            "%s, statement_timestamp() + make_interval(secs => %s) "
            "FROM decide WHERE d = 'mark' "
            "ON CONFLICT (key) DO UPDATE SET state = 'queued', fingerprint = EXCLUDED.fingerprint, "
            "content_type = NULL, content_encoding = NULL, result = EXCLUDED.result, "
            "created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at "
            "WHERE NOT (r.state IN ('completed', 'queued', 'claimed') "
            "AND r.expires_at > statement_timestamp()) RETURNING 1) "
            "SELECT (SELECT d FROM decide), (SELECT count(*) FROM put), "
            "s.state, s.fingerprint, s.content_type, s.content_encoding, s.result, "
            "s.created_at, s.fencing_token, s.ttl, "
            # after the insert (read on the left): the caller's lock_timeout again, which
            # matters when the statement ran inside the caller's transaction (Django)
            "(SELECT set_config('lock_timeout', before, true) FROM cfg) "
            "FROM (SELECT 1) AS one LEFT JOIN seen AS s ON true"
        )
        self.queued = (
            f"SELECT result, extract(epoch FROM expires_at - statement_timestamp()) FROM {t} "
            "WHERE key = %s AND state = 'queued' AND expires_at > statement_timestamp()"
        )
        # The same, with what ``Task.idempotency_status`` shows of a queued key: the publish
        # time (the publisher's clock) and whether a delivery claimed it before it was queued
        # again (``requeue_marker`` sets ``content_type`` to 'requeued' on the marker row; a
        # fresh publish clears it, and a marker row holds no result of its own to type).
        self.queued_info = (
            f"SELECT result, extract(epoch FROM expires_at - statement_timestamp()), "
            f"created_at, COALESCE(content_type = 'requeued', false) FROM {t} "
            "WHERE key = %s AND state = 'queued' AND expires_at > statement_timestamp()"
        )
        # Never waits: a row a running delivery holds is left to that delivery's end.
        self.drop_queued = (
            f"DELETE FROM {t} WHERE key = (SELECT key FROM {t} WHERE key = %s "
            "AND state IN ('queued', 'claimed') AND result = convert_to(%s, 'UTF8') "
            "FOR UPDATE SKIP LOCKED)"
        )
        # Plain reads (never wait) of the rows drop_queued and requeue_marker are meant for:
        # while one still shows, a change that skipped it met a lock held for a moment.
        self.marker_named = (
            f"SELECT 1 FROM {t} WHERE key = %s AND state IN ('queued', 'claimed') "
            "AND result = convert_to(%s, 'UTF8')"
        )
        self.claimed_named = (
            f"SELECT 1 FROM {t} WHERE key = %s AND state = 'claimed' "
            "AND result = convert_to(%s, 'UTF8')"
        )
        # Before a claim's BEGIN, in the same flight and committed on its own: the marker is
        # claimed, for the lease's ttl. Never waits (a row another delivery holds is left
        # alone). Until the claim's transaction locks the row (the next statements of the
        # flight, which a killed client's server still runs) and after that transaction died
        # with its client, the row is claimed and unlocked: it holds the key until its
        # expiry, so a key frees "within lock_ttl" as on Redis, never for a moment in between
        # (a status read there said "absent" and the publish just after found the row locked).
        self.claim_marker = (
            f"UPDATE {t} SET state = 'claimed', "
            "expires_at = statement_timestamp() + make_interval(secs => %s) "
            f"WHERE key = (SELECT key FROM {t} WHERE key = %s "
            "AND state = 'queued' AND expires_at > statement_timestamp() "
            "FOR UPDATE SKIP LOCKED)"
        )
        # A claimed marker queued again (a retry was published, Reject(requeue=True)).
        self.requeue_marker = (
            f"UPDATE {t} SET state = 'queued', content_type = 'requeued', "
            "expires_at = statement_timestamp() + make_interval(secs => %s) "
            f"WHERE key = (SELECT key FROM {t} WHERE key = %s AND state = 'claimed' "
            "AND result = convert_to(%s, 'UTF8') FOR UPDATE SKIP LOCKED)"
        )
        # A plain MVCC read of the catalog (to_regclass may answer from a catalog snapshot
        # taken before a concurrent creator committed).
        self.exists = (
            "SELECT count(*) = 2 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
            "ON n.oid = c.relnamespace WHERE c.relname IN (%s, %s) AND (n.nspname = %s OR "
            "(%s = '' AND pg_catalog.pg_table_is_visible(c.oid)))"
        )
        schema_name = schema.rstrip(".")
        self.exists_params = (name, name + "_fencing", schema_name, schema_name)
        self.ddl_lock = "SELECT pg_advisory_xact_lock(hashtext(%s))"
        self._started(t, table, name, schema_name)

    def _started(self, t: str, table: str, name: str, schema_name: str) -> None:
        """The statements of ``idempotency_publish_until="started"``, on the marker table
        (:func:`markers_ddl`) beside the key table. None of them touches a key's row but to
        read it (an MVCC read: never waits), so none waits for a running body."""
        m = quote_table(markers_table(table))
        self.markers = markers_table(table)
        self.markers_exists = (
            "SELECT count(*) = 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
            "ON n.oid = c.relnamespace WHERE c.relname = %s AND (n.nspname = %s OR "
            "(%s = '' AND pg_catalog.pg_table_is_visible(c.oid)))"
        )
        self.markers_exists_params = (name + "_markers", schema_name, schema_name)
        live = "expires_at > statement_timestamp()"
        gone = "q.expires_at <= statement_timestamp()"
        # The publish check of the mode, one statement: the key's one queued slot is taken
        # when it is free (absent, expired) and left as it is otherwise; RETURNING says whose
        # it is now (the upsert waits only for another publisher's or a starter's statement
        # on the slot). With a live record nothing is written: a live queued marker (a call
        # published while the record's body ran) still stops the publish, else the call is
        # published past it (the worker replays it).
        self.publish_started = (
            "WITH cfg AS (SELECT set_config('synchronous_commit', "
            "COALESCE(%s, current_setting('synchronous_commit')), true) AS sc), "
            f"rec AS (SELECT 1 FROM {t} WHERE key = %s AND state = 'completed' AND {live}), "
            "seen AS (SELECT task_id, fingerprint, "
            f"extract(epoch FROM expires_at - statement_timestamp()) AS ttl FROM {m} "
            f"WHERE key = %s AND slot = 'queued' AND {live}), "
            f"put AS (INSERT INTO {m} AS q (key, slot, task_id, fingerprint, created_at, "
            "expires_at) SELECT %s, 'queued', %s, %s, %s, statement_timestamp() + "
            "make_interval(secs => %s) FROM cfg WHERE NOT EXISTS (SELECT 1 FROM rec) "
            "ON CONFLICT (key, slot) DO UPDATE SET "
            f"task_id = CASE WHEN {gone} THEN EXCLUDED.task_id ELSE q.task_id END, "
            f"fingerprint = CASE WHEN {gone} THEN EXCLUDED.fingerprint ELSE q.fingerprint END, "
            f"created_at = CASE WHEN {gone} THEN EXCLUDED.created_at ELSE q.created_at END, "
            f"expires_at = CASE WHEN {gone} THEN EXCLUDED.expires_at ELSE q.expires_at END "
            "RETURNING q.task_id, q.fingerprint, "
            "extract(epoch FROM q.expires_at - statement_timestamp()) AS ttl) "
            "SELECT EXISTS (SELECT 1 FROM rec), COALESCE(p.task_id, s.task_id), "
            "CASE WHEN p.task_id IS NULL THEN s.fingerprint ELSE p.fingerprint END, "
            "COALESCE(p.ttl, s.ttl) "
            "FROM (SELECT 1) AS one LEFT JOIN put AS p ON true LEFT JOIN seen AS s ON true"
        )
        # As a body starts (its delivery holds the key's row): its own queued marker ends,
        # and the running slot names it (for the admin; read only while the row is held).
        self.start_queued = f"DELETE FROM {m} WHERE key = %s AND slot = 'queued' AND task_id = %s"
        self.start_running = (
            f"INSERT INTO {m} (key, slot, task_id, fingerprint, created_at, expires_at) "
            "VALUES (%s, 'running', %s, NULL, %s, statement_timestamp() + "
            "make_interval(secs => %s)) ON CONFLICT (key, slot) DO UPDATE SET "
            "task_id = EXCLUDED.task_id, created_at = EXCLUDED.created_at, "
            "expires_at = EXCLUDED.expires_at"
        )
        # A delivery ended (or replayed): whatever slot still names it.
        self.end_started = f"DELETE FROM {m} WHERE key = %s AND task_id = %s"
        # What the admin shows: the key's live slots.
        self.started_slots = (
            "SELECT slot, task_id, fingerprint, created_at, "
            f"extract(epoch FROM expires_at - statement_timestamp()) FROM {m} "
            f"WHERE key = %s AND {live}"
        )
        self.forget_markers = f"DELETE FROM {m} WHERE key = %s"
        self.count_markers_like = (
            f"SELECT count(*) FROM {m} WHERE key LIKE %s AND slot = 'queued' AND {live}"
        )
        self.forget_markers_like = f"DELETE FROM {m} WHERE key LIKE %s AND slot = 'queued'"
        self.cleanup_markers = (
            f"DELETE FROM {m} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {m} "
            "WHERE expires_at < statement_timestamp() ORDER BY expires_at LIMIT %s "
            "FOR UPDATE SKIP LOCKED))"
        )


#: The order of :attr:`Statements.publish`'s parameters.
PUBLISH_PARAMS = ("wait", "sync", "key", "key", "tid", "key", "fp", "tid", "now", "ttl")
#: The order of :attr:`Statements.publish_started`'s parameters.
STARTED_PARAMS = ("sync", "key", "key", "key", "tid", "fp", "now", "ttl")


class AdminStatements:
    """The SQL of the admin's reads and deletes (``inspect``, ``forget``, ``stats``) on one
    table: PostgreSQL's text, run by :class:`~celery_idempotent.backends.sql.admin.SqlAdmin`
    (the same logic on every dialect; MySQL's text is in its own ``sql.py``)."""

    #: Whether a queued row says if a delivery claimed it (``requeue_marker`` types it).
    says_claimed = True

    def __init__(self, table: str) -> None:
        t = quote_table(table)
        self.table = table
        #: One key's row: state, fencing_token, fingerprint, content_type, content_encoding,
        #: the result's size, created_at, seconds left, result.
        self.row = (
            "SELECT state, fencing_token, fingerprint, content_type, content_encoding, "
            "octet_length(result), created_at, "
            f"extract(epoch FROM expires_at - statement_timestamp()), result FROM {t} "
            "WHERE key = %s"
        )
        self.count = f"SELECT count(*) FROM {t} WHERE key LIKE %s"
        #: The rows no transaction holds, locked for this one (never waits).
        self.free = f"SELECT key FROM {t} WHERE key LIKE %s FOR UPDATE SKIP LOCKED"
        #: Each row and whether it holds an unexpired record.
        self.live = (
            "SELECT key, state = 'completed' AND expires_at > statement_timestamp() "
            f"FROM {t} WHERE key LIKE %s"
        )
        #: The rows no running body holds (a shared lock: never waits, blocks no one long).
        self.unheld = f"SELECT key FROM {t} WHERE key LIKE %s FOR SHARE SKIP LOCKED"
        self._wait = "SELECT set_config('lock_timeout', %s, true)"
        self._delete = f"DELETE FROM {t} WHERE key = %s"
        self._delete_keys = f"DELETE FROM {t} WHERE key = ANY(%s)"

    def forget_row(self, row: str, lock_timeout: float) -> list[tuple[str, tuple[Any, ...]]]:
        """Delete one row, waiting at most ``lock_timeout`` for a running body's row lock
        (then :meth:`lock_refused`); the last statement's count is the rows deleted."""
        return [(self._wait, (f"{max(1, round(lock_timeout * 1000))}ms",)), (self._delete, (row,))]

    def delete_keys(self, keys: Sequence[str]) -> list[tuple[str, tuple[Any, ...]]]:
        """Delete rows this transaction locked already (by :attr:`free`): one statement."""
        return [(self._delete_keys, (list(keys),))]

    @staticmethod
    def lock_refused(exc: BaseException) -> bool:
        """Whether ``exc`` says a running body's row lock was not given up in time."""
        return is_pg_error(exc, LOCK_NOT_AVAILABLE) or "lock timeout" in str(exc)
