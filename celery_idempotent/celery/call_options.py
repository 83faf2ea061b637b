"""Per-call ``idempotency_*`` options of ``apply_async``: taken for that call, or refused.

``charge.apply_async((42,), idempotency_ttl=60)`` keeps this call's result for 60 s. Every
``idempotency_*`` option of ``apply_async`` either takes effect for that call or raises
``TypeError`` naming it: never silently ignored (SPEC §8). Those that take effect:

- ``idempotency_ttl``: how long this call's result is kept;
- ``idempotency_publish_ttl``: how long this call's queued marker outlives a lost message;
- ``idempotency_window``: this call's schedule slot (seconds or ``timedelta``);
- ``idempotency_on_duplicate_publish``: what a duplicate publish of this call does.

They are validated at the call (a bad value raises there, as the setting's check says), and
those the worker needs travel with the message in the ``idempotency_options`` header, so that
the delivery, its retries and its redeliveries use the same values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery_idempotent.settings import check_setting

if TYPE_CHECKING:
    from celery_idempotent.settings import IdempotencySettings

__all__ = ["CALL_OPTIONS_HEADER", "PER_CALL", "from_request", "take", "with_call_options"]

#: The header that carries a call's own options to the worker.
CALL_OPTIONS_HEADER = "idempotency_options"
#: The ``idempotency_*`` options ``apply_async`` takes per call.
PER_CALL = (
    "idempotency_ttl",
    "idempotency_publish_ttl",
    "idempotency_window",
    "idempotency_on_duplicate_publish",
)
#: Of those, the ones the worker uses (carried in the header); the duplicate-publish policy is
#: the publish side's alone.
_CARRIED = frozenset(PER_CALL) - {"idempotency_on_duplicate_publish"}


def take(task_name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Remove every ``idempotency_*`` option from ``options`` (``apply_async``'s) and return
    them checked; ``TypeError`` naming one that cannot be set per call, ``ValueError`` /
    ``TypeError`` from the setting's own check for a bad value."""
    found = {name: options.pop(name) for name in list(options) if name.startswith("idempotency_")}
    unknown = sorted(set(found) - set(PER_CALL))
    if unknown:
        raise TypeError(
            f"apply_async() of {task_name} got {', '.join(map(repr, unknown))}, which cannot "
            f"be set per call (per call: {', '.join(PER_CALL)}); set it as a task option or "
            "an app setting"
        )
    return {
        name: check_setting(name, value, task_name=f"{task_name}, this call")
        for name, value in found.items()
        if value is not None
    }


def carried(call: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a call's options that travels to the worker (JSON-native values)."""
    return {name: value for name, value in call.items() if name in _CARRIED}


def from_request(task_name: str, request: Any) -> dict[str, Any]:
    """The options a delivery's message carries (checked again: the worker decides with
    them); ``TypeError`` for an option this version does not take per call."""
    headers = getattr(request, "headers", None) or {}
    sent = headers.get(CALL_OPTIONS_HEADER) if isinstance(headers, dict) else None
    if sent is None:
        sent = getattr(request, CALL_OPTIONS_HEADER, None)
    if not sent:
        return {}
    if not isinstance(sent, Mapping):
        raise TypeError(f"the {CALL_OPTIONS_HEADER!r} header must be a mapping, got {sent!r}")
    unknown = sorted(set(sent) - _CARRIED)
    if unknown:
        raise TypeError(
            f"{task_name}: the message carries per-call option(s) {', '.join(map(repr, unknown))}"
            " that this worker does not take per call (a newer publisher?)"
        )
    return {
        name: check_setting(name, value, task_name=f"{task_name}, this call")
        for name, value in sent.items()
    }


def with_call_options(cfg: IdempotencySettings, call: Mapping[str, Any]) -> IdempotencySettings:
    """``cfg`` with a call's own options in force (``cfg`` itself when there are none)."""
    if not call:
        return cfg
    return dataclasses.replace(cfg, **dict(call))
