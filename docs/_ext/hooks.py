"""MkDocs hooks: pages generated from the code.

The reference of every setting declared on
:class:`celery_idempotent.settings.IdempotencySettings` (its name, its default from
``DEFAULTS`` and its meaning, the ``#:`` comment above the field) is written into
``docs/settings.md`` itself, between ``<!-- settings-reference -->`` and
``<!-- /settings-reference -->``, so that the page reads complete where users read it (on
GitHub, in the sdist). Regenerate it after changing a setting::

    python docs/_ext/hooks.py

``tests/docs`` fails while the file differs from the code; the site build writes the code's
reference into the page all the same. A setting without a ``#:`` comment fails both.

The same command copies files of the repository into the pages that show them: a fenced
block right after ``<!-- include: PATH -->`` holds PATH's text (the sample project's tests on
``docs/testing.md``), visible on GitHub, where the site's ``--8<--`` includes are not
expanded; the build and ``tests/docs`` check that each block is the file's current text.
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

MARKER = "<!-- settings-reference -->"
END_MARKER = "<!-- /settings-reference -->"
#: Said in the generated block, for a reader of the Markdown source.
GENERATED_NOTE = (
    "<!-- generated from celery_idempotent/settings.py by `python docs/_ext/hooks.py`; "
    "do not edit by hand (tests/docs checks it) -->"
)

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
        # No {#id}: GitHub shows attr_list braces; both it and MkDocs slugify to the name.
        out += ["", f"### `{name}`", "", f"Default: `{default_text(default)}`", ""]
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


INCLUDE = re.compile(r"^<!-- include: (\S+) -->\n(`{3,})(\w*)\n(?:.*?\n)??\2$", re.M | re.S)


def with_includes(markdown: str, root: Any) -> str:
    """``markdown`` with every ``<!-- include: PATH -->`` block holding PATH's current text
    (PATH relative to the repository's root ``root``, a :class:`pathlib.Path`)."""

    def block(match: re.Match[str]) -> str:
        path, fence, language = match.group(1), match.group(2), match.group(3)
        text = (root / path).read_text(encoding="utf-8").rstrip("\n")
        while fence in text:
            fence += "`"
        return f"<!-- include: {path} -->\n{fence}{language}\n{text}\n{fence}"

    return INCLUDE.sub(block, markdown)


def with_settings_reference(markdown: str) -> str:
    """``markdown`` with the block between the settings markers replaced by the code's
    reference (a page with only the opening marker gets the block and its closing marker)."""
    start = markdown.index(MARKER)
    end = markdown.find(END_MARKER, start)
    after = markdown[end + len(END_MARKER) :] if end >= 0 else markdown[start + len(MARKER) :]
    block = f"{MARKER}\n{GENERATED_NOTE}\n\n{settings_reference()}\n{END_MARKER}"
    return markdown[:start] + block + after


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: write the code's settings reference into its block, and complete the API
    reference with every public name its page does not place itself (a name added to
    ``__all__`` shows up)."""
    if MARKER in markdown:
        markdown = with_settings_reference(markdown)
    if "<!-- include: " in markdown:
        from pathlib import Path  # noqa: PLC0415

        markdown = with_includes(markdown, Path(__file__).resolve().parents[2])
    if API_MARKER in markdown:
        rest = undocumented_names(markdown)
        block = "\n\n".join(f"::: celery_idempotent.{name}" for name in rest)
        markdown = markdown.replace(API_MARKER, f"## More\n\n{block}" if rest else "")
    return markdown


def regenerate(root: Any) -> list[str]:
    """Rewrite the generated parts of the pages under ``root / "docs"`` (the settings
    reference, the included files); the pages that changed, relative to ``root``."""
    changed = []
    for page in sorted((root / "docs").rglob("*.md")):
        before = page.read_text(encoding="utf-8")
        after = with_includes(before, root)
        if MARKER in after:
            after = with_settings_reference(after)
        if after != before:
            page.write_text(after, encoding="utf-8")
            changed.append(str(page.relative_to(root)))
    return changed


def main() -> None:
    """``python docs/_ext/hooks.py``: regenerate the pages' generated parts from the code."""
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    changed = regenerate(root)
    print("regenerated: " + ", ".join(changed) if changed else "docs: generated parts up to date")


if __name__ == "__main__":
    main()
