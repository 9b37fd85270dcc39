"""Background processes, PTYs, rename/mkdir/exists and directory watches through the
daemon: the real HTTP server and controller, the Python SDK as the client, and a real
agent server (on a Unix socket, on this host) behind every sandbox — only the VM is
left out (the KVM tiers run the same agent in guests)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.agent_support import Agent, running_agent
from tests.unit.test_server_http import TOKEN, FakeSpawner, Served, _fake_snapshot, _serve
from tests.unix_http import UnixHTTPConnection
from vmfork.agent.client import AgentClient, unix_connector
from vmfork.client import Controller, ControllerError, Sandbox
from vmfork.server.requests import SnapshotCreate


class AgentBackedSpawner(FakeSpawner):
    """Sandboxes whose agent is a real agent server on this host."""

    def __init__(self, agent: Agent) -> None:
        super().__init__()
        self.agent_server = agent

    def agent(self, run_dir: str) -> Any:
        return AgentClient(unix_connector(self.agent_server.sock_path), io_timeout=30)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with running_agent() as agent:
        yield from _serve(tmp_path, TOKEN, spawner=AgentBackedSpawner(agent))


@pytest.fixture
def sandbox(served: Served) -> Sandbox:
    _fake_snapshot(served.store, SnapshotCreate(tag="base"))
    controller = Controller(served.url, token=TOKEN.decode(), timeout=30)
    return Sandbox.create("base", controller=controller)


def test_start_list_wait_and_kill_through_the_sdk(sandbox: Sandbox) -> None:
    proc = sandbox.commands.start("echo hi; echo oops >&2; exit 4", tag="job")
    result = proc.wait()
    assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "oops\n", 4)
    [info] = [p for p in sandbox.commands.list() if p["pid"] == proc.pid]
    assert info["tag"] == "job" and info["running"] is False
    sleeper = sandbox.commands.start(["sleep", "60"])
    assert sandbox.commands.kill(sleeper.pid, "SIGTERM") is True
    assert sleeper.wait().signal == signal.SIGTERM


def test_stdin_by_pid_and_reconnect(sandbox: Sandbox) -> None:
    proc = sandbox.commands.start(["cat"], stdin=True)
    again = sandbox.commands.connect(proc.pid)
    again.send_stdin("from another handle\n")
    proc.close_stdin()
    assert proc.wait().stdout == "from another handle\n"


def test_output_streams_while_the_process_runs(sandbox: Sandbox) -> None:
    proc = sandbox.commands.start("echo first; sleep 1; echo second")
    arrivals: list[tuple[float, str]] = []
    result = proc.wait(on_stdout=lambda text: arrivals.append((time.monotonic(), text)))
    assert result.stdout == "first\nsecond\n"
    assert arrivals[0][1] == "first\n" and time.monotonic() - arrivals[0][0] > 0.7


def test_a_silent_process_is_followed_across_heartbeats(
        sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    from vmfork.server import api
    monkeypatch.setattr(api, "WATCH_HEARTBEAT_SECS", 0.3)
    proc = sandbox.commands.start("sleep 1.2; echo late")
    assert proc.wait().stdout == "late\n"


def test_a_pty_session(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(30, 100, cmd=["sh", "-c", "stty size; read x; echo got:$x"])
    sandbox.pty.send_input(term.pid, "hello\n")
    result = term.wait()
    assert "30 100" in result.stdout and "got:hello" in result.stdout


def test_bad_process_calls_are_clear_4xx(served: Served, sandbox: Sandbox) -> None:
    base = f"/v1/sandboxes/{sandbox.id}/processes"
    cases: list[tuple[str, str, Any, int, str]] = [
        ("POST", base, {}, 400, "exactly one of args"),
        ("POST", base, {"cmd": "x", "args": ["x"]}, 400, "exactly one of args"),
        ("POST", base, {"cmd": "x", "pty": {"rows": 0, "cols": 80}}, 400, "rows"),
        ("POST", base, {"cmd": "x", "pty": {"rows": 24, "cols": 80, "x": 1}}, 400, "exactly"),
        ("POST", base, {"cmd": "x", "bogus": 1}, 400, "unknown field 'bogus'"),
        ("GET", f"{base}/999999/output", None, 404, "no background process 999999"),
        ("POST", f"{base}/abc/signal", {}, 400, "invalid process id"),
        ("POST", f"{base}/999999/signal", {}, 404, "no background process"),
        ("POST", f"{base}/999999/resize", {"rows": 5000, "cols": 80}, 400, "'rows'"),
    ]
    for method, path, body, status, text in cases:
        got, reply, _ = served.request(method, path, body)
        assert got == status and text in reply["error"], (path, body, reply)
    pid = sandbox.commands.start(["sleep", "30"]).pid
    got, reply, _ = served.request("POST", f"{base}/{pid}/signal", {"signal": "SIGSEGV"})
    assert got == 422 and "not one of" in reply["error"]
    # Refused from the header alone, before a byte of the body is read.
    got, reply, _ = served.request("POST", f"{base}/{pid}/stdin",
                                   headers={"Content-Length": str((1 << 20) + 1)})
    assert got == 413 and "the limit is" in reply["error"]
    sandbox.commands.kill(pid)


def test_rename_make_dir_and_exists(sandbox: Sandbox, tmp_path: Path) -> None:
    work = tmp_path / "work"
    assert sandbox.files.make_dir(str(work / "a" / "b")) is True
    assert sandbox.files.make_dir(str(work / "a" / "b")) is False
    sandbox.files.write(str(work / "f"), b"data")
    assert sandbox.files.exists(str(work / "f")) and not sandbox.files.exists(str(work / "g"))
    moved = sandbox.files.rename(str(work / "f"), str(work / "g"))
    assert moved["type"] == "file" and sandbox.files.read(str(work / "g")) == b"data"
    sandbox.files.write(str(work / "h"), b"other")
    with pytest.raises(ControllerError) as err:
        sandbox.files.rename(str(work / "g"), str(work / "h"))
    assert err.value.status == 422 and "already exists" in err.value.message


def test_watch_dir_streams_changes(sandbox: Sandbox, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    with sandbox.files.watch_dir(str(tmp_path)) as watcher:
        def change() -> None:
            (tmp_path / "new.txt").write_text("x")
        threading.Timer(0.2, change).start()
        for batch in watcher:
            seen += batch
            if any(e["name"] == "new.txt" and e["type"] == "create" for e in seen):
                break
    assert {"name": "new.txt", "type": "create", "is_dir": False} in seen


def test_a_stream_whose_client_left_ends_at_its_next_write(
        served: Served, sandbox: Sandbox, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The front turns a write to a client that went away into an error (the server
    itself would drop it silently), so an idle watch ends at its next heartbeat instead
    of holding a thread and an agent watch for ever; its audit line, written when the
    stream ends, shows that it did."""
    from vmfork.server import api
    monkeypatch.setattr(api, "WATCH_HEARTBEAT_SECS", 0.3)
    conn = UnixHTTPConnection(str(served.socket), timeout=10)
    conn.request("GET", f"/v1/sandboxes/{sandbox.id}/files/watch?path={tmp_path}",
                 headers={"Authorization": "Bearer " + TOKEN.decode()})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read1(4096).startswith(b"event: watching")
    conn.close()   # gone, without a word
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = served.audit_path.read_text().splitlines() if served.audit_path.exists() else []
        if any("/files/watch" in line for line in lines):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the watch stream went on after its client left")
