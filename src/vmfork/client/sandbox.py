"""``Sandbox``: the E2B-shaped handle on one sandbox (REFERENCE-forkd.md, SDKs), and
``AsyncSandbox``, the same for ``asyncio``.

``Sandbox.create(tag)`` spawns one through the daemon, ``Sandbox.connect(id)``
attaches to one spawned any other way (CLI, curl, another process): the daemon
owns the state (DESIGN.md decision 6). ``with`` kills it on exit. Sub-APIs are
properties: ``sb.commands.run``, ``sb.files.read/write/list/remove``.

One implementation: the synchronous one. Every call is one request on its own
connection, so many sandboxes can be driven from many threads at once.
``AsyncSandbox`` is a thin facade that runs each call in a worker thread
(``asyncio.to_thread``) and delivers streamed output to the event loop, so a
coroutine never blocks the loop and there is no second copy of the logic.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import io
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, Self

from vmfork.client.controller import Controller, Egress, ExecStream
from vmfork.client.errors import ControllerError

OutputCallback = Callable[[str], object]


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    signal: int | None = None
    duration_secs: float = 0.0
    truncated: bool = False
    """The output went past the daemon's cap and was cut (stream it to get it whole)."""


class CommandExitError(ControllerError):
    """``commands.run(..., check=True)`` and the command exited non-zero; ``result`` holds
    its output."""

    def __init__(self, result: CommandResult, url: str) -> None:
        super().__init__(200, {"error": f"command exited {result.exit_code}: "
                               f"{result.stderr.strip()[-300:]}"}, url)
        self.result = result


class CommandTimeout(ControllerError):
    """The command ran past ``timeout`` seconds and was killed; ``stdout``/``stderr`` hold
    its output so far. Pass a larger ``timeout=`` to ``commands.run``."""

    def __init__(self, error: ControllerError) -> None:
        super().__init__(error.status, error.body, error.url)
        body = error.body if isinstance(error.body, dict) else {}
        self.stdout = str(body.get("stdout", ""))
        self.stderr = str(body.get("stderr", ""))


@dataclass(frozen=True)
class EvalResult:
    result: str | None
    error: str | None
    exit_code: int
    stdout: str = ""
    stderr: str = ""


