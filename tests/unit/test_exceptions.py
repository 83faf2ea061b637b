"""Every error survives pickle and Celery's JSON result backend as the same class with the
same attributes, and carries the key it concerns."""

from __future__ import annotations

import json
import pickle

import pytest
from celery import Celery
from celery.backends.base import BaseBackend

from celery_idempotent import (
    CommitUnknownError,
    DuplicatePublishError,
    IdempotencyAbortedError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyError,
    IdempotencyKeyHeldError,
    IdempotencyKeyMissingError,
    IdempotencyMismatchError,
    LockAcquisitionError,
    LockLostError,
    RecordDecodeError,
    ResultEncodeError,
)
from celery_idempotent.core import exceptions as exceptions_module

# (instance, the attributes it must keep). Results are JSON-friendly so the JSON path applies.
EXAMPLES = [
    (IdempotencyError("k1", "boom"), {"key": "k1", "message": "boom"}),
    (IdempotencyError("k1"), {"key": "k1", "message": None}),
    (LockAcquisitionError("k2", 4), {"key": "k2", "attempts": 4, "message": None}),
    (LockAcquisitionError("k2", attempts=4, message="busy"), {"attempts": 4, "message": "busy"}),
    (IdempotencyAbortedError("k3", 2), {"key": "k3", "attempts": 2}),
    (
        IdempotencyMismatchError("k4", "aa", "bb"),
        {"key": "k4", "stored_fingerprint": "aa", "fingerprint": "bb"},
    ),
    (
        IdempotencyKeyMissingError("user:{user_id}", "proj.charge", "user_id"),
        {"key": "user:{user_id}", "task": "proj.charge", "field": "user_id"},
    ),
    (
        IdempotencyKeyMissingError("<callable key_fn>", task="proj.charge"),
        {"task": "proj.charge", "field": None},
    ),
    (DuplicatePublishError("k10", "tid-1"), {"key": "k10", "task_id": "tid-1"}),
    (DuplicatePublishError("k10"), {"key": "k10", "task_id": None, "message": None}),
    (
        DuplicatePublishError("k10", "tid-1", state="queued", ttl_left=3597.25),
        {"key": "k10", "task_id": "tid-1", "state": "queued", "ttl_left": 3597.25},
    ),
    (
        IdempotencyKeyHeldError("t:key:k", "host:1:ab", 2.5, "held"),
        {"key": "t:key:k", "holder": "host:1:ab", "lease_left": 2.5, "message": "held"},
    ),
    (LockLostError("k5", {"charged": [1, 2]}), {"key": "k5", "result": {"charged": [1, 2]}}),
    (LockLostError("k5", None), {"key": "k5", "result": None}),
    (CommitUnknownError("k5", [3], "unconfirmed"), {"key": "k5", "result": [3]}),
    (IdempotencyBackendError("k6", "store get failed"), {"key": "k6"}),
    (IdempotencyConnectionError("k7", "refused"), {"key": "k7", "message": "refused"}),
    (RecordDecodeError("k8", "application/x-python-serialize"), {"key": "k8"}),
    (ResultEncodeError("k9", "unencodable repr"), {"key": "k9", "result": "unencodable repr"}),
]
IDS = [f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(EXAMPLES)]


def public_exception_classes():
    return sorted(
        (
            obj
            for name in exceptions_module.__all__
            if isinstance(obj := getattr(exceptions_module, name), type)
            and issubclass(obj, BaseException)
        ),
        key=lambda cls: cls.__name__,
    )


def test_every_public_exception_class_is_covered():
    assert {type(e) for e, _ in EXAMPLES} == set(public_exception_classes())


@pytest.mark.parametrize("cls", public_exception_classes(), ids=lambda c: c.__name__)
def test_one_root_and_every_error_carries_its_key(cls):
    assert issubclass(cls, IdempotencyError)
    exc = cls("the-key")
    assert exc.key == "the-key"
    assert "the-key" in str(exc)
    positional = cls("the-key", *[None] * (len(exc.args) - 1))
    assert positional.key == "the-key"


def assert_same(rebuilt, original, attrs):
    assert type(rebuilt) is type(original)
    assert rebuilt.args == original.args
    assert vars(rebuilt) == vars(original)
    for name, value in attrs.items():
        assert getattr(rebuilt, name) == value
    assert str(rebuilt) == str(original)


@pytest.mark.parametrize(("exc", "attrs"), EXAMPLES, ids=IDS)
def test_survives_pickle(exc, attrs):
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        rebuilt = pickle.loads(pickle.dumps(exc, protocol))  # noqa: S301 - our own bytes
        assert_same(rebuilt, exc, attrs)


@pytest.mark.parametrize(("exc", "attrs"), EXAMPLES, ids=IDS)
def test_survives_rebuild_from_args(exc, attrs):
    assert_same(type(exc)(*exc.args), exc, attrs)


@pytest.mark.parametrize(("exc", "attrs"), EXAMPLES, ids=IDS)
def test_survives_a_json_round_trip_of_args(exc, attrs):
    args = json.loads(json.dumps(list(exc.args)))
    assert_same(type(exc)(*args), exc, attrs)


@pytest.fixture(scope="module")
def json_backend():
    app = Celery("unit-exceptions", set_as_current=False)
    return BaseBackend(app, serializer="json", accept=["json"])


@pytest.mark.parametrize(("exc", "attrs"), EXAMPLES, ids=IDS)
def test_survives_celerys_json_result_backend(json_backend, exc, attrs):
    stored = json_backend.encode(json_backend.prepare_exception(exc))
    rebuilt = json_backend.exception_to_python(json_backend.decode(stored))
    assert_same(rebuilt, exc, attrs)
    with pytest.raises(type(exc)):  # `except`-able as the library's class
        raise rebuilt


def test_mismatch_from_the_guard_survives_the_result_backend(guard, json_backend):
    guard.execute("order-1", lambda: "paid", input={"amount": 10})
    with pytest.raises(IdempotencyMismatchError) as info:
        guard.execute("order-1", lambda: "again", input={"amount": 20})
    stored = json_backend.encode(json_backend.prepare_exception(info.value))
    rebuilt = json_backend.exception_to_python(json_backend.decode(stored))
    assert isinstance(rebuilt, IdempotencyMismatchError)
    assert rebuilt.key == "order-1"
    assert rebuilt.stored_fingerprint == info.value.stored_fingerprint
    assert rebuilt.fingerprint == info.value.fingerprint


def test_subclass_relations():
    assert issubclass(IdempotencyConnectionError, IdempotencyBackendError)
    for cls in public_exception_classes():
        assert issubclass(cls, Exception)  # `except Exception` catches them all


@pytest.mark.parametrize(("exc", "_attrs"), EXAMPLES, ids=IDS)
def test_str_names_the_key(exc, _attrs):
    assert repr(exc.key) in str(exc)
