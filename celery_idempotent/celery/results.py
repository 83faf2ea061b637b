"""Results as Celery hands them over: the app's result serializer, the round trip an eager
caller's value takes, and the envelope in which a failure listed in
``idempotency_store_errors`` is stored and replayed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_idempotent.settings import result_accept

if TYPE_CHECKING:
    from celery_idempotent.celery.task import IdempotentTask

__all__ = [
    "FAILURE_MARKER",
    "as_delivered",
    "failure_envelope",
    "failure_from",
    "is_failure_envelope",
    "result_serialization",
]

#: The key of the envelope in which a failure listed in ``idempotency_store_errors`` is stored:
#: ``{FAILURE_MARKER: 1, "exc": <the exception as Celery's result backend serializes it>}``.
FAILURE_MARKER = "__celery_idempotent_failure__"


def result_serialization(conf: Any) -> tuple[str, list[str]]:
    """The app's result serializer and the accept list results are loaded with."""
    serializer = conf.get("result_serializer") or "json"
    return serializer, result_accept(conf)


def as_delivered(conf: Any, value: Any) -> Any:
    """``value`` after a round trip through the result serializer, as a replay gets it."""
    import kombu.serialization  # noqa: PLC0415

    kombu_ser: Any = kombu.serialization  # kombu ships no type information
    serializer, accept = result_serialization(conf)
    content_type, encoding, data = kombu_ser.dumps(value, serializer=serializer)
    accepted = kombu_ser.prepare_accept_content(accept)
    return kombu_ser.loads(data, content_type, encoding, accept=accepted)


def failure_envelope(task: IdempotentTask, exc: BaseException) -> dict[str, Any]:
    """What is stored for a failure listed in ``idempotency_store_errors``: the exception
    as Celery's result backend prepares it for the result serializer (class, module and
    args for JSON; the exception itself for pickle), in an envelope no result can be
    mistaken for (see :func:`is_failure_envelope`)."""
    serializer, _ = result_serialization(task.app.conf)
    return {FAILURE_MARKER: 1, "exc": task.backend.prepare_exception(exc, serializer)}


def is_failure_envelope(value: Any) -> bool:
    """Whether a stored value is a failure stored by ``idempotency_store_errors``."""
    if type(value) is not dict or len(value) != 2 or "exc" not in value:
        return False
    return bool(value.get(FAILURE_MARKER) == 1)


def failure_from(
    task: IdempotentTask,
    envelope: dict[str, Any],
    store_errors: tuple[type[BaseException], ...] | None = None,
) -> BaseException:
    """The stored failure rebuilt as Celery's result backend rebuilds one: the same class
    with the same args; a stored name that is not an exception class is refused
    (``SecurityError``), and nothing is imported.

    A class listed in ``idempotency_store_errors`` is taken from the list itself: Celery
    looks classes up in ``sys.modules`` only, and a replay that does not run the body may
    not have imported the module the body takes it from. ``store_errors``: that list as
    the call's settings (resolved once per call) give it; ``None``: the task's settings.
    """
    stored = envelope["exc"]
    if isinstance(stored, dict):
        wanted = (stored.get("exc_module"), stored.get("exc_type"))
        if store_errors is None:
            store_errors = task.idempotency_settings().idempotency_store_errors
        for cls in store_errors:
            if (cls.__module__, cls.__qualname__) == wanted:
                message = stored.get("exc_message", ())
                args = message if isinstance(message, (list, tuple)) else (message,)
                try:
                    return cls(*args)
                except Exception:  # as Celery: fall back to its own rebuild
                    break
    exc = task.backend.exception_to_python(stored)
    if not isinstance(exc, BaseException):  # pragma: no cover - Celery always gives one
        raise TypeError(f"stored failure of task {task.name} is not an exception: {exc!r}")
    return exc
