"""The README is the user's manual: what it states about commands and defaults must be true."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from celery_idempotent.settings import DEFAULTS

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


def _settings_table() -> dict[str, str]:
    start = README.index("<!-- settings-table")
    rows: dict[str, str] = {}
    for line in README[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].strip("`")
        if name.startswith("idempotency_"):
            rows[name] = cells[1].strip("`")
    return rows


def test_settings_table_matches_the_code_defaults() -> None:
    table = _settings_table()
    assert list(table) == list(DEFAULTS), "README settings table: names or order differ"
    for name, text in table.items():
        assert ast.literal_eval(text) == DEFAULTS[name], (
            f"README says {name} defaults to {text}, the code says {DEFAULTS[name]!r}"
        )
