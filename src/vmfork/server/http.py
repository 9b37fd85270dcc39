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
import http.client
import logging
import os
import socket
import socketserver
import ssl
import stat
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from vmfork.server import api, auth, e2b
from vmfork.server.audit import AuditEntry, AuditLog
from vmfork.server.controller import Controller
from vmfork.server.errors import ApiError, BadRequest, PayloadTooLarge

log = logging.getLogger(__name__)
DRAIN_BYTES = 64 << 10
"""An unread request body up to this size is read and dropped after the answer is
made (see ``RequestHandler._drain``)."""


@dataclass(frozen=True)
class FrontLimits:
    """What one client may hold of the daemon's HTTP front, before it has proved anything
    (the token is checked only once a request is whole). Times are in seconds.

    A connection gets ``header_timeout`` from accept to the end of its first request's
    headers, and ``idle_timeout`` from the end of a response to the end of the next
    request's headers (keep-alive); the whole span, not each read, so sending a byte at
    a time does not extend it. Past it the connection is shut down. Bodies are read by
    handlers, each read bounded by ``read_timeout``.

    At most ``max_connections`` connections are served (one thread each). When all are
    taken, a new connection evicts the oldest one that has not sent a whole request yet
    (a slow or stalled client; a busy request is never evicted), so half-open
    connections cannot lock real clients out; with none to evict it gets a 503.
    """

    header_timeout: float = 10.0
    idle_timeout: float = 30.0
    read_timeout: float = 120.0
    max_connections: int = 256
    max_header_bytes: int = 64 << 10
    """Request line and headers together."""


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

    def setup(self) -> None:
        front: FrontLimits = getattr(self.server, "front_limits", FrontLimits())
        self._front = front
        self._requests = 0
        super().setup()
        self.connection.settimeout(front.read_timeout)

    def handle_one_request(self) -> None:
        watch = getattr(self.server, "watch", None)
        if watch is not None:
            watch(self.connection, self._front.header_timeout if self._requests == 0
                  else self._front.idle_timeout)
        self._requests += 1
        super().handle_one_request()

    def parse_request(self) -> bool:
        # The request line was read by the caller (the stdlib caps it at 64 KiB); the
        # headers are read here, through a budget, so that 100 lines of 64 KiB each
        # (the stdlib's own caps) cannot make one client cost 6.5 MB.
        original = self.rfile
        self.rfile = _HeaderBudget(original, self._front.max_header_bytes  # type: ignore[assignment]
                                   - len(self.raw_requestline))
        try:
            ok = super().parse_request()
        finally:
            self.rfile = original
        busy = getattr(self.server, "busy", None)
        if ok and busy is not None:
            busy(self.connection)
        return ok

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
            if isinstance(self.rfile, _ChunkedReader):
                req.chunked = True
            elif "Transfer-Encoding" in self.headers:
                self.close_connection = True
                raise BadRequest(f"Transfer-Encoding {self.headers['Transfer-Encoding']!r:.60}"
                                 " is not supported: send a Content-Length or chunked")
            elif length_header is not None:
                try:
                    req.content_length = int(length_header)
                    if req.content_length < 0:
                        raise ValueError
                except ValueError:
                    self.close_connection = True
                    raise BadRequest(f"invalid Content-Length {length_header[:40]!r}") from None
            e2b_route = e2b.route_for(req)
            if e2b_route is not None:
                # E2B's wire (its control plane and envd): its own routes and tokens.
                route_name = e2b_route.name
                response = e2b_route.handle(self.context.controller, req, self.context.token)
            else:
                route, req.params = api.match(self.command, split.path)
                route_name = route.template
                token = self.context.token
                if token is not None and route.template not in auth.OPEN_ROUTES:
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
        if isinstance(req.body, _ChunkedReader) and req.body.broken:
            self.close_connection = True   # the framing is lost: nothing after it is read
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
        """Read what the handler left of a small body (a request refused before its
        body was read: a bad path, a missing token), so the client, which may still
        be sending it, gets to read the answer and keep-alive works; a large unread
        body (an upload refused early) closes the connection instead."""
        body = req.body
        if isinstance(body, _ChunkedReader):
            if not body.drain(DRAIN_BYTES):
                self.close_connection = True
            return
        length = req.content_length or 0
        if not length:
            return
        if isinstance(body, _CountingReader) and body.drain(DRAIN_BYTES):
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


class _HeaderBudget:
    """The read side while headers are parsed: ``readline`` past ``budget`` bytes
    raises what the stdlib answers with 431."""

    def __init__(self, raw: Any, budget: int) -> None:
        self._raw = raw
        self._left = budget

    def readline(self, limit: int = -1) -> bytes:
        if self._left <= 0:
            raise http.client.LineTooLong("request headers over the daemon's size limit")
        line: bytes = self._raw.readline(self._left + 1 if limit < 0
                                         else min(limit, self._left + 1))
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong("request headers over the daemon's size limit")
        return line

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._raw.read(n)
        return data


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

    def drain(self, limit: int) -> bool:
        """Read and drop the rest of the body if it is at most ``limit`` bytes (within
        the socket's timeout). True if the whole body has now been read."""
        if self._vmfork_consumed:
            return True
        if self._left > limit:
            return False
        try:
            while self._left > 0 and self.read(self._left):
                pass
        except OSError:
            return False
        return self._vmfork_consumed


