"""Every ``idempotency_*`` setting: its default, ``app.conf``, a task option, Django's
``CELERY_`` namespace, a bad value (an error that names it), and its effect on a call."""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry, SoftTimeLimitExceeded

from celery_idempotent import IdempotentTask, LockAcquisitionError, current_lease
from celery_idempotent.backends.redis.client import glob_escape
from celery_idempotent.settings import DEFAULTS, IdempotencySettings, clear_cache, resolve
from tests.celery.cidem_helpers import key_of, redis_names
from tests.support.leases import lease_left_ms

pytestmark = pytest.mark.usefixtures("fresh_config")


def _client_factory() -> Any:  # pragma: no cover - resolve() never calls it
    raise AssertionError("settings are resolved without making the client")


def _other_client_factory() -> Any:  # pragma: no cover - resolve() never calls it
    raise AssertionError("settings are resolved without making the client")


#: A valid value other than the default, for every setting.
OTHER: dict[str, Any] = {
    "idempotency_url": "memory://",
    "idempotency_client": _client_factory,
    "idempotency_key": "task_id",
    "idempotency_fingerprint": ("x",),
    "idempotency_missing_key": "run",
    "idempotency_namespace": "billing.charge",
    "idempotency_store_errors": (LookupError,),
    "idempotency_ttl": 60,
    "idempotency_lock_ttl": 3,
    "idempotency_retry_count": 0,
    "idempotency_retry_base_delay": 0.5,
    "idempotency_on_locked": "raise",
    "idempotency_on_duplicate_publish": "raise",
    "idempotency_publish_ttl": 30,
    "idempotency_publish_until": "started",
    "idempotency_window": 300,
    "idempotency_wait_replicas": 1,
    "idempotency_wait_timeout": 0.25,
    "idempotency_key_prefix": "other:",
    "idempotency_enabled": False,
}

#: Bad values, with the exception class expected.
BAD: list[tuple[str, Any, type[Exception]]] = [
    ("idempotency_url", 6379, TypeError),
    ("idempotency_url", "http://localhost:6379/0", ValueError),
    ("idempotency_client", 42, TypeError),
    ("idempotency_client", "redis://localhost:6379/0", TypeError),
    ("idempotency_key", 5, TypeError),
    ("idempotency_key", "", TypeError),
    ("idempotency_fingerprint", "x", ValueError),  # one name: ("x",)
    ("idempotency_on_duplicate_publish", "skip", ValueError),
    ("idempotency_publish_ttl", 0, ValueError),
    ("idempotency_publish_until", "finished", ValueError),
    ("idempotency_window", -5, ValueError),
    ("idempotency_fingerprint", (), TypeError),
    ("idempotency_fingerprint", ("x", 3), TypeError),
    ("idempotency_fingerprint", ("x", "x"), ValueError),
    ("idempotency_missing_key", "skip", ValueError),
    ("idempotency_namespace", "", TypeError),
    ("idempotency_namespace", 7, TypeError),
    ("idempotency_namespace", "a{b}", ValueError),
    ("idempotency_namespace", "billing:key:x", ValueError),
    ("idempotency_store_errors", "ValueError", TypeError),
    ("idempotency_store_errors", (ValueError, 3), TypeError),
    ("idempotency_store_errors", (KeyboardInterrupt,), TypeError),
    ("idempotency_store_errors", (Retry,), ValueError),
    ("idempotency_store_errors", (SoftTimeLimitExceeded,), ValueError),
    ("idempotency_store_errors", (LockAcquisitionError,), ValueError),
    ("idempotency_ttl", -1, ValueError),
    # 0 is a mode since 0.2.0 (nothing kept once the body ends), not a bad value.
    ("idempotency_ttl", float("nan"), ValueError),
    ("idempotency_ttl", "1 day", TypeError),
    ("idempotency_lock_ttl", 0, ValueError),
    ("idempotency_lock_ttl", float("nan"), ValueError),
    ("idempotency_retry_count", -1, ValueError),
    ("idempotency_retry_count", 1.5, TypeError),
    ("idempotency_retry_base_delay", -0.1, ValueError),
    ("idempotency_on_locked", "wait", ValueError),
    ("idempotency_wait_replicas", -1, ValueError),
    ("idempotency_wait_replicas", "1", TypeError),
    ("idempotency_wait_timeout", 0, ValueError),
    ("idempotency_wait_timeout", "1s", TypeError),
    ("idempotency_key_prefix", "", ValueError),
    ("idempotency_key_prefix", "a{b}:", ValueError),
    ("idempotency_enabled", "yes", TypeError),
]


