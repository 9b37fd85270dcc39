"""The daemon's HTTP front: uvicorn serving an ASGI app, routed on Starlette.

Why uvicorn and Starlette: HTTP/1.1 framing (chunked bodies both ways, pipelining,
keep-alive, ``Expect: 100-continue``), TLS and Unix sockets are a maintained
server's job (h11 parses, asyncio serves), not ~700 lines of our own; Starlette's
routes match the table in ``api.ROUTES``. What vmfork adds is what a daemon facing
untrusted clients needs and uvicorn lacks: a deadline on the whole request head and
on keep-alive idleness (uvicorn's keep-alive timer stops at the first byte, so a
client sending one byte a second would hold a connection for ever), eviction of
waiting connections at the cap, JSON errors for bad framing, a response-splitting
check, and a half-closed client still getting its answer (``_FrontProtocol``).

The handlers stay synchronous: they block on VMs for seconds, and the controller is
threaded. Each request runs whole in a worker thread (anyio's pool, a limiter of
``max_connections`` threads): its body is a blocking reader (``_Body``) that pulls the
ASGI ``receive`` messages through ``anyio.from_thread``, each pull bounded by
``read_timeout``; its response is sent through ``anyio.from_thread`` too, a streamed
one write by write as ``produce(write)`` makes it, so each write waits while the
client is slow to read (uvicorn's flow control: back-pressure holds, nothing piles up
in the daemon), and a write to a client that went away raises, which ends the stream.

Per request, in order: E2B's wire (routed on headers, ``e2b.route_for``) or the
``/v1`` table (404/405, path parameters validated), the bearer token (all but
``auth.OPEN_ROUTES``), the handler, the response (JSON with Content-Length, or
chunked for streams), then metrics and one audit line. Errors raised anywhere become
``{"error": "..."}``; an unexpected exception is a 500 that names its type and points
at the daemon log.

All listeners (the Unix socket, TCP with or without TLS) are uvicorn servers on one
event loop in one thread (``HttpFront``); uvicorn installs no signal handlers there
(the daemon owns signals).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import socket
import ssl
import stat
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import h11
import uvicorn
from starlette.routing import Match
from starlette.routing import Route as StarletteRoute
from uvicorn.protocols.http.h11_impl import H11Protocol

from vmfork.server import api, auth, e2b
from vmfork.server.audit import AuditEntry, AuditLog
from vmfork.server.controller import Controller
from vmfork.server.errors import ApiError, BadRequest, MethodNotAllowed, NotFound, PayloadTooLarge

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DRAIN_BYTES = 64 << 10
"""An unread request body up to this size is read and dropped after the answer (the
connection stays usable); a larger one closes the connection after the answer."""
MAX_CHUNKED_BODY = 64 << 30
"""The most a chunked body may carry on any route; each route bounds its own body
below that (a JSON body at ``api.MAX_JSON_BODY``, stdin at ``api.MAX_STDIN_BODY``) by
reading at most its limit, as it does with a Content-Length."""
SHUTDOWN_GRACE_S = 3.0
"""On stop, requests in flight get this long to finish before they are cancelled (a
handler blocked on a VM runs on in its thread; its next read or write fails)."""


@dataclass(frozen=True)
class FrontLimits:
    """What one client may hold of the daemon's HTTP front, before it has proved anything
    (the token is checked only once a request is whole). Times are in seconds.

    A connection gets ``header_timeout`` from accept (for TLS: from the start of the
    handshake, which must also end within it) to the end of its first request's
    headers, and ``idle_timeout`` from the end of a response to the end of the next
    request's headers (keep-alive); the whole span, not each read, so sending a byte
    at a time does not extend it. Past it the connection is closed. Each read of a
    body by a handler waits at most ``read_timeout``.

    At most ``max_connections`` connections are served (and as many handler
    threads). When all are taken, a new connection evicts the oldest one that is
    waiting for a request's headers (a slow or stalled client; a busy request is never
    evicted), so half-open connections cannot lock real clients out; with none to
    evict it gets a 503. Request heads over ``max_header_bytes`` are refused (431).
    """

    header_timeout: float = 10.0
    idle_timeout: float = 30.0
    read_timeout: float = 120.0
    max_connections: int = 256
    max_header_bytes: int = 64 << 10
    """Request line and headers together."""


class ServerContext:
    """What every request needs, shared by the Unix and TCP listeners."""

    def __init__(self, controller: Controller, token: bytes | None = None,
                 audit: AuditLog | None = None) -> None:
        self.controller = controller
        self.token = token
        self.audit = audit


# -- the connection: h11 with deadlines ------------------------------------------------

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: "
            b"application/json\r\nContent-Length: 53\r\nConnection: close\r\n\r\n"
            b'{"error": "too many connections to the daemon open"}\n')


_END_OF_HEAD = re.compile(rb"\n\r?\n")   # h11 takes bare LF line ends too


def _oldest_waiting(connections: Iterable[object]) -> _FrontProtocol | None:
    """The connection that has waited longest for a request's head (the one to evict
    at the cap), or None when every connection is serving a request."""
    waiting = [c for c in connections
               if isinstance(c, _FrontProtocol) and c._waiting_since is not None]
    return min(waiting, key=lambda c: c._waiting_since or 0.0, default=None)


class _FrontProtocol(H11Protocol):
    """uvicorn's h11 connection, with what ``FrontLimits`` asks of it (see the module
    docstring). ``limits`` is set on the subclass ``HttpFront`` makes."""

    limits: FrontLimits = FrontLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None
        self._armed_for: object = None
        # The cap is settled before this connection counts: never one over it.
        if len(self.connections) >= self.limits.max_connections:
            oldest = _oldest_waiting(self.connections)
            if oldest is None:
                self.transport = transport   # what connection_lost closes
                transport.write(_REFUSED)
                transport.close()
                return
            oldest._cut()
        super().connection_made(transport)
        self._await_head(self.limits.header_timeout)

    def _await_head(self, seconds: float) -> None:
        """Arm the deadline for the next request's head: the current cycle (None before
        the first request) is what it waits to see replaced."""
        self._disarm()
        self._armed_for = self.cycle
        self._waiting_since = time.monotonic()
        self._deadline = self.loop.call_later(seconds, self._cut)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_since = None

    def _cut(self) -> None:
        self._disarm()
        # Its slot is free from now on, not once the close has gone through.
        self.connections.discard(self)
        if not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._waiting_since is not None and self.conn.their_state is h11.IDLE:
            # h11 would refuse the head as well, past its incomplete-event size, but
            # with uvicorn's 400; a head too large is a 431 (RFC 6585), in JSON.
            buffered = self.conn.trailing_data[0] + data
            end = _END_OF_HEAD.search(buffered)
            if (len(buffered) if end is None else end.end()) > self.limits.max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large",
                             "request headers over the daemon's size limit "
                             f"({self.limits.max_header_bytes} bytes)")
                return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self._waiting_since is not None and self.cycle is not self._armed_for:
            self._disarm()   # a new request's head is whole: the handler has it

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_head(self.limits.idle_timeout)
        super().on_response_complete()   # may start a pipelined request at once

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio's own type
        # A client may shut down its side once it has sent the request (HTTP/1.1 lets
        # it): it still gets the answer, and the connection closes after it. A body
        # cut short by that end is bad framing: h11 says so and the client gets a 400.
        if self.cycle is None or self.cycle.response_complete:
            return None   # nothing in flight: close
        self.cycle.keep_alive = False
        if self.conn.their_state is h11.SEND_BODY:
            self.conn.receive_data(b"")
            self.handle_events()
        return True

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "Bad Request", f"invalid HTTP request: {msg}")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer a request h11 could not parse, in JSON, and close."""
        self._disarm()
        if self.cycle is None or not self.cycle.response_started:
            body = api.Response(body={"error": message}).encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                                 % (status, reason.encode(), len(body), body))
        if self.cycle is not None:
            self.cycle.disconnected = True   # the handler's reads and writes now fail
            self.cycle.message_event.set()
        self.transport.close()


