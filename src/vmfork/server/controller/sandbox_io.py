"""What runs in a sandbox, through its agent: exec (buffered or streamed), eval,
files, and the environment its commands get."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vmfork.agent.client import AgentError, ExecResult, FileInfo
from vmfork.server.controller.core import Part, agent_errors
from vmfork.server.requests import Eval, Exec, RemoveFile

log = logging.getLogger(__name__)


def exec_result_json(result: ExecResult) -> dict[str, Any]:
    return {"stdout": result.stdout.decode("utf-8", "replace"),
            "stderr": result.stderr.decode("utf-8", "replace"),
            "exit_code": result.exit_code, "signal": result.signal,
            "duration_secs": round(result.duration, 6), "truncated": result.truncated}


def file_info_json(info: FileInfo) -> dict[str, Any]:
    return {"name": info.name, "path": info.path, "type": info.type, "size": info.size,
            "mode": info.mode, "mtime": info.mtime, "target": info.target}


STREAMED_KEPT_BYTES = 64 << 10


class SandboxIO(Part):
    """Calls into a running sandbox's agent, their errors mapped by
    ``agent_errors``."""

    def command_env(self, sandbox_id: str, env: dict[str, Any] | None
                    ) -> dict[str, Any] | None:
        """The environment of one command: the sandbox's ``envs`` (given at spawn), then
        the command's own (which wins; a null value unsets)."""
        record = self.registry.get_sandbox(sandbox_id)
        if record is None or not record.envs:
            return env
        return {**record.envs, **(env or {})}


    def ping(self, sandbox_id: str) -> dict[str, Any]:
        with agent_errors(sandbox_id, "ping"):
            result = self.core.agent(sandbox_id).ping()
        return {"pong": True, "pid": result.pid, "version": result.version,
                "protocol": result.protocol, "uptime": result.uptime, "boot_id": result.boot_id}

    def exec(self, sandbox_id: str, request: Exec,
             on_stdout: Callable[[bytes], None] | None = None,
             on_stderr: Callable[[bytes], None] | None = None) -> dict[str, Any]:
        agent = self.core.agent(sandbox_id)
        timeout = float(request.timeout_secs)
        try:
            with agent_errors(sandbox_id, "exec"):
                streamed = on_stdout is not None or on_stderr is not None
                # A streamed exec's output went to the client as it came; a bounded
                # head is still kept, for the error of one that times out.
                result = agent.exec(request.args, env=self.command_env(sandbox_id,
                                                                      request.env),
                                    cwd=request.cwd,
                                    stdin=request.stdin, timeout=timeout,
                                    on_stdout=on_stdout, on_stderr=on_stderr,
                                    max_output=(STREAMED_KEPT_BYTES if streamed
                                                else self.limits.exec_output_bytes))
        except AgentError as err:
            if err.code == "not_found":
                # As a shell would: the program is missing, exit status 127.
                return {"stdout": "", "stderr": err.message + "\n", "exit_code": 127,
                        "signal": None, "duration_secs": 0.0}
            raise
        return exec_result_json(result)

    def eval(self, sandbox_id: str, request: Eval) -> dict[str, Any]:
        agent = self.core.agent(sandbox_id)
        with agent_errors(sandbox_id, "eval"):
            result = agent.eval(request.code, timeout=request.timeout_secs)
        exc = result.exception
        return {"result": result.value,
                "error": None if exc is None else f"{exc.type}: {exc.message}",
                "exit_code": 0 if exc is None else 1,
                "stdout": result.stdout, "stderr": result.stderr,
                "traceback": None if exc is None else exc.traceback,
                "value_truncated": result.value_truncated}

    def stat_file(self, sandbox_id: str, path: str) -> dict[str, Any]:
        with agent_errors(sandbox_id, "stat"):
            return file_info_json(self.core.agent(sandbox_id).stat(path))

    def list_files(self, sandbox_id: str, path: str) -> dict[str, Any]:
        with agent_errors(sandbox_id, "list"):
            listing = self.core.agent(sandbox_id).list_dir_bounded(path, self.limits.list_entries)
        return {"path": path, "entries": [file_info_json(e) for e in listing.entries],
                "truncated": listing.truncated}

    def remove_file(self, sandbox_id: str, query: RemoveFile) -> None:
        with agent_errors(sandbox_id, "remove"):
            self.core.agent(sandbox_id).remove(query.path, recursive=query.recursive,
                                               missing_ok=query.missing_ok)


