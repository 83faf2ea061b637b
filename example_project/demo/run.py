"""One run of the demo: set the stage, send the load (and the chaos), wait, sum up, tear down."""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

from example_project.demo.chaos import Chaos
from example_project.demo.console import Console
from example_project.demo.load import Load, Published
from example_project.demo.options import Options
from example_project.demo.plan import Message, make_orders
from example_project.demo.progress import Progress
from example_project.demo.report import summarize
from example_project.demo.stage import Stage

__all__ = ["Demo"]


class Demo:
    """The pieces of one run, under a namespace of its own (keys, queue, worker names)."""

    def __init__(self, options: Options, console: Console) -> None:
        self.opts = options
        self.console = console
        self.namespace = f"shop-demo-{uuid.uuid4().hex[:8]}"
        self.stop = threading.Event()
        self.stage = Stage(options, console, self.namespace)
        self.chaos = Chaos(self.stage, console, self.stop)
        published = Published()
        self.progress = Progress(options, self.stage, console, published, self.chaos)
        self.load = Load(self.stage, published, options.duplicates, self.stop, self.progress.show)
        self.conflicts_sent = 0
        self.refused_at_publish = 0

    @property
    def started(self) -> float:
        """When the run began (``time.monotonic()``)."""
        return self.stage.started

    def run(self) -> dict[str, Any]:
        from celery_idempotent import IdempotencyMismatchError

        opts = self.opts
        self.stage.setup()
        rng = random.Random(opts.seed)
        orders = make_orders(opts.orders, rng)
        mismatch_orders = rng.sample(orders, opts.mismatches)
        others = [o for o in orders if o not in mismatch_orders]
        victims = rng.sample(others, opts.kills) if opts.chaos else []
        # Some mail servers are down on the first attempt: send_receipt_email retries them.
        flaky = rng.sample(orders, max(1, opts.orders // 10))
        self.stage.world.client.sadd(self.stage.world.key("mail_flaky"), *[o.email for o in flaky])

        load_started = time.monotonic()
        chaos_thread = self.chaos.start(victims, load_started) if victims else None
        self.load.run_bursts(orders)
        self.progress.wait_finished(self.load.published.messages, "the bursts")
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
                conflicts.append(self.load.send(message))
            except IdempotencyMismatchError:
                refused += 1  # refused at publish, synchronously
                self.refused_at_publish += 1
        self.progress.wait_finished(self.load.published.messages, "the conflicting requests")
        for result in conflicts:
            result.get(timeout=30, propagate=False)
            if result.failed() and isinstance(result.result, IdempotencyMismatchError):
                refused += 1
        load_elapsed = time.monotonic() - load_started
        self.progress.show()
        self.console.done()
        return summarize(self, orders, victims, refused, load_elapsed)

    def close(self, *, quick: bool = False) -> dict[str, Any]:
        """Stop everything this run started, remove its files; report what was left running."""
        self.stop.set()
        return self.stage.close(self.load.published.all_ids, quick=quick)
