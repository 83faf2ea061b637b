"""How a row of an SQL backend's table holds a record, whichever the dialect.

The table's default name and the check of a name (:func:`check_table`), a record as the row's
columns (:func:`record_columns`) and a row's columns as the record (:func:`decode_row`): the
PostgreSQL and the MySQL tables have the same columns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from celery_idempotent.core.codec import ResultCodec
from celery_idempotent.core.protocols import IdempotencyRecord

__all__ = ["DEFAULT_TABLE", "check_table", "decode_row", "record_columns"]

#: The table name when none is given (URL query parameter ``table``).
DEFAULT_TABLE = "celery_idempotency"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,47}(\.[A-Za-z_][A-Za-z0-9_]{0,47})?$")


def check_table(table: Any) -> str:
    """``table`` if it is a PostgreSQL identifier (optionally schema-qualified), else an error."""
    if not isinstance(table, str) or not _IDENT.match(table):
        raise ValueError(
            "table must be a PostgreSQL identifier (letters, digits, underscores, optionally "
            f"schema-qualified: 'schema.table'), got {table!r}"
        )
    return table


def record_columns(
    codec: ResultCodec, key: str, record: IdempotencyRecord
) -> tuple[str | None, str, str, bytes, float]:
    """``record`` as the columns ``fingerprint, content_type, content_encoding, result,
    created_at`` (in that order, as each dialect's ``Statements.upsert`` and ``Statements.commit``
    take them); :class:`~celery_idempotent.core.exceptions.ResultEncodeError` when the serializer
    refuses the result."""
    data = codec.dumps(key, record.result)
    return (
        record.fingerprint,
        codec.content_type,
        codec.content_encoding,
        data,
        float(record.created_at),
    )


def decode_row(codec: ResultCodec, key: str, row: Sequence[Any]) -> IdempotencyRecord:
    """The record in a row of the columns of each dialect's ``Statements.select``;
    :class:`~celery_idempotent.core.exceptions.RecordDecodeError` when its result is refused."""
    _state, fingerprint, ctype, encoding, data, created_at, fence = row
    raw = bytes(data) if data is not None else b""
    result = codec.loads(key, ctype, encoding, raw)
    token = None if fence is None else int(fence)
    return IdempotencyRecord(result, fingerprint, float(created_at or 0.0), token)
