"""The ``idempotency`` fixture's :class:`IdempotencyTester`: deliveries and what they stored."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_idempotent.testing.switch import Switchboard, current

if TYPE_CHECKING:
    from celery_idempotent.core.protocols import IdempotencyRecord

__all__ = ["IdempotencyTester", "TwoDeliveries"]

#: Final states of a delivery: every other (RETRY: re-queued while the key was held) is
#: followed by another delivery of the same message.
_FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "IGNORED", "REJECTED", "REVOKED"})


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
        self._switch = Switchboard(backend_url)
        self._lock = threading.Condition()
        self._finished: dict[str, list[tuple[str, Any]]] = {}
        self._listening = False

    # -- switching --------------------------------------------------------------------------

    def use(self, app_or_task: Any) -> None:
        """Switch an app (every idempotent task it has now and later) or one task's app."""
        self._switch.use(app_or_task)

    def close(self) -> None:
        """Put every switched app and task back as it was; forget the test's backends."""
        from celery_idempotent.celery.task import reset_backends  # noqa: PLC0415

        self._switch.restore()
        if self._listening:
            from celery import signals  # noqa: PLC0415

            signals.task_postrun.disconnect(self._on_postrun)
            self._listening = False
        reset_backends()

    # -- delivering -------------------------------------------------------------------------

    def executions(self, task: Any) -> int:
        """How many times ``task``'s body has run since the test switched it."""
        return self._switch.executions(task)

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
        name = current(task).name
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
        from celery_idempotent.testing import django_db  # noqa: PLC0415

        task = current(task)
        shared = django_db.test_transactions()
        if shared and self.backend_url.startswith("django://"):
            raise ValueError(
                "while_running=True with the django:// backend needs transactional_db (or a "
                "TransactionTestCase): the two deliveries each hold a transaction of their "
                "own, which cannot see the rows the test writes inside the db fixture's "
                "transaction. Use transactional_db, or the memory or redis backend under db"
            )
        entered, release, held = threading.Event(), threading.Event(), threading.Event()

        def contended(sender: Any = None, **_: Any) -> None:
            if current(sender) is task:
                held.set()
                release.set()

        outcomes: list[tuple[bool, Any]] = [(False, None), (False, None)]

        def deliver(index: int) -> None:
            # On the test's own Django connections when it holds a transaction open (db
            # fixture), and no connection of the thread's own left open afterwards.
            with django_db.delivery_thread(shared):
                try:
                    value = self.deliver(task, args, kwargs, task_id=ids[index], key=key)
                except BaseException as exc:  # handed to the test's thread below
                    outcomes[index] = (False, exc)
                else:
                    outcomes[index] = (True, value)

        signals.idempotency_contended.connect(contended, weak=False)
        self._switch.hold(task, entered, release, timeout)
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
            self._switch.unhold(task)
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
                        f"no worker finished {current(task).name}[{task_id}] within "
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
        task = current(task)
        if (
            key is None
            and task_id is None
            and task.idempotency_settings().idempotency_key == ("task_id")
        ):
            raise ValueError(f"the key of {task.name} is the task id: pass task_id=")
        headers = {"idempotency_key": key} if key is not None else {}
        # The arguments as a worker receives them (through the task's serializer): one identity.
        # (Imported here: loading the plugin must not import kombu or Celery.)
        from celery_idempotent.celery.keys import as_received  # noqa: PLC0415

        call_args, call_kwargs = as_received(task, args, kwargs)
        task.push_request(id=task_id, headers=headers, args=list(call_args), kwargs=call_kwargs)
        try:
            return str(task.idempotency_key_for(call_args, call_kwargs))
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
        provider = guard.lock_provider
        is_locked = getattr(provider, "is_locked", None)
        if not callable(is_locked):
            raise TypeError(
                f"{type(provider).__name__} has no is_locked(resource): this lock provider "
                "cannot say whether a key is held"
            )
        return bool(is_locked(guard.lock_resource(name)))

    def _guard(self, task: Any) -> Any:
        task = current(task)
        # The guard the task itself uses, so that what is shown is what a delivery sees.
        return task.idempotency_guard()


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
