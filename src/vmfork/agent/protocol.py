"""The wire protocol between the host and the guest agent (stdlib only).

Transport
=========
The agent listens on AF_VSOCK port ``AGENT_PORT`` (1024). The host reaches it through
the VMM's Unix socket with the Firecracker convention (``CONNECT 1024\\n`` → ``OK <n>\\n``,
see ``client.vsock_uds_connector``). **One request per connection**; any number of
connections may be open at once (the agent serves each on its own thread).

Frames
======
Every message in both directions is one frame::

    >II  header_len  payload_len      (8 bytes, big-endian unsigned)
    header_len bytes  UTF-8 JSON object (the "header")
    payload_len bytes raw payload      (file data, process output; binary-safe)

``header_len`` is 1..``MAX_HEADER`` (1 MiB) and ``payload_len`` 0..``MAX_PAYLOAD``
(1 MiB). A frame that breaks these limits, or whose header is not a JSON object, is
answered with an ``error`` frame (``bad_request`` / ``too_large``) and the connection is
closed; the agent keeps serving other connections.

The first frame the host sends is the request: ``{"op": <name>, ...fields}``. Every
frame the agent sends has a ``"type"``. A call ends with exactly one final frame,
``result`` or ``error``, after which the agent half-closes the connection.

Errors
======
``{"type": "error", "error": <code>, "message": <human text naming what failed>, ...}``.
Codes: ``bad_request`` (malformed frame or field), ``too_large`` (frame over a cap),
``unknown_op``, ``busy`` (too many connections), ``timeout`` (exec deadline hit),
``not_found``, ``exists``, ``permission_denied``, ``not_a_directory``,
``is_a_directory``, ``not_empty``, ``os_error`` (any other errno; ``errno`` field set),
``unsupported`` (op not available in this agent, e.g. shutdown outside a VM),
``internal`` (a bug in the agent; traceback logged on the guest console).
Errors from a file system call also carry ``errno`` and ``path``.

Ops
===
``ping`` — no fields.
    → ``result {pong: true, pid, version, protocol, uptime (s, float), boot_id}``

``exec`` — ``argv: [str]`` *or* ``cmd: str`` (run as ``/bin/sh -c cmd``);
``env: {str: str|null}`` (merged over ``DEFAULT_ENV``; null removes a key);
``cwd: str``; ``stdin: bool`` (default false: stdin is /dev/null);
``timeout: float`` seconds (null or absent: no limit); ``user: str`` (protocol 3: a
name in the guest's /etc/passwd to run as, with its groups, ``HOME``/``USER``/
``LOGNAME`` under the request's ``env``, and its home as the default ``cwd``; an
unknown name is ``error unknown_user``; absent: the image's user, root by default).
    → ``started {pid, uid}`` once the process runs (``uid``: whom it runs as). If ``stdin`` is true the host then sends
      ``data`` frames (payload = bytes for the process's stdin) and one ``eof`` frame;
      the host must wait for ``started`` before sending them.
    → ``stdout`` / ``stderr`` frames (payload = bytes) **as the process produces them**,
      in the order they were read (at most 64 KiB each).
    → ``result {exit_code, signal, pid, duration}``: ``exit_code`` is the exit status, or
      ``-N`` if the process was killed by signal N, in which case ``signal`` is N
      (otherwise null) — the ``subprocess`` convention.
    → or ``error timeout {timeout, pid, duration}`` if the deadline passed: the
      process's whole process group was SIGKILLed; the output up to then has already
      been streamed in ``stdout``/``stderr`` frames.
    → or ``error not_found {exit_code: 127}`` if the program or ``cwd`` does not exist
      (``permission_denied {exit_code: 126}`` if it is not executable).

``eval`` — ``code: str``: Python run in the agent's own (warm) interpreter, in one
globals dict shared by all calls (imports and variables persist). If ``code`` is a
single expression, or ends with an expression statement, that expression's value is
the result (like a REPL); otherwise the value is null.
    → ``stdout`` / ``stderr`` frames with what the code printed (UTF-8).
    → ``result {value: repr(value) | null, value_truncated: bool, exception: null |
      {type, message, traceback}}``. An exception in the code (SyntaxError included) is a
      *successful* eval whose ``exception`` is set; SystemExit is caught like any other.

``read`` — ``path`` (absolute), ``offset`` (default 0), ``length`` (default: to EOF).
    → ``data`` frames (payload = file bytes, ``CHUNK_SIZE`` each) → ``result {size}``.

``write`` — ``path``, ``mode`` (default 0o644, applied exactly, umask ignored),
``make_parents`` (default false), ``user`` (protocol 3: the file, and the parents
made for it, are owned by that user and its primary group).
    → ``ready`` (the temporary file is open; send now) or an error.
    ← host sends ``data`` frames then one ``eof`` frame.
    → ``result {size, uid}``. The write is atomic: data goes to a temporary file in the same
      directory, which is fsynced and renamed over ``path`` (the directory is fsynced
      too). A dropped connection or an error leaves ``path`` untouched.

``list`` — ``path``.
    → ``entries {entries: [entry…]}`` frames (at most ``LIST_BATCH`` entries each), then
      ``result {count}``. An entry is ``{name, type, size, mode, mtime}`` (+ ``target``
      for a symlink); ``type`` is ``file|dir|symlink|fifo|socket|char|block|other``
      (the entry itself, symlinks not followed); ``mode`` is the permission bits;
      ``mtime`` is seconds since the epoch (float). Entries are sorted by name.

``stat`` — ``path``, ``follow_symlinks`` (default true).
    → ``result {stat: {path, name, type, size, mode, mtime, uid, gid, nlink[, target]}}``
      (nested: a frame's own ``type`` is taken).

``remove`` — ``path``, ``recursive`` (default false), ``missing_ok`` (default false).
A file or symlink is unlinked; a directory needs ``recursive`` unless empty.
    → ``result {}``.

``mkdir`` — ``path``, ``parents`` (default false: like ``mkdir``; true: like
``mkdir -p``, an existing directory is fine), ``mode`` (default 0o755), ``user``
(protocol 3: the directories made are owned by that user).
    → ``result {uid}``.

``reseed`` — payload = host random bytes (1..``MAX_PAYLOAD``); ``entropy_bits``
(default 8 × len). Mixes the bytes into the kernel CRNG (ioctl RNDADDENTROPY on
/dev/random, crediting the entropy, then RNDRESEEDCRNG) and reseeds Python's ``random``
module in the agent interpreter (hence in ``eval``). Needed after every fork: children
of one snapshot otherwise share the parent's RNG state.
    → ``result {bytes, entropy_bits, kernel_reseeded}``.

``set_time`` — ``ns``: wall-clock time in nanoseconds since the epoch; or
``offset_ns``: step the clock by this much from its value when the request is handled
(0 only reads it). A relative step is immune to the request's transit time, which is
how the host syncs a restored child (``client.sync_clock``).
    → ``result {previous_ns, ns}``.

``shutdown`` — ``reboot`` (default false). The agent replies, then syncs file systems and
calls reboot(2) with RB_POWER_OFF (or RB_AUTOBOOT). The VMM sees the guest's final reset
as the end of the VM.
    → ``result {action: "poweroff"|"reboot"}``.

``net_refresh`` — no fields. Sent by the host right after a child is restored from a
snapshot: the agent aborts every TCP connection the guest inherited (SOCK_DESTROY: the
peer gets a RST; listening sockets and loopback connections stay) and flushes the
network interface's neighbour cache (``agent/network.py``).
    → ``result {interface, connections_aborted, neighbours_flushed}``.

``after_fork`` — what a restored child needs, on one connection instead of one per
op: ``ns`` (the host's wall clock when it sent the request), payload = host random
bytes and ``entropy_bits`` as for ``reseed``, ``net_refresh`` (default false),
``clock_exchange`` (protocol 4, default false). Sets the clock to ``ns`` first (its
error is the request's one-way transit time), then reseeds as ``reseed``, then
refreshes as ``net_refresh``.
    → without ``clock_exchange``: ``result {pong, pid, version, protocol, uptime,
      boot_id, clock {previous_ns, ns}, reseed {bytes, entropy_bits, kernel_reseeded},
      net null | {interface, …}}``; the host bounds the clock's error by the round trip
      and corrects it with ``set_time offset_ns`` when that is too long.
    → with ``clock_exchange`` the correction happens on this connection, NTP style:
      ``clock {ns, processing_ns}`` (the guest's clock just before sending, and the
      monotonic nanoseconds since it set the clock to the request's ``ns``).
    ← the host sends one ``clock_step {offset_ns}`` frame: the step to apply, the NTP
      offset ``((T1 - T2) + (T4 - T3)) / 2`` from its send time T1, the guest's reading
      T3, ``T2 = T3 - processing_ns`` (the guest's clock when it was set) and its own
      receive time T4 — half the round trip net of the guest's processing, since T2 is
      T1 — or 0 when that round trip was within the host's tolerance (0 leaves the
      clock alone). The magnitude is at most ``MAX_CLOCK_STEP_NS``; a frame of another
      type, or an ``offset_ns`` that is not an integer in that range, is ``error
      bad_request`` (the clock stays as the request set it; the reseed and refresh
      have happened).
    → ``result`` as above plus ``clock_step {offset_ns, previous_ns, ns} | null``:
      null when no step arrived within the agent's ``CLOCK_STEP_TIMEOUT`` (10 s) or
      the host half-closed instead, so a host that never answers cannot hold the
      agent's thread longer than that. An agent older than protocol 4 ignores the
      field and answers ``result`` at once, without ``clock_step``: that first frame
      is how the host tells, and it falls back to ``set_time``.

``rename`` — ``path``, ``new_path``, ``overwrite`` (default false: an existing
``new_path`` is an ``exists`` error, checked atomically with RENAME_NOREPLACE).
    → ``result {path, new_path}``.

``watch`` — ``path`` (a directory), ``recursive`` (default false).
    → ``watching {path, recursive, directories, unwatched}`` once the watches are set,
      then ``events {events: [{name, type, is_dir}], overflow, unwatched}`` frames as
      changes happen (``name`` relative to ``path``; ``type`` is ``create``,
      ``write``, ``remove``, ``rename_from``, ``rename_to`` or ``chmod``).
    ← the host sends any frame (``eof``) or hangs up to stop.
    → ``result {events, overflow, unwatched, root_gone}`` (also sent, unasked, if the
      watched directory itself is removed or moved).

Background processes (``agent/jobs.py``): a process that outlives the connection that
started it, reached by pid from other connections.

``start`` — the fields of ``exec`` (``argv``/``cmd``, ``env``, ``cwd``, ``timeout``;
``stdin: true`` keeps a pipe open for ``send_stdin``), ``pty: {rows, cols}`` (run on
a new pseudo-terminal: one output stream, ``pty``, and stdin always open), ``tag``,
``user`` (as for ``exec``).
    → ``result {pid, pty, uid}`` as soon as it runs.

``attach`` — ``pid``, ``offset`` (default 0: the start of its output).
    → ``attached {pid, pty, skipped}`` (``skipped``: bytes before ``offset`` that are no
      longer kept), then ``stdout``/``stderr``/``pty`` frames ``{offset}`` with the kept
      output from ``offset`` and then live output, then when the process has ended
      ``result {pid, exit_code, signal, timed_out, duration, offset, skipped}``. The
      host may hang up at any time: the process goes on (reattach with ``offset``).

``send_stdin`` — ``pid``, payload = bytes for its stdin, ``eof`` (default false: true
closes stdin after the bytes; on a PTY it sends ^D).
    → ``result {pid, written, closed}``; ``busy`` if the process does not read for 10 s.

``signal`` — ``pid``, ``signal`` (a name such as ``SIGTERM``/``TERM`` or its number;
default SIGKILL; only the signals in ``jobs.SIGNALS``), ``group`` (default true: its
whole process group).
    → ``result {pid, signal, delivered, running}``.

``pty_resize`` — ``pid``, ``rows``, ``cols`` (1..1000).
    → ``result {pid, rows, cols}``.

``ps`` — no fields.
    → ``result {processes: [{pid, argv, cwd, tag, pty, started_at, running, exit_code,
      signal, timed_out, stdin_open, output_bytes}]}`` (at most ``jobs.MAX_JOBS``; the
      oldest finished ones are forgotten first).

``mount_volume`` — ``device`` (the volume slot's place among the ``virtio_mmio.device=``
entries of the kernel command line: the N of ``virtio-mmio.N``), ``guest_path`` (absolute), ``read_only`` (default true), ``sectors`` (the size the
host gave the disk). Waits (at most 10 s) until the slot's block device has that size,
recognises erofs, squashfs or ext4 by its superblock and mounts it there (``MS_RDONLY``
when read-only), making the directory if needed (``agent/volumes.py``).
    → ``result {device, fstype, guest_path, read_only, sectors}``; ``exists`` if
      something is mounted there, ``not_ready`` if the disk never showed up.

``export_upper`` — ``max_bytes``, ``max_members`` (caps; the agent caps them too). Only in
a build VM (kernel word ``vmfork.build=1``, whose ``/init`` moves the root overlay's
tmpfs to ``/.vmfork-rw``): streams the overlay's upper directory as an OCI layer tar
(whiteouts and opaque directories converted, ``agent/upper.py``).
    → ``data`` frames, then ``result {size, members, file_bytes, whiteouts,
      opaque_dirs}``; ``unsupported`` in a guest not booted for a build, ``too_large``
      over a cap.

``cell`` — ``code`` (Python, at most 128 Ki characters), ``context`` (default
``default``: the ``eval`` op's namespace), ``timeout`` (seconds, at most 3600),
``env`` (set for the cell's duration). A code-interpreter cell (``agent/interpreter.py``):
    → ``started {context}``, then ``stdout``/``stderr`` frames ``{ts}`` as it prints,
      then ``display {more}`` frames (a result's JSON bundle — ``text``, ``html``,
      ``png``…, ``is_main_result`` — in payloads; ``more`` until its last piece), then
      ``result {execution_count, error: {name, value, traceback} | null,
      output_truncated}``; ``not_found`` for an unknown context.

``contexts`` — ``action``: ``list``, ``create`` (``cwd``), ``remove`` or ``restart``
(``context``).
    → ``result {contexts: [{id, language, cwd}]}`` / ``{context}`` / ``{removed}``;
      ``not_found``, ``limit`` past 32 contexts.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

AGENT_PORT = 1024
PROTOCOL_VERSION = 4
"""2 added ``rename``, ``watch`` and background processes (``start`` … ``ps``);
an agent that answers 1 (an older snapshot's) does not have them. 3 added ``user`` on
``exec``, ``start``, ``write`` and ``mkdir``; an older agent ignores the field, so its
replies' ``uid`` (which it does not send) is how the host tells. 4 added
``after_fork``'s ``clock_exchange``; an older agent ignores the field, so a ``result``
where the ``clock`` frame would be is how the host tells."""

HEADER = struct.Struct(">II")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 20
CHUNK_SIZE = 256 << 10
"""File data is sent in frames of this many bytes (the last one may be shorter)."""
OUTPUT_CHUNK = 64 << 10
"""Largest stdout/stderr frame (one pipe read)."""
LIST_BATCH = 512
MAX_CLOCK_STEP_NS = 3600 * 10**9
"""The largest ``clock_step`` an agent applies in ``after_fork`` (one hour). An honest
step is half a round trip the host sat through, seconds at worst on a starved host; a
value beyond this is a confused host, and stepping a guest's clock by hours would
break its certificates' and caches' idea of now for no correction at all."""

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_ENV: dict[str, str] = {
    "PATH": DEFAULT_PATH,
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
}

OPS = ("ping", "exec", "eval", "read", "write", "list", "stat", "remove", "mkdir",
       "reseed", "set_time", "shutdown", "net_refresh", "after_fork", "rename", "watch",
       "start", "attach", "send_stdin", "signal", "pty_resize", "ps", "mount_volume",
       "export_upper", "cell", "contexts")


class ProtocolError(Exception):
    """A frame broke the protocol. ``code`` is the error code the agent replies with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ConnectionClosed(ProtocolError):
    """The peer closed the connection. ``clean`` when it did so between two frames;
    ``lost`` when it was reset rather than closed (nothing can be sent back)."""

    def __init__(self, message: str, *, clean: bool, lost: bool = False) -> None:
        super().__init__("closed", message)
        self.clean = clean
        self.lost = lost


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: bytes = field(default=b"")

    @property
    def type(self) -> str:
        """The agent's frame type (``result``, ``stdout``, …), or '' for a request."""
        kind = self.header.get("type", "")
        return kind if isinstance(kind, str) else ""


# ``json.dumps`` with any argument builds a new encoder per call; these are built once.
# Both sides of the protocol use them, and in a restored guest every call that runs less
# Python touches fewer pages, each of which the child faults in the first time.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)


def encode_header(header: dict[str, Any]) -> bytes:
    try:
        return _ENCODER.encode(header).encode("utf-8")
    except UnicodeEncodeError:
        # A str holding lone surrogates: a non-UTF-8 file name decoded by os.listdir with
        # surrogateescape. ASCII-escaped JSON carries it as "\udcXX", which decodes back
        # to the same str on the other side, so such paths round-trip.
        return _ASCII_ENCODER.encode(header).encode("ascii")


def encode_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    body = encode_header(header)
    if len(body) > MAX_HEADER:
        raise ProtocolError("too_large", f"frame header is {len(body)} bytes, over {MAX_HEADER}")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError("too_large",
                            f"frame payload is {len(payload)} bytes, over {MAX_PAYLOAD}")
    return HEADER.pack(len(body), len(payload)) + body + payload


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    sock.sendall(encode_frame(header, payload))


def _recv_exact(sock: socket.socket, n: int, what: str, started: bool,
                deadline: float | None = None, idle: float | None = None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            # The socket's own timeout restarts at every recv, so a peer that trickles a
            # byte at a time would never hit it; the deadline bounds the whole call.
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"deadline passed while reading the {what}")
            sock.settimeout(left if idle is None else min(left, idle))
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise
        except OSError as err:
            # Not a bug: the host reset the connection, or (vsock) a transport reset
            # after a restore dropped every connection at once (ECONNRESET, ENOTCONN,
            # ESHUTDOWN, depending on the moment it hit).
            raise ConnectionClosed(f"connection lost ({what}: {err.strerror or err})",
                                   clean=False, lost=True) from err
        if k == 0:
            clean = not started and got == 0
            raise ConnectionClosed(
                "connection closed" if clean
                else f"connection closed in the middle of a frame ({what}: {got} of {n} bytes)",
                clean=clean)
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, deadline: float | None = None) -> Frame:
    """Read one whole frame. Raises ``ConnectionClosed`` at EOF, ``ProtocolError`` if
    the frame is invalid (after which the stream is out of sync and must be closed),
    ``TimeoutError`` if ``deadline`` (a ``time.monotonic()`` instant) passes first."""
    idle = sock.gettimeout()
    try:
        return _recv_frame(sock, deadline, idle)
    finally:
        if deadline is not None:
            sock.settimeout(idle)


def _recv_frame(sock: socket.socket, deadline: float | None, idle: float | None) -> Frame:
    prefix = _recv_exact(sock, HEADER.size, "length prefix", started=False, deadline=deadline,
                         idle=idle)
    header_len, payload_len = HEADER.unpack(prefix)
    if header_len == 0:
        raise ProtocolError("bad_request", "frame header length is 0; a JSON object is required")
    if header_len > MAX_HEADER:
        raise ProtocolError("too_large",
                            f"frame header length {header_len} is over the {MAX_HEADER} cap")
    if payload_len > MAX_PAYLOAD:
        raise ProtocolError("too_large",
                            f"frame payload length {payload_len} is over the {MAX_PAYLOAD} cap")
    raw = _recv_exact(sock, header_len, "header", started=True, deadline=deadline, idle=idle)
    payload = (_recv_exact(sock, payload_len, "payload", started=True, deadline=deadline,
                           idle=idle) if payload_len else b"")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProtocolError("bad_request", f"frame header is not UTF-8 JSON: {err}") from err
    if not isinstance(header, dict):
        raise ProtocolError("bad_request",
                            f"frame header must be a JSON object, got {type(header).__name__}")
    return Frame(header, payload)


def error_header(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "error": code, "message": message, **extra}
