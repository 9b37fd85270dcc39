"""Every agent op end to end: the real ``AgentServer`` on a Unix socket in a thread,
driven by the real ``AgentClient`` (only the PID-1 duties are left out)."""

from __future__ import annotations

import io
import os
import random
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.unit.agent_support import Agent, running_agent
from vmfork.agent import server as agent_server
from vmfork.agent.client import (
    AgentClient,
    AgentError,
    AgentTimeout,
    unix_connector,
)
from vmfork.agent.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ConnectionClosed,
    encode_frame,
    recv_frame,
    send_frame,
)
from vmfork.agent.server import AgentServer


@pytest.fixture
def power_calls() -> list[bool]:
    return []


@pytest.fixture
def agent(power_calls: list[bool]) -> Iterator[Agent]:
    with running_agent(power_calls) as a:
        yield a


@pytest.fixture
def client(agent: Agent) -> AgentClient:
    return agent.client


# -- ping ----------------------------------------------------------------------------


def test_ping(client: AgentClient) -> None:
    pong = client.ping()
    assert pong.pid == os.getpid()
    assert pong.protocol == PROTOCOL_VERSION
    assert pong.version
    assert pong.uptime > 0


# -- connection threads ----------------------------------------------------------------


def _wait_for_idle_workers(agent: Agent, count: int) -> None:
    """Until ``count`` workers wait for a connection (a worker counts itself idle only
    after its connection's drain, once the client has hung up)."""
    deadline = time.monotonic() + 10
    while agent.server._idle < count:
        assert time.monotonic() < deadline, f"idle workers: {agent.server._idle}, not {count}"
        time.sleep(0.01)


def _connection_threads() -> set[int | None]:
    return {t.native_id for t in threading.enumerate() if t.name == "agent-conn"}


def test_connections_after_the_first_are_served_by_the_idle_worker(
        agent: Agent, client: AgentClient) -> None:
    client.ping()
    _wait_for_idle_workers(agent, 1)
    workers = _connection_threads()
    assert len(workers) == 1
    for _ in range(3):
        client.ping()
        _wait_for_idle_workers(agent, 1)
        assert _connection_threads() == workers


def test_a_thread_that_ran_eval_code_ends_and_a_fresh_worker_takes_its_place(
        agent: Agent, client: AgentClient) -> None:
    client.ping()
    _wait_for_idle_workers(agent, 1)
    result = client.eval("import threading\nthreading.get_native_id()")
    assert result.value is not None
    eval_thread = int(result.value)
    _wait_for_idle_workers(agent, 1)
    deadline = time.monotonic() + 10
    while eval_thread in _connection_threads():
        assert time.monotonic() < deadline, "the thread that ran the eval is still alive"
        time.sleep(0.01)
    client.ping()  # served by the fresh worker
    _wait_for_idle_workers(agent, 1)
    assert len(_connection_threads()) == 1


def test_concurrent_connections_leave_at_most_the_idle_limit_of_workers(
        agent: Agent, client: AgentClient) -> None:
    from vmfork.agent.server import MAX_IDLE_WORKERS
    with ThreadPoolExecutor(max_workers=MAX_IDLE_WORKERS * 2) as pool:
        list(pool.map(lambda _: client.exec(["sleep", "0.3"]), range(MAX_IDLE_WORKERS * 2)))
    _wait_for_idle_workers(agent, MAX_IDLE_WORKERS)
    deadline = time.monotonic() + 10
    while len(_connection_threads()) > MAX_IDLE_WORKERS:
        assert time.monotonic() < deadline, f"{len(_connection_threads())} workers left"
        time.sleep(0.01)
    client.ping()
    assert agent.server._idle <= MAX_IDLE_WORKERS


# -- exec ----------------------------------------------------------------------------


def test_exec_argv_captures_stdout_and_stderr_separately(client: AgentClient) -> None:
    r = client.exec(["sh", "-c", "echo out; echo err >&2"])
    assert (r.stdout, r.stderr, r.exit_code, r.signal) == (b"out\n", b"err\n", 0, None)
    assert r.ok and r.pid > 0


