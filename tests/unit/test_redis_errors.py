"""How redis-py's errors reach the caller: a transient refusal (nothing written, try again)
is an IdempotencyConnectionError, so a task that had not run its body is re-queued; any
other Redis error is an IdempotencyBackendError; the original is chained either way."""

from __future__ import annotations

import pytest
import redis.exceptions as rex

from celery_idempotent import IdempotencyBackendError, IdempotencyConnectionError
from celery_idempotent.backends.redis.errors import translate_errors


@pytest.mark.parametrize(
    "error",
    [
        rex.ConnectionError("Connection refused"),
        rex.TimeoutError("Timeout reading from socket"),
        rex.BusyLoadingError("Redis is loading the dataset in memory"),
        rex.ReadOnlyError("You can't write against a read only replica."),
        rex.TryAgainError("Multiple keys request during rehashing of slot"),
        rex.ClusterDownError("The cluster is down"),
        rex.ResponseError("NOREPLICAS Not enough good replicas to write."),
        rex.ResponseError(
            "Error running script (call to f_0123): @user_script:3: NOREPLICAS Not enough "
            "good replicas to write."
        ),
        rex.ResponseError("MASTERDOWN Link with MASTER is down and replica-serve-stale-data no"),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(e)[:24],
)
def test_transient_refusals_are_connection_errors(error: Exception) -> None:
    expected = pytest.raises(IdempotencyConnectionError, match="Redis claim failed")
    with expected as caught, translate_errors("k", "claim"):
        raise error
    assert caught.value.key == "k"
    assert caught.value.__cause__ is error


@pytest.mark.parametrize(
    "error",
    [
        rex.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        rex.ResponseError("ERR Error running script: attempt to compare nil with number"),
        rex.NoPermissionError("this user has no permissions to run the 'evalsha' command"),
        rex.ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
        rex.ResponseError("some text that only mentions noreplicas in lower case"),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(e)[:24],
)
def test_other_redis_errors_are_backend_errors(error: Exception) -> None:
    with pytest.raises(IdempotencyBackendError) as caught, translate_errors("k", "commit"):
        raise error
    assert type(caught.value) is IdempotencyBackendError
    assert caught.value.__cause__ is error


def test_library_errors_and_success_pass_through() -> None:
    with translate_errors("k", "claim"):
        pass
    own = IdempotencyBackendError("k", "mine")
    with pytest.raises(IdempotencyBackendError) as caught, translate_errors("k", "claim"):
        raise own
    assert caught.value is own
