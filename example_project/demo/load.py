"""The load: client threads that publish every message's copies at the same moment."""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from example_project.demo.plan import Message, Order, burst
from example_project.demo.stage import DemoError, Stage

__all__ = ["Load", "Published"]


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


class Load:
    """Publishes through the tasks of the stage's app, counting in ``published``: ``duplicates``
    clients, until ``stop`` is set; ``show_progress`` is called while the clients run."""

    def __init__(
        self,
        stage: Stage,
        published: Published,
        duplicates: int,
        stop: threading.Event,
        show_progress: Callable[[], None],
    ) -> None:
        self.stage = stage
        self.duplicates = duplicates
        self.stop = stop
        self.show_progress = show_progress
        self.published = published

    def send(self, message: Message) -> Any:
        """Publish ``message``; ``apply_async`` publishes nothing for a key that is already
        queued, running or done (its result has the first call's task id, not ours)."""
        task = getattr(self.stage.tasks, message.task)
        result = task.apply_async(message.args, task_id=message.task_id, headers=message.headers)
        if result.id == message.task_id:
            self.published.add(message)
        else:
            self.published.add_stopped(message, result)
        return result

    def run_bursts(self, orders: list[Order]) -> None:
        """One thread per duplicate; for each order they publish their copies together."""
        plans = [burst(order, self.duplicates) for order in orders]
        barrier = threading.Barrier(self.duplicates)
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
            for i in range(self.duplicates)
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