def test_exec_streams_output_while_the_process_runs(client: AgentClient) -> None:
    arrivals: list[tuple[float, bytes]] = []
    r = client.exec("echo first; sleep 1; echo second",
                    on_stdout=lambda chunk: arrivals.append((time.monotonic(), chunk)))
    finished = time.monotonic()
    assert r.stdout == b"first\nsecond\n"
    assert arrivals[0][1] == b"first\n"
    # The first line reached us about a second before the process ended.
    assert finished - arrivals[0][0] > 0.7


def test_exec_stdin_bytes_iterable_and_file(client: AgentClient) -> None:
    blob = random.randbytes(3 << 20)
    assert client.exec(["cat"], stdin=blob).stdout == blob
    assert client.exec(["cat"], stdin=iter([b"a", b"b", b"c"])).stdout == b"abc"
    assert client.exec(["wc", "-c"], stdin=io.BytesIO(blob)).stdout.strip() == b"3145728"
    assert client.exec(["cat"], stdin=b"").stdout == b""


def test_exec_without_stdin_reads_dev_null(client: AgentClient) -> None:
    r = client.exec(["cat"], timeout=10)
    assert r.stdout == b"" and r.exit_code == 0


def test_exec_process_that_ignores_large_stdin_finishes(client: AgentClient) -> None:
    r = client.exec(["true"], stdin=b"x" * (8 << 20), timeout=20)
    assert r.exit_code == 0


def test_exec_env_and_cwd(client: AgentClient, agent: Agent) -> None:
    r = client.exec('echo "$GREETING|$HOME|$LANG|${TERM-unset}"; pwd',
                    env={"GREETING": "hi there", "TERM": None}, cwd=str(agent.root))
    assert r.stdout == f"hi there|/root|C.UTF-8|unset\n{agent.root}\n".encode()


def test_exec_default_path_finds_programs(client: AgentClient) -> None:
    assert client.exec(["ls", "/"]).exit_code == 0


def test_exec_nonzero_exit_and_signal(client: AgentClient) -> None:
    assert client.exec("exit 3").exit_code == 3
    r = client.exec("kill -TERM $$")
    assert (r.exit_code, r.signal) == (-15, 15)


def test_exec_large_output_is_complete(client: AgentClient) -> None:
    r = client.exec("head -c 5000000 /dev/zero; echo done >&2")
    assert len(r.stdout) == 5_000_000 and r.stderr == b"done\n"


