"""The container images the Docker tests run on, built here with no image registry.

No registry is reachable from this project's machines, so nothing is pulled: every image is
made locally, in three layers, each cached under a key that hashes its inputs (a second run with
the same inputs builds nothing):

1. **base** (``celery-idempotent/base-<distro>:<key>``): a Debian root filesystem made by
   ``debootstrap --variant=minbase`` with Python, ``redis-server`` (and ``valkey-server`` /
   ``rabbitmq-server`` where the release has them) from Debian's own packages, imported with
   ``docker import``. The tarball is kept in the cache directory, so a pruned Docker store is
   refilled in seconds without debootstrap.
2. **wheelhouse** (``<cache>/wheels/cp<XY>-<key>/``): the wheels for that distribution's Python,
   downloaded on the host (``pip download --python-version``), since containers reach no package
   index; plus the project's own wheel, built from this checkout (``pip wheel``), keyed by a hash
   of the package's source files.
3. **worker** (``celery-idempotent/worker-<distro>:<key>``): ``FROM`` the base, the wheelhouse
   installed with ``pip install --no-index`` into ``/opt/venv`` (on ``PATH``): this project,
   Celery with Redis, pytest-celery (its worker-container helpers), pytest and the test tools
   that the in-container matrix runs.

The same base image serves Redis, Valkey and RabbitMQ containers (their Debian packages are in
it); the worker image runs Celery workers and the in-container test runs.

The SQL servers have images of their own (``celery-idempotent/sql-<distro>:<key>``, built like a
base: debootstrap, ``docker import``, the tarball cached), one per release, with that release's
``postgresql-<major>`` and MariaDB (``default-mysql-server-core``, the client for the set-up):
PostgreSQL 13 / MariaDB 10.5 (bullseye), 15 / 10.11 (bookworm), 17 / 11.8 (trixie). They are
kept apart from the base images so that adding them rebuilt no base and no worker image, and
they are built only when an SQL cell of the matrix asks (``--sql`` builds them too).

Run it as ``python -m tests.containers build`` (``--distro bookworm`` for one, ``--json`` for
the timings); the pytest fixtures (``tests/containers/conftest.py``) call :func:`ensure` too, so a
first test run builds what is missing. The cache directory is ``CELERY_IDEMPOTENT_IMAGE_CACHE``
(default ``/var/cache/celery-idempotent-images``), outside the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DISTROS",
    "SQL_DISTROS",
    "BuildError",
    "Distro",
    "Images",
    "cache_dir",
    "ensure",
    "project_key",
]

ROOT = Path(__file__).resolve().parents[2]
MIRROR = "http://deb.debian.org/debian"
# Bumped whenever the way an image is made changes in a way its inputs do not show.
BUILDER_VERSION = "1"

# What the worker image installs from the wheelhouse, besides the project itself. pytest-celery
# is the worker side of its container API (its worker volume's utils import psutil); pytest and
# friends run the core subset inside the container (the matrix).
WORKER_REQUIREMENTS = (
    "celery[redis]>=5.5",
    "kombu>=5.5",
    "redis>=4.6",
    "pytest-celery[redis]>=1.3",
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
)

# RabbitMQ's default refuses "guest" from anything but loopback; containers talk over a docker
# network, so the test broker allows it (the official image does the same).
RABBITMQ_CONF = "loopback_users.guest = false\nlisteners.tcp.default = 5672\n"


class BuildError(RuntimeError):
    """An image could not be built; the message names the step and carries its output tail."""


@dataclass(frozen=True)
class Distro:
    """One Debian release: the Python and the servers its packages bring."""

    name: str
    python: str
    packages: tuple[str, ...]
    # server name -> the binary that runs it (in this distro's base image)
    servers: dict[str, str] = field(default_factory=dict)

    @property
    def python_tag(self) -> str:
        return "cp" + self.python.replace(".", "")


DISTROS: dict[str, Distro] = {
    "bookworm": Distro(
        "bookworm",
        "3.11",
        ("python3", "python3-venv", "redis-server", "rabbitmq-server", "procps"),
        {"redis-7.0": "redis-server"},
    ),
    "bullseye": Distro(
        "bullseye",
        "3.9",
        ("python3", "python3-venv", "redis-server", "procps"),
        {"redis-6.0": "redis-server"},
    ),
    "trixie": Distro(
        "trixie",
        "3.13",
        ("python3", "python3-venv", "redis-server", "valkey-server", "procps"),
        {"redis-8": "redis-server", "valkey-8": "valkey-server"},
    ),
}


#: Debian release -> its SQL server image's packages (PostgreSQL's major version is in the name;
#: ``default-mysql-server-core`` is the release's MariaDB, whatever its version).
SQL_DISTROS: dict[str, Distro] = {
    name: Distro(
        name,
        DISTROS[name].python,
        (f"postgresql-{major}", "default-mysql-server-core", "default-mysql-client", "procps"),
        {f"postgresql-{major}": f"/usr/lib/postgresql/{major}/bin/postgres", "mariadb": "mariadbd"},
    )
    for name, major in (("bullseye", "13"), ("bookworm", "15"), ("trixie", "17"))
}


def cache_dir() -> Path:
    """Where rootfs tarballs and wheelhouses are kept (outside the repository)."""
    return Path(
        os.environ.get("CELERY_IDEMPOTENT_IMAGE_CACHE", "/var/cache/celery-idempotent-images")
    )


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _run(step: str, argv: Sequence[str], **kwargs: Any) -> str:
    proc = subprocess.run(
        list(argv), check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        **kwargs,
    )  # fmt: skip
    if proc.returncode != 0:
        raise BuildError(
            f"{step} failed ({proc.returncode}): {' '.join(argv)}\n{proc.stdout[-4000:]}"
        )
    return proc.stdout


def _docker() -> Any:
    import docker  # type: ignore[import-untyped]  # pytest-celery's dependency

    return docker.from_env(timeout=600)


def _has_image(client: Any, tag: str) -> bool:
    import docker.errors  # type: ignore[import-untyped]

    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def project_files(root: Path = ROOT) -> list[Path]:
    """The files the project's wheel is made of (what its key hashes)."""
    files = [root / "setup.cfg", root / "pyproject.toml", root / "README.md"]
    for path in sorted((root / "celery_idempotent").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files.append(path)
    return files


def project_key(root: Path = ROOT) -> str:
    """A hash of the project's source: the wheel (and the worker images) change with it."""
    digest = hashlib.sha256()
    for path in project_files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclass
class Images:
    """The tags :func:`ensure` made or found, and what each step cost."""

    base: dict[str, str] = field(default_factory=dict)
    worker: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    built: list[str] = field(default_factory=list)


def _timed(images: Images, name: str, start: float) -> None:
    images.timings[name] = round(time.monotonic() - start, 1)


# --------------------------------------------------------------------------- base images


def base_key(distro: Distro) -> str:
    return _digest(BUILDER_VERSION, distro.name, distro.packages, MIRROR, RABBITMQ_CONF)


def base_tag(distro: Distro) -> str:
    return f"celery-idempotent/base-{distro.name}:{base_key(distro)}"


def _debootstrap(distro: Distro, tarball: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise BuildError("debootstrap is not installed: apt-get install -y debootstrap")
    work = Path(tempfile.mkdtemp(prefix=f"rootfs-{distro.name}-", dir=tarball.parent))
    try:
        rootfs = work / "rootfs"
        _run(
            f"debootstrap {distro.name}",
            [
                "debootstrap",
                "--variant=minbase",
                "--include=" + ",".join(distro.packages),
                distro.name,
                str(rootfs),
                MIRROR,
            ],
        )
        # Apt's downloaded packages and lists are dead weight in an image nobody apt-gets in.
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / sub).glob("*"):
                if entry.is_file():
                    entry.unlink()
        if "rabbitmq-server" in distro.packages:
            conf = rootfs / "etc/rabbitmq/rabbitmq.conf"
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(RABBITMQ_CONF)
        _stop_processes_in(rootfs)
        partial = tarball.with_suffix(".partial")
        _run("tar", ["tar", "-C", str(rootfs), "-cf", str(partial), "."])
        partial.rename(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stop_processes_in(rootfs: Path) -> None:
    """SIGKILL what a package's postinst left running in the new root filesystem (a server
    package may start its service in the chroot), so the tarball is of files nobody writes."""
    import signal

    target = rootfs.resolve()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            root = (proc / "root").resolve()
        except OSError:
            continue
        if root == target:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(proc.name), signal.SIGKILL)
    for sub in ("proc", "sys", "dev/pts"):
        mount = rootfs / sub
        if os.path.ismount(mount):
            subprocess.run(["umount", "-l", str(mount)], check=False)


def ensure_base(client: Any, distro: Distro, images: Images) -> str:
    tag = base_tag(distro)
    images.base[distro.name] = tag
    if _has_image(client, tag):
        return tag
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"rootfs-{distro.name}-{base_key(distro)}.tar"
    if not tarball.exists():
        start = time.monotonic()
        _debootstrap(distro, tarball)
        _timed(images, f"debootstrap {distro.name}", start)
    start = time.monotonic()
    _run("docker import", ["docker", "import", str(tarball), tag])
    _timed(images, f"import {distro.name}", start)
    images.built.append(tag)
    return tag


def sql_tag(distro: Distro) -> str:
    """The SQL server image of ``distro`` (one of :data:`SQL_DISTROS`)."""
    return f"celery-idempotent/sql-{distro.name}:{base_key(distro)}"


def ensure_sql(distro: Distro, images: Images | None = None) -> str:
    """Make (or find) the SQL server image of ``distro``: debootstrap, then ``docker import``."""
    images = images if images is not None else Images()
    client = _docker()
    tag = sql_tag(distro)
    images.base[f"sql-{distro.name}"] = tag
    if _has_image(client, tag):
        return tag
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"rootfs-sql-{distro.name}-{base_key(distro)}.tar"
    if not tarball.exists():
        start = time.monotonic()
        _debootstrap(distro, tarball)
        _timed(images, f"debootstrap sql-{distro.name}", start)
    start = time.monotonic()
    _run("docker import", ["docker", "import", str(tarball), tag])
    _timed(images, f"import sql-{distro.name}", start)
    images.built.append(tag)
    return tag


# --------------------------------------------------------------------------- wheels


def python_version(base: str) -> str:
    """The base image's exact Python version: markers such as redis-py's
    ``python_full_version < "3.11.3"`` need the micro version, not just ``3.11``."""
    out = _run(
        "python3 --version",
        ["docker", "run", "--rm", "--network", "none", base, "python3", "-c",
         "import platform; print(platform.python_version())"],
    )  # fmt: skip
    return out.strip().splitlines()[-1]


def wheelhouse(distro: Distro, base: str, images: Images) -> Path:
    """The wheels of :data:`WORKER_REQUIREMENTS` for ``distro``'s Python (downloaded once)."""
    full = python_version(base)
    if not full.startswith(distro.python + "."):
        raise BuildError(f"{base} has Python {full}, expected {distro.python}.x")
    key = _digest(BUILDER_VERSION, full, WORKER_REQUIREMENTS)
    target = cache_dir() / "wheels" / f"{distro.python_tag}-{key}"
    if (target / ".complete").exists():
        return target
    start = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _download(partial, full, distro.python_tag, WORKER_REQUIREMENTS)
    # pip evaluates some markers on the host's interpreter, not the target's (redis-py's
    # ``async-timeout; python_full_version < "3.11.3"`` is left out for bookworm's 3.11.2), so
    # the base image's own pip resolves the wheelhouse offline and names what is missing.
    for _ in range(10):
        missing = _missing_in(base, partial)
        if missing is None:
            break
        _download(partial, full, distro.python_tag, (missing,))
    else:
        raise BuildError(f"the wheelhouse for {base} is still incomplete after 10 rounds")
    (partial / ".complete").write_text("\n".join(WORKER_REQUIREMENTS))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    _timed(images, f"wheels {distro.python_tag}", start)
    return target


def _download(dest: Path, python: str, abi: str, requirements: Sequence[str]) -> None:
    _run(
        f"pip download for Python {python}",
        [
            sys.executable, "-m", "pip", "download", "-q", "--dest", str(dest),
            "--only-binary=:all:", "--python-version", python,
            "--implementation", "cp", "--abi", abi,
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux_2_28_x86_64", "--platform", "linux_x86_64",
            *requirements,
        ],
    )  # fmt: skip


_MISSING = re.compile(r"No matching distribution found for (\S+.*?)\s*$", re.M)


def _missing_in(base: str, wheels: Path) -> str | None:
    """The first requirement the base image's pip cannot satisfy from ``wheels``, or ``None``."""
    script = (
        "python3 -m venv /tmp/venv && /tmp/venv/bin/pip download -q --no-index "
        "--find-links /wheels -d /tmp/resolved " + " ".join(f"'{r}'" for r in WORKER_REQUIREMENTS)
    )
    proc = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "-v", f"{wheels}:/wheels:ro", base,
         "sh", "-c", script],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    if proc.returncode == 0:
        return None
    match = _MISSING.search(proc.stdout)
    if match is None:
        raise BuildError(f"pip in {base} could not resolve the wheelhouse:\n{proc.stdout[-4000:]}")
    return match.group(1).split(";")[0].strip()