class CommandHandle:
    """A command started with ``background=True``: its output streams into ``stdout`` /
    ``stderr`` (and the callbacks) while it runs; ``wait()`` returns its result."""

    def __init__(self, stream: ExecStream, base_url: str,
                 on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                 check: bool) -> None:
        self._stream = stream
        self._base_url = base_url
        self._out, self._err = io.StringIO(), io.StringIO()
        self._lock = threading.Lock()
        self._result: CommandResult | None = None
        self._error: BaseException | None = None
        self._check = check
        self._done = threading.Event()
        self._callbacks = (on_stdout, on_stderr)
        self._thread = threading.Thread(target=self._pump, name="vmfork-command", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            data = _consume(self._stream, self._base_url, self._append)
            with self._lock:
                self._result = CommandResult(self._out.getvalue(), self._err.getvalue(),
                                             data["exit_code"], data.get("signal"),
                                             data.get("duration_secs", 0.0))
        except BaseException as err:  # noqa: BLE001 - handed to wait()
            self._error = err
        finally:
            self._done.set()

    def _append(self, kind: str, text: str) -> None:
        with self._lock:
            (self._out if kind == "stdout" else self._err).write(text)
        callback = self._callbacks[0 if kind == "stdout" else 1]
        if callback is not None:
            callback(text)

    @property
    def stdout(self) -> str:
        with self._lock:
            return self._out.getvalue()

    @property
    def stderr(self) -> str:
        with self._lock:
            return self._err.getvalue()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> CommandResult:
        """The result once the command has exited (``timeout`` in seconds: how long to
        wait here, not the command's own limit). Raises ``CommandTimeout`` if the
        command's limit killed it, ``TimeoutError`` if ``timeout`` passed first."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the command is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        if self._check and self._result.exit_code != 0:
            raise CommandExitError(self._result, self._base_url)
        return self._result

    def kill(self) -> None:
        """Hang up: the guest kills the command's process group when it next writes
        output (or at its timeout); ``wait`` then raises ``ControllerError``."""
        self._stream.close()


def _consume(stream: ExecStream, base_url: str,
             emit: Callable[[str, str], None]) -> dict[str, Any]:
    """Read an exec stream to its end: output events go to ``emit(kind, text)``; returns
    the ``exit`` event's data or raises the ``error`` event as ``ControllerError``."""
    for event, data in stream:
        if event in ("stdout", "stderr"):
            emit(event, data["data"])
        elif event == "exit":
            return data
        elif event == "error":
            error = ControllerError(int(data.get("status", 502)), data, base_url)
            if error.status == 504:
                raise CommandTimeout(error)
            raise error
    raise ControllerError(502, "the exec stream ended without a result (the daemon or the "
                          "sandbox stopped, or the command was killed)", base_url)


class Process:
    """A background process in a sandbox (``commands.start``, ``commands.connect``,
    ``pty.create``): it outlives the call that started it and this handle; any client
    can reach it again by ``pid``."""

    def __init__(self, sandbox: Sandbox, pid: int, *, pty: bool = False) -> None:
        self._sb = sandbox
        self.pid = pid
        self.pty = pty
        self._end: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"Process({self.pid}, sandbox={self._sb.id!r})"

    def output(self, *, offset: int = 0) -> Iterator[tuple[str, bytes]]:
        """``(stream, bytes)`` as the process writes (what the guest still keeps from
        ``offset`` first), until it ends; ``stream`` is ``stdout``, ``stderr`` or
        ``pty``. Stopping the iteration detaches."""
        stream = self._sb.controller.process_output(self._sb.id, self.pid, offset=offset,
                                                    encoding="base64")
        try:
            for event, data in stream:
                if event in ("stdout", "stderr", "pty"):
                    yield event, base64.b64decode(data["data_b64"])
                elif event == "exit":
                    self._end = data
                    return
                elif event == "error":
                    raise ControllerError(int(data.get("status", 502)), data,
                                          self._sb.controller.base_url)
        finally:
            stream.close()

    def wait(self, *, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> CommandResult:
        """Follow the output from the start until the process ends."""
        out, err = bytearray(), bytearray()
        self._end = None
        for kind, chunk in self.output():
            (err if kind == "stderr" else out).extend(chunk)
            callback = on_stderr if kind == "stderr" else on_stdout
            if callback is not None:
                callback(chunk.decode("utf-8", "replace"))
        end = self._end
        if end is None:
            raise ControllerError(502, "the output stream ended without the process's end "
                                  "(the daemon or the sandbox stopped)",
                                  self._sb.controller.base_url)
        return CommandResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                             int(end["exit_code"]), end.get("signal"),
                             float(end.get("duration", 0.0)),
                             truncated=int(end.get("skipped", 0)) > 0)

    def send_stdin(self, data: bytes | str) -> int:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        return self._sb.controller.send_process_stdin(self._sb.id, self.pid, raw)

    def close_stdin(self) -> None:
        self._sb.controller.send_process_stdin(self._sb.id, self.pid, b"", eof=True)

    def kill(self, signal: str | int = "SIGKILL") -> bool:
        """Signal its process group; False if it had already exited."""
        return self._sb.controller.signal_process(self._sb.id, self.pid, signal)

    def resize(self, rows: int, cols: int) -> None:
        self._sb.controller.resize_process_pty(self._sb.id, self.pid, rows, cols)


class Commands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def run(self, cmd: str | Sequence[str], *, timeout: float = 60,
            envs: Mapping[str, str | None] | None = None, cwd: str | None = None,
            stdin: str | None = None, on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None, background: bool = False,
            check: bool = False) -> Any:
        """Run ``cmd`` (a string for ``/bin/sh -c``, or an argv list); ``timeout`` in
        seconds, after which the guest kills it (``CommandTimeout``).

        With ``on_stdout``/``on_stderr`` the output streams to them as it is written
        (and is also in the result). With ``background=True`` it returns at once with
        a ``CommandHandle`` (``wait()``, ``kill()``, output so far); otherwise a
        ``CommandResult``. ``check=True`` raises ``CommandExitError`` on non-zero exit.
        """
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        c = self._sb.controller
        try:
            if background:
                stream = c.exec_stream(self._sb.id, args, timeout, env=envs, cwd=cwd,
                                       stdin=stdin)
                return CommandHandle(stream, c.base_url, on_stdout, on_stderr, check)
            if on_stdout is None and on_stderr is None:
                r = c.exec_command(self._sb.id, args, timeout, env=envs, cwd=cwd, stdin=stdin)
            else:
                r = self._stream(args, timeout, envs, cwd, stdin, on_stdout, on_stderr)
        except ControllerError as err:
            if err.status == 504 and not isinstance(err, CommandTimeout):
                raise CommandTimeout(err) from None
            raise
        result = CommandResult(r["stdout"], r["stderr"], r["exit_code"], r.get("signal"),
                               r.get("duration_secs", 0.0), bool(r.get("truncated", False)))
        if check and result.exit_code != 0:
            raise CommandExitError(result, c.base_url)
        return result

    def start(self, cmd: str | Sequence[str], *, envs: Mapping[str, str | None] | None = None,
              cwd: str | None = None, stdin: bool = False, timeout: float | None = None,
              tag: str | None = None) -> Process:
        """Start ``cmd`` in the background and return at once; the process outlives
        this call (``connect(pid)`` reaches it later). ``stdin=True`` keeps its stdin
        open for ``Process.send_stdin``."""
        r = self._sb.controller.start_process(self._sb.id, cmd, env=envs, cwd=cwd,
                                              stdin=stdin, timeout_secs=timeout, tag=tag)
        return Process(self._sb, int(r["pid"]))

    def list(self) -> list[dict[str, Any]]:
        """The sandbox's background processes (running, and recently ended)."""
        return self._sb.controller.list_processes(self._sb.id)

    def connect(self, pid: int) -> Process:
        for info in self.list():
            if info["pid"] == pid:
                return Process(self._sb, pid, pty=bool(info["pty"]))
        raise ControllerError(404, {"error": f"sandbox {self._sb.id} has no background "
                                             f"process {pid}"}, self._sb.controller.base_url)

    def kill(self, pid: int, signal: str | int = "SIGKILL") -> bool:
        return self._sb.controller.signal_process(self._sb.id, pid, signal)

    def send_stdin(self, pid: int, data: bytes | str) -> int:
        return Process(self._sb, pid).send_stdin(data)

    def _stream(self, args: builtins.list[str], timeout: float, envs: Mapping[str, str | None] | None,
                cwd: str | None, stdin: str | None, on_stdout: OutputCallback | None,
                on_stderr: OutputCallback | None) -> dict[str, Any]:
        out, err = io.StringIO(), io.StringIO()
        c = self._sb.controller

        def emit(kind: str, text: str) -> None:
            (out if kind == "stdout" else err).write(text)
            callback = on_stdout if kind == "stdout" else on_stderr
            if callback is not None:
                callback(text)

        stream = c.exec_stream(self._sb.id, args, timeout, env=envs, cwd=cwd, stdin=stdin)
        data = _consume(stream, c.base_url, emit)
        return {**data, "stdout": out.getvalue(), "stderr": err.getvalue()}


class Pty:
    """Terminals: a process on a pseudo-terminal (one output stream, input by
    ``send_input``, a size that ``resize`` changes)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def create(self, rows: int = 24, cols: int = 80, *, cmd: str | Sequence[str] = "/bin/sh",
               envs: Mapping[str, str | None] | None = None, cwd: str | None = None,
               timeout: float | None = None) -> Process:
        r = self._sb.controller.start_process(self._sb.id, cmd, env=envs, cwd=cwd,
                                              timeout_secs=timeout, pty=(rows, cols))
        return Process(self._sb, int(r["pid"]), pty=True)

    def send_input(self, pid: int, data: bytes | str) -> int:
        return Process(self._sb, pid, pty=True).send_stdin(data)

    def resize(self, pid: int, rows: int, cols: int) -> None:
        self._sb.controller.resize_process_pty(self._sb.id, pid, rows, cols)

    def kill(self, pid: int) -> bool:
        return self._sb.controller.signal_process(self._sb.id, pid, "SIGKILL")


class Files:
    """Guest files. Reads and writes stream (no size limit from buffering): pass a file
    object to ``read_to``/``write`` for large files."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def read(self, path: str) -> bytes:
        buf = io.BytesIO()
        self._sb.controller.read_file_to(self._sb.id, path, buf)
        return buf.getvalue()

    def read_to(self, path: str, out: IO[bytes]) -> int:
        """Stream the guest file into ``out``; returns the number of bytes."""
        return self._sb.controller.read_file_to(self._sb.id, path, out)  # type: ignore[arg-type]

    def write(self, path: str, data: bytes | str | IO[bytes], *, mode: int = 0o644,
              make_parents: bool = False, length: int | None = None) -> int:
        """Replace the guest file with ``data``: bytes, text (UTF-8), or a binary file
        object streamed (``length`` bytes; default: from its position to its end)."""
        raw = data.encode() if isinstance(data, str) else data
        result = self._sb.controller.write_file(self._sb.id, path, raw,  # type: ignore[arg-type]
                                                length=length, mode=mode,
                                                make_parents=make_parents)
        return int(result["size"])

    def list(self, path: str) -> list[dict[str, Any]]:
        return self._sb.controller.list_files(self._sb.id, path)

    def stat(self, path: str) -> dict[str, Any]:
        return self._sb.controller.stat_file(self._sb.id, path)

    def rename(self, path: str, new_path: str, *, overwrite: bool = False) -> dict[str, Any]:
        """Move a guest path; returns the moved file's stat."""
        return self._sb.controller.rename_file(self._sb.id, path, new_path,
                                               overwrite=overwrite)

    def make_dir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> bool:
        """Make a directory (with its parents, by default); False if it was there."""
        return self._sb.controller.make_dir(self._sb.id, path, parents=parents, mode=mode)

    def exists(self, path: str) -> bool:
        return self._sb.controller.file_exists(self._sb.id, path)

    def watch_dir(self, path: str, *, recursive: bool = False) -> DirWatcher:
        """Changes under a guest directory, as they happen: iterate the returned
        watcher (lists of ``{name, type, is_dir}``); ``close()`` stops it."""
        return DirWatcher(self._sb.controller.watch_dir(self._sb.id, path,
                                                        recursive=recursive),
                          self._sb.controller.base_url)

    def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False) -> None:
        self._sb.controller.remove_file(self._sb.id, path, recursive=recursive,
                                        missing_ok=missing_ok)


