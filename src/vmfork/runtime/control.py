"""The VMM control protocol: what a sandbox's VMM process takes on its ``control.sock``.

One home for both sides: the request records the host sends and the VMM parses
(``parse_request``, in ``runtime.vmmchild.ControlServer``), the reply records the VMM
sends and the host parses, the one client (``ControlClient``) and its one error
(``ControlError``).

The wire is JSON lines over a Unix stream socket, one object per line each way. A
request is ``{"op": <name>, ...fields}``; a reply is ``{"ok": true, ...fields}`` or
``{"ok": false, "error": "<reason>"}``. Replies come in request order, so a connection
may carry many requests. The ops, their fields and replies:

* ``status`` -> ``paused``, ``exit`` (the guest's exit reason or null),
  ``snapshot_bases`` (``[{"tag", "kind"}]``, what a diff can be based on, newest first),
  ``snapshot_tracking``, ``jailed``, ``free_page_reporting`` (the balloon's counters or
  null). ``StatusReply``.
* ``pause``, ``resume``, ``stop`` -> nothing more (``Ack``).
* ``exits`` -> ``profile``: the vCPUs' exit counters (``ExitsReply``).
* ``snapshot`` with ``mode``, ``memory_path``, ``state_path``, ``tag``, ``base_tag``,
  ``resume``, ``progress`` -> ``SnapshotReply``; with ``progress``, the VMM first sends
  ``{"ok": true, "stage": "resumed", "timings": {...}}`` as soon as the source runs
  again (``Resumed``). What the fields mean: ``ControlServer.snapshot``.

These names are the wire of VMMs that are running now: a daemon restarted onto an
older zygote drives that zygote's VMMs with this module, so an op or a field is never
renamed, and a reply field added later is optional here (an older VMM leaves it out).

Every reply is parsed here into a record, whole, before anyone reads it: the VMM runs
beside a guest and is not trusted with what it answers (a guest that took its VMM over
chooses every byte). A reply line is bounded (``MAX_LINE_BYTES``), must be a JSON
object of the op's shape, and anything else -- too long, not JSON, too deep, a wrong
type, no ``ok`` -- is a ``ControlError``, never a ``KeyError`` in a caller. Each call
has a deadline for its whole exchange, so a VMM that trickles bytes cannot hold a
caller longer than one that says nothing.

Stdlib only, and nothing of ``vmfork`` is imported: the VMM process imports this module
(the zygote pre-imports it), and the daemon imports it from ``runtime`` (the
dependency runs server -> runtime, never back).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, NoReturn, Protocol, TypeVar

# -- bounds and timeouts: the protocol's whole vocabulary, in seconds and bytes ---------
CONNECT_TIMEOUT_S = 30.0    # to connect: the VMM accepts on its control thread
CALL_TIMEOUT_S = 30.0       # an op's whole exchange; a snapshot's until the source resumes
WRITE_TIMEOUT_S = 3600.0    # a snapshot's final reply after that: its write of guest RAM
MAX_LINE_BYTES = 1 << 20    # one request or reply line, either way
MAX_ERROR_CHARS = 2000      # of a VMM's error text kept (it reaches logs and HTTP replies)
_MAX_QUOTED = 100           # bytes of a malformed line quoted in the error

SNAPSHOT_MODES = ("full", "diff", "live")   # vmm.capture.MODES (a test holds them equal)


class ControlError(Exception):
    """A control request failed; ``reason`` says who caused it:

    * ``"unreachable"``: the socket cannot be connected, or the connection broke or was
      closed (the VMM exited, or is exiting);
    * ``"timeout"``: no complete answer within the call's deadline;
    * ``"refused"``: the VMM answered ``ok: false`` (``message`` is its error, or, on the
      VMM's side, the request was not the protocol's);
    * ``"malformed"``: the VMM's answer is not the protocol's (oversized, not JSON, not
      an object, a field missing or of the wrong type).

    ``op`` is the request's op where known.
    """

    UNREACHABLE: ClassVar[str] = "unreachable"
    TIMEOUT: ClassVar[str] = "timeout"
    REFUSED: ClassVar[str] = "refused"
    MALFORMED: ClassVar[str] = "malformed"

    def __init__(self, message: str, *, reason: str, op: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.op = op

    @property
    def unreachable(self) -> bool:
        return self.reason == ControlError.UNREACHABLE

    @property
    def refused(self) -> bool:
        return self.reason == ControlError.REFUSED


# -- reading wire objects: one helper per type, each failing with the field's name ------
class _Malformed(Exception):
    """A wire object is not of its record's shape (turned into a ``ControlError``)."""


