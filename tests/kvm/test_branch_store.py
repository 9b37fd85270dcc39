"""BRANCH into the store through the VMM control socket, on tiny guests.

A tiny filler guest (see test_branch_tiny) is snapshotted into a store, restored
as a "sandbox" with its control server, and branched with ``branch_sandbox`` in
every mode, repeatedly and nested; every branch is restored and checked.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kvm.test_branch_tiny import (
    FILL_AT,
    MEM_MIB,
    PAGES,
    PATTERN_AT,
    _check_consistent,
    _page_values,
)
from tests.kvm.tinyguest import Script, script_machine, wait_until
from vmfork.ondisk.memplan import snapshot_memory
from vmfork.ondisk.stateformat import read_state_file, write_state_file
from vmfork.runtime import control
from vmfork.runtime.branch import BranchFailed, branch_into_pending, branch_sandbox
from vmfork.runtime.vmmchild import ControlServer, StopSignal
from vmfork.store import Snapshot, SnapshotMeta, Store, TagExists
from vmfork.vmm import dirty
from vmfork.vmm.machine import Machine, MachineConfig
from vmfork.vmm.vmstate import MachineState


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    # Ten branches of whole images per test: removed after each test, not at session
    # end (the emulated test host's /tmp is RAM).
    store = Store.open(tmp_path / "home")
    parent, _ = script_machine(Script().fill_pages_forever(FILL_AT, PAGES), memfd=True,
                               mem_mib=MEM_MIB)
    with parent, store.begin("base") as pending:
        parent.start()
        assert wait_until(lambda: parent.memory.read_u64(FILL_AT) > 50)
        state, _ = parent.snapshot(str(pending.memory_path), resume=False)
        write_state_file(str(pending.state_path), state)
        pending.publish(SnapshotMeta(tag="base", image="tiny", mem_mib=MEM_MIB, vcpus=1))
    yield store
    shutil.rmtree(tmp_path, ignore_errors=True)


class Sandbox:
    """A restored machine with its control server, as a VMM process would run it."""

    def __init__(self, snapshot: Snapshot, run_dir: Path, *, start: bool = True) -> None:
        run_dir.mkdir()
        state = read_state_file(str(snapshot.state_path), MachineState)
        memory_file, plan = snapshot_memory(str(snapshot.path))   # a diff: its memory plan
        self.machine = Machine(MachineConfig(restore_state=state, memory_file=memory_file,
                                             memory_plan=plan, mem_mib=MEM_MIB, rng=False,
                                             memfd=False))
        if start:
            self.machine.start()
        self.control_path = str(run_dir / "control.sock")
        self.stop = StopSignal()
        self.control = ControlServer(self.machine, self.control_path, self.stop)

    def counter(self) -> int:
        return self.machine.memory.read_u64(FILL_AT)

    def close(self) -> None:
        self.control.close()
        self.machine.close()
        self.stop.close()


@pytest.fixture
def sandbox(store: Store, tmp_path: Path) -> Iterator[Sandbox]:
    box = Sandbox(store.get("base"), tmp_path / "sandbox")
    yield box
    box.close()


def _check_spawnable(snapshot: Snapshot, tmp_path: Path) -> int:
    child = Sandbox(snapshot, tmp_path / f"child-{snapshot.tag}", start=False)
    try:
        # Read before the child runs: its guest rewrites the pages at once.
        captured = _check_consistent(_page_values(child.machine.memory.read_u64))
        child.machine.start()
        assert wait_until(lambda: child.counter() > captured + 20)
    finally:
        child.close()
    return captured


@pytest.mark.parametrize("mode", ["full", "diff", "live"])
def test_ten_branches_of_one_sandbox(mode: str, store: Store, sandbox: Sandbox,
                                     tmp_path: Path) -> None:
    last = 0
    for n in range(10):
        result = branch_sandbox(store, sandbox.control_path, f"{mode}-{n}", mode,
                                sandbox_id="sb-1").result()
        snap = result.snapshot
        assert store.get(snap.tag).meta.branch_mode == mode
        assert snap.meta.branched_from == "sb-1" and snap.meta.branched_from_tag == "base"
        assert result.pause_ms > 0 and result.total_ms >= result.pause_ms
        if mode == "diff":
            expected_parent = (f"diff-{n - 1}" if n and dirty.soft_dirty_supported()
                               else "base")
            assert snap.meta.parent_tag == expected_parent
            assert snap.layer_path is not None and snap.layer_path.is_file()
            assert snap.meta.memory_layers[-1].tag == snap.tag
            assert snap.meta.content_hash and snap.meta.root_tag == "base"
            assert result.dirty_pages is not None and result.dirty_pages < 2048
        else:
            assert snap.meta.parent_tag is None and snap.layer_path is None
        if n in (0, 1, 9):
            captured = _check_spawnable(snap, tmp_path)
            assert captured > last
            last = captured
        at = sandbox.counter()
        assert wait_until(lambda at=at: sandbox.counter() > at + 20)   # the source runs on


def test_a_diff_of_a_sandbox_restored_from_a_diff(store: Store, sandbox: Sandbox,
                                                  tmp_path: Path) -> None:
    first = branch_sandbox(store, sandbox.control_path, "link1", "diff").result().snapshot
    nested = Sandbox(first, tmp_path / "nested")
    try:
        at = nested.counter()
        assert wait_until(lambda: nested.counter() > at + 20)
        second = branch_sandbox(store, nested.control_path, "link2", "diff").result()
    finally:
        nested.close()
    meta = second.snapshot.meta
    assert meta.parent_tag == "link1" and meta.root_tag == "base"
    assert [layer.tag for layer in meta.memory_layers] == ["link1", "link2"]
    assert meta.parent_content_hash == first.meta.content_hash
    assert _check_spawnable(second.snapshot, tmp_path) > at


def test_wait_false_returns_once_the_source_runs_again(store: Store, sandbox: Sandbox,
                                                       tmp_path: Path) -> None:
    job = branch_sandbox(store, sandbox.control_path, "later", "live", wait=False)
    assert job.pause_ms is not None
    result = job.result(timeout=120)
    assert job.done() and result.snapshot.tag == "later"
    _check_spawnable(result.snapshot, tmp_path)


def test_failures_publish_nothing(store: Store, sandbox: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(TagExists):
        branch_sandbox(store, sandbox.control_path, "base", "full")
    with pytest.raises(BranchFailed, match="cannot diff against 'nowhere'") as failed:
        branch_sandbox(store, sandbox.control_path, "bad-parent", "diff", parent_tag="nowhere")
    assert failed.value.stage == "base"
    with pytest.raises(BranchFailed, match="cannot reach"):
        branch_sandbox(store, str(tmp_path / "no.sock"), "no-vmm", "live")
    with pytest.raises(ValueError, match="mode must be one of"):
        branch_sandbox(store, sandbox.control_path, "bad-mode", "partial")
    assert [s.tag for s in store.list()] == ["base"]
    assert not [p for p in os.listdir(store.snapshots_dir) if p.startswith(".")]
    # The source was untouched and can still branch under the failed tags.
    at = sandbox.counter()
    assert wait_until(lambda: sandbox.counter() > at + 20)
    assert branch_sandbox(store, sandbox.control_path, "no-vmm", "live").result()


def test_a_diff_whose_write_fails_after_the_resume_publishes_nothing(
        store: Store, sandbox: Sandbox, tmp_path: Path) -> None:
    """A diff's layer is written by the forked writer once the source runs again; when
    that write fails (here: the file-size limit the writer inherits) the branch fails,
    the pending snapshot is discarded, no writer or descriptor is left, the source runs
    on, and the next diff is based on what is still valid."""
    first = branch_sandbox(store, sandbox.control_path, "d1", "diff").result()
    marker = os.urandom(1 << 20)
    sandbox.machine.memory.write(PATTERN_AT, marker)     # 1 MiB changed since "d1"
    fds = len(os.listdir("/proc/self/fd"))
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, old[1]))
    try:
        job = branch_sandbox(store, sandbox.control_path, "d2", "diff", wait=False)
        assert job.pause_ms is not None          # the source resumed before the failure
        with pytest.raises(BranchFailed, match="snapshot writer failed.*File too large"):
            job.result(timeout=120)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(s.tag for s in store.list()) == ["base", "d1"]
    assert not [p for p in os.listdir(store.snapshots_dir) if p.startswith(".")]
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        assert f.read().split() == []
    # The in-process control server closes its end of the branch's connection on its own
    # thread once the client has gone, which may be just after the client's last reply.
    assert wait_until(lambda: len(os.listdir("/proc/self/fd")) == fds), \
        (len(os.listdir("/proc/self/fd")), fds)
    at = sandbox.counter()
    assert wait_until(lambda: sandbox.counter() > at + 20)
    # The soft-dirty bits were cleared for "d2", which does not exist: "d1" can no longer
    # be a base, and the next diff is taken against the restore base.
    third = branch_sandbox(store, sandbox.control_path, "d3", "diff").result()
    assert third.base_tag == "base" and first.snapshot.tag == "d1"
    child = Sandbox(third.snapshot, tmp_path / "child-d3-marker", start=False)
    try:
        assert child.machine.memory.read(PATTERN_AT, len(marker)) == marker
    finally:
        child.close()
    _check_spawnable(third.snapshot, tmp_path)


def test_the_op_refuses_fields_of_another_contract(sandbox: Sandbox, tmp_path: Path) -> None:
    request = {"op": "snapshot", "mode": "diff", "memory_path": str(tmp_path / "m"),
               "state_path": str(tmp_path / "s"), "parent_memory_path": "/elsewhere"}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(sandbox.control_path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        reply = json.loads(sock.makefile("rb").readline())
    assert not reply["ok"] and "parent_memory_path" in reply["error"]
    assert not (tmp_path / "m").exists() and not (tmp_path / "s").exists()


def test_every_op_through_the_one_client(sandbox: Sandbox, tmp_path: Path) -> None:
    """The real control server and ``runtime.control``'s client agree on every op."""
    with control.ControlClient.connect(sandbox.control_path) as client:
        status = client.call(control.Status())
        assert not status.paused and status.exit is None and not status.jailed
        assert control.SnapshotBase("base", "restore") in status.snapshot_bases
        assert status.snapshot_tracking in ("soft-dirty", "restore-base-only")
        assert client.call(control.Pause()) == control.Ack()
        assert client.call(control.Status()).paused
        at = sandbox.counter()
        time.sleep(0.2)
        assert sandbox.counter() == at           # paused: the guest's counter stands
        assert client.call(control.Resume()) == control.Ack()
        assert wait_until(lambda: sandbox.counter() > at + 20)
        assert client.call(control.Exits()).profile["by_reason"]
        same = str(tmp_path / "same")
        with pytest.raises(control.ControlError, match="must differ") as refused:
            client.call(control.Snapshot(memory_path=same, state_path=same))
        assert refused.value.refused
        seen: list[control.Resumed] = []
        live = control.Snapshot(memory_path=str(tmp_path / "m"),
                                state_path=str(tmp_path / "s"), mode="live", progress=True)
        reply = client.snapshot(live, on_resumed=seen.append)
        assert reply.memory_format == "image" and reply.memory_bytes > 0
        assert [r.pause_s for r in seen] == [reply.pause_s]
        assert client.call(control.Stop()) == control.Ack()
        assert sandbox.control.on_stop.is_set()


