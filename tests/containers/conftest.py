"""pytest-celery's setups on images built here (``images.py``), with no image registry.

pytest-celery's vendors pull ``redis:latest`` and ``rabbitmq:management`` and build their worker
``FROM python:3.10-slim``: none of that is reachable here. This layer overrides the fixtures its
docs name for customisation, so ``celery_setup`` and every fixture under it run on the images
that ``python -m tests.containers build`` makes:

- ``celery_base_worker_image``: the worker image (this project, Celery, pytest-celery installed
  from the host's wheelhouse); ``default_worker_container_cls``: our worker class (the tasks of
  ``worker_tasks.py``, a prefork pool of 2, prefetch 1);
- ``default_redis_*_image`` / ``default_rabbitmq_broker_image``: the Debian base image, whose
  ``redis-server`` and ``rabbitmq-server`` are Debian's packages; the RabbitMQ container is
  redefined since pytest-celery gives it no command (the official image has an entrypoint);
- ports are published on 127.0.0.1 only; containers talk over the network pytest-celery creates
  for the test (``default_pytest_celery_network``): no other address is involved;
- ``celery_broker`` / ``celery_backend``: Redis and RabbitMQ brokers, the Redis backend (the
  plugin's defaults are whatever vendors happen to import);
- ``celery_setup_app`` / ``default_worker_app``: the idempotency settings, for the test process
  (the Redis backend's published port) and for the worker (the backend container by name).

Without a Docker daemon every test here skips with a reason that says how to run them.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from pytest_celery import (
    CeleryTestWorker,
    CeleryWorkerContainer,
    RabbitMQContainer,
    RedisContainer,
)
from pytest_celery.fixtures.worker import celery_worker  # noqa: F401  (see below)
from pytest_docker_tools import container, fxtr

from tests.containers import worker_tasks
from tests.containers.images import BuildError, Images, ensure
from tests.support.ports import free_port

# The suite's root conftest replaces pytest-celery's ``celery_worker`` (a container) with
# Celery's in-process one, which the rest of the suite expects; here pytest-celery's is the
# one ``celery_setup`` builds on, so it is imported back (a conftest's imported fixtures count).

HOW_TO_RUN = (
    "no Docker daemon: the container tests need one (apt-get install -y docker.io debootstrap; "
    "start dockerd; python -m tests.containers build), as .ci/run does"
)
#: Seconds a key's lease lasts in the container tests (short, so a killed body frees it soon).
LOCK_TTL = 3.0


def docker_available() -> str | None:
    """``None`` when a Docker daemon answers, else why not (the skip reason)."""
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=10)
        client.ping()
        client.close()
    except Exception as exc:
        return f"{HOW_TO_RUN} ({type(exc).__name__}: {exc})"
    return None


@pytest.fixture(scope="session")
def docker_client() -> Any:
    """pytest-docker-tools' client, asked for first by pytest-celery's setups: here it skips
    with the reason (and how to run these tests) when no daemon answers, instead of erroring
    in ``docker.from_env()`` before any fixture of ours could skip."""
    reason = docker_available()
    if reason is not None:
        pytest.skip(reason)
    import docker

    return docker.from_env()


@pytest.fixture(scope="session")
def container_images() -> Images:
    """The images, built (or found in the cache) once per session; a skip without Docker."""
    reason = docker_available()
    if reason is not None:
        pytest.skip(reason)
    try:
        return ensure(["bookworm"])
    except BuildError as exc:
        pytest.fail(f"the container images could not be built: {exc}")


@pytest.fixture(scope="session")
def base_image(container_images: Images) -> str:
    return container_images.base["bookworm"]


# --------------------------------------------------------------------------- brokers, backend


@pytest.fixture(params=["celery_redis_broker", "celery_rabbitmq_broker"])
def celery_broker(request: pytest.FixtureRequest) -> Iterator[Any]:
    broker = request.getfixturevalue(request.param)
    yield broker
    broker.teardown()


@pytest.fixture
def celery_backend(celery_redis_backend: Any) -> Iterator[Any]:
    yield celery_redis_backend
    celery_redis_backend.teardown()


@pytest.fixture
def default_redis_broker_image(base_image: str) -> str:
    return base_image


@pytest.fixture
def default_redis_backend_image(base_image: str) -> str:
    return base_image


@pytest.fixture
def default_rabbitmq_broker_image(base_image: str) -> str:
    return base_image


LOOPBACK_REDIS = {"6379/tcp": ("127.0.0.1", None)}


@pytest.fixture
def default_redis_broker_ports() -> dict[str, Any]:
    return LOOPBACK_REDIS


@pytest.fixture
def default_redis_backend_ports() -> dict[str, Any]:
    # A fixed host port: a restarted container gets its binding back, and the test process's
    # URLs (result backend, idempotency store) stay right.
    return {"6379/tcp": ("127.0.0.1", free_port())}


@pytest.fixture
def default_rabbitmq_broker_ports() -> dict[str, Any]:
    return {"5672/tcp": ("127.0.0.1", None)}


@pytest.fixture
def default_redis_backend_command() -> list[str]:
    # The backend holds the idempotency keys too: AOF on, fsync'd on every write, as the docs
    # recommend for a store whose records must survive a restart.
    return [*RedisContainer.command(), "--appendonly", "yes", "--appendfsync", "always"]


def published_port(node: Any, port: str, timeout: float = 60.0) -> int:
    """The host port docker published ``port`` on; only ever on 127.0.0.1 (see the ports).

    pytest-celery's vendors ask pytest-docker-tools, which answers with the container's own
    port when it believes the tests run in a container (``/.dockerenv``, as on this project's
    machines), and then build ``localhost:<that port>``: the host's own Redis. Read docker's
    port binding instead, so a test never talks to a server it did not start.
    """
    deadline = time.monotonic() + timeout
    while True:
        node.reload()
        bindings = (node.attrs["NetworkSettings"]["Ports"] or {}).get(port) or []
        if bindings:
            assert bindings[0]["HostIp"] == "127.0.0.1", bindings
            return int(bindings[0]["HostPort"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node.name}: {port} was not published in {timeout:g}s")
        time.sleep(0.1)


class LoopbackRedisContainer(RedisContainer):
    """pytest-celery's Redis, reached from the test process on its loopback-published port."""

    @property
    def port(self) -> int:
        return published_port(self, "6379/tcp")

    @property
    def host_url(self) -> str:
        return f"{self.prefix()}127.0.0.1:{self.port}/{self.vhost}"


