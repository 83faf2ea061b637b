"""The README is the front door: its two commands, a short tour and links into the docs.

What it states about commands must be true, and every link must lead somewhere. The manual
itself (settings reference, guarantees, recipes) lives in ``docs/`` and is checked by
``tests/docs``; the README's own examples run there too.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _command_after(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\s*```sh\n(.+?)\n```", README, re.S)
    assert match, f"README has no ```sh block after <!-- {marker} -->"
    return match.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = _command_after("test-command")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lines = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.startswith("#")]
    assert command in lines, f".ci/run does not run the README's test command {command!r}"


def test_demo_command_runs_the_example_project() -> None:
    command = _command_after("demo-command")
    assert command.endswith("-m example_project")
    assert (ROOT / "example_project" / "__main__.py").is_file()


#: Where the repository is read online. The README is also the package index's long
#: description, where a relative link has no page to lead to: every link into the repository
#: is absolute, to this, and names a file the repository has.
REPOSITORY = "https://github.com/celery-idempotent/celery-idempotent"


def _heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the Markdown's headings (lowercase, punctuation dropped)."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _in_repository(link: str) -> str | None:
    """The path (``#anchor`` kept) a link into the repository names, or ``None``."""
    if link.startswith(f"{REPOSITORY}/blob/main/"):
        return link.removeprefix(f"{REPOSITORY}/blob/main/")
    if link.startswith(f"{REPOSITORY}#"):
        return link.removeprefix(REPOSITORY)
    return None


def test_no_link_is_relative_so_the_package_index_page_has_none_broken() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert len(links) >= 40
    relative = [link for link in links if "://" not in link]
    assert not relative, f"relative links break on the package index: {relative}"


def test_every_link_resolves_and_every_docs_page_is_linked() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [path for link in links if (path := _in_repository(link)) is not None]
    assert len(local) >= 40
    for link in local:
        path, _, anchor = link.partition("#")
        if path:
            assert (ROOT / path).is_file(), f"README links to a missing file: {link}"
            if anchor and path.endswith(".md"):
                anchors = _heading_anchors((ROOT / path).read_text(encoding="utf-8"))
                assert anchor in anchors, f"README links to a missing heading: {link}"
        else:
            assert anchor in _heading_anchors(README), link
    pages = {
        str(page.relative_to(ROOT))
        for page in (ROOT / "docs").rglob("*.md")
        if "_ext" not in page.parts
    }
    unlinked = pages - {link.partition("#")[0] for link in local}
    assert not unlinked, f"README's documentation list misses {sorted(unlinked)}"
