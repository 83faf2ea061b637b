"""``Task.idempotency_status`` / ``idempotency_forget`` on the PostgreSQL backend: read and
deleted through the store and lock-provider protocols (no TTL left, no holder)."""

from __future__ import annotations

import uuid

from celery import Celery

from celery_idempotent import IdempotentTask
from celery_idempotent.celery.task import reset_backends
from celery_idempotent.core.fingerprint import fingerprint_payload


def test_status_and_forget_on_postgresql(postgres_url: str, pg_table: str) -> None:
    reset_backends()
    app = Celery(f"pgadmin-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    sep = "&" if "?" in postgres_url else "?"
    app.conf.update(
        result_backend="cache+memory://", idempotency_url=f"{postgres_url}{sep}table={pg_table}"
    )
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, name="pgadmin.charge")
    def charge(order_id: int, amount: int) -> int:
        runs.append(order_id)
        return amount

    try:
        assert charge.idempotency_status((1, 10)).state == "absent"
        assert charge.apply((1, 10)).get() == 10
        done = charge.idempotency_status((1, 10))
        assert done.state == "completed"
        assert done.fingerprint == fingerprint_payload({"order_id": 1, "amount": 10})
        assert done.fencing_token
        assert done.key == charge.idempotency_key_for((1, 10), {})
        forgotten = charge.idempotency_forget((1, 10))
        assert forgotten.state == "completed"
        assert len(forgotten.deleted) == 1
        assert charge.idempotency_status((1, 10)).state == "absent"
        assert charge.apply((1, 10)).get() == 10
        assert runs == [1, 1]  # forgotten: the body ran again
    finally:
        reset_backends()
        app.close()
