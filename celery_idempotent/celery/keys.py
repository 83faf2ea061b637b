"""The key and the fingerprint of one task call.

What :class:`~celery_idempotent.IdempotentTask` derives from a call: the arguments bound to
the task's signature (defaults applied), the key its ``idempotency_key`` strategy gives (or the
per-call header), namespaced and, with ``idempotency_window``, slotted, and the fingerprint
stored with the result. The publish side (``publish.py``) and the worker side (``task.py``)
both come here, so that a key computed at publish is the key the worker computes.

One identity (SPEC §8): a worker derives the key and fingerprint from the arguments as the
message delivers them, after the task's serializer (JSON turns ``{101: 2}`` into
``{"101": 2}``, a tuple into a list, an ``IntEnum`` into its int). Every path that sees the
caller's Python arguments (publish, an eager ``apply()``, ``idempotency_status`` /
``idempotency_forget``, the CLI's ``--args``, the testing plugin) first passes them through
:func:`as_received`: the serializer and back, skipped when the arguments are already of the
types every built-in serializer gives back unchanged. The worker's own arguments are used as
they arrive, so its keys do not change.
"""

from __future__ import annotations

import datetime as _dt
import inspect
import logging
import string
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from kombu import serialization
from kombu.exceptions import KombuError

from celery_idempotent import keyspace
from celery_idempotent.core.exceptions import IdempotencyKeyMissingError
from celery_idempotent.core.fingerprint import fingerprint_payload
from celery_idempotent.keyspace import task_key

if TYPE_CHECKING:
    from celery_idempotent.celery.task import IdempotentTask
    from celery_idempotent.settings import IdempotencySettings

__all__ = [
    "KEY_HEADER",
    "SLOT_HEADER",
    "PreparedCall",
    "admin_key",
    "as_received",
    "bound_arguments",
    "default_hook",
    "eta_seconds",
    "fingerprint_for",
    "key_for",
    "prepare_call",
    "received_or_none",
    "request_value",
    "slot_of_request",
]

log = logging.getLogger("celery_idempotent")

_F = TypeVar("_F", bound=Callable[..., Any])

#: The per-call header that sets the key explicitly:
#: ``task.apply_async(args, headers={"idempotency_key": "payment-42"})``.
KEY_HEADER = "idempotency_key"
#: The schedule slot (``idempotency_window``) stamped at publish, so that redeliveries keep it.
SLOT_HEADER = "idempotency_slot"


#: The serializers (kombu's registered names) under which the fast path of
#: :func:`as_received` holds: ``str``, ``int``, ``float``, ``bool``, ``None``, and lists and
#: str-keyed dicts of them come back from each as they went in. Not yaml: it sorts a dict's
#: keys, which a format key that shows a dict would see.
_NATIVE_SERIALIZERS = frozenset({"json", "msgpack", "pickle"})
#: kombu's serialization module (untyped).
_kombu: Any = serialization
#: msgpack encodes ints in 64 bits; a bigger one is not native there.
_MSGPACK_INT = (-(2**63), 2**64 - 1)


def _native(value: Any, small_ints: bool) -> bool:
    """Whether ``value`` comes back from every built-in serializer as it went in."""
    t = type(value)
    if t is str or t is bool or t is float or value is None:
        return True
    if t is int:
        return not small_ints or _MSGPACK_INT[0] <= value <= _MSGPACK_INT[1]
    if t is list:
        return all(_native(item, small_ints) for item in value)
    if t is dict:
        return all(type(k) is str and _native(v, small_ints) for k, v in value.items())
    return False


