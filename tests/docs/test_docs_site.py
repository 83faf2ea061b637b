"""The documentation site, as a reader meets it.

It is built the way ``tox -e docs`` builds it (``mkdocs build --strict``: every warning fails);
then the built HTML is walked from ``site/index.html``: every internal link and anchor resolves,
every page is in the navigation and reachable from the home page, and the settings reference is
exactly the code's table. The pages' code examples are run (``run_examples.py``).
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
import subprocess
import sys
from collections import Counter, deque
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from celery_idempotent.settings import DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import hooks  # noqa: E402  (docs/_ext/hooks.py: the generator the build uses)

sys.path.remove(str(DOCS / "_ext"))


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_ext" not in p.parts)


class _Page(HTMLParser):
    """The ids, links and navigation links of one built page, and its settings table."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.nav_links: list[str] = []
        self.rows: list[list[str]] = []
        self.sections: dict[str, list[str]] = {}
        self._section: list[str] | None = None
        self._nav_depth = 0
        self._stack: list[str] = []
        self._cell: list[str] | None = None
        self._row: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = {k: v or "" for k, v in attrs}
        if "id" in attr:
            self.ids.add(attr["id"])
        if re.fullmatch(r"h[1-6]", tag):
            self._section = self.sections.setdefault(attr.get("id", ""), [])
        elif tag == "footer":
            self._section = None
        if tag == "a" and "name" in attr:
            self.ids.add(attr["name"])
        primary = "md-nav--primary" in attr.get("class", "").split()
        if tag == "nav" and (self._nav_depth or primary):
            self._nav_depth += 1
        for name in ("href", "src"):
            if name in attr and tag in ("a", "link", "script", "img"):
                self.links.append(attr[name])
                if self._nav_depth and tag == "a":
                    self.nav_links.append(attr[name])
        if tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "article":
            self._section = None
        if tag == "nav" and self._nav_depth:
            self._nav_depth -= 1
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._section is not None:
            self._section.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as ``tox -e docs`` builds it."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "WARNING" not in run.stderr, run.stderr
    return out


@pytest.fixture(scope="module")
def built(site: Path) -> dict[Path, _Page]:
    return {path: _parse(path) for path in site.rglob("*.html")}


def _resolve(site: Path, page: Path, link: str) -> tuple[Path, str] | None:
    """The file and fragment an internal link leads to; ``None`` for an external one."""
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
        return None
    if not parts.path:
        return page, unquote(parts.fragment)
    target = (page.parent / unquote(parts.path)).resolve()
    if target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


def test_tox_builds_the_docs_with_warnings_as_errors() -> None:
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    assert "mkdocs build --strict" in tox["testenv:docs"]["commands"]
    assert "docs" in tox["testenv:docs"]["extras"]


def test_every_internal_link_and_anchor_resolves(site: Path, built: dict[Path, _Page]) -> None:
    broken = []
    checked = 0
    for page, parsed in built.items():
        if page.name == "404.html":
            # Served by a web server for a missing URL, at any depth: its links are absolute
            # on purpose, and no page links to it.
            continue
        for link in parsed.links:
            resolved = _resolve(site, page, link)
            if resolved is None:
                continue
            target, fragment = resolved
            checked += 1
            where = f"{page.relative_to(site)}: {link}"
            if not target.is_file() or site.resolve() not in target.parents:
                broken.append(f"{where} (no file {target})")
            elif fragment and target.suffix == ".html" and fragment not in built[target].ids:
                broken.append(f"{where} (no anchor #{fragment})")
    assert not broken, "\n".join(broken)
    assert checked > 500  # the walk saw the site, not an empty page


def test_every_page_is_in_the_navigation_and_reachable_from_the_home_page(
    site: Path, built: dict[Path, _Page]
) -> None:
    expected = {(site / p.relative_to(DOCS)).with_suffix(".html").resolve() for p in _pages()}
    assert expected <= set(built), sorted(map(str, expected - set(built)))
    index = site.resolve() / "index.html"
    in_nav = {_resolve(site, index, link)[0] for link in built[index].nav_links}  # type: ignore[index]
    assert expected <= in_nav, sorted(str(p.relative_to(site)) for p in expected - in_nav)
    seen, queue = {index}, deque([index])
    while queue:
        page = queue.popleft()
        for link in built[page].links:
            resolved = _resolve(site, page, link)
            if resolved and resolved[0].suffix == ".html" and resolved[0] not in seen:
                seen.add(resolved[0])
                queue.append(resolved[0])
    assert expected <= seen, sorted(str(p.relative_to(site)) for p in expected - seen)


def _rendered(markdown: str) -> str:
    """A table cell's Markdown as its text reads in the HTML."""
    return re.sub(r"\s+", " ", markdown.replace("`", "").replace("\\|", "|")).strip()


def test_the_settings_reference_is_the_codes_table(site: Path, built: dict[Path, _Page]) -> None:
    page = built[site.resolve() / "settings.html"]
    table = {row[0]: row[1] for row in page.rows if row and row[0].startswith("idempotency_")}
    assert list(table) == list(DEFAULTS), "settings summary: names or order differ from the code"
    documented = {name: meaning for name, _, meaning in hooks.setting_docs()}
    for name, default in table.items():
        assert ast.literal_eval(default) == DEFAULTS[name], (
            f"the reference says {name} defaults to {default}, the code {DEFAULTS[name]!r}"
        )
        section = _rendered("".join(page.sections[name]))
        meaning = documented[name][:1].upper() + documented[name][1:]
        assert section == _rendered(f"{name}¶ Default: {default} {meaning}"), name


