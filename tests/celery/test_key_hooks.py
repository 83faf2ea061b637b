"""``idempotency_key_for`` and ``idempotency_fingerprint_for`` stay hooks a subclass overrides.

``keys.prepare_call`` derives a call's key itself for ``IdempotentTask``'s own hooks (one
crossing from the task, the settings it was given), and calls a subclass's override back: the
publish side and the worker then both use the override (one identity).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_idempotent import IdempotentTask
from celery_idempotent.celery import keys as task_keys
from celery_idempotent.celery.publish import _plan_publish
from celery_idempotent.keyspace import task_key

pytestmark = pytest.mark.redis

hook_calls: list[str] = []


class ByOrder(IdempotentTask):
    """Keyed by ``order`` alone (``note`` is not part of the key), no fingerprint check."""

    abstract = True

    def idempotency_key_for(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        payload: Any = None,
        fingerprint: str | None = None,
    ) -> str:
        hook_calls.append("key")
        bound = payload if payload is not None else task_keys.bound_arguments(self, args, kwargs)
        return task_key(self.idempotency_namespace_of(), "key", f"order-{bound['order']}")

    def idempotency_fingerprint_for(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, payload: Any = None
    ) -> str | None:
        hook_calls.append("fingerprint")
        return None


def test_an_overriding_subclass_is_called_by_the_worker_and_the_publish_side(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    runs: list[str] = []

    # A fingerprint setting other than "args" (which is the key's own hash): the hook decides.
    @app.task(
        base=ByOrder,
        name=f"hooks.charge.{uuid.uuid4().hex[:8]}",
        shared=False,
        idempotency_fingerprint=("order", "note"),
    )
    def charge(order: int, note: str) -> str:
        runs.append(note)
        return f"charged {order} ({note})"

    hook_calls.clear()
    assert charge.apply((1, "first")).get() == "charged 1 (first)"
    # Another note: the same key by the override, and no fingerprint check: a replay.
    assert charge.apply((1, "second")).get() == "charged 1 (first)"
    assert charge.apply((2, "third")).get() == "charged 2 (third)"
    assert runs == ["first", "third"]
    assert hook_calls.count("key") == 3
    assert hook_calls.count("fingerprint") == 3

    task = app.tasks[charge.name]  # the task itself, not the decorator's lazy proxy
    plan = _plan_publish(task, (1, "other"), {}, None, link=None, link_error=None, options={})
    assert plan.check is not None
    assert plan.check.key == f"{charge.name}:key:order-1"
    assert plan.check.fingerprint is None


def test_the_default_hooks_are_not_called_back(
    make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch
) -> None:
    # IdempotentTask's own hooks are marked: prepare_call derives the key itself, with the
    # settings it was given (no callback into the task, no second resolve).
    assert getattr(IdempotentTask.idempotency_key_for, "_idempotency_default_hook", False)
    assert getattr(IdempotentTask.idempotency_fingerprint_for, "_idempotency_default_hook", False)
    app = make_app()

    @app.task(
        base=IdempotentTask,
        name=f"hooks.plain.{uuid.uuid4().hex[:8]}",
        shared=False,
        idempotency_key="order:{order}",
        idempotency_fingerprint=("order", "note"),
    )
    def plain(order: int, note: str) -> str:
        return note

    called: list[str] = []
    real_settings = IdempotentTask.idempotency_settings

    def counted(self: IdempotentTask) -> Any:
        called.append("settings")
        return real_settings(self)

    monkeypatch.setattr(IdempotentTask, "idempotency_settings", counted)
    assert plain.apply((3, "a")).get() == "a"
    assert called == ["settings"]
    # The key and fingerprint are still the hooks' (the public methods agree with the call).
    assert plain.idempotency_key_for((3, "a"), {}) == f"{plain.name}:key:order:3"
    assert not ByOrder.idempotency_key_for.__dict__.get("_idempotency_default_hook")
