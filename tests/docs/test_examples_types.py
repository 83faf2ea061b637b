"""The documentation's examples under ``mypy --strict``, against the package's own types.

Each page's Python (its hidden ``example-setup`` code and its blocks, in order, as
``run_examples.py`` runs them) becomes one module, checked with ``mypy --strict`` and the
package's annotations (``mypy_path`` is the repository, so ``celery_idempotent`` is read from
source, not taken as ``Any``). The examples are written as a Celery user writes tasks, without
annotations, and take names from the reader's project (``gateway``, ``carrier``), so the codes
that only say so are off; every other error (a ``None`` not handled, a wrong argument, a name
the package does not export) fails the test. The documented fencing idiom,
``require_lease().fencing_token``, is the reason this exists: ``current_lease()`` returns
``Lease | None``, and the last test shows that the check catches that form.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.run_examples import ROOT, SNIPPET, blocks

pytestmark = pytest.mark.slow

#: What an unannotated example that uses its reader's own objects is bound to trigger.
OFF = ("no-untyped-def", "no-untyped-call", "var-annotated", "name-defined", "no-redef")


def _modules(out: Path, pages: list[Path]) -> list[Path]:
    written = []
    for page in pages:
        parts = []
        for item in blocks(page.read_text(encoding="utf-8")):
            if item["kind"] == "block" and (
                item["language"] != "python" or item["not_run"] or item["include"]
            ):
                continue
            lines = [ln.strip() for ln in item["code"].splitlines() if ln.strip()]
            if lines and all(SNIPPET.match(ln) for ln in lines):
                continue  # sample-project files: tests/plugin runs (and ruff checks) them
            parts.append(f"# {page.relative_to(ROOT)}:{item['line']}\n{item['code']}")
        if parts:
            name = str(page.relative_to(ROOT)).replace("/", "_").replace("-", "_")
            path = out / name.replace(".md", ".py")
            path.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
            written.append(path)
    return written


def _mypy(tmp: Path, files: list[Path]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports"]
    command += ["--follow-imports=silent", "--cache-dir", str(tmp / "cache")]
    command += [f"--disable-error-code={code}" for code in OFF]
    env = dict(os.environ, MYPYPATH=str(ROOT))
    return subprocess.run(
        [*command, *map(str, files)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_ext" not in p.parts)
    return [ROOT / "README.md", *docs]


def test_the_examples_type_check_strictly(tmp_path: Path) -> None:
    files = _modules(tmp_path, _pages())
    assert len(files) >= 10, [f.name for f in files]
    run = _mypy(tmp_path, files)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found" in run.stdout


def test_the_check_catches_the_optional_lease_idiom(tmp_path: Path) -> None:
    """The same check on the README with the 0.1.0 idiom fails, naming the ``None``."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "require_lease().fencing_token" in readme
    old = readme.replace("require_lease", "current_lease")
    module = tmp_path / "readme_example.py"
    parts = [
        item["code"]
        for item in blocks(old)
        if item["kind"] == "setup"
        or (item["language"] == "python" and not item["not_run"] and not item["include"])
    ]
    module.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    run = _mypy(tmp_path, [module])
    assert run.returncode == 1, run.stdout
    assert 'Item "None" of "Lease | None" has no attribute "fencing_token"' in run.stdout
