"""Host-side client of the guest agent (stdlib only; the protocol is in ``protocol.py``).

``AgentClient`` opens one connection per call through a ``connect`` callable, so one
client serves any number of threads at once. Connectors:

* ``vsock_uds_connector(uds_path, port)`` — the VMM's vsock device exposed as a Unix
  socket, Firecracker style: send ``CONNECT <port>\\n``, expect ``OK <hostport>\\n``.
  The reply line is read one byte at a time: the agent may start talking right after
  it, and those bytes belong to the protocol, not to a read-ahead buffer.
* ``vsock_connector(cid, port)`` — AF_VSOCK directly (vhost-vsock hosts).
* ``unix_connector(path)`` — an agent served on a Unix socket (tests, ``main --unix``).

Errors: ``AgentError`` (the agent answered with an error; ``code`` is the protocol's
error code), and its subclasses ``AgentTimeout`` (an exec hit its timeout — the output
streamed until then is in ``stdout``/``stderr`` — or the agent went silent),
``AgentUnavailable`` (could not connect: not booted yet, or gone) and
``AgentProtocolError`` (a malformed reply or a connection cut mid-reply).
"""

from __future__ import annotations

import io
import json
import math
import select
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Self

from vmfork.agent.protocol import (
    AGENT_PORT,
    CHUNK_SIZE,
    MAX_CLOCK_STEP_NS,
    MAX_PAYLOAD,
    ConnectionClosed,
    Frame,
    ProtocolError,
    recv_frame,
    send_frame,
)

Connector = Callable[[], socket.socket]
OutputCallback = Callable[[bytes], None]
StdinSource = bytes | bytearray | memoryview | str | BinaryIO | Iterable[bytes]

EXEC_GRACE = 10.0
"""Seconds beyond an exec's own timeout that the client waits for the agent's reply."""

TRANSFER_DEADLINE = 3600.0
"""Seconds a whole file read or write may take, however steadily the agent answers."""
CELL_RESULT_BYTES = 9 << 20
"""A code-interpreter result's bundle (the agent keeps them under 8 MiB)."""

FILE_TYPES = frozenset({"file", "dir", "symlink", "fifo", "socket", "char", "block", "other"})


# -- typed reading of replies ------------------------------------------------------
#
# Everything an agent sends is data from the guest, which runs untrusted code. A reply
# is checked field by field before any of it is used: a value of the wrong type would
# otherwise travel on into HTTP headers, JSON bodies and arithmetic on the host (an
# agent that answered ``size: "1\r\nX-Injected: 1"`` once forged a response header).


def _field(r: Mapping[str, Any], key: str, kinds: tuple[type, ...], op: str | None,
           optional: bool) -> Any:
    value = r.get(key)
    if value is None:
        if optional:
            return None
        raise AgentProtocolError(f"the agent's reply lacks {key!r}", op=op)
    # bool is an int subclass; a count or a size of True is a lie, not a number.
    if isinstance(value, bool) and bool not in kinds:
        raise AgentProtocolError(f"the agent's {key!r} is a bool, expected "
                                 f"{'/'.join(k.__name__ for k in kinds)}", op=op)
    if not isinstance(value, kinds):
        raise AgentProtocolError(f"the agent's {key!r} is {type(value).__name__} "
                                 f"{value!r:.60}, expected "
                                 f"{'/'.join(k.__name__ for k in kinds)}", op=op)
    return value


def _int(r: Mapping[str, Any], key: str, op: str | None = None, *,
         minimum: int | None = None) -> int:
    value: int = _field(r, key, (int,), op, False)
    if minimum is not None and value < minimum:
        raise AgentProtocolError(f"the agent's {key!r} is {value}, below {minimum}", op=op)
    return value


def _opt_int(r: Mapping[str, Any], key: str, op: str | None = None, *,
             minimum: int | None = None) -> int | None:
    if r.get(key) is None:
        return None
    return _int(r, key, op, minimum=minimum)


def _num(r: Mapping[str, Any], key: str, op: str | None = None) -> float:
    value = _field(r, key, (int, float), op, False)
    if not math.isfinite(value):
        raise AgentProtocolError(f"the agent's {key!r} is not a finite number", op=op)
    return float(value)


def _str(r: Mapping[str, Any], key: str, op: str | None = None) -> str:
    value: str = _field(r, key, (str,), op, False)
    return value


def _opt_str(r: Mapping[str, Any], key: str, op: str | None = None) -> str | None:
    value: str | None = _field(r, key, (str,), op, True)
    return value


def _bool(r: Mapping[str, Any], key: str, op: str | None = None) -> bool:
    value: bool = _field(r, key, (bool,), op, False)
    return value


def _record(r: Mapping[str, Any], key: str, op: str | None = None) -> Mapping[str, Any]:
    value: Mapping[str, Any] = _field(r, key, (dict,), op, False)
    return value


# -- errors ------------------------------------------------------------------------


