"""Run the code examples of the documentation pages; print one JSON report on stdout.

Usage: ``python tests/docs/run_examples.py PAGE.md ...`` with ``DOCS_REDIS_URL`` naming a Redis
server the examples may use (and flush): ``redis://localhost:6379`` in an example is pointed at
it. Run in a process of its own, since examples define Celery apps, tasks and signal receivers.

Per page, in order and in one namespace (as a reader goes down the page):

- a ```` ```python ```` block is executed, unless the line before it is
  ``<!-- example: not run (the reason) -->``;
- a block made only of ``--8<-- "path"`` lines (pymdownx.snippets includes), or right after
  ``<!-- include: path -->`` (a copy of the file, ``docs/_ext/hooks.py``), is not executed
  here: it must name files of a sample project (``SAMPLES``), which the suite runs
  (``tests/plugin`` the plugin's and Django's, ``tests/containers/example`` pytest-celery's);
- ``<!-- example-setup`` ... ``-->`` is executed where it stands, hidden from the reader: what
  a block takes from the reader's own project (an ``app``, a stand-in for a payment gateway).
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The sample projects whose files a page may include (the suite runs them: tests/plugin in
#: their own pytest processes, tests/containers/example on pytest-celery's setups).
SAMPLES = (
    "tests/plugin/sample_project/",
    "tests/plugin/django_project/",
    "tests/containers/example/",
)
FENCE = re.compile(r"^```(\w*)[^\n]*$")
NOT_RUN = re.compile(r"^<!-- example: not run \((.+)\) -->$")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')
INCLUDED = re.compile(r"^<!-- include: (\S+) -->$")


def blocks(text: str) -> list[dict[str, Any]]:
    """The page's setup comments and fenced blocks, in order."""
    lines = text.splitlines()
    found: list[dict[str, Any]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == "<!-- example-setup":
            end = lines.index("-->", i)
            found.append({"kind": "setup", "line": i + 1, "code": "\n".join(lines[i + 1 : end])})
            i = end + 1
            continue
        match = FENCE.match(line)
        if match:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = NOT_RUN.match(before.strip())
            included = INCLUDED.match(before.strip())
            found.append(
                {
                    "kind": "block",
                    "language": match.group(1),
                    "line": i + 1,
                    "code": "\n".join(lines[i + 1 : end]),
                    "not_run": skip.group(1) if skip else None,
                    "include": included.group(1) if included else None,
                }
            )
            i = end + 1
            continue
        i += 1
    return found


def flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def run_page(path: Path, redis_url: str) -> list[dict[str, Any]]:
    flush(redis_url)
    namespace: dict[str, Any] = {"__name__": f"docs_example_{path.stem.replace('-', '_')}"}
    report = []
    for item in blocks(path.read_text(encoding="utf-8")):
        entry = {"page": str(path.relative_to(ROOT)), "line": item["line"]}
        if item["kind"] == "block" and item["language"] != "python":
            continue
        code = item["code"]
        includes = [SNIPPET.match(ln.strip()) for ln in code.splitlines() if ln.strip()]
        if item["kind"] == "block" and (item["include"] or (includes and all(includes))):
            paths = [item["include"]] if item["include"] else [m.group(1) for m in includes if m]
            # "path:section" includes a named section (pymdownx.snippets) of the file.
            files = [p.split(":", 1)[0] for p in paths]
            bad = [p for p in files if not p.startswith(SAMPLES) or not (ROOT / p).is_file()]
            entry.update(status="snippet", paths=paths)
            if bad:
                entry.update(status="error", error=f"not a sample-project file: {bad}")
            report.append(entry)
            continue
        if item["kind"] == "block" and item["not_run"]:
            entry.update(status="not run", reason=item["not_run"])
            report.append(entry)
            continue
        code = code.replace("redis://localhost:6379", redis_url.rsplit("/", 1)[0])
        try:
            exec(compile(code, f"{path.name}:{item['line']}", "exec"), namespace)  # noqa: S102
        except BaseException:
            entry.update(status="error", error=traceback.format_exc(limit=-3))
        else:
            entry.update(status="setup" if item["kind"] == "setup" else "ran")
        report.append(entry)
    return report


def main(pages: list[str]) -> None:
    # An example that warns is wrong (the suite's own filter, setup.cfg's filterwarnings).
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(kombu|celery)\.")
    redis_url = os.environ["DOCS_REDIS_URL"]
    report: list[dict[str, Any]] = []
    for page in pages:
        report += run_page(Path(page).resolve(), redis_url)
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
