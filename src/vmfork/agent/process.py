"""The ``exec`` op: run a process, stream its output, enforce its timeout (stdlib only).

Streaming. The connection thread multiplexes, with one selector, the process's stdout
pipe, its stderr pipe and a pidfd (``pidfd_open``, readable once the process has
exited). Each read (≤ 64 KiB) is sent at once as a ``stdout``/``stderr`` frame, so the
host sees output when the process writes it, not when it ends. The process's stdin is
fed from a second thread, which reads ``data`` frames from the host and writes them to
the pipe (non-blocking, so it can give up when the exec is over even if a grandchild
holds the pipe open and never reads).

End of output. A process's exit and its pipes' EOF are separate events: a background
grandchild (``server &``) inherits the pipes and keeps them open. After the exit the
loop reads what is still buffered in the pipes and stops at EOF, after ``QUIET`` seconds
without output, or ``DRAIN_LIMIT`` seconds after the exit, whichever comes first. Output
written later by such grandchildren is not delivered (they get EPIPE/SIGPIPE).

Timeouts. Each exec runs in a new session (``start_new_session``), so it leads its own
process group. At the deadline the whole group gets SIGKILL — children that left the
group with ``setsid`` escape, as in any shell — the process is reaped, buffered output
is drained as above, and the final frame is an ``error`` with code ``timeout``.
If the host goes away mid-exec (a send fails) the group is killed the same way.

Exit status. The op reaps its own child with ``waitpid(pid)`` and tells ``Popen`` the
status (so ``Popen`` never waits itself); the pid is in ``OwnedPids`` from spawn to
reap, which keeps the PID-1 reaper away from it (see ``reaper.py``).
"""

from __future__ import annotations

import os
import select
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vmfork.agent import defaults
from vmfork.agent.conn import Conn, PeerGone
from vmfork.agent.protocol import OUTPUT_CHUNK, ConnectionClosed, ProtocolError
from vmfork.agent.reaper import OwnedPids
from vmfork.agent.request import OpError, os_error

QUIET = 0.05
DRAIN_LIMIT = 1.0
POLL = 0.05
"""Exit polling interval where pidfd_open is missing (Linux < 5.3)."""


def _parse_argv(req: dict[str, Any]) -> list[str]:
    argv, cmd = req.get("argv"), req.get("cmd")
    if (argv is None) == (cmd is None):
        raise OpError("bad_request", "exec needs exactly one of 'argv' (list of strings) "
                                     "and 'cmd' (shell string)")
    if cmd is not None:
        if not isinstance(cmd, str) or "\0" in cmd:
            raise OpError("bad_request", "exec: 'cmd' must be a string without NUL bytes")
        return ["/bin/sh", "-c", cmd]
    if (not isinstance(argv, list) or not argv
            or not all(isinstance(a, str) and "\0" not in a for a in argv)):
        raise OpError("bad_request",
                      "exec: 'argv' must be a non-empty list of strings without NUL bytes")
    return argv


def _parse_env(req: dict[str, Any], user: defaults.RunAs | None = None) -> dict[str, str]:
    env = dict(defaults.current().env)
    if user is not None:   # what login(1) sets; the request's own env still wins
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    extra = req.get("env") or {}
    if not isinstance(extra, dict):
        raise OpError("bad_request", "exec: 'env' must be an object of strings")
    for key, value in extra.items():
        if not key or "=" in key or "\0" in key:
            raise OpError("bad_request", f"exec: invalid environment variable name {key!r}")
        if value is None:
            env.pop(key, None)
        elif isinstance(value, str) and "\0" not in value:
            env[key] = value
        else:
            raise OpError("bad_request", f"exec: env[{key!r}] must be a string or null")
    return env


def _parse_timeout(req: dict[str, Any]) -> float | None:
    timeout = req.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise OpError("bad_request", f"exec: 'timeout' must be a positive number of seconds "
                                     f"or null, got {timeout!r}")
    return float(timeout)


