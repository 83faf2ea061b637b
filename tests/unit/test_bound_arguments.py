"""The arguments a key and a fingerprint are computed from: every signature shape binds as
``inspect.Signature.bind`` + ``apply_defaults`` does, the all-positional shortcut included."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from celery_idempotent.celery.keys import bound_arguments


def _task_of(fn: Callable[..., Any]) -> Any:
    """An object shaped as bound_arguments reads a task: its class's ``run`` is ``fn``."""
    return type("FakeTask", (), {"run": staticmethod(fn), "name": "t"})()


def plain(a: Any, b: Any) -> None: ...
def defaults(a: Any, b: Any = 2, c: Any = None) -> None: ...
def var_positional(a: Any, *rest: Any) -> None: ...
def positional_only(a: Any, /, b: Any) -> None: ...
def keyword_only(a: Any, *, b: Any = 1) -> None: ...
def var_keyword(a: Any, **kw: Any) -> None: ...
def nothing() -> None: ...


CASES: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = [
    (plain, (1, 2), {}),
    (plain, (1,), {"b": 2}),
    (plain, (), {"b": 2, "a": 1}),
    (defaults, (1, 5, 6), {}),
    (defaults, (1,), {}),
    (defaults, (1, 5), {}),
    (defaults, (1,), {"c": [3]}),
    (var_positional, (1, 2, 3), {}),
    (var_positional, (1,), {}),
    (positional_only, (1, 2), {}),
    (keyword_only, (1,), {}),
    (keyword_only, (1,), {"b": 4}),
    (var_keyword, (1,), {"x": 2}),
    (nothing, (), {}),
]


@pytest.mark.parametrize(("fn", "args", "kwargs"), CASES)
def test_binds_as_signature_bind_with_defaults(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    expected = inspect.signature(fn).bind(*args, **kwargs)
    expected.apply_defaults()
    task = _task_of(fn)
    for _ in range(2):  # the first call caches the signature, the second uses it
        got = bound_arguments(task, args, dict(kwargs))
        assert got == dict(expected.arguments)
        assert list(got) == list(expected.arguments)  # the same order


@pytest.mark.parametrize(
    ("fn", "args", "kwargs"),
    [(plain, (1, 2, 3), {}), (plain, (1,), {}), (defaults, (), {}), (nothing, (1,), {})],
)
def test_a_call_that_does_not_fit_raises_naming_the_task(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    task = _task_of(fn)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"^t: "):
            bound_arguments(task, args, kwargs)
