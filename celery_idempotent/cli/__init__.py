"""``celery -A proj idempotency ...``: inspect, forget and count idempotency keys in Redis.

Installed as a ``celery.commands`` entry point, so Celery's own ``celery`` program gains the
``idempotency`` group; ``ctx.obj.app`` is the app given with ``-A``. Where the keys live comes
from that app's settings (``idempotency_url``, else a Redis ``broker_url``;
``idempotency_key_prefix``), with the task's own options when ``--task`` names a registered
task; ``--url`` and ``--prefix`` override both::

    celery -A proj idempotency inspect payment-42 --task proj.tasks.charge
    celery -A proj idempotency inspect --task proj.tasks.charge --args '[42, 999]'
    celery -A proj idempotency inspect --task proj.tasks.report --task-id 3f2a...
    celery -A proj idempotency inspect --raw 'proj.tasks.charge:args:9f86d0...'
    celery -A proj idempotency forget payment-42 --task proj.tasks.charge
    celery -A proj idempotency forget --task proj.tasks.charge --dry-run
    celery -A proj idempotency stats --json

Keys are named as :class:`~celery_idempotent.IdempotentTask` names them:
``<task>:key:<explicit or formatted key>``, ``<task>:id:<task id>`` or
``<task>:args:<sha256 of the bound arguments>``. In Redis (see ``backends.redis.keyspace``)
a key ``k`` becomes the record ``<prefix>{k}``, the lock ``<prefix>lock:{k}`` and the fence
``<prefix>lock:{k}:fence``, where ``k`` is shortened to its first 64 characters plus a sha256
when it is longer than 200 characters or contains a brace.

What the commands never do: deserialize a stored result unless ``inspect --show-result`` asks
(and then only with the app's accept list), use ``KEYS`` (every scan is ``SCAN`` in batches),
or delete a held lock without ``--force``. Fence keys are left to expire by themselves: they
keep fencing tokens increasing across a ``forget``.

Limitation: a key longer than 200 characters (or with a brace) is stored under a shortened
name that keeps only its first 64 characters. ``forget --task NAME`` and ``stats --task NAME``
still find such keys when NAME has fewer than 64 characters (plain ``stats`` counts those whose
head ends before the ``:args:``/``:id:``/``:key:`` marker as ``(shortened)``). For a task name
of 64 characters or more, its shortened keys (every argument-hash key once the name passes 130
characters, long explicit keys) cannot be told apart from other tasks' sharing those 64
characters: ``forget --task`` reports and skips them. One key named with KEY, ``--task-id``,
``--args`` or ``--raw`` is always reached.
"""

from __future__ import annotations

import click

from celery_idempotent.admin import KeyInfo, format_duration, read_key
from celery_idempotent.backends.redis.keyspace import parse_name as parse_redis_name
from celery_idempotent.cli.forget import forget
from celery_idempotent.cli.inspect_key import inspect
from celery_idempotent.cli.stats import stats
from celery_idempotent.keyspace import task_of_slot

__all__ = [
    "KeyInfo",
    "format_duration",
    "idempotency",
    "parse_redis_name",
    "read_key",
    "task_of_slot",
]


# --------------------------------------------------------------------------- the group


@click.group(name="idempotency")
@click.pass_context
def idempotency(ctx: click.Context) -> None:
    """Inspect, forget and count idempotency keys (celery-idempotent).

    Settings come from the app (-A): idempotency_url (or a Redis broker_url) and
    idempotency_key_prefix; a registered task's own options apply with --task.
    """


for _command in (inspect, forget, stats):
    idempotency.add_command(_command)


def _describe_key_argument(command: click.Command, text: str) -> None:
    # Click 8.5.1 lists arguments among the options; set the help where it is read
    # (older Click has no ``help`` for arguments and ignores the attribute).
    for param in command.params:
        if isinstance(param, click.Argument) and param.name == "key":
            param.help = text


_KEY_HELP = (
    "The key as the task used it: payment-42 (explicit), order:42 (formatted); with --raw "
    "a namespaced key or a Redis name."
)
_describe_key_argument(inspect, _KEY_HELP)
_describe_key_argument(
    forget, _KEY_HELP + " Without KEY, --task-id or --args: every key of --task."
)


# --------------------------------------------------------------------------- PostgreSQL DDL


def _add_sql_command() -> None:
    from celery_idempotent.cli.postgres import sql_command  # noqa: PLC0415 - no psycopg import

    idempotency.add_command(sql_command)


_add_sql_command()
