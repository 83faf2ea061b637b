"""Griffe extension: the docstrings' reST roles as Markdown for mkdocstrings.

The code's docstrings are written for Python's ``help()`` with Sphinx-style roles
(``:class:`~celery_idempotent.LockLostError```); mkdocstrings renders Markdown. A role becomes a
cross-reference (``[LockLostError][celery_idempotent.LockLostError]``) when it names something
of the package, else inline code; ``double backticks`` become single ones.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|data|attr|exc|mod|obj):`(~?)([^`]+)`")


class ReSTRoles(griffe.Extension):
    """Rewrites each docstring once, when its object is loaded."""

    def on_instance(self, *, obj: Any, **_: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        docstring.value = convert(docstring.value, obj)


def convert(text: str, obj: Any = None) -> str:
    def role(match: re.Match[str]) -> str:
        short, target = match.group(1) == "~", match.group(2)
        shown = target.rsplit(".", 1)[-1] if short else target
        if target.startswith("celery_idempotent."):
            return f"[`{shown}`][{target}]"
        return f"`{shown}`"

    text = _ROLE.sub(role, text)
    text = _simple_tables(text)  # before the markup changes the columns' widths
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return _literal_blocks(text)


_RULE = re.compile(r"^=+( +=+)+$")


def _simple_tables(text: str) -> str:
    """reST simple tables (``====  ====`` rules around a header) as Markdown tables."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if _RULE.match(lines[i]) and i + 2 < len(lines) and _RULE.match(lines[i + 2]):
            spans = [m.span() for m in re.finditer(r"=+", lines[i])]

            def cells(line: str, spans: list[tuple[int, int]] = spans) -> list[str]:
                ends = [start for start, _ in spans[1:]] + [len(line)]
                return [line[a:b].strip() for (a, _), b in zip(spans, ends)]

            out += ["| " + " | ".join(cells(lines[i + 1])) + " |", "|" + "---|" * len(spans)]
            j = i + 3
            while j < len(lines) and not _RULE.match(lines[j]):
                out.append("| " + " | ".join(cells(lines[j])) + " |")
                j += 1
            i = j + 1
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def _literal_blocks(text: str) -> str:
    """reST's ``paragraph::`` + indented block as a fenced code block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip():
            stripped = line.rstrip()[:-2].rstrip()
            out.append(stripped + ":" if stripped else "")
            j = i + 1
            block: list[str] = []
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith("    ")):
                block.append(lines[j][4:])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", "```python", *[b for b in block if b or block], "```", ""]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)
