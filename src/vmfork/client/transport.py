"""HTTP over TCP or a Unix socket, with ``http.client``.

One connection per request: requests from many threads (many sandboxes driven
at once) never share a connection, and a daemon restart never leaves a stale
keep-alive socket behind. The cost, a connect per call, is microseconds on a
Unix socket or loopback.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.parse
from dataclasses import dataclass

# Request bodies (file uploads) are sent in blocks of this size; http.client's
# default of 8 KiB costs a system call per 8 KiB of a 100 MiB upload.
SEND_BLOCK = 1 << 20


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout, blocksize=SEND_BLOCK)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


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

    def connection(self, timeout: float | None,
                   tls: ssl.SSLContext | None = None) -> http.client.HTTPConnection:
        if self.socket_path is not None:
            return UnixHTTPConnection(self.socket_path, timeout)
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               blocksize=SEND_BLOCK,
                                               context=tls or tls_context(None))
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout,
                                          blocksize=SEND_BLOCK)


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """How an ``https://`` daemon is verified: the system's roots, or only ``ca_file``
    (a private CA, or the daemon's self-signed certificate). The host name is checked
    against the certificate either way; TLS 1.2 at least, as the daemon."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
