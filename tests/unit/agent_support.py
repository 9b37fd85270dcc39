"""The real agent server on a Unix socket in a thread, with the real client: what the
agent's unit tests drive (only the PID-1 duties are left out)."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vmfork.agent.client import AgentClient, unix_connector
from vmfork.agent.server import AgentServer


class Agent:
    def __init__(self, root: Path, power_calls: list[bool]) -> None:
        self.root = root
        self.sock_path = str(root / "agent.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.sock_path)
        listener.listen(128)
        self.server = AgentServer(listener, power=power_calls.append, log=lambda m: None)
        self.thread = self.server.start()
        self.client = AgentClient(unix_connector(self.sock_path), io_timeout=30)

    def raw(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(self.sock_path)
        return sock


@contextmanager
def running_agent(power_calls: list[bool] | None = None) -> Iterator[Agent]:
    root = Path(tempfile.mkdtemp(prefix="vmfa-", dir="/tmp"))  # short: AF_UNIX path limit
    a = Agent(root, power_calls if power_calls is not None else [])
    try:
        yield a
    finally:
        a.server.stop()
        a.thread.join(timeout=5)
        shutil.rmtree(root, ignore_errors=True)
