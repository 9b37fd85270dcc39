"""HTTP to the daemon over TCP or a Unix socket, with ``httpx``.

One ``httpx.Client`` per ``Controller``: a pool of keep-alive connections that many
threads (many sandboxes driven at once) share safely; a stream (exec, watch, process
output) holds a connection of its own until it is closed. The pool has no cap on
connections, because a caller with a hundred sandboxes streaming at once must not
wait for a slot, and it drops an idle connection after a few seconds, well inside
the daemon's 30-second idle deadline (``server/http.py``), so a request never lands
on a connection the daemon is closing.
"""

from __future__ import annotations

import ssl
import urllib.parse
from dataclasses import dataclass

import httpx

# An idle pooled connection is dropped after this many seconds: the daemon closes one
# idle for 30 (``FrontLimits.idle_timeout``), and reusing a socket it is closing fails.
KEEPALIVE_EXPIRY = 5.0
# Request bodies read from a file are sent in blocks of this size.
SEND_BLOCK = 1 << 20


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon listens: ``unix:///path/api.sock`` or ``http(s)://host:port[/prefix]``."""

    url: str
    scheme: str
    host: str
    port: int | None
    socket_path: str | None
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        split = urllib.parse.urlsplit(url)
        if split.scheme == "unix":
            path = urllib.parse.unquote(split.path)
            if not path.startswith("/"):
                raise ValueError(f"{url!r}: a Unix socket URL is unix:///absolute/path.sock")
            return cls(url, "unix", "localhost", None, path, "")
        if split.scheme in ("http", "https") and split.hostname:
            return cls(url, split.scheme, split.hostname, split.port, None,
                       split.path.rstrip("/"))
        raise ValueError(f"{url!r} is not a daemon URL: use http://HOST:PORT or "
                         "unix:///path/to/api.sock")

    @property
    def origin(self) -> str:
        """The URL requests are made against (a Unix socket's is nominal)."""
        if self.socket_path is not None:
            return "http://localhost"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}" + (f":{self.port}" if self.port else "")

    def client(self, timeout: float | None, tls: ssl.SSLContext | None = None) -> httpx.Client:
        """A pooled client for this endpoint; ``timeout`` bounds each connect, read and
        write (a request may pass its own)."""
        verify: ssl.SSLContext | bool = (tls or tls_context(None)) if self.scheme == "https" \
            else False
        transport = httpx.HTTPTransport(
            uds=self.socket_path, verify=verify, retries=1,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32,
                                keepalive_expiry=KEEPALIVE_EXPIRY))
        # No proxy from the environment: the daemon is this host's or named exactly.
        return httpx.Client(base_url=self.origin, transport=transport, trust_env=False,
                            timeout=httpx.Timeout(timeout))


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """How an ``https://`` daemon is verified: the system's roots, or only ``ca_file``
    (a private CA, or the daemon's self-signed certificate). The host name is checked
    against the certificate either way; TLS 1.2 at least, as the daemon."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