class AgentError(Exception):
    """The agent (or the path to it) failed an op. ``code`` is the protocol error code
    (``not_found``, ``timeout``, ``bad_request``, ``os_error``, …), ``op`` the op, and
    ``details`` the error frame's other fields (``errno``, ``path``, ``exit_code``…)."""

    def __init__(self, code: str, message: str, *, op: str | None = None,
                 details: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{op}: {message}" if op and not message.startswith(op) else message)
        self.code = code
        self.message = message
        self.op = op
        self.details: dict[str, Any] = dict(details or {})

    @property
    def errno(self) -> int | None:
        value = self.details.get("errno")
        return value if isinstance(value, int) else None

    @property
    def path(self) -> str | None:
        value = self.details.get("path")
        return value if isinstance(value, str) else None


class AgentTimeout(AgentError):
    """An exec exceeded its ``timeout`` (its process group was killed), or the agent sent
    nothing for too long. ``stdout``/``stderr`` hold the output received before."""

    def __init__(self, message: str, *, op: str | None = None, timeout: float | None = None,
                 stdout: bytes = b"", stderr: bytes = b"",
                 details: Mapping[str, Any] | None = None) -> None:
        super().__init__("timeout", message, op=op, details=details)
        self.timeout = timeout
        self.stdout = stdout
        self.stderr = stderr


class AgentUnavailable(AgentError):
    """No connection to the agent: the VM is not up yet, the agent is not listening
    yet, or the VM is gone. ``wait_until_ready`` retries on this."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message)


class AgentProtocolError(AgentError):
    """The agent's reply broke the protocol, or the connection ended mid-reply."""

    def __init__(self, message: str, *, op: str | None = None) -> None:
        super().__init__("protocol", message, op=op)


# -- results -----------------------------------------------------------------------


@dataclass(frozen=True)
class PingResult:
    pid: int
    version: str
    protocol: int
    uptime: float
    """Seconds since the guest booted."""
    boot_id: str | None

    @classmethod
    def from_reply(cls, r: Mapping[str, Any]) -> PingResult:
        return cls(pid=_int(r, "pid", "ping", minimum=0), version=_str(r, "version", "ping"),
                   protocol=_int(r, "protocol", "ping"), uptime=_num(r, "uptime", "ping"),
                   boot_id=_opt_str(r, "boot_id", "ping"))


@dataclass(frozen=True)
class ExecResult:
    stdout: bytes
    stderr: bytes
    exit_code: int
    """The exit status, or -N if the process was killed by signal N."""
    signal: int | None
    pid: int
    duration: float
    """Seconds from spawn to exit."""
    truncated: bool = False
    """The output went past the call's ``max_output``: ``stdout``/``stderr`` hold its
    first bytes only (callbacks still got all of it)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class EvalException:
    type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class EvalResult:
    value: str | None
    """``repr`` of the value of the code's trailing expression; None if it had none."""
    stdout: str
    stderr: str
    exception: EvalException | None
    value_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exception is None


@dataclass(frozen=True)
class FileInfo:
    name: str
    type: str
    """``file``, ``dir``, ``symlink``, ``fifo``, ``socket``, ``char``, ``block``, ``other``."""
    size: int
    mode: int
    """Permission bits (``0o644``)."""
    mtime: float
    target: str | None = None
    """A symlink's target."""
    path: str | None = None
    uid: int | None = None
    gid: int | None = None
    nlink: int | None = None

    @classmethod
    def from_fields(cls, fields: Any, op: str | None = None) -> FileInfo:
        """Checks every field's type and range (see "typed reading of replies")."""
        if not isinstance(fields, dict):
            raise AgentProtocolError(f"a file entry is {type(fields).__name__}, expected an "
                                     "object", op=op)
        kind = _str(fields, "type", op)
        if kind not in FILE_TYPES:
            raise AgentProtocolError(f"unknown file type {kind!r:.40}", op=op)
        mode = _int(fields, "mode", op, minimum=0)
        if mode > 0o7777:
            raise AgentProtocolError(f"file mode {mode:#o} has bits beyond 0o7777", op=op)
        return cls(name=_str(fields, "name", op), type=kind,
                   size=_int(fields, "size", op, minimum=0), mode=mode,
                   mtime=_num(fields, "mtime", op), target=_opt_str(fields, "target", op),
                   path=_opt_str(fields, "path", op),
                   uid=_opt_int(fields, "uid", op, minimum=0),
                   gid=_opt_int(fields, "gid", op, minimum=0),
                   nlink=_opt_int(fields, "nlink", op, minimum=0))


@dataclass(frozen=True)
class Listing:
    entries: list[FileInfo]
    truncated: bool
    """The directory has more entries than the call's ``max_entries``."""


@dataclass(frozen=True)
class ReseedResult:
    bytes: int
    entropy_bits: int
    kernel_reseeded: bool


@dataclass(frozen=True)
class NetRefreshResult:
    interface: str | None
    connections_aborted: int
    neighbours_flushed: int

    @classmethod
    def from_reply(cls, r: Mapping[str, Any]) -> NetRefreshResult:
        op = "net_refresh"
        return cls(interface=_opt_str(r, "interface", op),
                   connections_aborted=_int(r, "connections_aborted", op, minimum=0),
                   neighbours_flushed=_int(r, "neighbours_flushed", op, minimum=0))


@dataclass(frozen=True)
class AfterForkResult:
    ping: PingResult
    reseed: ReseedResult
    net: NetRefreshResult | None
    previous_ns: int
    """The guest's wall clock just before it was set."""
    clock_error_bound_ns: int
    """The most the guest's clock can be off after the call: the round trip (net of
    the guest's processing when the agent took part in the clock exchange), or half
    the round trip of the correction ``after_fork`` made when that was too long."""
    clock_step_ns: int
    """The correction applied after the clock was set (0: none was needed, or none
    arrived in time and the round trip was within tolerance)."""


@dataclass(frozen=True)
class ProcessInfo:
    """A background process (``start``), as ``ps`` lists it."""

    pid: int
    argv: list[str]
    cwd: str | None
    tag: str | None
    pty: bool
    started_at: float
    running: bool
    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdin_open: bool
    output_bytes: int

    @classmethod
    def from_fields(cls, fields: Any) -> ProcessInfo:
        op = "ps"
        if not isinstance(fields, dict):
            raise AgentProtocolError("a process entry is not an object", op=op)
        argv = fields.get("argv")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise AgentProtocolError("a process entry's argv is not a list of strings", op=op)
        return cls(pid=_int(fields, "pid", op, minimum=1), argv=argv,
                   cwd=_opt_str(fields, "cwd", op), tag=_opt_str(fields, "tag", op),
                   pty=_bool(fields, "pty", op), started_at=_num(fields, "started_at", op),
                   running=_bool(fields, "running", op),
                   exit_code=_opt_int(fields, "exit_code", op, minimum=-64),
                   signal=_opt_int(fields, "signal", op, minimum=0),
                   timed_out=_bool(fields, "timed_out", op),
                   stdin_open=_bool(fields, "stdin_open", op),
                   output_bytes=_int(fields, "output_bytes", op, minimum=0))


@dataclass(frozen=True)
class ProcessOutput:
    """A chunk of a background process's output, from ``attach``."""

    stream: str
    """``stdout``, ``stderr`` or ``pty``."""
    offset: int
    """Where ``data`` starts in the process's output (reattach from ``offset + len``)."""
    data: bytes


@dataclass(frozen=True)
class ProcessEnd:
    """How a background process ended (the last item ``attach`` yields)."""

    pid: int
    exit_code: int
    signal: int | None
    timed_out: bool
    duration: float
    offset: int
    """The end of its output."""
    skipped: int
    """Bytes of output this attach never saw: scrolled out of the agent's buffer."""


@dataclass(frozen=True)
class WatchEvent:
    name: str
    """Relative to the watched directory."""
    type: str
    """``create``, ``write``, ``remove``, ``rename_from``, ``rename_to``, ``chmod``."""
    is_dir: bool


WATCH_EVENT_TYPES = frozenset({"create", "write", "remove", "rename_from", "rename_to",
                               "chmod"})
OUTPUT_STREAMS = frozenset({"stdout", "stderr", "pty"})


# -- connectors --------------------------------------------------------------------


def unix_connector(path: str, timeout: float = 5.0) -> Connector:
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as err:
            sock.close()
            raise AgentUnavailable(f"connect to agent socket {path!r}: {err}") from err
        return sock
    return connect


def vsock_connector(cid: int, port: int = AGENT_PORT, timeout: float = 5.0) -> Connector:
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect((cid, port))
        except OSError as err:
            sock.close()
            raise AgentUnavailable(f"connect to vsock {cid}:{port}: {err}") from err
        return sock
    return connect


def vsock_uds_connector(uds_path: str, port: int = AGENT_PORT,
                        timeout: float = 5.0) -> Connector:
    """Connect through a VMM's vsock Unix socket (``CONNECT <port>\\n`` → ``OK <n>\\n``).
    ``timeout`` bounds the connect and the handshake, in seconds."""

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            try:
                sock.connect(uds_path)
            except OSError as err:
                raise AgentUnavailable(f"connect to the VMM's vsock socket {uds_path!r}: "
                                       f"{err}") from err
            try:
                sock.sendall(f"CONNECT {port}\n".encode())
                line = bytearray()
                # Up to the '\n' and no further (what follows is the agent's): peek at
                # what has come, then take the line's part of it (one or two calls, not
                # one per byte).
                while not line.endswith(b"\n") and len(line) < 64:
                    peek = sock.recv(64 - len(line), socket.MSG_PEEK)
                    if not peek:
                        break
                    newline = peek.find(b"\n")
                    line += sock.recv(newline + 1 if newline >= 0 else len(peek))
            except OSError as err:
                raise AgentUnavailable(f"vsock handshake on {uds_path!r} for port {port}: "
                                       f"{err}") from err
            if not (line.startswith(b"OK ") and line.endswith(b"\n")):
                why = (f"replied {bytes(line)!r}" if line
                       else "closed the connection (nothing listening on the port yet?)")
                raise AgentUnavailable(f"vsock CONNECT {port} via {uds_path!r}: the VMM "
                                       f"{why}; expected 'OK <port>'")
        except BaseException:
            sock.close()
            raise
        return sock

    return connect


# -- the client --------------------------------------------------------------------


class _Call:
    """One op on one connection."""

    def __init__(self, op: str, sock: socket.socket, timeout: float | None,
                 deadline: float | None = None) -> None:
        self.op = op
        self.sock = sock
        sock.settimeout(timeout)
        self.timeout = timeout
        self.deadline = deadline
        """A ``time.monotonic()`` instant by which the whole call must be over."""
        self.frames = 0

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        send_frame(self.sock, header, payload)

    def recv(self) -> Frame:
        """The agent's next frame; an ``error`` frame is raised as ``AgentError``."""
        try:
            frame = recv_frame(self.sock, self.deadline)
        except ConnectionClosed as err:
            if err.clean and self.frames == 0:
                # Nothing at all came back: during boot the VMM may accept before the
                # agent listens; later, the agent or the VM is gone. Retryable.
                raise AgentUnavailable(f"{self.op}: the connection closed before the agent "
                                       "replied (agent not listening yet, or gone)") from err
            raise AgentProtocolError(f"the agent closed the connection before its final "
                                     f"frame ({err.message})", op=self.op) from err
        except ProtocolError as err:
            raise AgentProtocolError(f"malformed frame from the agent: {err.message}",
                                     op=self.op) from err
        except TimeoutError as err:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise AgentTimeout("the agent did not finish the call within its deadline",
                                   op=self.op, timeout=self.timeout) from err
            raise AgentTimeout(f"no reply from the agent within {self.timeout} s",
                               op=self.op, timeout=self.timeout) from err
        except OSError as err:
            raise AgentProtocolError(f"connection to the agent failed: {err}",
                                     op=self.op) from err
        self.frames += 1
        if frame.type == "error":
            raise _error_from(self.op, frame.header)
        return frame

    def expect(self, kind: str) -> Frame:
        frame = self.recv()
        if frame.type != kind:
            raise AgentProtocolError(f"expected a {kind!r} frame, got {frame.header!r:.200}",
                                     op=self.op)
        return frame

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _error_from(op: str, header: Mapping[str, Any]) -> AgentError:
    code = str(header.get("error", "unknown"))
    message = str(header.get("message", "(no message)"))
    details = {k: v for k, v in header.items() if k not in ("type", "error", "message")}
    if code == "timeout":
        return AgentTimeout(message, op=op, timeout=details.get("timeout"), details=details)
    return AgentError(code, message, op=op, details=details)


def _chunks(source: StdinSource) -> Iterator[bytes]:
    """Split any stdin/data source into frames of at most ``CHUNK_SIZE`` bytes."""
    if isinstance(source, str):
        source = source.encode("utf-8")
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source).cast("B")
        for start in range(0, len(view), CHUNK_SIZE):
            yield bytes(view[start:start + CHUNK_SIZE])
        return
    read = getattr(source, "read", None)
    if read is not None:
        while chunk := read(CHUNK_SIZE):
            yield bytes(chunk)
        return
    for piece in source:
        if not isinstance(piece, (bytes, bytearray, memoryview)):
            raise TypeError(f"stdin/data iterables must yield bytes, got "
                            f"{type(piece).__name__}")
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), MAX_PAYLOAD):
            yield bytes(view[start:start + MAX_PAYLOAD])


