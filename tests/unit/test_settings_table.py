"""The settings are declared once (settings.setting): default, check, documentation; the task's
options and the validation come from that one declaration."""

from __future__ import annotations

import dataclasses

import pytest

from celery_idempotent.settings import (
    DEFAULTS,
    NOT_SET,
    IdempotencySettings,
    check_setting,
    task_option_defaults,
)


def test_every_setting_is_declared_with_a_check() -> None:
    undeclared = [
        f.name
        for f in dataclasses.fields(IdempotencySettings)
        if not callable(f.metadata.get("check"))
    ]
    assert not undeclared, f"declare these with setting(default, check): {undeclared}"


def test_every_setting_is_a_task_option_unset_on_the_base_class() -> None:
    from celery_idempotent import IdempotentTask

    for name in DEFAULTS:
        assert name in vars(IdempotentTask), name
        # A task's own None is a choice for these (no check, no slot): unset is NOT_SET.
        expected = NOT_SET if name in ("idempotency_fingerprint", "idempotency_window") else None
        assert vars(IdempotentTask)[name] is expected, name
    assert task_option_defaults() == {name: vars(IdempotentTask)[name] for name in DEFAULTS}


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_each_check_accepts_the_default_and_names_the_setting_when_it_refuses(name: str) -> None:
    assert check_setting(name, DEFAULTS[name], task_name="t") == DEFAULTS[name]
    with pytest.raises((TypeError, ValueError)) as caught:
        check_setting(name, object(), task_name="t")
    assert f"{name} (task t)" in str(caught.value)
