"""The Redis Lua scripts are written whole and keep their conventions (issue 28).

Lua in Redis has no include: each script carries the pieces it shares with others in full,
between ``--[[ shared: <name> ]]`` and ``--[[ end: <name> ]]``. These tests make those copies
one spelling in effect (every copy the same text), and check what the text spells against the
Python side: the reply codes against their enums, the separators, heads and field names
against ``keyspace`` / ``layout``, the lock margin against ``FENCE_MARGIN_MS``, and the one
``KEYS`` order. They read the text only; what the scripts do is tested on a real Redis
(``tests/redis``) and in the simulation (``tests/sim``).
"""

from __future__ import annotations

import enum
import inspect
import re
import textwrap

import pytest

from celery_idempotent.backends.redis import admin_scripts, keyspace, layout, publish_scripts
from celery_idempotent.backends.redis import scripts as lease_scripts
from celery_idempotent.backends.redis import store as redis_store

MODULES = (lease_scripts, publish_scripts, admin_scripts)

#: Every script the library registers, by constant name.
SCRIPTS: dict[str, str] = {
    name: getattr(module, name)
    for module in MODULES
    for name in module.__all__
    if name.isupper() and isinstance(getattr(module, name), str)
}

_BLOCK = re.compile(
    r"^([ \t]*)--\[\[ shared: ([a-z ]+) \]\]\n(.*?)^[ \t]*--\[\[ end: \2 \]\]\n", re.M | re.S
)
_OPEN = re.compile(r"--\[\[ (shared|end): ([^\]]*) \]\]")

#: Each shared piece and the scripts that carry it (a piece must not silently disappear).
CARRIERS = {
    "server clock": {
        "ACQUIRE",
        "CLAIM",
        "COMMIT",
        "END",
        "EXTEND",
        "RELEASE",
        "HOLDER",
        "PUBLISH",
        "PUBLISH_AND_PUSH",
        "DROP_QUEUED",
        "READ_KEY",
        "DROP_FENCE",
        "FORGET",
    },
    "lock value": {
        "ACQUIRE",
        "CLAIM",
        "COMMIT",
        "END",
        "EXTEND",
        "RELEASE",
        "HOLDER",
        "PUBLISH",
        "PUBLISH_AND_PUSH",
        "DROP_QUEUED",
        "READ_KEY",
        "FORGET",
    },
    "take lock": {"ACQUIRE", "CLAIM"},
    "tombstone": {"END", "RELEASE"},
    "keep fence": {"COMMIT", "END", "EXTEND", "RELEASE", "FORGET"},
    "queued marker": {"CLAIM", "PUBLISH", "PUBLISH_AND_PUSH", "DROP_QUEUED", "REQUEUE_MARKER"},
}


def _blocks(src: str) -> list[tuple[str, str]]:
    """``(name, text)`` of each shared piece in ``src``, its indentation removed."""
    return [(m.group(2), textwrap.dedent(m.group(3))) for m in _BLOCK.finditer(src)]


def _outside_blocks(src: str) -> str:
    return _BLOCK.sub("", src)


def test_every_script_is_found() -> None:
    assert set(SCRIPTS) == {
        "ACQUIRE",
        "CLAIM",
        "COMMIT",
        "END",
        "EXTEND",
        "HOLDER",
        "RELEASE",
        "DROP_QUEUED",
        "PUBLISH",
        "PUBLISH_AND_PUSH",
        "REQUEUE_MARKER",
        "DROP_FENCE",
        "FORGET",
        "READ_KEY",
    }


def test_the_script_modules_assemble_nothing() -> None:
    """Each script is one literal: the modules build no text at import (no ``.replace``,
    no concatenation, no f-string, no helper that returns Lua)."""
    for module in MODULES:
        source = inspect.getsource(module)
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
        for name in SCRIPTS:
            if getattr(module, name, None) is None:
                continue
            assert re.search(rf'^{name} = """', code, re.M), f"{name} is not one literal"
            assert not re.search(rf"^{name} = \(", code, re.M), f"{name} is assembled"
        assert ".replace(" not in code, module.__name__
        assert not re.search(r'"""\s*\+|\+\s*"""|f"""', code), module.__name__
        assert not re.search(r"^def ", code, re.M), f"{module.__name__} builds Lua in a function"


