"""A host connection as the agent's ops see it: send frames, receive frames, finish
(stdlib only). See ``server.py`` for the connection life cycle."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from vmfork.agent.protocol import Frame, error_header, recv_frame, send_frame

SEND_STALL_TIMEOUT = 120
"""Seconds a send may block on a host that has stopped reading before the host counts
as gone (SO_SNDTIMEO): an exec whose caller stalls is then killed instead of running on
with a thread stuck in sendall. Reads have their own, per-op timeouts."""
DRAIN_TIMEOUT = 2.0
"""After the final frame, seconds to wait for the host to hang up (see ``close``)."""


class PeerGone(Exception):
    """Sending to the host failed: it closed the connection or the VM's vsock broke."""


_TIMEVAL = struct.pack("@ll", SEND_STALL_TIMEOUT, 0)
_vsock_setsockopt: Any = None
"""libc's ``setsockopt`` and the timeval buffer, looked up on the first vsock connection
(the parent's first ping) and kept: a restored child then pays one foreign call per
connection, not a ``dlopen`` and a ctypes function object (measured: ~40 ms of guest
CPU in the emulated host, each object ctypes touches a page the child faults in)."""


def _set_send_timeout(sock: socket.socket) -> None:
    """SO_SNDTIMEO of ``SEND_STALL_TIMEOUT`` s, so a host that stops reading cannot
    block a send forever.

    CPython's ``setsockopt`` on an AF_VSOCK socket accepts only integers (it
    parses the value as a u64 for the vsock-level options), so the struct
    timeval goes through libc directly there.
    """
    global _vsock_setsockopt
    if sock.family != getattr(socket, "AF_VSOCK", -1):
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _TIMEVAL)
        except OSError:
            pass  # a family without SO_SNDTIMEO: sends may block indefinitely
        return
    if _vsock_setsockopt is None:
        import ctypes

        buf = ctypes.create_string_buffer(_TIMEVAL, len(_TIMEVAL))
        _vsock_setsockopt = (ctypes.CDLL(None, use_errno=True).setsockopt, buf)
    setsockopt, buf = _vsock_setsockopt
    setsockopt(sock.fileno(), socket.SOL_SOCKET, socket.SO_SNDTIMEO, buf, len(_TIMEVAL))


class Conn:
    """One host connection, as seen by an op."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.finished = False
        self.after: Callable[[], None] | None = None
        """Run once the final frame has been delivered and the host has hung up."""
        self.input_drained = False
        """Set by an op that already read the host's input to its end (exec's stdin)."""
        self._send_lock = threading.Lock()
        _set_send_timeout(sock)

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        with self._send_lock:
            try:
                send_frame(self.sock, header, payload)
            except OSError as err:
                raise PeerGone(f"sending a {header.get('type')!r} frame: {err}") from err

    def recv(self, timeout: float | None, deadline: float | None = None) -> Frame:
        """The host's next frame. ``timeout`` bounds each read; ``deadline`` (a
        ``time.monotonic()`` instant) the whole frame, so a host that trickles bytes
        cannot stretch the wait (``TimeoutError`` either way)."""
        self.sock.settimeout(timeout)
        return recv_frame(self.sock, deadline)

    def result(self, **fields: Any) -> None:
        self.send({"type": "result", **fields})
        self.finished = True

    def error(self, code: str, message: str, **extra: Any) -> None:
        self.send(error_header(code, message, **extra))
        self.finished = True

    def half_close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.half_close()
        if not self.input_drained:
            deadline = time.monotonic() + DRAIN_TIMEOUT
            try:
                while (left := deadline - time.monotonic()) > 0:
                    self.sock.settimeout(left)
                    if not self.sock.recv(1 << 16):
                        break
            except OSError:
                pass
        self.sock.close()
