"""A Sentinel group of private servers: a master, one replica and one Sentinel (quorum 1)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tests.support.cleanup import close_at_exit, forget_at_exit
from tests.support.redis_bin import RedisServerError
from tests.support.redis_server import RedisServer

if TYPE_CHECKING:
    import redis
    import redis.sentinel

Address = tuple[str, int]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(reply: Mapping[Any, Any] | Sequence[Any]) -> dict[str, str]:
    """One entry of a ``SENTINEL REPLICAS`` reply as a ``{str: str}`` dict.

    RESP2 sends a flat ``[name, value, ...]`` list, which some redis-py versions already turn
    into a dict; both are accepted.
    """
    if isinstance(reply, Mapping):
        return {_text(name): _text(value) for name, value in reply.items()}
    items = [_text(item) for item in reply]
    return dict(zip(items[::2], items[1::2]))


class _SentinelProcess(RedisServer):
    """A ``redis-server <conf> --sentinel``: a Sentinel, run and stopped like any server here.

    Its config holds only what a Sentinel needs (Sentinel rewrites the file as it learns the
    topology, so it lives in the process's own dir); ``monitor`` are the ``sentinel ...`` lines.
    """

    def __init__(self, monitor: Sequence[str], *, binary: str | None = None) -> None:
        super().__init__(binary=binary)
        self.monitor = list(monitor)

    def _config(self) -> str:
        return "\n".join([*self._process_config(), *self.monitor]) + "\n"

    def _arguments(self) -> list[str]:
        return ["--sentinel"]

    def __repr__(self) -> str:
        return f"<Sentinel {self.host}:{self.port} pid={self.pid} running={self.running}>"


class RedisSentinelGroup:
    """A master, one replica of it and one Sentinel watching them, all private servers.

    The Sentinel monitors :attr:`master_name` with quorum 1, ``down-after-milliseconds``
    ``down_after_ms`` (5 s: long enough that a master stalled by a loaded CI machine is not
    failed over by itself; the tests fail over on purpose with ``SENTINEL FAILOVER``, which does
    not wait for it) and ``failover-timeout`` ``failover_timeout_ms``. Every process is a
    :class:`RedisServer` of the same ``redis-server`` binary (:func:`find_redis_server`; a
    Sentinel is that binary run with ``--sentinel``), each on a free port in its own temp dir.

    ``start()`` returns once the replica is in sync with the master (``master_link_status:up``
    and equal replication offsets) and the Sentinel knows both, with the replica healthy: a
    ``SENTINEL FAILOVER`` can then promote it. :meth:`failover` does that and waits for the
    result (see there). :meth:`master_client` gives redis-py Sentinel clients
    (``Sentinel(...).master_for(name)``) that find the current master by asking the Sentinel.

    ``extra_config`` lines go into both data servers' configs (e.g. ``min-replicas-to-write 1``).
    ``close()`` stops the Sentinel first (so that it never reacts to the servers going away),
    then the servers, by pid, and removes every dir; it is also the context manager's exit and
    runs at interpreter exit for a group left open.
    """

    def __init__(
        self,
        master_name: str = "idem-master",
        *,
        binary: str | None = None,
        down_after_ms: int = 5000,
        failover_timeout_ms: int = 10_000,
        socket_timeout: float = 3.0,
        extra_config: Sequence[str] = (),
    ) -> None:
        if not master_name or any(ch.isspace() for ch in master_name):
            raise ValueError(f"master_name must be one word, got {master_name!r}")
        self.master_name = master_name
        self.binary = binary
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.socket_timeout = socket_timeout
        self.extra_config = list(extra_config)
        #: The two data servers: the first master, then the first replica (roles swap on
        #: :meth:`failover`; :meth:`master_address` says which is master now).
        self.servers: list[RedisServer] = []
        self.sentinel_server: _SentinelProcess | None = None
        self._admins: dict[Address, redis.Redis] = {}
        self._sentinels: list[redis.sentinel.Sentinel] = []
        self._shared: redis.sentinel.Sentinel | None = None
        self._clients: list[redis.Redis] = []

    # ------------------------------------------------------------------ topology

    @property
    def sentinel_hosts(self) -> list[Address]:
        """``[(host, port)]`` of the Sentinel(s), as ``redis.sentinel.Sentinel`` takes them."""
        if self.sentinel_server is None:
            raise RedisServerError("sentinel group not started")
        return [(self.sentinel_server.host, self.sentinel_server.port)]

    @property
    def addresses(self) -> list[Address]:
        """``[(host, port)]`` of the two data servers (first master, first replica)."""
        return [(server.host, server.port) for server in self.servers]

    def server_at(self, address: Address) -> RedisServer:
        """The data server listening at ``address``."""
        for server in self.servers:
            if (server.host, server.port) == tuple(address):
                return server
        raise KeyError(address)

    def master_address(self) -> Address:
        """The master's ``(host, port)`` as the Sentinel reports it now."""
        reply = self._sentinel_admin().execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name
        )
        if not reply:
            raise RedisServerError(f"the Sentinel knows no master {self.master_name!r}")
        host, port = reply
        return str(host), int(port)

    def replica_address(self) -> Address:
        """The data server that is not :meth:`master_address`."""
        master = self.master_address()
        others = [address for address in self.addresses if address != master]
        if len(others) != 1:
            raise RedisServerError(f"the Sentinel's master {master} is none of {self.addresses}")
        return others[0]

    def admin(self, address: Address) -> redis.Redis:
        """A plain ``redis.Redis`` (``decode_responses=True``) to one server of the group (a
        data server or the Sentinel), for checks; reused, closed by ``close()``.

        Not a Sentinel client: it stays on ``address`` whatever that server's role.
        """
        import redis as redis_module

        key = (address[0], int(address[1]))
        client = self._admins.get(key)
        if client is None:
            client = redis_module.Redis(
                host=key[0],
                port=key[1],
                decode_responses=True,
                socket_timeout=5.0,
                socket_connect_timeout=5.0,
            )
            self._admins[key] = client
        return client

    def _sentinel_admin(self) -> redis.Redis:
        host, port = self.sentinel_hosts[0]
        return self.admin((host, port))

    def sentinel_replicas(self) -> list[dict[str, str]]:
        """``SENTINEL REPLICAS <name>`` as a list of dicts (``ip``, ``port``, ``flags``...)."""
        reply = self._sentinel_admin().execute_command("SENTINEL", "SLAVES", self.master_name)
        return [_pairs(entry) for entry in reply]

    # ------------------------------------------------------------------ clients

    def sentinel(self, **kwargs: Any) -> redis.sentinel.Sentinel:
        """A new ``redis.sentinel.Sentinel`` over :attr:`sentinel_hosts` (closed by ``close()``).

        Short socket timeouts by default, for both the Sentinel connections and the clients
        that ``master_for`` makes from it; keywords override them.
        """
        from redis.sentinel import Sentinel

        kwargs.setdefault("socket_timeout", self.socket_timeout)
        kwargs.setdefault("socket_connect_timeout", self.socket_timeout)
        kwargs.setdefault(
            "sentinel_kwargs",
            {"socket_timeout": self.socket_timeout, "socket_connect_timeout": self.socket_timeout},
        )
        sentinel = Sentinel(self.sentinel_hosts, **kwargs)
        self._sentinels.append(sentinel)
        return sentinel

    def master_client(
        self,
        *,
        sentinel: redis.sentinel.Sentinel | None = None,
        service_name: str | None = None,
        **kwargs: Any,
    ) -> redis.Redis:
        """``sentinel.master_for(service_name, **kwargs)``, closed by ``close()`` if not before.

        ``sentinel`` defaults to one Sentinel shared by all clients made here (so two of them
        have the same ``sentinel_manager``: the library treats them as one server), and
        ``service_name`` to :attr:`master_name`. No connection is made until the first command.
        """
        if sentinel is None:
            if self._shared is None:
                self._shared = self.sentinel()
            sentinel = self._shared
        client: redis.Redis = sentinel.master_for(service_name or self.master_name, **kwargs)
        self._clients.append(client)
        return client

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> RedisSentinelGroup:
        """Start master, replica and Sentinel; return once the replica can be promoted."""
        close_at_exit(self)
        deadline = time.monotonic() + timeout
        # Full syncs (the first one, and the old master's after a failover) start at once
        # instead of after diskless sync's default 5 s of waiting for more replicas.
        common = ["repl-diskless-sync-delay 0", *self.extra_config]
        try:
            master = RedisServer(binary=self.binary, extra_config=common)
            self.servers.append(master)
            master.start()
            replica = RedisServer(
                binary=self.binary,
                extra_config=[*common, f"replicaof {master.host} {master.port}"],
            )
            self.servers.append(replica)
            replica.start()
            self._wait_replicating(
                (replica.host, replica.port), (master.host, master.port), deadline
            )
            # Started after the replica is attached: the Sentinel's first INFO of the master
            # lists it, instead of the next one 10 s later.
            name = self.master_name
            self.sentinel_server = _SentinelProcess(
                [
                    f"sentinel monitor {name} {master.host} {master.port} 1",
                    f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
                    f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {name} 1",
                ],
                binary=self.binary or master.binary,
            )
            self.sentinel_server.start()
            self._wait_sentinel_view(
                (master.host, master.port), (replica.host, replica.port), deadline
            )
        except BaseException:
            self.close()
            raise
        return self

    def _wait(self, what: str, check: Callable[[], tuple[bool, Any]], deadline: float) -> None:
        """Poll ``check()`` (``(done, what was seen)``) until done; fail at ``deadline``.

        Connection errors while polling count as "not yet" (a server may be switching roles).
        """
        import redis as redis_module

        seen: Any = None
        while True:
            try:
                done, seen = check()
            except (redis_module.ConnectionError, redis_module.TimeoutError) as exc:
                done, seen = False, exc
            if done:
                return
            if time.monotonic() > deadline:
                raise RedisServerError(f"timed out waiting for {what}; last seen: {seen!r}")
            time.sleep(0.05)

    def _wait_replicating(self, replica: Address, master: Address, deadline: float) -> None:
        """Until ``replica`` replicates ``master`` with its link up and has all of its data."""

        def in_sync() -> tuple[bool, Any]:
            master_info = self.admin(master).info("replication")
            info = self.admin(replica).info("replication")
            linked = (
                master_info.get("role") == "master"
                and info.get("role") == "slave"
                and (str(info.get("master_host")), int(info.get("master_port", 0))) == master
                and info.get("master_link_status") == "up"
            )
            caught_up = linked and int(info.get("slave_repl_offset", -1)) >= int(
                master_info.get("master_repl_offset", 0)
            )
            return caught_up, (master_info, info)

        self._wait(f"{replica} to be an in-sync replica of {master}", in_sync, deadline)

    def sentinel_master_state(self) -> dict[str, str]:
        """``SENTINEL MASTER <name>`` as a dict (``ip``, ``port``, ``flags``...)."""
        reply = self._sentinel_admin().execute_command("SENTINEL", "MASTER", self.master_name)
        return _pairs(reply)

    def _wait_sentinel_view(
        self, master: Address, replica: Address, deadline: float, *, fresh: bool = True
    ) -> None:
        """Until the Sentinel names ``master``, with no failover running, and lists ``replica``
        as a connected replica that is not down: one that ``SENTINEL FAILOVER`` can promote.

        With ``fresh`` the Sentinel must also have seen ``replica`` say (in ``INFO``) that it
        replicates ``master`` with its link up. Not after a failover: the Sentinel asks a
        replica for ``INFO`` only every 10 s, and a promotion does not need it.
        """

        def agrees() -> tuple[bool, Any]:
            state = self.sentinel_master_state()
            if (
                (state.get("ip"), int(state.get("port", 0))) != master
                or state.get("flags") != "master"
                or self.master_address() != master
            ):
                return False, state
            replicas = self.sentinel_replicas()
            for entry in replicas:
                if (
                    (entry.get("ip"), int(entry.get("port", 0))) == replica
                    and entry.get("flags") == "slave"
                    and (
                        not fresh
                        or (
                            entry.get("role-reported") == "slave"
                            and entry.get("master-link-status") == "ok"
                            and (entry.get("master-host"), int(entry.get("master-port", 0)))
                            == master
                        )
                    )
                ):
                    return True, entry
            return False, replicas

        self._wait(f"the Sentinel to see {replica} as a replica of {master}", agrees, deadline)

    def wait_in_sync(self, timeout: float = 30.0) -> None:
        """Until the replica has everything the master has (equal replication offsets)."""
        deadline = time.monotonic() + timeout
        self._wait_replicating(self.replica_address(), self.master_address(), deadline)

    def failover(self, timeout: float = 60.0, *, demote: bool = True) -> Address:
        """``SENTINEL FAILOVER``: promote the replica; return the new master's ``(host, port)``.

        First waits until the replica has all of the master's writes, so nothing written before
        the call is lost. Returns once the Sentinel names the former replica as master and that
        server says it is a master (it takes writes).

        With ``demote`` (the default) the old master is then made a replica of the new one the
        way Sentinel itself does it (:meth:`demote`), and the call returns only once it is in
        sync and the Sentinel sees it as a replica it could promote: the group is as after
        ``start()``, roles swapped, ready for the next failover. Sentinel would do the demotion
        by itself, but only 10-20 s later (it waits for its next ``INFO`` of the old master,
        every 10 s, and 8 s of stable role): until then the old master still takes the writes
        of clients whose pooled connections still lead there, writes that its demotion then
        throws away. ``demote=False`` leaves the group in that window.
        """
        import redis as redis_module

        deadline = time.monotonic() + timeout
        old, new = self.master_address(), self.replica_address()
        self._wait_replicating(new, old, deadline)
        sentinel = self._sentinel_admin()

        def started() -> tuple[bool, Any]:
            try:
                sentinel.execute_command("SENTINEL", "FAILOVER", self.master_name)
            except redis_module.ResponseError as exc:
                # NOGOODSLAVE: the Sentinel's view of the replica is not fresh yet; INPROG: a
                # failover is already running. Both settle by themselves: ask again.
                if "NOGOODSLAVE" in str(exc) or "INPROG" in str(exc):
                    return False, exc
                raise
            return True, None

        self._wait(f"the Sentinel to accept FAILOVER of {self.master_name}", started, deadline)

        def promoted() -> tuple[bool, Any]:
            # The failover is over (the Sentinel has switched to the new master: flags back to
            # plain "master"), and the new master says so itself.
            state = self.sentinel_master_state()
            if (state.get("ip"), int(state.get("port", 0))) != new or state.get(
                "flags"
            ) != "master":
                return False, state
            role = self.admin(new).info("replication").get("role")
            return role == "master" and self.master_address() == new, role

        self._wait(f"{new} to be the master after the failover", promoted, deadline)
        if demote:
            self.demote(old, timeout=max(deadline - time.monotonic(), 1.0))
        return new

    def demote(self, address: Address, timeout: float = 30.0) -> None:
        """Make the server at ``address`` a replica of the Sentinel's master, as Sentinel does.

        Sentinel demotes an old master that is still up with ``REPLICAOF <new master>`` and
        ``CLIENT KILL TYPE normal`` in one transaction (the kill makes clients reconnect and
        ask a Sentinel where the master is now); so does this. Returns once the server is in
        sync with the master and the Sentinel lists it as a replica that it could promote.
        """
        deadline = time.monotonic() + timeout
        master = self.master_address()
        if tuple(address) == master:
            raise ValueError(f"{address} is the master: there is nothing to demote it to")
        pipe = self.admin(address).pipeline(transaction=True)
        pipe.execute_command("REPLICAOF", master[0], str(master[1]))
        pipe.execute_command("CLIENT", "KILL", "TYPE", "normal")  # SKIPME yes: not this one
        pipe.execute()
        self._wait_replicating(address, master, deadline)
        self._wait_sentinel_view(master, address, deadline, fresh=False)

    def _is_replica(self, server: RedisServer) -> bool:
        """Whether ``server`` says it is a replica (quick, ``False`` when it does not answer)."""
        import redis as redis_module

        if not server.running:
            return False
        client = redis_module.Redis(
            host=server.host, port=server.port, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        try:
            return bool(client.info("replication").get("role") == "slave")
        except Exception:
            return False
        finally:
            client.close()

    def close(self) -> None:
        """Close every client, then stop the Sentinel and the servers and remove their dirs.

        Replicas are stopped before the master: a Redis 7 master told to shut down waits (up to
        ``shutdown-timeout``) for its replicas to confirm they have everything, about a second.
        """
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()
        for sentinel in self._sentinels:
            with contextlib.suppress(Exception):
                sentinel.close()
        self._sentinels.clear()
        self._shared = None
        for admin in self._admins.values():
            with contextlib.suppress(Exception):
                admin.close()
        self._admins.clear()
        if self.sentinel_server is not None:
            self.sentinel_server.close()
            self.sentinel_server = None
        for server in sorted(self.servers, key=lambda server: not self._is_replica(server)):
            server.close()
        self.servers.clear()
        forget_at_exit(self)

    def __enter__(self) -> RedisSentinelGroup:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.sentinel_hosts if self.sentinel_server is not None else "not started"
        return f"<RedisSentinelGroup {self.master_name} sentinel={where} servers={self.addresses}>"
