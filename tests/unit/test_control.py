"""The VMM control protocol (``runtime/control.py``): its records, both parsers and the
client, against the wire a VMM sends -- or a hostile one could.

The VMM side here is a real Unix socket served by a script (``ScriptedVMM``): what it
sends is exactly the bytes under test. The real ``ControlServer`` answers the same
client in tests/kvm/test_branch_store.py and tests/e2e.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from vmfork.runtime import control
from vmfork.runtime.branch import BranchFailed, branch_sandbox
from vmfork.runtime.control import (
    Ack,
    ControlClient,
    ControlError,
    Exits,
    ExitsReply,
    FreePageReporting,
    Pause,
    Resume,
    Resumed,
    Snapshot,
    SnapshotBase,
    SnapshotReply,
    Status,
    StatusReply,
    Stop,
    encode,
    parse_reply,
    parse_request,
)
from vmfork.store import Store

FPR = FreePageReporting(active=True, reports=3, bytes_discarded=3 << 20, discard_errors=0,
                        last_report_age_s=1.5)
STATUS = StatusReply(paused=False, exit=None,
                     snapshot_bases=(SnapshotBase("b1", "previous"),
                                     SnapshotBase("base", "restore")),
                     snapshot_tracking="soft-dirty", jailed=True, free_page_reporting=FPR)
TIMINGS = {"pause_s": 0.004, "vcpu_state_s": 0.001, "memory_write_s": 0.2, "total_s": 0.3}
SNAPSHOT_REPLY = SnapshotReply(mode="diff", memory_format="layer", memory_bytes=8192,
                               dirty_pages=2, base_tag="base", base_kind="restore",
                               tag="d1", tracking="soft-dirty", timings=TIMINGS,
                               changed_pages=2)
SNAPSHOT = Snapshot(memory_path="/r/m", state_path="/r/s", mode="diff", tag="d1",
                    base_tag="base", progress=True)


# -- records and the wire --------------------------------------------------------------
@pytest.mark.parametrize("request_", [
    Status(), Pause(), Resume(), Exits(), Stop(), SNAPSHOT,
    Snapshot(memory_path="/r/m", state_path="/r/s"),
    Snapshot(memory_path="/r/m", state_path="/r/s", mode="live", resume=False),
], ids=repr)
def test_every_request_round_trips(request_: control.AnyRequest) -> None:
    line = encode(request_)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert parse_request(line[:-1]) == request_


@pytest.mark.parametrize(("request_", "reply"), [
    (Status(), STATUS),
    (Status(), StatusReply(paused=True, exit="shutdown")),
    (Pause(), Ack()), (Resume(), Ack()), (Stop(), Ack()),
    (Exits(), ExitsReply(profile={"by_reason": {"io": 4}, "irqs": {"5": 1}})),
    (SNAPSHOT, SNAPSHOT_REPLY),
    (SNAPSHOT, SnapshotReply(mode="full", memory_format="image", memory_bytes=0,
                             dirty_pages=None, base_tag=None, base_kind=None, tag=None,
                             tracking="restore-base-only", timings={"pause_s": 0})),
], ids=repr)
def test_every_reply_round_trips(request_: control.Request[Any], reply: Any) -> None:
    assert parse_reply(request_, encode(reply)[:-1]) == reply


def test_the_wire_is_the_one_running_vmms_speak() -> None:
    # The op and field names of VMMs already running: a rename breaks them.
    assert [json.loads(encode(r)) for r in (Status(), Pause(), Resume(), Exits(), Stop())] \
        == [{"op": op} for op in ("status", "pause", "resume", "exits", "stop")]
    assert json.loads(encode(SNAPSHOT)) == {
        "op": "snapshot", "mode": "diff", "memory_path": "/r/m", "state_path": "/r/s",
        "tag": "d1", "base_tag": "base", "resume": True, "progress": True}
    assert set(json.loads(encode(Snapshot(memory_path="m", state_path="s")))) == {
        "op", "mode", "memory_path", "state_path", "resume", "progress"}
    assert json.loads(encode(STATUS)) == {
        "ok": True, "paused": False, "exit": None,
        "snapshot_bases": [{"tag": "b1", "kind": "previous"}, {"tag": "base", "kind": "restore"}],
        "snapshot_tracking": "soft-dirty", "jailed": True,
        "free_page_reporting": {"active": True, "reports": 3, "bytes_discarded": 3 << 20,
                                "discard_errors": 0, "last_report_age_s": 1.5}}
    assert json.loads(encode(Resumed({"pause_s": 0.01}))) == {
        "ok": True, "stage": "resumed", "timings": {"pause_s": 0.01}}
    assert set(json.loads(encode(SNAPSHOT_REPLY))) == {
        "ok", "mode", "memory_format", "memory_bytes", "dirty_pages", "base_tag",
        "base_kind", "tag", "tracking", "timings", "changed_pages"}


def test_an_older_vmms_snapshot_reply_reads_with_no_changed_pages() -> None:
    wire = json.loads(encode(SNAPSHOT_REPLY))
    del wire["changed_pages"]
    reply = parse_reply(SNAPSHOT, json.dumps(wire).encode())
    assert reply == replace(SNAPSHOT_REPLY, changed_pages=None)


def test_an_older_vmms_status_reads_with_the_later_fields_at_their_defaults() -> None:
    # Before snapshot tracking, the jail and the balloon, status said this much.
    old = parse_reply(Status(), b'{"ok": true, "paused": false, "exit": null}')
    assert old == StatusReply(paused=False, exit=None)
    assert old.snapshot_bases == () and not old.jailed and old.free_page_reporting is None


def test_snapshot_modes_are_the_capture_modes() -> None:
    from vmfork.vmm.capture import MODES
    assert control.SNAPSHOT_MODES == MODES


def test_the_vmm_imports_the_protocol_and_nothing_else_of_vmfork() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run(
        [sys.executable, "-c", "import sys, vmfork.runtime.control; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('vmfork'))))"],
        env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True,
        check=True)
    assert out.stdout.split() == ["vmfork", "vmfork.runtime", "vmfork.runtime.control"]


# -- the VMM's side: requests ------------------------------------------------------------
@pytest.mark.parametrize(("line", "expected"), [
    (b"", "not JSON"),
    (b"status", "not JSON"),
    (b'["status"]', "not a JSON object"),
    (b'{"op": "frobnicate"}', "unknown op 'frobnicate'"),
    (b'{"op": 7}', "unknown op 7"),
    (b'{}', "unknown op None"),
    (b'{"op": "pause", "vcpu": 1}', "takes no fields, not vcpu"),
    (b'{"op": "snapshot", "mode": "diff"}', "memory_path and state_path (strings) are required"),
    (b'{"op": "snapshot", "memory_path": 1, "state_path": "s"}', "are required"),
    (b'{"op": "snapshot", "memory_path": "m", "state_path": "s", "mode": "partial"}',
     "mode must be one of full, diff, live, not 'partial'"),
    (b'{"op": "snapshot", "memory_path": "m", "state_path": "s", "base_tag": "b"}',
     "base_tag applies to mode diff only"),
    (b'{"op": "snapshot", "memory_path": "m", "state_path": "s", "tag": 5}',
     "'tag' must be a string, not int"),
    (b'{"op": "snapshot", "memory_path": "m", "state_path": "s", "resume": "no"}',
     "'resume' must be true or false, not str"),
    (b'{"op": "snapshot", "memory_path": "m", "state_path": "s", "parent_memory_path": "/p"}',
     "unknown snapshot field(s) parent_memory_path"),
])
def test_a_bad_request_is_refused_saying_why(line: bytes, expected: str) -> None:
    with pytest.raises(ControlError) as exc:
        parse_request(line)
    assert exc.value.refused and expected in exc.value.message, exc.value.message


# -- the host's side: what a hostile VMM may answer -----------------------------------------
@pytest.mark.parametrize(("request_", "line", "expected"), [
    (Status(), b"", "not JSON"),
    (Status(), b"\xff\xfe", "not JSON"),
    (Status(), b"[true]", "not a JSON object"),
    (Status(), b'"ok"', "not a JSON object"),
    (Status(), b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    (Status(), b'{"paused": false, "exit": null}', "no 'ok'"),
    (Status(), b'{"ok": 1, "paused": false}', "no 'ok'"),
    (Status(), b'{"ok": true}', "'paused' is missing"),
    (Status(), b'{"ok": true, "paused": "no", "exit": null}', "'paused' must be true or false"),
    (Status(), b'{"ok": true, "paused": false, "exit": 3}', "'exit' must be a string"),
    (Status(), b'{"ok": true, "paused": false, "snapshot_bases": {"tag": "x"}}',
     "'snapshot_bases' must be a list"),
    (Status(), b'{"ok": true, "paused": false, "snapshot_bases": ["x"]}',
     "'snapshot_bases[]' must be an object"),
    (Status(), b'{"ok": true, "paused": false, "snapshot_bases": [{"tag": "x"}]}',
     "'kind' is missing"),
    (Status(), b'{"ok": true, "paused": false, "jailed": 1}', "'jailed' must be true or false"),
    (Status(), b'{"ok": true, "paused": false, "free_page_reporting": {"active": true}}',
     "'reports' is missing"),
    (Status(), b'{"ok": true, "paused": false, "free_page_reporting": {"active": true, '
     b'"reports": true, "bytes_discarded": 0, "discard_errors": 0}}',
     "'reports' must be a non-negative integer"),
    (Exits(), b'{"ok": true, "profile": []}', "'profile' must be an object"),
    (SNAPSHOT, b'{"ok": true, "mode": "full"}', "'memory_format' is missing"),
    (SNAPSHOT, json.dumps({**SNAPSHOT_REPLY.to_wire(), "memory_bytes": -1}).encode(),
     "'memory_bytes' must be a non-negative integer"),
    (SNAPSHOT, json.dumps({**SNAPSHOT_REPLY.to_wire(), "memory_bytes": 1.5}).encode(),
     "'memory_bytes' must be a non-negative integer"),
    (SNAPSHOT, json.dumps({**SNAPSHOT_REPLY.to_wire(), "timings": {}}).encode(),
     "'timings' has no 'pause_s'"),
    (SNAPSHOT, json.dumps({**SNAPSHOT_REPLY.to_wire(), "timings": [1]}).encode(),
     "'timings' must be an object"),
    (SNAPSHOT, json.dumps({**SNAPSHOT_REPLY.to_wire(), "timings": {"pause_s": "0"}}).encode(),
     "'timings.pause_s' must be a non-negative number"),
    (SNAPSHOT, json.dumps({**SNAPSHOT_REPLY.to_wire(), "timings": {"pause_s": -1}}).encode(),
     "'timings.pause_s' must be a non-negative number"),
    (SNAPSHOT, json.dumps(SNAPSHOT_REPLY.to_wire()).replace('0.004', 'NaN').encode(),
     "NaN is not a JSON number"),
    (SNAPSHOT, json.dumps(SNAPSHOT_REPLY.to_wire()).replace('0.004', '1e999').encode(),
     "'timings.pause_s' must be a non-negative number"),
], ids=lambda v: v[:40] if isinstance(v, (bytes, str)) else None)
def test_a_hostile_reply_is_a_control_error(request_: control.Request[Any], line: bytes,
                                            expected: str) -> None:
    with pytest.raises(ControlError) as exc:
        parse_reply(request_, line)
    assert exc.value.reason == ControlError.MALFORMED and expected in exc.value.message, \
        exc.value.message
    assert exc.value.op == request_.op and not exc.value.unreachable


def test_a_refusal_carries_the_vmms_reason_bounded() -> None:
    with pytest.raises(ControlError) as exc:
        parse_reply(Pause(), b'{"ok": false, "error": "vcpu 0 is gone"}')
    assert exc.value.refused and exc.value.message == "vcpu 0 is gone"
    with pytest.raises(ControlError) as exc:
        parse_reply(Pause(), json.dumps({"ok": False, "error": "x" * 100_000}).encode())
    assert exc.value.refused and len(exc.value.message) == control.MAX_ERROR_CHARS
    with pytest.raises(ControlError) as exc:
        parse_reply(Pause(), b'{"ok": false, "error": {"nested": 1}}')
    assert exc.value.refused and exc.value.message == "(no reason given)"


# -- the client, on a real socket -------------------------------------------------------
Serve = Callable[[socket.socket, BinaryIO], None]


class ScriptedVMM:
    """A control socket whose answers are the test's script (one call per connection):
    the wire as a VMM -- any VMM -- could speak it."""

    def __init__(self, path: Path, serve: Serve) -> None:
        self.path = str(path)
        self.serve = serve
        self.requests: list[dict[str, Any]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            try:
                self.serve(conn, reader)
            except OSError:
                pass   # the client went away: what some tests do

    def read(self, reader: BinaryIO) -> dict[str, Any] | None:
        """The next request, None once the client closed."""
        line = reader.readline()
        if not line:
            return None
        request: dict[str, Any] = json.loads(line)
        self.requests.append(request)
        return request

    def close(self) -> None:
        # Shut down first: that wakes the blocked accept. A bare close would leave it
        # blocked on the fd number, and a later test's listener given that number would
        # have its connections taken by this script (seen: an agent's frames read here).
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._acceptor.join(5)
        self.sock.close()


@pytest.fixture
def vmm(tmp_path: Path) -> Iterator[Callable[[Serve], ScriptedVMM]]:
    made: list[ScriptedVMM] = []

    def make(serve: Serve) -> ScriptedVMM:
        made.append(ScriptedVMM(tmp_path / f"control-{len(made)}.sock", serve))
        return made[-1]

    yield make
    for v in made:
        v.close()


def _send(conn: socket.socket, wire: dict[str, Any] | bytes) -> None:
    conn.sendall(wire if isinstance(wire, bytes) else json.dumps(wire).encode() + b"\n")


def test_nothing_listening_is_unreachable(tmp_path: Path) -> None:
    with pytest.raises(ControlError) as exc:
        ControlClient.connect(tmp_path / "nowhere.sock")
    assert exc.value.unreachable and "nowhere.sock" in exc.value.message
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "dead.sock"))   # bound, never listening: a VMM that exited
    dead.close()
    with pytest.raises(ControlError) as exc:
        ControlClient.connect(tmp_path / "dead.sock")
    assert exc.value.unreachable


def test_calls_on_one_connection_in_order(vmm: Callable[[Serve], ScriptedVMM]) -> None:
    def serve(conn: socket.socket, reader: BinaryIO) -> None:
        while (request := v.read(reader)) is not None:
            _send(conn, STATUS.to_wire() if request["op"] == "status" else
                  control.error_reply("not now") if request["op"] == "pause"
                  else {"ok": True})

    v = vmm(serve)
    with ControlClient.connect(v.path) as client:
        assert client.call(Status()) == STATUS
        with pytest.raises(ControlError) as exc:
            client.call(Pause())
        assert exc.value.refused and exc.value.message == "not now"
        assert client.call(Resume()) == Ack()     # a refusal leaves the connection usable
        assert client.call(Status()).free_page_reporting == FPR
    assert [r["op"] for r in v.requests] == ["status", "pause", "resume", "status"]


def test_a_silent_vmm_times_out_and_the_connection_is_dropped(
        vmm: Callable[[Serve], ScriptedVMM]) -> None:
    answer = threading.Event()

    def serve(conn: socket.socket, reader: BinaryIO) -> None:
        v.read(reader)
        answer.wait(5)
        _send(conn, {"ok": True})    # late: must not be read as the next call's reply

    v = vmm(serve)
    with ControlClient.connect(v.path) as client:
        started = time.monotonic()
        with pytest.raises(ControlError) as exc:
            client.call(Pause(), timeout=0.3)
        assert exc.value.reason == ControlError.TIMEOUT and "'pause' within 0.3 s" in str(exc.value)
        assert 0.25 < time.monotonic() - started < 2
        answer.set()
        with pytest.raises(ControlError) as exc:
            client.call(Resume())
        assert exc.value.unreachable and "closed" in exc.value.message


def test_a_trickling_vmm_is_held_to_the_whole_deadline(
        vmm: Callable[[Serve], ScriptedVMM]) -> None:
    stop = threading.Event()

    def serve(conn: socket.socket, reader: BinaryIO) -> None:
        v.read(reader)
        conn.sendall(b'{"ok": true')
        while not stop.wait(0.05):     # a byte well within any per-read timeout
            conn.sendall(b" ")

    v = vmm(serve)
    try:
        with ControlClient.connect(v.path) as client:
            started = time.monotonic()
            with pytest.raises(ControlError) as exc:
                client.call(Pause(), timeout=0.5)
            assert exc.value.reason == ControlError.TIMEOUT
            assert time.monotonic() - started < 2
    finally:
        stop.set()


def test_a_vmm_that_closes_is_unreachable(vmm: Callable[[Serve], ScriptedVMM]) -> None:
    def serve(conn: socket.socket, reader: BinaryIO) -> None:
        v.read(reader)   # and closes without a word

    v = vmm(serve)
    with ControlClient.connect(v.path) as client, pytest.raises(ControlError) as exc:
        client.call(Status())
    assert exc.value.unreachable and "closed the control connection" in exc.value.message


def test_an_oversized_reply_is_refused_without_reading_it_all(
        vmm: Callable[[Serve], ScriptedVMM]) -> None:
    def serve(conn: socket.socket, reader: BinaryIO) -> None:
        v.read(reader)
        for _ in range(64):               # 4 MiB of one line, if anyone would read it
            conn.sendall(b" " * 65536)

    v = vmm(serve)
    with ControlClient.connect(v.path) as client, pytest.raises(ControlError) as exc:
        client.call(Status())
    assert exc.value.reason == ControlError.MALFORMED and "longer than" in exc.value.message


def test_a_malformed_reply_drops_the_connection(vmm: Callable[[Serve], ScriptedVMM]) -> None:
    def serve(conn: socket.socket, reader: BinaryIO) -> None:
        v.read(reader)
        _send(conn, b'{"ok": true, "paused": "maybe"}\n{"ok": true}\n')

    v = vmm(serve)
    with ControlClient.connect(v.path) as client:
        with pytest.raises(ControlError) as exc:
            client.call(Status())
        assert exc.value.reason == ControlError.MALFORMED
        with pytest.raises(ControlError) as exc:
            client.call(Pause())
        assert exc.value.unreachable


def _snapshot_vmm(progress: list[dict[str, Any] | bytes], final: dict[str, Any] | bytes,
                  delay: float = 0.0) -> Serve:
    def serve(conn: socket.socket, reader: BinaryIO) -> None:
        reader.readline()
        for line in progress:
            _send(conn, line)
        time.sleep(delay)
        _send(conn, final)
    return serve


def test_a_streamed_snapshot_reports_the_resume_then_the_reply(
        vmm: Callable[[Serve], ScriptedVMM]) -> None:
    v = vmm(_snapshot_vmm([Resumed({"pause_s": 0.004}).to_wire()], SNAPSHOT_REPLY.to_wire(),
                          delay=0.4))
    seen: list[Resumed] = []
    with ControlClient.connect(v.path) as client:
        # The pause must end within 0.2 s, the write may take longer.
        reply = client.snapshot(SNAPSHOT, on_resumed=seen.append, timeout=0.2,
                                write_timeout=5)
    assert reply == SNAPSHOT_REPLY and reply.pause_s == 0.004
    assert seen == [Resumed({"pause_s": 0.004})]
    with ControlClient.connect(v.path) as client:
        assert client.call(SNAPSHOT) == SNAPSHOT_REPLY   # call reads the progress and drops it


def test_a_streamed_snapshot_is_held_to_each_deadline(
        vmm: Callable[[Serve], ScriptedVMM]) -> None:
    v = vmm(_snapshot_vmm([], SNAPSHOT_REPLY.to_wire(), delay=1))
    with ControlClient.connect(v.path) as client, pytest.raises(ControlError) as exc:
        client.snapshot(SNAPSHOT, timeout=0.2)         # never said it resumed
    assert exc.value.reason == ControlError.TIMEOUT
    v = vmm(_snapshot_vmm([Resumed({"pause_s": 0.004}).to_wire()], SNAPSHOT_REPLY.to_wire(),
                          delay=1))
    with ControlClient.connect(v.path) as client, pytest.raises(ControlError) as exc:
        client.snapshot(SNAPSHOT, timeout=5, write_timeout=0.2)
    assert exc.value.reason == ControlError.TIMEOUT


@pytest.mark.parametrize(("progress", "expected"), [
    ([Resumed({"pause_s": 0.1}).to_wire()] * 2, "a second progress line"),
    ([{"ok": True, "stage": "halfway", "timings": {"pause_s": 0}}], "unknown progress stage"),
    ([{"ok": True, "stage": "resumed"}], "'timings' is missing"),
])
def test_a_hostile_snapshot_stream_is_a_control_error(
        vmm: Callable[[Serve], ScriptedVMM], progress: list[dict[str, Any]],
        expected: str) -> None:
    v = vmm(_snapshot_vmm(progress, SNAPSHOT_REPLY.to_wire()))
    with ControlClient.connect(v.path) as client, pytest.raises(ControlError) as exc:
        client.snapshot(SNAPSHOT, timeout=2)
    assert exc.value.reason == ControlError.MALFORMED and expected in exc.value.message


def test_a_callback_that_raises_drops_the_connection(
        vmm: Callable[[Serve], ScriptedVMM]) -> None:
    v = vmm(_snapshot_vmm([Resumed({"pause_s": 0.1}).to_wire()], SNAPSHOT_REPLY.to_wire()))

    def fail(_: Resumed) -> None:
        raise RuntimeError("the caller's own failure")

    with ControlClient.connect(v.path) as client:
        with pytest.raises(RuntimeError):
            client.snapshot(SNAPSHOT, on_resumed=fail, timeout=2)
        with pytest.raises(ControlError) as exc:
            client.call(Status())
        assert exc.value.unreachable


# -- what BRANCH makes of it --------------------------------------------------------------
def _branch_vmm(snapshot_answer: dict[str, Any] | bytes,
                status: dict[str, Any] | None = None) -> Serve:
    def serve(conn: socket.socket, reader: BinaryIO) -> None:
        reader.readline()
        _send(conn, status or StatusReply(paused=False, exit=None).to_wire())
        reader.readline()
        _send(conn, snapshot_answer)
    return serve


@pytest.mark.parametrize(("serve", "stage", "expected"), [
    (_branch_vmm({"ok": False, "error": "disk full"}), "capture",
     "could not snapshot: disk full"),
    (_branch_vmm({"ok": True, "mode": "full"}), "control", "malformed reply to 'snapshot'"),
    (_branch_vmm(b"\n", status={"ok": False, "error": "busy"}), "control",
     "refused 'status': busy"),
    (_branch_vmm(b"\n", status={"ok": True, "paused": 0}), "control",
     "malformed reply to 'status'"),
])
def test_a_branch_of_a_failing_vmm_publishes_nothing(
        vmm: Callable[[Serve], ScriptedVMM], tmp_path: Path, serve: Serve, stage: str,
        expected: str) -> None:
    store = Store.open(tmp_path / "home")
    v = vmm(serve)
    with pytest.raises(BranchFailed) as exc:
        branch_sandbox(store, v.path, "b1", "full")
    assert exc.value.stage == stage and expected in str(exc.value), str(exc.value)
    assert not store.exists("b1")
    with pytest.raises(BranchFailed) as exc:
        branch_sandbox(store, str(tmp_path / "gone.sock"), "b2", "full")
    assert exc.value.stage == "control" and "cannot reach" in str(exc.value)
    assert not store.exists("b2")
