"""Host-side connectors (the Firecracker-style vsock handshake), readiness waiting, and
the agent's ``main --unix`` development mode."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vmfork.agent.client import AgentClient, AgentUnavailable, vsock_uds_connector
from vmfork.agent.protocol import AGENT_PORT, encode_frame, recv_frame
from vmfork.agent.server import AgentServer

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def tmp() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="vmfc-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def fake_vmm(path: str, handle: Callable[[socket.socket, bytes], None]) -> socket.socket:
    """A Unix socket that reads the CONNECT line of each connection and calls
    ``handle(conn, line)``, like a VMM's vsock device."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            line = b""
            while not line.endswith(b"\n"):
                line += conn.recv(1)
            handle(conn, line)

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_handshake_does_not_swallow_protocol_bytes(tmp: Path) -> None:
    seen: list[bytes] = []

    def handle(conn: socket.socket, line: bytes) -> None:
        seen.append(line)
        # The OK line and the agent's first frame in one segment.
        conn.sendall(b"OK 1073741824\n" + encode_frame({"type": "result", "pong": True}))
        conn.close()

    vmm = fake_vmm(str(tmp / "v.sock"), handle)
    try:
        sock = vsock_uds_connector(str(tmp / "v.sock"), AGENT_PORT, timeout=5)()
        with sock:
            assert recv_frame(sock).header == {"type": "result", "pong": True}
        assert seen == [f"CONNECT {AGENT_PORT}\n".encode()]
    finally:
        vmm.close()


def test_handshake_line_in_pieces_then_protocol_bytes(tmp: Path) -> None:
    def handle(conn: socket.socket, line: bytes) -> None:
        conn.sendall(b"OK 10")
        time.sleep(0.05)   # the client has peeked at the first piece by now
        conn.sendall(b"73741824\n" + encode_frame({"type": "result", "pong": True}))
        conn.close()

    vmm = fake_vmm(str(tmp / "v.sock"), handle)
    try:
        sock = vsock_uds_connector(str(tmp / "v.sock"), AGENT_PORT, timeout=5)()
        with sock:
            assert recv_frame(sock).header == {"type": "result", "pong": True}
    finally:
        vmm.close()


def test_handshake_failures_are_agent_unavailable(tmp: Path) -> None:
    with pytest.raises(AgentUnavailable) as err:
        vsock_uds_connector(str(tmp / "missing.sock"), AGENT_PORT, timeout=1)()
    assert "missing.sock" in str(err.value)

    vmm = fake_vmm(str(tmp / "refuse.sock"), lambda conn, line: conn.close())
    try:
        with pytest.raises(AgentUnavailable) as err:
            vsock_uds_connector(str(tmp / "refuse.sock"), AGENT_PORT, timeout=1)()
        assert "closed the connection" in str(err.value)
    finally:
        vmm.close()

    def garbage(conn: socket.socket, line: bytes) -> None:
        conn.sendall(b"ERR no\n")
        conn.close()

    vmm = fake_vmm(str(tmp / "garbage.sock"), garbage)
    try:
        with pytest.raises(AgentUnavailable) as err:
            vsock_uds_connector(str(tmp / "garbage.sock"), AGENT_PORT, timeout=1)()
        assert "ERR no" in str(err.value)
    finally:
        vmm.close()


def test_wait_until_ready_through_a_proxy_that_comes_up_late(tmp: Path) -> None:
    """The host's boot wait: the VMM refuses until the agent listens, then forwards."""
    agent_path = str(tmp / "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(agent_path)
    listener.listen()
    server = AgentServer(listener, log=lambda m: None)
    up_at = time.monotonic() + 0.5

    def forward(conn: socket.socket, line: bytes) -> None:
        if time.monotonic() < up_at:
            conn.close()  # like Firecracker while nothing listens on the guest port
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(agent_path)
        conn.sendall(b"OK 1073741825\n")

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        threading.Thread(target=pipe, args=(conn, upstream), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()

    vmm = fake_vmm(str(tmp / "v.sock"), forward)
    server.start()
    try:
        client = AgentClient(vsock_uds_connector(str(tmp / "v.sock"), AGENT_PORT, timeout=2))
        t0 = time.monotonic()
        pong = client.wait_until_ready(timeout=10)
        assert pong.pid == os.getpid() and time.monotonic() - t0 >= 0.4
        assert client.exec(["echo", "via vsock"]).stdout == b"via vsock\n"
        with pytest.raises(AgentUnavailable):
            AgentClient(vsock_uds_connector(str(tmp / "none.sock"), AGENT_PORT,
                                            timeout=0.2)).wait_until_ready(timeout=0.3)
    finally:
        vmm.close()
        server.stop()


def test_main_serves_a_unix_socket_outside_a_vm(tmp: Path) -> None:
    path = str(tmp / "dev.sock")
    proc = subprocess.Popen([sys.executable, "-c",
                             "from vmfork.agent.main import main; main()", "--unix", path],
                            env=dict(os.environ, PYTHONPATH=SRC), stderr=subprocess.PIPE,
                            text=True)
    try:
        from vmfork.agent.client import unix_connector

        client = AgentClient(unix_connector(path, timeout=1))
        pong = client.wait_until_ready(timeout=20)
        assert pong.pid == proc.pid
        assert client.eval("import sys; sys.modules['__main__'].__name__").value == "'__main__'"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    lines = err.splitlines()
    assert lines[0].startswith("vmfork-agent: init ")
    assert any(line.startswith("vmfork-agent: ready ") for line in lines)