def project_wheel(images: Images, root: Path = ROOT) -> Path:
    """This checkout's wheel, built once per source hash (from a copy: the tree stays clean)."""
    target = cache_dir() / "project" / project_key(root)
    wheels = sorted(target.glob("celery_idempotent-*.whl")) if target.is_dir() else []
    if wheels:
        return wheels[0]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="celery-idempotent-src-") as tmp:
        src = Path(tmp) / "src"
        for path in project_files(root):
            dest = src / path.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
        out = Path(tmp) / "out"
        _run(
            "pip wheel (the project)",
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        )
        built = sorted(out.glob("celery_idempotent-*.whl"))
        if not built:
            raise BuildError(f"pip wheel made no celery_idempotent wheel in {out}")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], target / built[0].name)
    _timed(images, "project wheel", start)
    return target / built[0].name


# --------------------------------------------------------------------------- worker images

DOCKERFILE = """\
FROM {base}
COPY wheels /wheels
RUN python3 -m venv /opt/venv \\
 && /opt/venv/bin/pip install -q --no-index --find-links /wheels \\
    /wheels/{project} {requirements} \\
 && rm -rf /wheels /root/.cache
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8
WORKDIR /app
CMD ["celery", "--version"]
"""


def ensure_worker(client: Any, distro: Distro, images: Images, root: Path = ROOT) -> str:
    base = ensure_base(client, distro, images)
    wheels = wheelhouse(distro, base, images)
    project = project_wheel(images, root)
    requirements = " ".join(f"'{req}'" for req in WORKER_REQUIREMENTS)
    dockerfile = DOCKERFILE.format(base=base, project=project.name, requirements=requirements)
    key = _digest(BUILDER_VERSION, dockerfile, wheels.name, project.parent.name)
    tag = f"celery-idempotent/worker-{distro.name}:{key}"
    images.worker[distro.name] = tag
    if _has_image(client, tag):
        return tag
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="celery-idempotent-ctx-") as tmp:
        ctx = Path(tmp)
        (ctx / "wheels").mkdir()
        for wheel in [*wheels.glob("*.whl"), project]:
            shutil.copy2(wheel, ctx / "wheels" / wheel.name)
        (ctx / "Dockerfile").write_text(dockerfile)
        # The classic builder: FROM a local image, nothing pulled (BuildKit would ask a registry).
        _run(
            f"docker build {distro.name}",
            ["docker", "build", "-q", "--pull=false", "--force-rm", "-t", tag, str(ctx)],
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )
    _timed(images, f"worker {distro.name}", start)
    images.built.append(tag)
    return tag


