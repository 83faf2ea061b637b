"""Mutants of the library's scripts and renewal, to prove the checker has teeth.

Each mutant edits the library's own code as it is loaded into the simulation (the script
text the library registers, or the source of ``LeaseKeeper._renew``), never the files on
disk. An edit that no longer finds its target raises, so a change of the library's code
cannot silently turn a mutant into the original.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from celery_idempotent.core import renewal

from . import adapter

__all__ = ["MUTANTS", "Mutant"]


@dataclass
class Mutant:
    name: str
    what: str
    script_edit: Callable[[str], str] | None = None
    renew_edit: Callable[[str], str] | None = None
    guard_edit: Callable[[Any], Any] | None = None
    publish: bool = False  # caught only with publishes in the plan (make_publish_plan)

    def renew(self, proc: Any) -> Any:
        if self.renew_edit is None:
            return None
        return adapter.recompile(renewal.LeaseKeeper._renew, self.renew_edit, time=proc.time)

    def check(self) -> None:
        """Raise unless every edit of this mutant applies to the library's current code."""
        if self.script_edit is not None:
            sources = list(adapter.script_roles())
            if all(self.script_edit(s) == s for s in sources):
                raise ValueError(f"mutant {self.name}: its script edit matches no script")
        if self.renew_edit is not None:
            adapter.recompile(renewal.LeaseKeeper._renew, self.renew_edit)


def _sub(*alternatives: tuple[str, str], only: str | None = None) -> Callable[[str], str]:
    """A script edit: the first of ``(pattern, replacement)`` that matches, applied once, to
    the script ``only`` (a constant's name in the library's script modules) or to any.
    Alternatives cover the script texts of both Redis layouts (v1, v2)."""
    compiled = [(re.compile(p, re.S), r) for p, r in alternatives]

    def edit(src: str) -> str:
        if only is not None and src != adapter.script_source(only):
            return src
        for rx, repl in compiled:
            out = rx.sub(repl, src, count=1)
            if out != src:
                return out
        return src

    return edit


def _re(pattern: str, repl: str) -> Callable[[str], str]:
    rx = re.compile(pattern)

    def edit(src: str) -> str:
        return rx.sub(repl, src, count=1)

    return edit


MUTANTS = [
    Mutant(
        "commit-without-holder-check",
        "COMMIT writes the record and deletes the lock without checking the token",
        script_edit=_sub(
            (r"if redis\.call\('get', KEYS\[1\]\) ~= ARGV\[1\] then", "if false then"),
            (r"if not live then\n  local rec", "live = true\nif not live then\n  local rec"),
            only="COMMIT",
        ),
    ),
    Mutant(
        "release-without-token-check",
        "RELEASE deletes the lock whoever holds it",
        script_edit=_sub(
            # v1: "if get == token then return del end return 0"
            (
                r"if redis\.call\('get', KEYS\[1\]\) == ARGV\[1\] then "
                r"return (redis\.call\('del', KEYS\[1\]\)) end",
                r"do return \1 end",
            ),
            # v2: "if get ~= token then return 0 end; del; ..."
            (r"if redis\.call\('get', KEYS\[1\]\) ~= ARGV\[1\] then return 0 end", ""),
            # v2 with tombstones: "if not held then return 0 end ... if not live then return 0 end"
            (
                r"if not held then return 0 end(.*)if not live then return 0 end",
                r"if not held then return 0 end\1live = true",
            ),
            only="RELEASE",
        ),
    ),
    Mutant(
        "fence-not-floored",
        "a fencing token is last + 1, not floored by the server's clock",
        script_edit=_sub(
            (r"math\.max\(last \+ 1, now\)", "last + 1"),  # v1
            (r"math\.max\(now, (tonumber\(fv or '0'\) \+ 1)\)", r"\1"),  # v2
            (r"\nlocal f = now\n", "\nlocal f = 0\n"),  # v2 with tombstones
        ),
    ),
    Mutant(
        "renewal-ignores-not-ours",
        "the lease keeper keeps renewing after Redis answered 'not ours'",
        renew_edit=_re(r"if not ours:", "if False:  # mutant: 'not ours' ignored"),
    ),
    Mutant(
        "commit-resend-rewrites",
        "a commit sent again after its reply was lost writes the record again",
        script_edit=_sub(
            (  # v1
                r"if fence and fence == ARGV\[9\] and ARGV\[9\] ~= '' then return 1 end",
                "if fence and fence == ARGV[9] and ARGV[9] ~= '' then "
                "redis.call('hset', KEYS[2], 'at', ARGV[8]) "
                "redis.call('pexpire', KEYS[2], ARGV[2]) return 1 end",
            ),
            (  # v2
                r"(if type\(rec\) == 'string' and string\.sub\(rec, 1, #head\) == head then) "
                r"return 1 end",
                r"\1 redis.call('set', KEYS[2], ARGV[3], 'PX', ARGV[2]) return 1 end",
            ),
            only="COMMIT",
        ),
    ),
]

MUTANTS += [
    Mutant(
        "release-forgets-the-token",
        "RELEASE deletes the lock (no tombstone): a server clock step back after it lowers "
        "the next fencing token",
        script_edit=_sub(
            (
                r"(local f = tonumber\(ARGV\[2\]\)\n--\[\[ shared: tombstone \]\]\n)"
                r"redis\.call\('set', KEYS\[1\][^\n]*\n",
                r"\1redis.call('del', KEYS[1])\n",
            ),
            only="RELEASE",
        ),
    ),
    Mutant(
        "lease-key-without-margin",
        "a claim's lock lives only as long as its lease: once it expires nothing keeps the token",
        script_edit=_sub(
            (r"(local px = ARGV\[2\]) \+ \d+\n", r"\1\n"),
            only="CLAIM",
        ),
    ),
    Mutant(
        "publish-ignores-record",
        "PUBLISH does not see a committed record (the completed answer is gone)",
        script_edit=_sub(
            (r"if head == '[^']*' then return \{2, rec[^}]*\} end", ""),
            only="PUBLISH",
        ),
        publish=True,
    ),
    Mutant(
        "publish-marks-over-record",
        "PUBLISH writes its queued marker over a committed record",
        script_edit=_sub(
            (
                r"if head == '([^']*)' then return \{2, rec[^}]*\} end",
                r"if head == '\1' then redis.call('set', KEYS[2], 'q|' .. ARGV[1] .. '|' .. "
                r"ARGV[2], 'PX', ARGV[3]) return {1} end",
            ),
            only="PUBLISH",
        ),
        publish=True,
    ),
    Mutant(
        "publish-ignores-marker",
        "PUBLISH sets its own marker over another call's queued marker",
        script_edit=_sub(
            (
                r"local got = redis\.call\('mget', KEYS\[1\], KEYS\[2\]\)\nlocal held, rec = "
                r"got\[1\], got\[2\]",
                "local got = redis.call('mget', KEYS[1], KEYS[2])\n"
                "local held, rec = got[1], got[2]\n"
                "if rec and string.sub(rec, 1, 2) == 'q|' then rec = nil end",
            ),
            only="PUBLISH",
        ),
        publish=True,
    ),
]

BY_NAME = {m.name: m for m in MUTANTS}
