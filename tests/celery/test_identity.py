"""One identity (SPEC §8): every path that names a call computes the key and fingerprint the
worker computes from the message it receives, through the task's real serializer.

The worker's identity here is what ``IdempotentTask.__call__`` derives in a worker: the call
encoded as Celery encodes a message (``app.amqp.as_task_v2``), the body through kombu's
``dumps``/``loads`` with the serializer, the delivered arguments bound in a worker request.
Each path is then asked for its identity of the caller's Python arguments:

- publish: ``publish._plan_publish`` (the check ``apply_async`` makes, both for the one-script
  path and check-then-push: they share the plan);
- eager: ``task.apply(args)`` runs the guard; the record it leaves must be at the worker's key
  with the worker's fingerprint (every ``EAGER_EVERY``-th example: it is the costly one);
- admin: ``Task.idempotency_status`` / ``idempotency_forget`` name ``keys.admin_key``;
- cli: ``--args`` as JSON text (``cli.options._args_key``), against the worker's key of the
  JSON the text carries;
- plugin: ``IdempotencyTester.key_for`` (the testing plugin).

A few thousand examples per serializer in CI (``IDENTITY_EXAMPLES``: 300 in the README's
command, 2000 in .ci/run's campaign step); the counts per
serializer and path are printed (``pytest -s``) and each path must have been compared often.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import os
import types
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import serialization
from kombu.exceptions import KombuError

from celery_idempotent import IdempotencyKeyMissingError, IdempotentTask
from celery_idempotent import settings as idem_settings
from celery_idempotent.backends.redis.key_info import read_key
from celery_idempotent.celery import keys as task_keys
from celery_idempotent.celery.factory import reset_backends
from celery_idempotent.celery.publish import _plan_publish
from celery_idempotent.cli.options import _args_key
from celery_idempotent.testing import IdempotencyTester

pytestmark = pytest.mark.redis

SERIALIZERS = ("json", "msgpack", "yaml", "pickle")
#: 300 per serializer in the README's test command; .ci/run runs it again with 2000.
EXAMPLES = int(os.environ.get("IDENTITY_EXAMPLES", "300"))
#: Each path must have compared at least this share of the examples (the rest: values the
#: serializer cannot carry, where no message exists to compare with).
MIN_SHARE = 0.2
#: The eager path runs a real ``apply()`` (guard, Redis): compared on every n-th example.
EAGER_EVERY = 4


class Color(enum.IntEnum):
    RED = 1
    BLUE = 2


class Kind(str, enum.Enum):
    A = "a"
    B = "b"


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**31), max_value=2**31),
    st.integers(min_value=2**64, max_value=2**90),  # big ints (msgpack cannot carry them)
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.decimals(allow_nan=False, allow_infinity=False, places=3),
    st.uuids(),
    st.datetimes(timezones=st.sampled_from([None, dt.timezone.utc])),
    st.sampled_from([*Color, *Kind]),
)

values = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.integers(min_value=-5, max_value=300), children, max_size=3),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
        st.sets(st.integers(min_value=0, max_value=9), max_size=3),
    ),
    max_leaves=6,
)


def _app(serializer: str, redis_url: str, prefix: str) -> Celery:
    app = Celery(f"identity-{serializer}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        idempotency_url=redis_url,
        idempotency_key_prefix=prefix,
        task_serializer=serializer,
        result_serializer="json",
        accept_content=list(SERIALIZERS),
        task_eager_propagates=False,
    )

    @app.task(base=IdempotentTask, name="identity.by_args", shared=False)
    def by_args(a: Any, b: Any = None, **extra: Any) -> None:
        return None

    @app.task(
        base=IdempotentTask, name="identity.by_format", idempotency_key="k:{a}:{n}", shared=False
    )
    def by_format(a: Any, n: str, b: Any = None) -> None:
        return None

    return app


@pytest.fixture(scope="module")
def apps(redis_url: str) -> Iterator[dict[str, Celery]]:
    idem_settings.clear_cache()
    reset_backends()
    prefix = f"identity-{uuid.uuid4().hex[:8]}:"
    made = {name: _app(name, redis_url, prefix) for name in SERIALIZERS}
    tester = IdempotencyTester(redis_url)
    for app in made.values():
        tester.use(app)
    _testers["tester"] = tester
    yield made
    tester.close()
    for app in made.values():
        app.close()
    idem_settings.clear_cache()
    reset_backends()


_counts: Counter[tuple[str, str]] = Counter()
_testers: dict[str, IdempotencyTester] = {}


def _worker_identity(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a worker derives: ``("ok", key, fingerprint)``, ``("error", type)`` when the
    worker refuses the call, or ``None`` when no message can carry it (encode or decode)."""
    app = task.app
    message = app.amqp.as_task_v2(str(uuid.uuid4()), task.name, args, kwargs)
    try:
        content_type, encoding, data = serialization.dumps(message.body, task.serializer)
        got_args, got_kwargs, _embed = serialization.loads(
            data, content_type, encoding, accept=[content_type]
        )
    except KombuError:
        return None
    return _identity(task, tuple(got_args), got_kwargs, eager=False)


