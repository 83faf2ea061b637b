"""Run every benchmark against one Redis, print the table and the targets, write JSON.

``python -m benchmarks`` (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LATEST = HERE / "results" / "latest.json"
QUICK = HERE / "results" / "quick.json"

#: The cases of the per-call table, in the order printed.
CASES = (
    "ping",
    "evalsha_floor",
    "guard_first",
    "guard_duplicate",
    "scripts_first",
    "scripts_duplicate",
    "guard_python_first",
    "guard_python_duplicate",
    "powertools_first",
    "powertools_duplicate",
    "naive_first",
    "naive_duplicate",
    "celery_once",
    "redis_py_lock",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="celery-idempotent against the alternatives, on one Redis.",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="Redis to use (default: $REDIS_URL, else a private redis-server is started). "
        "Keys are namespaced per run and deleted afterwards; nothing else is touched.",
    )
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    p.add_argument("--calls", type=int, default=200, help="calls per case per round (200)")
    p.add_argument("--e2e-rounds", type=int, default=8, help="end-to-end rounds (default 8)")
    p.add_argument("--e2e-tasks", type=int, default=300, help="tasks per end-to-end block (300)")
    p.add_argument("--pool", default="prefork", help="worker pool (default prefork)")
    p.add_argument("--concurrency", type=int, default=2, help="worker concurrency (default 2)")
    p.add_argument("--memory-keys", type=int, default=1_000_000, help="memory store keys (1M)")
    p.add_argument("--skip-e2e", action="store_true", help="no worker")
    p.add_argument(
        "--e2e-load",
        type=int,
        default=os.cpu_count() or 2,
        metavar="N",
        help="CPU-bound neighbours of the loaded end-to-end variant (default: one per core)",
    )
    p.add_argument("--skip-e2e-loaded", action="store_true", help="the end-to-end case quiet only")
    p.add_argument("--skip-memory", action="store_true", help="no memory-store run")
    p.add_argument(
        "--redis-memory-keys",
        type=int,
        default=20_000,
        help="completed keys per library for keys/bytes per key in Redis (20k)",
    )
    p.add_argument("--skip-redis-memory", action="store_true", help="no Redis memory run")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few iterations only, no worker, 20k memory keys: checks that it works; "
        "writes results/quick.json unless --output is given",
    )
    p.add_argument(
        "--output", type=Path, help=f"JSON file (default {LATEST.relative_to(HERE.parent)})"
    )
    p.add_argument(
        "--profile",
        metavar="CASE",
        choices=CASES,
        help="instead of the run: profile one per-call case with pyinstrument and print it",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.calls = min(args.calls, 20)
        args.memory_keys = min(args.memory_keys, 20_000)
        args.redis_memory_keys = min(args.redis_memory_keys, 2_000)
        args.skip_e2e = True
    if args.output is None:
        args.output = QUICK if args.quick else LATEST
    return args


# -- the machine ------------------------------------------------------------------------------


def machine(client: Any) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for dist in (
        "celery",
        "kombu",
        "redis",
        "aws-lambda-powertools",
        "celery-once",
        "celery-idempotent",
    ):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    info = client.info("server")
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:  # pragma: no cover - older redis-py
        HIREDIS_AVAILABLE = False
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "redis_server": info.get("redis_version"),
        "reply_parser": "hiredis" if HIREDIS_AVAILABLE else "python",
        "packages": versions,
        "loadavg_start": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -- targets ----------------------------------------------------------------------------------


def targets(
    micro: dict[str, Any] | None,
    e2e: dict[str, Any] | None,
    memory: dict[str, Any] | None = None,
    publish: dict[str, Any] | None = None,
    e2e_loaded: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(
        name: str, value: float, limit: float, unit: str, how: str, *, at_most: bool = True
    ) -> None:
        ok = value <= limit if at_most else value >= limit
        out.append(
            {
                "target": name,
                "value": round(value, 3),
                "op": "≤" if at_most else "≥",
                "limit": limit,
                "unit": unit,
                "how": how,
                "pass": ok,
            }
        )

    if micro:
        g1, gd = micro["guard_first"], micro["guard_duplicate"]
        p1, pd = micro["powertools_first"], micro["powertools_duplicate"]
        ping = micro["ping"]["p50_us"]
        floor = micro.get("evalsha_floor", {}).get("server_us")
        add("round trips, first execution", g1["round_trips"], 2, "", "counted at the client")
        add("round trips, duplicate", gd["round_trips"], 1, "", "counted at the client")
        for label, ours, theirs, limit in (
            ("first execution vs Powertools first call", g1, p1, 0.9),
            ("duplicate vs Powertools duplicate", gd, pd, 0.5),
        ):
            if "skipped" in theirs:
                out.append({"target": label, "pass": None, "how": theirs["skipped"]})
                continue
            add(
                label,
                ours["p50_us"] / theirs["p50_us"],
                limit,
                "×",
                f"p50 {ours['p50_us']} / {theirs['p50_us']} µs",
            )
        for label, ours, theirs, limit, scripts in (
            ("Redis server time, first execution vs Powertools first", g1, p1, 3.0, 2),
            ("Redis server time, duplicate vs Powertools duplicate", gd, pd, 1.5, 1),
        ):
            if "skipped" in theirs:
                out.append({"target": label, "pass": None, "how": theirs["skipped"]})
                continue
            where = (
                f"; of ours, {scripts} × EVALSHA of a no-op = {scripts * floor:.1f} µs"
                if floor is not None
                else ""
            )
            add(
                label,
                ours["server_us"] / max(theirs["server_us"], 0.1),
                limit,
                "×",
                f"{ours['server_us']} / {theirs['server_us']} µs per call (INFO commandstats)"
                f"{where}",
            )
        for label, case, py, limit in (
            ("first execution", g1, micro.get("guard_python_first"), 60),
            ("duplicate", gd, micro.get("guard_python_duplicate"), 30),
        ):
            rt = case["round_trips"]
            ours = f"; of it our Python {py['p50_us']} µs" if py and "p50_us" in py else ""
            add(
                f"client CPU per guarded call, {label}",
                case["p50_us"] - rt * ping,
                limit,
                "µs",
                f"p50 {case['p50_us']} − {rt:g} × PING p50 {ping} µs{ours}",
            )
    if memory:
        ours = memory["celery_idempotent"]
        add(
            "Redis keys per completed key",
            ours["redis_keys_per_key"],
            1,
            "",
            f"DBSIZE delta over {ours['keys']:,} keys",
        )
        theirs = memory.get("powertools", {})
        if "bytes_per_key" in theirs:
            add(
                "bytes per completed key vs Powertools",
                ours["bytes_per_key"] / theirs["bytes_per_key"],
                1.0,
                "×",
                f"{ours['bytes_per_key']} / {theirs['bytes_per_key']} bytes (INFO memory "
                f"used_memory delta over {ours['keys']:,} keys each)",
            )
    if publish:
        add(
            "round trips of the publish-side check",
            publish["idempotency_round_trips_per_publish"],
            1,
            "",
            "counted at the idempotency client, per apply_async",
        )
        add(
            "publish throughput with the check vs plain apply_async",
            publish["ratio"],
            0.8,
            "×",
            f"{publish['idempotent_per_s']:,} / {publish['plain_per_s']:,} publishes/s "
            f"(median of {publish.get('rounds', '?')} per-round ratios "
            f"{publish.get('ratio_median_of_rounds', '?')})",
            at_most=False,
        )
    for run, where in ((e2e, ""), (e2e_loaded, ", loaded")):
        if not run or "tasks_per_second" not in run:
            continue
        tps = run["tasks_per_second"]
        load = f"; {run['neighbours']} CPU-bound neighbours" if run.get("neighbours") else ""
        # The server's CPU per task: from the quiet run (the neighbours do not change it).
        cpu = None if where else run.get("redis_cpu_us_per_task")
        for label, kind, short in (
            ("first executions", "idempotent_first", "first"),
            ("duplicates", "idempotent_duplicate", "duplicate"),
        ):
            if cpu:  # result files from before this figure have none
                add(
                    f"Redis server CPU per task, {label} vs plain (broker, backend, store on it)",
                    run[f"redis_cpu_ratio_{short}"],
                    1.15,
                    "×",
                    f"{cpu[kind]:.1f} / {cpu['plain']:.1f} µs per task (INFO cpu), all rounds "
                    f"together; median of per-round ratios "
                    f"{run[f'redis_cpu_ratio_{short}_median_of_rounds']:.2f}",
                )
            add(
                f"end-to-end throughput{where}, {label} vs plain",
                run[f"ratio_{short}_median_of_rounds"],
                0.98,
                "×",
                f"median of {run['rounds']} per-round ratios; all rounds together "
                f"{tps[kind]:.0f} / {tps['plain']:.0f} tasks/s = {tps[kind] / tps['plain']:.2f}"
                f"{load}",
                at_most=False,
            )
    return out


# -- printing ---------------------------------------------------------------------------------


def _render_publish(pub: dict[str, Any]) -> list[str]:
    if "two_step_per_s" not in pub:  # a result file from before the two-step kind
        return [
            f"Publish throughput ({pub['publishes_per_kind']:,} apply_async per kind): plain "
            f"{pub['plain_per_s']:,}/s, with the check {pub['idempotent_per_s']:,}/s "
            f"({pub['ratio']:.2f}×)."
        ]
    requests = pub["redis_requests_per_publish"]
    commands = pub["commands_of_one_publish"]
    rows = [
        ("plain `apply_async`", "plain", pub["plain_per_s"], pub["plain_us"], 1.0, 1.0),
        (
            "IdempotentTask, store on the broker's Redis (check + push: one script)",
            "checked",
            pub["idempotent_per_s"],
            pub["idempotent_us"],
            pub["ratio"],
            pub["ratio_median_of_rounds"],
        ),
        (
            "IdempotentTask, store on another database (check, then kombu's push)",
            "two_step",
            pub["two_step_per_s"],
            pub["two_step_us"],
            pub["ratio_two_step"],
            pub["ratio_two_step_median_of_rounds"],
        ),
    ]
    if "duplicate_per_s" in pub:
        rows.append(
            (
                "IdempotentTask, a duplicate stopped at publish (no message)",
                "duplicate",
                pub["duplicate_per_s"],
                pub["duplicate_us"],
                pub["ratio_duplicate"],
                pub["ratio_duplicate_median_of_rounds"],
            )
        )
    lines = [
        f"Publish throughput ({pub['rounds']} rounds × {pub['calls']} apply_async per kind, "
        "interleaved, to a queue no worker consumes):",
        "",
        "| publish | per s | µs per call | vs plain | vs plain, median of rounds "
        "| Redis requests per publish |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, kind, per_s, us, ratio, median in rows:
        lines.append(
            f"| {label} | {per_s:,} | {us:.0f} | {ratio:.2f} | {median:.2f} "
            f"| {requests[kind]:g}: {' '.join(commands[kind])} |"
        )
    lines.append("")
    lines.append(
        f"The check: {pub['idempotency_round_trips_per_publish']:g} round trip at the "
        "idempotency client per checked publish. Requests: every client of the process (the "
        "broker's, ours), not the result backend's pub/sub (alike for every kind)."
    )
    return lines


def render(result: dict[str, Any]) -> str:
    lines: list[str] = []
    m = result["machine"]
    lines.append(
        f"machine: {m['cpu']}, {m['cores']} cores, {m['implementation']} {m['python']}, "
        f"Redis {m['redis_server']}, redis-py {m['packages']['redis']} "
        f"({m['reply_parser']} reply parser), "
        f"celery {m['packages']['celery']}; load average {m['loadavg_start']} -> "
        f"{result.get('loadavg_end')}"
    )
    micro = result.get("per_call")
    if micro:
        cfg = result["config"]
        lines.append("")
        lines.append(
            f"Per call, one Redis on loopback ({cfg['rounds']} rounds × {cfg['calls']} calls per "
            "case, interleaved):"
        )
        lines.append("")
        lines.append(
            "| case | round trips | p50 µs | p99 µs | client CPU µs | server µs | commands |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---|")
        for name in CASES:
            c = micro.get(name)
            if c is None:
                continue
            if "skipped" in c:
                lines.append(f"| {name}: skipped, {c['skipped']} | | | | | | |")
                continue
            lines.append(
                f"| {c['label']} | {c['round_trips']:g} | {c['p50_us']:.0f} | {c['p99_us']:.0f} "
                f"| {c['client_cpu_us']:.0f} | {c['server_us']:.1f} | {' '.join(c['commands'])} |"
            )
        lines.append("")
        lines.append(
            "client CPU: this process's CPU time per call (mean; on loopback the kernel's TCP work "
            "lands here too); server: Redis's own time per call (INFO commandstats)."
        )
    for e2e, where in (
        (result.get("end_to_end"), ""),
        (result.get("end_to_end_loaded"), "loaded, "),
    ):
        if not e2e:
            continue
        lines.append("")
        if "skipped" in e2e:
            lines.append(f"End to end: skipped ({e2e['skipped']})")
        else:
            tps = e2e["tasks_per_second"]
            load = (
                f", {e2e['neighbours']} CPU-bound neighbour processes running"
                if e2e.get("neighbours")
                else ""
            )
            lines.append(
                f"End to end, {where}no-op task through a real worker (-P {e2e['pool']} "
                f"-c {e2e['concurrency']}, {e2e['rounds']} rounds × {e2e['tasks_per_block']} tasks "
                f"per kind, group publish then get{load}):"
            )
            lines.append("")
            lines.append("| task | tasks/s | vs plain | vs plain, median of rounds |")
            lines.append("|---|---:|---:|---:|")
            medians = {
                "plain": 1.0,
                "idempotent_first": e2e["ratio_first_median_of_rounds"],
                "idempotent_duplicate": e2e["ratio_duplicate_median_of_rounds"],
            }
            for kind, label in (
                ("plain", "@app.task"),
                ("idempotent_first", "base=IdempotentTask, first executions"),
                ("idempotent_duplicate", "base=IdempotentTask, duplicates"),
            ):
                lines.append(
                    f"| {label} | {tps[kind]:.0f} | {tps[kind] / tps['plain']:.2f} "
                    f"| {medians[kind]:.2f} |"
                )
            cpu = e2e.get("redis_cpu_us_per_task")
            if cpu:
                lines.append("")
                lines.append(
                    "Redis server CPU per task (INFO cpu, user + system; the one Redis is "
                    "broker, result backend and store):"
                )
                lines.append("")
                lines.append("| task | Redis CPU µs/task | vs plain | vs plain, median of rounds |")
                lines.append("|---|---:|---:|---:|")
                ratios = {
                    "plain": (1.0, 1.0),
                    "idempotent_first": (
                        e2e["redis_cpu_ratio_first"],
                        e2e["redis_cpu_ratio_first_median_of_rounds"],
                    ),
                    "idempotent_duplicate": (
                        e2e["redis_cpu_ratio_duplicate"],
                        e2e["redis_cpu_ratio_duplicate_median_of_rounds"],
                    ),
                }
                for kind, label in (
                    ("plain", "@app.task"),
                    ("idempotent_first", "base=IdempotentTask, first executions"),
                    ("idempotent_duplicate", "base=IdempotentTask, duplicates"),
                ):
                    lines.append(
                        f"| {label} | {cpu[kind]:.1f} | {ratios[kind][0]:.2f} "
                        f"| {ratios[kind][1]:.2f} |"
                    )
                by_command = e2e.get("redis_commands_per_task")
                if by_command:
                    lines.append("")
                    lines.append(
                        "Where it goes, per task: the library's scripts (EVALSHA, INFO "
                        "commandstats: their execution, the commands they call included) and "
                        "everything else (Celery's broker and result commands, and reading, "
                        "parsing and answering every round trip). Top commands: calls × µs "
                        "(a command run inside a script or MULTI is also counted on its own)."
                    )
                    lines.append("")
                    lines.append("| task | CPU µs | EVALSHA calls | EVALSHA µs | rest µs | top |")
                    lines.append("|---|---:|---:|---:|---:|---|")
                    for kind in ("plain", "idempotent_first", "idempotent_duplicate"):
                        stats = by_command[kind]
                        script = stats.get("evalsha", {"calls": 0, "us": 0.0})
                        top = ", ".join(
                            f"{name} {v['calls']:g}×{v['us'] / v['calls']:.1f}"
                            for name, v in list(stats.items())[:5]
                        )
                        lines.append(
                            f"| {kind} | {cpu[kind]:.1f} | {script['calls']:g} "
                            f"| {script['us']:.1f} | {cpu[kind] - script['us']:.1f} | {top} |"
                        )
    mem = result.get("memory_store")
    if mem:
        lines.append("")
        lines.append(
            f"Memory store, {mem['keys']:,} distinct keys, TTL {mem['ttl_s']:g} s on a fake clock "
            f"advancing {mem['clock_step_s']:g} s per key: set {mem['set_ops_per_s']:,}/s, "
            f"get {mem['get_ops_per_s']:,}/s, RSS +{mem['rss_delta_mib']} MiB with "
            f"{mem['live_records_after']:,} records alive (peak {mem['peak_live_records']:,}); "
            f"{mem['bytes_per_live_record']} bytes per live record."
        )
    pub = result.get("publish")
    if pub:
        lines.append("")
        lines.extend(_render_publish(pub))
    costs = result.get("server_costs")
    if costs:
        lua, plain, ours = costs["lua"], costs["plain"], costs["scripts"]
        floor = lua["noop"]["us"]
        lines.append("")
        lines.append(
            f"Redis server time step by step ({costs['calls']:,} calls each, INFO commandstats; "
            "a script's row minus the no-op script's is what its commands cost inside Lua):"
        )
        lines.append("")
        lines.append("| probe | server µs per call | inside Lua |")
        lines.append("|---|---:|---:|")
        for name, probe in lua.items():
            extra = "" if name == "noop" else f"{probe['us'] - floor:.2f}"
            lines.append(f"| script: {probe['label']} | {probe['us']:.2f} | {extra} |")
        lines.append(f"| plain SET PX of a new key | {plain['set_px_new']:.2f} | |")
        lines.append(f"| plain GET of a missing key | {plain['get_missing']:.2f} | |")
        lines.append(f"| our CLAIM, first execution | {ours['claim_first']:.2f} | |")
        lines.append(f"| our COMMIT | {ours['commit']:.2f} | |")
        lines.append(f"| our CLAIM, duplicate | {ours['claim_duplicate']:.2f} | |")
    rmem = result.get("redis_memory")
    if rmem:
        lines.append("")
        lines.append(
            f"Completed keys in Redis ({rmem['celery_idempotent']['keys']:,} per library, the "
            "per-call payload and result; INFO memory and DBSIZE deltas; projection: "
            f"{rmem['keys_per_day']:,} keys a day):"
        )
        lines.append("")
        lines.append(
            "| library | Redis keys per key | bytes per key | record TTL | steady state, "
            "default TTL | steady state, 1-day TTL |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|")
        for name, label in (
            ("celery_idempotent", "celery-idempotent"),
            ("powertools", "Powertools"),
        ):
            m = rmem.get(name, {})
            if "bytes_per_key" not in m:
                lines.append(f"| {label}: skipped, {m.get('skipped')} | | | | | |")
                continue
            lines.append(
                f"| {label} | {m['redis_keys_per_key']:g} | {m['bytes_per_key']:.0f} "
                f"| {m['ttl_s']:,} s | {m['projected_gb_default_ttl']:.3f} GB "
                f"| {m['projected_gb_1_day_ttl']:.3f} GB |"
            )
    lines.append("")
    lines.append("Targets (ratios from this run):")
    lines.append("")
    for t in result["targets"]:
        if t["pass"] is None:
            lines.append(f"  n/a   {t['target']}: {t['how']}")
            continue
        verdict = "PASS" if t["pass"] else "MISS"
        value = f"{t['value']:g}{t['unit']}" if t["unit"] != "µs" else f"{t['value']:.0f} µs"
        limit = f"{t['limit']:g}{t['unit']}" if t["unit"] != "µs" else f"{t['limit']:g} µs"
        lines.append(f"  {verdict}  {t['target']}: {value} ({t['op']} {limit}; {t['how']})")
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------


def _delete_prefix(client: Any, prefix: str) -> None:
    """This run's keys go at the end, as the tests' do (SCAN by the escaped prefix, UNLINK)."""
    from tests.support.keys import delete_keys_with_prefix

    delete_keys_with_prefix(client, prefix, count=1000)


def _memory(keys: int) -> dict[str, Any]:
    # A TTL of 60 fake seconds and a clock step that keeps at most 60,000 records alive, or a
    # quarter of the keys for a short run: either way most records must be swept.
    step = max(0.001, 60.0 / (keys / 4))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--keys", str(keys), "--step", str(step)],
        cwd=str(HERE.parent),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def _profile(client: Any, prefix: str, case_name: str) -> None:
    from pyinstrument import Profiler

    from benchmarks import micro

    cases = {c.name: c for c in micro.build_cases(client, prefix)[0]}
    call = cases[case_name].call
    for i in range(10**6, 10**6 + 300):
        call(i)
    profiler = Profiler(interval=0.0001)
    profiler.start()
    for i in range(3000):
        call(i)
    profiler.stop()
    print(profiler.output_text(unicode=True, color=False))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from benchmarks._counting import counting_client
    from celery_idempotent.servers.redis_server import start_private_redis

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if not url:
            url = stack.enter_context(start_private_redis()).url()
        client = counting_client(url)
        stack.callback(client.close)
        prefix = f"cibench:{secrets.token_hex(4)}:"
        stack.callback(_delete_prefix, client, prefix)
        if args.profile:
            _profile(client, prefix, args.profile)
            return 0
        result: dict[str, Any] = {
            "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(
                ["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])]
            ),
            "machine": machine(client),
            "config": {
                "rounds": args.rounds,
                "calls": args.calls,
                "redis": "private" if not args.redis_url else "given",
            },
        }
        from benchmarks import micro

        print(f"per-call cases: {args.rounds} rounds × {args.calls} calls ...", file=sys.stderr)
        result["per_call"] = micro.run(client, prefix, rounds=args.rounds, calls=args.calls)
        if not args.skip_redis_memory:
            from benchmarks import redis_memory

            print(
                f"Redis memory: {args.redis_memory_keys:,} completed keys each ...",
                file=sys.stderr,
            )
            result["redis_memory"] = redis_memory.run(
                client,
                prefix,
                n=args.redis_memory_keys,
                # A private server: one empty database per library, so both grow their tables
                # alike. A given server: its database, shared (see redis_memory.run).
                databases=(1, 2) if not args.redis_url else None,
            )
            result["redis_memory"]["key_examples"] = redis_memory.key_examples(prefix)
        from benchmarks import publish

        print("publish throughput ...", file=sys.stderr)
        result["publish"] = publish.run(
            url, prefix, rounds=2 if args.quick else 10, calls=20 if args.quick else 200
        )
        from benchmarks import server_costs

        print("Redis server time, step by step ...", file=sys.stderr)
        result["server_costs"] = server_costs.run(client, prefix, n=500 if args.quick else 5000)
        if not args.skip_e2e:
            from benchmarks import e2e

            print(
                f"end to end: {args.e2e_rounds} rounds × {args.e2e_tasks} tasks ...",
                file=sys.stderr,
            )
            result["end_to_end"] = e2e.run(
                url,
                prefix,
                rounds=args.e2e_rounds,
                tasks=args.e2e_tasks,
                pool=args.pool,
                concurrency=args.concurrency,
            )
            if not args.skip_e2e_loaded and args.e2e_load > 0:
                print(
                    f"end to end, loaded ({args.e2e_load} CPU-bound neighbours) ...",
                    file=sys.stderr,
                )
                result["end_to_end_loaded"] = e2e.run(
                    url,
                    prefix,
                    rounds=args.e2e_rounds,
                    tasks=args.e2e_tasks,
                    pool=args.pool,
                    concurrency=args.concurrency,
                    load=args.e2e_load,
                )
        if not args.skip_memory:
            print(f"memory store: {args.memory_keys:,} keys ...", file=sys.stderr)
            result["memory_store"] = _memory(args.memory_keys)
        result["loadavg_end"] = _loadavg()
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["targets"] = targets(
            result.get("per_call"),
            result.get("end_to_end"),
            result.get("redis_memory"),
            result.get("publish"),
            result.get("end_to_end_loaded"),
        )

    print(render(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"\nwritten: {args.output} ({result['seconds']} s)", file=sys.stderr)
    return 0