def ensure(distros: Iterable[str] = ("bookworm",), root: Path = ROOT) -> Images:
    """Make (or find) the base and worker images of ``distros``; see the module doc.

    The distributions are built side by side (threads: debootstrap, pip download and docker
    build mostly wait on the network and on dpkg), after the project's wheel they share.
    """
    names = list(dict.fromkeys(distros))
    for name in names:
        if name not in DISTROS:
            raise BuildError(f"unknown distro {name!r}: choose from {sorted(DISTROS)}")
    client = _docker()
    images = Images()
    project_wheel(images, root)

    def one(name: str) -> None:
        start = time.monotonic()
        ensure_worker(client, DISTROS[name], images, root)
        _timed(images, f"total {name}", start)

    with ThreadPoolExecutor(max_workers=len(names) or 1) as pool:
        for future in [pool.submit(one, name) for name in names]:
            future.result()
    return images


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.containers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or find in the cache) the test images")
    build.add_argument(
        "--distro", action="append", choices=sorted(DISTROS), help="default: all of them"
    )
    build.add_argument("--json", action="store_true", help="print tags and timings as JSON")
    build.add_argument(
        "--sql", action="store_true", help="the SQL server images too (the matrix's SQL cells)"
    )
    matrix = sub.add_parser("matrix", help="run the core subset in every Python x server cell")
    matrix.add_argument(
        "--cell",
        action="append",
        help="PYTHON:SERVER, e.g. 3.11:redis-7.0, or sql:SERVER, e.g. sql:mariadb-10.11",
    )
    matrix.add_argument("--report", type=Path, help="write the cells' results there (JSON)")
    args = parser.parse_args(argv)
    if args.command == "matrix":
        from tests.containers import matrix as cells

        chosen = [tuple(cell.split(":", 1)) for cell in args.cell] if args.cell else None
        return cells.main(chosen, args.report)  # type: ignore[arg-type]
    start = time.monotonic()
    images = ensure(args.distro or list(DISTROS))
    if args.sql:
        with ThreadPoolExecutor(max_workers=len(SQL_DISTROS)) as pool:
            names = [name for name in args.distro or SQL_DISTROS if name in SQL_DISTROS]
            for future in [pool.submit(ensure_sql, SQL_DISTROS[name], images) for name in names]:
                future.result()
    images.timings["total"] = round(time.monotonic() - start, 1)
    if args.json:
        print(json.dumps(images.__dict__, indent=2))
    else:
        for name, tag in {**images.base, **images.worker}.items():
            print(f"{name}: {tag}")
        built = ", ".join(images.built) or "nothing (all cached)"
        print(f"built: {built}; {images.timings['total']} s")
    return 0
