"""HTTP framing: stdlib ``http.server`` on a Unix socket and/or TCP.

Why the stdlib and not a framework: the API is ~20 routes of JSON plus two
streamed bodies; ``ThreadingHTTPServer``-style servers (one thread per
connection) fit a daemon whose requests mostly block on a VM, keep vmfork's
runtime free of dependencies, and run on a Unix socket with a few lines. The cost
is writing the router and chunked encoding ourselves (``api.match``, below).

Per request, in order: match the route (404/405, path parameters validated),
check the bearer token (all but ``/healthz``), run the handler, write the
response (JSON with Content-Length, or chunked for streams), then record metrics
and one audit line. Errors raised anywhere become ``{"error": "..."}``; an
unexpected exception is a 500 that names its type and points at the daemon log.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import socketserver
import stat
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from vmfork.server import api, auth
from vmfork.server.audit import AuditEntry, AuditLog
from vmfork.server.controller import Controller
from vmfork.server.errors import ApiError, BadRequest

log = logging.getLogger(__name__)


class ServerContext:
    """What every request handler needs, shared by the Unix and TCP listeners."""

    def __init__(self, controller: Controller, token: bytes | None = None,
                 audit: AuditLog | None = None) -> None:
        self.controller = controller
        self.token = token
        self.audit = audit


class _ChunkedWriter:
    def __init__(self, wfile: Any) -> None:
        self._wfile = wfile

    def write(self, data: bytes) -> None:
        if data:
            self._wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self._wfile.flush()

    def finish(self) -> None:
        self._wfile.write(b"0\r\n\r\n")
        self._wfile.flush()


class RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "vmfork"
    context: ServerContext   # set on the subclass made by ``handler_for``

    def address_string(self) -> str:
        if isinstance(self.client_address, tuple) and self.client_address:
            return str(self.client_address[0])
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def __getattr__(self, name: str) -> Any:
        # Every method, standard or not (TRACE, QUERY, ...), goes through the router,
        # which answers 405 with Allow when a path does not take it; the stdlib would
        # answer 501 with an HTML page.
        if name.startswith("do_"):
            return self._dispatch
        raise AttributeError(name)

    def _dispatch(self) -> None:
        started = time.monotonic()
        split = urllib.parse.urlsplit(self.path)
        route_name = "unmatched"
        length_header = self.headers.get("Content-Length")
        req = api.Request(method=self.command, path=split.path,
                          query=urllib.parse.parse_qs(split.query, keep_blank_values=True),
                          headers={k.lower(): v for k, v in self.headers.items()},
                          body=self.rfile, content_length=None)
        response: api.Response
        try:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                self.close_connection = True
                raise BadRequest("chunked request bodies are not supported; send a "
                                 "Content-Length")
            if length_header is not None:
                try:
                    req.content_length = int(length_header)
                    if req.content_length < 0:
                        raise ValueError
                except ValueError:
                    self.close_connection = True
                    raise BadRequest(f"invalid Content-Length {length_header[:40]!r}") from None
            route, req.params = api.match(self.command, split.path)
            route_name = route.template
            token = self.context.token
            if token is not None and split.path not in auth.OPEN_PATHS:
                problem = auth.authorize(self.headers.get("Authorization"), token)
                if problem is not None:
                    raise _Unauthorized(problem)
            response = route.handler(self.context.controller, req)
        except ApiError as err:
            response = api.Response(err.status, err.body(), headers=err.headers)
        except Exception as err:
            log.exception("%s %s failed", self.command, self.path)
            response = api.Response(500, {"error": f"internal error: {type(err).__name__}: "
                                          f"{err}; see the daemon log"})
        unsafe = _unsafe_header(response.headers)
        if unsafe is not None:
            # A header value made from something a guest said (a file's size, a name)
            # that could end the header line would let the guest write its own headers,
            # or a whole second response, to the client. Nothing of it is sent.
            log.warning("%s %s: refused to send header %s: %s", self.command, self.path,
                        unsafe[0], unsafe[1])
            response = api.Response(502, {"error": f"the reply for {split.path} would carry "
                                          f"header {unsafe[0]!r:.60} with {unsafe[1]}; nothing "
                                          "of it was sent (a hostile or broken guest agent?)"})
        self._drain(req)
        if isinstance(response, api.StreamResponse):
            self._send(response)
            self._record(req, route_name, response.status, started)
        else:
            # Recorded before the client sees the answer, so a client that reads the
            # audit log (or the metrics) right after a reply finds its request there.
            self._record(req, route_name, response.status, started)
            self._send(response)

    def send_header(self, keyword: str, value: str) -> None:
        # Every header, including the stdlib's own, passes here: the last line of
        # defence against response splitting, whatever code path made the value.
        problem = _header_problem(keyword, value)
        if problem is not None:
            raise ValueError(f"refusing to send header {keyword!r:.60}: {problem}")
        super().send_header(keyword, value)

    def _drain(self, req: api.Request) -> None:
        """Read what the handler left of a small body so keep-alive works; a large
        unread body (an upload refused early) closes the connection instead."""
        length = req.content_length or 0
        if not length:
            return
        consumed_all = getattr(req.body, "_vmfork_consumed", False)
        if consumed_all:
            return
        self.close_connection = True

    def _send(self, response: api.Response) -> None:
        try:
            self.send_response(response.status)
            for name, value in response.headers.items():
                self.send_header(name, value)
            if isinstance(response, api.StreamResponse):
                self.send_header("Content-Type", response.content_type)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                writer = _ChunkedWriter(self.wfile)
                try:
                    response.produce(writer.write)
                except ApiError as err:
                    # Headers are gone: end the stream early so the client sees a
                    # truncated body, and log why.
                    log.warning("%s %s: stream aborted: %s", self.command, self.path, err)
                    self.close_connection = True
                    return
                writer.finish()
                return
            data = response.encode()
            if response.status != 204 and response.body is not None:
                self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _record(self, req: api.Request, route: str, status: int, started: float) -> None:
        elapsed = time.monotonic() - started
        metrics = self.context.controller.metrics
        metrics.requests.inc(method=self.command, route=route, status=str(status))
        if status >= 400:
            metrics.errors.inc(method=self.command, route=route, status=str(status))
        metrics.request_seconds.observe(elapsed, method=self.command, route=route)
        if self.context.audit is not None:
            try:
                self.context.audit.write(AuditEntry(
                    method=self.command, path=req.path, status=status,
                    latency_us=int(elapsed * 1e6), ua=self.headers.get("User-Agent", ""),
                    remote=self.address_string(), sandbox_ids=req.sandbox_ids,
                    snapshot_tag=req.snapshot_tag, image=req.image))
            except OSError as err:
                log.error("cannot write the audit log: %s", err)


def _header_problem(name: str, value: object) -> str | None:
    """Why ``name: value`` cannot be sent as one header line, or None if it can."""
    if not isinstance(value, str):
        return f"a {type(value).__name__} value, not a str"
    if not name or any(c in _NOT_TOKEN or ord(c) > 126 for c in name):
        return "a name that is not an HTTP token"
    for c in value:
        code = ord(c)
        # HTAB is the one control character a field value may hold (RFC 9110 5.5); CR,
        # LF and NUL would end or corrupt the line. Above Latin-1 cannot be encoded.
        if (code < 0x20 and c != "\t") or code == 0x7F or code > 0xFF:
            return f"control or non-Latin-1 character {c!r} in its value"
    return None


_NOT_TOKEN = frozenset('()<>@,;:\\"/[]?={} \t') | {chr(c) for c in range(0x20)}


def _unsafe_header(headers: dict[str, str]) -> tuple[str, str] | None:
    for name, value in headers.items():
        problem = _header_problem(name, value)
        if problem is not None:
            return name, problem
    return None


class _Unauthorized(ApiError):
    status = 401

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="vmfork"'})


class _CountingReader:
    """Wraps the socket's read side to know whether the handler read the whole body."""

    def __init__(self, raw: Any, length: int) -> None:
        self._raw = raw
        self._left = length
        self._vmfork_consumed = length == 0

    def read(self, n: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        data: bytes = self._raw.read(self._left if n < 0 else min(n, self._left))
        self._left -= len(data)
        if self._left <= 0:
            self._vmfork_consumed = True
        return data


class _BoundedHandler(RequestHandler):
    def _dispatch(self) -> None:
        # Give handlers a reader that stops at Content-Length (never blocks reading
        # into the next pipelined request) and records whether it was all read.
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
        original = self.rfile
        self.rfile = _CountingReader(original, max(length, 0))  # type: ignore[assignment]
        try:
            super()._dispatch()
        finally:
            self.rfile = original


def handler_for(context: ServerContext) -> type[RequestHandler]:
    return type("BoundRequestHandler", (_BoundedHandler,), {"context": context})


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str | Path, handler: type[RequestHandler]) -> None:
        self.socket_path = Path(path)
        _remove_stale_socket(self.socket_path)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        old = os.umask(0o177)  # the socket is born 0600: only this user may connect
        try:
            super().__init__(str(self.socket_path), handler)
        finally:
            os.umask(old)

    def server_close(self) -> None:
        super().server_close()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass


class TCPHTTPServer(ThreadingHTTPServer):
    daemon_threads = True


class TCP6HTTPServer(TCPHTTPServer):
    address_family = socket.AF_INET6


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; remove it or choose "
                      "another --socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # a dead daemon's socket
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another daemon is serving {path}; stop it or choose "
                  "another --socket path")


def parse_bind(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--bind {value!r}: expected HOST:PORT, e.g. 127.0.0.1:8889")
    return host.strip("[]"), int(port)


def tcp_server(bind: str, handler: type[RequestHandler]) -> TCPHTTPServer:
    host, port = parse_bind(bind)
    if ":" in host:
        return TCP6HTTPServer((host, port), handler)
    return TCPHTTPServer((host, port), handler)
