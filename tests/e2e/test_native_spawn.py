"""A real spawn whose children run no Python (``VMFORK_NATIVE_CHILD=1``): the zygote
forks them with ``_core.fork_native_batch``, and the child restores the snapshot as a
``NativeMachine`` (native/src/machine_plan.rs) after its set-up and jail, then lives
natively (native/src/child_life.rs): the reports, the control server, the agent's
handshake, the idle wait and the exit.

The children are jailed, as spawns are by default; the snapshot is the default parent's:
rng, the balloon (whose counters ``status`` reports natively), vsock and its empty volume
slots (virtio-blk, served by the native transport). That they run natively is checked
through their I/O loop's thread, ``NativeMachine``'s; ``exits`` is served natively
from the vCPU loops' and the devices' counters. What the guest sees of its empty
slots is compared with what a Python ``Machine`` restored from the same snapshot shows
its guest. Volumes given at spawn: a new read-write volume goes into an empty slot at
the restore and the child's agent mounts it, natively; a read-write volume the
snapshot's slot holds (a workspace's) is reopened on the file the spawn gives, and a
spawn without it is refused. Their BRANCH is ``test_native_branch.py``'s."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.forker_support import spare_of
from vmfork.agent.client import AgentClient, AgentUnavailable, vsock_uds_connector
from vmfork.agent.protocol import AGENT_PORT
from vmfork.image import find_image
from vmfork.ondisk.stateformat import read_state_file
from vmfork.runtime import cgroups, control, spawnprofile, vmmchild
from vmfork.runtime.parent import boot_and_capture, parent_meta, snapshot_parent
from vmfork.runtime.spawn import Child, fork_children
from vmfork.runtime.volumes import DEFAULT_FREE_SLOTS, PreparedVolume, parse_volume, prepare
from vmfork.runtime.zygote_child import NATIVE_CHILD_ENV
from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote
from vmfork.store import Snapshot, Store
from vmfork.vmm.devices.manager import VOLUME
from vmfork.vmm.vmstate import MachineState

WARM = "marker = 'from the parent'\n"
# Each virtio disk as its guest sees it: name, sectors, read-only, and its serial, which
# the guest's driver asks the device for (GET_ID) when it is read.
# How long the Python child's agent may take to answer (a guard against a hang).
AGENT_GUARD_S = 120.0
DISKS = ("for d in /sys/block/vd*; do echo \"${d##*/} $(cat $d/size) $(cat $d/ro) "
         "[$(cat $d/serial)]\"; done")


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    # The default parent: its empty volume slots are the native transport's virtio-blk.
    store = Store.open(tmp_path_factory.mktemp("home"))
    return snapshot_parent(store, "warm", find_image(), mem_mib=256,
                           warm_code=WARM).snapshot


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteProcess]:
    path = tmp_path_factory.mktemp("zygote") / "z.sock"
    # As test_fork's: the imports over the test host's 9p take long. Each child records
    # its phases (spawn_profile.rs), its jail's among them.
    proc = start_zygote(str(path), timeout=180.0,
                        env={**os.environ, NATIVE_CHILD_ENV: "1", spawnprofile.ENV: "1"})
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def children(zygote: ZygoteProcess, warm: Snapshot,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Child]]:
    client = zygote.client()
    report = fork_children(client, warm, 2, tmp_path_factory.mktemp("vms"))
    assert not report.failed, report.failed
    yield report.children
    for child in report.children:
        if child.vm_id in {c.vm_id for c in client.list()}:
            client.kill_and_wait(child.vm_id)


def test_a_snapshots_write_set_is_learnt_from_one_child_and_copied_by_the_next(
        zygote: ZygoteProcess, warm: Snapshot,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """native/src/write_set.rs: the first child of a snapshot is a learner, which saves
    the guest pages it wrote on its way to ready; the zygote takes the set when it reaps
    the learner, and the next child copies those pages on a thread of its own from its
    guest's start, done by its ready report. (The first test of the module: no child of
    ``warm`` came before.)"""
    client = zygote.client()
    learner = _spawn_one(zygote, warm, tmp_path_factory.mktemp("vms"), ())
    status = learner.read_status()
    assert status["prefaulted_pages"] == 0, status
    learnt = status["write_set_pages"]
    # The restore, after_fork's clock and reseed, the agent's answer: hundreds of pages
    # (~600 in the test host), far below the bound of a quarter of the RAM.
    assert 50 < learnt < (256 << 20) // 4096 // 4, status
    saved = json.loads((learner.run_dir / vmmchild.WRITE_SET_FILE).read_text())
    assert sum(length for _, length in saved["runs"]) == learnt * 4096, saved
    client.kill_and_wait(learner.vm_id)
    child = _spawn_one(zygote, warm, tmp_path_factory.mktemp("vms"), ())
    try:
        status = child.read_status()
        assert status["write_ahead_pages"] == learnt, status
        assert status["prefaulted_pages"] == learnt, status
        assert status["write_ahead_cpu_s"] > 0, status
        assert "write_set_pages" not in status, status   # not a learner: its plan has a set
        assert child.agent.eval("marker").value == repr("from the parent")
    finally:
        client.kill_and_wait(child.vm_id)


def test_native_children_become_ready_and_run_code(children: list[Child]) -> None:
    for child in children:
        status = child.read_status()
        assert status["state"] == "ready", status
        assert status["fork_to_entry_s"] is not None
        agent = child.agent
        assert agent.eval("marker").value == repr("from the parent")
        assert agent.exec(["echo", "native"]).stdout == b"native\n"
        with control.ControlClient.connect(child.run_dir / "control.sock") as ctl:
            # The guest's exits since the restore: the exec above took the vsock's
            # register reads (MMIO exits) and its used-buffer interrupts.
            profile = ctl.call(control.Exits()).profile
            assert profile["by_reason"].get("mmio", 0) > 0, profile
            assert {"bus", "address", "count"} <= set(profile["top_io"][0]), profile
            assert any(count > 0 for count in profile["irqs"].values()), profile
        # A native child: its I/O loop is NativeMachine's ("vmm-io"), where a Python
        # child's is named after its vm_id (Machine's "vmm-io-<vm_id>").
        assert "vmm-io" in thread_names(child.pid)


def thread_names(pid: int) -> set[str]:
    task = Path(f"/proc/{pid}/task")
    return {(task / tid / "comm").read_text().strip() for tid in os.listdir(task)}


def test_native_children_see_the_empty_volume_slots_as_a_python_child_does(
        children: list[Child], warm: Snapshot, tmp_path: Path) -> None:
    state = read_state_file(str(warm.state_path), MachineState)
    slots = state.devices_of(VOLUME)
    assert len(slots) == DEFAULT_FREE_SLOTS and not any(s.disk.disk_key for s in slots)
    native = children[0].agent.exec(DISKS).stdout.decode()
    # Empty (no sectors), offered read-write (a slot may get either), no serial.
    assert sorted(line.split(" ", 1)[1] for line in native.splitlines()) == \
        ["0 0 []"] * DEFAULT_FREE_SLOTS, native
    # The same snapshot restored by the Python Machine, in this process.
    run_dir = tmp_path / "python-child"
    run_dir.mkdir()
    machine, _ = vmmchild.restore(str(warm.path), run_dir, "python-child")
    try:
        machine.start()
        agent = AgentClient(vsock_uds_connector(str(run_dir / "vsock.sock"), AGENT_PORT,
                                                timeout=5.0))
        deadline = time.monotonic() + AGENT_GUARD_S
        while True:
            try:
                agent.ping()
                break
            except AgentUnavailable:
                assert time.monotonic() < deadline, "the Python child's agent never answered"
                time.sleep(0.1)
        assert agent.exec(DISKS).stdout.decode() == native
    finally:
        machine.close()


def test_a_jailed_native_child_records_its_jails_and_machines_steps(
        children: list[Child]) -> None:
    for child in children:
        record = child.run_dir / spawnprofile.PROFILE_FILE
        deadline = time.monotonic() + 30.0   # written right after the ready report
        while not record.exists():
            assert time.monotonic() < deadline, f"no {record}"
            time.sleep(0.05)
        marks = json.loads(record.read_text())["marks"]
        names = [m["phase"] for m in marks]
        # The copy of its snapshot's write set (write_set.rs WriteAhead): a child of a
        # batch makes it before it reports itself prepared, its vCPU parked; a kernel
        # before 5.14 makes it at the restore, in place, instead.
        status = child.read_status()
        release = tuple(int(part) for part in platform.release().split(".")[:2])
        in_place = release < (5, 14) and status["prefaulted_pages"]
        copied = ["machine_write_set"] if in_place else []
        before_prepared = ["write_set_copied"] if status["prefaulted_pages"] and not in_place else []
        assert status["prefaulted_pages"] == status["write_ahead_pages"], status
        assert names[names.index("vcpu_start"):names.index("start_gate") + 1] == [
            "vcpu_start", *before_prepared, "prepared_report", "start_gate"], names
        # A child of a batch joins the batch's jail base: no pivot, no old root of its
        # own to detach (runtime/jail.py, step 2).
        assert names[names.index("set_up"):names.index("machine") + 1] == [
            "set_up", "jail_opened", "jail_unshared", "jail_tmpfs", "jail_binds",
            "jail_proc", "jailed", "machine_opened", "machine_ram", *copied,
            "machine_vm", "machine_devices", "machine"], names
        assert all(later["mono_ns"] >= earlier["mono_ns"]
                   for earlier, later in zip(marks, marks[1:])), marks


def test_native_children_pause_resume_and_report_status(children: list[Child]) -> None:
    child = children[0]
    with control.ControlClient.connect(child.run_dir / "control.sock") as ctl:
        status = ctl.call(control.Status())
        assert (status.paused, status.exit, status.jailed) == (False, None, True)
        assert status.free_page_reporting is not None   # the balloon's, served natively
        ctl.call(control.Pause())
        assert ctl.call(control.Status()).paused
        ctl.call(control.Resume())
        assert not ctl.call(control.Status()).paused
    assert child.agent.eval("1 + 1").value == "2"


def test_native_children_exit_cleanly_on_stop_and_on_sigterm(
        zygote: ZygoteProcess, children: list[Child]) -> None:
    client = zygote.client()
    by_stop, by_signal = children
    with control.ControlClient.connect(by_stop.run_dir / "control.sock") as ctl:
        ctl.call(control.Stop())
    event = client.wait(by_stop.vm_id, timeout=60.0)
    assert (event.reason, event.exit_code) == ("exited", 0), event
    event = client.kill_and_wait(by_signal.vm_id, signal.SIGTERM, timeout=60.0)
    assert (event.reason, event.exit_code) == ("exited", 0), event


def _rw_volume(path: Path, guest_path: str) -> PreparedVolume:
    """A read-write volume: a fresh 16 MiB ext4 image at ``path``."""
    with open(path, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run([shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4", "-q", "-F", str(path)],
                   check=True, capture_output=True)
    return prepare(parse_volume(f"{path}:{guest_path}:rw"))


def _spawn_one(zygote: ZygoteProcess, snapshot: Snapshot, run_root: Path,
               volumes: tuple[PreparedVolume, ...]) -> Child:
    report = fork_children(zygote.client(), snapshot, 1, run_root, volumes=volumes)
    assert not report.failed, report.failed
    return report.children[0]


def test_a_native_child_mounts_a_new_read_write_volume_and_keeps_its_writes(
        zygote: ZygoteProcess, warm: Snapshot,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The volume goes into the snapshot's first empty slot at the restore; the driver
    learns its capacity from the configuration change and the agent mounts it before
    the child reports ready. What one child writes, the next child of the volume reads."""
    volume = _rw_volume(tmp_path_factory.mktemp("rw") / "work.img", "/work")
    client = zygote.client()
    for script in ("echo from-a-native-child > /work/f && sync && cat /work/f",
                   "cat /work/f"):
        child = _spawn_one(zygote, warm, tmp_path_factory.mktemp("vms"), (volume,))
        try:
            assert child.agent.exec(["/bin/sh", "-c", script]).stdout == \
                b"from-a-native-child\n"
            mounted = child.agent.exec(["/bin/sh", "-c", "grep ' /work ' /proc/mounts"])
            assert b" ext4 rw," in mounted.stdout, mounted.stdout
            disks = child.agent.exec(DISKS).stdout.decode().splitlines()
            assert sum(line.split()[1:3] == [str(32768), "0"] for line in disks) == 1, disks
        finally:
            client.kill_and_wait(child.vm_id)


