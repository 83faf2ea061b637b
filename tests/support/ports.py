"""Free TCP ports on 127.0.0.1, and pairs of them for a Redis Cluster node and its bus."""

from __future__ import annotations

import random
import socket

from celery_idempotent.servers import processes
from tests.support.redis_bin import RedisServerError

__all__ = ["HOST", "free_port"]

HOST = "127.0.0.1"


def _can_bind(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    With ``cluster_bus=True`` the port is drawn from 20000-29999 (below the ephemeral range) and
    ``port + 10000``, the Redis Cluster bus port, is checked to be free as well.
    """
    if not cluster_bus:
        return processes.free_port(HOST)
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(20000, 30000)
        if _can_bind(port) and _can_bind(port + 10000):
            return port
    raise RedisServerError("no free port pair (port, port+10000) for a cluster node")
