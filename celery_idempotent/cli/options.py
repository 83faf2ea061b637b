"""The options the ``idempotency`` commands share: ``--url``/``--prefix``/``--json``, and the
ways to name a key (KEY with ``--task``, ``--raw``, ``--task-id``, ``--args``/``--kwargs``),
handed to a command as one :class:`KeySelection`."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click
from kombu.exceptions import KombuError

from celery_idempotent.backends.redis import keyspace as redis_keyspace
from celery_idempotent.celery.keys import as_received
from celery_idempotent.cli.common import DEFAULT_BATCH, Target
from celery_idempotent.core.exceptions import IdempotencyKeyMissingError
from celery_idempotent.keyspace import task_key

__all__ = ["KeySelection", "batch_size_option", "common_options", "key_options"]

F = TypeVar("F", bound=Callable[..., Any])


def common_options(f: F) -> F:
    """``--url``, ``--prefix`` and ``--json``: on every subcommand."""
    f = click.option(
        "--json", "as_json", is_flag=True, help="Print one JSON document (for scripts)."
    )(f)
    f = click.option(
        "--prefix",
        metavar="PREFIX",
        help="Key prefix instead of the idempotency_key_prefix setting.",
    )(f)
    return click.option(
        "--url",
        metavar="URL",
        help="Redis URL instead of the idempotency_url setting (or the Redis broker_url).",
    )(f)


def _json_arg(value: str | None, option: str, kind: type[Any]) -> Any:
    if value is None:
        return kind()
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=option) from exc
    if not isinstance(parsed, kind):
        raise click.BadParameter(f"must be a JSON {kind.__name__}", param_hint=option)
    return parsed


def _args_key(
    target: Target, task_name: str, args_json: str | None, kwargs_json: str | None
) -> str:
    """The key the registered task derives for a call with these arguments."""
    task = target.task
    if task is None or not callable(getattr(task, "idempotency_key_for", None)):
        raise click.UsageError(
            f"--args needs {task_name!r} to be a registered IdempotentTask of this app"
        )
    if target.settings.idempotency_key == "task_id":
        raise click.UsageError(f"{task_name} is keyed by task id: use --task-id")
    args = _json_arg(args_json, "--args", list)
    kwargs = _json_arg(kwargs_json, "--kwargs", dict)
    try:
        # As the worker would receive them (a --args list through the task's serializer).
        call_args, call_kwargs = as_received(task, args, kwargs)
        return str(task.idempotency_key_for(call_args, call_kwargs))
    except (TypeError, ValueError, IdempotencyKeyMissingError, KombuError) as exc:
        raise click.BadParameter(str(exc), param_hint="--args/--kwargs") from exc


@dataclass(frozen=True)
class KeySelection:
    """How a command was told which key: KEY (with ``--task``), ``--raw``, ``--task-id`` or
    ``--args``/``--kwargs``. :func:`key_options` adds these to a command and hands it one."""

    key: str | None = None
    task_name: str | None = None
    raw: bool = False
    task_id: str | None = None
    args_json: str | None = None
    kwargs_json: str | None = None
    any_task: bool = False

    @property
    def names_a_key(self) -> bool:
        """Whether one key is named (else ``forget`` takes every key of ``--task``)."""
        named = (self.key, self.task_id, self.args_json, self.kwargs_json)
        return self.raw or any(value is not None for value in named)

    def resolve(self, target: Target) -> str:
        """The namespaced key that KEY, ``--raw``, ``--task-id`` or ``--args`` names."""
        key, task_name = self.key, self.task_name
        by_args = self.args_json is not None or self.kwargs_json is not None
        if [key is not None, self.task_id is not None, by_args].count(True) != 1:
            raise click.UsageError("name one key: KEY, --task-id ID or --args JSON")
        if self.raw:
            if key is None:
                raise click.UsageError("--raw needs KEY (the namespaced key or a Redis name)")
            # A Redis name (record, lock or fence) carries the slot, and slot_key(slot) == slot:
            # the slot reaches the same names, shortened keys included.
            parsed = redis_keyspace.parse_name(key, target.prefix)
            return parsed[1] if parsed is not None else key
        if task_name is None:
            raise click.UsageError(
                "--task NAME is needed: keys are namespaced by task name (or pass --raw with "
                "the namespaced key)"
            )
        namespace = target.namespace(task_name)
        if key is not None:
            return task_key(namespace, "key", key)
        if self.task_id is not None:
            return task_key(namespace, "id", self.task_id)
        return _args_key(target, task_name, self.args_json, self.kwargs_json)


def batch_size_option(help: str) -> Callable[[F], F]:
    """``--batch-size`` (names per SCAN or per pipelined batch), with ``help``."""
    return click.option(
        "--batch-size",
        type=click.IntRange(1, 100_000),
        default=DEFAULT_BATCH,
        show_default=True,
        help=help,
    )


def any_task_option(f: F) -> F:
    """``--any-task``: take ``--task NAME`` as a bare key namespace even when the app defines
    no idempotent task of that name (without it such a name exits with status 2)."""
    return click.option(
        "--any-task",
        is_flag=True,
        help="Accept a --task name the app does not define (keys of a removed task, or made "
        "by a guard directly); without it such a name is an error (exit status 2).",
    )(f)


def key_options(f: F) -> F:
    """KEY, ``--task``, ``--raw``, ``--task-id``, ``--args`` and ``--kwargs``, handed to the
    command as one ``selection`` (a :class:`KeySelection`)."""

    @functools.wraps(f)
    def collect(
        *args: Any,
        key: str | None = None,
        task_name: str | None = None,
        raw: bool = False,
        task_id: str | None = None,
        args_json: str | None = None,
        kwargs_json: str | None = None,
        any_task: bool = False,
        **kwargs: Any,
    ) -> Any:
        selection = KeySelection(key, task_name, raw, task_id, args_json, kwargs_json, any_task)
        return f(*args, selection=selection, **kwargs)

    g: Any = collect
    g = click.option(
        "--kwargs",
        "kwargs_json",
        metavar="JSON",
        help="With --args: keyword arguments as a JSON object.",
    )(g)
    g = click.option(
        "--args",
        "args_json",
        metavar="JSON",
        help="The key a call with these arguments (a JSON array) uses; the task must be "
        "registered in the app.",
    )(g)
    g = click.option(
        "--task-id", metavar="ID", help='The key of an idempotency_key="task_id" task.'
    )(g)
    g = click.option(
        "--raw",
        is_flag=True,
        help="KEY is a namespaced key (<task>:args:<sha>, <task>:id:<id>, <task>:key:<key>) "
        "or a Redis name (<prefix>{...}).",
    )(g)
    g = any_task_option(g)
    g = click.option(
        "--task",
        "task_name",
        metavar="NAME",
        help="The task's name: keys are namespaced by it.",
    )(g)
    return click.argument("key", required=False)(g)  # type: ignore[no-any-return]
