"""The native fork (``_core.fork_native_batch``, native/src/native_fork.rs): a child forked by
a one-thread process runs its set-up, a real tiny machine on this host's KVM and its
whole life natively, answers a real agent and the control socket, runs Python only
for a handed-over line, and exits with the life's status; a zygote forks a spawn its
entry module's hook refuses as a Python child that says why.

The forking process is a subprocess (the fork needs a process of one thread; the
real agent serves from a thread of this one)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vmfork
from tests.forker_support import spare_of
from tests.unit.agent_support import Agent, running_agent
from vmfork.runtime import memphases, spawnprofile, vmmchild, zygote, zygote_child
from vmfork.runtime.zygote_client import start_zygote
from vmfork.runtime.zygote_protocol import SpawnItem
from vmfork.vmm.native import CORE_BUILT

needs_kvm = pytest.mark.skipif(
    not CORE_BUILT or not os.access("/dev/kvm", os.R_OK | os.W_OK),
    reason="needs the native core and /dev/kvm")

# Real mode: wait for the TSC's high half to pass its value at start + 3 (some
# seconds, however fast the CPU runs the loop), then pulse the i8042's reset line.
#   rdtsc; mov ebx, edx; add ebx, 3
#   1: rdtsc; cmp edx, ebx; jb 1b
#   mov al, 0xfe; out 0x64, al; hlt
RESET_AFTER_SECONDS = bytes.fromhex("0f31" "6689d3" "6683c303" "0f31" "6639da" "72f9"
                                    "b0fe" "e664" "f4")
# Real mode, interrupts off: hlt; jmp back to it. Runs until the child is stopped.
HALT_FOREVER = bytes.fromhex("f4" "ebfd")

# The forking process: one thread, the zygote's calls; its child runs under the VMM's
# seccomp filter from before its guest starts, as a jailed one does. Its ``answer`` is
# the hand-over handler named in the plan ("__main__:answer"); the at-fork hook it
# registers runs only in a child that ran ``PyOS_AfterFork_Child``.
FORKER = """
import json, os, sys
from vmfork import _core
from vmfork.runtime import control, jail, seccomp

cfg = json.loads(sys.argv[1])
after_fork_hooks = []
os.register_at_fork(after_in_child=lambda: after_fork_hooks.append(os.getpid()))

def answer(line, fd):
    request = control.parse_request(line)
    return control.encode(control.ExitsReply(profile={
        "op": type(request).__name__, "pid": os.getpid(),
        "after_fork_hooks": after_fork_hooks}))

plan = _core.ChildPlan(error=jail.JailError, set_up=(os.getpid(), None, [], cfg["log"], 0))
life = _core.ChildLife(
    run_dir=cfg["run_dir"], vm_id="vm1", notify_path=None, start_gate=cfg["gate"],
    start_gate_timeout=60.0, seccomp=seccomp.vmm_filter(), jailed=False,
    agent=_core.AgentTarget(cfg["agent"], None, 5.0, 30.0), ready_timeout=60.0,
    net_refresh=False, profile=cfg.get("profile", False))
machine = _core.TinyMachinePlan(bytes.fromhex(cfg["code"]))
(pid,), error = _core.fork_native_batch(
    [_core.NativeFork(plan, life, machine, "__main__:answer")])
assert error is None, error
print(pid, flush=True)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