_MISSING: Any = object()


def _get(wire: Mapping[str, Any], name: str, default: Any) -> Any:
    if name in wire:
        return wire[name]
    if default is _MISSING:
        raise _Malformed(f"{name!r} is missing")
    return default


def _wrong(name: str, kind: str, value: object) -> NoReturn:
    raise _Malformed(f"{name!r} must be {kind}, not {type(value).__name__}")


def _bool(wire: Mapping[str, Any], name: str, default: Any = _MISSING) -> bool:
    value = _get(wire, name, default)
    if not isinstance(value, bool):
        _wrong(name, "true or false", value)
    return value


def _int(wire: Mapping[str, Any], name: str, default: Any = _MISSING) -> int:
    value = _get(wire, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _wrong(name, "a non-negative integer", value)
    return value


def _opt_int(wire: Mapping[str, Any], name: str) -> int | None:
    return None if wire.get(name) is None else _int(wire, name)


def _seconds(value: object, name: str) -> float:
    # bool is an int to Python; decode refuses NaN and Infinity, but 1e999 parses as
    # an infinite float; and a negative duration is still a lie.
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        _wrong(name, "a non-negative number of seconds", value)
    return float(value)


def _opt_seconds(wire: Mapping[str, Any], name: str) -> float | None:
    value = wire.get(name)
    return None if value is None else _seconds(value, name)


def _str(wire: Mapping[str, Any], name: str, default: Any = _MISSING) -> str:
    value = _get(wire, name, default)
    if not isinstance(value, str):
        _wrong(name, "a string", value)
    return value


def _opt_str(wire: Mapping[str, Any], name: str) -> str | None:
    return None if wire.get(name) is None else _str(wire, name)


def _object(value: object, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _wrong(name, "an object", value)
    return value


def _list(value: object, name: str) -> list[Any]:
    if not isinstance(value, list):
        _wrong(name, "a list", value)
    return value


def _timings(wire: Mapping[str, Any], name: str = "timings") -> dict[str, float]:
    """Named durations in seconds; ``pause_s`` (how long the vCPUs were stopped) is the
    one every capture has."""
    timings = {str(k): _seconds(v, f"{name}.{k}")
               for k, v in _object(_get(wire, name, _MISSING), name).items()}
    if "pause_s" not in timings:
        raise _Malformed(f"{name!r} has no 'pause_s'")
    return timings


# -- replies -------------------------------------------------------------------------
@dataclass(frozen=True)
class Ack:
    """The reply of ``pause``, ``resume`` and ``stop``: done."""

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Ack:
        return cls()


@dataclass(frozen=True)
class SnapshotBase:
    """A base a diff can be taken against: its tag (None for a machine restored from a
    snapshot of no name) and ``kind``, ``"restore"`` (the snapshot the sandbox was
    restored from) or ``"previous"`` (its previous capture)."""

    tag: str | None
    kind: str

    def to_wire(self) -> dict[str, Any]:
        return {"tag": self.tag, "kind": self.kind}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> SnapshotBase:
        return cls(tag=_opt_str(wire, "tag"), kind=_str(wire, "kind"))


@dataclass(frozen=True)
class FreePageReporting:
    """What the VMM's balloon did (``vmm/devices/virtio/balloon.py``): whether the
    guest's driver runs free page reporting, its counters, and the seconds since the
    guest's last report (None if it never reported)."""

    active: bool
    reports: int
    bytes_discarded: int
    discard_errors: int
    last_report_age_s: float | None

    def to_wire(self) -> dict[str, Any]:
        return {"active": self.active, "reports": self.reports,
                "bytes_discarded": self.bytes_discarded,
                "discard_errors": self.discard_errors,
                "last_report_age_s": self.last_report_age_s}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> FreePageReporting:
        return cls(active=_bool(wire, "active"), reports=_int(wire, "reports"),
                   bytes_discarded=_int(wire, "bytes_discarded"),
                   discard_errors=_int(wire, "discard_errors"),
                   last_report_age_s=_opt_seconds(wire, "last_report_age_s"))


@dataclass(frozen=True)
class StatusReply:
    """The ``status`` op's reply. ``exit``: why the guest stopped, None while it runs.
    ``snapshot_tracking``: ``"soft-dirty"`` or ``"restore-base-only"``. The fields from
    ``snapshot_bases`` on came later than the op: an older VMM's reply has them at
    these defaults."""

    paused: bool
    exit: str | None
    snapshot_bases: tuple[SnapshotBase, ...] = ()
    snapshot_tracking: str | None = None
    jailed: bool = False
    free_page_reporting: FreePageReporting | None = None

    def to_wire(self) -> dict[str, Any]:
        fpr = self.free_page_reporting
        return {"ok": True, "paused": self.paused, "exit": self.exit,
                "snapshot_bases": [b.to_wire() for b in self.snapshot_bases],
                "snapshot_tracking": self.snapshot_tracking, "jailed": self.jailed,
                "free_page_reporting": None if fpr is None else fpr.to_wire()}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> StatusReply:
        bases = wire.get("snapshot_bases")
        bases = [] if bases is None else _list(bases, "snapshot_bases")
        fpr = wire.get("free_page_reporting")
        return cls(paused=_bool(wire, "paused"), exit=_opt_str(wire, "exit"),
                   snapshot_bases=tuple(SnapshotBase.from_wire(_object(b, "snapshot_bases[]"))
                                        for b in bases),
                   snapshot_tracking=_opt_str(wire, "snapshot_tracking"),
                   jailed=_bool(wire, "jailed", False),
                   free_page_reporting=None if fpr is None else FreePageReporting.from_wire(
                       _object(fpr, "free_page_reporting")))


@dataclass(frozen=True)
class ExitsReply:
    """The ``exits`` op's reply: the VMM's VM-exit counters (``Machine.exit_profile``:
    by reason, the busiest I/O addresses, unmapped accesses, interrupts by line), a
    diagnostic passed on as it is, not read by the host; only its shape (an object)
    is checked."""

    profile: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "profile": self.profile}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> ExitsReply:
        return cls(profile=_object(_get(wire, "profile", _MISSING), "profile"))


@dataclass(frozen=True)
class Resumed:
    """The ``snapshot`` op's progress line (asked with ``progress``): the source runs
    again; ``timings`` so far, in seconds, ``pause_s`` among them."""

    STAGE: ClassVar[str] = "resumed"
    timings: Mapping[str, float]

    @property
    def pause_s(self) -> float:
        return self.timings["pause_s"]

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "stage": self.STAGE, "timings": dict(self.timings)}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Resumed:
        if wire.get("stage") != cls.STAGE:
            raise _Malformed(f"unknown progress stage {wire.get('stage')!r}")
        return cls(timings=_timings(wire))


