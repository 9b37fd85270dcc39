"""Shared by the MCP tests: a real ``vmfork serve`` in a subprocess, and an MCP
client session (the MCP SDK's own stdio client) with ``vmfork mcp`` as its
server process, talking to that daemon."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

from vmfork.client import Controller, ControllerError

SRC = str(Path(__file__).resolve().parents[1] / "src")


@dataclass
class RunningDaemon:
    url: str
    controller: Controller
    root: Path


@contextmanager
def running_daemon(root: Path, *, token: str | None = None,
                   env: dict[str, str] | None = None,
                   bind: str | None = None) -> Iterator[RunningDaemon]:
    """``env``: more of the daemon's environment (e.g. an image cache of its own);
    ``bind``: also listen on this TCP address (forkd's clients speak HTTP over TCP)."""
    env = dict(os.environ, VMFORK_HOME=str(root / "home"),
               PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p),
               **(env or {}))
    api_socket = root / "api.sock"
    cmd = [sys.executable, "-m", "vmfork.cli.serve", "--state", str(root / "state"),
           "--socket", str(api_socket)]
    if bind is not None:
        cmd += ["--bind", bind]
    if token is not None:
        (root / "token").write_text(token)
        cmd += ["--token-file", str(root / "token")]
    url = f"unix://{api_socket}"
    ctl = Controller(url, token=token, timeout=900)
    with open(root / "serve.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if not _answers(ctl, proc):
                # Its first start in a fresh emulated host reads every module over 9p, and
                # a loaded machine can push the zygote past its 30 s start-up limit; the
                # second start finds them cached. One retry, said out loud.
                first = (root / "serve.log").read_text().strip()
                print(f"vmfork serve did not start ({first.splitlines()[-1:]}); retrying once",
                      file=sys.stderr)
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                if not _answers(ctl, proc):
                    raise AssertionError("vmfork serve did not start twice:\n"
                                         + (root / "serve.log").read_text())
            yield RunningDaemon(url, ctl, root)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def free_port() -> int:
    """A TCP port on loopback nobody listens on (as of now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def tcp_daemon(root: Path, *, token: str | None = None,
               snapshot: str | None = None) -> Iterator[tuple[RunningDaemon, int]]:
    """A daemon that also listens on a loopback TCP port (E2B's and forkd's clients
    speak HTTP over TCP), with ``snapshot`` (a tag, 256 MiB) made before it is
    handed out, and every sandbox left killed at the end."""
    port = free_port()
    with running_daemon(root, token=token, bind=f"127.0.0.1:{port}") as d:
        if snapshot is not None:
            d.controller.create_snapshot(snapshot, mem_mib=256)
        yield d, port
        for sandbox in d.controller.list_sandboxes():
            d.controller.kill_sandbox(sandbox["id"])


def _answers(ctl: Controller, proc: subprocess.Popen[bytes]) -> bool:
    """Whether the daemon answers within 2 minutes (False as soon as it exits)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            ctl.healthz()
            return True
        except ControllerError:
            if proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                return False
            time.sleep(0.1)


class ToolFailed(Exception):
    """The tool answered with ``isError``; the message is its text."""


class McpSession:
    def __init__(self, client: Client) -> None:
        self.client = client

    async def call(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        """The tool's structured result (a list tool's list unwrapped); raises
        ``ToolFailed`` with the error text when the tool reports an error."""
        result = await self.client.call_tool(name, arguments or {})
        text = "".join(getattr(c, "text", "") for c in result.content)
        if result.is_error:
            raise ToolFailed(text)
        data = result.structured_content
        if data is None:
            return json.loads(text)
        if set(data) == {"result"}:
            return data["result"]
        return data


@asynccontextmanager
async def mcp_session(url: str, *, token: str | None = None) -> AsyncIterator[McpSession]:
    """``vmfork mcp`` as a stdio subprocess, the daemon at ``url``."""
    env = dict(os.environ, VMFORK_URL=url,
               PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    env.pop("VMFORK_TOKEN", None)
    env.pop("FORKD_TOKEN", None)
    if token is not None:
        env["VMFORK_TOKEN"] = token
    params = StdioServerParameters(command=sys.executable, args=["-m", "vmfork", "mcp"], env=env)
    async with Client(params, read_timeout_seconds=900) as client:
        yield McpSession(client)


FORKD_MCP_VERSION = "0.2.1"   # scripts/lib.sh setup_forkd_mcp installs it


def forkd_mcp_command() -> Path:
    """forkd's own MCP server from the registry, in the venv the set-up made for it."""
    cache = Path(os.environ.get("VMFORK_CACHE_DIR") or Path.home() / ".cache/vmfork")
    command = cache / f"forkd-mcp-{FORKD_MCP_VERSION}" / "bin" / "forkd-mcp"
    if not command.is_file():
        raise AssertionError(f"forkd-mcp {FORKD_MCP_VERSION} is not installed at {command}: "
                             "run the set-up (scripts/test, scripts/lib.sh setup_forkd_mcp)")
    return command


@asynccontextmanager
async def forkd_mcp_session(http_url: str) -> AsyncIterator[McpSession]:
    """forkd-mcp as a stdio subprocess, pointed at the daemon's TCP address with
    ``FORKD_URL`` as forkd's users point it at forkd; its HTTP timeout (60 s by
    default) raised for boots in the emulated test host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "VMFORK_"))}
    env.update(FORKD_URL=http_url, FORKD_HTTP_TIMEOUT="1500")
    params = StdioServerParameters(command=str(forkd_mcp_command()), args=[], env=env)
    async with Client(params, read_timeout_seconds=1800) as client:
        yield McpSession(client)