CLOCK_EXCHANGE_MAX_BOUND_NS = 250_000_000
"""The longest half round trip ``after_fork``'s clock exchange corrects by itself;
beyond it the host corrects with a bracketed ``sync_clock`` instead (``after_fork``)."""


def clock_exchange_step(sent_ns: int, guest_ns: int, processing_ns: int,
                        received_ns: int) -> tuple[int, int]:
    """``after_fork``'s clock exchange, NTP style: ``(step, round trip)`` in ns.

    The host sent the request at ``sent_ns`` (T1) and the agent set its clock to that
    on arrival; the agent read ``guest_ns`` (T3) just before answering,
    ``processing_ns`` after setting the clock; the host received the answer at
    ``received_ns`` (T4). With T2 = T3 - processing (the guest's clock when it was
    set), the guest is behind by ``((T1 - T2) + (T4 - T3)) / 2``, give or take half
    the round trip net of the processing, ``(T4 - T1) - processing``. The processing
    time comes from the guest, so it is kept within the round trip: a lie can move
    only the guest's own clock, never make the host's error bound negative.
    """
    processing = min(max(processing_ns, 0), max(received_ns - sent_ns, 0))
    guest_set = guest_ns - processing
    step = ((sent_ns - guest_set) + (received_ns - guest_ns)) // 2
    return step, max(received_ns - sent_ns - processing, 0)