@dataclass(frozen=True)
class SnapshotReply:
    """The ``snapshot`` op's reply, sent once both files are written (what each field
    means: ``runtime.vmmchild.ControlServer.snapshot``). Sizes in bytes, ``timings``
    in seconds, ``pause_s`` among them."""

    mode: str
    memory_format: str                 # "image" or "layer"
    memory_bytes: int
    dirty_pages: int | None
    base_tag: str | None
    base_kind: str | None
    tag: str | None
    tracking: str | None
    timings: Mapping[str, float] = field(default_factory=dict)
    changed_pages: int | None = None   # diff: its layer's pages that differ (older VMMs: none)

    @property
    def pause_s(self) -> float:
        return self.timings["pause_s"]

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "mode": self.mode, "memory_format": self.memory_format,
                "memory_bytes": self.memory_bytes, "dirty_pages": self.dirty_pages,
                "base_tag": self.base_tag, "base_kind": self.base_kind, "tag": self.tag,
                "tracking": self.tracking, "timings": dict(self.timings),
                "changed_pages": self.changed_pages}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> SnapshotReply:
        return cls(mode=_str(wire, "mode"), memory_format=_str(wire, "memory_format"),
                   memory_bytes=_int(wire, "memory_bytes"),
                   dirty_pages=_opt_int(wire, "dirty_pages"),
                   base_tag=_opt_str(wire, "base_tag"), base_kind=_opt_str(wire, "base_kind"),
                   tag=_opt_str(wire, "tag"), tracking=_opt_str(wire, "tracking"),
                   timings=_timings(wire), changed_pages=_opt_int(wire, "changed_pages"))


