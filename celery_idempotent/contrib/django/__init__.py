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

#: The app's label (``manage.py migrate celery_idempotent``) and dotted name.
APP_LABEL = "celery_idempotent"
APP_NAME = "celery_idempotent.contrib.django"

__all__ = ["APP_LABEL", "APP_NAME", "is_installed"]


def is_installed() -> bool:
    """Whether Django is configured with this app in ``INSTALLED_APPS`` (never imports Django
    for a process that has not loaded it)."""
    import sys  # noqa: PLC0415

    if "django.apps" not in sys.modules:
        return False
    from django.apps import apps  # noqa: PLC0415

    try:
        return bool(apps.ready and apps.is_installed(APP_NAME))
    except Exception:  # settings not configured
        return False
