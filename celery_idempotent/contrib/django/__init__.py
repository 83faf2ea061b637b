"""``celery_idempotent.contrib.django``: the Django app of the idempotency table.

Add it to ``INSTALLED_APPS`` and run ``manage.py migrate``::

    INSTALLED_APPS = [..., "celery_idempotent.contrib.django"]
    CELERY_IDEMPOTENCY_URL = "django://default"

- **Migrations** create the table the ``django://`` backend uses (``celery_idempotency``, its
  ``expires_at`` index and, on PostgreSQL, its fencing sequence), exactly as the backend's own
  DDL does, with ``IF NOT EXISTS``: a table the backend already created at first use is
  adopted as it is, nothing is lost.
- With the app installed the backend **never runs DDL**: a missing table is an error that
  names ``manage.py migrate`` (without the app, the table is created at first use, as before).
- **An admin page** (``/admin/celery_idempotent/idempotencykey/``) lists the keys (task, state,
  age, TTL left, holder) with filters by state and task, and a "forget" action behind a
  confirmation page and Django's ``delete`` permission on the model.

The model is engine-neutral (no PostgreSQL-only field); the PostgreSQL-only parts (the
sequence) are in the migration, per database vendor.
"""

from __future__ import annotations

# The backends ask whether this app is installed (with it they run no DDL), and sit below it:
# the app's dotted name and that question are theirs, re-exported here.
from celery_idempotent.backends.postgres.django_backend import APP_NAME
from celery_idempotent.backends.postgres.django_backend import app_installed as is_installed

#: The app's label (``manage.py migrate celery_idempotent``); its dotted name is ``APP_NAME``.
APP_LABEL = "celery_idempotent"

__all__ = ["APP_LABEL", "APP_NAME", "is_installed"]