MAX_CHUNK_LINE = 4096
"""A chunk-size line, extensions included, and each trailer line, in bytes."""
MAX_TRAILER_BYTES = 16 << 10
MAX_CHUNKED_BODY = 64 << 30
"""The most a chunked body may carry on any route; each route bounds its own body
below that (a JSON body at ``api.MAX_JSON_BODY``, stdin at ``api.MAX_STDIN_BODY``) by
reading at most its limit, as it does with a Content-Length."""


class _ChunkedReader:
    """A ``Transfer-Encoding: chunked`` request body (RFC 9112 7.1) as a plain reader:
    ``read`` returns the data of the chunks and b"" after the last one. Bounded: a
    chunk-size line or trailer line of at most ``MAX_CHUNK_LINE`` bytes, trailers
    (read and ignored) of at most ``MAX_TRAILER_BYTES``, a body of at most
    ``MAX_CHUNKED_BODY``. Bad framing raises ``BadRequest`` and marks the reader
    ``broken`` (the connection is then closed: where the next request starts is
    unknown). Each read is bounded by the socket's timeout, like any body read."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._left = 0           # of the current chunk
        self._total = 0
        self._done = False
        self.broken = False

    @property
    def _vmfork_consumed(self) -> bool:
        return self._done

    def _fail(self, problem: str) -> BadRequest:
        self.broken = True
        return BadRequest(f"bad chunked request body: {problem}")

    def _line(self) -> bytes:
        line: bytes = self._raw.readline(MAX_CHUNK_LINE + 1)
        if not line:
            raise self._fail("the connection ended inside it")
        if len(line) > MAX_CHUNK_LINE or not line.endswith(b"\n"):
            raise self._fail(f"a line over {MAX_CHUNK_LINE} bytes")
        return line.rstrip(b"\r\n")

    def _next_chunk(self) -> None:
        size_text = self._line().split(b";", 1)[0].strip()
        if not size_text or len(size_text) > 16 or any(
                c not in b"0123456789abcdefABCDEF" for c in size_text):
            raise self._fail(f"chunk size {size_text[:20]!r} is not hexadecimal")
        size = int(size_text, 16)
        if self._total + size > MAX_CHUNKED_BODY:
            raise PayloadTooLarge(f"chunked request body over {MAX_CHUNKED_BODY} bytes")
        if size == 0:
            trailer = 0
            while True:   # trailers, ignored; the empty line ends the body
                line = self._line()
                if not line:
                    break
                trailer += len(line)
                if trailer > MAX_TRAILER_BYTES:
                    raise self._fail(f"trailers over {MAX_TRAILER_BYTES} bytes")
            self._done = True
        self._left = size

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while not self._done and (n < 0 or len(out) < n):
            if self._left == 0:
                self._next_chunk()
                continue
            want = self._left if n < 0 else min(self._left, n - len(out))
            data: bytes = self._raw.read(want)
            if not data:
                raise self._fail("the connection ended inside a chunk")
            out += data
            self._left -= len(data)
            self._total += len(data)
            if self._left == 0 and self._raw.read(2) != b"\r\n":
                raise self._fail("a chunk is not followed by CRLF")
            if n < 0:
                continue
            break   # return what one chunk gave, as a socket read would
        return bytes(out)

    def drain(self, limit: int) -> bool:
        """Read and drop what is left if it is at most ``limit`` bytes. True if the
        body has now been read to its end, framing intact."""
        try:
            while not self._done and not self.broken and limit >= 0:
                limit -= len(self.read(min(limit + 1, STREAM_DRAIN_READ)))
        except (ApiError, OSError):
            return False
        return self._done and not self.broken


STREAM_DRAIN_READ = 64 << 10


class _BoundedHandler(RequestHandler):
    def _dispatch(self) -> None:
        # Give handlers a reader that stops at the end of the body (Content-Length or
        # the last chunk; never blocks reading into the next pipelined request) and
        # records whether it was all read.
        original = self.rfile
        if self.headers.get("Transfer-Encoding", "").strip().lower() == "chunked":
            self.rfile = _ChunkedReader(original)  # type: ignore[assignment]
            try:
                super()._dispatch()
            finally:
                self.rfile = original
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
        self.rfile = _CountingReader(original, max(length, 0))  # type: ignore[assignment]
        try:
            super()._dispatch()
        finally:
            self.rfile = original


def handler_for(context: ServerContext) -> type[RequestHandler]:
    return type("BoundRequestHandler", (_BoundedHandler,), {"context": context})


_BUSY = -1.0
"""The watch deadline of a connection whose request is being handled."""
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: "
            b"application/json\r\nContent-Length: 53\r\nConnection: close\r\n\r\n"
            b'{"error": "too many connections to the daemon open"}\n')


class _BoundedFront(socketserver.ThreadingMixIn):
    """Bounds connections and the time a connection may take to say what it wants
    (see ``FrontLimits``). One watchdog thread per server shuts down connections whose
    deadline passed; shutting the socket down wakes the handler thread blocked in its
    read, which then ends as if the client had closed."""

    daemon_threads = True
    request_queue_size = 128
    front_limits = FrontLimits()

    def _front_init(self, limits: FrontLimits | None) -> None:
        if limits is not None:
            self.front_limits = limits
        self._lock = threading.Lock()
        # socket -> (deadline: monotonic instant or _BUSY, admitted at)
        self._conns: dict[socket.socket, tuple[float, float]] = {}
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def active_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def watch(self, conn: socket.socket, seconds: float) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns[conn] = (time.monotonic() + seconds, self._conns[conn][1])

    def busy(self, conn: socket.socket) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns[conn] = (_BUSY, self._conns[conn][1])

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()
        evict: socket.socket | None = None
        with self._lock:
            if len(self._conns) >= self.front_limits.max_connections:
                waiting = [(admitted, c) for c, (deadline, admitted) in self._conns.items()
                           if deadline != _BUSY]
                if not waiting:
                    self._refuse(request)
                    return
                evict = min(waiting, key=lambda pair: pair[0])[1]
                del self._conns[evict]   # its slot is the newcomer's from now on
            self._conns[request] = (now + self.front_limits.header_timeout, now)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch_loop,
                                                  name="http-front-watchdog", daemon=True)
                self._watchdog.start()
        if evict is not None:
            _shut(evict)
        super().process_request(request, client_address)

    tls: ssl.SSLContext | None = None

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            if self.tls is not None:
                request = self._handshake(request)
                if request is None:
                    return
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._conns.pop(request, None)

    def _handshake(self, raw: socket.socket) -> ssl.SSLSocket | None:
        """TLS on an admitted connection, in its own handler thread (a slow client's
        handshake never holds up ``accept``) and inside the same header deadline: the
        watchdog cuts a client that stalls it, as it cuts one that stalls its headers."""
        assert self.tls is not None
        try:
            conn = self.tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except OSError:
            raw.close()
            return None
        with self._lock:   # the wrapped socket owns the descriptor now: watch it instead
            entry = self._conns.pop(raw, None)
            if entry is not None:
                self._conns[conn] = entry
        try:
            conn.settimeout(self.front_limits.header_timeout)
            conn.do_handshake()
            conn.settimeout(None)
        except (OSError, ValueError) as err:   # a plain-HTTP client, an old TLS, a cut
            log.debug("TLS handshake failed: %s", err)
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            return None
        return conn

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away, or was cut off by the watchdog, is not a daemon
        # error; anything else is logged with its traceback (socketserver would print
        # it to stderr).
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("connection from %s ended: %s", client_address or "unix", exc)
        else:
            log.exception("connection from %s failed", client_address or "unix")

    @staticmethod
    def _refuse(request: socket.socket) -> None:
        try:
            request.send(_REFUSED, socket.MSG_DONTWAIT)
        except OSError:
            pass
        request.close()

    def _watch_loop(self) -> None:
        while not self._closing.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [c for c, (deadline, _) in self._conns.items()
                        if deadline != _BUSY and deadline <= now]
                for conn in late:
                    # Not forgotten here: the handler thread does that as it ends, so
                    # the count stays true until the thread is gone.
                    self._conns[conn] = (_BUSY, self._conns[conn][1])
            for conn in late:
                _shut(conn)

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()


def _shut(conn: socket.socket) -> None:
    try:
        # The descriptor's shutdown, also for a TLS socket: SSLSocket.shutdown would
        # first drop its TLS object under the handler thread reading from it.
        socket.socket.shutdown(conn, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its handler


class UnixHTTPServer(_BoundedFront, socketserver.UnixStreamServer):
    def __init__(self, path: str | Path, handler: type[RequestHandler],
                 limits: FrontLimits | None = None) -> None:
        self._front_init(limits)
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


class TCPHTTPServer(_BoundedFront, ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], handler: type[RequestHandler],
                 limits: FrontLimits | None = None, tls: ssl.SSLContext | None = None) -> None:
        self._front_init(limits)
        self.tls = tls
        super().__init__(address, handler)


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


def tcp_server(bind: str, handler: type[RequestHandler], limits: FrontLimits | None = None,
               tls: ssl.SSLContext | None = None) -> TCPHTTPServer:
    host, port = parse_bind(bind)
    if ":" in host:
        return TCP6HTTPServer((host, port), handler, limits, tls)
    return TCPHTTPServer((host, port), handler, limits, tls)
