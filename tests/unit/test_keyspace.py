"""The keyspaces: task keys (every backend's), the names every backend stores a key under, and
what Redis adds (fence names, lock values, the v2 record format) round-trip."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis.keyspace import (
    decode_record,
    encode_record,
    fence_name,
    lock_entry,
    lock_name,
    lock_value,
    parse_lease_token,
    parse_lock,
    parse_lock_value,
    parse_name,
    record_name,
)
from celery_idempotent.core import names
from celery_idempotent.keyspace import parse_task_key, task_key


def test_task_keys_round_trip_and_the_earliest_marker_wins() -> None:
    assert task_key("t", "key", "a:key:b") == "t:key:a:key:b"
    assert parse_task_key("t:key:a:key:b") == ("t", "key", "a:key:b")
    assert parse_task_key("proj.charge:args:ff") == ("proj.charge", "args", "ff")
    assert parse_task_key("r:id:42") == ("r", "id", "42")
    assert parse_task_key("no marker") is None
    with pytest.raises(ValueError, match="kind"):
        task_key("t", "other", "x")


def test_names_of_a_key_share_a_hash_tag_and_parse_back() -> None:
    lock, record = lock_name("p:", "t:key:k"), record_name("p:", "t:key:k")
    assert (lock, record, fence_name(lock)) == (
        "p:lock:{t:key:k}",
        "p:{t:key:k}",
        "p:lock:{t:key:k}:fence",
    )
    assert parse_name(lock, "p:") == ("lock", "t:key:k")
    assert parse_name(record, "p:") == ("record", "t:key:k")
    assert parse_name(fence_name(lock), "p:") == ("fence", "t:key:k")
    assert parse_name("other:{x}", "p:") is None
    assert parse_name("p:lock:{}:fence", "p:") is None
    assert parse_name("p:lock:{a{b}:fence", "p:") is None
    # The names every backend shares parse alike without Redis; a fence name is Redis's own.
    assert names.parse_name(lock, "p:") == ("lock", "t:key:k")
    assert names.parse_name(record, "p:") == ("record", "t:key:k")
    assert names.parse_name(fence_name(lock), "p:") is None
    assert (keyspace.lock_name, keyspace.record_name) == (names.lock_name, names.record_name)


def test_lock_values_carry_the_fencing_token_and_the_owner() -> None:
    value = lock_value(17, "abc@host:1:ff")
    assert value == "17/abc@host:1:ff"
    assert parse_lock_value(value) == (17, "host:1:ff")
    assert parse_lock_value("abc@host:1:ff") == (None, "host:1:ff")  # a 0.1.0 lock
    assert parse_lease_token(value) == (17, "host:1:ff")
    entry = lock_entry(1_796_000_000_000, value)
    assert parse_lock_value(entry) == (17, "host:1:ff")
    assert parse_lock(entry) == (1_796_000_000_000, 17, value, "host:1:ff")
    assert parse_lock(entry).held(1_795_999_999_999)
    assert not parse_lock(entry).held(1_796_000_000_000)  # past its deadline: a tombstone
    old = parse_lock("abc@host:1:ff")  # 0.1.0's lock: no deadline, held while it exists
    assert (old.deadline_ms, old.fencing_token, old.owner) == (None, None, "host:1:ff")
    assert old.held(1e15)
    # "<fencing token>/<token>" is a lease's token; no release stored it as a lock's value.
    with pytest.raises(ValueError, match="not a lock value"):
        parse_lock(value)


@given(
    fence=st.one_of(st.none(), st.integers(0, 2**52)),
    at=st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12),
    fp=st.one_of(st.none(), st.text(st.characters(blacklist_characters="|"), max_size=80)),
    tid=st.one_of(st.none(), st.text(max_size=40)),
    data=st.binary(max_size=200),
    serializer=st.sampled_from(["json", "msgpack", "pickle"]),
)
def test_records_round_trip_exactly(
    *,
    fence: int | None,
    at: float,
    fp: str | None,
    tid: str | None,
    data: bytes,
    serializer: str,
) -> None:
    name = record_name("p:", f"t:args:{fp or 'x'}")
    raw = encode_record(
        name=name,
        fencing_token=fence,
        created_at=at,
        serializer=serializer,
        fingerprint=fp,
        task_id=tid,
        data=data,
    )
    back = decode_record(raw, name)
    assert back.fencing_token == fence
    assert back.created_at == at
    assert back.fingerprint == (fp or None)
    assert back.task_id == (None if not tid or "|" in tid else tid)
    assert back.data == data
    assert back.serializer == serializer


def test_compact_forms_for_what_the_guard_writes() -> None:
    fp = "ab" * 32
    name = record_name("idempotency:", f"t:args:{fp}")
    raw = encode_record(
        name=name,
        fencing_token=1_796_000_000_000_000,
        created_at=1_796_000_000.000_027,
        serializer="json",
        fingerprint=fp,
        task_id=None,
        data=b"1",
    )
    assert raw == b"2|1796000000000000|27||=64||1"
    assert decode_record(raw, name).fingerprint == fp
    with pytest.raises(ValueError, match="name"):
        decode_record(raw)
    with pytest.raises(ValueError, match="v2"):
        decode_record(b"something else")
    assert keyspace.record_head(1_796_000_000_000_000) == "2|1796000000000000|"
