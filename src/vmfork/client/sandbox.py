"""``Sandbox``: the E2B-shaped handle on one sandbox (REFERENCE-forkd.md, SDKs).

``Sandbox.create(tag)`` spawns one through the daemon, ``Sandbox.connect(id)``
attaches to one spawned any other way (CLI, curl, another process): the daemon
owns the state (DESIGN.md decision 6). ``with`` kills it on exit. Sub-APIs are
properties: ``sb.commands.run``, ``sb.files.read/write/list/remove``.
Synchronous only for now; every call is one request on its own connection, so
many sandboxes can be driven from many threads.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from vmfork.client.controller import Controller, ControllerError


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    signal: int | None = None
    duration_secs: float = 0.0


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


class Commands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def run(self, cmd: str | Sequence[str], *, timeout: float = 60,
            envs: Mapping[str, str | None] | None = None, cwd: str | None = None,
            stdin: str | None = None, on_stdout: Callable[[str], None] | None = None,
            on_stderr: Callable[[str], None] | None = None,
            check: bool = False) -> CommandResult:
        """Run ``cmd`` (a string for ``/bin/sh -c``, or an argv list); ``timeout`` in
        seconds. With ``on_stdout``/``on_stderr`` the output streams to them as it is
        written (and is also in the result)."""
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        c = self._sb.controller
        try:
            if on_stdout is None and on_stderr is None:
                r = c.exec_command(self._sb.id, args, timeout, env=envs, cwd=cwd, stdin=stdin)
            else:
                r = self._stream(args, timeout, envs, cwd, stdin, on_stdout, on_stderr)
        except ControllerError as err:
            if err.status == 504:
                raise CommandTimeout(err) from None
            raise
        result = CommandResult(r["stdout"], r["stderr"], r["exit_code"], r.get("signal"),
                               r.get("duration_secs", 0.0))
        if check and result.exit_code != 0:
            raise CommandExitError(result, c.base_url)
        return result

    def _stream(self, args: list[str], timeout: float, envs: Mapping[str, str | None] | None,
                cwd: str | None, stdin: str | None,
                on_stdout: Callable[[str], None] | None,
                on_stderr: Callable[[str], None] | None) -> dict[str, Any]:
        out, err = io.StringIO(), io.StringIO()
        c = self._sb.controller
        for event, data in c.exec_stream(self._sb.id, args, timeout, env=envs, cwd=cwd,
                                         stdin=stdin):
            if event in ("stdout", "stderr"):
                (out if event == "stdout" else err).write(data["data"])
                callback = on_stdout if event == "stdout" else on_stderr
                if callback is not None:
                    callback(data["data"])
            elif event == "exit":
                return {**data, "stdout": out.getvalue(), "stderr": err.getvalue()}
            elif event == "error":
                raise ControllerError(int(data.get("status", 502)), data, c.base_url)
        raise ControllerError(502, "the exec stream ended without a result (the daemon or "
                              "the sandbox stopped?)", c.base_url)


class Files:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def read(self, path: str) -> bytes:
        buf = io.BytesIO()
        self._sb.controller.read_file_to(self._sb.id, path, buf)
        return buf.getvalue()

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644,
              make_parents: bool = False) -> int:
        raw = data.encode() if isinstance(data, str) else data
        result = self._sb.controller.write_file(self._sb.id, path, raw, mode=mode,
                                                make_parents=make_parents)
        return int(result["size"])

    def list(self, path: str) -> list[dict[str, Any]]:
        return self._sb.controller.list_files(self._sb.id, path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._sb.controller.remove_file(self._sb.id, path, recursive=recursive)


class Sandbox:
    def __init__(self, info: dict[str, Any], controller: Controller) -> None:
        self.info = info
        self.id: str = info["id"]
        self.controller = controller
        self.commands = Commands(self)
        self.files = Files(self)

    @classmethod
    def create(cls, snapshot_tag: str, *, memory_limit_mib: int | None = None,
               controller: Controller | None = None) -> Sandbox:
        c = controller or Controller()
        info = c.spawn_sandboxes(snapshot_tag, 1, memory_limit_mib=memory_limit_mib)[0]
        return cls(info, c)

    @classmethod
    def connect(cls, sandbox_id: str, *, controller: Controller | None = None) -> Sandbox:
        c = controller or Controller()
        return cls(c.get_sandbox(sandbox_id), c)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, snapshot={self.info.get('snapshot_tag')!r})"

    def eval(self, code: str, *, timeout: float | None = None) -> EvalResult:
        r = self.controller.eval_code(self.id, code, timeout)
        return EvalResult(r["result"], r["error"], r["exit_code"], r.get("stdout", ""),
                          r.get("stderr", ""))

    def ping(self) -> dict[str, Any]:
        return self.controller.ping_sandbox(self.id)

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
