"""The end of a run: its figures and checks (the JSON summary), and the report a person reads."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from example_project.demo.console import redact_url
from example_project.demo.load import Published
from example_project.demo.plan import Order

if TYPE_CHECKING:
    from example_project.demo.run import Demo

__all__ = ["inconsistent_results", "render", "summarize"]


def summarize(
    demo: Demo, orders: list[Order], victims: list[Order], refused: int, elapsed: float
) -> dict[str, Any]:
    """The run's figures and checks (the JSON summary) from what the world and workers saw."""
    published = demo.load.published
    client = demo.stage.world.client
    stats = demo.progress.stats()
    effects = {k: int(v) for k, v in client.hgetall(demo.stage.world.key("effects")).items()}
    charges = [json.loads(e) for e in client.lrange(demo.stage.world.key("ledger:charges"), 0, -1)]
    amounts = {o.order_id: o.amount_cents for o in orders}
    wrong_amounts = sum(1 for c in charges if amounts.get(c["order_id"]) != c["amount_cents"])
    expected_keys = {key for key in published.ids_by_key if key != "conflict"}
    expected_keys |= {k for k in published.stopped_results if k != "conflict"}
    inconsistent = inconsistent_results(demo.stage.app, published, expected_keys)
    demo.stage.refresh_pool_pids()
    executions = sum(effects.values())
    doubles = {k: v for k, v in effects.items() if v > 1}
    failures = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("failed:")}
    unexpected = {k: v for k, v in failures.items() if k != "IdempotencyMismatchError"}
    examples = client.hgetall(demo.stage.world.key("failure_examples"))
    retries = stats.get("finished:RETRY", 0)
    summary: dict[str, Any] = {
        "ok": False,
        "orders": len(orders),
        "duplicates_per_message": demo.opts.duplicates,
        "messages_published": published.messages,
        "published_by_task": dict(published.by_task),
        "distinct_task_ids": len(published.all_ids),
        "distinct_keys": len(expected_keys),
        "deliveries": stats.get("deliveries", 0),
        "bodies_started": stats.get("bodies", 0),
        "executions": executions,
        "replays": stats.get("replays", 0),  # absorbed at run time
        "requeued_while_key_held": retries - stats.get("mail_retries", 0),
        "lock_contention": stats.get("contention", 0),
        "mail_retries": stats.get("mail_retries", 0),
        "mismatches_sent": demo.conflicts_sent,
        "stopped_at_publish": published.stopped,
        "stopped_at_publish_by_task": dict(published.stopped_by_task),
        "mismatches_refused": refused,
        "mismatches_refused_at_publish": demo.refused_at_publish,
        "double_executions": len(doubles),
        "extra_executions": sum(v - 1 for v in doubles.values()),
        "doubled_keys": sorted(doubles)[:20],
        "missing_executions": len(expected_keys - set(effects)),
        "inconsistent_results": inconsistent,
        "wrong_amounts_charged": wrong_amounts,
        "unexpected_failures": unexpected,
        "unexpected_failure_examples": {k: examples.get(k) for k in unexpected},
        "lease_lost": stats.get("lease_lost", 0),
        "overlapping_bodies": stats.get("overlaps", 0),
        "killed_messages_acked": demo.progress.acked_after_kill,
        "chaos": {
            "enabled": demo.opts.chaos,
            "kills_requested": len(victims),
            "killed": demo.chaos.kills,
            "error": demo.chaos.error,
        },
        "elapsed_seconds": round(elapsed, 2),
        "namespace": demo.namespace,
        "settings": {
            "idempotency_enabled": not demo.opts.without_idempotency,
            "workers": demo.opts.workers,
            "pool": demo.opts.pool,
            "concurrency": demo.opts.concurrency,
            "idempotency_lock_ttl": demo.opts.lock_ttl,
            "latency": demo.opts.latency,
            "broker": redact_url(demo.stage.urls["broker"]),
            "redis": demo.stage.redis_info,
        },
    }
    checks = {
        "no double execution": not doubles,
        "never two bodies of one key at once": not stats.get("overlaps", 0),
        "one execution per key": executions == len(expected_keys)
        and not summary["missing_executions"],
        "every conflict refused": refused == summary["mismatches_sent"],
        "duplicates got the first result": inconsistent == 0,
        "no wrong amount charged": wrong_amounts == 0,
        "no unexpected failure": not unexpected,
        "chaos kills done": len(demo.chaos.kills) == len(victims) and demo.chaos.error is None,
    }
    summary["checks"] = checks
    summary["ok"] = all(checks.values())
    return summary