def spawn(argv: list[str], env: dict[str, str], cwd: str | None, *,
          stdin: int, stdout: int = subprocess.PIPE,
          stderr: int = subprocess.PIPE,
          user: defaults.RunAs | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own, as ``user`` (the request's) or else the
    image's user, with errors mapped to the protocol's codes (``exec`` and background
    jobs both start processes here). ``stdin``/``stdout``/``stderr`` are ``subprocess``
    constants or fds."""
    image = defaults.current()
    # The image's user, if it names one (an OCI image's User): as a container runtime
    # runs its processes, with the groups /etc/group gives that user.
    ids: dict[str, Any] = {}
    if user is not None:
        ids = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
    elif image.uid is not None:
        ids = {"user": image.uid, "group": image.gid, "extra_groups": list(image.groups)}
    try:
        return subprocess.Popen(
            argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
            close_fds=True, start_new_session=True, **ids)
    except FileNotFoundError as err:
        # Popen names the missing file: the working directory if chdir failed,
        # otherwise the program.
        if cwd is not None and err.filename == cwd:
            raise OpError("not_found", f"exec {argv[0]!r}: working directory {cwd!r} "
                                       "does not exist", exit_code=127, path=cwd) from err
        raise OpError("not_found", f"exec: program {argv[0]!r} not found (PATH="
                                   f"{env.get('PATH', '')!r})", exit_code=127,
                      path=argv[0]) from err
    except PermissionError as err:
        raise OpError("permission_denied", f"exec {argv[0]!r}: {err.strerror}",
                      exit_code=126, path=err.filename or argv[0]) from err
    except OSError as err:
        raise os_error(err, "exec", err.filename or argv[0], exit_code=126) from err


@dataclass(frozen=True)
class Command:
    """What ``exec`` and ``start`` share: the validated program, environment,
    working directory, stdin choice and timeout of a request."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    stdin: bool
    timeout: float | None
    user: defaults.RunAs | None = None

    @classmethod
    def parse(cls, req: dict[str, Any], op: str = "exec") -> Command:
        argv = _parse_argv(req)
        user = defaults.run_as(req.get("user"), op)
        env = _parse_env(req, user)
        cwd = req.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
            raise OpError("bad_request", f"exec: 'cwd' must be an absolute path, got {cwd!r}")
        if cwd is None:
            cwd = user.home if user is not None else defaults.current().cwd
        want_stdin = req.get("stdin", False)
        if not isinstance(want_stdin, bool):
            raise OpError("bad_request", "exec: 'stdin' must be true or false")
        return cls(argv, env, cwd, want_stdin, _parse_timeout(req), user)

    def uid(self) -> int:
        """Whom the process runs as (told to the host, which checks that a ``user`` it
        asked for was heard: an agent older than protocol 3 ignores the field)."""
        if self.user is not None:
            return self.user.uid
        image = defaults.current().uid
        return os.getuid() if image is None else image


def run_exec(conn: Conn, req: dict[str, Any], owned: OwnedPids) -> None:
    command = Command.parse(req)
    argv = command.argv
    timeout = command.timeout
    started = time.monotonic()
    proc = spawn(argv, command.env, command.cwd,
                 stdin=subprocess.PIPE if command.stdin else subprocess.DEVNULL,
                 user=command.user)
    with owned.owning(proc.pid):
        _Execution(conn, proc, argv[0], started, timeout, command.uid()).run()


class _Execution:
    def __init__(self, conn: Conn, proc: subprocess.Popen[bytes], program: str,
                 started: float, timeout: float | None, uid: int = 0) -> None:
        self.conn = conn
        self.uid = uid
        self.proc = proc
        self.program = program
        self.started = started
        self.timeout = timeout
        self.exit_code: int | None = None

    def run(self) -> None:
        proc = self.proc
        assert proc.stdout is not None and proc.stderr is not None
        stdin_fd = os.dup(proc.stdin.fileno()) if proc.stdin is not None else None
        if proc.stdin is not None:
            proc.stdin.close()
        stop_stdin = threading.Event()
        pump: threading.Thread | None = None
        try:
            self.conn.send({"type": "started", "pid": proc.pid, "uid": self.uid})
            if stdin_fd is not None:
                pump = threading.Thread(target=_pump_stdin,
                                        args=(self.conn, stdin_fd, stop_stdin),
                                        name=f"exec-stdin-{proc.pid}", daemon=True)
                pump.start()
                stdin_fd = None  # the pump owns it now
            timed_out = self._stream_output()
            duration = time.monotonic() - self.started
            if timed_out:
                self.conn.error("timeout", f"exec: {self.program!r} (pid {proc.pid}) "
                                f"did not finish within its timeout of {self.timeout:g} s; "
                                "its process group was killed (raise 'timeout' to allow "
                                "more time)", timeout=self.timeout, pid=proc.pid,
                                duration=duration)
            else:
                code = self.exit_code
                assert code is not None
                self.conn.result(exit_code=code, signal=-code if code < 0 else None,
                                 pid=proc.pid, duration=duration)
        finally:
            if self.exit_code is None:  # the host went away, or a bug: leave no orphans
                self._kill()
                self._reap(block=True)
            proc.stdout.close()
            proc.stderr.close()
            if stdin_fd is not None:
                os.close(stdin_fd)
            stop_stdin.set()
            if pump is not None:
                # The pump reads the host's remaining frames until its EOF; once our
                # final frame is out, the host hangs up and the pump returns.
                self.conn.half_close()
                pump.join(timeout=2.0)
                if pump.is_alive():
                    try:
                        self.conn.sock.shutdown(socket.SHUT_RD)
                    except OSError:
                        pass
                    pump.join(timeout=1.0)
                self.conn.input_drained = True

    def _stream_output(self) -> bool:
        """Forward output until the process has exited and its pipes are drained.
        Returns True if the timeout killed it."""
        proc = self.proc
        assert proc.stdout is not None and proc.stderr is not None
        deadline = self.started + self.timeout if self.timeout is not None else None
        try:
            return follow_output(
                {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}, proc.pid,
                deadline, lambda stream, data: self.conn.send({"type": stream}, data),
                kill_group(proc.pid), lambda block: self._reap(block=block))
        except PeerGone:
            kill_group(proc.pid)()
            raise

    def _kill(self) -> None:
        kill_group(self.proc.pid)()

    def _reap(self, *, block: bool) -> bool:
        """Collect the child's exit status. True once collected."""
        if self.exit_code is not None:
            return True
        try:
            pid, status = os.waitpid(self.proc.pid, 0 if block else os.WNOHANG)
        except ChildProcessError as err:
            raise OpError("internal", f"exec: the exit status of pid {self.proc.pid} was "
                                      "collected by someone else") from err
        if pid == 0:
            return False
        self.exit_code = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.exit_code  # so Popen never calls waitpid itself
        return True


def kill_group(pid: int) -> Callable[[], None]:
    """A call that SIGKILLs ``pid``'s process group (it leads its own session), then
    ``pid`` itself in case it changed its group."""
    def kill() -> None:
        for call, target in ((os.killpg, pid), (os.kill, pid)):
            try:
                call(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return kill


def follow_output(sources: dict[int, str], pid: int, deadline: float | None,
                  emit: Callable[[str, bytes], None], kill: Callable[[], None],
                  reap: Callable[[bool], bool]) -> bool:
    """Read ``sources`` (fd → stream name) into ``emit`` until process ``pid`` has
    exited and its output is drained (see "End of output" above); at ``deadline``
    (a ``time.monotonic()`` instant) ``kill`` it. ``reap(block)`` collects its exit
    status and says whether it has. Returns True if the deadline killed it.

    ``exec`` and background jobs both follow their processes here. A read error
    counts as EOF: a PTY master gives EIO once the last slave fd is closed."""
    sel = selectors.DefaultSelector()
    for fd, name in sources.items():
        sel.register(fd, selectors.EVENT_READ, name)
    open_sources = len(sources)
    pidfd: int | None = None
    try:
        pidfd = os.pidfd_open(pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    except (AttributeError, OSError):
        pidfd = None
    timed_out = False
    exited_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if exited_at is None:
                if deadline is not None and now >= deadline:
                    timed_out = True
                    kill()
                    reap(True)
                    exited_at = now
                    continue
                wait = None if deadline is None else deadline - now
                if pidfd is None:
                    wait = POLL if wait is None else min(wait, POLL)
            else:
                if open_sources == 0 or now - exited_at >= DRAIN_LIMIT:
                    break
                wait = min(QUIET, exited_at + DRAIN_LIMIT - now)
            events = sel.select(wait)
            if not events and exited_at is not None:
                break  # quiet since the exit: whatever still holds the pipes is not it
            for key, _ in events:
                if key.data == "exit":
                    sel.unregister(key.fd)
                    reap(True)
                    exited_at = time.monotonic()
                    continue
                try:
                    data = os.read(key.fd, OUTPUT_CHUNK)
                except OSError:
                    data = b""
                if data:
                    emit(key.data, data)
                else:
                    sel.unregister(key.fd)
                    open_sources -= 1
            if exited_at is None and pidfd is None and reap(False):
                exited_at = time.monotonic()
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return timed_out


def _pump_stdin(conn: Conn, fd: int, stop: threading.Event) -> None:
    """Copy the host's ``data`` frames into the process's stdin until ``eof``.

    After the process stops reading (EPIPE) or the exec is over, frames are still read
    and discarded until ``eof``, so the host is never blocked on a full socket."""
    os.set_blocking(fd, False)
    writable = True
    try:
        while True:
            try:
                frame = conn.recv(None)
            except (ConnectionClosed, ProtocolError, OSError):
                return
            if frame.type == "eof":
                return
            if frame.type != "data" or not writable:
                continue
            view = memoryview(frame.payload)
            while view and writable:
                if stop.is_set():
                    writable = False
                    break
                try:
                    n = os.write(fd, view)
                    view = view[n:]
                except BlockingIOError:
                    select.select([], [fd], [], 0.1)
                except OSError:  # EPIPE: the process closed its stdin or exited
                    writable = False
    finally:
        os.close(fd)
