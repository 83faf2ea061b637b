"""A TCP proxy that injects network faults: stall, cut, resume."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from urllib.parse import urlsplit, urlunsplit

from tests.support.cleanup import close_at_exit, forget_at_exit
from tests.support.redis_server import HOST


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
        close_at_exit(self)
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
        forget_at_exit(self)

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
