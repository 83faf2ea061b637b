"""Create the marker table of ``idempotency_publish_until="started"`` (issue 24) beside the
idempotency table: ``<table>_markers``, its queued and running slots per key.

The database side is the backend's own DDL (``CREATE ... IF NOT EXISTS``): a table that the
``django://`` backend created at its first use of the mode is adopted unchanged, and an install
migrated to 0001 before the mode existed gets it here. The state side is unchanged (no model:
the rows are the backend's, read through its admin). An engine without a backend package of
ours has no ``markers_ddl`` and no publish side of that mode: nothing is created.
"""

from __future__ import annotations

import importlib
from typing import Any

from django.db import migrations

from celery_idempotent.backends.postgres.sql import DEFAULT_TABLE


def _vendor_markers_ddl(vendor: str) -> Any:
    name = "postgres" if vendor == "postgresql" else vendor
    try:
        module = importlib.import_module(f"celery_idempotent.backends.{name}.sql")
    except ImportError:
        return None
    return getattr(module, "markers_ddl", None)


def create_markers(apps: Any, schema_editor: Any) -> None:
    ddl = _vendor_markers_ddl(schema_editor.connection.vendor)
    if ddl is None:
        return
    for statement in ddl(DEFAULT_TABLE).split(";\n"):
        if statement.strip():
            schema_editor.execute(statement.strip())


def drop_markers(apps: Any, schema_editor: Any) -> None:
    if _vendor_markers_ddl(schema_editor.connection.vendor) is None:
        return
    quote = schema_editor.quote_name
    schema_editor.execute(f"DROP TABLE IF EXISTS {quote(DEFAULT_TABLE + '_markers')}")


class Migration(migrations.Migration):
    # DDL outside a transaction: MySQL cannot roll it back, and Django refuses it in one.
    atomic = False
    dependencies = (("celery_idempotent", "0001_initial"),)

    operations = (migrations.RunPython(create_markers, drop_markers, atomic=False),)
