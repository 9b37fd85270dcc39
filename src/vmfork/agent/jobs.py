"""Background processes ("jobs"): start one, then attach to its output, feed its stdin,
signal it, resize its terminal and list them — each on connections of their own
(stdlib only).

``exec`` ties a process to one connection: its output goes to that connection and the
process dies with it. Interactive use (an E2B ``commands.run(background=True)``, a
terminal, a server started by an agent) needs a process that outlives the call that
started it and that other calls can reach by pid. ``JobTable`` holds them:

- **Output** is read by a pump thread per job, from its stdout and stderr pipes (or
  its PTY master), into ``OutputLog``: the last ``KEPT_OUTPUT`` bytes, each chunk with
  its offset in the job's output. ``attach`` replays what is kept from an offset and
  then follows live output until the job ends; a host that reattaches later with the
  offset it got to misses nothing that is still kept, and is told how much was dropped.
- **Exit.** The pump reaps its own child (the pid is in ``OwnedPids`` from start to
  reap, which keeps the PID-1 reaper away, as for ``exec``), then drains the pipes as
  ``exec`` does (``process.QUIET`` / ``process.DRAIN_LIMIT``: a grandchild holding a
  pipe open does not keep the job alive). A ``timeout`` kills the process group.
- **Bounds.** Everything here is driven by the host and by guest programs: at most
  ``MAX_JOBS`` jobs (running or finished and not yet forgotten: the oldest finished is
  forgotten first, and a start is refused when all are running), ``KEPT_OUTPUT`` bytes
  per job, ``MAX_ATTACHERS`` attached connections per job, ``MAX_TAG`` characters of
  tag, PTY sizes within ``MAX_PTY_SIZE``, stdin writes that give up after
  ``STDIN_WRITE_TIMEOUT`` on a process that does not read.
- **PTY.** ``pty: {rows, cols}`` runs the process on a new pseudo-terminal (its
  controlling terminal, so ^C and job control work), stdin, stdout and stderr all on
  it; its output is one stream, ``pty``.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal as signals
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vmfork.agent.conn import Conn
from vmfork.agent.process import Command, follow_output, kill_group, spawn
from vmfork.agent.reaper import OwnedPids
from vmfork.agent.request import OpError, get_bool, get_int, get_str

MAX_JOBS = 64
KEPT_OUTPUT = 1 << 20
"""Bytes of each job's most recent output kept for ``attach``."""
MAX_ATTACHERS = 8
MAX_TAG = 256
MAX_PTY_SIZE = 1000
"""Largest PTY rows or columns accepted (a terminal of 1000 x 1000 is already absurd)."""
STDIN_WRITE_TIMEOUT = 10.0
"""Seconds a ``send_stdin`` waits for a process that does not read its stdin."""
ATTACH_POLL = 0.5
"""How often a silent ``attach`` checks that its host is still there."""

SIGNALS: dict[str, int] = {
    name: int(getattr(signals, name))
    for name in ("SIGHUP", "SIGINT", "SIGQUIT", "SIGKILL", "SIGUSR1", "SIGUSR2",
                 "SIGTERM", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGWINCH")
}
"""The signals a host may send a job: the ones a terminal or a supervisor sends.
Others (SIGSEGV, SIGBUS…) would only forge crashes."""


@dataclass(frozen=True)
class Chunk:
    stream: str
    offset: int
    data: bytes


class OutputLog:
    """The most recent ``cap`` bytes of a job's output, as chunks with their offsets."""

    def __init__(self, cap: int = KEPT_OUTPUT) -> None:
        self.cap = cap
        self.produced = 0
        """Bytes of output so far (the next chunk's offset)."""
        self._chunks: deque[Chunk] = deque()
        self._kept = 0

    def append(self, stream: str, data: bytes) -> None:
        self._chunks.append(Chunk(stream, self.produced, data))
        self.produced += len(data)
        self._kept += len(data)
        while self._kept > self.cap and len(self._chunks) > 1:
            self._kept -= len(self._chunks.popleft().data)

    @property
    def first_kept(self) -> int:
        return self._chunks[0].offset if self._chunks else self.produced

    def since(self, offset: int) -> list[Chunk]:
        """Chunks that end after ``offset``; one that straddles it is cut at it."""
        out: list[Chunk] = []
        for chunk in self._chunks:
            end = chunk.offset + len(chunk.data)
            if end <= offset:
                continue
            if chunk.offset < offset:
                cut = offset - chunk.offset
                chunk = Chunk(chunk.stream, offset, chunk.data[cut:])
            out.append(chunk)
        return out


@dataclass
class Job:
    pid: int
    argv: list[str]
    cwd: str | None
    tag: str | None
    pty: bool
    started_at: float
    """Wall-clock seconds since the epoch."""
    started: float
    """``time.monotonic()`` at start."""
    proc: subprocess.Popen[bytes]
    stdin_fd: int | None
    """The write end of its stdin pipe, or its PTY master; None once closed."""
    had_stdin: bool
    output: OutputLog = field(default_factory=OutputLog)
    exit_code: int | None = None
    timed_out: bool = False
    ended: float | None = None
    attachers: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)
    stdin_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def running(self) -> bool:
        return self.ended is None

    def describe(self) -> dict[str, Any]:
        code = self.exit_code
        return {"pid": self.pid, "argv": self.argv, "cwd": self.cwd, "tag": self.tag,
                "pty": self.pty, "started_at": self.started_at, "running": self.running,
                "exit_code": code, "signal": -code if code is not None and code < 0 else None,
                "timed_out": self.timed_out, "stdin_open": self.stdin_fd is not None,
                "output_bytes": self.output.produced}