def test_a_native_child_reopens_the_read_write_volume_its_snapshot_holds(
        zygote: ZygoteProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A snapshot whose slot holds a read-write volume (as a workspace's suspended
    sandbox's does; a parent's volumes are read-only, so it is captured here without
    ``snapshot_parent``'s check): its native child restores the slot on the file the
    spawn gives and reads what the snapshot's guest wrote; a spawn that does not give
    the file is refused, naming it."""
    volume = _rw_volume(tmp_path_factory.mktemp("held") / "held.img", "/held")
    store = Store.open(tmp_path_factory.mktemp("held-home"))
    image = find_image()
    with store.begin("workspace") as pending:
        captured = boot_and_capture(
            image, str(pending.memory_path), str(pending.state_path), mem_mib=256, vcpus=1,
            warm_code=None, warm_cmd="echo from-the-snapshot > /held/f && sync",
            network=None, net_tap=None, volumes=(volume,), free_volume_slots=1)
        snapshot = pending.publish(parent_meta(
            pending.tag, image, captured, mem_mib=256, vcpus=1, warm_up=None, network=False,
            connected=False, volumes=(), free_volume_slots=2))
    child = _spawn_one(zygote, snapshot, tmp_path_factory.mktemp("vms"), (volume,))
    try:
        agent = child.agent
        assert agent.exec(["cat", "/held/f"]).stdout == b"from-the-snapshot\n"
        agent.exec(["/bin/sh", "-c", "echo again > /held/g && sync"])
        assert agent.exec(["cat", "/held/g"]).stdout == b"again\n"
    finally:
        zygote.client().kill_and_wait(child.vm_id)
    report = fork_children(zygote.client(), snapshot, 1, tmp_path_factory.mktemp("vms"))
    [(_, reason)] = report.failed
    assert "read-write volume" in reason and "needs its file" in reason, reason


def test_a_lone_spawn_is_the_forkers_spare(zygote: ZygoteProcess, warm: Snapshot,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """After a lone spawn, once its channel was quiet, the forker forks a spare of the
    jailed children's kind: the first process of a PID namespace of its own. The next
    lone spawn is that process, sent the zygote's descriptors its recipe names (its
    jail base's among them): it joins its cgroup and jail, restores, becomes ready and
    runs code, as a child forked then would. (Its spawn asks a memory limit: a group
    of its own, which it joins by path.)"""
    client = zygote.client()
    run_root = tmp_path_factory.mktemp("vms")
    first = _spawn_one(zygote, warm, run_root, ())
    try:
        spare = spare_of(zygote)
        limited = cgroups.detect() is not None
        report = fork_children(client, warm, 1, run_root,
                               memory_limit_mib=512 if limited else None)
        assert not report.failed, report.failed
        second = report.children[0]
        try:
            assert second.pid == spare
            status = second.read_status()
            assert (status["state"], status["child"]) == ("ready", "native"), status
            assert second.agent.eval("marker").value == repr("from the parent")
            with control.ControlClient.connect(second.run_dir / "control.sock") as ctl:
                assert ctl.call(control.Status()).jailed
            nspid = next(line for line in Path(f"/proc/{spare}/status").read_text().splitlines()
                         if line.startswith("NSpid:")).split()[1:]
            assert len(nspid) == 2 and nspid[-1] == "1", nspid
            cgroup = Path(f"/proc/{spare}/cgroup").read_text()
            assert not limited or f"/{second.vm_id}\n" in cgroup, cgroup   # its limit's group
        finally:
            client.kill_and_wait(second.vm_id)
    finally:
        client.kill_and_wait(first.vm_id)
