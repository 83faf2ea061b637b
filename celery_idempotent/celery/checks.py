"""The misconfiguration checks a worker runs at start and a publisher at its first publish.

- :func:`misspelt_settings`: a setting whose name looks like one of ours but is not one
  (``idempotent_url``, ``idempotency_tll``, ``CELERY_IDEMPOTENT_URL`` under Django's
  ``CELERY_`` namespace, or ``IDEMPOTENCY_URL`` without it): Celery ignores it silently, so the
  keys go elsewhere than meant. An ERROR naming the closest real setting.
- :func:`delivery_warnings`: idempotent tasks whose message is acknowledged so that a killed
  worker loses the call: Celery's default early ack, or ``acks_late`` without
  ``task_reject_on_worker_lost``. A WARNING naming the tasks and the recommended settings.
- :func:`postgres_problem`: an unknown ``django://<alias>``, a PostgreSQL that does not
  answer, a table the Django app has not migrated yet (worker start only).

:func:`at_first_publish` runs the first two once per app in a process that publishes (a web
process never starts a worker, so it would never see them otherwise).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import weakref
from collections.abc import Iterable
from typing import Any

from celery_idempotent.settings import DEFAULTS

__all__ = ["at_first_publish", "delivery_warnings", "misspelt_settings", "postgres_problem"]

log = logging.getLogger("celery_idempotent")

_KNOWN = tuple(DEFAULTS)
_WORD = "idempotency"


def _looks_like_ours(name: str) -> bool:
    head = name.split("_", 1)[0]
    return "idempot" in name or difflib.SequenceMatcher(None, head, _WORD).ratio() >= 0.8


def _closest(name: str) -> str | None:
    guess = name.replace("idempotent_", "idempotency_").replace("idempotence_", "idempotency_")
    head, _, rest = guess.partition("_")
    if rest and difflib.SequenceMatcher(None, head, _WORD).ratio() >= 0.8:
        guess = f"{_WORD}_{rest}"
    if guess in _KNOWN:
        return guess
    # Compared without the shared "idempotency_", which would make every name look close.
    tails = {name[len(_WORD) + 1 :]: name for name in _KNOWN}
    tail = guess[len(_WORD) + 1 :] if guess.startswith(_WORD + "_") else guess
    found = difflib.get_close_matches(tail, list(tails), n=1, cutoff=0.6)
    return tails[found[0]] if found else None


def _spell(name: str, real: str, namespace: str | None) -> str:
    """``real`` as the user would write it beside ``name`` (namespaced: ``CELERY_...``)."""
    if namespace and name.isupper():
        return f"{namespace}_{real}".upper()
    return real.upper() if name.isupper() else real


def misspelt_settings(app: Any) -> list[str]:
    """One message per setting of ``app.conf`` whose name looks like a celery-idempotent
    setting but is none (so Celery and the library ignore it), naming the closest real one
    as the user would spell it (with the app's namespace, e.g. ``CELERY_``)."""
    namespace = getattr(app, "namespace", None)
    prefix = f"{namespace.lower()}_" if namespace else ""
    messages: list[str] = []
    try:
        names = sorted({str(name) for name in app.conf})
    except Exception:  # a configuration that cannot be listed: nothing to say
        return []
    for name in names:
        low = name.lower()
        if prefix and low.startswith(prefix):
            bare, prefixed = low[len(prefix) :], True
        else:
            bare, prefixed = low, not prefix
        if not _looks_like_ours(bare):
            continue
        if bare in _KNOWN:
            if prefixed or not name.isupper():
                continue  # a real setting, spelled right
            messages.append(
                f"setting {name} is ignored: the app reads its settings with the namespace "
                f"{namespace!r}, so it must be spelled {_spell(name, bare, namespace)}"
            )
            continue
        real = _closest(bare)
        hint = (
            f"did you mean {_spell(name, real, namespace)}?"
            if real
            else ("see the settings reference")
        )
        messages.append(
            f"setting {name} is not a celery-idempotent setting and is ignored: {hint} "
            "(until it is fixed, the tasks run with that setting's default)"
        )
    return messages


def _acks(task: Any, app: Any) -> tuple[bool, bool]:
    """(acks_late, reject_on_worker_lost) as Celery applies them to ``task``."""
    acks_late = getattr(task, "acks_late", None)
    if acks_late is None:
        acks_late = app.conf.get("task_acks_late")
    reject = getattr(task, "reject_on_worker_lost", None)
    if reject is None:
        reject = app.conf.get("task_reject_on_worker_lost")
    return bool(acks_late), bool(reject)


_SETTINGS_HINT = (
    "task_acks_late = True and task_reject_on_worker_lost = True (under Django: "
    "CELERY_TASK_ACKS_LATE, CELERY_TASK_REJECT_ON_WORKER_LOST; see the recommended settings)"
)


def _tasks(names: list[str]) -> str:
    return ("task " if len(names) == 1 else "tasks ") + ", ".join(sorted(names))


def _verb(names: list[str], one: str, many: str) -> str:
    return one if len(names) == 1 else many


def delivery_warnings(app: Any, tasks: Iterable[Any]) -> list[str]:
    """At most two messages: the enabled idempotent tasks acknowledged before their body runs
    (early ack), and those with ``acks_late`` but not ``reject_on_worker_lost``. Either way a
    worker killed mid-body (SIGKILL, OOM, a lost machine) loses the call: the message is gone
    and the body never committed."""
    early: list[str] = []
    lost: list[str] = []
    for task in tasks:
        acks_late, reject = _acks(task, app)
        if not acks_late:
            early.append(task.name)
        elif not reject:
            lost.append(task.name)
    messages = []
    if early:
        messages.append(
            f"{_tasks(early)} {_verb(early, 'acknowledges', 'acknowledge')} their message "
            "before the body "
            "runs (task_acks_late is off, Celery's default): a worker killed mid-body loses "
            f"the call, nothing redelivers it. Set {_SETTINGS_HINT}"
        )
    if lost:
        messages.append(
            f"{_tasks(lost)} {_verb(lost, 'has', 'have')} acks_late without "
            "task_reject_on_worker_lost: when a worker child is killed mid-body Celery acks "
            "the message as failed (WorkerLostError) and the call is lost. Set "
            f"{_SETTINGS_HINT}"
        )
    return messages


def postgres_problem(url: str) -> str | None:
    """Why the PostgreSQL backend of ``url`` cannot work now, or ``None``: an unknown
    ``django://`` alias, a server that does not answer, or (``django://`` with
    ``celery_idempotent.contrib.django`` installed) a table not migrated yet."""
    from celery_idempotent.backends.postgres.connections import split_url  # noqa: PLC0415
    from celery_idempotent.backends.postgres.sql import DEFAULT_TABLE, Statements  # noqa: PLC0415
    from celery_idempotent.urls import redact  # noqa: PLC0415

    rest, options = split_url(url)
    sql = Statements(options.get("table", DEFAULT_TABLE))
    if url.startswith("django://"):
        return _django_problem(url, options, sql)
    if rest.startswith("postgres://"):
        rest = "postgresql://" + rest[len("postgres://") :]
    try:
        import psycopg  # noqa: PLC0415
    except ImportError:
        return f"{redact(url)} needs psycopg: pip install 'celery-idempotent[postgres]'"
    try:
        with psycopg.connect(rest, connect_timeout=3, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        return f"the idempotency PostgreSQL at {redact(url)} is unreachable: {_first_line(exc)}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _django_problem(url: str, options: dict[str, str], sql: Any) -> str | None:
    from urllib.parse import urlsplit  # noqa: PLC0415

    from celery_idempotent.contrib.django import APP_NAME, is_installed  # noqa: PLC0415

    alias = urlsplit(url).netloc or "default"
    try:
        from django.conf import settings  # noqa: PLC0415
        from django.db import connections  # noqa: PLC0415
    except ImportError:
        return f"{url} needs Django installed in the worker"
    if not settings.configured:
        return f"{url}: Django is not configured in the worker (DJANGO_SETTINGS_MODULE)"
    databases = getattr(settings, "DATABASES", {}) or {}
    if alias not in databases:
        known = ", ".join(sorted(databases)) or "none"
        return (
            f"django://{alias}: no database alias {alias!r} in Django's DATABASES "
            f"(its aliases: {known})"
        )
    conn = connections[alias]
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
            if conn.vendor == "postgresql" and is_installed():
                cur.execute(sql.exists, list(sql.exists_params))
                row = cur.fetchone()
                if not (row and row[0]):
                    return (
                        f"django://{alias}: table {sql.table} does not exist; {APP_NAME} is "
                        "installed, so the backend runs no DDL: run `manage.py migrate "
                        "celery_idempotent`"
                    )
    except Exception as exc:
        return f"django://{alias}: the database is unreachable: {_first_line(exc)}"
    finally:
        conn.close()  # never hand an open socket to the pool's forked children
    return None


#: The apps whose first publish in this process ran the checks (or whose worker did).
_checked: weakref.WeakSet[Any] = weakref.WeakSet()


def mark_checked(app: Any) -> None:
    """The worker's start-up checks ran for ``app``: its publishes need not repeat them."""
    with contextlib.suppress(TypeError):  # an app that cannot be weakly referenced
        _checked.add(app)


def at_first_publish(app: Any) -> None:
    """Log the setting-name ERRORs and delivery WARNINGs once per app in this process."""
    if app in _checked:
        return
    mark_checked(app)
    from celery_idempotent.celery.worker_start import _idempotent_tasks  # noqa: PLC0415

    try:
        for message in misspelt_settings(app):
            log.error("celery-idempotent: %s", message)
        enabled = []
        for task in _idempotent_tasks(app).values():
            try:
                if task.idempotency_settings().idempotency_enabled:
                    enabled.append(task)
            except (TypeError, ValueError):
                continue
        for message in delivery_warnings(app, enabled):
            log.warning("celery-idempotent: %s", message)
    except Exception:  # a check must never fail a publish
        log.exception("celery-idempotent: the first-publish checks failed")