class DirWatcher:
    """An active directory watch: iterate it for batches of events."""

    def __init__(self, stream: ExecStream, base_url: str) -> None:
        self._stream = stream
        self._base_url = base_url
        self._events = iter(stream)
        event, data = next(self._events, ("closed", {}))
        if event != "watching":
            stream.close()
            raise ControllerError(int(data.get("status", 502)), data, base_url)
        self.directories = int(data.get("directories", 0))

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        for event, data in self._events:
            if event == "events":
                yield list(data["events"])
            elif event == "end":
                return
            elif event == "error":
                raise ControllerError(int(data.get("status", 502)), data, self._base_url)

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandbox:
    def __init__(self, info: dict[str, Any], controller: Controller) -> None:
        self.info = info
        self.id: str = info["id"]
        self.controller = controller
        self.commands = Commands(self)
        self.files = Files(self)
        self.pty = Pty(self)

    @classmethod
    def create(cls, snapshot_tag: str, *, memory_limit_mib: int | None = None,
               controller: Controller | None = None,
               network: bool | Egress = False, timeout: float | None = None,
               on_timeout: str = "kill", metadata: Mapping[str, str] | None = None,
               envs: Mapping[str, str] | None = None) -> Sandbox:
        """``network``: give the sandbox a network of its own (``True``: egress allowed;
        or an egress policy: ``"deny"``, a list of CIDRs and domain names, ...). The
        snapshot must have been created with ``network=True``. ``timeout``: seconds
        until it is killed (or paused, ``on_timeout="pause"``); default none.
        ``metadata``: labels ``Sandbox.list`` finds it by; ``envs``: every command's."""
        c = controller or Controller()
        egress = None if isinstance(network, bool) else network
        info = c.spawn_sandboxes(snapshot_tag, 1, memory_limit_mib=memory_limit_mib,
                                 per_child_netns=network is not False, egress=egress,
                                 timeout_secs=timeout, on_timeout=on_timeout,
                                 metadata=metadata, envs=envs)[0]
        return cls(info, c)

    @classmethod
    def connect(cls, sandbox_id: str, *, controller: Controller | None = None,
                timeout: float | None = None) -> Sandbox:
        """Attach to a sandbox by id; a paused one is resumed (same id). ``timeout``
        extends its lifetime to at least that many seconds from now."""
        c = controller or Controller()
        info = c.get_sandbox(sandbox_id)   # all a forkd daemon offers
        if info.get("status") == "paused" or timeout is not None:
            info = c.connect_sandbox(sandbox_id, timeout)
        return cls(info, c)

    @classmethod
    def list(cls, *, metadata: Mapping[str, str] | None = None,
             state: Sequence[str] | str | None = None,
             controller: Controller | None = None) -> builtins.list[dict[str, Any]]:
        """The sandboxes (their info) whose metadata has every pair of ``metadata``."""
        return (controller or Controller()).list_sandboxes(metadata=metadata, state=state)

    def get_info(self) -> dict[str, Any]:
        """The sandbox's info now (status, ``end_at_unix``, metadata, volumes)."""
        self.info = self.controller.get_sandbox(self.id)
        return self.info

    def set_timeout(self, timeout: float | None) -> None:
        """End the sandbox ``timeout`` seconds from now (None: never)."""
        self.info = self.controller.set_timeout(self.id, timeout)

    def pause(self) -> None:
        """Snapshot the sandbox and stop it; ``resume`` (or ``connect``) brings it back
        with the same id, files and processes."""
        self.info = self.controller.pause_sandbox(self.id)

    def resume(self, *, timeout: float | None = None) -> None:
        self.info = self.controller.resume_sandbox(self.id, timeout)

    def get_metrics(self) -> dict[str, Any]:
        """CPU seconds, memory and disk use, measured now."""
        return self.controller.sandbox_metrics(self.id)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, snapshot={self.info.get('snapshot_tag')!r})"

    def eval(self, code: str, *, timeout: float | None = None) -> EvalResult:
        r = self.controller.eval_code(self.id, code, timeout)
        return EvalResult(r["result"], r["error"], r["exit_code"], r.get("stdout", ""),
                          r.get("stderr", ""))

    def ping(self) -> dict[str, Any]:
        return self.controller.ping_sandbox(self.id)

    def branch(self, tag: str | None = None, *, mode: str = "full",
               wait: bool = True) -> dict[str, Any]:
        """Snapshot this sandbox as ``tag`` (BRANCH); returns the ``SnapshotInfo``."""
        return self.controller.branch_sandbox(self.id, tag=tag, mode=mode, wait=wait)

    @property
    def address(self) -> str | None:
        """Where the host reaches the guest (a sandbox with a network of its own)."""
        address: str | None = self.info.get("guest_addr")
        return address

    def expose(self, guest_port: int, host_port: int = 0,
               protocol: str = "tcp") -> int:
        """Publish ``guest_port`` on ``host_port`` of the host (0: a free one); returns
        the host port (reachable on every host address, 127.0.0.1 included)."""
        published = self.controller.expose_port(self.id, guest_port, host_port, protocol)
        return int(published["host_port"])

    def unexpose(self, host_port: int, protocol: str = "tcp") -> None:
        self.controller.unexpose_port(self.id, host_port, protocol)

    def ports(self) -> builtins.list[dict[str, Any]]:
        return self.controller.list_ports(self.id)

    def set_egress(self, egress: Egress) -> dict[str, Any]:
        return self.controller.set_egress(self.id, egress)

    def kill(self) -> None:
        """Kill the sandbox; killing one that is already gone is not an error."""
        try:
            self.controller.kill_sandbox(self.id)
        except ControllerError as err:
            if err.status != 404:
                raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill()