def test_exec_timeout_kills_the_process_group_and_keeps_partial_output(
        client: AgentClient, agent: Agent) -> None:
    pidfile = agent.root / "grandchild.pid"
    t0 = time.monotonic()
    with pytest.raises(AgentTimeout) as err:
        client.exec(f"sleep 60 & echo $! > {pidfile}; echo partial; echo oops >&2; wait",
                    timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert err.value.stdout == b"partial\n"
    assert err.value.stderr == b"oops\n"
    assert err.value.code == "timeout" and err.value.timeout == 0.5
    assert "0.5 s" in err.value.message
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the background child {grandchild} survived the timeout")


def test_exec_returns_when_a_background_child_keeps_the_pipes_open(
        client: AgentClient) -> None:
    t0 = time.monotonic()
    r = client.exec("sleep 3 & echo started", timeout=30)
    assert r.stdout == b"started\n" and r.exit_code == 0
    assert time.monotonic() - t0 < 2.5


def test_exec_missing_program(client: AgentClient) -> None:
    with pytest.raises(AgentError) as err:
        client.exec(["/no/such/program", "x"])
    assert err.value.code == "not_found"
    assert err.value.details["exit_code"] == 127
    assert "/no/such/program" in str(err.value)
    # Through the shell it is the shell's usual 127.
    r = client.exec("no-such-program-vmfork")
    assert r.exit_code == 127 and b"not found" in r.stderr


def test_exec_missing_cwd_names_the_directory(client: AgentClient) -> None:
    with pytest.raises(AgentError) as err:
        client.exec(["true"], cwd="/no/such/dir")
    assert err.value.code == "not_found"
    assert "working directory" in err.value.message and err.value.path == "/no/such/dir"


@pytest.mark.parametrize("request_fields", [
    {},
    {"argv": []},
    {"argv": "ls"},
    {"argv": ["ls"], "cmd": "ls"},
    {"argv": ["ls"], "timeout": -1},
    {"argv": ["ls"], "env": {"A=B": "x"}},
    {"argv": ["ls"], "cwd": "relative"},
])
def test_exec_bad_requests(agent: Agent, request_fields: dict[str, object]) -> None:
    with agent.raw() as sock:
        send_frame(sock, {"op": "exec", **request_fields})
        reply = recv_frame(sock)
    assert reply.header["type"] == "error" and reply.header["error"] == "bad_request"
    assert reply.header["message"]


# -- eval ----------------------------------------------------------------------------


def test_eval_expression_statement_and_persistence(client: AgentClient) -> None:
    assert client.eval("1 + 1").value == "2"
    assert client.eval("import json\nx = [1, 'a']").value is None
    r = client.eval("json.dumps(x)")
    assert r.value == repr('[1, "a"]') and r.ok


def test_eval_captures_prints(client: AgentClient) -> None:
    r = client.eval("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n42")
    assert (r.stdout, r.stderr, r.value) == ("to out\n", "to err\n", "42")


def test_eval_exception_has_type_message_and_traceback(client: AgentClient) -> None:
    r = client.eval("def f():\n    raise ValueError('bad value')\nf()")
    assert not r.ok and r.exception is not None
    assert (r.exception.type, r.exception.message) == ("ValueError", "bad value")
    assert "raise ValueError('bad value')" in r.exception.traceback
    assert "in f" in r.exception.traceback
    assert "evaluator.py" not in r.exception.traceback


def test_eval_syntax_error_and_system_exit_do_not_hurt_the_agent(client: AgentClient) -> None:
    r = client.eval("def (:")
    assert r.exception is not None and r.exception.type == "SyntaxError"
    r = client.eval("import sys; sys.exit(3)")
    assert r.exception is not None and r.exception.type == "SystemExit"
    assert client.ping().pid == os.getpid()


def test_concurrent_evals_keep_their_output_apart(client: AgentClient) -> None:
    code = "import time\nfor i in range(20):\n    print('{tag}', i)\n    time.sleep(0.005)"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda tag: client.eval(code.format(tag=tag)),
                                ["A", "B", "C", "D"]))
    for tag, r in zip("ABCD", results, strict=True):
        assert r.stdout == "".join(f"{tag} {i}\n" for i in range(20))


def test_eval_value_is_truncated_not_refused(client: AgentClient) -> None:
    r = client.eval("'x' * 1_000_000")
    assert r.value_truncated and r.value is not None and len(r.value) == 128 << 10


# -- files ---------------------------------------------------------------------------


def test_ten_mib_binary_round_trip(client: AgentClient, agent: Agent) -> None:
    blob = random.randbytes(10 << 20)
    path = str(agent.root / "big.bin")
    assert client.write_file(path, blob, mode=0o600) == len(blob)
    assert Path(path).read_bytes() == blob
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert client.read_file(path) == blob
    sink = io.BytesIO()
    assert client.read_file_to(path, sink) == len(blob)
    assert sink.getvalue() == blob
    assert client.read_file(path, offset=5, length=10) == blob[5:15]


def test_write_from_file_object_replaces_atomically(client: AgentClient, agent: Agent) -> None:
    path = agent.root / "f.txt"
    path.write_text("old")
    client.write_file(str(path), io.BytesIO(b"new contents"))
    assert path.read_bytes() == b"new contents"
    assert sorted(os.listdir(agent.root)) == ["agent.sock", "f.txt"]  # no temp file left


def test_interrupted_write_leaves_the_old_file(agent: Agent) -> None:
    path = agent.root / "keep.txt"
    path.write_text("original")
    with agent.raw() as sock:
        send_frame(sock, {"op": "write", "path": str(path)})
        assert recv_frame(sock).header["type"] == "ready"
        send_frame(sock, {"type": "data"}, b"half of the new")
    deadline = time.monotonic() + 5
    while len(os.listdir(agent.root)) > 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.read_text() == "original"
    assert sorted(os.listdir(agent.root)) == ["agent.sock", "keep.txt"]


def test_write_parents_only_when_asked(client: AgentClient, agent: Agent) -> None:
    path = str(agent.root / "a" / "b" / "c.txt")
    with pytest.raises(AgentError) as err:
        client.write_file(path, b"x")
    assert err.value.code == "not_found" and "make_parents" in err.value.message
    client.write_file(path, "text é", make_parents=True)
    assert Path(path).read_text() == "text é"


