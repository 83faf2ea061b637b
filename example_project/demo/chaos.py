"""``--chaos``: SIGKILL the pool process that charges a card, in the middle of the charge.

Only a pool process of this run's workers is killed, by its pid, after checking that it is
one (its parent is one of our workers and it is still alive).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from celery_idempotent.servers.processes import pid_alive
from example_project.demo.console import Console
from example_project.demo.plan import Order
from example_project.demo.stage import Stage

__all__ = ["Chaos"]


class Chaos:
    """The killer thread; :attr:`kills` what it killed, :attr:`error` why it stopped early."""

    def __init__(self, stage: Stage, console: Console, stop: threading.Event) -> None:
        self.stage = stage
        self.console = console
        self.stop = stop
        self.kills: list[dict[str, Any]] = []
        self.error: str | None = None

    def start(self, victims: list[Order], load_started: float) -> threading.Thread:
        """Kill the pool process that charges each victim's card, in the middle of the charge."""
        client = self.stage.world.client
        key = self.stage.world.key("inflight")
        client.sadd(self.stage.world.key("slow_once"), *[o.order_id for o in victims])

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
                    self.stage.refresh_pool_pids()
                    pid, ppid = int(info["pid"]), int(info["ppid"])
                    ours = (
                        ppid in {w.pid for w in self.stage.workers} and pid in self.stage.pool_pids
                    )
                    if not ours or not pid_alive(pid):
                        self.error = f"refused to kill pid {pid}: not one of our pool processes"
                        return
                    time.sleep(0.2)  # well inside the CHAOS_HANG seconds the call hangs
                    os.kill(pid, signal.SIGKILL)
                    # The dead call never says it is over: say it for it (see shop.World.busy).
                    self.stage.world.leave(f"charge:{info['order_id']}")
                    pending.discard(info["order_id"])
                    self.kills.append(
                        {
                            "order_id": info["order_id"],
                            "pid": pid,
                            "at": round(time.monotonic() - load_started, 2),
                            "hung_for": round(time.time() - float(info["at"]), 2),
                            "hang_began_after": round(
                                float(info["at"]) - float(info["entered"]), 2
                            ),
                        }
                    )
                    self.console.info(
                        f"[{self.stage.elapsed():5.1f}s] chaos: SIGKILL pool process {pid} "
                        f"while it charges {info['order_id']}"
                    )
            except Exception as exc:  # report, never crash the run from a thread
                self.error = repr(exc)

        thread = threading.Thread(target=run, name="chaos", daemon=True)
        thread.start()
        return thread