# -- asyncio facade -------------------------------------------------------------------


def _on_loop(callback: OutputCallback | None) -> OutputCallback | None:
    """``callback`` called on the running event loop, wherever the output arrives."""
    if callback is None:
        return None
    loop = asyncio.get_running_loop()

    def deliver(text: str) -> None:
        loop.call_soon_threadsafe(callback, text)

    return deliver


class AsyncCommandHandle:
    def __init__(self, handle: CommandHandle) -> None:
        self._handle = handle

    @property
    def stdout(self) -> str:
        return self._handle.stdout

    @property
    def stderr(self) -> str:
        return self._handle.stderr

    async def wait(self) -> CommandResult:
        return await asyncio.to_thread(self._handle.wait)

    def kill(self) -> None:
        self._handle.kill()


class AsyncCommands:
    def __init__(self, commands: Commands) -> None:
        self._commands = commands

    async def run(self, cmd: str | Sequence[str], *, timeout: float = 60,
                  envs: Mapping[str, str | None] | None = None, cwd: str | None = None,
                  stdin: str | None = None, on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None, background: bool = False,
                  check: bool = False) -> Any:
        """``Commands.run``, awaited; callbacks run on the event loop. With
        ``background=True`` returns an ``AsyncCommandHandle``."""
        result = await asyncio.to_thread(
            self._commands.run, cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
            on_stdout=_on_loop(on_stdout), on_stderr=_on_loop(on_stderr),
            background=background, check=check)
        return AsyncCommandHandle(result) if background else result