def error_reply(message: str) -> dict[str, Any]:
    """The wire form of a refusal: ``ok`` false and why."""
    return {"ok": False, "error": message}


# -- requests ------------------------------------------------------------------------
R = TypeVar("R")


class Request(Generic[R]):
    """A control request; ``R`` is its reply record. ``deadline_s``: the default
    deadline of its whole exchange (``ControlClient.call``)."""

    op: ClassVar[str]
    deadline_s: ClassVar[float] = CALL_TIMEOUT_S

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.op}

    def reply_from_wire(self, wire: Mapping[str, Any]) -> R:
        raise NotImplementedError


@dataclass(frozen=True)
class Status(Request[StatusReply]):
    op: ClassVar[str] = "status"

    def reply_from_wire(self, wire: Mapping[str, Any]) -> StatusReply:
        return StatusReply.from_wire(wire)


@dataclass(frozen=True)
class Pause(Request[Ack]):
    """Stop the vCPUs (the I/O thread and devices keep running)."""

    op: ClassVar[str] = "pause"

    def reply_from_wire(self, wire: Mapping[str, Any]) -> Ack:
        return Ack.from_wire(wire)


@dataclass(frozen=True)
class Resume(Request[Ack]):
    op: ClassVar[str] = "resume"

    def reply_from_wire(self, wire: Mapping[str, Any]) -> Ack:
        return Ack.from_wire(wire)


@dataclass(frozen=True)
class Exits(Request[ExitsReply]):
    op: ClassVar[str] = "exits"

    def reply_from_wire(self, wire: Mapping[str, Any]) -> ExitsReply:
        return ExitsReply.from_wire(wire)


@dataclass(frozen=True)
class Stop(Request[Ack]):
    """End the VMM process (the guest stops with it)."""

    op: ClassVar[str] = "stop"

    def reply_from_wire(self, wire: Mapping[str, Any]) -> Ack:
        return Ack.from_wire(wire)


