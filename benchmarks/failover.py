"""Sentinel failover, measured: executions per key, commits lost and what deliveries were told.

``python -m benchmarks.failover [--wait 0 1 2] [--events ...] [--keys N] [--json PATH]``

Each run starts its own group on loopback: a master, two replicas and three Sentinels (quorum
2, ``down-after-milliseconds`` 1000), and three worker processes of four threads, each thread
a "worker slot" running deliveries through a real guard (``RedisLockProvider`` and
``RedisIdempotencyStore`` on a Sentinel client, ``wait_replicas`` as given, lease 3 s, bodies
1.5 s). Every key is delivered twice, the copy 0.3 s after the first (a duplicate is always
there to take over a lease a promoted replica lost). A delivery that could not claim (key held
through every attempt, or Redis unreachable) is delivered again 0.5 s later, as a worker
re-queues it; one told ``LockLostError`` or ``CommitUnknownError`` ends there, as a task
failure would. Then one event, at a time chosen to hit the bodies or the commits:

- ``failover-bodies`` / ``failover-commits``: ``SENTINEL FAILOVER`` 0.6 s after the first
  deliveries start (bodies running), or as the first bodies end (commits in flight);
- ``kill-bodies`` / ``kill-commits``: SIGKILL of the master at those moments (the Sentinels
  then fail over by themselves, after about 1 s of silence and an election).

Once every delivery has ended (or 60 s passed), the final master is asked for each key's record.
Per run it prints: keys run twice (or more), commits lost (a delivery was told its result was
stored, and the final master has no record of the key), deliveries told each outcome, keys never
completed. Each body appends ``key token pid`` to a file (an execution counts whatever Redis
lost). Loopback only; a run takes 15-40 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

MASTER = "fo-master"
LEASE = 3.0
BODY = 1.5
EVENTS = ("failover-bodies", "failover-commits", "kill-bodies", "kill-commits")


def _worker(  # noqa: PLR0917 - a multiprocessing target: positional by nature
    sentinels: list[tuple[str, int]],
    wait: int,
    prefix: str,
    log_path: str,
    jobs: Any,
    results: Any,
    threads: int,
    verbose: bool,
) -> None:
    """A worker process: ``threads`` slots taking (key, copy, due) from ``jobs``."""
    import logging

    from redis.sentinel import Sentinel

    from celery_idempotent import (
        CommitUnknownError,
        DistributedIdempotencyGuard,
        IdempotencyConnectionError,
        LockAcquisitionError,
        LockLostError,
        RedisIdempotencyStore,
        RedisLockProvider,
        current_lease,
    )

    if not verbose:
        logging.getLogger("celery_idempotent").setLevel(logging.ERROR)
    sentinel = Sentinel(sentinels, socket_timeout=1.0, sentinel_kwargs={"socket_timeout": 1.0})
    client = sentinel.master_for(MASTER, socket_timeout=1.0, socket_connect_timeout=1.0)
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client, wait_replicas=wait, wait_timeout=0.5),
        lock_provider=RedisLockProvider(
            client, key_prefix=prefix, wait_replicas=wait, wait_timeout=0.5
        ),
        key_prefix=prefix,
        lock_ttl=LEASE,
        retry_count=3,
        retry_base_delay=0.1,
    )
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def slot() -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            key, copy, due = job
            time.sleep(max(0.0, due - time.time()))

            def body(key: str = key) -> str:
                lease = current_lease()
                token = lease.fencing_token if lease is not None else 0
                time.sleep(BODY)
                os.write(fd, f"{key} {token} {os.getpid()}\n".encode())
                return f"{key}:{token}"

            try:
                outcome = guard.run(key, body)
                told = "replayed" if outcome.replayed else "committed"
            except (LockAcquisitionError, IdempotencyConnectionError) as exc:
                results.put((key, copy, "requeued", type(exc).__name__))
                continue
            except CommitUnknownError:
                told = "CommitUnknownError"
            except LockLostError:
                told = "LockLostError"
            except Exception as exc:  # anything else is a finding too: say which
                told = f"other:{type(exc).__name__}"
            results.put((key, copy, told, ""))

    pool = [threading.Thread(target=slot, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def _pairs(reply: Any) -> dict[str, str]:
    from tests.support.sentinel import _pairs as pairs

    return pairs(reply)


class Group:
    """Master, two replicas, three Sentinels (quorum 2), all private servers on loopback."""

    def __init__(self) -> None:
        from tests.support.redis_server import RedisServer

        common = ["repl-diskless-sync-delay 0", "appendonly no", "save ''"]
        self.master = RedisServer(extra_config=common).start()
        self.replicas = [
            RedisServer(
                extra_config=[*common, f"replicaof {self.master.host} {self.master.port}"]
            ).start()
            for _ in range(2)
        ]
        self.sentinels: list[Any] = []
        self._wait(self._replicating, 30)
        from tests.support.sentinel import _SentinelProcess

        for _ in range(3):
            process = _SentinelProcess(
                [
                    f"sentinel monitor {MASTER} {self.master.host} {self.master.port} 2",
                    f"sentinel down-after-milliseconds {MASTER} 1000",
                    f"sentinel failover-timeout {MASTER} 5000",
                    f"sentinel parallel-syncs {MASTER} 2",
                ],
                binary=self.master.binary,
            )
            self.sentinels.append(process.start())
        self._wait(self._sentinels_agree, 30)

    @property
    def servers(self) -> list[Any]:
        return [self.master, *self.replicas]

    @property
    def sentinel_hosts(self) -> list[tuple[str, int]]:
        return [(s.host, s.port) for s in self.sentinels]

    @staticmethod
    def _wait(check: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out: {check.__name__}")
            time.sleep(0.1)

    def _replicating(self) -> bool:
        info = self.master.client().info("replication")
        return int(info.get("connected_slaves", 0)) == 2 and all(
            r.client().info("replication").get("master_link_status") == "up" for r in self.replicas
        )

    def _sentinels_agree(self) -> bool:
        for s in self.sentinels:
            try:
                state = s.client().execute_command("SENTINEL", "MASTER", MASTER)
            except Exception:
                return False
            fields = _pairs(state)
            if (
                int(fields.get("num-slaves", 0)) < 2
                or int(fields.get("num-other-sentinels", 0)) < 2
            ):
                return False
        return True

    def master_address(self) -> tuple[str, int] | None:
        for s in self.sentinels:
            try:
                host, port = s.client().execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER
                )
                host = host.decode() if isinstance(host, bytes) else str(host)
                return host, int(port)
            except Exception:  # noqa: S112 - that Sentinel is down: ask the next
                continue
        return None

    def server_at(self, address: tuple[str, int]) -> Any:
        return next(s for s in self.servers if (s.host, s.port) == address)

    def failover(self) -> None:
        self.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", MASTER)

    def kill_master(self) -> None:
        address = self.master_address()
        assert address is not None
        server = self.server_at(address)
        os.kill(server.pid, signal.SIGKILL)

    def settled(self) -> Any:
        """The client of the master every Sentinel names, once it takes writes."""
        deadline = time.monotonic() + 30
        last: Any = None
        while time.monotonic() < deadline:
            address = self.master_address()
            if address is not None:
                try:
                    c = self.server_at(address).client()
                    if c.info("replication").get("role") == "master":
                        c.set("fo:probe", "1")
                        return c
                except Exception as exc:
                    last = exc
            time.sleep(0.2)
        raise RuntimeError(f"no master took writes within 30 s ({address}, {last!r})")

    def close(self) -> None:
        for p in [*self.sentinels, *self.servers]:
            with contextlib.suppress(Exception):  # a killed master is closed already
                p.close()


def run_one(wait: int, event: str, keys: int, *, verbose: bool = False) -> dict[str, Any]:
    group = Group()
    ctx = multiprocessing.get_context("fork")
    jobs: Any = ctx.Queue()
    results: Any = ctx.Queue()
    prefix = f"fo:{uuid.uuid4().hex[:6]}:"
    fd, log_path = tempfile.mkstemp(prefix="failover-", suffix=".log")
    os.close(fd)
    procs = [
        ctx.Process(
            target=_worker,
            args=(group.sentinel_hosts, wait, prefix, log_path, jobs, results, 4, verbose),
            daemon=True,
        )
        for _ in range(3)
    ]
    try:
        for p in procs:
            p.start()
        t0 = time.time() + 1.0  # the workers have connected by then
        names = [f"k{i:02d}" for i in range(keys)]
        for i, key in enumerate(names):
            start = t0 + 0.8 * i / keys
            jobs.put((key, 0, start))
            jobs.put((key, 1, start + 0.3))
        at = t0 + (0.6 if event.endswith("bodies") else BODY + 0.1)
        time.sleep(max(0.0, at - time.time()))
        (group.failover if event.startswith("failover") else group.kill_master)()
        open_deliveries = {(key, copy) for key in names for copy in (0, 1)}
        told: Counter[str] = Counter()
        finals: dict[str, list[str]] = {key: [] for key in names}
        requeues = 0
        deadline = time.time() + 60
        while open_deliveries and time.time() < deadline:
            try:
                key, copy, what, _detail = results.get(timeout=1.0)
            except Exception:  # noqa: S112 - queue.Empty: look at the deadline again
                continue
            if what == "requeued":
                requeues += 1
                jobs.put((key, copy, time.time() + 0.5))
                continue
            open_deliveries.discard((key, copy))
            told[what] += 1
            finals[key].append(what)
        master = group.settled()
        records = {key: bool(master.exists(f"{prefix}{{{key}}}")) for key in names}
        lines = Path(log_path).read_text().split() if Path(log_path).exists() else []
        runs = Counter(lines[::3])
        return {
            "wait_replicas": wait,
            "event": event,
            "keys": keys,
            "deliveries": 2 * keys,
            "executions": sum(runs.values()),
            "keys_run_twice": sum(1 for k in names if runs[k] >= 2),
            "keys_never_run": sum(1 for k in names if runs[k] == 0),
            "commits_lost": sum(1 for k in names if "committed" in finals[k] and not records[k]),
            "keys_without_record": sum(1 for k in names if not records[k]),
            "told": dict(sorted(told.items())),
            "requeues": requeues,
            "unfinished_deliveries": len(open_deliveries),
        }
    finally:
        for _ in range(len(procs) * 4):
            jobs.put(None)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        group.close()
        if os.path.exists(log_path):
            os.unlink(log_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.failover")
    parser.add_argument("--wait", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--events", nargs="+", default=list(EVENTS), choices=EVENTS)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--verbose", action="store_true", help="the workers' warnings too")
    args = parser.parse_args(argv)
    rows = []
    for wait in args.wait:
        for event in args.events:
            row = run_one(wait, event, args.keys, verbose=args.verbose)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
