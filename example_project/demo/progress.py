"""How far the run is: the workers' counters, the progress line, and waiting for the end."""

from __future__ import annotations

import time

from example_project.demo.chaos import Chaos
from example_project.demo.console import Console
from example_project.demo.load import Published
from example_project.demo.options import Options
from example_project.demo.stage import DemoError, Stage

__all__ = ["Progress"]


class Progress:
    """Reads what the workers counted (:mod:`example_project.metrics`) and the results."""

    def __init__(
        self,
        options: Options,
        stage: Stage,
        console: Console,
        published: Published,
        chaos: Chaos,
    ) -> None:
        self.opts = options
        self.stage = stage
        self.console = console
        self.published = published
        self.chaos = chaos
        #: Killed messages Celery acked because a copy with their task id had succeeded.
        self.acked_after_kill = 0

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
        deadline = self.stage.started + self.opts.timeout
        quiet_since, last = 0.0, dict[str, int]()
        while True:
            stats = self.stats()
            finished = stats.get("finished:SUCCESS", 0) + stats.get("finished:FAILURE", 0)
            self.show(stats)
            if finished >= expected:
                return
            now = time.monotonic()
            if (
                expected - finished <= len(self.chaos.kills) - self.acked_after_kill
                and self._all_final()
            ):
                if stats != last:
                    quiet_since, last = now, stats
                elif now - quiet_since > self.opts.lock_ttl + 2:
                    self.acked_after_kill += expected - finished
                    return
            if now > deadline:
                raise DemoError(
                    f"timeout while waiting for {what}: {finished}/{expected} finished after "
                    f"{self.opts.timeout:.0f}s\n{self.stage.worker_logs()}"
                )
            self.stage.check_workers()
            time.sleep(0.1)

    def _all_final(self) -> bool:
        """Whether every published task id has a SUCCESS or FAILURE in the result backend."""
        backend = self.stage.app.backend
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
        raw = self.stage.world.client.hgetall(self.stage.world.key("stats"))
        return {k: int(v) for k, v in raw.items()}

    def show(self, stats: dict[str, int] | None = None) -> None:
        stats = stats if stats is not None else self.stats()
        effects = self.stage.world.client.hvals(self.stage.world.key("effects"))
        doubles = sum(1 for v in effects if int(v) > 1)
        finished = stats.get("finished:SUCCESS", 0) + stats.get("finished:FAILURE", 0)
        text = (
            f"[{self.stage.elapsed():5.1f}s] sent {self.published.messages}  done {finished}  "
            f"executions {len(effects)}  replays {stats.get('replays', 0)}  "
            f"requeued {max(0, stats.get('finished:RETRY', 0) - stats.get('mail_retries', 0))}  "
            f"doubles {doubles}"
        )
        if self.opts.chaos:
            text += f"  killed {len(self.chaos.kills)}/{self.opts.kills}"
        self.console.progress(text)
