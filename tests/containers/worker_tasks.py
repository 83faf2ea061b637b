"""The tasks the worker containers run (pytest-celery copies this file's source into them).

Self-contained on purpose: the container has this project and Celery installed, not the test
suite, so nothing from ``tests`` is imported here. Each body prints one ``BODY start`` and one
``BODY end`` line on the worker's stdout, which docker keeps across restarts and kills, so the
test counts executions and checks overlaps from ``docker logs`` even while Redis is down or the
worker is cut off from it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task

from celery_idempotent import IdempotentTask

BODY = "BODY"


def _mark(event: str, token: str) -> None:
    # time.time(): the containers share the host's clock, so lines of two workers compare.
    print(f"{BODY} {event} {token} pid={os.getpid()} at={time.time():.6f}", flush=True)


@shared_task(base=IdempotentTask, name="cidem.containers.record", bind=True)
def record(self: Any, token: str, seconds: float = 0.0) -> str:
    """Run once per ``token``: sleep ``seconds`` between the start and end marks.

    A body that starts again after one was killed (the container's file system survives the
    kill: ``/tmp/started-<token>`` is there) skips the sleep, so a redelivery ends quickly.
    """
    started = f"/tmp/started-{token}"
    rerun = os.path.exists(started)
    with open(started, "a"):
        pass
    _mark("start", token)
    if not rerun:
        time.sleep(seconds)
    _mark("end", token)
    return f"done {token} by {os.getpid()}"
