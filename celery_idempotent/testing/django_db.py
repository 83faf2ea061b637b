"""Django's database connections for the tester's delivery threads (pytest-django, TestCase).

``while_running=True`` delivers on two threads. Django gives every thread connections of its
own, which cannot see what the test wrote inside its own transaction (pytest-django's ``db``
fixture, a ``TestCase``): the body's ``Order.objects.get`` failed with ``DoesNotExist``. And
a thread's connections stay open after it ends, so pytest-django could not drop the test
database at the end of a ``transactional_db`` session (PostgreSQL refuses while sessions are
connected): it was left behind.

:func:`test_transactions` finds the test thread's connections that hold such a transaction;
:func:`delivery_thread` lends them to a delivery thread (Django's thread sharing, as its
``LiveServerTestCase`` does) and closes every connection of the thread's own when it ends.
Importing this module imports nothing of Django's; a process without Django gets no-ops.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["delivery_thread", "test_transactions"]


def _configured() -> bool:
    if "django.conf" not in sys.modules:
        return False
    from django.conf import settings  # noqa: PLC0415

    return bool(settings.configured)


def test_transactions() -> dict[str, Any]:
    """The calling thread's Django connections (by alias) that are inside a transaction the
    test holds open (``db`` fixture, ``TestCase``): the deliveries must use these to see the
    test's rows. Empty without Django, or under ``transactional_db``."""
    if not _configured():
        return {}
    from django.db import connections  # noqa: PLC0415

    return {
        alias: connections[alias]
        for alias in connections
        if connections[alias].connection is not None and connections[alias].in_atomic_block
    }


@contextlib.contextmanager
def delivery_thread(shared: dict[str, Any]) -> Iterator[None]:
    """Run a delivery thread on the ``shared`` connections (from :func:`test_transactions`)
    and close the thread's own connections when it ends."""
    if not _configured():
        yield
        return
    from django.db import connections  # noqa: PLC0415

    for alias, conn in shared.items():
        conn.inc_thread_sharing()
        connections[alias] = conn
    try:
        yield
    finally:
        for alias in list(connections):
            if alias in shared:
                shared[alias].dec_thread_sharing()
                del connections[alias]
            else:
                connections[alias].close()