def inconsistent_results(app: Any, published: Published, keys: set[str]) -> int:
    """Keys whose task ids did not all return the same result (a replay must be identical)."""
    from celery.result import AsyncResult, ResultSet

    ids = sorted({i for k in keys for i in published.ids_by_key[k]})
    results = ResultSet([AsyncResult(i, app=app) for i in ids], app=app)
    values = dict(zip(ids, results.join_native(timeout=60, propagate=False)))
    bad = 0
    for key in keys:
        seen = {
            json.dumps(values[i], sort_keys=True, default=repr) for i in published.ids_by_key[key]
        }
        # A call stopped at publish got the first call's result object: the same value.
        for result in published.stopped_results.get(key, ()):
            value = result.get(timeout=60, propagate=False)
            seen.add(json.dumps(value, sort_keys=True, default=repr))
        bad += len(seen) != 1
    return bad


def render(summary: dict[str, Any], cleanup: dict[str, Any]) -> str:
    s = summary
    chaos = s["chaos"]
    by_task = ", ".join(f"{k} {v}" for k, v in sorted(s["published_by_task"].items()))
    row = "  {:<28}{}".format
    lines = [
        "",
        "celery-idempotent example shop: report",
        "=" * 72,
        row(
            "IdempotentTask",
            "on" if s["settings"]["idempotency_enabled"] else "OFF (--without-idempotency)",
        ),
        row("orders", f"{s['orders']} ({s['duplicates_per_message']} copies of every message)"),
        row("messages published", f"{s['messages_published']} ({by_task})"),
        row(
            "stopped at publish",
            f"{s['stopped_at_publish']} duplicates (no message: key queued, running or done)",
        ),
        row("deliveries run by workers", f"{s['deliveries']} (with requeues and redeliveries)"),
        row("distinct keys", s["distinct_keys"]),
        row("executions (side effects)", s["executions"]),
        row("replays at run time", f"{s['replays']} (re-sent task ids, redeliveries)"),
        row(
            "requeued while key held",
            f"{s['requeued_while_key_held']} (lock contention events: {s['lock_contention']})",
        ),
        row("retries (mail server down)", s["mail_retries"]),
        row("mismatches refused", f"{s['mismatches_refused']} of {s['mismatches_sent']} sent"),
    ]
    if chaos["enabled"]:
        lines.append(
            row(
                "pool processes SIGKILLed",
                f"{len(chaos['killed'])} of {chaos['kills_requested']} "
                "(mid-charge; requeued, charged once after the lease expired)",
            )
        )
        if chaos["error"]:
            lines.append(row("chaos error", chaos["error"]))
        if s["killed_messages_acked"]:
            lines.append(
                row("killed, acked by Celery", f"{s['killed_messages_acked']} (already succeeded)")
            )
    inconsistent = s["inconsistent_results"]
    doubles = s["double_executions"]
    lines += [
        row("results consistent", "yes" if not inconsistent else f"NO: {inconsistent} keys differ"),
        row(
            "double executions",
            f"{doubles}  <-- e.g. {', '.join(s['doubled_keys'][:3])}" if doubles else 0,
        ),
        row("two bodies of a key at once", s["overlapping_bodies"]),
        row(
            "elapsed",
            f"{s['elapsed_seconds']:.1f} s (wall {s['wall_seconds']:.1f} s with start and stop)",
        ),
    ]
    if s["unexpected_failures"]:
        lines.append(row("unexpected failures", s["unexpected_failures"]))
        for name, example in s["unexpected_failure_examples"].items():
            lines.append(row(f"  e.g. {name}", example))
    lines.append(
        row(
            "processes left running",
            f"{len(cleanup['left_running'])}; temp dir removed: "
            f"{'yes' if cleanup['workdir_removed'] else 'NO'}",
        )
    )
    failed = [name for name, good in s["checks"].items() if not good]
    lines.append("-" * 72)
    lines.append("  OK: every order, charge, email and shipment happened exactly once."
                 if s["ok"] else f"  FAILED: {', '.join(failed)}")  # fmt: skip
    return "\n".join(lines)
