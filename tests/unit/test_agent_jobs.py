"""Background processes, stdin by pid, signals, PTYs, ``ps``, ``rename`` and ``watch``:
the real agent server on a Unix socket, driven by the real client."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.agent_support import Agent, running_agent
from vmfork.agent import jobs
from vmfork.agent.client import AgentClient, AgentError, ProcessEnd, ProcessOutput
from vmfork.agent.protocol import recv_frame, send_frame


@pytest.fixture
def agent() -> Iterator[Agent]:
    with running_agent() as a:
        yield a


@pytest.fixture
def client(agent: Agent) -> AgentClient:
    return agent.client


def _wait_until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# -- start / attach ------------------------------------------------------------------


def test_a_background_process_outlives_its_start_call(client: AgentClient) -> None:
    pid = client.start("echo out; echo err >&2; sleep 0.3; exit 3", tag="t1")
    stdout, stderr, end = client.wait_process(pid, timeout=10)
    assert (stdout, stderr) == (b"out\n", b"err\n")
    assert (end.exit_code, end.signal, end.timed_out, end.skipped) == (3, None, False, 0)
    assert end.offset == len(b"out\n") + len(b"err\n")
    [info] = [p for p in client.processes() if p.pid == pid]
    assert (info.tag, info.running, info.exit_code, info.pty) == ("t1", False, 3, False)


def test_reattaching_from_an_offset_misses_nothing(client: AgentClient) -> None:
    pid = client.start("for i in 1 2 3 4 5; do echo line$i; sleep 0.1; done")
    first = client.attach(pid)
    got = next(item for item in first if isinstance(item, ProcessOutput))
    first.close()  # detach: the process goes on
    resume = got.offset + len(got.data)
    rest, _, end = b"", b"", None
    for item in client.attach(pid, offset=resume):
        if isinstance(item, ProcessEnd):
            end = item
        else:
            assert item.offset >= resume
            rest += item.data
    assert end is not None and end.exit_code == 0
    assert got.data + rest == b"".join(f"line{i}\n".encode() for i in range(1, 6))


def test_output_beyond_the_kept_window_is_reported_as_skipped(client: AgentClient) -> None:
    size = jobs.KEPT_OUTPUT * 3
    pid = client.start(f"head -c {size} /dev/zero")
    _wait_until(lambda: not next(p for p in client.processes() if p.pid == pid).running)
    stdout, _, end = client.wait_process(pid, timeout=10)
    assert end.offset == size
    assert end.skipped == size - len(stdout) > 0
    assert len(stdout) <= jobs.KEPT_OUTPUT + (64 << 10)


def test_a_silent_process_can_be_killed_by_pid(client: AgentClient) -> None:
    pid = client.start(["sleep", "60"])
    assert client.signal(pid, "TERM") is True
    _, _, end = client.wait_process(pid, timeout=10)
    assert (end.exit_code, end.signal) == (-signal.SIGTERM, signal.SIGTERM)
    assert client.signal(pid, "SIGKILL") is False  # already gone: not delivered


def test_the_timeout_kills_the_group(client: AgentClient) -> None:
    pid = client.start("sleep 30 & sleep 30; echo never", timeout=0.5)
    _, _, end = client.wait_process(pid, timeout=10)
    assert end.timed_out and end.signal == signal.SIGKILL


def test_a_detached_attach_does_not_hold_the_process(client: AgentClient,
                                                     agent: Agent) -> None:
    pid = client.start(["sleep", "1"])
    sock = agent.raw()
    send_frame(sock, {"op": "attach", "pid": pid})
    assert recv_frame(sock).header["type"] == "attached"
    sock.close()  # the host goes away while the process is silent
    _, _, end = client.wait_process(pid, timeout=10)
    assert end.exit_code == 0


# -- stdin ---------------------------------------------------------------------------


def test_stdin_is_streamed_by_pid_and_closed(client: AgentClient) -> None:
    pid = client.start(["cat"], stdin=True)
    assert client.send_stdin(pid, b"hello ") == 6
    assert client.send_stdin(pid, "world\n", eof=True) == 6
    stdout, _, end = client.wait_process(pid, timeout=10)
    assert (stdout, end.exit_code) == (b"hello world\n", 0)
    with pytest.raises(AgentError) as err:
        client.send_stdin(pid, b"late")
    assert err.value.code == "bad_request" and "exited" in err.value.message


def test_stdin_refused_for_a_process_started_without_it(client: AgentClient) -> None:
    pid = client.start(["sleep", "5"])
    with pytest.raises(AgentError) as err:
        client.send_stdin(pid, b"x")
    assert "without 'stdin'" in err.value.message
    client.signal(pid)


def test_a_process_that_never_reads_stdin_gives_busy_not_a_hang(
        client: AgentClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs, "STDIN_WRITE_TIMEOUT", 0.5)
    pid = client.start(["sleep", "30"], stdin=True)
    with pytest.raises(AgentError) as err:
        client.send_stdin(pid, b"x" * (1 << 20))  # more than a pipe holds
    assert err.value.code == "busy"
    assert 0 < err.value.details["written"] < 1 << 20
    client.signal(pid)


# -- PTY -----------------------------------------------------------------------------


def test_a_pty_process_has_a_terminal_of_the_asked_size(client: AgentClient) -> None:
    pid = client.start("stty size; tty -s && echo is-a-tty", pty=(33, 101))
    stdout, _, end = client.wait_process(pid, timeout=10)
    assert end.exit_code == 0
    assert b"33 101" in stdout and b"is-a-tty" in stdout


def test_pty_input_resize_and_interrupt(client: AgentClient) -> None:
    script = ("trap 'stty size; exit 7' WINCH; "
              "read line; echo got:$line; while :; do sleep 0.05; done")
    pid = client.start(["sh", "-c", script], pty=(24, 80))
    client.send_stdin(pid, b"abc\n")
    seen = b""
    attach = client.attach(pid, idle_timeout=10)
    for item in attach:
        assert isinstance(item, ProcessOutput) and item.stream == "pty"
        seen += item.data
        if b"got:abc" in seen:
            break
    attach.close()
    client.resize_pty(pid, 50, 132)
    stdout, _, end = client.wait_process(pid, timeout=10)
    assert end.exit_code == 7 and b"50 132" in stdout


@pytest.mark.parametrize("rows, cols", [(0, 80), (24, 0), (10_000, 80), (24, 1 << 20)])
def test_absurd_pty_sizes_are_refused(client: AgentClient, rows: int, cols: int) -> None:
    with pytest.raises(AgentError) as err:
        client.start(["true"], pty=(rows, cols))
    assert err.value.code == "bad_request"
    pid = client.start(["sleep", "5"], pty=(24, 80))
    with pytest.raises(AgentError) as err:
        client.resize_pty(pid, rows, cols)
    assert err.value.code == "bad_request"
    client.signal(pid)


# -- bad input and bounds --------------------------------------------------------------


def test_unknown_pid_and_bad_signal(client: AgentClient) -> None:
    for call in (lambda: client.signal(os.getpid()), lambda: client.send_stdin(1, b"x"),
                 lambda: client.resize_pty(1, 24, 80)):
        with pytest.raises(AgentError) as err:
            call()
        # The message says which side gave up when it is not "not_found" (one CI run
        # read "timeout" here once: 30 s without a reply, on a machine loaded by two
        # emulated test hosts, cargo and the fuzzers).
        assert err.value.code == "not_found", f"{err.value.code}: {err.value}"
    pid = client.start(["sleep", "5"])
    for bad in ("SIGSEGV", "nope", 11, 0, 99):
        with pytest.raises(AgentError) as err:
            client.signal(pid, bad)
        assert err.value.code == "bad_request"
    client.signal(pid)


def test_the_table_is_bounded_and_forgets_finished_jobs_first(agent: Agent) -> None:
    agent.server.jobs.max_jobs = 4
    client = agent.client
    done = client.start(["true"])
    client.wait_process(done, timeout=10)
    running = [client.start(["sleep", "30"]) for _ in range(3)]
    fourth = client.start(["sleep", "30"])  # the finished one is forgotten
    assert {p.pid for p in client.processes()} == {*running, fourth}
    with pytest.raises(AgentError) as err:
        client.start(["sleep", "30"])
    assert err.value.code == "busy"
    for pid in (*running, fourth):
        client.signal(pid)


def test_a_long_tag_is_refused(client: AgentClient) -> None:
    with pytest.raises(AgentError) as err:
        client.start(["true"], tag="x" * (jobs.MAX_TAG + 1))
    assert err.value.code == "bad_request"


# -- rename and watch ----------------------------------------------------------------


def test_rename_refuses_to_replace_unless_asked(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "a").write_text("A")
    (tmp_path / "b").write_text("B")
    with pytest.raises(AgentError) as err:
        client.rename(str(tmp_path / "a"), str(tmp_path / "b"))
    assert err.value.code == "exists"
    assert (tmp_path / "b").read_text() == "B"
    client.rename(str(tmp_path / "a"), str(tmp_path / "b"), overwrite=True)
    assert (tmp_path / "b").read_text() == "A" and not (tmp_path / "a").exists()
    client.rename(str(tmp_path / "b"), str(tmp_path / "c"))
    assert (tmp_path / "c").read_text() == "A"
    with pytest.raises(AgentError) as err:
        client.rename(str(tmp_path / "missing"), str(tmp_path / "d"))
    assert err.value.code == "not_found"


def _collect(watch, want: int, timeout: float = 10.0) -> list:  # type: ignore[no-untyped-def]
    events: list = []  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while len(events) < want and time.monotonic() < deadline:
        events += watch.events(timeout=0.5)
    return events


def test_watch_reports_changes_recursively(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    with client.watch(str(tmp_path), recursive=True) as watch:
        assert watch.directories == 2
        (tmp_path / "f").write_text("x")
        (tmp_path / "new").mkdir()
        time.sleep(0.2)  # the agent adds a watch for the new directory
        (tmp_path / "new" / "deep").write_text("y")
        (tmp_path / "old" / "g").write_text("z")
        os.chmod(tmp_path / "f", 0o600)
        os.rename(tmp_path / "f", tmp_path / "f2")
        (tmp_path / "f2").unlink()
        events = _collect(watch, 9)
    seen = {(e.name, e.type) for e in events}
    assert {("f", "create"), ("f", "write"), ("new", "create"), ("new/deep", "create"),
            ("old/g", "create"), ("f", "chmod"), ("f", "rename_from"),
            ("f2", "rename_to"), ("f2", "remove")} <= seen
    assert next(e for e in events if e.name == "new").is_dir


def test_watch_ends_when_its_directory_goes(client: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "w"
    target.mkdir()
    with client.watch(str(target)) as watch:
        target.rmdir()
        deadline = time.monotonic() + 10
        while not watch.ended and time.monotonic() < deadline:
            watch.events(timeout=0.5)
        assert watch.ended


def test_watch_bad_paths(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for path, code in ((tmp_path / "missing", "not_found"),
                       (tmp_path / "file", "not_a_directory")):
        with pytest.raises(AgentError) as err:
            client.watch(str(path))
        assert err.value.code == code


def test_a_host_that_hangs_up_ends_the_watch(agent: Agent, tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    sock = agent.raw()
    send_frame(sock, {"op": "watch", "path": str(tmp_path)})
    assert recv_frame(sock).header["type"] == "watching"
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    # The inotify fd and the connection are released.
    _wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before)