class AgentClient:
    """Talks to one guest agent. Every method opens its own connection.

    ``io_timeout`` (seconds) bounds how long any call other than ``exec``/``eval`` waits
    for the agent's next frame; ``exec`` waits up to its own ``timeout`` plus
    ``EXEC_GRACE`` (forever without one), ``eval`` up to its ``timeout``.
    """

    def __init__(self, connect: Connector, *, io_timeout: float | None = 60.0) -> None:
        self._connect = connect
        self.io_timeout = io_timeout
        self._protocol: int | None = None

    def _open(self, op: str, request: dict[str, Any], payload: bytes = b"",
              timeout: float | None = None, deadline: float | None = None) -> _Call:
        try:
            sock = self._connect()
        except AgentError:
            raise
        except OSError as err:
            raise AgentUnavailable(f"{op}: cannot connect to the agent: {err}") from err
        call = _Call(op, sock, timeout, deadline)
        try:
            call.send({"op": op, **request}, payload)
        except ProtocolError as err:
            call.close()
            raise AgentError(err.code, err.message, op=op) from err
        except OSError as err:
            call.close()
            raise AgentUnavailable(f"{op}: sending the request: {err}") from err
        return call

    def _simple(self, op: str, payload: bytes = b"", **request: Any) -> dict[str, Any]:
        call = self._open(op, request, payload, self.io_timeout, self._deadline(self.io_timeout))
        try:
            return call.expect("result").header
        finally:
            call.close()

    @staticmethod
    def _deadline(seconds: float | None) -> float | None:
        return None if seconds is None else time.monotonic() + seconds

    # -- ops -----------------------------------------------------------------------

    def ping(self) -> PingResult:
        return PingResult.from_reply(self._simple("ping"))

    def wait_until_ready(self, timeout: float, interval: float = 0.02) -> PingResult:
        """Ping until the agent answers (the guest is booting). Raises
        ``AgentUnavailable`` with the last failure after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.ping()
            except (AgentUnavailable, AgentProtocolError, AgentTimeout) as err:
                if time.monotonic() + interval >= deadline:
                    raise AgentUnavailable(f"the agent did not answer within {timeout:g} s; "
                                           f"last error: {err}") from err
            time.sleep(interval)

    def exec(self, argv_or_cmd: str | Sequence[str], *,
             env: Mapping[str, str | None] | None = None, cwd: str | None = None,
             stdin: StdinSource | None = None, timeout: float | None = None,
             on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
             capture: bool = True, max_output: int | None = None) -> ExecResult:
        """Run a program: ``argv_or_cmd`` is an argv list, or a string for ``/bin/sh -c``.

        ``env`` is merged over the guest's default environment (a None value unsets);
        ``stdin`` is streamed to the process (bytes, str, a binary file, or an iterable
        of bytes); ``timeout`` is in seconds (None: no limit) — when it passes, the
        process group is killed and ``AgentTimeout`` carries the output so far.
        ``on_stdout``/``on_stderr`` get each chunk as the process writes it;
        ``capture=False`` keeps the result's stdout/stderr empty (for huge outputs);
        ``max_output`` caps the bytes kept in stdout + stderr together (the result says
        ``truncated``; callbacks see everything). With a ``timeout`` the whole call is
        over by ``timeout + EXEC_GRACE`` seconds, however the agent paces its frames.
        A missing program raises ``AgentError`` with code ``not_found`` (and
        ``details["exit_code"] == 127``); a non-zero exit is a normal result.
        """
        request: dict[str, Any] = {"stdin": stdin is not None, "timeout": timeout}
        if isinstance(argv_or_cmd, str):
            request["cmd"] = argv_or_cmd
        else:
            request["argv"] = list(argv_or_cmd)
        if env is not None:
            request["env"] = dict(env)
        if cwd is not None:
            request["cwd"] = cwd
        wait = None if timeout is None else timeout + EXEC_GRACE
        if self.io_timeout is not None and wait is not None:
            wait = max(wait, self.io_timeout)
        call = self._open("exec", request, timeout=wait,
                          deadline=self._deadline(None if timeout is None
                                                  else timeout + EXEC_GRACE))
        out: list[bytes] = []
        err: list[bytes] = []
        room = max_output
        truncated = False
        feeder: threading.Thread | None = None
        feed_error: list[BaseException] = []
        try:
            try:
                started = call.expect("started")
                if stdin is not None:
                    feeder = threading.Thread(target=self._feed, args=(call, stdin, feed_error),
                                              name="agent-exec-stdin", daemon=True)
                    feeder.start()
                while True:
                    frame = call.recv()
                    if frame.type in ("stdout", "stderr"):
                        is_out = frame.type == "stdout"
                        if capture:
                            data = frame.payload
                            if room is not None:
                                if len(data) > room:
                                    data, truncated = data[:room], True
                                room -= len(data)
                            if data:
                                (out if is_out else err).append(data)
                        callback = on_stdout if is_out else on_stderr
                        if callback is not None:
                            callback(frame.payload)
                    elif frame.type == "result":
                        break
                    else:
                        raise AgentProtocolError(f"unexpected frame {frame.header!r:.200}",
                                                 op="exec")
            except AgentTimeout as exc:
                raise AgentTimeout(exc.message, op="exec", timeout=exc.timeout,
                                   stdout=b"".join(out), stderr=b"".join(err),
                                   details=exc.details) from None
        finally:
            call.close()
            if feeder is not None:
                feeder.join()
        if feed_error:
            raise feed_error[0]
        r = frame.header
        pid = _opt_int(r, "pid", "exec", minimum=0)
        return ExecResult(stdout=b"".join(out), stderr=b"".join(err),
                          exit_code=_int(r, "exit_code", "exec"),
                          signal=_opt_int(r, "signal", "exec", minimum=0),
                          pid=_int(started.header, "pid", "exec", minimum=0)
                          if pid is None else pid,
                          duration=_num(r, "duration", "exec") if "duration" in r else 0.0,
                          truncated=truncated)

    @staticmethod
    def _feed(call: _Call, source: StdinSource, errors: list[BaseException]) -> None:
        try:
            for chunk in _chunks(source):
                call.send({"type": "data"}, chunk)
            call.send({"type": "eof"})
        except OSError:
            pass  # the exec ended (or the process stopped reading): the agent hung up
        except BaseException as exc:  # noqa: BLE001 - the caller's source failed; report
            errors.append(exc)
            try:
                call.send({"type": "eof"})
            except OSError:
                pass

    def eval(self, code: str, *, timeout: float | None = None) -> EvalResult:
        """Run Python in the agent's interpreter (globals persist between calls).

        ``timeout`` (seconds) only bounds how long this call waits: the code itself
        cannot be interrupted and keeps running in the guest."""
        call = self._open("eval", {"code": code}, timeout=timeout,
                          deadline=self._deadline(timeout))
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            while True:
                frame = call.recv()
                if frame.type == "stdout":
                    out.append(frame.payload)
                elif frame.type == "stderr":
                    err.append(frame.payload)
                elif frame.type == "result":
                    break
                else:
                    raise AgentProtocolError(f"unexpected frame {frame.header!r:.200}",
                                             op="eval")
        finally:
            call.close()
        r = frame.header
        exc = r.get("exception")
        exception = None
        if exc is not None:
            exc = _record(r, "exception", "eval")
            exception = EvalException(_str(exc, "type", "eval"), _str(exc, "message", "eval"),
                                      _str(exc, "traceback", "eval"))
        return EvalResult(
            value=_opt_str(r, "value", "eval"),
            stdout=b"".join(out).decode("utf-8", "replace"),
            stderr=b"".join(err).decode("utf-8", "replace"),
            exception=exception,
            value_truncated=bool(r.get("value_truncated")))

    # -- files ---------------------------------------------------------------------

    def read_file_to(self, path: str, fileobj: BinaryIO, *, offset: int = 0,
                     length: int | None = None) -> int:
        """Stream a guest file into ``fileobj`` chunk by chunk; returns bytes written."""
        call = self._open("read", {"path": path, "offset": offset, "length": length},
                          timeout=self.io_timeout, deadline=self._deadline(TRANSFER_DEADLINE))
        written = 0
        try:
            while True:
                frame = call.recv()
                if frame.type == "data":
                    fileobj.write(frame.payload)
                    written += len(frame.payload)
                elif frame.type == "result":
                    break
                else:
                    raise AgentProtocolError(f"unexpected frame {frame.header!r:.200}",
                                             op="read")
        finally:
            call.close()
        if frame.header.get("size") != written:
            raise AgentProtocolError(f"read {path!r}: got {written} bytes, the agent says it "
                                     f"sent {frame.header.get('size')}", op="read")
        return written

    def read_file(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        buf = io.BytesIO()
        self.read_file_to(path, buf, offset=offset, length=length)
        return buf.getvalue()

    def write_file(self, path: str, data: bytes | str | BinaryIO | Iterable[bytes], *,
                   mode: int = 0o644, make_parents: bool = False,
                   user: str | None = None) -> int:
        """Atomically replace the guest file ``path`` with ``data`` (bytes, str as
        UTF-8, a binary file, or an iterable of bytes), streamed in chunks. ``mode`` is
        applied exactly; ``user`` (a guest user name) owns the file and the parents
        made for it. Returns the number of bytes written."""
        request: dict[str, Any] = {"path": path, "mode": mode, "make_parents": make_parents}
        if user is not None:
            self._need_protocol(3, "write", "writing a file as a user")
            request["user"] = user
        call = self._open("write", request,
                          timeout=self.io_timeout, deadline=self._deadline(TRANSFER_DEADLINE))
        try:
            call.expect("ready")
            sent = 0
            try:
                for chunk in _chunks(data):
                    call.send({"type": "data"}, chunk)
                    sent += len(chunk)
                call.send({"type": "eof"})
            except OSError as err:
                # The agent gave up (disk full…) and hung up: its error frame says why.
                call.recv()
                raise AgentProtocolError(f"write {path!r}: the connection broke after "
                                         f"{sent} bytes: {err}", op="write") from err
            result = call.expect("result").header
        finally:
            call.close()
        if result.get("size") != sent:
            raise AgentProtocolError(f"write {path!r}: sent {sent} bytes, the agent wrote "
                                     f"{result.get('size')}", op="write")
        return sent

    def list_dir(self, path: str) -> list[FileInfo]:
        return self.list_dir_bounded(path).entries

    def list_dir_bounded(self, path: str, max_entries: int | None = None) -> Listing:
        """The entries of a guest directory, at most ``max_entries`` of them (the rest
        are not read: the connection is closed), within ``io_timeout`` overall."""
        call = self._open("list", {"path": path}, timeout=self.io_timeout,
                          deadline=self._deadline(self.io_timeout))
        entries: list[FileInfo] = []
        try:
            while True:
                frame = call.recv()
                if frame.type == "entries":
                    batch = frame.header.get("entries")
                    if not isinstance(batch, list):
                        raise AgentProtocolError("an entries frame without an entries list",
                                                 op="list")
                    for fields in batch:
                        if max_entries is not None and len(entries) >= max_entries:
                            return Listing(entries, truncated=True)
                        entries.append(FileInfo.from_fields(fields, "list"))
                elif frame.type == "result":
                    return Listing(entries, truncated=False)
                else:
                    raise AgentProtocolError(f"unexpected frame {frame.header!r:.200}",
                                             op="list")
        finally:
            call.close()

    def stat(self, path: str, *, follow_symlinks: bool = True) -> FileInfo:
        r = self._simple("stat", path=path, follow_symlinks=follow_symlinks)
        return FileInfo.from_fields(r.get("stat"), "stat")

    def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False) -> None:
        self._simple("remove", path=path, recursive=recursive, missing_ok=missing_ok)

    def mkdir(self, path: str, *, parents: bool = False, mode: int = 0o755,
              user: str | None = None) -> None:
        """Make a guest directory (``parents``: and its missing parents, like
        ``mkdir -p``), owned by ``user`` (a guest user name) if given."""
        fields: dict[str, Any] = {"path": path, "parents": parents, "mode": mode}
        if user is not None:
            self._need_protocol(3, "mkdir", "making a directory as a user")
            fields["user"] = user
        self._simple("mkdir", **fields)

    def _need_protocol(self, version: int, op: str, what: str) -> None:
        """Refuse, before anything runs, what an older agent would silently do
        differently: an agent before protocol 3 ignores ``user`` (and would act as
        root). The agent's protocol is asked once per client."""
        if self._protocol is None:
            self._protocol = self.ping().protocol
        if self._protocol < version:
            raise AgentError("unsupported", f"{what} needs guest agent protocol {version}; "
                             f"this sandbox's agent speaks {self._protocol} (its snapshot "
                             "was made by an older vmfork: make it again)", op=op)

    # -- background processes ------------------------------------------------------

    def start(self, argv_or_cmd: str | Sequence[str], *,
              env: Mapping[str, str | None] | None = None, cwd: str | None = None,
              stdin: bool = False, timeout: float | None = None,
              pty: tuple[int, int] | None = None, tag: str | None = None,
              user: str | None = None) -> int:
        """Start a background process (it outlives this call); returns its pid.

        ``stdin`` keeps its stdin open for ``send_stdin``; ``pty=(rows, cols)`` runs it
        on a pseudo-terminal (output is one ``pty`` stream, stdin always open);
        ``timeout`` kills its process group after that many seconds; ``user`` (a guest
        user name) runs it as that user, in its home unless ``cwd`` is given."""
        request: dict[str, Any] = {"stdin": stdin, "timeout": timeout, "tag": tag}
        if user is not None:
            self._need_protocol(3, "start", "running a process as a user")
            request["user"] = user
        if isinstance(argv_or_cmd, str):
            request["cmd"] = argv_or_cmd
        else:
            request["argv"] = list(argv_or_cmd)
        if env is not None:
            request["env"] = dict(env)
        if cwd is not None:
            request["cwd"] = cwd
        if pty is not None:
            request["pty"] = {"rows": pty[0], "cols": pty[1]}
        return _int(self._simple("start", **request), "pid", "start", minimum=1)

    def attach(self, pid: int, *, offset: int = 0,
               idle_timeout: float | None = None
               ) -> Generator[ProcessOutput | ProcessEnd, None, None]:
        """Follow a background process's output from ``offset`` (what the agent still
        keeps of it, then live) until it ends: yields ``ProcessOutput`` chunks and
        finally one ``ProcessEnd``. Closing the iterator early detaches; the process
        goes on. ``idle_timeout`` bounds the wait for each frame (None: a silent
        process may be waited for indefinitely)."""
        op = "attach"
        call = self._open(op, {"pid": pid, "offset": offset}, timeout=idle_timeout)
        try:
            call.expect("attached")
            while True:
                frame = call.recv()
                if frame.type in OUTPUT_STREAMS:
                    yield ProcessOutput(frame.type, _int(frame.header, "offset", op, minimum=0),
                                        frame.payload)
                elif frame.type == "result":
                    r = frame.header
                    yield ProcessEnd(pid=_int(r, "pid", op, minimum=1),
                                     exit_code=_int(r, "exit_code", op, minimum=-64),
                                     signal=_opt_int(r, "signal", op, minimum=0),
                                     timed_out=_bool(r, "timed_out", op),
                                     duration=_num(r, "duration", op),
                                     offset=_int(r, "offset", op, minimum=0),
                                     skipped=_int(r, "skipped", op, minimum=0))
                    return
                else:
                    raise AgentProtocolError(f"unexpected frame {frame.header!r:.200}", op=op)
        finally:
            call.close()

    def wait_process(self, pid: int, *, timeout: float | None = None) -> tuple[bytes, bytes,
                                                                              ProcessEnd]:
        """Attach from the start and collect everything: (stdout, stderr or pty, end)."""
        out: list[bytes] = []
        err: list[bytes] = []
        for item in self.attach(pid, idle_timeout=timeout):
            if isinstance(item, ProcessEnd):
                return b"".join(out), b"".join(err), item
            (err if item.stream == "stderr" else out).append(item.data)
        raise AgentProtocolError("attach ended without the process's end", op="attach")

    def send_stdin(self, pid: int, data: bytes | str, *, eof: bool = False) -> int:
        """Write ``data`` to a background process's stdin (≤ 1 MiB per call);
        ``eof`` closes it afterwards. Returns the bytes written."""
        payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        r = self._simple("send_stdin", payload, pid=pid, eof=eof)
        return _int(r, "written", "send_stdin", minimum=0)

    def close_stdin(self, pid: int) -> None:
        self._simple("send_stdin", pid=pid, eof=True)

    def signal(self, pid: int, signal: str | int = "SIGKILL", *, group: bool = True) -> bool:
        """Send ``signal`` to a background process (its whole group unless ``group``
        is false). Returns whether it was delivered (False: it had already exited)."""
        r = self._simple("signal", pid=pid, signal=signal, group=group)
        return _bool(r, "delivered", "signal")

    def resize_pty(self, pid: int, rows: int, cols: int) -> None:
        self._simple("pty_resize", pid=pid, rows=rows, cols=cols)

    def processes(self) -> list[ProcessInfo]:
        entries = self._simple("ps").get("processes")
        if not isinstance(entries, list):
            raise AgentProtocolError("ps: the reply has no processes list", op="ps")
        return [ProcessInfo.from_fields(entry) for entry in entries]

    def rename(self, path: str, new_path: str, *, overwrite: bool = False) -> None:
        self._simple("rename", path=path, new_path=new_path, overwrite=overwrite)

    def watch(self, path: str, *, recursive: bool = False) -> DirWatch:
        """Watch a guest directory; the returned ``DirWatch`` is active (changes from
        now on are reported) and must be closed."""
        call = self._open("watch", {"path": path, "recursive": recursive},
                          timeout=self.io_timeout)
        try:
            ready = call.expect("watching")
        except BaseException:
            call.close()
            raise
        return DirWatch(call, _int(ready.header, "directories", "watch", minimum=0))


    # -- system --------------------------------------------------------------------

    def reseed(self, data: bytes, *, entropy_bits: int | None = None) -> ReseedResult:
        """Mix ``data`` (fresh host randomness, ≤ 1 MiB) into the guest kernel's CRNG,
        crediting ``entropy_bits`` (default: 8 per byte), and reseed ``random``."""
        request: dict[str, Any] = {}
        if entropy_bits is not None:
            request["entropy_bits"] = entropy_bits
        return _reseed_result(self._simple("reseed", bytes(data), **request))

    def net_refresh(self) -> NetRefreshResult:
        """Tell the guest it was just forked: abort the TCP connections it inherited
        (RST to their peers; loopback and listening sockets stay) and flush its
        neighbour cache. vsock (this channel) is not affected."""
        return NetRefreshResult.from_reply(self._simple("net_refresh"))

    def mount_volume(self, device: int, guest_path: str, *, read_only: bool,
                     sectors: int) -> dict[str, Any]:
        """Have the guest mount the disk of virtio-mmio device ``device`` (a volume
        slot, ``Machine.volume_devices``; ``sectors`` 512-byte sectors) at
        ``guest_path``; waits in the guest until the disk shows up. Returns the
        agent's ``{device, fstype, guest_path, read_only, sectors}``."""
        return self._simple("mount_volume", device=device, guest_path=guest_path,
                            read_only=read_only, sectors=sectors)

    def cell(self, code: str, *, context: str | None = None, timeout: float,
             env: Mapping[str, str] | None = None, idle: float | None = None
             ) -> Generator[tuple[str, Any], None, None]:
        """Run a code-interpreter cell (``agent/interpreter.py``), as it goes:
        ``("started", context_id)`` first (an unknown context raises ``AgentError``
        ``not_found`` before it), then ``("stdout" | "stderr", (text, ts_ns))``,
        ``("result", bundle)`` and at the end ``("end", {execution_count, error,
        output_truncated})``; with ``idle``, ``("idle", None)`` after each ``idle``
        seconds without a frame (so a caller can check on its own client). Closing the
        iterator early hangs up, which interrupts the cell. A result's bundle is at most
        ``CELL_RESULT_BYTES`` of JSON."""
        request: dict[str, Any] = {"code": code, "context": context, "timeout": timeout}
        if env:
            request["env"] = dict(env)
        call = self._open("cell", request, timeout=timeout + EXEC_GRACE,
                          deadline=self._deadline(timeout + EXEC_GRACE))
        try:
            started = call.expect("started")
            yield "started", _str(started.header, "context", "cell")
            pieces: list[bytes] = []
            size = 0
            while True:
                # Readable: a frame has begun (the agent sends each whole), so the
                # blocking read that follows cannot be cut inside one.
                while idle is not None and not select.select([call.sock], [], [], idle)[0]:
                    yield "idle", None
                frame = call.recv()
                if frame.type in ("stdout", "stderr"):
                    yield frame.type, (frame.payload.decode("utf-8", "replace"),
                                       _int(frame.header, "ts", "cell", minimum=0))
                elif frame.type == "display":
                    size += len(frame.payload)
                    if size > CELL_RESULT_BYTES:
                        raise AgentProtocolError(f"cell: a result over {CELL_RESULT_BYTES} "
                                                 "bytes", op="cell")
                    pieces.append(frame.payload)
                    if not frame.header.get("more"):
                        try:
                            bundle = json.loads(b"".join(pieces))
                        except ValueError as err:
                            raise AgentProtocolError(f"cell: a malformed result: {err}",
                                                     op="cell") from err
                        if not isinstance(bundle, dict):
                            raise AgentProtocolError("cell: a result is not an object",
                                                     op="cell")
                        pieces, size = [], 0
                        yield "result", bundle
                elif frame.type == "result":
                    yield "end", frame.header
                    return
                else:
                    raise AgentProtocolError(f"unexpected frame {frame.header!r:.200}",
                                             op="cell")
        finally:
            call.close()

    def code_contexts(self, action: str, **fields: Any) -> dict[str, Any]:
        """The code interpreter's contexts: ``list``, ``create`` (``cwd``), ``remove``
        and ``restart`` (``context``); the agent's ``result`` (``agent/interpreter.py``)."""
        return self._simple("contexts", action=action, **fields)

    def export_upper(self, fileobj: BinaryIO, *, max_bytes: int,
                     max_members: int) -> dict[str, Any]:
        """Stream a build VM's root overlay changes, as an OCI layer tar, into
        ``fileobj`` (``agent/upper.py``); at most ``max_bytes`` are accepted. Returns
        the agent's ``{size, members, file_bytes, whiteouts, opaque_dirs}``."""
        call = self._open("export_upper", {"max_bytes": max_bytes, "max_members": max_members},
                          timeout=self.io_timeout, deadline=self._deadline(TRANSFER_DEADLINE))
        written = 0
        # The tar's headers and padding come on top of the file data.
        cap = max_bytes + max_members * 2048 + (1 << 20)
        try:
            while True:
                frame = call.recv()
                if frame.type == "data":
                    written += len(frame.payload)
                    if written > cap:
                        raise AgentProtocolError(f"export_upper: the guest sent over {cap} "
                                                 "bytes", op="export_upper")
                    fileobj.write(frame.payload)
                elif frame.type == "result":
                    break
                else:
                    raise AgentProtocolError(f"unexpected frame {frame.header!r:.200}",
                                             op="export_upper")
        finally:
            call.close()
        if frame.header.get("size") != written:
            raise AgentProtocolError(f"export_upper: got {written} bytes, the agent says it "
                                     f"sent {frame.header.get('size')}", op="export_upper")
        return dict(frame.header)

    def after_fork(self, data: bytes, *, net_refresh: bool = False,
                   clock_tolerance_ns: int = 50_000_000) -> AfterForkResult:
        """Everything a restored child needs in one connection: set the guest's clock
        to the host's, mix ``data`` into its RNGs (as ``reseed``), and refresh its
        network (as ``net_refresh``) if asked.

        The clock is set to the host's time at sending, so it ends up behind by the
        request's transit time. The agent then sends its clock reading on the same
        connection and the host answers with a step (the op's ``clock_exchange``):
        when the round trip net of the guest's processing is over
        ``clock_tolerance_ns`` (a starved guest), half of it; otherwise none; and when
        half of it is over ``CLOCK_EXCHANGE_MAX_BOUND_NS``, none, followed by one
        bracketed correction on fresh connections. An agent
        older than the exchange answers at once, and a round trip over the tolerance
        is then followed by one bracketed correction, as ``sync_clock`` makes (two more
        connections). Raises ``AgentError`` with code ``unknown_op`` from an agent
        older than this op.
        """
        op = "after_fork"
        sent = time.time_ns()
        call = self._open(op, {"ns": sent, "net_refresh": net_refresh, "clock_exchange": True},
                          bytes(data), self.io_timeout, self._deadline(self.io_timeout))
        try:
            frame = call.recv()
            received = time.time_ns()
            if frame.type == "result":  # an agent without the exchange
                r, step, round_trip = frame.header, 0, received - sent
                if round_trip > clock_tolerance_ns:
                    correction_round_trip, step = self._sync_clock(1)
                    bound = min(round_trip, correction_round_trip // 2)
                else:
                    bound = round_trip
            elif frame.type == "clock":
                step, round_trip = clock_exchange_step(
                    sent, _int(frame.header, "ns", op),
                    _int(frame.header, "processing_ns", op), received)
                if abs(step) > MAX_CLOCK_STEP_NS:
                    raise AgentProtocolError(
                        f"the agent's clock reads {step} ns off the time it was just set "
                        f"to, beyond any transit time", op=op)
                # Split in two, a round trip is only as good as its halves are even: on
                # this first connection a guest just restored may take the request late
                # and answer at once, so a long one is not split but bracketed again on
                # fresh connections, as before the exchange (a CI run's guest ended 2 s
                # behind from a split ~4 s round trip).
                uneven = round_trip // 2 > CLOCK_EXCHANGE_MAX_BOUND_NS
                if round_trip <= clock_tolerance_ns or uneven:
                    step = 0
                try:
                    call.send({"type": "clock_step", "offset_ns": step})
                except OSError:
                    # The agent stopped waiting for the step (``server.CLOCK_STEP_TIMEOUT``:
                    # a VMM starved of the CPU, as at N = 100, answered later than that)
                    # and hung up after its result, which is still here to read: the
                    # step then counts as too late, below (a fresh-clone benchmark's
                    # child failed on this broken pipe).
                    pass
                r = call.expect("result").header
                bound = round_trip // 2 if step else round_trip
                if r.get("clock_step") is None or uneven:  # too late for the agent, or too long
                    step = 0
                    if round_trip > clock_tolerance_ns:
                        correction_round_trip, step = self._sync_clock(1)
                        bound = min(round_trip, correction_round_trip // 2)
                else:
                    step = _int(_record(r, "clock_step", op), "offset_ns", op)
            else:
                raise AgentProtocolError(f"expected a 'clock' or 'result' frame, got "
                                         f"{frame.header!r:.200}", op=op)
        finally:
            call.close()
        net = r.get("net")
        return AfterForkResult(
            ping=PingResult.from_reply(r),
            reseed=_reseed_result(_record(r, "reseed", op)),
            net=None if net is None else NetRefreshResult.from_reply(_record(r, "net", op)),
            previous_ns=_int(_record(r, "clock", op), "previous_ns", op),
            clock_error_bound_ns=bound,
            clock_step_ns=step)

    def set_time(self, ns: int | None = None) -> int:
        """Set the guest's wall clock to ``ns`` nanoseconds since the epoch (default: the
        host's clock now). Returns the guest's clock just before, in ns."""
        r = self._simple("set_time", ns=time.time_ns() if ns is None else ns)
        return _int(r, "previous_ns", "set_time")

    def step_time(self, offset_ns: int) -> int:
        """Step the guest's wall clock by ``offset_ns`` (0 only reads it); returns the
        guest's clock just before the step, in ns."""
        r = self._simple("set_time", offset_ns=offset_ns)
        return _int(r, "previous_ns", "set_time")

    def sync_clock(self, attempts: int = 3) -> int:
        """Bring the guest's wall clock to the host's, independent of transit time.

        Reads the guest clock bracketed by two host readings, keeps the reading
        with the shortest round trip, and steps the guest by the difference to
        the bracket's midpoint. The error is at most half that round trip.
        Returns the step applied, in ns.
        """
        return self._sync_clock(attempts)[1]

    def _sync_clock(self, attempts: int) -> tuple[int, int]:
        """``sync_clock``; returns (the round trip used, the step applied), in ns."""
        best: tuple[int, int] | None = None   # (round trip, offset)
        for _ in range(max(attempts, 1)):
            before = time.time_ns()
            guest = self.step_time(0)
            after = time.time_ns()
            candidate = (after - before, (before + after) // 2 - guest)
            if best is None or candidate[0] < best[0]:
                best = candidate
        assert best is not None
        self.step_time(best[1])
        return best

    def shutdown(self, *, reboot: bool = False) -> None:
        """Power the guest off (or reboot it); returns once the agent has acknowledged."""
        self._simple("shutdown", reboot=reboot)


class DirWatch:
    """An active ``watch``: ``events(timeout)`` returns the next batch of changes."""

    def __init__(self, call: _Call, directories: int) -> None:
        self._call = call
        self.directories = directories
        """Directories watched (a recursive watch follows subdirectories)."""
        self.overflow = 0
        """Times the guest kernel's event queue overflowed (changes were lost)."""
        self.ended = False
        """The watched directory itself was removed or moved: no more events."""

    def events(self, timeout: float | None = None) -> list[WatchEvent]:
        """The next batch (waiting up to ``timeout`` seconds: [] if nothing came)."""
        if self.ended:
            return []
        self._call.sock.settimeout(timeout)
        try:
            frame = self._call.recv()
        except AgentTimeout:
            return []
        if frame.type == "result":
            self.ended = True
            return []
        if frame.type != "events":
            raise AgentProtocolError(f"unexpected frame {frame.header!r:.200}", op="watch")
        self.overflow = _int(frame.header, "overflow", "watch", minimum=0)
        batch = frame.header.get("events")
        if not isinstance(batch, list):
            raise AgentProtocolError("an events frame without an events list", op="watch")
        out: list[WatchEvent] = []
        for item in batch:
            if not isinstance(item, dict):
                raise AgentProtocolError("a watch event is not an object", op="watch")
            kind = _str(item, "type", "watch")
            if kind not in WATCH_EVENT_TYPES:
                raise AgentProtocolError(f"unknown watch event type {kind!r:.40}", op="watch")
            out.append(WatchEvent(_str(item, "name", "watch"), kind,
                                  _bool(item, "is_dir", "watch")))
        return out

    def close(self) -> None:
        try:
            self._call.send({"type": "eof"})
        except OSError:
            pass
        self._call.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reseed_result(r: Mapping[str, Any]) -> ReseedResult:
    return ReseedResult(bytes=_int(r, "bytes", "reseed", minimum=0),
                        entropy_bits=_int(r, "entropy_bits", "reseed", minimum=0),
                        kernel_reseeded=_bool(r, "kernel_reseeded", "reseed"))