def _parse_pty(req: dict[str, Any]) -> tuple[int, int] | None:
    size = req.get("pty")
    if size is None:
        return None
    if not isinstance(size, dict):
        raise OpError("bad_request", "start: 'pty' must be an object {rows, cols} or null")
    return _pty_size(size, "start")


def _pty_size(req: dict[str, Any], op: str) -> tuple[int, int]:
    dims: list[int] = []
    for name in ("rows", "cols"):
        value = get_int(req, name, None, minimum=1)
        if value is None or value > MAX_PTY_SIZE:
            raise OpError("bad_request", f"{op}: {name!r} must be an integer from 1 to "
                                         f"{MAX_PTY_SIZE}, got {req.get(name)!r:.40}")
        dims.append(value)
    return dims[0], dims[1]


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


CONTROLLING_TTY = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")
"""Run before a PTY job's program: makes the terminal on its stdin the controlling
terminal of its new session, then execs the program. (``Popen``'s ``preexec_fn``
would do it in the forked child, but running Python between fork and exec in a
threaded process can deadlock on a lock another thread held at the fork.)"""


def _on_controlling_tty(argv: list[str]) -> list[str]:
    # -I -S: no site, no environment: the wrapper starts in milliseconds and cannot be
    # steered by the job's own PYTHON* variables.
    return [sys.executable or "/usr/bin/python3", "-I", "-S", "-c", CONTROLLING_TTY, *argv]


