"""What a package index and a packager read: one version, its changelog section, the
licence, the metadata, and the dependency floors the version matrix runs.

The built artefacts themselves (wheel and sdist contents, ``twine check --strict``, the
sdist's tests) are checked by ``.ci/check_dist.py`` after ``python -m build`` in ``.ci/run``.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import celery_idempotent

ROOT = Path(__file__).resolve().parent.parent
CFG = configparser.ConfigParser(interpolation=None)
CFG.read(ROOT / "setup.cfg", encoding="utf-8")


def _requirements(section: str, option: str) -> dict[str, str]:
    lines = [ln.strip() for ln in CFG[section][option].splitlines() if ln.strip()]
    return {re.split(r"[<>=\[]", ln, maxsplit=1)[0]: ln for ln in lines}


def test_the_version_has_one_source() -> None:
    assert CFG["metadata"]["version"] == "attr: celery_idempotent.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", celery_idempotent.__version__)
    sources = [
        path
        for path in (ROOT / "celery_idempotent").rglob("*.py")
        if re.search(r"^__version__\s*=", path.read_text(encoding="utf-8"), re.M)
    ]
    assert sources == [ROOT / "celery_idempotent" / "__init__.py"]


def test_the_changelog_has_this_versions_release_section() -> None:
    changelog = (ROOT / "docs" / "changelog.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", changelog, re.M)
    assert headings[0] == celery_idempotent.__version__, headings[:2]
    assert "Unreleased" not in changelog.split("\n## ", 2)[1]
    assert re.search(r"^## 0\.1\.0$", changelog, re.M)  # the previous release stays listed


def test_the_licence_is_bsd_3_clause_and_shipped() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("BSD 3-Clause License")
    assert "Neither the name of the copyright holder" in text
    assert CFG["metadata"]["license"] == "BSD-3-Clause"
    assert CFG["metadata"]["license_files"] == "LICENSE"


def test_the_metadata_names_its_people_and_places() -> None:
    meta = CFG["metadata"]
    for field in ("author", "maintainer", "url", "description", "long_description"):
        assert meta.get(field), field
    urls = dict(
        (part.strip() for part in line.split("=", 1))
        for line in meta["project_urls"].splitlines()
        if line.strip()
    )
    assert set(urls) >= {"Documentation", "Source", "Changelog", "Issues"}
    assert all(url.startswith("https://") for url in urls.values())


def test_the_floors_are_the_lowest_that_install_and_tox_lowest_pins_them() -> None:
    declared = _requirements("options", "install_requires")
    assert declared["celery"] == "celery[redis]>=5.5"
    assert declared["kombu"] == "kombu>=5.5.2"  # every celery 5.5 needs kombu >= 5.5.2
    assert declared["redis"] == "redis>=4.6"
    pins = {}
    for line in (ROOT / "constraints" / "lowest.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name] = version
    assert pins == {"celery": "5.5.0", "kombu": "5.5.2", "redis": "4.6.0"}


def test_tox_has_the_version_matrix_and_ci_runs_lowest() -> None:
    tox = (ROOT / "tox.ini").read_text(encoding="utf-8")
    assert "[testenv:{lowest,celery55,celery56,latest}]" in tox
    for env in ("lowest", "celery55", "celery56", "latest"):
        assert (ROOT / "constraints" / f"{env}.txt").is_file(), env
        assert env in tox.split("envlist =", 1)[1].splitlines()[0]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ".venv/bin/tox -e lowest" in ci
    assert "twine check --strict" in ci
    assert ".ci/check_dist.py" in ci