@dataclass(frozen=True)
class Snapshot(Request[SnapshotReply]):
    """Capture the running machine into two new files (``ControlServer.snapshot``).

    ``mode``: one of ``SNAPSHOT_MODES``; ``tag`` names the capture (a later diff's base);
    ``base_tag``, diff only: the base to diff against (default: the newest);
    ``resume``: False leaves the source paused; ``progress``: also send ``Resumed``
    when the source runs again."""

    op: ClassVar[str] = "snapshot"
    deadline_s: ClassVar[float] = CALL_TIMEOUT_S + WRITE_TIMEOUT_S
    FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"mode", "memory_path", "state_path", "tag", "base_tag", "resume", "progress"})

    memory_path: str
    state_path: str
    mode: str = "full"
    tag: str | None = None
    base_tag: str | None = None
    resume: bool = True
    progress: bool = False

    def __post_init__(self) -> None:
        if self.mode not in SNAPSHOT_MODES:
            raise ValueError(f"mode must be one of {', '.join(SNAPSHOT_MODES)}, "
                             f"not {self.mode!r}")
        if self.base_tag is not None and self.mode != "diff":
            raise ValueError("base_tag applies to mode diff only")

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"op": self.op, "mode": self.mode,
                                "memory_path": self.memory_path,
                                "state_path": self.state_path,
                                "resume": self.resume, "progress": self.progress}
        # Left out when unset, as before there were records: an older VMM reads an
        # absent name and null alike, and the line stays what it was.
        if self.tag is not None:
            wire["tag"] = self.tag
        if self.base_tag is not None:
            wire["base_tag"] = self.base_tag
        return wire

    def reply_from_wire(self, wire: Mapping[str, Any]) -> SnapshotReply:
        return SnapshotReply.from_wire(wire)

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Snapshot:
        unknown = sorted(set(wire) - cls.FIELDS - {"op"})
        if unknown:
            # Refused, not ignored: a caller that expects another contract (say, a diff
            # written as a whole image over some parent file) must not get a layer at
            # memory_path and publish it as a memory image.
            raise _Malformed(
                f"unknown snapshot field(s) {', '.join(unknown)}; the op takes "
                f"{', '.join(sorted(cls.FIELDS))} (a diff writes a layer relative to "
                "base_tag: publish it with vmfork.runtime.branch.branch_sandbox)")
        try:
            memory_path, state_path = _str(wire, "memory_path"), _str(wire, "state_path")
        except _Malformed as err:
            raise _Malformed("memory_path and state_path (strings) are required") from err
        try:
            return cls(memory_path=memory_path, state_path=state_path,
                       mode=_str(wire, "mode", "full"), tag=_opt_str(wire, "tag"),
                       base_tag=_opt_str(wire, "base_tag"),
                       resume=_bool(wire, "resume", True),
                       progress=_bool(wire, "progress", False))
        except ValueError as err:
            raise _Malformed(str(err)) from err


AnyRequest = Status | Pause | Resume | Exits | Snapshot | Stop
_SIMPLE: dict[str, type[Status | Pause | Resume | Exits | Stop]] = {
    cls.op: cls for cls in (Status, Pause, Resume, Exits, Stop)}
OPS = (*_SIMPLE, Snapshot.op)


# -- lines ---------------------------------------------------------------------------
class WireRecord(Protocol):
    def to_wire(self) -> dict[str, Any]: ...


def encode(record: WireRecord | dict[str, Any]) -> bytes:
    """One wire line: the record's JSON object (or a wire object as it is) and a newline."""
    wire = record if isinstance(record, dict) else record.to_wire()
    return json.dumps(wire).encode() + b"\n"


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def decode(line: bytes) -> dict[str, Any]:
    """A wire line (without its newline) as a JSON object; ``_Malformed`` otherwise."""
    if len(line) > MAX_LINE_BYTES:
        raise _Malformed(f"a line of {len(line)} bytes, more than {MAX_LINE_BYTES}")
    try:
        wire = json.loads(line, parse_constant=_refuse_constant)
    except RecursionError as err:   # "[[[[..." deeper than the parser's stack
        raise _Malformed("nested too deep") from err
    except ValueError as err:       # also UnicodeDecodeError
        raise _Malformed(f"not JSON ({err}): {line[:_MAX_QUOTED]!r}") from err
    if not isinstance(wire, dict):
        raise _Malformed(f"not a JSON object: {line[:_MAX_QUOTED]!r}")
    return wire