def as_received(
    task: IdempotentTask,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    serializer: str | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` as a worker receives them: through ``serializer`` (the call's, else
    the task's) and back, as Celery's message does (SPEC §8, one identity).

    Arguments that are already ``str``, ``int``, ``float``, ``bool``, ``None``, or lists and
    str-keyed dicts of them, skip the round trip under ``json``, ``msgpack`` and ``pickle``
    (they come back unchanged). Raises a ``kombu.exceptions.KombuError`` (``EncodeError``,
    ``DecodeError``) when the serializer cannot carry them: no message with them can be
    published or received either.
    """
    call_args = tuple(args or ())
    call_kwargs = dict(kwargs or {})
    name = serializer or getattr(task, "serializer", None) or task.app.conf.task_serializer
    if name in _NATIVE_SERIALIZERS:
        small = name == "msgpack"
        if all(_native(a, small) for a in call_args) and all(
            _native(v, small) for v in call_kwargs.values()
        ):
            return call_args, call_kwargs
    content_type, encoding, data = _kombu.dumps([list(call_args), call_kwargs], name)
    # Our own bytes, just made: accepting their content type loads nothing foreign.
    loaded = _kombu.loads(data, content_type, encoding, accept=[content_type])
    got_args, got_kwargs = loaded
    return tuple(got_args), dict(got_kwargs)


def received_or_none(
    task: IdempotentTask,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    serializer: str | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """:func:`as_received`, or ``None`` when the serializer cannot carry the arguments."""
    try:
        return as_received(task, args, kwargs, serializer=serializer)
    except (KombuError, TypeError, ValueError):
        return None


#: Set on ``IdempotentTask``'s own key and fingerprint hooks (:func:`default_hook`).
_DEFAULT_HOOK = "_idempotency_default_hook"


def default_hook(hook: _F) -> _F:
    """Mark one of ``IdempotentTask``'s own hooks (``idempotency_key_for``,
    ``idempotency_fingerprint_for``): :func:`prepare_call` does what it does itself, with the
    settings it was given, instead of calling back into the task. A subclass's override has
    no mark, so it is called."""
    setattr(hook, _DEFAULT_HOOK, True)
    return hook


def _overridden(task: IdempotentTask, hook: str) -> bool:
    """Whether ``task``'s class overrides ``IdempotentTask``'s own ``hook``."""
    return not getattr(getattr(type(task), hook, None), _DEFAULT_HOOK, False)


class PreparedCall(NamedTuple):
    """What a guarded call needs: its key, its bound arguments and its fingerprint."""

    key: str
    payload: Any
    fingerprint: str | None


def prepare_call(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    as_message: bool = False,
) -> PreparedCall | None:
    """The key, payload and fingerprint of the call in ``task.request`` under ``cfg`` (the
    call's settings, resolved once by the caller); ``None``: run it unguarded (no key, and
    ``idempotency_missing_key="run"``).

    ``as_message``: ``args`` and ``kwargs`` are the caller's own objects (an eager
    ``apply()``): the key is derived from them as a message would carry them (one identity),
    or from them as they are when no message can.

    The one call from the task into this module on a call's way to its key: the task's hooks
    ``idempotency_key_for`` and ``idempotency_fingerprint_for`` are called back only where a
    subclass overrides them; ``IdempotentTask``'s own (:func:`default_hook`) are
    :func:`key_for` and :func:`fingerprint_for`, called here with ``cfg``."""
    if as_message:
        args, kwargs = received_or_none(task, args, kwargs) or (args, kwargs)
    payload = bound_arguments(task, args, kwargs)
    args_hash = fingerprint_payload(payload) if _hashes_args(cfg) else None
    try:
        if _overridden(task, "idempotency_key_for"):
            key = task.idempotency_key_for(args, kwargs, payload=payload, fingerprint=args_hash)
        else:
            key = key_for(task, cfg, args, kwargs, payload=payload, fingerprint=args_hash)
    except IdempotencyKeyMissingError as exc:
        if cfg.idempotency_missing_key != "run":
            raise
        log.warning(
            "no idempotency key for %s[%s] (%s is None): running it unguarded "
            "(idempotency_missing_key='run')",
            task.name,
            task.request.id,
            f"field {exc.field!r}" if exc.field is not None else "the key callable",
        )
        return None
    if cfg.idempotency_fingerprint == "args":
        return PreparedCall(key, payload, args_hash)
    if _overridden(task, "idempotency_fingerprint_for"):
        fingerprint = task.idempotency_fingerprint_for(args, kwargs, payload=payload)
    else:
        fingerprint = fingerprint_for(task, cfg, args, kwargs, payload=payload)
    return PreparedCall(key, payload, fingerprint)


def _hashes_args(cfg: IdempotencySettings) -> bool:
    """Whether a call needs the hash of every bound argument (key or fingerprint)."""
    return bool(cfg.idempotency_key == "args" or cfg.idempotency_fingerprint == "args")


def request_value(request: Any, name: str) -> Any:
    """A per-call value sent with the message: its header ``name``, else the request's
    attribute of that name (where Celery's message protocol put the header), else ``None``."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, name, None)
    return value


def key_for(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    payload: Any = None,
    fingerprint: str | None = None,
) -> str:
    """The namespaced key of a call in ``task.request``: the ``idempotency_key`` header, else
    the task id (``idempotency_key="task_id"``), else derived from the arguments; with
    ``idempotency_window``, in the request's schedule slot. ``fingerprint``, when given, is the
    hash of every bound argument (the ``"args"`` key)."""
    request = task.request
    namespace = cfg.namespace_for(task.name)
    explicit = request_value(request, KEY_HEADER)
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit:
            raise TypeError(f"the {KEY_HEADER!r} header must be a non-empty str, got {explicit!r}")
        key = task_key(namespace, "key", explicit)
    elif cfg.idempotency_key == "task_id":
        key = task_key(namespace, "id", str(request.id))
    else:
        key = _derived_key(task, cfg, args, kwargs, payload=payload, fingerprint=fingerprint)
    window = cfg.idempotency_window
    if window is None:
        window = _call_window(task, request)
        if window is None:
            return key
    return keyspace.with_slot(key, slot_of_request(request, window))


def _call_window(task: IdempotentTask, request: Any) -> float | None:
    """A per-call ``idempotency_window`` carried with the message (``apply_async(...,
    idempotency_window=...)``), else ``None``."""
    from celery_idempotent.celery import call_options  # noqa: PLC0415 - rare: per-call options

    headers = getattr(request, "headers", None)
    if not (isinstance(headers, dict) and call_options.CALL_OPTIONS_HEADER in headers) and (
        getattr(request, call_options.CALL_OPTIONS_HEADER, None) is None
    ):
        return None
    window: float | None = call_options.from_request(task.name, request).get("idempotency_window")
    return window


def slot_of_request(request: Any, window: float) -> str:
    """The schedule slot of a delivery: stamped at publish, else its ETA's, else the worker
    clock's (a message published by ``send_task``)."""
    slot = request_value(request, SLOT_HEADER)
    if isinstance(slot, str) and slot:
        return slot
    when = eta_seconds(getattr(request, "eta", None)) or time.time()
    return keyspace.slot_for(when, window)


def eta_seconds(eta: Any) -> float | None:
    """A request's ETA (ISO text or datetime) as epoch seconds, or ``None``."""
    if not eta:
        return None
    if isinstance(eta, str):
        try:
            eta = _dt.datetime.fromisoformat(eta)
        except ValueError:
            return None
    if isinstance(eta, _dt.datetime):
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=_dt.timezone.utc)
        return float(eta.timestamp())
    return None


def _derived_key(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    payload: Any,
    fingerprint: str | None,
) -> str:
    """The key the ``idempotency_key`` strategy derives from the arguments (``"args"``, a
    format string or a callable; not ``"task_id"``), without reading the request."""
    namespace = cfg.namespace_for(task.name)
    strategy = cfg.idempotency_key
    if payload is None:
        payload = bound_arguments(task, args, kwargs)
    if callable(strategy):
        key = strategy(task, args, kwargs)
        if key is None:
            name = getattr(strategy, "__qualname__", None) or type(strategy).__name__
            raise IdempotencyKeyMissingError(f"<callable {name}>", task.name, None)
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"idempotency_key callable of task {task.name} must return a non-empty "
                f"str (or None: no key), returned {type(key).__name__}"
            )
        return task_key(namespace, "key", key)
    if strategy == "args":
        return task_key(namespace, "args", fingerprint or fingerprint_payload(payload))
    return task_key(namespace, "key", _format_key(strategy, payload, task.name))


def fingerprint_for(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    payload: Any = None,
) -> str | None:
    """The fingerprint stored with a call's result and compared with its duplicates'
    (``None``: not compared), as ``idempotency_fingerprint`` says."""
    setting = cfg.idempotency_fingerprint
    if setting is None:
        return None
    if payload is None:
        payload = bound_arguments(task, args, kwargs)
    if setting == "args":
        return fingerprint_payload(payload)
    if callable(setting):
        value = setting(task, args, kwargs)
        if value is None:
            return None
        if not isinstance(value, str):
            raise TypeError(
                f"idempotency_fingerprint callable of task {task.name} must return a str "
                f"or None, returned {type(value).__name__}"
            )
        # Hashed: it may hold argument values, and Redis keeps it for idempotency_ttl.
        return fingerprint_payload(["fingerprint_fn", value])
    missing = [name for name in setting if name not in payload]
    if missing:
        raise _no_such_arguments(
            f"idempotency_fingerprint {setting!r}", task.name, missing, payload
        )
    return fingerprint_payload({name: payload[name] for name in setting})


def admin_key(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    *,
    key: str | None,
    task_id: str | None,
) -> str:
    """The namespaced key that the admin methods' arguments name (never from the current
    request: called inside a body, it must not take that delivery's header)."""
    namespace = cfg.namespace_for(task.name)
    named = [(what, value) for what, value in (("key", key), ("task_id", task_id)) if value]
    if key is not None or task_id is not None:
        if len(named) != 1 or args or kwargs:
            raise TypeError(
                f"{task.name}: name one key: args/kwargs, key= or task_id= (got "
                f"args={args!r}, kwargs={kwargs!r}, key={key!r}, task_id={task_id!r})"
            )
        what, value = named[0]
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a non-empty str, got {value!r}")
        return task_key(namespace, "key" if what == "key" else "id", value)
    if cfg.idempotency_key == "task_id":
        raise TypeError(
            f"{task.name} is keyed by task id (idempotency_key='task_id'): pass task_id=..."
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list, as for apply_async, not {args!r}")
    call_args, call_kwargs = _received_for_admin(task, args, kwargs)
    return _derived_key(task, cfg, call_args, call_kwargs, payload=None, fingerprint=None)


def _received_for_admin(
    task: IdempotentTask, args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """:func:`as_received` for a path that names a key (status, forget, the CLI, the testing
    plugin): arguments no message can carry name no key, a ``TypeError`` that says so."""
    try:
        return as_received(task, args, kwargs)
    except KombuError as exc:
        raise TypeError(
            f"{task.name}: these arguments cannot be sent with serializer "
            f"{getattr(task, 'serializer', None)!r}, so no call has their key: {exc}"
        ) from exc


def bound_arguments(
    task: IdempotentTask, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied: f(1) == f(x=1)."""
    cls = type(task)
    # One signature per task class (computing it costs more than the rest of the call).
    cached = cls.__dict__.get("_idempotency_signature")
    if cached is None or cached[0] is not cls.run:
        try:
            sig = inspect.signature(task.run)
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            return {"args": list(args), "kwargs": dict(kwargs)}
        cached = (cls.run, sig, _plain_names(sig))
        cls._idempotency_signature = cached
    _, signature, names = cached
    if names is not None and not kwargs and len(args) == len(names):
        # Every parameter given by position, none of them special: what bind() and
        # apply_defaults() give, at a fifth of their cost.
        return dict(zip(names, args))
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{task.name}: {exc}") from exc
    bound.apply_defaults()
    return dict(bound.arguments)


def _plain_names(signature: inspect.Signature) -> tuple[str, ...] | None:
    """The parameters' names when each is a plain one (positional or keyword, no ``*args``,
    ``**kwargs``, positional-only or keyword-only), else ``None``."""
    params = signature.parameters.values()
    if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return tuple(p.name for p in params)
    return None


def _format_key(template: str, payload: dict[str, Any], task_name: str) -> str:
    names = {
        field.split(".")[0].split("[")[0]
        for _, field, _, _ in string.Formatter().parse(template)
        if field is not None
    }
    if "" in names or any(n.isdigit() for n in names):
        raise ValueError(
            f"idempotency_key {template!r} of task {task_name} must name its fields, "
            "e.g. 'order:{order_id}'"
        )
    missing = sorted(names - set(payload))
    if missing:
        raise _no_such_arguments(f"idempotency_key {template!r}", task_name, missing, payload)
    return _KeyFormatter(template, task_name).format(template, **payload)


def _no_such_arguments(
    setting: str, task_name: str, missing: list[str], payload: dict[str, Any]
) -> ValueError:
    return ValueError(
        f"{setting} of task {task_name} names {', '.join(missing)}, which the task has no "
        f"argument for (arguments: {', '.join(payload) or 'none'})"
    )


class _KeyFormatter(string.Formatter):
    """``str.format`` for key templates that treats a ``None`` field as a missing key:
    ``"user:{user_id}"`` with ``user_id=None`` must not become the shared key ``user:None``."""

    def __init__(self, template: str, task_name: str) -> None:
        self.template = template
        self.task_name = task_name

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        top = field_name.split(".", maxsplit=1)[0].split("[", maxsplit=1)[0]
        if kwargs.get(top) is None:  # also before reading a part of it (``{user.id}``)
            raise IdempotencyKeyMissingError(self.template, self.task_name, top)
        obj, used = super().get_field(field_name, args, kwargs)
        if obj is None:
            raise IdempotencyKeyMissingError(self.template, self.task_name, field_name)
        return obj, used
