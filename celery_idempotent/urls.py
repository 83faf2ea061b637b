"""URL helpers shared by the backends, the settings, the command line and the demo."""

from __future__ import annotations

__all__ = ["redact"]


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs).

    The last ``@`` ends the credentials, so a password that contains ``@`` is hidden whole, and
    so is every password of a multi-host URL (``sentinel://:pw@a;sentinel://:pw@b``) — its hosts
    but the last are dropped from the message then.
    """
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url
