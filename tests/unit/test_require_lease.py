"""``require_lease()``: the body's lease, typed ``Lease``; a clear error outside a body."""

from __future__ import annotations

import threading

import pytest

from celery_idempotent import (
    DistributedIdempotencyGuard,
    Lease,
    MemoryIdempotencyStore,
    MemoryLockProvider,
    current_lease,
    require_lease,
)


def _guard() -> DistributedIdempotencyGuard:
    return DistributedIdempotencyGuard(
        store=MemoryIdempotencyStore(), lock_provider=MemoryLockProvider()
    )


def test_inside_a_guarded_body_it_is_the_current_lease() -> None:
    seen: list[tuple[Lease, Lease | None]] = []

    def body() -> int:
        seen.append((require_lease(), current_lease()))
        return require_lease().fencing_token

    guard = _guard()
    token = guard.execute("k", body)
    assert len(seen) == 1
    required, current = seen[0]
    assert required is current
    assert required.fencing_token == token
    assert required.resource == guard.lock_resource("k")


def test_outside_a_guarded_body_it_raises_naming_the_cause() -> None:
    assert current_lease() is None
    with pytest.raises(RuntimeError, match=r"require_lease\(\) was called outside a guarded body"):
        require_lease()


def test_after_the_body_and_in_another_thread_there_is_none() -> None:
    errors: list[BaseException] = []

    def body() -> None:
        def elsewhere() -> None:  # a thread the body starts has no lease of its own
            try:
                require_lease()
            except RuntimeError as exc:
                errors.append(exc)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()

    _guard().execute("k2", body)
    assert len(errors) == 1
    with pytest.raises(RuntimeError):
        require_lease()