def parse_request(line: bytes) -> AnyRequest:
    """The VMM's side: a request line as its record; ``ControlError`` (``refused``)
    saying what is wrong for anything else -- not an object, an unknown op, a field
    of the wrong type or unknown to the op."""
    try:
        wire = decode(line)
    except _Malformed as err:
        raise ControlError(f"a request is a JSON object with an \"op\": {err}",
                           reason=ControlError.REFUSED) from err
    op = wire.get("op")
    try:
        if op == Snapshot.op:
            return Snapshot.from_wire(wire)
        cls = _SIMPLE.get(op) if isinstance(op, str) else None
        if cls is None:
            raise _Malformed(f"unknown op {op!r} (the ops are {', '.join(OPS)})")
        extra = sorted(set(wire) - {"op"})
        if extra:
            raise _Malformed(f"op {op!r} takes no fields, not {', '.join(extra)}")
        return cls()
    except _Malformed as err:
        raise ControlError(str(err), reason=ControlError.REFUSED,
                           op=op if isinstance(op, str) else None) from err


def parse_reply(request: Request[R], line: bytes) -> R:
    """The host's side: a reply line to ``request`` as its record. ``ControlError``:
    ``refused`` with the VMM's error when it answered ``ok: false``, ``malformed``
    for anything that is not the op's reply."""
    wire = _reply_object(request.op, line)
    try:
        return request.reply_from_wire(wire)
    except _Malformed as err:
        raise _malformed(request.op, f"{err}") from err


def _reply_object(op: str, line: bytes) -> dict[str, Any]:
    """A reply line that says ``ok``, as its object; a refusal raises."""
    try:
        wire = decode(line)
    except _Malformed as err:
        raise _malformed(op, str(err)) from err
    ok = wire.get("ok")
    if ok is True:
        return wire
    if ok is False:
        error = wire.get("error")
        text = error[:MAX_ERROR_CHARS] if isinstance(error, str) else "(no reason given)"
        raise ControlError(text, reason=ControlError.REFUSED, op=op)
    raise _malformed(op, "no 'ok' true or false")


def _malformed(op: str, what: str) -> ControlError:
    return ControlError(f"the sandbox's VMM sent a malformed reply to {op!r}: {what}",
                        reason=ControlError.MALFORMED, op=op)


