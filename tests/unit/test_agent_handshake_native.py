"""The child's native ``after_fork`` handshake (``native/src/agent_handshake.rs``) held
to ``AgentClient.after_fork``, which the daemon-side tests and the e2e tier still use.

Both are driven against the real agent (``agent_support``, in this process: its clock
is the host's, so each step it applies is a correction of microseconds) through a
stand-in for the VMM's vsock Unix socket that answers ``CONNECT <port>`` and records
every byte the host sends: the two must send the same frames, in the same encoding,
on the same connections, in every branch of the clock exchange. Then against scripted
hostile agents: both must fail the same way, with the same class and message, and the
native one must stay within its bounds (header and payload caps, its deadline).
"""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.unit.agent_support import Agent, running_agent
from vmfork import _core
from vmfork.agent import client as agent_client
from vmfork.agent import conn as agent_conn
from vmfork.agent import server as agent_server
from vmfork.agent.client import (
    AgentClient,
    AgentError,
    AgentProtocolError,
    AgentTimeout,
    AgentUnavailable,
    unix_connector,
    vsock_uds_connector,
)
from vmfork.agent.conn import Conn
from vmfork.agent.protocol import (
    AGENT_PORT,
    HEADER,
    MAX_CLOCK_STEP_NS,
    MAX_HEADER,
    MAX_PAYLOAD,
    Frame,
    encode_frame,
    encode_header,
    recv_frame,
)
from vmfork.runtime import vmmchild

IO_TIMEOUT = 10.0


# -- a stand-in for the VMM's vsock socket ---------------------------------------------


class VsockStandIn:
    """Listens where a VMM's ``vsock.sock`` would be: takes ``CONNECT <port>\\n``, answers
    ``OK 1\\n`` and bridges to the agent's Unix socket, recording what the host sent on
    each connection. ``hold_replies``: the agent's bytes are passed on only once the
    agent hung up, and then the host's side is closed whole (a VMM that answered after
    the agent stopped waiting, and whose peer is gone by the time it sends)."""

    def __init__(self, agent_path: str, path: str, *, hold_replies: bool = False) -> None:
        self.agent_path = agent_path
        self.path = path
        self.hold_replies = hold_replies
        self.sent: list[bytearray] = []
        self.lines: list[bytes] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                host, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._bridge, args=(host,), daemon=True).start()

    def _bridge(self, host: socket.socket) -> None:
        line = b""
        while not line.endswith(b"\n") and len(line) < 64:
            byte = host.recv(1)
            if not byte:
                host.close()
                return
            line += byte
        self.lines.append(line)
        agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        agent.connect(self.agent_path)
        host.sendall(b"OK 1\n")
        record = bytearray()
        self.sent.append(record)
        agent_gone = threading.Event()

        def host_to_agent() -> None:
            try:
                while data := host.recv(65536):
                    if agent_gone.is_set():
                        break   # what the host sends after the agent hung up is lost
                    record.extend(data)
                    agent.sendall(data)
                agent.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        upstream = threading.Thread(target=host_to_agent, daemon=True)
        upstream.start()
        held = bytearray()
        try:
            while data := agent.recv(65536):
                if self.hold_replies:
                    held.extend(data)
                else:
                    host.sendall(data)
            agent_gone.set()
            if held:
                host.sendall(held)
        except OSError:
            pass
        finally:
            if not self.hold_replies:
                upstream.join(5)
            host.close()
            agent.close()

    def frames(self) -> list[list[tuple[list[str], dict[str, Any], int]]]:
        """Each connection's frames as (keys in order, header, payload length); every
        header checked to be the protocol's compact encoding of itself."""
        out = []
        for raw in self.sent:
            frames = []
            at = 0
            while at < len(raw):
                header_len, payload_len = HEADER.unpack_from(raw, at)
                body = bytes(raw[at + 8:at + 8 + header_len])
                header = json.loads(body)
                assert encode_header(header) == body, "not the protocol's encoding"
                frames.append((list(header), header, payload_len))
                at += 8 + header_len + payload_len
            out.append(frames)
        return out

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def agent() -> Iterator[Agent]:
    with running_agent() as a:
        yield a


