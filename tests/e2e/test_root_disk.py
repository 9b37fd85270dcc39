"""A read-only root disk (virtio-blk) under the real Linux guest, across snapshot,
fork and BRANCH (issue 13).

The disk is a small squashfs built here with ``mksquashfs``; its content key is
its SHA-256, and it sits where the image cache keeps disks
(``vmfork.image.disk_path``) of a cache of this module's own, which the zygote
is pointed at: a forked child finds its disk from the snapshot's state alone. A child
that runs no Python (``VMFORK_NATIVE_CHILD=1``) reads it through the native transport,
its jail opening the file by the snapshot's key.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_native_spawn import thread_names
from vmfork.agent.client import AgentClient
from vmfork.image import disk_path, find_image
from vmfork.ondisk.stateformat import read_state_file, write_state_file
from vmfork.runtime import vmmchild
from vmfork.runtime.branch import branch_sandbox
from vmfork.runtime.guest import BootedGuest
from vmfork.runtime.spawn import Child, fork_children
from vmfork.runtime.zygote_child import NATIVE_CHILD_ENV
from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote
from vmfork.store import Snapshot, SnapshotMeta, Store
from vmfork.vmm.devices.manager import BLK
from vmfork.vmm.errors import HostError
from vmfork.vmm.vmstate import MachineState

pytestmark = pytest.mark.e2e

HELLO = b"hello from the read-only root disk\n"
MOUNT = "/mnt/root-disk"


@dataclass(frozen=True)
class Disk:
    path: Path
    key: str          # content key: the image's SHA-256
    size: int
    cache: Path       # the image cache it is in
    blob_sha256: str  # of /blob inside the file system (spans many squashfs blocks)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Disk:
    if shutil.which("mksquashfs") is None:
        pytest.fail("mksquashfs is missing: run scripts/setup (Debian package squashfs-tools)")
    tree = tmp_path_factory.mktemp("tree")
    (tree / "hello.txt").write_bytes(HELLO)
    blob = os.urandom(700 * 1024)   # incompressible: ~6 squashfs blocks of 128 KiB
    (tree / "blob").write_bytes(blob)
    image = tmp_path_factory.mktemp("build") / "root.img"
    subprocess.run(["mksquashfs", str(tree), str(image), "-noappend", "-quiet",
                    "-no-progress", "-all-root"], check=True, capture_output=True)
    key = _sha256(image)
    cache = tmp_path_factory.mktemp("cache")
    placed = disk_path(key, cache)
    placed.parent.mkdir(parents=True)
    shutil.copyfile(image, placed)
    size = placed.stat().st_size
    assert size % 512 == 0, "mksquashfs pads to 4 KiB"
    return Disk(placed, key, size, cache, hashlib.sha256(blob).hexdigest())


def _sh(agent: AgentClient, cmd: str, timeout: float = 120) -> str:
    done = agent.exec(cmd, timeout=timeout)
    assert done.exit_code == 0, (cmd, done.exit_code, done.stderr)
    return done.stdout.decode().strip()


def _check_reads(agent: AgentClient, disk: Disk) -> None:
    """What the guest sees of the disk, read from the device itself (caches dropped)."""
    _sh(agent, "sync; echo 3 > /proc/sys/vm/drop_caches")
    assert _sh(agent, "cat /sys/block/vda/ro") == "1"
    assert int(_sh(agent, "cat /sys/block/vda/size")) * 512 == disk.size
    assert _sh(agent, "cat /sys/block/vda/serial") == disk.key[:20]   # GET_ID
    whole = _sh(agent, "dd if=/dev/vda bs=64k 2>/dev/null | sha256sum")
    assert whole.split()[0] == disk.key
    # Reads at offsets and lengths that are not block-aligned in the guest's cache.
    part = _sh(agent, "dd if=/dev/vda bs=512 skip=3 count=9 2>/dev/null | sha256sum")
    with open(disk.path, "rb") as f:
        f.seek(3 * 512)
        assert part.split()[0] == hashlib.sha256(f.read(9 * 512)).hexdigest()


@pytest.fixture(scope="module")
def parent(disk: Disk) -> Iterator[BootedGuest]:
    with BootedGuest(find_image(), mem_mib=256, root_disk=str(disk.path),
                     root_disk_key=disk.key) as guest:
        yield guest


def test_the_guest_sees_a_read_only_disk_with_the_host_file_s_bytes(parent: BootedGuest,
                                                                    disk: Disk) -> None:
    _check_reads(parent.agent, disk)
    assert parent.machine is not None and parent.machine.blk is not None
    assert dict(parent.machine.blk.device.blk_counters())["bytes_read"] >= disk.size


def _check_mounted_and_unwritable(agent: AgentClient, disk: Disk) -> None:
    """The mounted disk's files are the host file's, and a write never reaches it."""
    assert agent.read_file(f"{MOUNT}/hello.txt") == HELLO
    assert _sh(agent, f"sha256sum {MOUNT}/blob").split()[0] == disk.blob_sha256
    before = _sha256(disk.path)
    # The block layer refuses a write open of a read-only disk; if it ever let one
    # through, the device would answer IOERR. Either way nothing reaches the file.
    wrote = agent.exec("dd if=/dev/zero of=/dev/vda bs=512 count=8 conv=fsync", timeout=60)
    assert wrote.exit_code != 0
    assert _sha256(disk.path) == before


def test_the_guest_mounts_it_and_cannot_write_it(parent: BootedGuest, disk: Disk) -> None:
    _sh(parent.agent, f"mkdir -p {MOUNT} && mount -t squashfs -o ro /dev/vda {MOUNT}")
    _check_mounted_and_unwritable(parent.agent, disk)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    home = tmp_path_factory.mktemp("home")
    yield Store.open(home)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def warm(parent: BootedGuest, store: Store) -> Snapshot:
    """The parent, its disk mounted, snapshotted (and so ended)."""
    _sh(parent.agent, f"grep -q ' {MOUNT} ' /proc/mounts || "
                      f"{{ mkdir -p {MOUNT} && mount -t squashfs -o ro /dev/vda {MOUNT}; }}")
    with store.begin("warm-disk") as pending:
        assert parent.machine is not None
        state, _ = parent.machine.snapshot(str(pending.memory_path), resume=False)
        write_state_file(str(pending.state_path), state)
        snapshot = pending.publish(SnapshotMeta(tag=pending.tag, image=parent.image.name,
                                                mem_mib=256, vcpus=1))
    return snapshot


def test_the_snapshot_names_its_disk(warm: Snapshot, disk: Disk) -> None:
    root = read_state_file(str(warm.state_path), MachineState).device(BLK)
    assert root is not None
    assert (root.disk_key, root.capacity_bytes) == (disk.key, disk.size)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory, disk: Disk) -> Iterator[ZygoteProcess]:
    # Its children find the disk in this module's image cache; generous timeout: the
    # zygote imports over 9p, slow in a busy emulated test host.
    env = {**os.environ, "VMFORK_CACHE_DIR": str(disk.cache)}
    proc = start_zygote(str(tmp_path_factory.mktemp("zygote") / "z.sock"), timeout=300.0,
                        env=env)
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vms")


def _spawn(zygote: ZygoteProcess, snapshot: Snapshot, run_root: Path) -> Child:
    report = fork_children(zygote.client(), snapshot, 1, run_root, timeout=300)
    assert not report.failed, report.failed
    return report.children[0]


@pytest.fixture(scope="module")
def child(zygote: ZygoteProcess, warm: Snapshot, run_root: Path) -> Iterator[Child]:
    c = _spawn(zygote, warm, run_root)
    yield c
    zygote.client().kill_and_wait(c.vm_id)


def test_a_forked_child_reads_the_same_disk(child: Child, disk: Disk) -> None:
    _check_reads(child.agent, disk)
    # The mount the parent made is still there, and reads go to the device again.
    assert child.agent.read_file(f"{MOUNT}/hello.txt") == HELLO
    assert _sh(child.agent, f"sha256sum {MOUNT}/blob").split()[0] == disk.blob_sha256


def test_a_branch_of_the_child_carries_the_disk(child: Child, store: Store, disk: Disk,
                                                zygote: ZygoteProcess,
                                                run_root: Path) -> None:
    child.agent.write_file("/tmp/branched", b"after the fork")
    job = branch_sandbox(store, str(child.run_dir / "control.sock"), "branched-disk", "diff")
    branched = job.result().snapshot
    root = read_state_file(str(branched.state_path), MachineState).device(BLK)
    assert root is not None and root.disk_key == disk.key
    grandchild = _spawn(zygote, branched, run_root)
    try:
        assert grandchild.agent.read_file("/tmp/branched") == b"after the fork"
        _check_reads(grandchild.agent, disk)
        assert grandchild.agent.read_file(f"{MOUNT}/hello.txt") == HELLO
    finally:
        zygote.client().kill_and_wait(grandchild.vm_id)
    # The source runs on.
    assert _sh(child.agent, "cat /sys/block/vda/ro") == "1"


def test_a_restore_onto_a_different_disk_fails_naming_both(
        warm: Snapshot, disk: Disk, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "cache"
    placed = disk_path(disk.key, other)
    placed.parent.mkdir(parents=True)
    with open(placed, "wb") as f:
        f.truncate(disk.size + 4096)   # same key, another size: not the snapshot's disk
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(other))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started = time.monotonic()
    with pytest.raises(HostError, match=rf"{disk.key} had {disk.size} bytes.*{placed} has "
                                        rf"{disk.size + 4096}"):
        vmmchild.restore(str(warm.path), run_dir, "wrong-disk")
    assert time.monotonic() - started < 120


@pytest.fixture(scope="module")
def native_zygote(tmp_path_factory: pytest.TempPathFactory,
                  disk: Disk) -> Iterator[ZygoteProcess]:
    env = {**os.environ, "VMFORK_CACHE_DIR": str(disk.cache), NATIVE_CHILD_ENV: "1"}
    proc = start_zygote(str(tmp_path_factory.mktemp("native-zygote") / "z.sock"),
                        timeout=300.0, env=env)
    yield proc
    proc.close()


def test_a_native_child_reads_the_same_disk_and_cannot_write_it(
        native_zygote: ZygoteProcess, warm: Snapshot, run_root: Path, disk: Disk) -> None:
    native = _spawn(native_zygote, warm, run_root)
    try:
        # A native child: its I/O loop is NativeMachine's ("vmm-io").
        assert "vmm-io" in thread_names(native.pid)
        _check_reads(native.agent, disk)
        _check_mounted_and_unwritable(native.agent, disk)
    finally:
        native_zygote.client().kill_and_wait(native.vm_id)
