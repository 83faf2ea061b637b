"""``admin.forget_all(app)`` (``forget --all``) on the SQL backends (issue 24): every record of
every idempotent task of the app goes, a row a running body holds stays."""

from __future__ import annotations

import threading
import uuid

from celery import Celery

from celery_idempotent import IdempotentTask
from celery_idempotent.admin import forget_all
from celery_idempotent.celery.task import reset_backends


def test_forget_all_on_postgres(postgres_url: str, pg_table: str) -> None:
    app = Celery("pgforget", broker="memory://", set_as_current=False)
    app.conf.idempotency_url = f"{postgres_url}?table={pg_table}"
    gate, inside = threading.Event(), threading.Event()

    @app.task(base=IdempotentTask, shared=False, name="pgforget.a")
    def a(x: int) -> int:
        return x

    @app.task(base=IdempotentTask, shared=False, name="pgforget.hold")
    def hold(tag: str) -> str:
        inside.set()
        gate.wait(10)
        return tag

    reset_backends()
    try:
        for x in range(3):
            a.apply((x,)).get()
        held = uuid.uuid4().hex
        holder = threading.Thread(target=lambda: hold.apply((held,)))
        holder.start()
        assert inside.wait(10)
        try:
            dry = forget_all(app, dry_run=True)
            by_task = {each.tasks: each for each in dry.namespaces}
            assert by_task[("pgforget.a",)].records == 3
            assert by_task[("pgforget.hold",)].records == 0  # its row is the body's, uncommitted
            done = forget_all(app)
            assert done.records == 3
            assert a.idempotency_status((0,)).state == "absent"
        finally:
            gate.set()
            holder.join(10)
        # The running body was not disturbed: its record committed after the forget.
        assert hold.idempotency_status((held,)).state == "completed"
        assert a.apply((0,)).get() == 0  # runs again
    finally:
        reset_backends()
        app.close()