# -- the client ----------------------------------------------------------------------
class ControlClient:
    """One connection to a VMM's control socket; requests on it are answered in order.

    ``ControlClient.connect(path)`` opens it; as a context manager it closes on exit.
    Not thread-safe: one call at a time. A call that failed part-way (a timeout, a
    malformed line, a callback that raised) closes the connection, since the rest of
    its reply would be read as the next call's; later calls raise ``ControlError``
    (``unreachable``). A refusal (``ok: false``) is a whole reply: the connection
    stays usable.
    """

    def __init__(self, sock: socket.socket, path: str = "") -> None:
        self.path = path
        self._sock: socket.socket | None = sock
        self._buffer = b""

    @classmethod
    def connect(cls, path: str | os.PathLike[str],
                timeout: float = CONNECT_TIMEOUT_S) -> ControlClient:
        """Connect to the VMM's socket at ``path`` within ``timeout`` seconds;
        ``ControlError`` (``unreachable``) if no VMM listens there."""
        path = os.fspath(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except TimeoutError as err:
            sock.close()
            raise ControlError(f"the sandbox's VMM at {path} did not accept a connection "
                               f"within {timeout:g} s", reason=ControlError.TIMEOUT) from err
        except OSError as err:
            sock.close()
            raise ControlError(f"cannot reach the sandbox's VMM at {path}: "
                               f"{err.strerror or err}",
                               reason=ControlError.UNREACHABLE) from err
        return cls(sock, path)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def call(self, request: Request[R], timeout: float | None = None) -> R:
        """Send ``request`` and return its reply record; ``timeout``: seconds for the
        whole exchange (default: the op's ``deadline_s``). A ``snapshot``'s progress
        line is read and dropped (``snapshot`` passes it on)."""
        budget = request.deadline_s if timeout is None else timeout
        deadline = time.monotonic() + budget
        self._send(request)
        progressed = False
        while True:
            wire = self._receive(request.op, deadline, budget)
            if not (isinstance(request, Snapshot) and "stage" in wire):
                return self._parse(request, wire)
            self._progress(wire, progressed)
            progressed = True

    def snapshot(self, request: Snapshot, *,
                 on_resumed: Callable[[Resumed], None] | None = None,
                 timeout: float = CALL_TIMEOUT_S,
                 write_timeout: float = WRITE_TIMEOUT_S) -> SnapshotReply:
        """The ``snapshot`` op, streamed. With ``request.progress``, the VMM says that
        the source runs again (``on_resumed`` is called with it, once) within
        ``timeout`` seconds -- the pause -- and the final reply follows within
        ``write_timeout`` seconds more; without, the one reply is awaited for both
        together. A VMM that refuses before the pause ends says so within ``timeout``."""
        budget = timeout + (0.0 if request.progress else write_timeout)
        deadline = time.monotonic() + budget
        self._send(request)
        progressed = False
        while True:
            wire = self._receive(request.op, deadline, budget)
            if "stage" not in wire:
                return self._parse(request, wire)
            resumed = self._progress(wire, progressed)
            progressed = True
            budget = write_timeout
            deadline = time.monotonic() + budget
            if on_resumed is not None:
                try:
                    on_resumed(resumed)
                except BaseException:
                    self.close()   # the final reply is still to come on this connection
                    raise

    # -- the exchange -------------------------------------------------------------------
    def _parse(self, request: Request[R], wire: dict[str, Any]) -> R:
        try:
            return request.reply_from_wire(wire)
        except _Malformed as err:
            self.close()
            raise _malformed(request.op, str(err)) from err

    def _progress(self, wire: dict[str, Any], progressed: bool) -> Resumed:
        try:
            # One per capture: a VMM that kept sending them would restart the clock of
            # its write timeout with each.
            if progressed:
                raise _Malformed("a second progress line")
            return Resumed.from_wire(wire)
        except _Malformed as err:
            self.close()
            raise _malformed(Snapshot.op, str(err)) from err

    def _live(self, op: str) -> socket.socket:
        if self._sock is None:
            raise ControlError(f"the control connection to {self.path or 'the VMM'} is "
                               f"closed (a call on it failed); cannot send {op!r}",
                               reason=ControlError.UNREACHABLE, op=op)
        return self._sock

    def _send(self, request: Request[Any]) -> None:
        sock = self._live(request.op)
        try:
            sock.settimeout(CALL_TIMEOUT_S)   # a request line fits the socket buffer
            sock.sendall(encode(request))
        except OSError as err:
            self.close()
            raise ControlError(f"the sandbox's VMM is gone ({err})",
                               reason=ControlError.UNREACHABLE, op=request.op) from err

    def _receive(self, op: str, deadline: float, budget: float) -> dict[str, Any]:
        """The next line as a JSON object that says ``ok``; raises for a refusal, a
        malformed line, a broken connection or the deadline passed (``budget``: the
        seconds it allowed, for the message)."""
        sock = self._live(op)
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE_BYTES:
                self.close()
                raise _malformed(op, f"a reply longer than {MAX_LINE_BYTES} bytes")
            try:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
                chunk = sock.recv(65536)
            except TimeoutError as err:
                self.close()
                raise ControlError(f"the sandbox's VMM did not answer {op!r} within "
                                   f"{budget:g} s", reason=ControlError.TIMEOUT, op=op) from err
            except OSError as err:
                self.close()
                raise ControlError(f"the sandbox's VMM is gone ({err})",
                                   reason=ControlError.UNREACHABLE, op=op) from err
            if not chunk:
                self.close()
                raise ControlError("the sandbox's VMM closed the control connection "
                                   "(did it exit?)", reason=ControlError.UNREACHABLE, op=op)
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return _reply_object(op, line)
        except ControlError as err:
            if not err.refused:
                self.close()
            raise