class LoopbackRabbitMQContainer(RabbitMQContainer):
    """pytest-celery's RabbitMQ, reached from the test process on its loopback-published port."""

    @property
    def port(self) -> int:
        return published_port(self, "5672/tcp")

    @property
    def ready_prompt(self) -> str:
        # Debian's rabbitmq-server logs to a file; its console says this once it accepts.
        return "Starting broker... completed"

    @property
    def host_url(self) -> str:
        return f"{self.prefix()}127.0.0.1:{self.port}/{self.vhost}"


# pytest-celery's container fixtures, redefined with the wrapper classes above (its factories
# take the class as a literal, not a fixture); the RabbitMQ one also needs a command, which the
# official image has as its entrypoint and Debian's package does not.
default_redis_broker = container(
    image="{default_redis_broker_image}",
    ports=fxtr("default_redis_broker_ports"),
    environment=fxtr("default_redis_broker_env"),
    network="{default_pytest_celery_network.name}",
    wrapper_class=LoopbackRedisContainer,
    timeout=60,
    command=fxtr("default_redis_broker_command"),
)

default_redis_backend = container(
    image="{default_redis_backend_image}",
    ports=fxtr("default_redis_backend_ports"),
    environment=fxtr("default_redis_backend_env"),
    network="{default_pytest_celery_network.name}",
    wrapper_class=LoopbackRedisContainer,
    timeout=60,
    command=fxtr("default_redis_backend_command"),
)

default_rabbitmq_broker = container(
    image="{default_rabbitmq_broker_image}",
    ports=fxtr("default_rabbitmq_broker_ports"),
    environment=fxtr("default_rabbitmq_broker_env"),
    network="{default_pytest_celery_network.name}",
    wrapper_class=LoopbackRabbitMQContainer,
    timeout=120,
    # Debian's wrapper script drops to the rabbitmq user itself.
    command=["rabbitmq-server"],
)


# --------------------------------------------------------------------------- worker


class IdempotentWorkerContainer(CeleryWorkerContainer):
    """A worker of this project's image running :mod:`tests.containers.worker_tasks`."""

    @classmethod
    def command(cls, *args: str, **kwargs: Any) -> list[str]:
        return super().command(
            "--pool", "prefork", "--concurrency", "2", "--prefetch-multiplier", "1",
            "--without-gossip", "--without-mingle", *args,
        )  # fmt: skip

    @classmethod
    def tasks_modules(cls) -> set[Any]:
        return {worker_tasks}


@pytest.fixture
def default_worker_container_cls() -> type[CeleryWorkerContainer]:
    return IdempotentWorkerContainer


@pytest.fixture(scope="session")
def default_worker_container_session_cls() -> type[CeleryWorkerContainer]:
    return IdempotentWorkerContainer