def test_the_pages_generated_parts_are_the_codes_and_files_current_text() -> None:
    """docs/settings.md holds the code's settings reference and docs/testing.md the sample
    project's files, in the Markdown itself (GitHub shows no generated or included text)."""
    stale = [
        str(page.relative_to(ROOT))
        for page in [*_pages(), DOCS / "settings.md"]
        if (text := page.read_text(encoding="utf-8"))
        != (
            hooks.with_settings_reference(hooks.with_includes(text, ROOT))
            if hooks.MARKER in text
            else hooks.with_includes(text, ROOT)
        )
    ]
    assert not stale, f"{stale} differ from the code: run `python docs/_ext/hooks.py`"
    settings_page = (DOCS / "settings.md").read_text(encoding="utf-8")
    for name in DEFAULTS:
        assert f"\n### `{name}`\n" in settings_page, name
    testing_page = (DOCS / "testing.md").read_text(encoding="utf-8")
    assert "--8<--" not in testing_page
    tasks = (ROOT / "tests/plugin/sample_project/shop/tasks.py").read_text(encoding="utf-8")
    assert tasks.strip() in testing_page


def test_a_stale_generated_part_is_found(tmp_path: Path) -> None:
    settings_page = (DOCS / "settings.md").read_text(encoding="utf-8")
    edited = settings_page.replace("Default: `86400`", "Default: `3600`", 1)
    assert edited != settings_page
    assert hooks.with_settings_reference(edited) == settings_page
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    testing = (DOCS / "testing.md").read_text(encoding="utf-8")
    tasks = (ROOT / "tests/plugin/sample_project/shop/tasks.py").read_text(encoding="utf-8")
    assert tasks.strip() in testing
    stale_testing = testing.replace(tasks.strip(), tasks.strip() + "\n# an old line", 1)
    (tmp_path / "docs" / "testing.md").write_text(stale_testing)
    (tmp_path / "docs" / "settings.md").write_text(edited)
    assert hooks.regenerate(tmp_path) == ["docs/settings.md", "docs/testing.md"]
    assert (tmp_path / "docs" / "testing.md").read_text(encoding="utf-8") == testing


def test_the_settings_reference_fails_the_build_for_an_undocumented_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import inspect

    from celery_idempotent import settings

    source = inspect.getsource(settings)
    stripped = source.replace(
        "    #: kill switch: ``False`` runs tasks plainly, without any guard.\n", ""
    )
    assert stripped != source
    monkeypatch.setattr(inspect, "getsource", lambda obj: stripped)
    with pytest.raises(ValueError, match="setting idempotency_enabled has no '#:' comment"):
        hooks.settings_reference()


def test_the_examples_run(idempotency_redis: Any) -> None:
    pages = [str(ROOT / "README.md")] + [str(p) for p in _pages()]
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("run_examples.py")), *pages],
        cwd=ROOT,
        env=dict(os.environ, DOCS_REDIS_URL=idempotency_redis.url(0)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    errors = [f"{r['page']}:{r['line']}\n{r['error']}" for r in report if r["status"] == "error"]
    assert not errors, "\n".join(errors)
    counts = Counter(r["status"] for r in report)
    assert counts["ran"] >= 15, counts
    assert counts["not run"] <= 5, [r for r in report if r["status"] == "not run"]
    assert counts["snippet"] >= 4, counts
    ran_on = {r["page"] for r in report if r["status"] == "ran"}
    for page in ("README.md", "docs/getting-started.md", "docs/recipes/http.md", "docs/guard.md"):
        assert page in ran_on, page


def test_the_testing_page_covers_every_fixture_and_helper() -> None:
    from celery_idempotent import testing

    page = (DOCS / "testing.md").read_text(encoding="utf-8")
    fixtures = [name for name in testing.__all__ if name.startswith("idempotency")]
    helpers = [
        name
        for name, value in vars(testing.IdempotencyTester).items()
        if not name.startswith("_") and callable(value) and name != "close"
    ]
    assert len(fixtures) == 6
    assert len(helpers) >= 7
    missing = [name for name in fixtures + helpers if f"`{name}" not in page]
    assert not missing, f"docs/testing.md does not describe {missing}"


def test_the_api_reference_renders_every_public_name(site: Path, built: dict[Path, _Page]) -> None:
    import celery_idempotent

    ids = built[site.resolve() / "api.html"].ids
    public = [name for name in celery_idempotent.__all__ if name != "__version__"]
    missing = [name for name in public if f"celery_idempotent.{name}" not in ids]
    assert not missing, f"the API reference does not render {missing}"
    # A name added to __all__ without a place on the page is rendered under "More".
    page = (DOCS / "api.md").read_text(encoding="utf-8")
    without = page.replace("::: celery_idempotent.current_lease\n", "")
    assert without != page
    completed = hooks.on_page_markdown(without)
    assert "## More\n\n::: celery_idempotent.current_lease" in completed
    assert "## More" not in hooks.on_page_markdown(page)