# A batch forker: one child for each of ``cfg["namespaces"]`` (its ``own_pid_namespace``),
# each parked at its start gate; it prints the batch's pids and error, then each
# child's wait status once the test has killed it.
BATCH_FORKER = """
import json, os, sys
from vmfork import _core
from vmfork.runtime import jail

cfg = json.loads(sys.argv[1])
forks = []
for i, own_pid_namespace in enumerate(cfg["namespaces"]):
    run_dir = os.path.join(cfg["root"], f"vm{i}")
    os.mkdir(run_dir)
    pidfd = os.pidfd_open(os.getpid()) if own_pid_namespace is not None else None
    plan = _core.ChildPlan(error=jail.JailError, set_up=(os.getpid(), pidfd, [], None, 0))
    life = _core.ChildLife(
        run_dir=run_dir, vm_id=f"vm{i}", notify_path=None, start_gate=cfg["gate"],
        start_gate_timeout=60.0, seccomp=None, jailed=False,
        agent=_core.AgentTarget(cfg["agent"], None, 5.0, 30.0), ready_timeout=60.0,
        net_refresh=False)
    machine = _core.TinyMachinePlan(bytes.fromhex(cfg["code"]))
    forks.append(_core.NativeFork(plan, life, machine, "json:dumps", None, own_pid_namespace))
pids, error = _core.fork_native_batch(forks)
print(json.dumps({"pids": pids, "errno": getattr(error, "errno", None)}), flush=True)
for pid in pids:
    print(os.waitpid(pid, 0)[1], flush=True)
"""


@pytest.fixture
def agent() -> Iterator[Agent]:
    with running_agent() as a:
        yield a