def test_list_stat_mkdir_remove(client: AgentClient, agent: Agent) -> None:
    root = agent.root / "tree"
    client.mkdir(str(root / "sub" / "deeper"), parents=True)
    client.mkdir(str(root / "sub" / "deeper"), parents=True)  # like mkdir -p
    with pytest.raises(AgentError) as err:
        client.mkdir(str(root / "sub"))
    assert err.value.code == "exists"
    client.write_file(str(root / "b.bin"), b"12345", mode=0o640)
    os.symlink("b.bin", root / "a-link")
    entries = client.list_dir(str(root))
    assert [(e.name, e.type) for e in entries] == [
        ("a-link", "symlink"), ("b.bin", "file"), ("sub", "dir")]
    assert entries[0].target == "b.bin"
    assert (entries[1].size, entries[1].mode) == (5, 0o640)
    assert abs(entries[1].mtime - os.stat(root / "b.bin").st_mtime) < 1e-3

    info = client.stat(str(root / "a-link"))
    assert (info.type, info.size, info.path) == ("file", 5, str(root / "a-link"))
    assert client.stat(str(root / "a-link"), follow_symlinks=False).type == "symlink"
    with pytest.raises(AgentError) as err:
        client.stat(str(root / "missing"))
    assert err.value.code == "not_found" and err.value.errno == 2

    client.remove(str(root / "b.bin"))
    assert not (root / "b.bin").exists()
    with pytest.raises(AgentError) as err:
        client.remove(str(root / "sub"))
    assert err.value.code == "not_empty" and "recursive" in err.value.message
    client.remove(str(root / "sub"), recursive=True)
    assert not (root / "sub").exists()
    client.remove(str(root / "gone"), missing_ok=True)
    with pytest.raises(AgentError) as err:
        client.remove(str(root / "gone"))
    assert err.value.code == "not_found"


def test_list_of_a_big_directory_comes_in_batches(client: AgentClient, agent: Agent) -> None:
    big = agent.root / "many"
    big.mkdir()
    for i in range(1300):
        (big / f"f{i:05d}").touch()
    names = [e.name for e in client.list_dir(str(big))]
    assert names == [f"f{i:05d}" for i in range(1300)]


def test_file_op_errors_are_specific(client: AgentClient, agent: Agent) -> None:
    with pytest.raises(AgentError) as err:
        client.read_file(str(agent.root))
    assert err.value.code == "is_a_directory"
    with pytest.raises(AgentError) as err:
        client.read_file("relative/path")
    assert err.value.code == "bad_request" and "absolute" in err.value.message
    with pytest.raises(AgentError) as err:
        client.list_dir(agent.sock_path)
    assert err.value.code == "not_a_directory"


# -- system ops ------------------------------------------------------------------------


def test_reseed_mixes_into_the_kernel_and_reseeds_random(client: AgentClient) -> None:
    before = client.eval("import random\nrandom.getstate()").value
    try:
        r = client.reseed(os.urandom(64))
    except AgentError as err:  # an unprivileged test run: the ioctl needs CAP_SYS_ADMIN
        assert err.code == "permission_denied" and "RNDADDENTROPY" in err.message
        return
    assert (r.bytes, r.entropy_bits) == (64, 512)
    assert client.eval("random.getstate()").value != before
    with pytest.raises(AgentError) as err:
        client.reseed(b"")
    assert err.value.code == "bad_request"
    with pytest.raises(AgentError) as err:
        client.reseed(b"ab", entropy_bits=17)
    assert err.value.code == "bad_request"


def test_set_time_validates_and_sets(client: AgentClient, agent: Agent) -> None:
    with agent.raw() as sock:
        send_frame(sock, {"op": "set_time"})
        assert recv_frame(sock).header["error"] == "bad_request"
    now = time.clock_gettime_ns(time.CLOCK_REALTIME)  # a no-op step of the real clock
    try:
        previous = client.set_time(now)
    except AgentError as err:
        assert err.code == "permission_denied"
        return
    assert 0 <= previous - now < 5_000_000_000