def test_a_request_line_without_end_is_refused_and_dropped(sandbox: Sandbox) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(sandbox.control_path)
        # One byte over: all of it is read before the server drops the connection (a
        # close with bytes unread would reset it, and the reply could be lost).
        sock.sendall(b" " * (control.MAX_LINE_BYTES + 1))
        reader = sock.makefile("rb")
        reply = json.loads(reader.readline())
        assert not reply["ok"] and "longer than" in reply["error"]
        assert reader.readline() == b""          # and the connection is closed
    with control.ControlClient.connect(sandbox.control_path) as client:
        assert not client.call(control.Status()).paused  # others are served as before


def test_a_caller_that_claimed_the_tag_itself(store: Store, sandbox: Sandbox) -> None:
    pauses: list[float] = []
    with store.begin("claimed") as pending:
        result = branch_into_pending(store, pending, sandbox.control_path, "diff",
                                     parent_tag="base", on_resumed=pauses.append)
    assert result.snapshot.tag == "claimed" and store.get("claimed").meta.parent_tag == "base"
    assert pauses == [result.pause_ms]
    with pytest.raises(BranchFailed), store.begin("refused") as pending:
        branch_into_pending(store, pending, sandbox.control_path, "diff", parent_tag="nowhere")
    assert not store.exists("refused")


# -- an idle sandbox waits without waking (runtime.vmmchild) ----------------------------------
def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("voluntary_ctxt_switches"))


def test_an_idle_control_thread_does_not_wake(sandbox: Sandbox) -> None:
    # An idle VMM that wakes runs Python, and every page that touches becomes the
    # child's own: the control thread blocks until a request or its close.
    with control.ControlClient.connect(sandbox.control_path) as client:
        assert isinstance(client.call(control.Status()), control.StatusReply)
    tid = sandbox.control.thread_id     # the native control thread's
    assert tid > 0
    time.sleep(0.1)
    before = _voluntary_switches(tid)
    time.sleep(1.2)
    assert _voluntary_switches(tid) == before
    sandbox.control.close()
    assert not sandbox.control.serving


def test_the_exit_fd_is_readable_once_the_machine_ends(sandbox: Sandbox) -> None:
    fd = sandbox.machine.exit_fd()
    assert sandbox.machine.exit_fd() == fd   # one pipe, however often asked
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(100) == []
    sandbox.machine.stop()
    assert poller.poll(5000) == [(fd, select.POLLIN)]
    assert poller.poll(0) == [(fd, select.POLLIN)]   # and stays readable