def _status(run_dir: Path, state: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            status: dict[str, Any] = json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
        if status.get("state") == state:
            return status
        assert time.monotonic() < deadline, f"no {state!r} report; last: {status}"
        time.sleep(0.01)


def _ask(sock: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
    sock.sendall(json.dumps(request).encode() + b"\n")
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = sock.recv(65536)
        assert chunk, "the control socket closed"
        reply += chunk
    answer: dict[str, Any] = json.loads(reply)
    return answer


def _forker(cfg: dict[str, Any]) -> subprocess.Popen[str]:
    """The forking process of ``cfg``; it prints the child's pid, then its exit status."""
    package_root = str(Path(vmfork.__file__).parent.parent)
    return subprocess.Popen([sys.executable, "-c", FORKER, json.dumps(cfg)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": package_root})


def _assert_phases_recorded(run_dir: Path) -> None:
    """The child's ``spawn-profile.json`` (written after its ready report): the Python
    child's phases, in the Python child's order, each ending after the one before."""
    deadline = time.monotonic() + 30
    while not (run_dir / spawnprofile.PROFILE_FILE).exists():
        assert time.monotonic() < deadline, "no spawn-profile.json"
        time.sleep(0.01)
    marks = json.loads((run_dir / spawnprofile.PROFILE_FILE).read_text())["marks"]
    assert [m["phase"] for m in marks] == [
        "fork", "forked", "set_up", "machine", "seccomp", "vcpu_start", "prepared_report",
        "start_gate", "resumed", "restored_report", "control_server", "agent_answered",
        "ready_report", "finished"]
    phases = spawnprofile.phases(marks)
    assert all(float(p["wall_s"]) >= 0 for p in phases), phases
    assert float(marks[-1]["thread_cpu_ns"]) > 0, marks


def _mappings(pid: int) -> list[memphases.Mapping]:
    with memphases.read_smaps(pid) as smaps:
        return memphases.mappings(smaps, memphases.no_guest_ram)


def _count(mappings: list[memphases.Mapping], cls: str) -> int:
    return sum(m.cls == cls for m in mappings)


@needs_kvm
def test_a_natively_forked_child_lives_answers_and_hands_a_line_to_python(
        agent: Agent, tmp_path: Path) -> None:
    run_dir = Path(agent.root) / "run"   # short: AF_UNIX paths
    run_dir.mkdir()
    gate = run_dir / "gate"
    os.mkfifo(gate)
    gate_fd = os.open(gate, os.O_RDWR | os.O_NONBLOCK)   # the spawner's end
    cfg = {"run_dir": str(run_dir), "gate": str(gate), "agent": agent.sock_path,
           "log": str(tmp_path / "child.log"), "code": RESET_AFTER_SECONDS.hex(),
           "profile": True}
    forker = _forker(cfg)
    try:
        assert forker.stdout is not None
        pid = int(forker.stdout.readline())
        assert _status(run_dir, "prepared")["pid"] == pid
        os.write(gate_fd, b"x")
        ready = _status(run_dir, "ready")
        assert ready["pid"] == pid
        for key in ("restore_s", "start_wait_s", "fork_to_entry_s", "ready_s",
                    "agent_ready", "clock_error_bound_s", "agent_connected",
                    "agent_first_frame", "agent_call"):
            assert isinstance(ready[key], float) and ready[key] >= 0, (key, ready)
        assert ready["agent_connected"] <= ready["agent_first_frame"] <= ready["agent_call"]
        assert ready["agent_retries"] == 0
        _assert_phases_recorded(run_dir)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
            control.settimeout(30)
            control.connect(str(run_dir / "control.sock"))
            # Served natively: not the hand-over handler's answer.
            exits = _ask(control, {"op": "exits"})
            assert exits["ok"] and "profile" in exits and "op" not in exits["profile"], exits
            handed = _ask(control, {"op": "snapshot", "memory_path": "m", "state_path": "s"})
            assert handed == {"ok": True, "profile": {
                "op": "Snapshot", "pid": pid, "after_fork_hooks": [pid]}}, handed
            assert _ask(control, {"op": "status"})["paused"] is False
        assert Path(f"/proc/{pid}/status").read_text().count("Seccomp:\t2") == 1
        exited = _status(run_dir, "exited")
        assert (exited["reason"], exited["panicked"]) == ("reset", False), exited
        assert int(forker.stdout.readline()) == 0, "a clean end exits 0"
    finally:
        os.close(gate_fd)
        forker.kill()
        forker.wait()


@needs_kvm
def test_a_native_child_allocates_from_a_heap_of_its_own(
        agent: Agent, tmp_path: Path) -> None:
    """glibc gives each thread that allocates an arena of its own, whose pages it then
    dirties: the child's vCPU, control and handshake threads (each allocates) make
    none, so its arenas are the forker's. Its Rust allocations, on every thread, come
    from a mapping of its own (``child_heap.rs``), written densely, not from the
    forker's free lists scattered over the heap it inherited."""
    run_dir = Path(agent.root) / "run"
    run_dir.mkdir()
    cfg = {"run_dir": str(run_dir), "gate": None, "agent": agent.sock_path,
           "log": str(tmp_path / "child.log"), "code": HALT_FOREVER.hex()}
    forker = _forker(cfg)
    try:
        assert forker.stdout is not None
        pid = int(forker.stdout.readline())
        _status(run_dir, "ready")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
            control.settimeout(30)
            control.connect(str(run_dir / "control.sock"))
            assert _ask(control, {"op": "status"})["paused"] is False
        assert len(os.listdir(f"/proc/{pid}/task")) >= 3   # main, vCPU, control
        child, parent = _mappings(pid), _mappings(forker.pid)
        assert _count(child, "malloc_arenas") == _count(parent, "malloc_arenas")
        heaps = [m for m in child if m.cls == "child_heap"]
        assert len(heaps) == 1 and heaps[0].private_dirty_kib > 0, heaps
        assert _count(parent, "child_heap") == 0
        assert not (run_dir / spawnprofile.PROFILE_FILE).exists(), "no record unless asked"
        os.kill(pid, signal.SIGTERM)
        assert int(forker.stdout.readline()) == 0, "a SIGTERM ends the child with 0"
    finally:
        forker.kill()
        forker.wait()


def test_the_knob_is_on_by_default_and_a_snapshot_with_no_native_machine_falls_back(
        tmp_path: Path) -> None:
    assert zygote_child.NATIVE_CHILD is (os.environ.get("VMFORK_NATIVE_CHILD") != "0")
    # The format-1 golden snapshot, networked, its unjailed child given a tap whose name
    # is no interface's (a jailed child's spec is refused before, by jail.plan).
    snapshot_dir = tmp_path / "snapshot"
    snapshot_dir.mkdir()
    shutil.copy(Path(__file__).parent / "golden" / "state-v1.bin", snapshot_dir / "state.bin")
    (snapshot_dir / "memory.bin").write_bytes(b"")
    prep = zygote._Prepared("vm1", {"vm_id": "vm1", "run_dir": str(tmp_path),
                                    "snapshot_dir": str(snapshot_dir), "netns": "vmft-1",
                                    "net_tap": "tap/0"}, None, None, str(tmp_path))
    # vmmchild's hook refuses a machine it cannot build natively, naming the device:
    # the spawn gets a Python child, told why (never a silent one).
    assert zygote.Zygote._native_child(vmmchild.native_child, prep) is None
    assert prep.args[zygote_child.NATIVE_REFUSED] == (
        "ValueError: net_tap 'tap/0' is not a Linux interface name")


def test_a_batch_looks_its_snapshot_up_once_and_the_next_batch_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot_dir = tmp_path / "snapshot"
    snapshot_dir.mkdir()
    shutil.copy(Path(__file__).parent / "golden" / "state-v1.bin", snapshot_dir / "state.bin")
    (snapshot_dir / "memory.bin").write_bytes(b"")
    args = {"vm_id": "vm1", "run_dir": str(tmp_path / "vm1"), "snapshot_dir": str(snapshot_dir)}
    vmmchild.prefork([args])   # its warm-up fails on the empty memory file: logged
    assert str(snapshot_dir) in vmmchild._batch_snapshots
    # Its children take what the batch's prefork looked up, checking no file again.
    def looked_up_again(snapshot_dir: str) -> None:
        raise AssertionError(f"{snapshot_dir} looked up again for a child of its batch")
    monkeypatch.setattr(vmmchild, "_native_snapshot", looked_up_again)
    native = vmmchild.native_child(dict(args), None)
    assert native is not None
    monkeypatch.undo()
    # The next batch's prefork replaces them: a snapshot it does not name is gone, and
    # one that no longer loads is not kept; its child looks again, and is refused why.
    (snapshot_dir / "state.bin").write_bytes(b"not a state file")
    vmmchild.prefork([args])
    assert str(snapshot_dir) not in vmmchild._batch_snapshots
    with pytest.raises(Exception, match="state"):
        vmmchild.native_child(dict(args), None)


@needs_kvm
def test_a_spawn_the_hook_refuses_runs_in_a_python_child_that_says_why(
        tmp_path: Path) -> None:
    """A batch of three whose middle spawn the entry module's hook refuses: the first
    and the last are native children (a native batch each side), the middle one a
    Python child that its args tell why; a single spawn refused is one too."""
    env = {k: v for k, v in os.environ.items() if k != zygote_child.NATIVE_CHILD_ENV}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    z = start_zygote(tmp_path / "z.sock", env=env,
                     entries_modules=["test_zygote_native_entries"])
    entry = "test_zygote_native_entries:python_child"
    runs = tmp_path / "runs"

    def item(vm_id: str, **args: str) -> SpawnItem:
        return SpawnItem(vm_id, {"vm_id": vm_id, "run_dir": str(runs / vm_id),
                                 "out": str(tmp_path / f"{vm_id}.json"), **args})

    try:
        with z.client() as client:
            result = client.spawn_many(entry, [item("vm0"), item("vm1", refuse="asked to"),
                                               item("vm2")])
            assert result.failed == []
            assert [c.vm_id for c in result.children] == ["vm0", "vm1", "vm2"]
            single = client.spawn(entry, item("vm3", refuse="once more").args, vm_id="vm3")
            for vm_id in ("vm0", "vm2"):
                assert _status(runs / vm_id, "restored")["child"] == "native"
                assert not (tmp_path / f"{vm_id}.json").exists()
            for vm_id, why, pid in (("vm1", "asked to", result.children[1].pid),
                                    ("vm3", "once more", single.pid)):
                out = tmp_path / f"{vm_id}.json"
                _until_exists(out)
                assert json.loads(out.read_text()) == {
                    "pid": pid, zygote_child.NATIVE_REFUSED: f"ValueError: {why}"}
            for vm_id in ("vm0", "vm1", "vm2", "vm3"):
                client.kill(vm_id)
                assert client.wait(vm_id).reason == "killed"
    finally:
        z.close()


def _until_exists(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.01)


def test_the_default_hand_over_parses_as_the_control_server_does() -> None:
    # A snapshot needs a native child's machine: this process runs none.
    snapshot = json.loads(vmmchild.native_handover(
        b'{"op": "snapshot", "memory_path": "m", "state_path": "s"}', -1))
    assert snapshot == {"ok": False, "error": "this process runs no native child's machine"}
    # A malformed line gets control.parse_request's words, as ControlServer.handle_line's.
    malformed = b'{"op": "exits", "x": 1}'
    assert (vmmchild.native_handover(malformed, -1)
            == vmmchild.handover_reply(malformed, lambda request: pytest.fail("dispatched")))


@needs_kvm
@pytest.mark.skipif(os.geteuid() != 0, reason="a new PID namespace needs CAP_SYS_ADMIN")
def test_a_batch_stopped_by_a_failure_returns_the_children_it_forked(
        agent: Agent) -> None:
    """The second child of three is forked into a PID namespace of its own (it is pid 1
    there), and the forker's return to its own fails (a descriptor that is not open):
    the batch stops there, with both forked children in its pids and the third never
    forked."""
    root = Path(agent.root)
    gate = root / "gate"
    os.mkfifo(gate)
    gate_fd = os.open(gate, os.O_RDWR | os.O_NONBLOCK)   # open, never written: all park
    not_open = 1000
    cfg = {"root": str(root), "gate": str(gate), "agent": agent.sock_path,
           "code": HALT_FOREVER.hex(), "namespaces": [None, not_open, None]}
    package_root = str(Path(vmfork.__file__).parent.parent)
    forker = subprocess.Popen([sys.executable, "-c", BATCH_FORKER, json.dumps(cfg)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": package_root})
    try:
        assert forker.stdout is not None
        batch = json.loads(forker.stdout.readline())
        assert batch["errno"] == errno.EBADF, batch
        first, second = batch["pids"]
        assert _status(root / "vm0", "prepared")["pid"] == first
        assert _status(root / "vm1", "prepared")["pid"] == 1   # its namespace's first
        assert os.readlink(f"/proc/{second}/ns/pid") != os.readlink(f"/proc/{first}/ns/pid")
        assert not (root / "vm2" / "status.json").exists()
        for pid in (first, second):
            os.kill(pid, signal.SIGKILL)
            assert os.WTERMSIG(int(forker.stdout.readline())) == signal.SIGKILL
    finally:
        os.close(gate_fd)
        forker.kill()
        forker.wait()


def _children_of(pid: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def _forker_zygote(tmp_path: Path, spare: str) -> tuple[Any, Path]:
    """A zygote of the tiny-machine entries with its forker on (``VMFORK_FORKER_SPARE``
    ``spare``), and a short directory for its children's runs (AF_UNIX paths)."""
    env = {k: v for k, v in os.environ.items()
           if k not in (zygote_child.NATIVE_CHILD_ENV, "VMFORK_FORKER")}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    env["VMFORK_FORKER_SPARE"] = spare
    z = start_zygote(tmp_path / "z.sock", env=env,
                     entries_modules=["test_zygote_native_entries"])
    return z, Path(tempfile.mkdtemp(prefix="vmfork-forker-"))


@needs_kvm
def test_a_forker_forks_the_zygotes_native_children_from_their_recipes(
        tmp_path: Path) -> None:
    """By default the zygote clones a forker and sends it each native
    batch as plain values (runtime/forker.py, native/src/forker.rs): the children are
    the zygote's own (it reaps them), run natively, and hand a line over to Python
    after their named prelude ran; the next batch goes to the same forker, which the
    zygote's shutdown reaps with everything else."""
    z, runs = _forker_zygote(tmp_path, "0")   # no spare: the children counted are forked
    entry = "test_zygote_native_entries:python_child"

    def item(vm_id: str) -> SpawnItem:
        return SpawnItem(vm_id, {"vm_id": vm_id, "run_dir": str(runs / vm_id),
                                 "out": str(tmp_path / f"{vm_id}.json")})

    try:
        with z.client() as client:
            first = client.spawn_many(entry, [item("vm0"), item("vm1")])
            assert first.failed == []
            forkers = _children_of(z.pid) - {c.pid for c in first.children}
            assert len(forkers) == 1, forkers
            assert {client.ping()["forker"]["pid"]} == forkers
            second = client.spawn(entry, item("vm2").args, vm_id="vm2")
            assert _children_of(z.pid) - {c.pid for c in first.children} - {second.pid} \
                == forkers, "the second batch went to the same forker"
            for child in [*first.children, second]:
                status = _status(runs / child.vm_id, "restored")
                assert status["child"] == "native" and status["pid"] == child.pid
                assert int(Path(f"/proc/{child.pid}/stat").read_text().split()[3]) == z.pid
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
                control.settimeout(30)
                control.connect(str(runs / "vm1" / "control.sock"))
                handed = _ask(control, {"op": "snapshot", "memory_path": "m",
                                        "state_path": "s"})
            assert handed["profile"]["pid"] == first.children[1].pid
            assert handed["profile"]["noted"] == ["vm1"], handed
            # A forker killed between two batches: the next one clones another.
            (forker,) = forkers
            os.kill(forker, signal.SIGKILL)
            third = client.spawn(entry, item("vm3").args, vm_id="vm3")
            assert _status(runs / "vm3", "restored")["child"] == "native"
            replaced = client.ping()["forker"]["pid"]
            assert replaced != forker and replaced in _children_of(z.pid)
            assert not Path(f"/proc/{forker}").exists(), "the dead forker was reaped"
            assert third.pid in _children_of(z.pid)
            for vm_id in ("vm0", "vm1", "vm2", "vm3"):
                client.kill(vm_id)
                assert client.wait(vm_id).reason == "killed"
            assert _children_of(z.pid) == {replaced}
    finally:
        z.close()
        shutil.rmtree(runs, ignore_errors=True)
    assert z.proc.returncode == 0


def _wait_gone_or_zombie(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        assert time.monotonic() < deadline, f"{pid} still {state}"
        time.sleep(0.05)


@needs_kvm
def test_a_forkers_spare_becomes_the_next_lone_child(tmp_path: Path) -> None:
    """After a lone batch, once its channel was quiet, the forker forks a spare
    (native/src/forker_spare.rs), a child of the zygote's that it does not know yet;
    the next lone spawn is that process: the pid the zygote is told, a native child
    that restores, runs its prelude and hands a line over. A forker killed and
    replaced leaves no descriptor behind. A batch of two is forked, leaving the spare
    waiting; a lone batch the spare cannot build ends it, and is
    forked and refused as without one; retiring the forker (the zygote's shutdown)
    reaps what is left."""
    z, runs = _forker_zygote(tmp_path, "0.2")
    entry = "test_zygote_native_entries:python_child"

    def args(vm_id: str) -> dict[str, Any]:
        return {"vm_id": vm_id, "run_dir": str(runs / vm_id)}

    spare = -1
    try:
        with z.client() as client:
            client.spawn(entry, args("vm0"), vm_id="vm0")
            spare = spare_of(z, client=client)
            lone = client.spawn(entry, args("vm1"), vm_id="vm1")
            assert lone.pid == spare, "the lone spawn is the spare"
            status = _status(runs / "vm1", "restored")
            assert status["child"] == "native" and status["pid"] == spare
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
                control.settimeout(30)
                control.connect(str(runs / "vm1" / "control.sock"))
                handed = _ask(control, {"op": "snapshot", "memory_path": "m",
                                        "state_path": "s"})
            assert handed["profile"]["pid"] == spare
            assert handed["profile"]["noted"] == ["vm1"], "its prelude ran, once"
            spare = spare_of(z, client=client)
            # A forker that dies leaves nothing open in the table it shared: the next
            # one, with its own spare, holds as many of the zygote's descriptors.
            held = len(os.listdir(f"/proc/{z.pid}/fd"))
            os.kill(client.ping()["forker"]["pid"], signal.SIGKILL)
            client.spawn(entry, args("vm5"), vm_id="vm5")
            client.kill("vm5")
            assert client.wait("vm5").reason == "killed"
            _wait_gone_or_zombie(spare)
            spare = spare_of(z, client=client)
            assert len(os.listdir(f"/proc/{z.pid}/fd")) == held
            pair = client.spawn_many(entry, [SpawnItem("vm2", args("vm2")),
                                             SpawnItem("vm3", args("vm3"))])
            assert pair.failed == [] and spare not in {c.pid for c in pair.children}
            for child in pair.children:
                assert _status(runs / child.vm_id, "restored")["child"] == "native"
            assert spare in _children_of(z.pid), "a batch of two leaves the spare waiting"
            # A recipe the spare cannot build: the spare is killed and the child forked,
            # whose build refuses the batch, saying why, as with no spare.
            bad = client.spawn_many(entry, [SpawnItem("vm4", {**args("vm4"),
                                                               "bad_recipe": True})])
            assert [vm for vm, _ in bad.failed] == ["vm4"] and not bad.children, bad
            assert "hex" in bad.failed[0][1], bad.failed
            _wait_gone_or_zombie(spare)
            for vm_id in ("vm0", "vm1", "vm2", "vm3"):
                client.kill(vm_id)
                assert client.wait(vm_id).reason == "killed"
    finally:
        z.close()
        shutil.rmtree(runs, ignore_errors=True)
    assert z.proc.returncode == 0
    assert not Path(f"/proc/{spare}").exists(), "the spare was reaped"


@needs_kvm
def test_with_no_forker_the_zygote_forks_its_native_children_itself(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != zygote_child.NATIVE_CHILD_ENV}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    env["VMFORK_FORKER"] = "0"
    z = start_zygote(tmp_path / "z.sock", env=env,
                     entries_modules=["test_zygote_native_entries"])
    runs = Path(tempfile.mkdtemp(prefix="vmfork-forker-"))
    try:
        with z.client() as client:
            child = client.spawn("test_zygote_native_entries:python_child",
                                 {"vm_id": "vm0", "run_dir": str(runs / "vm0")}, vm_id="vm0")
            assert _status(runs / "vm0", "restored")["child"] == "native"
            assert client.ping()["forker"] is None
            assert _children_of(z.pid) == {child.pid}
            client.kill("vm0")
            assert client.wait("vm0").reason == "killed"
    finally:
        z.close()
        shutil.rmtree(runs, ignore_errors=True)


@needs_kvm
def test_a_new_forker_is_cloned_for_a_batch_like_the_one_before(tmp_path: Path) -> None:
    """A batch the forker cannot serve (here: the entry module's image key changed) is
    forked by the zygote itself the first time, and a new forker is cloned only when
    the next batch is like it: batches taking turns between two images clone none."""
    z, runs = _forker_zygote(tmp_path, "0")
    try:
        with z.client() as client:
            forkers: list[int | None] = []
            for n, image in enumerate([1, 2, 1, 2, 2, 2]):
                vm_id = f"vm{n}"
                child = client.spawn("test_zygote_native_entries:python_child",
                                     {"vm_id": vm_id, "run_dir": str(runs / vm_id),
                                      "image": image}, vm_id=vm_id)
                assert _status(runs / vm_id, "restored")["child"] == "native"
                assert child.pid in _children_of(z.pid)
                forker = client.ping()["forker"]
                forkers.append(None if forker is None else forker["pid"])
            first, second = forkers[0], forkers[4]
            assert first is not None and second is not None and first != second
            assert forkers == [first, first, first, first, second, second], forkers
            for n in range(6):
                client.kill(f"vm{n}")
                assert client.wait(f"vm{n}").reason == "killed"
    finally:
        z.close()
        shutil.rmtree(runs, ignore_errors=True)