# -- the request in its thread -----------------------------------------------------------


class _Gone(ConnectionResetError):
    """The client closed the connection, or the daemon is stopping."""


class _ReadTimeout(ApiError):
    status = 408


class _Exchange:
    """One request's side of the event loop, for its worker thread: the body as a
    blocking reader, and sending."""

    def __init__(self, receive: Receive, send: Send, read_timeout: float,
                 chunked: bool) -> None:
        self._receive = receive
        self._send = send
        self._read_timeout = read_timeout
        self._chunked = chunked
        self._buffer = b""
        self._total = 0
        self.done = False          # the body's last message was received
        self.gone = False          # the client went away
        self.broken = False        # a read failed: where the next request starts is unknown
        self.watched = False       # ``watch`` has the receiving side

    # The body: ``api.BodyReader``.
    def read(self, n: int = -1) -> bytes:
        while not self.done and (n < 0 or not self._buffer):
            self._pull()
        if n < 0:
            out, self._buffer = self._buffer, b""
        else:
            out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def _pull(self) -> None:
        if self.gone:
            raise _Gone("the client closed the connection")
        if self.watched:   # a stream's producer reads nothing: its handler read the body
            raise RuntimeError("the request body is read once the response streams")
        try:
            message = self._in_loop(self._next)
        except TimeoutError:
            self.broken = True
            raise _ReadTimeout(f"the request body stalled: nothing came for "
                               f"{self._read_timeout:g} s", headers={"Connection": "close"}
                               ) from None
        if message["type"] == "http.disconnect":
            self.gone = self.broken = True
            raise _Gone("the client closed the connection inside the request body")
        data = message.get("body", b"")
        self._total += len(data)
        if self._chunked and self._total > MAX_CHUNKED_BODY:
            self.broken = True
            raise PayloadTooLarge(f"chunked request body over {MAX_CHUNKED_BODY} bytes",
                                  headers={"Connection": "close"})
        self._buffer += data
        if not message.get("more_body", False):
            self.done = True

    async def _next(self) -> Message:
        with anyio.fail_after(self._read_timeout):
            return await self._receive()

    async def watch(self) -> None:
        """While a response streams: the next message is the end of the connection (or
        of the response), after what is left of a body nobody reads any more; a
        stream's next write then fails instead of going nowhere (uvicorn drops writes
        to a closed connection silently)."""
        self.watched = True
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone = True

    def drain(self, limit: int) -> bool:
        """Read and drop what is left of the body if it is at most ``limit`` bytes. True
        if the body has now been read to its end."""
        try:
            while not self.done and not self.broken and limit >= 0:
                limit -= len(self.read(min(limit + 1, 64 << 10)))
        except (ApiError, OSError):
            return False
        return self.done and not self.broken

    def send(self, message: Message) -> None:
        if self.gone:
            raise _Gone("the client closed the connection")
        self._in_loop(self._send_now, message)

    async def _send_now(self, message: Message) -> None:
        await self._send(message)

    @staticmethod
    def _in_loop(call: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        try:
            return anyio.from_thread.run(call, *args)
        except RuntimeError as err:   # the loop is gone: the daemon is stopping
            raise _Gone(f"the daemon is stopping ({err})") from None


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


@dataclass(frozen=True)
class _Matched:
    """What the event loop found for a request, before its thread runs it."""

    name: str                               # for metrics and the audit log
    route: api.Route | None = None
    params: dict[str, str] | None = None    # percent-encoded, not validated yet
    e2b_route: e2b.Route | None = None
    error: ApiError | None = None


class _Routes:
    """``api.ROUTES`` as Starlette routes, matched on the percent-encoded path (so a
    ``%2F`` stays inside its segment, where the parameter check refuses it).

    Matched in the table's order, each template against any method: the first whose
    path and method fit wins (``POST /v1/snapshots/pull`` is not a tag), and a path
    that fits only other methods is a 405 naming them all in ``Allow``."""

    def __init__(self, routes: Iterable[api.Route]) -> None:
        self._routes = [(StarletteRoute(r.template, endpoint=_no_endpoint), r)
                        for r in routes]

    def match(self, method: str, raw_path: str) -> tuple[api.Route, dict[str, str]]:
        path = raw_path if raw_path == "/" else raw_path.rstrip("/") or "/"
        try:
            urllib.parse.unquote(path, errors="strict")
        except UnicodeDecodeError:
            raise BadRequest(f"the path {raw_path[:100]!r} is not valid UTF-8 once "
                             "percent-decoded") from None
        probe = {"type": "http", "path": path, "root_path": "", "method": method}
        allowed: set[str] = set()
        for starlette_route, route in self._routes:
            found, child = starlette_route.matches(probe)
            if found is Match.NONE:
                continue
            if route.method != method:
                allowed.add(route.method)
                continue
            return route, dict(child["path_params"])
        if allowed:
            listed = ", ".join(sorted(allowed))
            raise MethodNotAllowed(f"{method} is not allowed on {raw_path}; allowed: {listed}",
                                   headers={"Allow": listed})
        raise NotFound(f"no route {method} {raw_path}; GET /openapi.json lists the API")


def _length(header: str | None) -> int | None:
    """The Content-Length h11 has checked (one value, digits only), as a number."""
    try:
        return int(header) if header is not None else None
    except ValueError:
        return None


async def _no_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("routes are matched, never called")  # pragma: no cover


def validated_params(params: dict[str, str]) -> dict[str, str]:
    """Path parameters percent-decoded and checked (``api.PARAM_CHECKS``)."""
    out = {}
    for name, value in params.items():
        out[name] = api.PARAM_CHECKS[name](urllib.parse.unquote(value, errors="strict"))
    return out


class ApiApp:
    """The ASGI application: every route of ``api.ROUTES`` and E2B's wire."""

    def __init__(self, context: ServerContext, limits: FrontLimits) -> None:
        self.context = context
        self.limits = limits
        self.routes = _Routes(api.ROUTES)
        self.threads: anyio.CapacityLimiter | None = None   # made on the loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return   # lifespan is off; websockets are not served (uvicorn has none here)
        if self.threads is None:
            self.threads = anyio.CapacityLimiter(self.limits.max_connections)
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers[name.decode("latin-1")] = value.decode("latin-1")
        raw_path = scope["raw_path"].decode("latin-1")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        exchange = _Exchange(receive, send, self.limits.read_timeout, chunked)
        req = api.Request(method=scope["method"], path=raw_path,
                          query=urllib.parse.parse_qs(scope["query_string"].decode("latin-1"),
                                                      keep_blank_values=True),
                          headers=headers, body=exchange,
                          content_length=_length(length) if not chunked else None,
                          chunked=chunked)
        client = scope.get("client")
        remote = str(client[0]) if client else "unix"
        matched = self._match(req)
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            try:
                response, head = await anyio.to_thread.run_sync(
                    self._prepare, req, exchange, matched, started, remote,
                    limiter=self.threads, abandon_on_cancel=True)
                await send({"type": "http.response.start", "status": response.status,
                            "headers": head})
                if isinstance(response, api.StreamResponse):
                    group.start_soon(exchange.watch)
                    await anyio.to_thread.run_sync(
                        self._produce, req, exchange, response, matched.name, started,
                        remote, limiter=self.threads, abandon_on_cancel=True)
                else:
                    await send({"type": "http.response.body", "body": response.encode()})
            finally:
                # Nothing more goes to this client once the app is done, also when it is
                # cancelled at stop: a producer still running in its thread ends at its
                # next write.
                exchange.gone = True
                group.cancel_scope.cancel()

    def _match(self, req: api.Request) -> _Matched:
        e2b_route = e2b.route_for(req)
        if e2b_route is not None:
            # E2B's wire (its control plane and envd): its own routes and tokens.
            return _Matched(e2b_route.name, e2b_route=e2b_route)
        try:
            route, params = self.routes.match(req.method, req.path)
        except ApiError as err:
            return _Matched("unmatched", error=err)
        return _Matched(route.template, route=route, params=params)

    # In worker threads from here on: the handler and its reads, a stream's writes.

    def _prepare(self, req: api.Request, exchange: _Exchange, matched: _Matched,
                 started: float, remote: str
                 ) -> tuple[api.Response, list[tuple[bytes, bytes]]]:
        """The response and its header lines, checked; a whole (not streamed) one is
        recorded here, before the client sees it, so a client that reads the audit log
        (or the metrics) right after a reply finds its request there."""
        response = self._respond(req, matched)
        unsafe = _unsafe_header(response.headers)
        if unsafe is not None:
            # A header value made from something a guest said (a file's size, a name)
            # that could end the header line would let the guest write its own headers,
            # or a whole second response, to the client. Nothing of it is sent.
            log.warning("%s %s: refused to send header %s: %s", req.method, req.path,
                        unsafe[0], unsafe[1])
            response = api.Response(502, {"error": f"the reply for {req.path} would carry "
                                          f"header {unsafe[0]!r:.60} with {unsafe[1]}; nothing "
                                          "of it was sent (a hostile or broken guest agent?)"})
        head = self._head(response, close=not self._body_finished(req, exchange))
        if not isinstance(response, api.StreamResponse):
            self._record(req, matched.name, response.status, started, remote)
        return response, head

    def _respond(self, req: api.Request, matched: _Matched) -> api.Response:
        try:
            if matched.error is not None:
                raise matched.error
            if matched.e2b_route is not None:
                return matched.e2b_route.handle(self.context.controller, req,
                                                self.context.token)
            assert matched.route is not None and matched.params is not None
            req.params = validated_params(matched.params)
            token = self.context.token
            if token is not None and matched.route.template not in auth.OPEN_ROUTES:
                problem = auth.authorize(req.headers.get("authorization"), token)
                if problem is not None:
                    raise _Unauthorized(problem)
            return matched.route.handler(self.context.controller, req)
        except ApiError as err:
            return api.Response(err.status, err.body(), headers=err.headers)
        except _Gone as err:
            log.debug("%s %s: %s", req.method, req.path, err)
            return api.Response(400, {"error": str(err)}, headers={"Connection": "close"})
        except Exception as err:
            log.exception("%s %s failed", req.method, req.path)
            return api.Response(500, {"error": f"internal error: {type(err).__name__}: "
                                      f"{err}; see the daemon log"})

    @staticmethod
    def _body_finished(req: api.Request, exchange: _Exchange) -> bool:
        """Whether the connection can carry another request after this answer: what the
        handler left of the body (a request refused before it was read) is read and
        dropped when it is small, so the client, which may still be sending it, gets
        to read the answer; a large one (an upload refused early) closes instead."""
        if exchange.done or exchange.broken:
            return not exchange.broken
        if req.chunked:
            return exchange.drain(DRAIN_BYTES)
        # uvicorn reads and drops the rest of a Content-Length body after the answer.
        return (req.content_length or 0) <= DRAIN_BYTES

    @staticmethod
    def _head(response: api.Response, close: bool) -> list[tuple[bytes, bytes]]:
        headers = [(k.encode("latin-1"), v.encode("latin-1"))
                   for k, v in response.headers.items()]
        if isinstance(response, api.StreamResponse):
            # No length: h11 sends it chunked (close-delimited to an HTTP/1.0 client).
            headers.append((b"content-type", response.content_type.encode("latin-1")))
        else:
            if response.status != 204 and response.body is not None:
                headers.append((b"content-type", response.content_type.encode("latin-1")))
            if response.status != 204:
                headers.append((b"content-length", str(len(response.encode())).encode()))
        if close and not any(k.lower() == b"connection" for k, _ in headers):
            headers.append((b"connection", b"close"))
        return headers

    def _produce(self, req: api.Request, exchange: _Exchange, response: api.StreamResponse,
                 route: str, started: float, remote: str) -> None:
        def write(data: bytes) -> None:
            if data:
                exchange.send({"type": "http.response.body", "body": bytes(data),
                               "more_body": True})
        try:
            response.produce(write)
            exchange.send({"type": "http.response.body", "body": b""})
        except ApiError as err:
            # Headers are gone: end the stream without its last chunk, so the client
            # sees a truncated body, and log why (uvicorn closes the connection).
            log.warning("%s %s: stream aborted: %s", req.method, req.path, err)
        except _Gone as err:   # the client went away, or the daemon is stopping
            log.debug("%s %s: stream ended: %s", req.method, req.path, err)
        finally:
            self._record(req, route, response.status, started, remote)

    def _record(self, req: api.Request, route: str, status: int, started: float,
                remote: str) -> None:
        elapsed = time.monotonic() - started
        metrics = self.context.controller.metrics
        metrics.requests.inc(method=req.method, route=route, status=str(status))
        if status >= 400:
            metrics.errors.inc(method=req.method, route=route, status=str(status))
        metrics.request_seconds.observe(elapsed, method=req.method, route=route)
        if self.context.audit is not None:
            try:
                self.context.audit.write(AuditEntry(
                    method=req.method, path=req.path, status=status,
                    latency_us=int(elapsed * 1e6), ua=req.headers.get("user-agent", ""),
                    remote=remote, sandbox_ids=req.sandbox_ids,
                    snapshot_tag=req.snapshot_tag, image=req.image))
            except OSError as err:
                log.error("cannot write the audit log: %s", err)


# -- listeners ---------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """A uvicorn server on a socket bound beforehand. On a TLS listener each accepted
    connection goes through a ``_TlsGate`` first, so a handshake has the header deadline
    (uvicorn's own start-up leaves asyncio's 60 s) and holds a slot of the cap."""

    def __init__(self, config: uvicorn.Config, sock: socket.socket,
                 handshake_timeout: float, max_connections: int) -> None:
        super().__init__(config)
        self.sock = sock
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.handshaking: dict[_TlsGate, None] = {}   # oldest first

    def make_protocol(self) -> asyncio.Protocol:
        config = self.config
        made: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=self.server_state, app_state={})
        return made

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        factory: Callable[[], asyncio.Protocol] = self.make_protocol
        if self.config.ssl is not None:
            factory = lambda: _TlsGate(self)  # noqa: E731
        self.servers = [await loop.create_server(factory, sock=self.sock,
                                                 backlog=self.config.backlog)]
        self.started = True


class _TlsGate(asyncio.Protocol):
    """A TLS connection until its handshake is done. asyncio's own TLS server makes the
    connection's protocol only once the handshake is over, so handshakes would hold no
    slot of the cap, and a client opening connections faster than the deadline cuts
    them could hold any number of sockets. The gate counts from accept: past the cap
    it cuts the oldest connection still in its handshake (with none, the oldest one
    waiting for a request's head; with none either, the new one), then runs the handshake (``loop.start_tls``, within the header deadline) and hands
    the TLS transport to the HTTP protocol, whose own cap and deadlines take over."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.raw: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.raw = transport
        # Nothing is read until start_tls has put its protocol in place (it resumes
        # reading): a ClientHello read here would be lost.
        transport.pause_reading()
        server = self.server
        if len(server.handshaking) + len(server.server_state.connections) \
                >= server.max_connections:
            oldest = _oldest_waiting(server.server_state.connections)
            if server.handshaking:
                next(iter(server.handshaking)).cut()
            elif oldest is not None:
                oldest._cut()
            else:
                transport.abort()   # every slot serves a request: no TLS to say 503 in
                return
        server.handshaking[self] = None
        self.task = asyncio.get_running_loop().create_task(self._handshake(transport))

    def cut(self) -> None:
        self.server.handshaking.pop(self, None)
        if self.raw is not None:
            self.raw.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        # Only while this gate is the transport's protocol: before start_tls took over.
        self.server.handshaking.pop(self, None)

    async def _handshake(self, raw: asyncio.Transport) -> None:
        server = self.server
        loop = asyncio.get_running_loop()
        early = _Early(server.config.h11_max_incomplete_event_size or DRAIN_BYTES)
        assert server.config.ssl is not None
        try:
            tls = await loop.start_tls(raw, early, server.config.ssl, server_side=True,
                                       ssl_handshake_timeout=server.handshake_timeout)
        except OSError as err:   # SSLError, TimeoutError, ConnectionError among them
            log.debug("TLS handshake failed: %s", err)
            raw.abort()
            return
        finally:
            server.handshaking.pop(self, None)
        if tls is None or tls.is_closing():
            return
        if early.overflow:
            tls.abort()
            return
        # What the client sent between the handshake and now (this task runs after the
        # loop has delivered it) goes to the HTTP protocol after its connection_made.
        protocol = server.make_protocol()
        tls.set_protocol(protocol)
        protocol.connection_made(tls)
        if early.data and not tls.is_closing():
            protocol.data_received(bytes(early.data))
        if early.eof and not tls.is_closing():
            if not protocol.eof_received():
                tls.close()


class _Early(asyncio.Protocol):
    """Holds what a TLS connection receives before its HTTP protocol is in place,
    at most ``limit`` bytes (a request head's bound)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.eof = False
        self.overflow = False

    def data_received(self, data: bytes) -> None:
        if len(self.data) + len(data) > self.limit:
            self.overflow = True
            return
        self.data += data

    def eof_received(self) -> bool:
        self.eof = True
        return True   # keep the transport open: the HTTP protocol decides


@dataclass
class Listener:
    sock: socket.socket
    tls: ssl.SSLContext | None = None
    unix_path: Path | None = None

    @property
    def address(self) -> str:
        if self.unix_path is not None:
            return f"unix://{self.unix_path}"
        host, port = self.sock.getsockname()[:2]
        host = str(host)
        if ":" in host:
            host = f"[{host}]"   # an IPv6 literal, as URLs write it
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    @property
    def port(self) -> int:
        port: int = self.sock.getsockname()[1]
        return port


class HttpFront:
    """The daemon's listeners: each a uvicorn server, all on one event loop in one
    thread. Sockets are bound when added (a bad address or a live daemon's socket
    fails there, before anything serves); ``start`` serves them, ``stop`` closes them."""

    def __init__(self, context: ServerContext, limits: FrontLimits | None = None) -> None:
        self.limits = limits or FrontLimits()
        self.app = ApiApp(context, self.limits)
        self.listeners: list[Listener] = []
        self._servers: list[_Server] = []
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._protocol = type("FrontProtocol", (_FrontProtocol,), {"limits": self.limits})

    def _config(self, tls: ssl.SSLContext | None) -> uvicorn.Config:
        config = uvicorn.Config(
            self.app, http=self._protocol, lifespan="off", log_config=None,
            access_log=False, proxy_headers=False, server_header=False,
            headers=[("Server", "vmfork")],
            timeout_keep_alive=max(1, round(self.limits.idle_timeout)),
            # uvicorn counts the asking connection among the open ones; the cap of
            # connections is ours (_FrontProtocol): this one bounds the requests whose
            # clients left while their handlers still run.
            limit_concurrency=self.limits.max_connections + 1,
            h11_max_incomplete_event_size=self.limits.max_header_bytes,
            timeout_graceful_shutdown=round(SHUTDOWN_GRACE_S))
        config.load()
        config.ssl = tls   # the context the daemon checked at start-up (server/tls.py)
        return config

    def listen_unix(self, path: str | Path) -> Listener:
        socket_path = Path(path)
        _remove_stale_socket(socket_path)
        socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: only this user may connect
        try:
            sock.bind(str(socket_path))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        sock.listen(128)
        listener = Listener(sock, unix_path=socket_path)
        self.listeners.append(listener)
        return listener

    def listen_tcp(self, bind: str, tls: ssl.SSLContext | None = None) -> Listener:
        host, port = parse_bind(bind)
        # IPPROTO_TCP named, not 0: accepted sockets inherit it, and asyncio turns Nagle
        # off only on sockets that say they are TCP (with Nagle on, a response's head
        # and body, two writes, waited for the client's delayed ACK: +40 ms each).
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        listener = Listener(sock, tls=tls)
        self.listeners.append(listener)
        return listener

    def addresses(self) -> list[str]:
        return [listener.address for listener in self.listeners]

    @property
    def active_connections(self) -> int:
        return sum(len(s.server_state.connections) for s in self._servers)

    def start(self) -> None:
        for listener in self.listeners:
            self._servers.append(_Server(self._config(listener.tls), listener.sock,
                                         self.limits.header_timeout,
                                         self.limits.max_connections))
        # A daemon thread, so anyio's workers, which it starts, are daemon threads too:
        # a handler abandoned at stop (an exec blocked in a sandbox that outlives the
        # daemon) must not hold the process's exit, as it could not with the old front.
        self._thread = threading.Thread(target=self._serve, name="http-front", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not all(s.started for s in self._servers):
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP front did not start: {self._failed}")
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP front did not start within 30 s")
            time.sleep(0.005)

    def _serve(self) -> None:
        async def serve_all() -> None:
            await asyncio.gather(*(s.serve() for s in self._servers))
        try:
            asyncio.run(serve_all())
        except BaseException as err:
            self._failed = err
            log.exception("the HTTP front stopped")

    def stop(self) -> None:
        """Stop accepting, give requests in flight ``SHUTDOWN_GRACE_S``, close every
        socket and remove the Unix socket's file."""
        for server in self._servers:
            server.should_exit = True
        if self._thread is not None:
            self._thread.join(SHUTDOWN_GRACE_S + 10)
            if self._thread.is_alive():
                log.error("the HTTP front did not stop within %.0f s", SHUTDOWN_GRACE_S + 10)
            self._thread = None
        for listener in self.listeners:
            listener.sock.close()
            if listener.unix_path is not None:
                try:
                    listener.unix_path.unlink()
                except FileNotFoundError:
                    pass
        self.listeners = []
        self._servers = []


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
