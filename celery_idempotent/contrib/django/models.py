"""The idempotency table as a Django model: one row per key (see
:mod:`celery_idempotent.backends.postgres`).

The backend reads and writes the table with its own SQL; the model exists for the migrations
and the admin, which never write a row except to delete it ("forget"). Fields are
engine-neutral Django fields, named as the backend's columns.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import models

from celery_idempotent import keyspace
from celery_idempotent.backends.postgres.sql import DEFAULT_TABLE

__all__ = ["IdempotencyKey", "task_of_row"]


def task_of_row(row: str) -> str:
    """The task (key namespace) of a row's key ``<prefix>{<namespace>:<kind>:<value>}``, or
    ``""`` for a key not made by ``IdempotentTask`` (an explicit guard key)."""
    start = row.find("{")
    slot = row[start + 1 : -1] if start >= 0 and row.endswith("}") else row
    parsed = keyspace.parse_task_key(slot)
    return parsed[0] if parsed is not None else ""


class IdempotencyKey(models.Model):
    """A key's row: ``completed`` (a stored result until ``expires_at``), ``queued`` (a
    published call no delivery has committed yet) or ``running`` (the row of a key whose
    delivery's transaction has not committed: other sessions see the row as it was)."""

    key = models.TextField(primary_key=True)
    state = models.TextField()
    fencing_token = models.BigIntegerField(null=True)
    fingerprint = models.TextField(null=True)
    content_type = models.TextField(null=True)
    content_encoding = models.TextField(null=True)
    result = models.BinaryField(null=True)
    created_at = models.FloatField(null=True)
    expires_at = models.DateTimeField()

    class Meta:
        db_table = DEFAULT_TABLE
        verbose_name = "idempotency key"
        indexes = [models.Index(fields=["expires_at"], name=f"{DEFAULT_TABLE}_expires_at")]  # noqa: RUF012

    def __str__(self) -> str:
        return self.key

    @property
    def task(self) -> str:
        """The task whose key this is (``""`` for a key not made by ``IdempotentTask``)."""
        return task_of_row(str(self.key))

    def age(self, now: float | None = None) -> float | None:
        """Seconds since the record was committed (or the call queued), ``None`` unknown."""
        created = self.created_at
        if created is None or created < 1e9:
            return None
        return max(0.0, (time.time() if now is None else now) - float(created))

    def ttl_left(self, now: Any = None) -> float:
        """Seconds until the row expires (0 once it has)."""
        from django.utils import timezone  # noqa: PLC0415

        current = timezone.now() if now is None else now
        return max(0.0, float((self.expires_at - current).total_seconds()))
