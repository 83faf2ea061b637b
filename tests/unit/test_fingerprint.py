"""``fingerprint_payload``: canonical, stable across processes, and strict about what it hashes."""

from __future__ import annotations

import datetime as dt
import enum
import json
import os
import subprocess
import sys
import uuid
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_idempotent import fingerprint_payload

FEW = settings(max_examples=100, database=None, deadline=None)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.uuids()
    | st.decimals(allow_nan=False, allow_infinity=False, places=3)
    | st.datetimes()
    | st.dates()
)
dict_keys = st.text(max_size=10) | st.integers()
payloads = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(dict_keys, children, max_size=5)
    ),
    max_leaves=15,
)


def reorder(obj, rng):
    """The same payload with every dict rebuilt in another insertion order."""
    if isinstance(obj, dict):
        items = [(k, reorder(v, rng)) for k, v in obj.items()]
        rng.shuffle(items)
        return dict(items)
    if isinstance(obj, list):
        return [reorder(v, rng) for v in obj]
    return obj


def tuplify(obj):
    if isinstance(obj, list):
        return tuple(tuplify(v) for v in obj)
    if isinstance(obj, dict):
        return {k: tuplify(v) for k, v in obj.items()}
    return obj


@FEW
@given(payload=payloads, rng=st.randoms(use_true_random=False))
def test_dict_key_order_does_not_matter(payload, rng):
    assert fingerprint_payload(reorder(payload, rng)) == fingerprint_payload(payload)


@FEW
@given(payload=payloads)
def test_tuples_hash_like_lists(payload):
    assert fingerprint_payload(tuplify(payload)) == fingerprint_payload(payload)


@FEW
@given(payload=payloads)
def test_the_fingerprint_is_a_sha256_hex_and_deterministic(payload):
    first = fingerprint_payload(payload)
    assert len(first) == 64
    assert int(first, 16) >= 0
    assert fingerprint_payload(payload) == first


@FEW
@given(
    payload=st.dictionaries(st.text(max_size=5), payloads, min_size=1, max_size=5),
    data=st.data(),
)
def test_a_changed_value_changes_the_hash(payload, data):
    key = data.draw(st.sampled_from(sorted(payload)))
    # A value of another kind than any canonical twin could be: a fresh unique marker.
    changed = {**payload, key: ["changed", payload[key]]}
    assert fingerprint_payload(changed) != fingerprint_payload(payload)


@FEW
@given(a=st.integers(), b=st.integers())
def test_different_ints_differ(a, b):
    assert (fingerprint_payload({"n": a}) == fingerprint_payload({"n": b})) == (a == b)


@FEW
@given(a=st.text(), b=st.text())
def test_different_strings_differ(a, b):
    assert (fingerprint_payload([a]) == fingerprint_payload([b])) == (a == b)


@FEW
@given(payload=payloads)
def test_nesting_and_extra_keys_change_the_hash(payload):
    base = fingerprint_payload(payload)
    assert fingerprint_payload([payload]) != base
    assert fingerprint_payload({"a": payload}) != fingerprint_payload({"a": payload, "b": None})


def test_distinct_kinds_do_not_collide():
    values = [
        None,
        True,
        False,
        0,
        1,
        "1",
        "",
        b"1",
        b"",
        1.5,
        "1.5",
        Decimal("1.5"),
        [],
        {},
        [None],
        [[]],
        {"": None},
        ["a", "b"],
        ["ab"],
        {"a": "b"},
        ["a", ["b"]],
        uuid.UUID(int=1),
        str(uuid.UUID(int=1)),
        dt.date(2024, 1, 2),
        "2024-01-02",
        dt.datetime(2024, 1, 2),
        Color.RED,
        "red",
    ]
    hashes = [fingerprint_payload(v) for v in values]
    assert len(set(hashes)) == len(values)


class Color(enum.Enum):
    RED = "red"


def test_documented_equivalences():
    assert fingerprint_payload(10.0) == fingerprint_payload(10)
    assert fingerprint_payload(Decimal("1.50")) == fingerprint_payload(Decimal("1.5"))
    assert fingerprint_payload(Decimal("10")) == fingerprint_payload(Decimal("1E+1"))
    aware = dt.datetime(2024, 1, 1, 12, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    utc = dt.datetime(2024, 1, 1, 10, tzinfo=dt.timezone.utc)
    assert fingerprint_payload(aware) == fingerprint_payload(utc)
    assert fingerprint_payload(True) != fingerprint_payload(1)
    assert fingerprint_payload("1") != fingerprint_payload(1)
    assert fingerprint_payload(bytearray(b"x")) == fingerprint_payload(b"x")


# Built the same way here and in a fresh interpreter; only stdlib enums so that the
# subprocess can import them.
PAYLOAD_SOURCE = """
import datetime as dt, decimal, http, re, uuid
PAYLOADS = [
    None,
    {"order": 42, "amount": decimal.Decimal("19.90"), "items": ["a", "b", ("c", 1)]},
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    dt.datetime(2024, 5, 17, 8, 30, 1, 250, tzinfo=dt.timezone.utc),
    dt.datetime(2024, 5, 17, 8, 30),
    dt.date(1999, 12, 31),
    http.HTTPStatus.OK,
    re.RegexFlag.IGNORECASE,
    b"\\x00\\xffbytes",
    {"nested": {"z": [1.5, -0.25, 10**30], "a": {"\\u00e9": True}}, 7: None},
]
"""
PRINT_HASHES = (
    "import json\nfrom celery_idempotent import fingerprint_payload\n"
    "print(json.dumps([fingerprint_payload(p) for p in PAYLOADS]))\n"
)


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_the_hash_is_the_same_in_another_process(hash_seed):
    namespace = {}
    exec(PAYLOAD_SOURCE, namespace)  # noqa: S102 - our own constant source
    here = [fingerprint_payload(p) for p in namespace["PAYLOADS"]]
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", PAYLOAD_SOURCE + PRINT_HASHES],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout) == here
    assert len(set(here)) == len(here)


def test_known_value_is_pinned():
    # A fingerprint is stored with results for up to `ttl`: changing the encoding would turn
    # every duplicate delivered across an upgrade into a mismatch. This pins it.
    assert fingerprint_payload(None) == (
        "8ce86a6ae65d3692e7305e2c58ac62eebd97d3d943e093f577da25c36988246b"
    )
    assert fingerprint_payload({"b": [1, "x", 2.5, b"y"], "a": None}) == (
        "8bf9a92ef472c0ba7811fd71d78d5863046edc6844d5df475b07325eef37b856"
    )


class Custom:
    pass


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({1, 2}, "set"),
        (frozenset(), "frozenset"),
        (object(), "object"),
        (Custom(), "Custom"),
        ([1, {"a": {3}}], "set"),
        ({"k": Custom()}, "Custom"),
        ({Custom(): 1}, "Custom"),
        (1j, "complex"),
        (len, "builtin_function_or_method"),
    ],
)
def test_unsupported_types_raise_type_error_naming_the_type(value, type_name):
    with pytest.raises(TypeError, match=type_name):
        fingerprint_payload(value)


def test_self_containing_containers_raise_value_error():
    loop = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        fingerprint_payload(loop)
    nested = {"a": []}
    nested["a"].append(nested)
    with pytest.raises(ValueError, match="contains itself"):
        fingerprint_payload(nested)


def test_a_shared_but_acyclic_reference_is_fine():
    shared = [1, 2]
    assert fingerprint_payload([shared, shared]) == fingerprint_payload([[1, 2], [1, 2]])
