"""``--task`` with a name the app does not define: exit status 2 and the names it knows, never
"state absent" with exit status 0 (an operator asking "was this order charged?" reads "no")."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "order-1", "--task", "cliadmin.chrage"),
        ("inspect", "--task", "cliadmin.chrage", "--args", "[1, 2]"),
        ("forget", "order-1", "--task", "cliadmin.chrage", "--yes"),
        ("forget", "--task", "cliadmin.chrage", "--yes"),
        ("stats", "--task", "cliadmin.chrage"),
    ],
)
def test_an_unknown_task_name_exits_2_and_lists_the_known_ones(
    celery_cli: Callable[..., subprocess.CompletedProcess[str]], args: tuple[str, ...]
) -> None:
    done = celery_cli(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "this app defines no IdempotentTask of that name" in done.stderr
    assert "Did you mean 'cliadmin.charge'?" in done.stderr
    assert "cliadmin.charge, " in done.stderr  # the list of the names it knows
    assert "absent" not in done.stdout


def test_a_known_name_still_answers(
    celery_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    done = celery_cli("inspect", "order-1", "--task", "cliadmin.charge")
    assert done.returncode == 0, done.stderr
    assert "absent" in done.stdout