def _identity(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, eager: bool) -> Any:
    cfg = task.idempotency_settings()
    task.push_request(id=str(uuid.uuid4()), headers={}, is_eager=eager)
    try:
        prepared = task_keys.prepare_call(task, cfg, args, kwargs)
    except (TypeError, ValueError, IdempotencyKeyMissingError) as exc:
        return ("error", type(exc).__name__)
    finally:
        task.pop_request()
    assert prepared is not None
    return ("ok", prepared.key, prepared.fingerprint)


def _check_call(app: Celery, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    serializer = task.serializer
    worker = _worker_identity(task, args, kwargs)

    # publish: the plan apply_async makes (the marker's key and fingerprint)
    plan = _plan_publish(task, args, kwargs, None, link=None, link_error=None, options={})
    if worker is None or worker[0] == "error":
        assert plan.check is None, (args, kwargs)  # published unchecked: Celery/the worker says
    else:
        assert plan.check is not None
        assert (plan.check.key, plan.check.fingerprint) == worker[1:], (args, kwargs)
        _counts[serializer, "publish"] += 1
    if worker is None:
        _counts[serializer, "no message"] += 1
        return

    # admin (idempotency_status / idempotency_forget) and the testing plugin
    cfg = task.idempotency_settings()
    if worker[0] == "ok":
        admin = task_keys.admin_key(task, cfg, args, kwargs, key=None, task_id=None)
        assert admin == worker[1], (args, kwargs)
        _counts[serializer, "admin"] += 1
        assert _testers["tester"].key_for(task, args, kwargs) == worker[1]
        _counts[serializer, "plugin"] += 1

    # eager apply(): the record must be at the worker's key, with the worker's fingerprint.
    # A real apply() through the guard and Redis costs most of an example: every EAGER_EVERY-th.
    _counts[serializer, "seen"] += 1
    if _counts[serializer, "seen"] % EAGER_EVERY:
        _cli(task, cfg, serializer, args, kwargs)
        return
    result = task.apply(args, kwargs)
    if worker[0] == "error":
        assert result.failed()
        assert type(result.result).__name__ == worker[1]
    else:
        assert result.successful(), result.result
        store = task.idempotency_guard().store
        info = read_key(store.client, cfg.idempotency_key_prefix, worker[1])
        assert info.record is not None, (args, kwargs)
        assert info.record.get("fingerprint") == worker[2], (args, kwargs)
    _counts[serializer, "eager"] += 1
    _cli(task, cfg, serializer, args, kwargs)


def _cli(
    task: Any, cfg: Any, serializer: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    # the CLI's --args: JSON text, against the worker's key of the JSON it carries
    try:
        args_json = json.dumps(list(args))
        kwargs_json = json.dumps(kwargs)
    except (TypeError, ValueError):
        return
    parsed_args, parsed_kwargs = json.loads(args_json), json.loads(kwargs_json)
    from_json = _worker_identity(task, tuple(parsed_args), parsed_kwargs)
    if from_json is None or from_json[0] != "ok":
        return
    target = types.SimpleNamespace(task=task, settings=cfg)
    assert _args_key(target, task.name, args_json, kwargs_json) == from_json[1]  # type: ignore[arg-type]
    _counts[serializer, "cli"] += 1


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_every_path_names_a_call_as_the_worker_does(
    apps: dict[str, Celery], serializer: str
) -> None:
    app = apps[serializer]
    by_args = app.tasks["identity.by_args"]
    by_format = app.tasks["identity.by_format"]

    @settings(
        max_examples=EXAMPLES,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(a=values, b=values, extra=st.dictionaries(st.sampled_from(["x", "y"]), values))
    def check(a: Any, b: Any, extra: dict[str, Any]) -> None:
        _check_call(app, by_args, (a,), {"b": b, **extra})
        # n: the key's own field, so that two examples never share a format key
        _check_call(app, by_format, (a, uuid.uuid4().hex, b), {})

    check()
    counts = {path: n for (name, path), n in _counts.items() if name == serializer}
    print(f"\none identity, {serializer}: {EXAMPLES} examples x 2 tasks; compared: {counts}")
    calls = 2 * EXAMPLES
    for path in ("publish", "admin", "plugin"):
        assert counts.get(path, 0) >= MIN_SHARE * calls, (path, counts)
    assert counts.get("eager", 0) >= MIN_SHARE * calls / EAGER_EVERY, counts
    assert counts.get("cli", 0) > 0, counts


# --------------------------------------------------------------------------- the cases


@pytest.mark.parametrize(
    ("value", "delivered"),
    [
        ({101: 2}, {"101": 2}),
        (Color.BLUE, 2),
        (Kind.A, "a"),
        ((1, 2), [1, 2]),
    ],
)
def test_the_reported_values_name_the_workers_key(
    apps: dict[str, Celery], value: Any, delivered: Any
) -> None:
    """The issue's cases under JSON: a dict with int keys, an IntEnum, a (str, Enum), a tuple
    in a format key. Each path's key is the key of what the worker receives."""
    app = apps["json"]
    for name in ("identity.by_args", "identity.by_format"):
        task = app.tasks[name]
        worker = _identity(task, (delivered, "n"), {}, eager=False)
        assert worker[0] == "ok"
        plan = _plan_publish(task, (value, "n"), {}, None, link=None, link_error=None, options={})
        assert plan.check is not None
        assert (plan.check.key, plan.check.fingerprint) == worker[1:]
        cfg = task.idempotency_settings()
        admin = task_keys.admin_key(task, cfg, (value, "n"), {}, key=None, task_id=None)
        assert admin == worker[1]


def test_json_native_arguments_keep_their_worker_key(apps: dict[str, Celery]) -> None:
    """The fast path: JSON-native arguments are not re-encoded, and their key is the one the
    worker (which never re-encodes) has always computed: no key changes on upgrade."""
    task = apps["json"].tasks["identity.by_args"]
    inner = {"k": [2, 1.5, None, True, "x"]}
    got_args, got_kwargs = task_keys.as_received(task, (1, inner), {"b": "y"})
    assert got_args == (1, inner)
    assert got_args[1] is inner  # not re-encoded: the very objects
    assert got_kwargs == {"b": "y"}
    # A tuple is not native (the message makes it a list): it goes through the serializer.
    assert task_keys.as_received(task, ((1, 2),), {}) == (([1, 2],), {})


def test_a_per_call_serializer_is_the_one_used(apps: dict[str, Celery]) -> None:
    """``apply_async(serializer="pickle")`` on a JSON task: the worker receives the pickled
    arguments, and the publish side's key is theirs (an IntEnum stays an IntEnum)."""
    task = apps["json"].tasks["identity.by_args"]
    options = {"serializer": "pickle"}
    plan = _plan_publish(task, (Color.RED,), {}, None, link=None, link_error=None, options=options)
    assert plan.check is not None
    assert plan.check.key == _identity(task, (Color.RED,), {}, eager=False)[1]
    assert plan.check.key != _identity(task, (1,), {}, eager=False)[1]
