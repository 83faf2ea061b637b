"""Publish throughput: ``apply_async`` of an ``IdempotentTask`` (publish-side check on) against
the same call of a plain task, to a Redis broker queue that no worker consumes.

Three kinds, each call with distinct arguments (every publish is a first one: the check sets a
queued marker and the message is published):

- ``plain``: ``@app.task``;
- ``checked``: ``base=IdempotentTask``, the idempotency store on the broker's Redis and
  database: the check and kombu's push travel as one script (one round trip, as plain);
- ``two_step``: the same task with its store on another database of the same server: the
  check (one round trip), then kombu's own push (another), as with a broker on another Redis;
- ``duplicate``: the ``checked`` task called again and again with the same arguments: every
  publish but the first is a duplicate the check stops (one script, no message).

Blocks of ``calls`` publishes take turns, the order rotated every round. Reported: publishes
per second of each kind over all rounds, the ratio to plain over all rounds and as the median
of the per-round ratios, the round trips counted at the idempotency client per checked
publish, and every request this process sent to Redis per publish (all clients: the broker's
and ours; not the result backend's pub/sub, see :class:`_Requests`) with the commands of one
publish of each kind.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery

from benchmarks._counting import Counter, counting_client

KINDS = ("plain", "checked", "two_step", "duplicate")


class _Requests:
    """Every request any redis-py connection of this process writes, but those sent with
    ``check_health=False``: handshakes, health-check PINGs, and the pub/sub commands of a
    connection already subscribed (Celery's result backend (UN)SUBSCRIBEs each task id
    without waiting for a reply, alike for every kind)."""

    sends = 0
    names: list[str] | None = None


@contextmanager
def _all_requests() -> Iterator[None]:
    base = redis.connection.AbstractConnection
    original = base.send_packed_command

    def send_packed_command(self: Any, command: Any, check_health: bool = True) -> Any:
        if not check_health:  # a handshake, a health-check PING, pub/sub
            return original(self, command, check_health)
        _Requests.sends += 1
        if _Requests.names is not None:
            first = command if isinstance(command, (bytes, bytearray)) else command[0]
            parts = bytes(first[:64]).split(b"\r\n")
            _Requests.names.append(parts[2].decode().upper() if len(parts) > 2 else "?")
        return original(self, command, check_health)

    base.send_packed_command = send_packed_command  # type: ignore[method-assign]
    try:
        yield
    finally:
        base.send_packed_command = original  # type: ignore[method-assign]


def _app(url: str, prefix: str, name: str, idem: redis.Redis, queue: str) -> Celery:
    app = Celery(name, broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_serializer="json",
        broker_connection_retry_on_startup=True,
        broker_transport_options={"global_keyprefix": f"{prefix}kombu:"},
        idempotency_client=idem,
        idempotency_key_prefix=f"{prefix}pub:",
        idempotency_publish_ttl=600,
    )
    return app


def _other_database(url: str) -> str:
    """``url`` with the database number changed (0 <-> 1, 2 <-> 3, ...)."""
    db = int(redis.Redis.from_url(url).connection_pool.connection_kwargs.get("db") or 0)
    base, _, query = url.partition("?")
    head, slash, tail = base.rpartition("/")
    if slash and head.count("/") >= 2 and (tail == "" or tail.isdigit()):
        base = f"{head}/{db ^ 1}"
    else:
        base = f"{base.rstrip('/')}/{db ^ 1}"
    return f"{base}?{query}" if query else base


def run(url: str, prefix: str, *, rounds: int, calls: int) -> dict[str, Any]:
    """Publishes per second of each kind, their ratios, and round trips per publish."""
    from celery_idempotent import IdempotentTask
    from celery_idempotent.celery.factory import reset_backends

    queue = f"{prefix}publish"
    idem = counting_client(url)
    other_url = _other_database(url)
    idem_other = counting_client(other_url)
    app = _app(url, prefix, "cibench_publish", idem, queue)
    app_other = _app(url, prefix, "cibench_publish_other", idem_other, queue)

    @app.task(name="cibench.publish.plain", shared=False)
    def plain(i: int, tag: str) -> int:
        return i

    @app.task(name="cibench.publish.idempotent", base=IdempotentTask, shared=False)
    def checked(i: int, tag: str) -> int:
        return i

    @app_other.task(name="cibench.publish.idempotent", base=IdempotentTask, shared=False)
    def two_step(i: int, tag: str) -> int:
        return i

    reset_backends()
    tasks = {"plain": plain, "checked": checked, "two_step": two_step, "duplicate": checked}
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    idem_trips = dict.fromkeys(KINDS, 0)
    requests = dict.fromkeys(KINDS, 0)
    commands: dict[str, list[str]] = {}
    counter = 0
    try:
        with _all_requests():
            for warm in range(50):
                for task in tasks.values():
                    task.apply_async((warm, "warm"))
            checked.apply_async((0, "duplicate"))  # the first: published, then stopped
            for kind, task in tasks.items():  # one publish each, traced
                _Requests.names = []
                counter += 1
                task.apply_async(_call(kind, counter, "trace"))
                commands[kind] = _Requests.names
                _Requests.names = None
            fused = {
                kind: _fuses(app_of, tasks[kind])
                for kind, app_of in (("checked", app), ("two_step", app_other))
            }
            for r in range(rounds):
                order = list(KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)])
                for kind in order:
                    task = tasks[kind]
                    before, sent = Counter.sends, _Requests.sends
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        counter += 1
                        task.apply_async(_call(kind, counter, "run"))
                    seconds[kind].append(time.perf_counter() - t0)
                    idem_trips[kind] += Counter.sends - before
                    requests[kind] += _Requests.sends - sent
    finally:
        reset_backends()
        app.close()
        app_other.close()
        _delete(idem_other, prefix)
        idem.close()
        idem_other.close()
    n = rounds * calls
    total = {kind: sum(seconds[kind]) for kind in KINDS}
    per_round = {kind: [p / c for p, c in zip(seconds["plain"], seconds[kind])] for kind in KINDS}
    return {
        "publishes_per_kind": n,
        "rounds": rounds,
        "calls": calls,
        "plain_per_s": round(n / total["plain"]),
        "idempotent_per_s": round(n / total["checked"]),
        "two_step_per_s": round(n / total["two_step"]),
        "plain_us": round(total["plain"] / n * 1e6, 1),
        "idempotent_us": round(total["checked"] / n * 1e6, 1),
        "two_step_us": round(total["two_step"] / n * 1e6, 1),
        "ratio": round(total["plain"] / total["checked"], 3),
        "ratio_median_of_rounds": round(statistics.median(per_round["checked"]), 3),
        "ratio_two_step": round(total["plain"] / total["two_step"], 3),
        "ratio_two_step_median_of_rounds": round(statistics.median(per_round["two_step"]), 3),
        "duplicate_per_s": round(n / total["duplicate"]),
        "duplicate_us": round(total["duplicate"] / n * 1e6, 1),
        "ratio_duplicate": round(total["plain"] / total["duplicate"], 3),
        "ratio_duplicate_median_of_rounds": round(statistics.median(per_round["duplicate"]), 3),
        "idempotency_round_trips_per_publish": idem_trips["checked"] / n,
        "idempotency_round_trips_per_publish_two_step": idem_trips["two_step"] / n,
        "redis_requests_per_publish": {kind: requests[kind] / n for kind in KINDS},
        "commands_of_one_publish": commands,
        "fused": fused,
    }


def _call(kind: str, counter: int, tag: str) -> tuple[int, str]:
    """The arguments of one publish: distinct each time, but for ``duplicate``'s (stopped)."""
    return (0, "duplicate") if kind == "duplicate" else (counter, tag)