@pytest.fixture(scope="session")
def celery_base_worker_image(container_images: Images, docker_client: Any) -> Any:
    # pytest-celery builds this FROM python:3.10-slim; ours is built from the wheelhouse.
    return docker_client.images.get(container_images.worker["bookworm"])


def idempotency_settings(url: str) -> dict[str, Any]:
    """The settings both sides share: late acks so a killed worker's message comes back."""
    return {
        "idempotency_url": url,
        "idempotency_lock_ttl": LOCK_TTL,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "broker_transport_options": {"visibility_timeout": 10},
        "broker_connection_retry_on_startup": True,
    }


#: The idempotency store's name on the store network (the worker's ``idempotency_url``).
STORE_ALIAS = "idempotency-store"


@pytest.fixture
def store_network(docker_client: Any, default_redis_backend: RedisContainer) -> Iterator[Any]:
    """A network of the worker and the Redis that holds the keys, and nothing else: cutting it
    (:func:`partition`) parts the worker from its store while its broker stays connected.
    ``internal``: no route out of it."""
    network = docker_client.networks.create(
        f"cidem-store-{uuid.uuid4().hex[:8]}", driver="bridge", internal=True
    )
    network.connect(default_redis_backend.name, aliases=[STORE_ALIAS])
    try:
        yield network
    finally:
        network.reload()
        for member in network.containers:
            network.disconnect(member, force=True)
        network.remove()


@pytest.fixture
def idempotency_urls(default_redis_backend: RedisContainer, store_network: Any) -> dict[str, str]:
    """The idempotency store (database 1 of the backend container): as the test process reaches
    it (the port published on loopback) and as the worker does (over the store network)."""
    return {
        "host": f"redis://127.0.0.1:{default_redis_backend.port}/1",
        "worker": f"redis://{STORE_ALIAS}:6379/1",
    }


@pytest.fixture
def celery_setup_app(
    celery_setup_cls: Any, celery_setup_config: dict[str, Any], celery_setup_name: str,
    idempotency_urls: dict[str, str],
) -> Celery:  # fmt: skip
    app = celery_setup_cls.create_setup_app(
        celery_setup_config=celery_setup_config, celery_setup_app_name=celery_setup_name
    )
    app.conf.update(idempotency_settings(idempotency_urls["host"]))
    return app


@pytest.fixture
def default_worker_app(celery_setup_app: Celery, idempotency_urls: dict[str, str]) -> Celery:
    # What pytest-celery writes into the worker's app module: only the changed settings, so the
    # broker and backend still come from the container's environment (their names in the
    # network), and the idempotency store is reached by the backend container's name.
    app = Celery(celery_setup_app.main)
    app.conf.update(idempotency_settings(idempotency_urls["worker"]))
    return app


@pytest.fixture
def celery_setup_worker(
    default_worker_cls: type[CeleryTestWorker],
    default_worker_container: CeleryWorkerContainer,
    celery_setup_app: Celery,
    store_network: Any,
) -> Iterator[CeleryTestWorker]:
    # pytest-celery hands the worker node the app written into the container; the test process
    # needs one that reaches the containers through their published ports instead. The worker
    # joins the store network here (pytest-docker-tools starts a container on one network);
    # until then its start-up check cannot reach the store, which only costs a log line.
    worker = default_worker_cls(container=default_worker_container, app=celery_setup_app)
    store_network.connect(default_worker_container.name)
    yield worker
    worker.teardown()


# --------------------------------------------------------------------------- reading the logs

_LINE = re.compile(r"^.*BODY (start|end) (\S+) pid=(\d+) at=([\d.]+)", re.M)


def body_marks(*logs: str, token: str | None = None) -> list[tuple[str, str, int, float]]:
    """``(event, token, pid, at)`` of every body mark in ``logs``, in time order."""
    marks = [
        (event, tok, int(pid), float(at))
        for log in logs
        for event, tok, pid, at in _LINE.findall(log)
        if token is None or tok == token
    ]
    return sorted(marks, key=lambda mark: mark[3])


def assert_never_overlapping(marks: list[tuple[str, str, int, float]]) -> None:
    """No two bodies of one token were running at the same time (a start while one ran)."""
    running: dict[str, int] = {}
    for event, token, _pid, _at in marks:
        if event == "start":
            assert running.get(token, 0) == 0, f"two bodies of {token} at once: {marks}"
            running[token] = 1
        else:
            running[token] = 0


@contextlib.contextmanager
def partition(network: Any, node: Any) -> Iterator[None]:
    """``docker network disconnect`` ``node`` from ``network``, and connect it again on exit."""
    network.disconnect(node.name, force=True)
    try:
        yield
    finally:
        network.connect(node.name)