def test_after_fork_sets_the_clock_and_reseeds_in_one_round_trip(
        client: AgentClient, agent: Agent) -> None:
    with agent.raw() as sock:
        send_frame(sock, {"op": "after_fork"}, os.urandom(8))
        reply = recv_frame(sock).header
        assert reply["error"] == "bad_request" and "'ns'" in reply["message"]
    before = client.eval("import random\nrandom.getstate()").value
    try:  # the clock is set to the host's own (the agent runs here): a no-op step
        r = client.after_fork(os.urandom(64))
    except AgentError as err:  # an unprivileged run: clock_settime needs CAP_SYS_TIME
        assert err.code == "permission_denied"
        return
    assert r.ping.pid == os.getpid() and (r.reseed.bytes, r.reseed.entropy_bits) == (64, 512)
    assert r.net is None, "no network refresh unless asked"
    assert 0 < r.clock_error_bound_ns < 5_000_000_000
    assert abs(r.previous_ns - time.time_ns()) < 5_000_000_000
    assert client.eval("random.getstate()").value != before


def test_make_unique_gives_an_older_agent_its_steps_one_call_each(
        client: AgentClient, agent: Agent) -> None:
    from vmfork import _core
    from vmfork.runtime.vmmchild import make_unique

    # The native handshake meets the agent's unknown_op, and takes the steps one call
    # each itself (agent_handshake.rs, op_by_op).
    target = _core.AgentTarget(agent.sock_path, None, 5.0, 30.0)
    del agent.server._handlers["after_fork"]  # as an agent of an earlier release
    before = client.eval("import random\nrandom.getstate()").value
    try:
        timings = make_unique(target, timeout=10.0)
    except AgentError as err:
        assert err.code == "permission_denied"
        return
    assert timings["agent_op_by_op"] is True and "net_refresh" not in timings
    assert client.eval("random.getstate()").value != before, "reseeded"
    agent.server._handlers["after_fork"] = agent.server._after_fork
    assert make_unique(target, timeout=10.0)["agent_op_by_op"] is False


def test_shutdown_answers_then_powers_off(client: AgentClient, power_calls: list[bool]) -> None:
    client.shutdown(reboot=True)
    deadline = time.monotonic() + 5
    while not power_calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert power_calls == [True]


def test_shutdown_is_refused_outside_a_vm(tmp_path: Path) -> None:
    path = tempfile.mktemp(prefix="vmfa-", dir="/tmp")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    server = AgentServer(listener, log=lambda m: None)
    server.start()
    try:
        with pytest.raises(AgentError) as err:
            AgentClient(unix_connector(path)).shutdown()
        assert err.value.code == "unsupported"
    finally:
        server.stop()
        os.unlink(path)


# -- robustness ----------------------------------------------------------------------


def test_many_concurrent_requests(client: AgentClient, agent: Agent) -> None:
    def one(i: int) -> None:
        match i % 4:
            case 0:
                assert client.exec(["sh", "-c", f"sleep 0.3; echo {i}"]).stdout == f"{i}\n".encode()
            case 1:
                assert client.eval(f"{i} * 2").value == str(i * 2)
            case 2:
                path = str(agent.root / f"c{i}")
                client.write_file(path, str(i).encode())
                assert client.read_file(path) == str(i).encode()
            case _:
                assert client.ping().pid == os.getpid()

    t0 = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        list(pool.map(one, range(128)))
    # 32 execs of 0.3 s each: they ran side by side, not one after another.
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    HEADER.pack(4, 0) + b"null",
    HEADER.pack(1 << 30, 0),
    encode_frame({"op": 42}),
    encode_frame({"no": "op"}),
    encode_frame({"op": "frobnicate"}),
])
def test_malformed_requests_get_an_error_and_the_agent_lives(agent: Agent,
                                                             garbage: bytes) -> None:
    with agent.raw() as sock:
        sock.sendall(garbage)
        reply = recv_frame(sock)
        assert reply.header["type"] == "error"
        assert reply.header["error"] in ("bad_request", "too_large", "unknown_op")
        assert reply.header["message"]
        with pytest.raises(ConnectionClosed):
            recv_frame(sock)
    assert agent.client.ping().pid == os.getpid()


