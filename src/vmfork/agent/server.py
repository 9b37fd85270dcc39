"""The agent's server: accepts connections on a listening socket and runs one op per
connection, each on its own thread, reused between connections (stdlib only).

``AgentServer`` takes any listening stream socket — AF_VSOCK in the guest, AF_UNIX in
the unit tests — and knows nothing about being PID 1; ``main.py`` adds those duties.

Threads. A connection is served by an idle worker thread if there is one, else by a new
one. A worker goes back to waiting for the next connection after an op that ran no user
code (``USER_CODE_OPS``: eval code and cells can leave thread state behind, a cell's
watchdog can still raise in its thread, so their threads end as before), at most
``MAX_IDLE_WORKERS`` of them. Why: a child restored from a snapshot faults in every page
it touches, and starting a thread touches many (its stack, the kernel's task, Python's
thread state and bootstrap); a worker parked in the snapshot is woken instead. Measured in
the emulated test host, the thread's start was ~15-65 ms of the guest's ~200 ms of work
for ``after_fork`` (docs/design-notes.md, "The guest's own work for after_fork").

Connection life cycle: read the request frame (within ``REQUEST_TIMEOUT``), run the op,
which sends zero or more streamed frames and exactly one final ``result``/``error``
frame, then half-close (SHUT_WR) and read and discard whatever the host still sends
until it closes (at most ``DRAIN_TIMEOUT``). Draining instead of closing at once matters
when the agent fails an upload half-way: closing a socket with unread input can turn
into a reset that destroys the error frame before the host reads it.

Nothing a connection does may take the agent down: every exception is turned into an
``error`` frame (``internal`` for bugs, with the traceback on the agent's log), and the
accept loop survives errors such as EMFILE.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from vmfork import __version__
from vmfork.agent import files, network, system, upper, volumes, watch
from vmfork.agent.conn import Conn, PeerGone
from vmfork.agent.evaluator import Evaluator
from vmfork.agent.interpreter import Interpreter
from vmfork.agent.jobs import JobTable
from vmfork.agent.process import run_exec
from vmfork.agent.protocol import (
    MAX_CLOCK_STEP_NS,
    OPS,
    PROTOCOL_VERSION,
    ConnectionClosed,
    Frame,
    ProtocolError,
    error_header,
    send_frame,
)
from vmfork.agent.reaper import OwnedPids
from vmfork.agent.request import OpError, get_bool, get_int

REQUEST_TIMEOUT = 30.0
"""Seconds a new connection may take to send its request frame."""
MAX_CONNECTIONS = 256
MAX_IDLE_WORKERS = 4
"""Worker threads kept waiting for a connection (see the module docstring)."""
USER_CODE_OPS = frozenset({"eval", "cell"})
"""Ops whose thread runs user code; it ends with the connection instead of being reused."""
CLOCK_STEP_TIMEOUT = 10.0
"""Seconds ``after_fork`` waits for the host's ``clock_step`` after sending its clock.
An honest host answers as soon as the reading arrives; a starved guest's reading can
take seconds to get out, the host's answer seconds to get in, so this is generous, and
it is the longest a host that never answers can hold the connection's thread."""

Logger = Callable[[str], None]
PowerAction = Callable[[bool], None]
"""Called with ``reboot`` after a ``shutdown`` op has been answered."""


def _stderr_log(message: str) -> None:
    print(f"vmfork-agent: {message}", file=sys.__stderr__, flush=True)