def test_markers_are_well_formed() -> None:
    """Every marker opens and closes a piece of a known name (a typo would hide a copy)."""
    for name, src in SCRIPTS.items():
        opened = [m.group(2) for m in _OPEN.finditer(src) if m.group(1) == "shared"]
        closed = [m.group(2) for m in _OPEN.finditer(src) if m.group(1) == "end"]
        found = [block for block, _ in _blocks(src)]
        assert opened == closed == found, name
        assert set(found) <= set(CARRIERS), (name, found)


@pytest.mark.parametrize("piece", sorted(CARRIERS))
def test_each_shared_piece_is_one_text(piece: str) -> None:
    """Every copy of a shared piece, in every script, is the same text (indentation aside),
    and it is where the conventions say."""
    texts = {
        name: text
        for name, src in SCRIPTS.items()
        for block, text in _blocks(src)
        if block == piece
    }
    assert set(texts) == CARRIERS[piece]
    assert len(set(texts.values())) == 1, f"{piece!r} differs between scripts: {texts}"


def test_the_server_clock_is_read_only_in_its_piece() -> None:
    for name, src in SCRIPTS.items():
        outside = _outside_blocks(src)
        assert "'time'" not in outside, f"{name} reads TIME outside the server clock piece"
        assert "now / 1000" not in outside.replace("math.floor(f / 1000)", ""), name


def test_the_lock_value_is_parsed_only_in_its_piece() -> None:
    """Where a lock value's separators are looked for: inside the piece only (FORGET also
    reads the fencing token in front of a lease token it was given, ``ARGV[1]``)."""
    for name, src in SCRIPTS.items():
        outside = _outside_blocks(src)
        finds = re.findall(r"string\.find\((\w+(?:\[\d\])?), '/'", outside)
        assert finds in ([], ["ARGV[1]"]), (name, finds)
        assert "string.byte" not in outside, name


def test_publish_and_push_runs_publish_verbatim() -> None:
    assert publish_scripts.PUBLISH_AND_PUSH == (
        "local function decide()\n"
        + publish_scripts.PUBLISH
        + "end\nlocal r = decide()\n"
        + "if r[1] == 1 or r[1] == 7 then redis.call('lpush', KEYS[3], ARGV[5]) end\nreturn r\n"
    )


# --------------------------------------------------------------------------- reply codes


def _table_codes(src: str) -> set[int]:
    return {int(code) for code in re.findall(r"return \{(\d+)\b", src)}


@pytest.mark.parametrize(
    ("script", "reply"),
    [
        (lease_scripts.CLAIM, lease_scripts.ClaimReply),
        (publish_scripts.PUBLISH, publish_scripts.PublishReply),
        (publish_scripts.PUBLISH_AND_PUSH, publish_scripts.PublishReply),
    ],
)
def test_reply_enums_cover_exactly_the_codes_returned(
    script: str, reply: type[enum.IntEnum]
) -> None:
    assert _table_codes(script) == {member.value for member in reply}


def test_no_other_script_returns_a_coded_table() -> None:
    coded = {"CLAIM", "PUBLISH", "PUBLISH_AND_PUSH"}
    for name, src in SCRIPTS.items():
        if name not in coded:
            assert _table_codes(src) == set(), name


def test_publish_and_push_pushes_on_the_publish_codes() -> None:
    reply = publish_scripts.PublishReply
    pushed = re.search(
        r"if r\[1\] == (\d+) or r\[1\] == (\d+) then", publish_scripts.PUBLISH_AND_PUSH
    )
    assert pushed is not None
    assert {int(c) for c in pushed.groups()} == {reply.PUBLISH, reply.UNCHECKED}


