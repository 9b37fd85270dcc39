"""The daemon's HTTP front against slow and half-open clients (issue 16, item 3).

A real TCP listener on loopback with the daemon's real front (uvicorn, with
``http._FrontProtocol``'s deadlines and cap) and controller (the fake spawner of
``test_server_http``); the clients are plain sockets that send part of a request and
stop, as a slowloris attack does.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server_http import TOKEN, Served, _serve

from vmfork.client import Controller
from vmfork.server.http import FrontLimits, HttpFront, ServerContext

LIMITS = FrontLimits(header_timeout=2.0, idle_timeout=2.0, max_connections=64,
                     max_header_bytes=16 << 10)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[HttpFront]:
    for served in _serve(tmp_path, TOKEN):
        yield from _front(served)


def _front(served: Served, limits: FrontLimits = LIMITS) -> Iterator[HttpFront]:
    server = HttpFront(ServerContext(served.controller, TOKEN), limits)
    server.listen_tcp("127.0.0.1:0")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _port(server: HttpFront) -> int:
    return server.listeners[0].port


def _healthz(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status
    finally:
        conn.close()


def _half_open(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n")   # and never the end
    return sock


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while data := sock.recv(4096):
            if not data.startswith(b"HTTP/1.1 503"):
                return False
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_thousand_half_open_connections_hold_at_most_the_cap(front: HttpFront) -> None:
    port = _port(front)
    threads_before = threading.active_count()
    socks: list[socket.socket] = []
    most_active = most_threads = 0
    answered = 0
    try:
        for i in range(1000):
            socks.append(_half_open(port))
            if i % 50 == 49:
                # The API answers while the attack goes on: a real request evicts the
                # oldest connection that has not sent a whole request.
                assert _healthz(port) == 200
                answered += 1
            most_active = max(most_active, front.active_connections)
            most_threads = max(most_threads, threading.active_count() - threads_before)
        assert answered == 20
        assert most_active <= LIMITS.max_connections
        # Connections are served on the event loop; threads are for handlers only.
        assert most_threads <= 8, most_threads
        # Every half-open connection is gone once the header timeout has passed.
        deadline = time.monotonic() + LIMITS.header_timeout + 1.0
        still_open = [s for s in socks
                      if not _closed_by_server(s, max(0.01, deadline - time.monotonic()))]
        assert not still_open, f"{len(still_open)} of 1000 connections still open"
        for _ in range(100):   # their closes are going through
            if front.active_connections == 0:
                break
            time.sleep(0.01)
        assert front.active_connections == 0
        assert _healthz(port) == 200
    finally:
        for s in socks:
            s.close()


def test_a_slow_header_is_cut_at_the_header_timeout(front: HttpFront) -> None:
    """A byte every 0.5 s keeps every read within any per-read timeout; the deadline
    covers the whole header."""
    sock = socket.create_connection(("127.0.0.1", _port(front)), timeout=5)
    elapsed = _trickle(sock)
    assert _closed_by_server(sock, 1.0)
    assert LIMITS.header_timeout <= elapsed < LIMITS.header_timeout + 1.5, elapsed
    sock.close()


def _trickle(sock: socket.socket) -> float:
    """Send a request head a byte every 0.5 s until the server cuts the connection
    (or the head, longer than any deadline here, is sent); the seconds it took."""
    t0 = time.monotonic()
    try:
        for byte in b"GET /healthz HTTP/1.1\r\nHost: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx":
            sock.sendall(bytes([byte]))
            time.sleep(0.5)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return time.monotonic() - t0


def test_an_idle_keep_alive_connection_is_closed(front: HttpFront) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", _port(front), timeout=10)
    conn.request("GET", "/healthz")
    assert conn.getresponse().read() == b'{"ok":true}'
    assert conn.sock is not None
    t0 = time.monotonic()
    assert _closed_by_server(conn.sock, LIMITS.idle_timeout + 1.5)
    assert time.monotonic() - t0 >= LIMITS.idle_timeout - 0.3
    conn.close()


def test_a_trickled_keep_alive_request_is_cut_at_the_idle_timeout(front: HttpFront) -> None:
    """After a response the next request's head has ``idle_timeout`` in all: a byte
    every 0.5 s does not extend it (uvicorn's own keep-alive timer stops at the first
    byte)."""
    conn = http.client.HTTPConnection("127.0.0.1", _port(front), timeout=10)
    conn.request("GET", "/healthz")
    assert conn.getresponse().read() == b'{"ok":true}'
    sock = conn.sock
    assert sock is not None
    elapsed = _trickle(sock)
    assert _closed_by_server(sock, 1.0)
    assert LIMITS.idle_timeout <= elapsed < LIMITS.idle_timeout + 1.5, elapsed
    sock.close()


def test_headers_over_the_size_limit_are_431(front: HttpFront) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", _port(front), timeout=10)
    conn.putrequest("GET", "/healthz")
    for i in range(40):   # 40 x ~1 KiB: each line is fine, together over 16 KiB
        conn.putheader(f"X-Pad-{i}", "p" * 1000)
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 431 and b"size limit" in response.read()
    conn.close()
    assert _healthz(_port(front)) == 200


def test_busy_connections_are_not_evicted_and_extra_ones_get_503(tmp_path: Path) -> None:
    """When every slot holds a request being handled, a newcomer is refused with 503
    rather than evicting work in progress."""
    for served in _serve(tmp_path, TOKEN):
        Controller(served.url, token=TOKEN.decode()).create_snapshot("base")
        served.spawner.gate.clear()   # spawns block inside the handler
        server = HttpFront(ServerContext(served.controller, TOKEN),
                           FrontLimits(max_connections=2, header_timeout=2, idle_timeout=2))
        port = server.listen_tcp("127.0.0.1:0").port
        server.start()
        body = b'{"snapshot_tag": "base"}'
        busy = []
        try:
            for _ in range(2):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                          + TOKEN + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                busy.append(s)
            time.sleep(0.5)
            extra = socket.create_connection(("127.0.0.1", port), timeout=5)
            assert extra.recv(4096).startswith(b"HTTP/1.1 503")
            extra.close()
            assert server.active_connections == 2
        finally:
            served.spawner.gate.set()
            for s in busy:
                s.close()
            server.stop()


def test_a_stalled_body_is_408_after_the_read_timeout(tmp_path: Path) -> None:
    """Each read of a body by a handler waits at most ``read_timeout``: a client that
    stops inside its body gets a 408 and the connection is closed (where its next
    request would start is unknown)."""
    for served in _serve(tmp_path, TOKEN):
        for server in _front(served, FrontLimits(read_timeout=1.0, header_timeout=5,
                                                 idle_timeout=5)):
            sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=10)
            sock.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + TOKEN + b"\r\nContent-Length: 100\r\n\r\n{\"snapshot")
            t0 = time.monotonic()
            response = http.client.HTTPResponse(sock)
            response.begin()
            assert response.status == 408 and b"stalled" in response.read()
            assert 1.0 <= time.monotonic() - t0 < 3.0
            assert response.getheader("Connection") == "close"
            sock.close()
