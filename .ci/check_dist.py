"""Check the built artefacts in ``dist/`` as a package index and a packager would see them.

- one wheel and one sdist, both named for ``celery_idempotent.__version__``;
- the wheel holds the package (and its ``py.typed``) and its metadata, nothing else, and
  carries the LICENSE;
- the sdist holds every file git tracks (``MANIFEST.in``), plus the generated metadata (an
  untracked file of the checkout it also holds is named in a warning);
- the sdist's tests run: ``tests/unit`` is run from the unpacked sdist, importing the
  sdist's own copy of the package (``pythonpath = .`` in its setup.cfg).

Usage: ``python .ci/check_dist.py [dist-dir]`` after ``python -m build``; exits non-zero with
the reason. ``.ci/run`` runs it after ``twine check --strict``.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {"PKG-INFO", "setup.cfg"}  # setup.cfg: setuptools rewrites it with egg_info's tags


def fail(message: str) -> None:
    print(f"check_dist: {message}", file=sys.stderr)
    raise SystemExit(1)


def version() -> str:
    sys.path.insert(0, str(ROOT))
    import celery_idempotent  # noqa: PLC0415

    return celery_idempotent.__version__


def main(dist: Path) -> None:
    v = version()
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    expected = (f"celery_idempotent-{v}-py3-none-any.whl", f"celery_idempotent-{v}.tar.gz")
    if [w.name for w in wheels] != [expected[0]] or [s.name for s in sdists] != [expected[1]]:
        fail(f"expected exactly {expected} in {dist}, found {[p.name for p in dist.iterdir()]}")

    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
    info = f"celery_idempotent-{v}.dist-info/"
    stray = [n for n in names if not n.startswith(("celery_idempotent/", info))]
    if stray:
        fail(f"the wheel carries files outside the package: {stray}")
    for needed in ("celery_idempotent/py.typed", f"{info}licenses/LICENSE", f"{info}METADATA"):
        if needed not in names:
            fail(f"the wheel has no {needed}")

    tracked = set(
        subprocess.run(
            ["git", "ls-files"],  # noqa: S607 - the checkout's own git
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
    )
    prefix = f"celery_idempotent-{v}/"
    with tarfile.open(sdists[0]) as sdist:
        members = {m.name.removeprefix(prefix) for m in sdist.getmembers() if m.isfile()}
        missing = sorted(tracked - members)
        extra = sorted(
            name for name in members - tracked if name not in GENERATED and ".egg-info/" not in name
        )
        if missing:
            fail(f"the sdist lacks files git tracks (MANIFEST.in): {missing}")
        if extra:
            # Files the checkout has and git does not track (left by a test run, say): a
            # release is built from a clean clone, so they are named, not fatal.
            print(f"check_dist: WARNING: the sdist also carries untracked files: {extra}")
        with tempfile.TemporaryDirectory() as tmp:
            sdist.extractall(tmp, filter="data")
            unpacked = Path(tmp) / prefix
            run = subprocess.run(
                [sys.executable, "-m", "pytest", "tests/unit", "-q", "-x"],
                cwd=unpacked,
                check=False,
                capture_output=True,
                text=True,
            )
            tail = "\n".join(run.stdout.strip().splitlines()[-3:])
            if run.returncode != 0:
                fail(f"tests/unit failed when run from the sdist:\n{run.stdout[-4000:]}")
            print(f"check_dist: tests/unit from the sdist: {tail.splitlines()[-1]}")
    print(
        f"check_dist: OK: {wheels[0].name} ({len(names)} files), {sdists[0].name} "
        f"({len(members)} files, the {len(tracked)} git tracks + metadata)"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "dist")