def test_the_table_covers_every_setting() -> None:
    assert set(OTHER) == set(DEFAULTS)
    assert {name for name, _, _ in BAD} == set(DEFAULTS)
    for name, value in OTHER.items():
        assert value != DEFAULTS[name], name


@pytest.fixture
def make_app() -> Iterator[Callable[..., Celery]]:
    apps: list[Celery] = []

    def factory(broker: str = "redis://127.0.0.1:6379/0", **conf: Any) -> Celery:
        app = Celery(f"settings-{uuid.uuid4().hex[:8]}", set_as_current=False)
        app.conf.update(broker_url=broker, result_backend="cache+memory://", **conf)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.close()


def plain_task(app: Celery, **options: Any) -> Any:
    @app.task(shared=False, base=IdempotentTask, name=f"t{uuid.uuid4().hex[:8]}", **options)
    def task(x: int = 0) -> int:
        return x

    return task


# --------------------------------------------------------------------------- sources


def test_defaults(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    cfg = resolve(app, plain_task(app))

    for name, default in DEFAULTS.items():
        if name == "idempotency_url":
            assert cfg.idempotency_url == "redis://127.0.0.1:6379/0"  # the broker fallback
        else:
            assert getattr(cfg, name) == default, name
    assert DEFAULTS["idempotency_ttl"] == 86_400
    assert DEFAULTS["idempotency_lock_ttl"] == 10
    assert DEFAULTS["idempotency_retry_count"] == 3
    assert DEFAULTS["idempotency_retry_base_delay"] == 0.1
    assert DEFAULTS["idempotency_on_locked"] == "retry"
    assert DEFAULTS["idempotency_key"] == "args"
    assert DEFAULTS["idempotency_fingerprint"] == "args"
    assert DEFAULTS["idempotency_missing_key"] == "raise"
    assert DEFAULTS["idempotency_namespace"] is None  # the task's name
    assert DEFAULTS["idempotency_store_errors"] == ()
    assert DEFAULTS["idempotency_key_prefix"] == "idempotency:"
    assert DEFAULTS["idempotency_enabled"] is True


@pytest.mark.parametrize("name", list(OTHER))
def test_app_conf(make_app: Callable[..., Celery], name: str) -> None:
    app = make_app(**{name: OTHER[name]})
    assert getattr(resolve(app, plain_task(app)), name) == OTHER[name]


@pytest.mark.parametrize("name", list(OTHER))
def test_task_option_overrides_the_app(make_app: Callable[..., Celery], name: str) -> None:
    app = make_app(**{name: OTHER[name]})
    value = {
        "idempotency_url": "redis://127.0.0.1:6379/3",
        "idempotency_client": _other_client_factory,
        "idempotency_namespace": "other.namespace",  # None as an option: "not set"
    }.get(name, DEFAULTS[name])
    task = plain_task(app, **{name: value})
    untouched = plain_task(app)

    assert getattr(resolve(app, task), name) == value
    assert getattr(resolve(app, untouched), name) == OTHER[name]
    assert getattr(task.idempotency_settings(), name) == value


@pytest.mark.parametrize("name", list(OTHER))
def test_django_celery_namespace(make_app: Callable[..., Celery], name: str) -> None:
    settings_module = type(
        "DjangoSettings",
        (),
        {"CELERY_BROKER_URL": "redis://127.0.0.1:6379/5", f"CELERY_{name.upper()}": OTHER[name]},
    )
    app = Celery(f"django-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.config_from_object(settings_module, namespace="CELERY")
    try:
        assert app.conf.get(name) == OTHER[name]  # Celery maps the namespace
        assert getattr(resolve(app, plain_task(app)), name) == OTHER[name]
        if name not in ("idempotency_url", "idempotency_client"):  # a client: no fallback
            assert resolve(app, plain_task(app)).idempotency_url == "redis://127.0.0.1:6379/5"
    finally:
        app.close()


def test_callable_key_as_task_option_and_as_setting(make_app: Callable[..., Celery]) -> None:
    def key_fn(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return f"k-{args[0]}"

    app = make_app(idempotency_url="memory://")
    task = plain_task(app, idempotency_key=key_fn)
    assert resolve(app, task).idempotency_key is key_fn
    assert task.idempotency_key_for((7,), {}) == f"{task.name}:key:k-7"
    app2 = make_app(idempotency_url="memory://", idempotency_key=key_fn)
    task2 = plain_task(app2)
    assert task2.idempotency_key_for((8,), {}) == f"{task2.name}:key:k-8"


def test_durations_accept_timedelta(make_app: Callable[..., Celery]) -> None:
    app = make_app(idempotency_ttl=datetime.timedelta(hours=1))
    cfg = resolve(app, plain_task(app, idempotency_lock_ttl=datetime.timedelta(seconds=5)))
    assert cfg.idempotency_ttl == 3600
    assert cfg.idempotency_lock_ttl == 5


def test_settings_are_cached_until_clear_cache(make_app: Callable[..., Celery]) -> None:
    app = make_app(idempotency_ttl=100)
    task = plain_task(app)
    assert resolve(app, task).idempotency_ttl == 100
    app.conf.idempotency_ttl = 200
    assert resolve(app, task).idempotency_ttl == 100
    clear_cache(app)
    assert resolve(app, task).idempotency_ttl == 200


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(("name", "value", "error"), BAD)
def test_bad_value_in_app_conf_names_the_setting(
    make_app: Callable[..., Celery], name: str, value: Any, error: type[Exception]
) -> None:
    app = make_app(**{name: value})
    task = plain_task(app)

    with pytest.raises(error, match=name):
        resolve(app, task)
    # a call fails with the same error (before any body runs)
    result = task.apply((1,))
    assert result.state == "FAILURE"
    assert isinstance(result.result, error)
    assert name in str(result.result)


@pytest.mark.parametrize(("name", "value", "error"), BAD)
def test_bad_value_as_task_option_names_the_setting(
    make_app: Callable[..., Celery], name: str, value: Any, error: type[Exception]
) -> None:
    app = make_app()
    task = plain_task(app, **{name: value})
    with pytest.raises(error, match=name):
        task.idempotency_settings()


def test_bad_value_in_django_form_names_the_setting() -> None:
    settings_module = type(
        "DjangoSettings",
        (),
        {"CELERY_BROKER_URL": "redis://127.0.0.1:6379/5", "CELERY_IDEMPOTENCY_TTL": -5},
    )
    app = Celery(f"django-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.config_from_object(settings_module, namespace="CELERY")
    try:
        with pytest.raises(ValueError, match="idempotency_ttl"):
            resolve(app, plain_task(app))
    finally:
        app.close()


# --------------------------------------------------------------------------- idempotency_url


@pytest.mark.parametrize(
    "broker",
    [
        "redis://127.0.0.1:6379/4",
        "rediss://127.0.0.1:6380/0",
        "unix:///tmp/redis.sock?db=1",
        "redis://127.0.0.1:6379/4;redis://127.0.0.1:6380/4",
    ],
)
def test_url_falls_back_to_a_redis_broker(make_app: Callable[..., Celery], broker: str) -> None:
    app = make_app(broker=broker)
    assert resolve(app, plain_task(app)).idempotency_url == broker.split(";", maxsplit=1)[0]


@pytest.mark.parametrize("broker", ["amqp://guest:secret@127.0.0.1:5672//", "memory://", None])
def test_non_redis_broker_without_url_is_a_clear_error(
    make_app: Callable[..., Celery], broker: str | None
) -> None:
    app = Celery(f"amqp-{uuid.uuid4().hex[:8]}", set_as_current=False)
    if broker is not None:
        app.conf.broker_url = broker
    task = plain_task(app)
    try:
        with pytest.raises(ValueError, match="idempotency_url") as caught:
            resolve(app, task)
        assert "secret" not in str(caught.value)  # the password is redacted
        result = task.apply((1,))
        assert result.state == "FAILURE"
        assert "idempotency_url" in str(result.result)
        app.conf.idempotency_url = "memory://"
        clear_cache(app)
        assert task.apply((1,)).get() == 1
    finally:
        app.close()


# --------------------------------------------------------------------------- effects


@pytest.fixture
def redis_app(
    make_app: Callable[..., Celery], redis_url: str, key_prefix: str
) -> Callable[..., Celery]:
    def factory(**conf: Any) -> Celery:
        conf.setdefault("idempotency_key_prefix", key_prefix)
        return make_app(broker=redis_url, **conf)

    return factory


def test_ttl_and_lock_ttl_reach_redis(redis_app: Callable[..., Celery], redis_client: Any) -> None:
    app = redis_app(idempotency_ttl=120)
    seen: dict[str, int] = {}

    @app.task(shared=False, base=IdempotentTask, idempotency_lock_ttl=4)
    def body(x: int) -> int:
        lease = current_lease()
        assert lease is not None
        seen["lock_pttl"] = lease_left_ms(redis_client, lease.resource)
        return x

    assert body.apply((1,)).get() == 1
    _, record = redis_names(body, key_of(body, 1))
    assert 110_000 < redis_client.pttl(record) <= 120_000
    assert 3_000 < seen["lock_pttl"] <= 4_000


def test_key_prefix_namespaces_every_key(
    redis_app: Callable[..., Celery], redis_client: Any, key_prefix: str
) -> None:
    app = redis_app(idempotency_key_prefix=f"{key_prefix}custom:")
    task = plain_task(app)
    task.apply((1,)).get()
    names = list(redis_client.scan_iter(match=glob_escape(key_prefix) + "*"))
    assert names
    assert all(n.decode().startswith(f"{key_prefix}custom:") for n in names)


def test_retry_count_and_base_delay_shape_the_attempts(
    redis_app: Callable[..., Celery],
) -> None:
    app = redis_app(idempotency_on_locked="raise")
    task = plain_task(app, idempotency_retry_count=2, idempotency_retry_base_delay=0.1)
    guard = task.idempotency_guard()
    resource, _ = redis_names(task, key_of(task, 1))
    assert guard.lock_provider.acquire(resource, 10) is not None

    started = time.monotonic()
    result = task.apply((1,))
    elapsed = time.monotonic() - started

    assert isinstance(result.result, LockAcquisitionError)
    assert result.result.attempts == 3
    assert elapsed >= 0.1 + 0.2  # base * 2**0 + base * 2**1, plus jitter


def test_key_strategies(redis_app: Callable[..., Celery]) -> None:
    app = redis_app()
    runs: list[str] = []

    @app.task(shared=False, base=IdempotentTask, idempotency_key="order:{order_id}")
    def ship(order_id: int, address: str) -> str:
        runs.append(address)
        return address

    @app.task(shared=False, base=IdempotentTask, idempotency_key="task_id")
    def by_id(x: int) -> int:
        runs.append(f"id{x}")
        return x

    assert ship.apply((1, "here")).get() == "here"
    assert ship.apply((1, "here")).get() == "here"
    assert type(ship.apply((1, "there")).result).__name__ == "IdempotencyMismatchError"
    by_id.apply((1,), task_id="same")
    by_id.apply((1,), task_id="same")
    by_id.apply((1,), task_id="other")
    assert runs == ["here", "id1", "id1"]


def test_kill_switch_runs_tasks_plainly(
    redis_app: Callable[..., Celery], redis_client: Any, key_prefix: str
) -> None:
    app = redis_app(idempotency_enabled=False)
    runs: list[int] = []

    @app.task(shared=False, base=IdempotentTask)
    def body(x: int) -> int:
        assert current_lease() is None
        runs.append(x)
        return x

    body.apply((1,))
    body.apply((1,))
    assert runs == [1, 1]
    assert list(redis_client.scan_iter(match=glob_escape(key_prefix) + "*")) == []


def test_resolved_settings_are_the_documented_dataclass(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    cfg = resolve(app, plain_task(app))
    assert isinstance(cfg, IdempotencySettings)
    assert cfg.backend_url == cfg.idempotency_url


def test_resolve_accepts_the_lazy_proxy_that_app_task_returns(
    make_app: Callable[..., Celery],
) -> None:
    """Regression: resolve() given the proxy cached the app's settings under the task's name,
    without the task's own options, and the task then used those."""
    app = make_app(idempotency_ttl=100)
    task = plain_task(app, idempotency_ttl=60)
    assert type(task).__name__ == "PromiseProxy"

    assert resolve(app, task).idempotency_ttl == 60
    assert task.idempotency_settings().idempotency_ttl == 60


def test_url_falls_back_to_the_broker_given_by_celery_broker_url_env(
    make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery takes its broker from ``CELERY_BROKER_URL`` before ``broker_url``; so does the
    fallback (the environment is how containers usually get their broker)."""
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/7")
    app = Celery(f"env-{uuid.uuid4().hex[:8]}", set_as_current=False)
    amqp_app = make_app(broker="amqp://guest:guest@127.0.0.1:5672//")
    try:
        assert app.conf.broker_url == "redis://127.0.0.1:6379/7"
        assert resolve(app, plain_task(app)).idempotency_url == "redis://127.0.0.1:6379/7"
        assert amqp_app.conf.broker_url == "redis://127.0.0.1:6379/7"  # Celery's choice
        assert resolve(amqp_app, plain_task(amqp_app)).idempotency_url == app.conf.broker_url
    finally:
        app.close()
