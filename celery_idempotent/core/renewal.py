"""Lease renewal: one keeper thread per process keeps every running body's lease alive.

A thread per guarded call would cost a thread start on the hot path; one keeper with a heap of
due renewals costs a heap push. Renewals happen every ``interval`` seconds (a third of the lease
by default), so two renewals can fail in a row before a lease runs out.

The keeper is a real OS thread, also under gevent and eventlet (made with the functions those
libraries saved before patching, see :mod:`celery_idempotent.core.green`), and a Redis lock provider
gives it a connection of its own with real sockets (``RedisLockProvider.renewer``): a body that
blocks the event loop with Python code cannot starve the renewals of the other bodies of its
worker, nor its own, because Python still switches threads every few milliseconds. Only a
single C call that holds the GIL for longer than the lease can. A provider that offers no such
renewer (a Cluster client, or TLS and Sentinel under gevent/eventlet) is renewed from a green
keeper on the event loop, as before.

Each renewal attempt waits at most the lease's remaining time. A lease that is lost (Redis
answered "not ours", or renewals failed until it ran out) is logged once, with its cause, and
the guard then refuses to commit (``LockLostError``). Under gevent/eventlet the keeper thread
never calls ``logging`` itself (the handlers' locks are green locks of the event loop's thread):
it queues its lines, and the event loop's side writes them (at the next guarded call, when the
body ends, and about once a second).
"""

from __future__ import annotations

import os

from celery_idempotent.core import green
from celery_idempotent.core.lease_keeper import (
    LeaseKeeper,
    Renew,
    Renewal,
    claim_report,
    flush_log,
    start_log_relay,
)
from celery_idempotent.core.protocols import Lease, LockProvider

__all__ = [
    "LeaseKeeper",
    "Renewal",
    "claim_report",
    "flush_log",
    "keep",
    "keeper",
    "renews_natively",
    "stop",
]

_native_keeper: LeaseKeeper | None = None
_green_keeper: LeaseKeeper | None = None


def keeper() -> LeaseKeeper:
    """The process's keeper on a real OS thread."""
    global _native_keeper  # noqa: PLW0603 - one per process, made on first use
    found = _native_keeper
    if found is None or (found.natives is not None and found.natives is not green.natives()):
        # First use, or the process was patched after the keeper was made.
        found = _native_keeper = LeaseKeeper(native=True)
    return found


def _green_keeper_() -> LeaseKeeper:
    global _green_keeper  # noqa: PLW0603 - one per process, made on first use
    if _green_keeper is None:
        _green_keeper = LeaseKeeper(native=False)
    return _green_keeper


def keep(
    provider: LockProvider,
    lease: Lease,
    ttl: float,
    interval: float,
    *,
    label: object = None,
) -> Renewal:
    """Keep ``lease`` alive until :func:`stop`: on the OS-thread keeper with the provider's own
    ``renewer()`` when it has one (or when no green runtime patched the process), else on the
    green keeper."""
    get_renewer = getattr(provider, "renewer", None)
    renew: Renew | None = get_renewer() if callable(get_renewer) else None
    if green.runtime() is None:
        return keeper().keep(provider, lease, ttl, interval, renew=renew, label=label)
    if renew is None:
        kept = _green_keeper_().keep(provider, lease, ttl, interval, label=label)
    else:
        kept = keeper().keep(provider, lease, ttl, interval, renew=renew, label=label)
    # Only once the lease is kept, what may switch to the event loop (a log handler that
    # yields): a body blocking the loop meanwhile would otherwise hold this caller past a
    # lease that nothing renews yet, and its commit would be refused.
    start_log_relay()
    flush_log()
    return kept


def stop(renewal: Renewal) -> None:
    """Stop renewing ``renewal`` (and write any queued log lines of the keeper)."""
    renewal.cancelled = True
    flush_log()


def renews_natively(provider: LockProvider) -> bool:
    """Whether ``provider``'s leases are renewed from the OS-thread keeper in this process (not
    from the event loop, where a blocking body can starve them)."""
    if green.runtime() is None:
        return True
    get_renewer = getattr(provider, "renewer", None)
    return callable(get_renewer) and get_renewer() is not None


def _reset_after_fork() -> None:
    # The keeper threads do not survive fork, and their locks may have been held by them.
    global _native_keeper, _green_keeper  # noqa: PLW0603 - per process
    _native_keeper = None
    _green_keeper = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
