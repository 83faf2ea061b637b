"""MkDocs hooks: pages generated from the code at build time.

``<!-- settings-reference -->`` in a page becomes the reference of every setting declared on
:class:`celery_idempotent.settings.IdempotencySettings`: its name, its default (from
``DEFAULTS``) and its meaning (the ``#:`` comment above the field). A setting added to the code
appears in the built docs without editing them; a setting without a ``#:`` comment fails the
build. ``tests/docs/test_docs_site.py`` checks the built page against the code.
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

MARKER = "<!-- settings-reference -->"

_MODULE = re.compile(r":mod:`~?([^`]+)`")
_ROLE = re.compile(r":(?:class|func|meth|data|attr|exc|mod):`~?([^`]+)`")


def _markdown(text: str) -> str:
    """reST inline markup of the code's comments as Markdown."""
    text = _MODULE.sub(lambda m: f"`{m.group(1)}`", text)  # a module keeps its dotted name
    text = _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


def setting_docs() -> list[tuple[str, Any, str]]:
    """``(name, default, meaning)`` of every setting, in the order of the code's table."""
    from celery_idempotent import settings  # noqa: PLC0415

    source = inspect.getsource(settings)
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "IdempotencySettings"
    )
    docs: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        index = node.lineno - 2
        while index >= 0 and lines[index].strip().startswith("#:"):
            comment.insert(0, lines[index].strip()[2:].strip())
            index -= 1
        docs[node.target.id] = " ".join(comment)
    rows = []
    for name, default in settings.DEFAULTS.items():
        meaning = docs.get(name, "")
        if not meaning:
            raise ValueError(
                f"setting {name} has no '#:' comment above its field in "
                "celery_idempotent/settings.py (IdempotencySettings): the settings reference "
                "is generated from those comments"
            )
        rows.append((name, default, _markdown(meaning)))
    return rows


def default_text(value: Any) -> str:
    """A default as the reference shows it: a Python literal (``"args"``, ``86400``)."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def settings_reference() -> str:
    """The Markdown of every setting: a summary table, then one section per setting."""
    rows = setting_docs()
    out = ["| setting | default |", "|---|---|"]
    out += [f"| [`{name}`](#{name}) | `{default_text(default)}` |" for name, default, _ in rows]
    for name, default, meaning in rows:
        out += ["", f"### `{name}` {{ #{name} }}", "", f"Default: `{default_text(default)}`", ""]
        out.append(meaning[:1].upper() + meaning[1:])
    return "\n".join(out) + "\n"


API_MARKER = "<!-- api-reference: the rest -->"


def undocumented_names(markdown: str) -> list[str]:
    """Public names (``celery_idempotent.__all__``) that no ``:::`` line of a page renders."""
    import celery_idempotent  # noqa: PLC0415

    shown = set(re.findall(r"^::: celery_idempotent\.(\w+)\s*$", markdown, re.M))
    return [
        name for name in celery_idempotent.__all__ if name != "__version__" and name not in shown
    ]


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: expand the settings reference, and complete the API reference with every
    public name its page does not place itself (a name added to ``__all__`` shows up)."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, settings_reference())
    if API_MARKER in markdown:
        rest = undocumented_names(markdown)
        block = "\n\n".join(f"::: celery_idempotent.{name}" for name in rest)
        markdown = markdown.replace(API_MARKER, f"## More\n\n{block}" if rest else "")
    return markdown