def _fuses(app: Celery, task: Any) -> bool:
    """Whether the check of ``task`` travels with the broker's push (store on its Redis)."""
    from celery_idempotent.backends.redis import publish as publish_redis
    from celery_idempotent.celery.factory import factory

    task = getattr(task, "_get_current_object", lambda: task)()
    store = factory.guard(task, task.idempotency_settings()).store
    with app.producer_or_acquire() as producer:
        return publish_redis.can_fuse(producer.channel, store)


def _delete(client: redis.Redis, prefix: str) -> None:
    names = list(client.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(names), 500):
        client.delete(*names[start : start + 500])


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.publish``: this part alone, printed as ``python -m benchmarks``
    prints it (nothing written)."""
    import argparse
    import contextlib
    import json
    import os
    import secrets

    from benchmarks.run import _delete_prefix, _render_publish
    from celery_idempotent.servers.redis_server import start_private_redis

    p = argparse.ArgumentParser(prog="python -m benchmarks.publish", description=__doc__)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(start_private_redis()).url()
        prefix = f"cibench:{secrets.token_hex(4)}:"
        client = redis.Redis.from_url(url)
        stack.callback(client.close)
        stack.callback(_delete_prefix, client, prefix)
        result = run(url, prefix, rounds=args.rounds, calls=args.calls)
    print(json.dumps(result, indent=2) if args.json else "\n".join(_render_publish(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
