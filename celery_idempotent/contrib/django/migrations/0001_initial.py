"""Create the idempotency table, its ``expires_at`` index and (PostgreSQL) its fencing sequence.

The database side is the backend's own DDL (``CREATE ... IF NOT EXISTS``), so a table that the
``django://`` backend created at first use before the app was installed is adopted unchanged.
The state side is the model. On an engine other than PostgreSQL the table is created from the
model unless a backend package for that vendor (``celery_idempotent.backends.<vendor>.sql``)
provides ``ddl(table)``, which is then used instead.
"""

from __future__ import annotations

import importlib
from typing import Any

from django.db import migrations, models

from celery_idempotent.backends.postgres.sql import DEFAULT_TABLE


def _vendor_ddl(vendor: str) -> Any:
    name = "postgres" if vendor == "postgresql" else vendor
    try:
        module = importlib.import_module(f"celery_idempotent.backends.{name}.sql")
    except ImportError:
        return None
    return getattr(module, "ddl", None)


def _statements(script: str) -> list[str]:
    return [each.strip() for each in script.split(";\n") if each.strip()]


def create_table(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    ddl = _vendor_ddl(connection.vendor)
    if ddl is not None:
        for statement in _statements(ddl(DEFAULT_TABLE)):
            schema_editor.execute(statement)
        return
    if DEFAULT_TABLE not in connection.introspection.table_names():
        schema_editor.create_model(apps.get_model("celery_idempotent", "IdempotencyKey"))


def drop_table(apps: Any, schema_editor: Any) -> None:
    quote = schema_editor.quote_name
    schema_editor.execute(f"DROP TABLE IF EXISTS {quote(DEFAULT_TABLE)}")
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {quote(DEFAULT_TABLE + '_fencing')}")
    if schema_editor.connection.vendor == "mysql":  # its fencing counter is a table
        schema_editor.execute(f"DROP TABLE IF EXISTS {quote(DEFAULT_TABLE + '_fencing')}")


class Migration(migrations.Migration):
    initial = True
    dependencies: tuple[tuple[str, str], ...] = ()

    operations = (
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(create_table, drop_table)],
            state_operations=[
                migrations.CreateModel(
                    name="IdempotencyKey",
                    fields=[
                        ("key", models.TextField(primary_key=True, serialize=False)),
                        ("state", models.TextField()),
                        ("fencing_token", models.BigIntegerField(null=True)),
                        ("fingerprint", models.TextField(null=True)),
                        ("content_type", models.TextField(null=True)),
                        ("content_encoding", models.TextField(null=True)),
                        ("result", models.BinaryField(null=True)),
                        ("created_at", models.FloatField(null=True)),
                        ("expires_at", models.DateTimeField()),
                    ],
                    options={
                        "verbose_name": "idempotency key",
                        "db_table": DEFAULT_TABLE,
                        "indexes": [
                            models.Index(fields=["expires_at"], name=f"{DEFAULT_TABLE}_expires_at")
                        ],
                    },
                ),
            ],
        ),
    )