@contextmanager
def stand_in(agent: Agent, **kw: Any) -> Iterator[VsockStandIn]:
    s = VsockStandIn(agent.sock_path, str(agent.root / f"vsock-{random.random()}.sock"), **kw)
    try:
        yield s
    finally:
        s.close()


def _count_ops(agent: Agent, *ops: str) -> dict[str, int]:
    counts = dict.fromkeys(ops, 0)
    for op in ops:
        handler = agent.server._handlers[op]

        def counted(conn: Conn, frame: Frame, op: str = op, handler: Any = handler) -> None:
            counts[op] += 1
            handler(conn, frame)

        agent.server._handlers[op] = counted
    return counts


def _native(path: str, port: int | None, *, tolerance_ns: int = 50_000_000,
            timeout: float = 0.0, net_refresh: bool = False,
            io_timeout: float = IO_TIMEOUT) -> tuple[int, int, Any, int]:
    """The native handshake's result, or its failure raised as the client's class."""
    done, failure = _core.agent_after_fork(_core.AgentTarget(path, port, 5.0, io_timeout),
                                           timeout, net_refresh, tolerance_ns)
    if failure is not None:
        raise vmmchild._agent_failure(*failure)
    assert done is not None
    return done[:4]   # the answering call's timings are for the reports, not compared


def _python(path: str, port: int | None, *, tolerance_ns: int = 50_000_000,
            net_refresh: bool = False, io_timeout: float = IO_TIMEOUT
            ) -> agent_client.AfterForkResult:
    connect = (unix_connector(path) if port is None
               else vsock_uds_connector(path, port, timeout=5.0))
    return AgentClient(connect, io_timeout=io_timeout).after_fork(
        os.urandom(64), net_refresh=net_refresh, clock_tolerance_ns=tolerance_ns)


def _shape(frames: list[list[tuple[list[str], dict[str, Any], int]]]) -> list[Any]:
    """The frames without the values that differ from call to call (times, steps)."""
    timed = {"ns", "offset_ns"}
    return [[(keys, {k: (type(v).__name__ if k in timed else v) for k, v in h.items()},
              payload) for keys, h, payload in conn] for conn in frames]


def _as_an_older_agent(agent: Agent) -> None:
    """``after_fork`` as protocol 3 serves it: ``clock_exchange`` ignored."""
    current = agent.server._after_fork

    def older(conn: Conn, frame: Frame) -> None:
        header = {k: v for k, v in frame.header.items() if k != "clock_exchange"}
        current(conn, Frame(header, frame.payload))

    agent.server._handlers["after_fork"] = older


# -- the same frames as the client, in every branch ------------------------------------


@pytest.mark.parametrize("case", ["within-tolerance", "stepped", "older-agent-stepped",
                                  "older-agent-within", "late-step"])