@pytest.mark.parametrize(
    ("method", "reply"),
    [
        (redis_store.RedisAtomicBackend.claim, lease_scripts.ClaimReply),
        (redis_store.RedisIdempotencyStore.check_publish, publish_scripts.PublishReply),
    ],
)
def test_decoders_name_every_code(method: object, reply: type[enum.IntEnum]) -> None:
    """The Python side decodes by the enum's members, never by a bare number."""
    source = inspect.getsource(method)  # type: ignore[arg-type]
    for member in reply:
        assert f"{reply.__name__}.{member.name}" in source, member
    assert not re.search(r"status [!=]= \d", source)


# --------------------------------------------------------------------------- what the text spells


def _literals(src: str) -> list[str]:
    return re.findall(r"'([^']*)'", src)


def test_separators_are_the_constants() -> None:
    """A Lua string that holds a separator holds :data:`keyspace.LOCK_SEP` (a lock's fields)
    or :data:`layout.RECORD_SEP` (a record's or a marker's), as the heads built from them."""
    assert keyspace.LOCK_SEP == "/"
    assert layout.RECORD_SEP == "|"
    lock_texts = {keyspace.LOCK_SEP, "0" + keyspace.LOCK_SEP}
    record_texts = {
        layout.RECORD_SEP,
        layout.RECORD_HEAD,
        layout.QUEUED_HEAD,
        layout.RECORD_SEP + "0" + layout.RECORD_SEP,
        layout.RECORD_SEP + layout.MARKER_QUEUED,
    }
    seen: set[str] = set()
    for name, src in SCRIPTS.items():
        for text in _literals(src):
            if any(not ch.isalnum() and ch not in "_%" for ch in text):
                assert text in lock_texts | record_texts, (name, text)
                seen.add(text)
    assert seen == lock_texts | record_texts


def test_heads_states_and_fields_are_the_constants() -> None:
    v1_fields = layout.lua_list(layout.V1_RECORD_FIELDS)
    for name in ("CLAIM", "PUBLISH", "READ_KEY"):
        assert v1_fields in SCRIPTS[name], name
    # A head is compared by its length: string.sub(x, 1, 2) for a 2-character head.
    assert len(layout.RECORD_HEAD) == len(layout.QUEUED_HEAD) == 2
    for name, src in SCRIPTS.items():
        for size in re.findall(r"string\.sub\(rec, 1, (\d+)\)", src):
            assert int(size) == len(layout.RECORD_HEAD), name
        # A marker's task id starts after its head.
        for start in re.findall(r"string\.find\(rec, '\|', (\d+), true\)", src):
            assert int(start) == len(layout.QUEUED_HEAD) + 1, name
    states = {"'" + state + "'" for state in layout.MARKER_STATES}
    for name, src in SCRIPTS.items():
        for state in re.findall(r"st [~=]= ('\w')|mbase \.\. ('\w')", src):
            assert set(state) - {""} <= states, (name, state)
    assert "mbase .. 'c'" in SCRIPTS["CLAIM"]
    assert "mbase .. 'r'" in SCRIPTS["REQUEUE_MARKER"]
    assert layout.MARKER_CLAIMED == "c"
    assert layout.MARKER_REQUEUED == "r"


def test_the_margin_is_fence_margin_ms() -> None:
    margin = str(int(keyspace.FENCE_MARGIN_MS))
    numbers = {number for src in SCRIPTS.values() for number in re.findall(r"\+ (\d{4,})", src)}
    assert numbers == {margin}


def test_one_keys_order() -> None:
    """The lock, the record, the fence key, then the rest: where a script names what its
    keys are (the contract above it), they come in that order."""
    rank = {"lock": 0, "record": 1, "fence": 2}
    for module in MODULES:
        source = inspect.getsource(module)
        for name in SCRIPTS:
            found = re.search(rf"((?:^# .*\n)+){name} = ", source, re.M)
            if found is None:
                continue
            contract = found.group(1)
            keys = re.findall(r"KEYS\[(?:\d|#KEYS)\] (lock|record|fence)", contract)
            assert keys, f"{name} has no KEYS contract"
            assert [rank[k] for k in keys] == sorted(rank[k] for k in keys), (name, keys)
