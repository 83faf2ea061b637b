"""Writing a ``redis.conf`` (quoting, extra directives) and a raw PING that needs no client."""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
from collections.abc import Mapping, Sequence
from typing import Union

__all__ = ["ConfigValue", "ExtraConfig", "config_lines", "ping", "quote_config"]

ConfigValue = Union[str, int, float, bool]
ExtraConfig = Union[Mapping[str, ConfigValue], Sequence[str], None]


def quote_config(value: str) -> str:
    """``value`` as one argument of a ``redis.conf`` directive (quoted when it must be)."""
    if value == "":
        return '""'
    if re.search(r'[\s"\'\\]', value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def config_lines(extra: ExtraConfig) -> list[str]:
    if extra is None:
        return []
    if isinstance(extra, Mapping):
        lines = []
        for name, value in extra.items():
            text = ("yes" if value else "no") if isinstance(value, bool) else str(value)
            lines.append(f"{name} {quote_config(text)}")
        return lines
    if isinstance(extra, str):
        return [extra]
    return [str(line) for line in extra]


def ping(
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
