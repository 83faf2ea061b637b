"""Each shared concept is spelled once: the key prefix's default, a task's namespace default,
the accept list results are loaded with, and the key states (one ``KeyState``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from celery import Celery

import celery_idempotent
from celery_idempotent import admin
from celery_idempotent.backends.redis.locks import RedisLockProvider
from celery_idempotent.core.guard import DistributedIdempotencyGuard
from celery_idempotent.core.names import DEFAULT_PREFIX
from celery_idempotent.core.states import IN_PROGRESS, KeyState
from celery_idempotent.settings import DEFAULTS, IdempotencySettings, result_accept

PACKAGE = Path(celery_idempotent.__file__).parent


def _code_lines(pattern: str) -> list[str]:
    """``path:line`` of every line of the package's code (not comments) matching ``pattern``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(pattern, code):
                found.append(f"{path.relative_to(PACKAGE)}:{number}")
    return found


def test_the_prefix_default_is_spelled_in_core_names_only() -> None:
    assert _code_lines(r'"idempotency:"') == [
        line for line in _code_lines(r'"idempotency:"') if line.startswith("core/names.py")
    ]
    assert len(_code_lines(r'"idempotency:"')) == 1
    assert DEFAULTS["idempotency_key_prefix"] == DEFAULT_PREFIX
    assert DistributedIdempotencyGuard.__init__.__kwdefaults__["key_prefix"] == DEFAULT_PREFIX
    assert RedisLockProvider.__init__.__kwdefaults__["key_prefix"] == DEFAULT_PREFIX


def test_the_namespace_default_is_one_method() -> None:
    assert _code_lines(r"idempotency_namespace or ") == [
        line for line in _code_lines(r"idempotency_namespace or ") if line.startswith("settings.py")
    ]
    cfg = IdempotencySettings()
    assert cfg.namespace_for("proj.charge") == "proj.charge"
    pinned = IdempotencySettings(idempotency_namespace="billing")
    assert pinned.namespace_for("proj.charge") == "billing"


def test_the_accept_list_is_one_function() -> None:
    assert _code_lines(r'get\("result_accept_content"\)') == [
        line
        for line in _code_lines(r'get\("result_accept_content"\)')
        if line.startswith("settings.py")
    ]
    app = Celery("spelled", set_as_current=False)
    app.conf.accept_content = ["json"]
    app.conf.result_accept_content = None
    assert result_accept(app.conf) == ["json"]
    app.conf.accept_content = ["json", "msgpack"]
    assert result_accept(app.conf) == ["json", "msgpack"]
    app.conf.result_accept_content = ["msgpack"]
    assert result_accept(app.conf) == ["msgpack"]
    assert result_accept({}) == ["json"]


def test_one_key_state_in_two_spellings() -> None:
    # The Python API says "running"; the command line's JSON keeps 0.1.0's "in_progress".
    assert admin.STATES == ("completed", "running", "queued", "absent")
    assert [str(state) for state in KeyState] == list(admin.STATES)
    assert KeyState.RUNNING == "running"
    assert KeyState.RUNNING.json_name == IN_PROGRESS
    assert KeyState.COMPLETED.json_name == "completed"
    assert KeyState.of("in_progress") is KeyState.RUNNING
    assert KeyState.of("running") is KeyState.RUNNING
    assert json.dumps({"state": KeyState.QUEUED}) == '{"state": "queued"}'
    assert f"{KeyState.ABSENT}" == "absent"
    with pytest.raises(ValueError, match=r"not a key state: 'held'.*'in_progress'"):
        KeyState.of("held")
    # Code, not the docstrings that quote the JSON (``"in_progress"``).
    assert _code_lines(r'(?<!`)"in_progress"(?!`)') == ["core/states.py:11"]


def test_a_guard_status_speaks_key_states() -> None:
    from celery_idempotent.backends.memory.locks import MemoryLockProvider
    from celery_idempotent.backends.memory.store import MemoryIdempotencyStore

    guard = DistributedIdempotencyGuard(
        store=MemoryIdempotencyStore(), lock_provider=MemoryLockProvider()
    )
    assert admin.status_from_guard(guard, "k").state is KeyState.ABSENT
    lease = guard.lock_provider.acquire(guard.lock_resource("k"), 30)
    assert lease is not None
    assert admin.status_from_guard(guard, "k").state is KeyState.RUNNING