class AgentServer:
    """Serves the agent protocol on ``listener`` (a bound, listening stream socket).

    ``owned`` is shared with the PID-1 reaper (see ``reaper.py``); ``power`` performs
    the ``shutdown`` op (None: the op answers ``unsupported``, as it must outside a VM).
    """

    def __init__(self, listener: socket.socket, *, owned: OwnedPids | None = None,
                 power: PowerAction | None = None, log: Logger = _stderr_log,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.listener = listener
        self.owned = owned if owned is not None else OwnedPids()
        self.power = power
        self.log = log
        self.evaluator = Evaluator()
        self.jobs = JobTable(self.owned)
        self.interpreter = Interpreter(self.evaluator)
        self._slots = threading.BoundedSemaphore(max_connections)
        # Idle workers wait on ``_handoff``; ``_idle`` counts them, under ``_pool_lock``.
        # A worker counts itself idle only just before it waits, and the accept loop
        # takes one off the count before it hands a socket over, so every socket put
        # there has a worker that will take it.
        self._handoff: queue.SimpleQueue[socket.socket | None] = queue.SimpleQueue()
        self._pool_lock = threading.Lock()
        self._idle = 0
        self._stopping = threading.Event()
        self._handlers: dict[str, Callable[[Conn, Frame], None]] = {
            "ping": self._ping,
            "exec": lambda conn, frame: run_exec(conn, frame.header, self.owned),
            "eval": lambda conn, frame: self.evaluator.handle(conn, frame.header),
            "read": lambda conn, frame: files.read(conn, frame.header),
            "write": lambda conn, frame: files.write(conn, frame.header),
            "list": lambda conn, frame: files.list_dir(conn, frame.header),
            "stat": lambda conn, frame: files.stat(conn, frame.header),
            "remove": lambda conn, frame: files.remove(conn, frame.header),
            "mkdir": lambda conn, frame: files.mkdir(conn, frame.header),
            "reseed": self._reseed,
            "set_time": lambda conn, frame: system.set_time_op(conn, frame.header),
            "shutdown": self._shutdown,
            "net_refresh": lambda conn, frame: conn.result(**network.refresh(frame.header)),
            "after_fork": self._after_fork,
            "rename": lambda conn, frame: files.rename(conn, frame.header),
            "watch": lambda conn, frame: watch.watch(conn, frame.header),
            "start": lambda conn, frame: self.jobs.start(conn, frame.header),
            "attach": lambda conn, frame: self.jobs.attach(conn, frame.header),
            "send_stdin": lambda conn, frame: self.jobs.send_stdin(conn, frame.header,
                                                                   frame.payload),
            "signal": lambda conn, frame: self.jobs.signal(conn, frame.header),
            "pty_resize": lambda conn, frame: self.jobs.resize(conn, frame.header),
            "ps": lambda conn, frame: self.jobs.list(conn, frame.header),
            "mount_volume": lambda conn, frame: conn.result(
                **volumes.mount_volume(frame.header)),
            "export_upper": lambda conn, frame: upper.export_upper(conn, frame.header),
            "cell": lambda conn, frame: self.interpreter.cell(conn, frame.header),
            "contexts": lambda conn, frame: self.interpreter.contexts(conn, frame.header),
        }
        assert set(self._handlers) == set(OPS)

    # -- accept loop -------------------------------------------------------------

    def serve_forever(self) -> None:
        """Accept connections until ``stop()``. Never raises for a bad connection."""
        while not self._stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError as err:
                if self._stopping.is_set():
                    return
                # EMFILE/ENFILE/ENOBUFS: back off instead of spinning; the connection
                # waits in the backlog.
                self.log(f"accept failed: {err}; retrying")
                time.sleep(0.05)
                continue
            if not self._slots.acquire(blocking=False):
                self._refuse(sock)
                continue
            with self._pool_lock:
                reuse = self._idle > 0
                if reuse:
                    self._idle -= 1
            if reuse:
                self._handoff.put(sock)
                continue
            try:
                threading.Thread(target=self._worker, args=(sock,),
                                 name="agent-conn", daemon=True).start()
            except RuntimeError as err:  # can't start new thread
                self._slots.release()
                self.log(f"cannot start a connection thread: {err}")
                sock.close()

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (tests, and ``main`` while it does other work)."""
        thread = threading.Thread(target=self.serve_forever, name="agent-accept", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stopping.set()
        with self._pool_lock:
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._handoff.put(None)
        try:
            # shutdown() wakes a thread blocked in accept(); close() alone does not.
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()

    def _refuse(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(1.0)
            send_frame(sock, error_header("busy", "the agent is serving too many connections; "
                                                  "retry later"))
        except OSError:
            pass
        finally:
            sock.close()

    # -- one connection ----------------------------------------------------------

    def _worker(self, sock: socket.socket | None) -> None:
        """Serve ``sock`` (if any), then (see the module docstring) wait for the next one
        or end."""
        while True:
            if sock is not None and not self._serve_connection(sock):
                return
            with self._pool_lock:
                if self._idle >= MAX_IDLE_WORKERS or self._stopping.is_set():
                    return
                self._idle += 1
            handed = self._handoff.get()
            if handed is None:  # stop()
                return
            sock = handed

    def _add_idle_worker(self) -> None:
        try:
            threading.Thread(target=self._worker, args=(None,), name="agent-conn",
                             daemon=True).start()
        except RuntimeError as err:  # can't start new thread: connections start their own
            self.log(f"cannot start an idle worker thread: {err}")

    def _serve_connection(self, sock: socket.socket) -> bool:
        """Serve one connection; whether its thread may serve another."""
        conn = Conn(sock)
        op: str | None = None
        try:
            op = self._dispatch(conn)
        except BaseException:  # noqa: BLE001 - a connection must never take PID 1 down
            self.log("connection failed:\n" + traceback.format_exc())
        finally:
            try:
                conn.close()
            except OSError:
                pass
            self._slots.release()
        if conn.after is not None:
            conn.after()
        return op is not None and op not in USER_CODE_OPS

    def _dispatch(self, conn: Conn) -> str:
        """Read the request and run its op; the op's name ("?" if none was read)."""
        op = "?"
        try:
            try:
                frame = conn.recv(REQUEST_TIMEOUT)
            except ConnectionClosed as err:
                # A clean close is a readiness probe, a lost one a host that gave up
                # (or a restore's vsock reset): nothing to answer, nothing to log. The
                # console is a slow serial line, and a restored child's first
                # connections are routinely reset.
                if not err.clean and not err.lost:
                    conn.error("bad_request", f"reading the request: {err.message}")
                return op
            except TimeoutError:
                # "timeout", not "bad_request": a host that sent its request whole can
                # see this when the guest was starved of CPU longer than the wait (a
                # batch of a hundred restored guests on one core), and a host retries
                # a timeout, which repeats no op (none ran).
                conn.error("timeout", f"no request frame within {REQUEST_TIMEOUT:g} s")
                return op
            conn.sock.settimeout(None)
            raw_op = frame.header.get("op")
            if not isinstance(raw_op, str):
                raise OpError("bad_request", "the request frame has no string field 'op'")
            op = raw_op
            if op in USER_CODE_OPS:
                # This thread ends with the connection: a fresh one takes its place in
                # the pool now, so that a snapshot taken after (say) a warm-up eval
                # still holds an idle worker for its children's first connection.
                self._add_idle_worker()
            handler = self._handlers.get(op)
            if handler is None:
                raise OpError("unknown_op", f"unknown op {op!r}; known ops: {', '.join(OPS)}")
            handler(conn, frame)
            if not conn.finished:
                raise OpError("internal", f"{op}: the op ended without a final frame")
        except PeerGone as err:
            self.log(f"{op}: host went away: {err}")
        except OpError as err:
            self._send_error(conn, err.code, err.message, **err.extra)
        except ConnectionClosed as err:
            if err.lost:
                self.log(f"{op}: host went away: {err.message}")
            else:
                self._send_error(conn, "bad_request", f"{op}: {err.message}")
        except ProtocolError as err:
            self._send_error(conn, err.code, f"{op}: {err.message}")
        except TimeoutError:
            self._send_error(conn, "bad_request", f"{op}: the host stopped sending")
        except OSError as err:  # the connection or the host side of it, not a bug here
            self.log(f"{op}: {type(err).__name__}: {err}")
            self._send_error(conn, "os_error", f"{op}: {err}")
        except Exception as err:  # noqa: BLE001 - report bugs to the caller, keep serving
            self.log(f"{op}: internal error:\n{traceback.format_exc()}")
            self._send_error(conn, "internal", f"{op}: {type(err).__name__}: {err}")
        return op

    def _send_error(self, conn: Conn, code: str, message: str, **extra: Any) -> None:
        if conn.finished:
            self.log(f"error after the final frame, not sent: {code}: {message}")
            return
        try:
            conn.error(code, message, **extra)
        except PeerGone:
            pass

    # -- small ops ---------------------------------------------------------------

    def _ping(self, conn: Conn, frame: Frame) -> None:
        conn.result(**_pong())

    def _reseed(self, conn: Conn, frame: Frame) -> None:
        conn.result(**system.reseed(frame.header, frame.payload))

    def _after_fork(self, conn: Conn, frame: Frame) -> None:
        """Clock first (the request's age is the clock's error), then the RNGs, then
        the network; answers like ``ping`` plus each step's result. With
        ``clock_exchange`` the clock's error is then corrected on this connection
        (``_clock_exchange``) instead of by two more ``set_time`` ops."""
        ns = get_int(frame.header, "ns", None, minimum=1)
        if ns is None:
            raise OpError("bad_request", "after_fork: 'ns' (the host's wall clock, "
                                         "nanoseconds since the epoch) is required")
        exchange = get_bool(frame.header, "clock_exchange", False)
        clock = system.set_time(ns)
        set_at = time.monotonic_ns()
        reseeded = system.reseed(frame.header, frame.payload)
        net = network.refresh({}) if get_bool(frame.header, "net_refresh", False) else None
        if not exchange:
            conn.result(**_pong(), clock=clock, reseed=reseeded, net=net)
            return
        step = _clock_exchange(conn, set_at)
        conn.result(**_pong(), clock=clock, reseed=reseeded, net=net, clock_step=step)

    def _shutdown(self, conn: Conn, frame: Frame) -> None:
        reboot = get_bool(frame.header, "reboot", False)
        power = self.power
        if power is None:
            raise OpError("unsupported", "shutdown: this agent is not PID 1 of a VM; "
                                         "refusing to power off the machine it runs on")
        conn.result(action="reboot" if reboot else "poweroff")
        conn.after = lambda: power(reboot)


def _clock_exchange(conn: Conn, set_at: int) -> dict[str, int] | None:
    """``after_fork``'s clock correction: send the clock as it reads now and how long
    ago (monotonic) it was set to the request's ``ns``, wait at most
    ``CLOCK_STEP_TIMEOUT`` for the host's ``clock_step`` and apply it. Returns
    ``{offset_ns, previous_ns, ns}``, or None when no step came (the host went quiet
    or hung up): the op then ends with its result all the same, the clock left as the
    request set it, so a missing step can hold this thread only that long."""
    now = time.clock_gettime_ns(time.CLOCK_REALTIME)
    conn.send({"type": "clock", "ns": now, "processing_ns": time.monotonic_ns() - set_at})
    try:
        reply = conn.recv(CLOCK_STEP_TIMEOUT, time.monotonic() + CLOCK_STEP_TIMEOUT)
    except TimeoutError:
        return None
    except ConnectionClosed as err:
        if err.lost:
            raise
        if not err.clean:
            raise OpError("bad_request",
                          f"after_fork: the clock step frame was cut short ({err.message}); "
                          "the clock is as the request set it") from err
        return None  # the host half-closed without a step: it may still read the result
    if reply.header.get("type") != "clock_step":
        raise OpError("bad_request", f"after_fork: expected a 'clock_step' frame, got "
                                     f"{reply.header!r:.120}; the clock is as the request set it")
    offset = reply.header.get("offset_ns")
    if (isinstance(offset, bool) or not isinstance(offset, int)
            or abs(offset) > MAX_CLOCK_STEP_NS):
        raise OpError("bad_request",
                      f"after_fork: 'offset_ns' must be an integer of magnitude at most "
                      f"{MAX_CLOCK_STEP_NS} (the step corrects a transit time), got "
                      f"{offset!r:.80}; the clock is as the request set it")
    previous = time.clock_gettime_ns(time.CLOCK_REALTIME)
    if offset == 0:
        return {"offset_ns": 0, "previous_ns": previous, "ns": previous}
    return {"offset_ns": offset, **system.set_time(previous + offset, previous)}


def _pong() -> dict[str, Any]:
    """What ``ping`` answers (``after_fork`` answers it too)."""
    return {"pong": True, "pid": os.getpid(), "version": __version__,
            "protocol": PROTOCOL_VERSION, "uptime": system.uptime(),
            "boot_id": system.boot_id()}