def test_truncated_and_silent_connections_do_not_hurt(agent: Agent) -> None:
    with agent.raw() as sock:
        sock.sendall(struct.pack(">II", 100, 0) + b'{"op": "pi')
    with agent.raw():
        pass
    socks = [agent.raw() for _ in range(20)]  # idle connections hold a thread each
    try:
        assert agent.client.ping().pid == os.getpid()
    finally:
        for sock in socks:
            sock.close()


def test_unknown_op_lists_the_known_ones(agent: Agent) -> None:
    with agent.raw() as sock:
        send_frame(sock, {"op": "frobnicate"})
        reply = recv_frame(sock).header
    assert reply["error"] == "unknown_op" and "exec" in reply["message"]


def test_exec_is_killed_when_the_host_hangs_up(agent: Agent) -> None:
    pidfile = agent.root / "p"
    with agent.raw() as sock:
        send_frame(sock, {"op": "exec", "cmd": f"echo $$ > {pidfile}; "
                                                "while true; do echo spam; sleep 0.01; done"})
        assert recv_frame(sock).header["type"] == "started"
        recv_frame(sock)
    deadline = time.monotonic() + 5
    pid = 0
    while time.monotonic() < deadline:
        pid = pid or int(pidfile.read_text() or 0)
        if pid and not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.05)
    pytest.fail(f"exec'd process {pid} kept running after the host hung up")


def test_a_thread_blocked_in_eval_does_not_block_others(client: AgentClient) -> None:
    slow = threading.Thread(target=client.eval, args=("import time; time.sleep(1.5)",))
    slow.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    assert client.eval("'quick'").value == "'quick'"
    assert time.monotonic() - t0 < 1.0
    slow.join()


def test_a_reset_connection_is_closed_quietly_and_the_agent_keeps_serving() -> None:
    """A restored child's first vsock connections are dropped by the transport reset;
    the agent must not log a traceback for each (its console is a slow serial line)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    logged: list[str] = []
    server = AgentServer(listener, log=logged.append)
    server.start()
    try:
        address = listener.getsockname()
        for _ in range(3):
            sock = socket.create_connection(address)
            sock.sendall(b"\x00\x00")  # half a length prefix, then a reset (RST)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        time.sleep(0.3)

        def connect() -> socket.socket:
            return socket.create_connection(address, timeout=5)

        assert AgentClient(connect).ping().pid == os.getpid()
        assert logged == [], logged
    finally:
        server.stop()


def test_a_socket_no_longer_connected_reads_as_a_lost_connection() -> None:
    """What a vsock transport reset leaves: recv fails with ENOTCONN, not ECONNRESET."""
    from vmfork.agent.protocol import ConnectionClosed, recv_frame

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        with pytest.raises(ConnectionClosed) as err:
            recv_frame(sock)
    assert err.value.lost and not err.value.clean and "not connected" in err.value.message


def test_console_log_never_blocks_and_says_what_it_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vmfork.agent import main

    read_end, write_end = os.pipe2(os.O_NONBLOCK)
    try:
        monkeypatch.setattr(main, "_console_fd", write_end)
        monkeypatch.setattr(main, "_console_dropped", 0)
        filler = b"x" * 65536
        while True:  # a console that takes nothing more
            try:
                os.write(write_end, filler)
            except BlockingIOError:
                break
        started = time.monotonic()
        main.log("first")
        main.log("second")
        assert time.monotonic() - started < 1.0 and main._console_dropped == 2
        while True:
            try:
                os.read(read_end, 1 << 20)
            except BlockingIOError:
                break
        main.log("third")
        assert os.read(read_end, 4096) == (b"vmfork-agent: (2 lines dropped: the console "
                                           b"was full)\nvmfork-agent: third\n")
        assert main._console_dropped == 0
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_request_that_never_comes_is_a_timeout_the_host_retries(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    # A guest starved of CPU past the wait sees a connection whose request it never
    # read in time: "timeout" (which both clients raise as AgentTimeout and the
    # after_fork handshake retries), not "bad_request" (which fails the child).
    monkeypatch.setattr(agent_server, "REQUEST_TIMEOUT", 0.2)
    with agent.raw() as sock:
        reply = recv_frame(sock).header
    assert reply["type"] == "error" and reply["error"] == "timeout"
    assert "no request frame within 0.2 s" in reply["message"]
