"""A local Redis Cluster of private servers (no replicas), formed with redis-py."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from tests.support.cleanup import close_at_exit, forget_at_exit
from tests.support.keys import delete_keys_with_prefix
from tests.support.redis_bin import RedisServerError
from tests.support.redis_server import RedisServer

if TYPE_CHECKING:
    import redis
    import redis.cluster

CLUSTER_SLOTS = 16384


class RedisCluster:
    """A local Redis Cluster of ``masters`` (default 3) private servers, no replicas.

    Formed with redis-py rather than ``redis-cli --cluster create`` (faster, and the same on 6.2
    and 7.x): each node gets a distinct config epoch and its share of the 16384 slots
    (``CLUSTER ADDSLOTS`` in chunks, since ``ADDSLOTSRANGE`` is 7.0+), the first node MEETs the
    others, and ``start()`` returns once every node reports ``cluster_state:ok`` and knows all
    the others. Redis holds a restarted master back for ~2s before the state turns ok, so expect
    about that long.
    """

    def __init__(self, masters: int = 3, *, binary: str | None = None) -> None:
        if masters < 1:
            raise ValueError("a cluster needs at least one master")
        self.masters = masters
        self.binary = binary
        self.servers: list[RedisServer] = []
        self._clients: list[Any] = []

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """``[(host, port), ...]`` of every node."""
        return [(server.host, server.port) for server in self.servers]

    @property
    def url(self) -> str:
        """``redis://host:port`` of the first node (a cluster client discovers the rest)."""
        host, port = self.startup_nodes[0]
        return f"redis://{host}:{port}"

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A ``redis.cluster.RedisCluster`` over all nodes; closed by ``close()`` at the latest."""
        from redis.cluster import ClusterNode
        from redis.cluster import RedisCluster as ClusterClient

        nodes = [ClusterNode(host, port) for host, port in self.startup_nodes]
        client = ClusterClient(startup_nodes=nodes, **kwargs)
        self._clients.append(client)
        return client

    def node_clients(self) -> list[redis.Redis]:
        """One plain ``redis.Redis`` per node (closed by ``close()``)."""
        return [server.client() for server in self.servers]

    def delete_keys_with_prefix(self, prefix: str) -> int:
        """Delete keys starting with ``prefix`` on every node; the number deleted."""
        import redis as redis_module

        deleted = 0
        for host, port in self.startup_nodes:
            client = redis_module.Redis(host=host, port=port)
            try:
                deleted += delete_keys_with_prefix(client, prefix, cluster_node=True)
            finally:
                client.close()
        return deleted

    def start(self, timeout: float = 30.0) -> RedisCluster:
        """Start the nodes and form the cluster; return once it is ok everywhere."""
        import redis as redis_module

        close_at_exit(self)
        try:
            for _ in range(self.masters):
                server = RedisServer(cluster=True, binary=self.binary)
                self.servers.append(server)
                server.start()
            clients = [
                redis_module.Redis(host=host, port=port, decode_responses=True)
                for host, port in self.startup_nodes
            ]
            try:
                self._form(clients, timeout)
            finally:
                for client in clients:
                    client.close()
        except BaseException:
            self.close()
            raise
        return self

    def _form(self, clients: list[redis.Redis], timeout: float) -> None:
        count = len(clients)
        bounds = [CLUSTER_SLOTS * index // count for index in range(count + 1)]
        for index, client in enumerate(clients):
            client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
            slots = list(range(bounds[index], bounds[index + 1]))
            for start in range(0, len(slots), 1000):
                client.execute_command("CLUSTER", "ADDSLOTS", *slots[start : start + 1000])
        first = clients[0]
        for host, port in self.startup_nodes[1:]:
            first.execute_command("CLUSTER", "MEET", host, port)
        deadline = time.monotonic() + timeout
        while True:
            infos = [client.execute_command("CLUSTER", "INFO") for client in clients]
            if all(
                "cluster_state:ok" in info and f"cluster_known_nodes:{count}" in info
                for info in infos
            ):
                return
            if time.monotonic() > deadline:
                raise RedisServerError(f"cluster not ok after {timeout}s: {infos!r}")
            time.sleep(0.05)

    def close(self) -> None:
        """Close clients and close (stop, remove dir) every node; idempotent."""
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()
        for server in self.servers:
            server.close()
        self.servers.clear()
        forget_at_exit(self)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