class JobTable:
    """The agent's background processes (see the module docstring)."""

    def __init__(self, owned: OwnedPids, *, max_jobs: int = MAX_JOBS) -> None:
        self.owned = owned
        self.max_jobs = max_jobs
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}

    # -- ops -----------------------------------------------------------------------

    def start(self, conn: Conn, req: dict[str, Any]) -> None:
        command = Command.parse(req, "start")
        pty_size = _parse_pty(req)
        tag = req.get("tag")
        if tag is not None:
            tag = get_str(req, "tag")
            if len(tag) > MAX_TAG:
                raise OpError("bad_request", f"start: 'tag' is {len(tag)} characters, "
                                             f"over {MAX_TAG}")
        with self._lock:
            self._make_room()
            job = self._spawn(command, pty_size, tag)
            self._jobs[job.pid] = job
        threading.Thread(target=self._pump, args=(job, command.timeout),
                         name=f"job-{job.pid}", daemon=True).start()
        conn.result(pid=job.pid, pty=job.pty, uid=command.uid())

    def attach(self, conn: Conn, req: dict[str, Any]) -> None:
        job = self._job(req, "attach")
        offset = get_int(req, "offset", 0)
        assert offset is not None
        with job.changed:
            if job.attachers >= MAX_ATTACHERS:
                raise OpError("busy", f"attach: pid {job.pid} already has {MAX_ATTACHERS} "
                                      "attached connections")
            job.attachers += 1
        try:
            self._follow(conn, job, offset)
        finally:
            with job.changed:
                job.attachers -= 1

    def send_stdin(self, conn: Conn, req: dict[str, Any], payload: bytes) -> None:
        job = self._job(req, "send_stdin")
        eof = get_bool(req, "eof", False)
        with job.stdin_lock:
            if job.stdin_fd is None:
                why = ("the process has exited" if not job.running
                       else "it was closed" if job.had_stdin
                       else "the process was started without 'stdin': true")
                raise OpError("bad_request", f"send_stdin: pid {job.pid} has no stdin to "
                                             f"write to: {why}")
            written = self._write_stdin(job, payload)
            if eof:
                self._close_stdin(job)
        conn.result(pid=job.pid, written=written, closed=eof)

    def signal(self, conn: Conn, req: dict[str, Any]) -> None:
        job = self._job(req, "signal")
        signum = self._signal_number(req.get("signal", "SIGKILL"))
        group = get_bool(req, "group", True)
        delivered = False
        if job.running:
            # The group first (the job leads its own session, so its children are in
            # it), then the process itself in case it changed its group.
            targets = ((os.killpg, job.pid), (os.kill, job.pid)) if group else \
                ((os.kill, job.pid),)
            for kill, target in targets:
                try:
                    kill(target, signum)
                    delivered = True
                except (ProcessLookupError, PermissionError):
                    pass
        conn.result(pid=job.pid, signal=signum, delivered=delivered, running=job.running)

    def resize(self, conn: Conn, req: dict[str, Any]) -> None:
        job = self._job(req, "pty_resize")
        rows, cols = _pty_size(req, "pty_resize")
        if not job.pty:
            raise OpError("bad_request", f"pty_resize: pid {job.pid} was not started on a PTY")
        with job.stdin_lock:
            if job.stdin_fd is None:
                raise OpError("bad_request", f"pty_resize: pid {job.pid} has exited")
            _set_winsize(job.stdin_fd, rows, cols)  # the kernel sends SIGWINCH
        conn.result(pid=job.pid, rows=rows, cols=cols)

    def list(self, conn: Conn, req: dict[str, Any]) -> None:
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda j: j.started)
        conn.result(processes=[job.describe() for job in jobs])

    # -- internals -----------------------------------------------------------------

    def _job(self, req: dict[str, Any], op: str) -> Job:
        pid = get_int(req, "pid", None, minimum=1)
        if pid is None:
            raise OpError("bad_request", f"{op}: 'pid' (a process started with 'start') "
                                         "is required")
        with self._lock:
            job = self._jobs.get(pid)
        if job is None:
            raise OpError("not_found", f"{op}: no background process with pid {pid} "
                                       "(only processes started with 'start' are known)",
                          pid=pid)
        return job

    @staticmethod
    def _signal_number(value: Any) -> int:
        if isinstance(value, str):
            name = value.upper()
            name = name if name.startswith("SIG") else "SIG" + name
            if name in SIGNALS:
                return SIGNALS[name]
        elif isinstance(value, int) and not isinstance(value, bool) \
                and value in SIGNALS.values():
            return value
        raise OpError("bad_request", f"signal: {value!r:.40} is not one of "
                                     f"{', '.join(SIGNALS)} (or their numbers)")

    def _make_room(self) -> None:
        """Forget the oldest finished job while the table is full (lock held)."""
        while len(self._jobs) >= self.max_jobs:
            finished = [j for j in self._jobs.values() if not j.running]
            if not finished:
                raise OpError("busy", f"start: {self.max_jobs} background processes are "
                                      "running; kill one first")
            oldest = min(finished, key=lambda j: j.ended or 0.0)
            del self._jobs[oldest.pid]

    def _spawn(self, command: Command, pty_size: tuple[int, int] | None,
               tag: str | None) -> Job:
        if pty_size is None:
            proc = spawn(command.argv, command.env, command.cwd,
                         stdin=subprocess.PIPE if command.stdin else subprocess.DEVNULL,
                         user=command.user)
            stdin_fd = None
            if proc.stdin is not None:
                stdin_fd = os.dup(proc.stdin.fileno())
                proc.stdin.close()
        else:
            master, slave = os.openpty()
            try:
                _set_winsize(slave, *pty_size)
                env = dict(command.env)
                env.setdefault("TERM", "xterm-256color")
                proc = spawn(_on_controlling_tty(command.argv), env, command.cwd,
                             stdin=slave, stdout=slave, stderr=slave, user=command.user)
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            stdin_fd = master
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)
        self.owned.add(proc.pid)
        return Job(pid=proc.pid, argv=command.argv, cwd=command.cwd, tag=tag,
                   pty=pty_size is not None, started_at=time.time(),
                   started=time.monotonic(), proc=proc, stdin_fd=stdin_fd,
                   had_stdin=stdin_fd is not None)

    def _pump(self, job: Job, timeout: float | None) -> None:
        """Read the job's output into its log until it has exited and its output is
        drained; reap it. Runs on the job's own thread."""
        proc = job.proc
        sources: dict[int, str] = {}
        pty_copy: int | None = None
        if job.pty:
            assert job.stdin_fd is not None
            # The master is shared with stdin writers; a dup lets the pump close its
            # own copy whatever they do.
            pty_copy = os.dup(job.stdin_fd)
            sources[pty_copy] = "pty"
        else:
            assert proc.stdout is not None and proc.stderr is not None
            sources[proc.stdout.fileno()] = "stdout"
            sources[proc.stderr.fileno()] = "stderr"

        def keep(stream: str, data: bytes) -> None:
            with job.changed:
                job.output.append(stream, data)
                job.changed.notify_all()

        try:
            deadline = job.started + timeout if timeout is not None else None
            job.timed_out = follow_output(sources, job.pid, deadline, keep,
                                          kill_group(job.pid),
                                          lambda block: self._reap(job, block=block))
        finally:
            if job.exit_code is None:  # a bug above: leave no orphan behind
                kill_group(job.pid)()
                self._reap(job, block=True)
            if pty_copy is not None:
                os.close(pty_copy)
            if proc.stdout is not None:
                proc.stdout.close()
            if proc.stderr is not None:
                proc.stderr.close()
            with job.stdin_lock:
                self._close_stdin(job, for_good=True)
            with job.changed:
                job.ended = time.monotonic()
                job.changed.notify_all()

    def _reap(self, job: Job, *, block: bool) -> bool:
        if job.exit_code is not None:
            return True
        try:
            pid, status = os.waitpid(job.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            # Nobody else may reap an owned pid; if it happened anyway, say so in the
            # record rather than invent a status.
            job.exit_code = -int(signals.SIGKILL)
            self.owned.discard(job.pid)
            return True
        if pid == 0:
            return False
        job.exit_code = os.waitstatus_to_exitcode(status)
        job.proc.returncode = job.exit_code  # so Popen never calls waitpid itself
        self.owned.discard(job.pid)
        return True

    @staticmethod
    def _write_stdin(job: Job, payload: bytes) -> int:
        """Write all of ``payload`` (stdin lock held); a process that stops reading for
        ``STDIN_WRITE_TIMEOUT`` gets an error naming how much went in."""
        fd = job.stdin_fd
        assert fd is not None
        view = memoryview(payload)
        written = 0
        deadline = time.monotonic() + STDIN_WRITE_TIMEOUT
        while written < len(view):
            try:
                written += os.write(fd, view[written:])
                continue
            except BlockingIOError:
                pass
            except OSError as err:  # EPIPE / EIO: it closed its stdin or exited
                raise OpError("bad_request", f"send_stdin: pid {job.pid} no longer reads "
                                             f"its stdin ({err.strerror})",
                              written=written) from err
            left = deadline - time.monotonic()
            if left <= 0:
                raise OpError("busy", f"send_stdin: pid {job.pid} did not read its stdin "
                                      f"for {STDIN_WRITE_TIMEOUT:g} s; {written} of "
                                      f"{len(view)} bytes written", written=written)
            select.select([], [fd], [], min(left, 0.5))
        return written

    @staticmethod
    def _close_stdin(job: Job, *, for_good: bool = False) -> None:
        """Close the job's stdin (stdin lock held). A PTY's master stays open while the
        process runs: it is also the terminal's output, so EOF on a terminal is the
        ^D character instead (the pump closes the master, ``for_good``, at the end)."""
        if job.stdin_fd is None:
            return
        if job.pty and not for_good:
            try:
                os.write(job.stdin_fd, b"\x04")
            except OSError:
                pass
            return
        os.close(job.stdin_fd)
        job.stdin_fd = None

    @staticmethod
    def _host_gone(sock: socket.socket) -> bool:
        """True if the host closed (or reset) an attach connection: it sends nothing
        after its request, so readable means EOF."""
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _follow(self, conn: Conn, job: Job, offset: int) -> None:
        with job.changed:
            skipped = max(0, job.output.first_kept - offset)
        conn.send({"type": "attached", "pid": job.pid, "pty": job.pty, "skipped": skipped})
        cursor = offset + skipped
        while True:
            with job.changed:
                chunks = job.output.since(cursor)
                if not chunks and job.running:
                    job.changed.wait(ATTACH_POLL)
                    chunks = job.output.since(cursor)
                running = job.running
                produced = job.output.produced
                dropped = max(0, job.output.first_kept - cursor)
            if dropped:  # output scrolled away while this host was slow
                skipped += dropped
                cursor += dropped
                chunks = [c for c in chunks if c.offset >= cursor]
            for chunk in chunks:
                conn.send({"type": chunk.stream, "offset": chunk.offset}, chunk.data)
                cursor = chunk.offset + len(chunk.data)
            if not running and cursor >= produced:
                break
            if not chunks and self._host_gone(conn.sock):
                # Detached: the job goes on. Nothing can be sent, so there is no final
                # frame to send: the call is over, quietly (a detach is normal use, and
                # the guest's console is too slow a line to log it on).
                conn.finished = True
                return
        code = job.exit_code
        assert code is not None
        ended = job.ended if job.ended is not None else time.monotonic()
        conn.result(pid=job.pid, exit_code=code, signal=-code if code < 0 else None,
                    timed_out=job.timed_out, duration=ended - job.started,
                    offset=cursor, skipped=skipped)
