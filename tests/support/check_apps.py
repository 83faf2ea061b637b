"""A Celery app with one idempotent task, for the configuration checks' tests.

The worker-start and first-publish checks look at an app's idempotent tasks. A test process
that imported other suites' modules has ``@shared_task`` IdempotentTasks of theirs registered,
and Celery adds every shared task to each app finalized after it: :func:`only_own_tasks` takes
those off again, so that a check speaks only of the test's own task.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery

from celery_idempotent import IdempotentTask


def only_own_tasks(app: Celery, *names: str) -> Celery:
    """Unregister from the finalized ``app`` every IdempotentTask not named in ``names`` (the
    shared tasks other modules registered); returns ``app``."""
    for name, task in list(app.tasks.items()):
        if isinstance(task, IdempotentTask) and name not in names:
            app.tasks.unregister(name)
    return app


def app_with_one_task(
    prefix: str,
    conf: dict[str, Any] | None = None,
    namespace: str | None = None,
    **task_opts: Any,
) -> Celery:
    """A finalized app ``<prefix>-<hex>`` on the memory broker whose only idempotent task is
    ``<prefix>.charge`` (options ``task_opts``). ``conf`` is the app's configuration, read
    from a settings object under ``namespace`` (``CELERY``: a Django project's) when given."""
    app = Celery(f"{prefix}-{uuid.uuid4().hex[:8]}", set_as_current=False)
    if namespace is None:
        app.conf.update(broker_url="memory://", **(conf or {}))
    else:
        source = type(
            "DjangoSettings", (), {f"{namespace}_BROKER_URL": "memory://", **(conf or {})}
        )
        app.config_from_object(source, namespace=namespace)
    name = f"{prefix}.charge"

    @app.task(base=IdempotentTask, shared=False, name=name, **task_opts)
    def charge(order_id: int) -> int:
        return order_id

    app.finalize()
    return only_own_tasks(app, name)
