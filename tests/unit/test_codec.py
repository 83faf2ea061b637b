"""The result codec decodes JSON as kombu does, with its decoder built once per process."""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_idempotent.core.codec import ResultCodec
from celery_idempotent.core.exceptions import RecordDecodeError, ResultEncodeError

kombu_json = pytest.importorskip("kombu.utils.json")

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(JSON)
def test_decodes_what_kombus_loads_decodes(value: Any) -> None:
    codec = ResultCodec("json", ["json"])
    data = codec.dumps("k", value)
    assert codec.loads("k", "application/json", "utf-8", data) == kombu_json.loads(data)
    assert codec.loads("k", "application/json", "utf-8", memoryview(data)) == kombu_json.loads(data)


def test_kombus_registered_types_come_back_as_themselves() -> None:
    codec = ResultCodec("json", ["json"])
    value = {
        "when": datetime.datetime(2026, 12, 1, 21, 0, tzinfo=datetime.timezone.utc),
        "day": datetime.date(2026, 12, 1),
        "amount": decimal.Decimal("12.50"),
        "id": uuid.UUID(int=7),
    }
    data = codec.dumps("k", value)
    assert codec.loads("k", "application/json", "utf-8", data) == value
    assert kombu_json.loads(data) == value


@pytest.mark.parametrize("data", [b"\xef\xbb\xbf[1]", b"[1", b"\xff"])
def test_what_kombu_refuses_is_a_corrupt_record(data: bytes) -> None:
    codec = ResultCodec("json", ["json"])
    with pytest.raises(Exception):
        kombu_json.loads(data)
    with pytest.raises(RecordDecodeError, match="corrupt record"):
        codec.loads("k", "application/json", "utf-8", data)


def test_an_applications_own_json_decoder_is_used_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kombu.serialization

    seen: list[Any] = []

    def own(data: Any) -> Any:
        seen.append(data)
        return "own"

    registry = kombu.serialization.registry
    monkeypatch.setitem(registry._decoders, "application/json", own)
    codec = ResultCodec("json", ["json"])
    assert codec.loads("k", "application/json", "utf-8", b"[1]") == "own"
    assert seen == [b"[1]"]


@given(JSON)
def test_encodes_what_kombus_dumps_encodes(value: Any) -> None:
    codec = ResultCodec("json", ["json"])
    assert codec.dumps("k", value) == kombu_json.dumps(value).encode("utf-8")


def test_kombus_registered_types_encode_as_kombu_encodes_them() -> None:
    codec = ResultCodec("json", ["json"])
    value = {"when": datetime.date(2026, 12, 1), "amount": decimal.Decimal("1.5")}
    assert codec.dumps("k", value) == kombu_json.dumps(value).encode("utf-8")
    with pytest.raises(TypeError):
        kombu_json.dumps({1, 2})
    with pytest.raises(ResultEncodeError, match="set is not JSON serializable"):
        codec.dumps("k", {1, 2})
