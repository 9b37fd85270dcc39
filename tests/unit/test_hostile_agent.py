"""The daemon against a hostile guest agent (issue 16, item 2's daemon half).

The agent here is real in every way that matters to the host: a separate process
serving the agent protocol on a Unix socket (``AgentClient`` + ``unix_connector``,
the same client the daemon uses for a VMM's vsock socket), behind the real HTTP
server and controller of ``test_server_http``. It lies the way a guest running
untrusted code can: endless output, a ``size`` that is a string holding CR/LF,
a directory with a million entries, replies trickled a byte at a time.

RSS is measured with the kernel's own peak (``VmHWM``), reset just before the call
(``/proc/self/clear_refs`` = 5), so a transient spike counts even if freed later.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server_http import TOKEN, FakeAgent, FakeSpawner, Served, _serve

from tests.memory_support import reset_peak, status_kib
from tests.unix_http import UnixHTTPConnection
from vmfork.agent.client import (
    AgentClient,
    AgentProtocolError,
    AgentTimeout,
    FileInfo,
    unix_connector,
)
from vmfork.client import Controller

SRC = str(Path(__file__).resolve().parents[2] / "src")

HOSTILE_AGENT = textwrap.dedent('''
    import json, socket, sys, threading, time
    from vmfork.agent.protocol import encode_frame, recv_frame

    STDOUT_BYTES = int(sys.argv[2])
    CHUNK = b"A" * (1 << 20)   # the protocol's largest payload, not the agent's 64 KiB

    def serve(conn):
        with conn:
            op = recv_frame(conn).header["op"]
            if op == "exec":
                conn.sendall(encode_frame({"type": "started", "pid": 7}))
                frame = encode_frame({"type": "stdout"}, CHUNK)
                for _ in range(STDOUT_BYTES // len(CHUNK)):
                    conn.sendall(frame)
                conn.sendall(encode_frame({"type": "result", "exit_code": 0, "signal": None,
                                           "pid": 7, "duration": 1.0}))
            elif op == "stat":
                conn.sendall(encode_frame({"type": "result", "stat": {
                    "path": "/x", "name": "x", "type": "file", "mode": 420, "mtime": 0.0,
                    "size": "1\\r\\nX-Injected: yes\\r\\n\\r\\nHTTP/1.1 200 OK"}}))
            elif op == "list":
                entry = {"name": "f", "type": "file", "size": 1, "mode": 420, "mtime": 0.0}
                batch = encode_frame({"type": "entries", "entries": [entry] * 512})
                try:
                    for _ in range(2000):  # a million entries
                        conn.sendall(batch)
                    conn.sendall(encode_frame({"type": "result", "count": 1024000}))
                except OSError:
                    pass  # the client stopped reading at its cap and hung up
            elif op == "ping":
                # A frame announced as 1 MiB of header, trickled a byte every 0.2 s.
                conn.sendall(b"\\x00\\x10\\x00\\x00\\x00\\x00\\x00\\x00")
                try:
                    for _ in range(200):
                        time.sleep(0.2)
                        conn.sendall(b" ")
                except OSError:
                    pass

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
''')


class HostileSpawner(FakeSpawner):
    def __init__(self, agent_socket: str) -> None:
        super().__init__()
        self.agent_socket = agent_socket

    def agent(self, run_dir: str) -> Any:
        return AgentClient(unix_connector(self.agent_socket, timeout=10), io_timeout=10)


def _start_agent(path: Path, stdout_bytes: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOSTILE_AGENT, str(path), str(stdout_bytes)],
                            env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[Served]:
    proc = _start_agent(tmp_path / "agent.sock", 1 << 30)
    try:
        yield from _serve(tmp_path, TOKEN, spawner=HostileSpawner(str(tmp_path / "agent.sock")))
    finally:
        proc.kill()
        proc.wait()


def _sandbox(served: Served) -> str:
    ctl = Controller(served.url, token=TOKEN.decode(), timeout=30)
    ctl.create_snapshot("base")
    sandbox_id: str = ctl.spawn_sandboxes("base")[0]["id"]
    return sandbox_id






def test_one_gib_of_stdout_grows_the_daemon_by_less_than_64_mib(hostile: Served) -> None:
    sandbox_id = _sandbox(hostile)
    before = reset_peak()
    t0 = time.monotonic()
    status, body, _ = hostile.request("POST", f"/v1/sandboxes/{sandbox_id}/exec",
                                      {"args": ["yes"], "timeout_secs": 600})
    grew_mib = (status_kib("VmHWM") - before) / 1024
    assert status == 200, body
    assert body["truncated"] is True and body["exit_code"] == 0
    assert len(body["stdout"]) == hostile.controller.limits.exec_output_bytes
    assert grew_mib < 64, f"1 GiB of guest stdout grew the daemon by {grew_mib:.0f} MiB"
    print(f"1 GiB stdout: peak RSS +{grew_mib:.1f} MiB in {time.monotonic() - t0:.1f} s")


def test_streamed_exec_forwards_output_and_keeps_none(tmp_path: Path) -> None:
    proc = _start_agent(tmp_path / "agent.sock", 256 << 20)
    try:
        for served in _serve(tmp_path, TOKEN,
                             spawner=HostileSpawner(str(tmp_path / "agent.sock"))):
            sandbox_id = _sandbox(served)
            before = reset_peak()
            conn = UnixHTTPConnection(str(served.socket), timeout=60)
            conn.request("POST", f"/v1/sandboxes/{sandbox_id}/exec/stream",
                         body=json.dumps({"args": ["yes"], "timeout_secs": 600}),
                         headers={"Authorization": "Bearer " + TOKEN.decode()})
            resp = conn.getresponse()
            received = 0
            last = b""
            while chunk := resp.read(1 << 20):
                received += chunk.count(b"A")
                last = (last + chunk)[-4096:]
            conn.close()
            grew_mib = (status_kib("VmHWM") - before) / 1024
            assert received == 256 << 20
            assert b"event: exit" in last
            assert grew_mib < 64, f"256 MiB streamed grew the daemon by {grew_mib:.0f} MiB"
    finally:
        proc.kill()
        proc.wait()


def test_an_injected_header_from_the_agent_is_a_502_and_sends_no_header(
        hostile: Served) -> None:
    sandbox_id = _sandbox(hostile)
    raw = _raw_get(hostile, f"/v1/sandboxes/{sandbox_id}/files?path=/x")
    assert raw.startswith(b"HTTP/1.1 502 "), raw[:200]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"X-Injected" not in head and b"\r\nHTTP/1.1" not in raw
    assert b"'size'" in body  # the error names the field that was refused


def test_the_http_layer_refuses_control_characters_in_any_header(tmp_path: Path) -> None:
    """Defence in depth: even a value that got past the agent client's checks (here a
    fake agent returns the record unchecked) never reaches the wire."""

    class Lying(FakeAgent):
        def stat(self, path: str) -> FileInfo:
            return FileInfo(name="x", type="file", size="1\r\nX-Injected: yes",  # type: ignore[arg-type]
                            mode=0o644, mtime=0.0, path=path)

    class Spawner(FakeSpawner):
        def agent(self, run_dir: str) -> Any:
            return Lying(self.files)

    for served in _serve(tmp_path, TOKEN, spawner=Spawner()):
        sandbox_id = _sandbox(served)
        raw = _raw_get(served, f"/v1/sandboxes/{sandbox_id}/files?path=/x")
        assert raw.startswith(b"HTTP/1.1 502 "), raw[:200]
        head, _, _ = raw.partition(b"\r\n\r\n")
        assert b"X-Injected" not in head and b"\r\nHTTP/1.1" not in raw


def _raw_get(served: Served, path: str) -> bytes:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(str(served.socket))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 f"Authorization: Bearer {TOKEN.decode()}\r\n\r\n".encode())
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def test_a_listing_stops_at_the_cap_with_truncated(hostile: Served) -> None:
    sandbox_id = _sandbox(hostile)
    status, body, _ = hostile.request("GET", f"/v1/sandboxes/{sandbox_id}/files/list?path=/")
    assert status == 200, body
    assert body["truncated"] is True
    assert len(body["entries"]) == hostile.controller.limits.list_entries


def test_a_trickling_agent_cannot_outlast_the_call_deadline(tmp_path: Path) -> None:
    proc = _start_agent(tmp_path / "agent.sock", 0)
    try:
        client = AgentClient(unix_connector(str(tmp_path / "agent.sock")), io_timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(AgentTimeout):
            client.ping()   # each byte comes well within the 1 s idle timeout
        assert time.monotonic() - t0 < 3.0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("field,value", [
    ("size", -1), ("size", True), ("size", "12"), ("size", 1.5), ("mode", 0o17777),
    ("type", "door"), ("mtime", float("nan")), ("name", 3), ("uid", -5), ("target", [1]),
])
def test_file_records_are_checked_field_by_field(field: str, value: Any) -> None:
    fields = {"name": "f", "type": "file", "size": 1, "mode": 0o644, "mtime": 0.0}
    assert FileInfo.from_fields(fields).size == 1
    with pytest.raises(AgentProtocolError) as err:
        FileInfo.from_fields({**fields, field: value}, "stat")
    assert err.value.op == "stat"