def test_the_native_handshake_sends_what_the_client_sends(
        agent: Agent, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    tolerance = 10**12 if case.endswith("within") or case == "within-tolerance" else 0
    if case.startswith("older-agent"):
        _as_an_older_agent(agent)
    if case == "late-step":
        # The agent stops waiting for the step at once; the stand-in passes its clock
        # frame on only after the agent hung up, and closes the host's side: the step
        # is sent too late (to a closed peer), the result is read all the same, and
        # the clock is bracketed on fresh connections.
        monkeypatch.setattr(agent_server, "CLOCK_STEP_TIMEOUT", 0.05)
        monkeypatch.setattr(agent_conn, "DRAIN_TIMEOUT", 0.05)
    runs = {}
    served = dict(agent.server._handlers)
    for side in ("python", "native"):
        counts = _count_ops(agent, "after_fork", "set_time")
        with stand_in(agent, hold_replies=case == "late-step") as vsock:
            if side == "python":
                r = _python(vsock.path, AGENT_PORT, tolerance_ns=tolerance)
                step, bound = r.clock_step_ns, r.clock_error_bound_ns
            else:
                bound, step, net, retries = _native(vsock.path, AGENT_PORT,
                                                    tolerance_ns=tolerance)
                assert net is None and retries == 0
            assert all(line == f"CONNECT {AGENT_PORT}\n".encode() for line in vsock.lines)
            runs[side] = (dict(counts), _shape(vsock.frames()), step != 0, bound >= 0)
        agent.server._handlers.update(served)
    assert runs["native"] == runs["python"]
    counts, frames, _, _ = runs["native"]
    expected_set_time = 2 if case in ("older-agent-stepped", "late-step") else 0
    assert counts == {"after_fork": 1, "set_time": expected_set_time}
    request = frames[0][0]
    assert request[0] == ["op", "ns", "net_refresh", "clock_exchange"]
    assert request[2] == 64, "64 bytes of entropy"


def test_an_agent_served_on_a_unix_socket_and_the_result(agent: Agent) -> None:
    bound, step, net, retries = _native(agent.sock_path, None, tolerance_ns=10**12)
    assert step == 0 and 0 < bound < 10**12 and net is None and retries == 0


def test_the_reseed_bytes_differ_on_every_call(agent: Agent) -> None:
    seen: list[bytes] = []
    current = agent.server._after_fork

    def recording(conn: Conn, frame: Frame) -> None:
        seen.append(frame.payload)
        current(conn, frame)

    agent.server._handlers["after_fork"] = recording
    for _ in range(3):
        _native(agent.sock_path, None)
    assert len(seen) == 3 and len(set(seen)) == 3 and all(len(p) == 64 for p in seen)


def test_the_arithmetic_is_the_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(19)
    for _ in range(20_000):
        args = [rng.randrange(-2**62, 2**62) if rng.random() < 0.2
                else rng.randrange(0, 10**10) for _ in range(4)]
        assert _core.clock_exchange_step(*args) == agent_client.clock_exchange_step(*args)


# -- make_unique: retried while unavailable, the op-by-op fallback ---------------------


def test_unavailable_is_retried_until_the_deadline(tmp_path: Path) -> None:
    missing = str(tmp_path / "nobody.sock")
    started = time.monotonic()
    with pytest.raises(AgentUnavailable, match="connect to the VMM's vsock socket"):
        _native(missing, AGENT_PORT, timeout=0.3)
    assert time.monotonic() - started >= 0.3


def test_an_agent_that_comes_up_late_is_waited_for(tmp_path: Path) -> None:
    path = str(tmp_path / "late.sock")

    def serve_later() -> None:
        time.sleep(0.3)
        with running_agent() as a:
            os.symlink(a.sock_path, path)
            deadline = time.monotonic() + 10
            while os.path.lexists(path) and time.monotonic() < deadline:
                time.sleep(0.05)

    t = threading.Thread(target=serve_later, daemon=True)
    t.start()
    try:
        bound, _, _, retries = _native(path, None, timeout=10.0, tolerance_ns=10**12)
    finally:
        os.unlink(path)
        t.join(10)
    assert retries >= 1 and bound > 0


# -- hostile agents --------------------------------------------------------------------


Script = Callable[[socket.socket, Frame], None]


@contextmanager
def scripted_agent(tmp_path: Path, script: Script) -> Iterator[str]:
    """An agent on a Unix socket that reads the request and then does ``script``."""
    path = str(tmp_path / f"hostile-{random.random()}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return

            def one(conn: socket.socket = conn) -> None:
                with conn:
                    try:
                        conn.settimeout(10)
                        script(conn, recv_frame(conn))
                    except OSError:
                        pass

            threading.Thread(target=one, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield path
    finally:
        listener.close()


def _ping_fields(**extra: Any) -> dict[str, Any]:
    return {"type": "result", "pong": True, "pid": 1, "version": "x", "protocol": 4,
            "uptime": 1.0, "boot_id": None, "clock": {"previous_ns": 1, "ns": 2},
            "reseed": {"bytes": 64, "entropy_bits": 512, "kernel_reseeded": True},
            "net": None, **extra}


def _both_fail(path: str, **kw: Any) -> tuple[AgentError, AgentError]:
    errors = []
    for call in (_python, _native):
        with pytest.raises(AgentError) as raised:
            call(path, None, **kw)
        errors.append(raised.value)
    return errors[0], errors[1]


def _send(frame: bytes) -> Script:
    def script(conn: socket.socket, _: Frame) -> None:
        conn.sendall(frame)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)   # until the host hangs up
    return script


HOSTILE: dict[str, tuple[bytes, type[AgentError]]] = {
    "oversize-header": (struct.pack(">II", MAX_HEADER + 1, 0), AgentProtocolError),
    "oversize-payload": (struct.pack(">II", 2, MAX_PAYLOAD + 1) + b"{}", AgentProtocolError),
    "empty-header": (struct.pack(">II", 0, 0), AgentProtocolError),
    "not-an-object": (struct.pack(">II", 6, 0) + b"[1, 2]", AgentProtocolError),
    "wrong-frame-type": (encode_frame({"type": "data", "x": [1, "two", None, True]}),
                         AgentProtocolError),
    "early-close": (b"", AgentUnavailable),
    "cut-in-a-header": (struct.pack(">II", 10, 0) + b'{"ty', AgentProtocolError),
    "cut-in-a-payload": (struct.pack(">II", 2, 10) + b"{}abc", AgentProtocolError),
    "an-error-frame": (encode_frame({"type": "error", "error": "busy", "message": "full"}),
                       AgentError),
    "a-timeout-error": (encode_frame({"type": "error", "error": "timeout", "message": "t"}),
                        AgentTimeout),
    "ns-not-an-int": (encode_frame({"type": "clock", "ns": "now", "processing_ns": 0}),
                      AgentProtocolError),
    "ns-a-bool": (encode_frame({"type": "clock", "ns": True, "processing_ns": 0}),
                  AgentProtocolError),
    "no-processing": (encode_frame({"type": "clock", "ns": 5, "processing_ns": None}),
                      AgentProtocolError),
    "result-without-reseed": (encode_frame({k: v for k, v in _ping_fields().items()
                                            if k != "reseed"}), AgentProtocolError),
    "negative-pid": (encode_frame(_ping_fields(pid=-1)), AgentProtocolError),
    "uptime-a-string": (encode_frame(_ping_fields(uptime="1")), AgentProtocolError),
    "net-counts-negative": (encode_frame(_ping_fields(net={
        "interface": "eth0", "connections_aborted": -3, "neighbours_flushed": 0})),
        AgentProtocolError),
    "reseed-not-a-record": (encode_frame(_ping_fields(reseed=[64])), AgentProtocolError),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_reply_fails_both_the_same_way(tmp_path: Path, case: str) -> None:
    frame, kind = HOSTILE[case]
    with scripted_agent(tmp_path, _send(frame)) as path:
        py, native = _both_fail(path, tolerance_ns=10**12)
    assert type(native) is type(py) is kind
    assert (native.code, str(native)) == (py.code, str(py))


def _older_than_after_fork(replies: dict[str, dict[str, Any]],
                           seen: list[tuple[str, int]]) -> Script:
    """An agent of a release before ``after_fork``: ``unknown_op`` for it, ``replies``
    by op for the rest; ``seen`` gets each request's op and payload length."""
    def script(conn: socket.socket, request: Frame) -> None:
        op = str(request.header["op"])
        seen.append((op, len(request.payload)))
        conn.sendall(encode_frame(replies.get(op) or {
            "type": "error", "error": "unknown_op", "message": f"unknown op {op!r}"}))
        conn.recv(1)   # until the host hangs up
    return script


OLDER_AGENT_REPLIES: dict[str, dict[str, Any]] = {
    "reseed": {"type": "result", "bytes": 64, "entropy_bits": 512, "kernel_reseeded": True},
    "set_time": {"type": "result", "previous_ns": 0, "ns": 0},
    "net_refresh": {"type": "result", "interface": "eth0", "connections_aborted": 2,
                    "neighbours_flushed": 3},
}


def test_an_agent_older_than_after_fork_gets_its_steps_one_call_each(tmp_path: Path) -> None:
    # The guest's clock reads 0 (1970): the bracket steps it by the host's clock.
    seen: list[tuple[str, int]] = []
    with scripted_agent(tmp_path, _older_than_after_fork(OLDER_AGENT_REPLIES, seen)) as path:
        done, failure = _core.agent_after_fork(_core.AgentTarget(path, None, 5.0, IO_TIMEOUT),
                                               10.0, True)
    assert failure is None, failure
    assert done is not None
    bound, step, net, retries, (reseeded, clock_set, all_done), op_by_op = done
    assert op_by_op and retries == 0 and net == (2, 3)
    assert abs(step - time.time_ns()) < 60 * 10**9 and 0 <= bound < 5 * 10**9
    assert 0 < reseeded <= clock_set <= all_done
    # One connection each: the refused op, the reseed with the host's 64 random bytes,
    # the clock read and its step (AgentClient.sync_clock's bracket), the refresh.
    assert seen == [("after_fork", 64), ("reseed", 64),
                    ("set_time", 0), ("set_time", 0), ("net_refresh", 0)]


@pytest.mark.parametrize("op", ["reseed", "net_refresh"])
def test_an_older_agents_reply_is_checked_as_the_clients(tmp_path: Path, op: str) -> None:
    replies = {**OLDER_AGENT_REPLIES, op: {**OLDER_AGENT_REPLIES[op], "type": "result",
                                           **({"kernel_reseeded": "yes"} if op == "reseed"
                                              else {"neighbours_flushed": -1})}}
    with scripted_agent(tmp_path, _older_than_after_fork(replies, [])) as path:
        with pytest.raises(AgentProtocolError) as raised:
            _native(path, None, timeout=10.0, net_refresh=True)
    field = "kernel_reseeded" if op == "reseed" else "neighbours_flushed"
    assert field in str(raised.value) and raised.value.op == op, raised.value


def test_garbage_json_is_a_malformed_frame(tmp_path: Path) -> None:
    # The two JSON parsers word their complaint differently; the rest is the same.
    with scripted_agent(tmp_path, _send(struct.pack(">II", 5, 0) + b"{nope")) as path:
        py, native = _both_fail(path)
    prefix = "after_fork: malformed frame from the agent: frame header is not UTF-8 JSON: "
    assert type(native) is type(py) is AgentProtocolError
    assert str(native).startswith(prefix) and str(py).startswith(prefix)


def test_a_clock_hours_off_is_refused(tmp_path: Path) -> None:
    def lying(conn: socket.socket, request: Frame) -> None:
        conn.sendall(encode_frame({"type": "clock", "processing_ns": 0,
                                   "ns": request.header["ns"] - 2 * MAX_CLOCK_STEP_NS}))
        conn.recv(1)

    with scripted_agent(tmp_path, lying) as path:
        py, native = _both_fail(path)
    assert type(native) is type(py) is AgentProtocolError
    for err in (py, native):
        assert str(err).startswith("after_fork: the agent's clock reads ")
        assert str(err).endswith(" ns off the time it was just set to, beyond any transit time")


def test_a_second_clock_frame_instead_of_the_result(tmp_path: Path) -> None:
    def again(conn: socket.socket, request: Frame) -> None:
        clock = encode_frame({"type": "clock", "ns": request.header["ns"],
                              "processing_ns": 0})
        conn.sendall(clock)
        recv_frame(conn)      # the step
        conn.sendall(encode_frame({"type": "clock", "ns": 7}))
        conn.recv(1)

    with scripted_agent(tmp_path, again) as path:
        py, native = _both_fail(path, tolerance_ns=10**12)
    assert type(native) is type(py) is AgentProtocolError
    assert str(native) == str(py)
    assert str(native).startswith("after_fork: expected a 'result' frame, got {'type': 'clock', 'ns': 7}")


def test_a_reply_trickled_past_the_deadline_times_out(tmp_path: Path) -> None:
    def trickle(conn: socket.socket, request: Frame) -> None:
        conn.sendall(struct.pack(">II", MAX_HEADER, 0))
        for _ in range(50):
            time.sleep(0.1)
            conn.sendall(b" ")

    with scripted_agent(tmp_path, trickle) as path:
        started = time.monotonic()
        py, native = _both_fail(path, io_timeout=0.5)
    assert type(native) is type(py) is AgentTimeout
    assert str(native) == str(py) == \
        "after_fork: the agent did not finish the call within its deadline"
    assert time.monotonic() - started < 4.5, "each gave up at its deadline"


def test_a_vmm_that_refuses_the_connect_line(tmp_path: Path) -> None:
    path = str(tmp_path / "vmm.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)

    def serve() -> None:
        for reply in (b"NO\x00 way\n", b"NO\x00 way\n", b"", b""):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for _ in range(2):   # a reply, then a closed connection
            errors = []
            for call in (_python, _native):
                with pytest.raises(AgentUnavailable) as raised:
                    call(path, AGENT_PORT)
                errors.append(str(raised.value))
            assert errors[0] == errors[1]
            assert "expected 'OK <port>'" in errors[0]
    finally:
        listener.close()
        t.join(5)


def test_the_net_refresh_counts_are_returned(tmp_path: Path) -> None:
    refreshed = _ping_fields(net={"interface": "eth0", "connections_aborted": 3,
                                  "neighbours_flushed": 2})
    asked: list[bool] = []

    def answer(conn: socket.socket, request: Frame) -> None:
        asked.append(request.header["net_refresh"])
        conn.sendall(encode_frame(refreshed))

    with scripted_agent(tmp_path, answer) as path:
        bound, step, net, _ = _native(path, None, tolerance_ns=10**12, net_refresh=True)
    assert asked == [True] and net == (3, 2) and step == 0 and bound > 0


# -- the status reports ----------------------------------------------------------------


def test_a_report_replaces_status_json_and_writes_the_fifo_line(tmp_path: Path) -> None:
    fifo = tmp_path / "notify"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        reporter = _core.ChildReporter(str(tmp_path), "vm-7", str(fifo))
        status = {"state": "ready", "pid": 12, "restore_s": 0.25, "start_wait_s": 0.0,
                  "fork_to_entry_s": None, "ready_s": 1e-05, "big": 2**70,
                  "net_refresh": {"connections_aborted": 1, "neighbours_flushed": 0},
                  "text": "é \"quoted\"\n", "ok": True, "tail": ["a", 1]}
        reporter.report({"state": "restored", "pid": 12})
        reporter.report(status)
        written = (tmp_path / "status.json").read_text()
        assert json.loads(written) == status
        assert list(json.loads(written)) == list(status), "in the dict's order"
        assert not (tmp_path / ".status.json.tmp").exists()
        assert os.read(reader, 100) == b"vm-7 restored\nvm-7 ready\n"
    finally:
        os.close(reader)


def test_a_failure_goes_to_stderr_too(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    reporter = _core.ChildReporter(str(tmp_path), "vm-8", None)
    reporter.report({"state": "failed", "reason": "restore: no such snapshot"})
    assert capfd.readouterr().err == "vmfork vmm vm-8: restore: no such snapshot\n"
    assert json.loads((tmp_path / "status.json").read_text())["reason"] == \
        "restore: no such snapshot"


def test_a_fifo_nobody_reads_or_a_missing_one_costs_nothing(tmp_path: Path) -> None:
    fifo = tmp_path / "notify"
    os.mkfifo(fifo)
    for notify in (str(fifo), str(tmp_path / "gone")):
        _core.ChildReporter(str(tmp_path), "vm-9", notify).report({"state": "prepared"})
        assert json.loads((tmp_path / "status.json").read_text()) == {"state": "prepared"}
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_run_dir_that_is_gone_is_an_os_error(tmp_path: Path) -> None:
    reporter = _core.ChildReporter(str(tmp_path / "gone"), "vm-10", None)
    with pytest.raises(OSError):
        reporter.report({"state": "ready"})


def test_a_status_that_is_not_json_is_refused(tmp_path: Path) -> None:
    reporter = _core.ChildReporter(str(tmp_path), "vm-11", None)
    with pytest.raises(ValueError):
        reporter.report({"state": "ready", "x": object()})
    with pytest.raises(ValueError):
        reporter.report({"no": "state"})
    assert not (tmp_path / "status.json").exists()