class AsyncFiles:
    def __init__(self, files: Files) -> None:
        self._files = files

    async def read(self, path: str) -> bytes:
        return await asyncio.to_thread(self._files.read, path)

    async def read_to(self, path: str, out: IO[bytes]) -> int:
        return await asyncio.to_thread(self._files.read_to, path, out)

    async def write(self, path: str, data: bytes | str | IO[bytes], *, mode: int = 0o644,
                    make_parents: bool = False, length: int | None = None) -> int:
        return await asyncio.to_thread(self._files.write, path, data, mode=mode,
                                       make_parents=make_parents, length=length)

    async def list(self, path: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._files.list, path)

    async def stat(self, path: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._files.stat, path)

    async def remove(self, path: str, *, recursive: bool = False,
                     missing_ok: bool = False) -> None:
        await asyncio.to_thread(self._files.remove, path, recursive=recursive,
                                missing_ok=missing_ok)


class AsyncSandbox:
    """``Sandbox`` for ``asyncio``: ``await AsyncSandbox.create(tag)``, ``async with``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sync = sandbox
        self.id = sandbox.id
        self.info = sandbox.info
        self.commands = AsyncCommands(sandbox.commands)
        self.files = AsyncFiles(sandbox.files)

    @classmethod
    async def create(cls, snapshot_tag: str, *, memory_limit_mib: int | None = None,
                     controller: Controller | None = None,
                     network: bool | Egress = False) -> AsyncSandbox:
        return cls(await asyncio.to_thread(Sandbox.create, snapshot_tag,
                                           memory_limit_mib=memory_limit_mib,
                                           controller=controller, network=network))

    async def expose(self, guest_port: int, host_port: int = 0, protocol: str = "tcp") -> int:
        return await asyncio.to_thread(self.sync.expose, guest_port, host_port, protocol)

    async def unexpose(self, host_port: int, protocol: str = "tcp") -> None:
        await asyncio.to_thread(self.sync.unexpose, host_port, protocol)

    async def ports(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.ports)

    @classmethod
    async def connect(cls, sandbox_id: str, *,
                      controller: Controller | None = None) -> AsyncSandbox:
        return cls(await asyncio.to_thread(Sandbox.connect, sandbox_id, controller=controller))

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"

    async def eval(self, code: str, *, timeout: float | None = None) -> EvalResult:
        return await asyncio.to_thread(self.sync.eval, code, timeout=timeout)

    async def ping(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.ping)

    async def branch(self, tag: str | None = None, *, mode: str = "full",
                     wait: bool = True) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.branch, tag, mode=mode, wait=wait)

    async def kill(self) -> None:
        await asyncio.to_thread(self.sync.kill)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.kill()
