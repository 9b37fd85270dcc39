"""Volumes without a VM: the volume-slot device (its native transport, as every
machine serves it: a simulated driver, a real file, a real I/O thread), its state, the machine's volume rules, ``SRC:GUEST_PATH[:ro|:rw]``
parsing and checks, sources made into disks, the agent's file-system recognition and
slot lookup, the vmmchild's slot placement, and the registry's read-write holds."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_restore_prepared import add_device, format_1_file, make_state
from test_virtio_harness import MEM_SIZE, GuestDriver, Window, loop, memory, wait_until  # noqa: F401

from vmfork import _core
from vmfork.agent import volumes as agent_volumes
from vmfork.agent.request import OpError
from vmfork.ondisk import stateformat
from vmfork.runtime import vmmchild
from vmfork.runtime import volumes as rv
from vmfork.runtime.jail import JailSpec
from vmfork.runtime.vmmchild import snapshot_slot_media
from vmfork.server.registry import SCHEMA_VERSION, Registry, VolumeHold
from vmfork.vmm import vmstate
from vmfork.vmm.devices.manager import VOLUME, DeviceState, VolumeSlotState
from vmfork.vmm.devices.plan import boot_plan, device_plan, empty_slot, plan_state
from vmfork.vmm.devices.virtio import blk, mmio
from vmfork.vmm.devices.virtio.device import STATUS_FEATURES_OK, VIRTIO_F_VERSION_1
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop
from vmfork.vmm.machine import MachineConfig, VolumeMedia
from vmfork.vmm.memory import GuestMemory

KEY = hashlib.sha256(b"a volume").hexdigest()[:32]
OTHER_KEY = hashlib.sha256(b"another volume").hexdigest()[:32]
DISK_BYTES = 64 * 1024
ACKED_SLOT = VIRTIO_F_VERSION_1 | blk.F_FLUSH | blk.F_SEG_MAX | blk.F_SIZE_MAX


def header(kind: int, sector: int = 0) -> bytes:
    return struct.pack("<IIQ", kind, 0, sector)


def _eventfd() -> int:
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


class SlotEnv:
    """An empty volume slot on its native transport (no ioeventfd: a machine gives an
    empty slot none), with the driver running."""

    def __init__(self, loop: EventLoop, memory: GuestMemory, plan: object = None  # noqa: F811
                 ) -> None:
        assert isinstance(loop, NativeEventLoop) and memory.native is not None
        self.loop, self.memory = loop, memory
        self.irq = _eventfd()
        # The queue's ioeventfd, once a disk brings one (as Machine.attach_volume does).
        self.kick: int | None = None
        self.dev = _core.NativeDevice.restore(
            plan or boot_plan("volume", disk=empty_slot()), memory.native,  # type: ignore[arg-type]
            loop.native_loop, self.irq, [None])
        self.window = Window.of(self.dev)
        self.driver = GuestDriver(self.window, memory)  # type: ignore[arg-type]
        assert self.driver.negotiate(ACKED_SLOT) & STATUS_FEATURES_OK
        self.q = self.driver.setup_queue(0, 16, 64 * 1024)
        self.driver.driver_ok()
        assert self.dev.active

    def capacity_sectors(self) -> int:
        return int.from_bytes(self.window.read(mmio.CONFIG_SPACE, 4), "little") | (
            int.from_bytes(self.window.read(mmio.CONFIG_SPACE + 4, 4), "little") << 32)

    def insert(self, fd: int, size: int, key: str, read_only: bool,
               guest_path: str = "/data") -> None:
        """A disk into the slot, as ``Machine.attach_volume`` puts it: with the queue's
        new ioeventfd, then the configuration change."""
        kick = _eventfd()
        try:
            self.dev.insert_media(fd, key, size, read_only, guest_path, kick)
        except BaseException:
            os.close(kick)
            raise
        self.kick = kick
        assert self.dev.config_changed()

    def request(self, readable: list[bytes], writable: list[int]) -> tuple[bytes, int]:
        """Post one chain and kick: through the queue's ioeventfd if it has one (as
        KVM would), else a QueueNotify write (the exit)."""
        before = self.q.used_idx()
        head = self.q.post(readable, writable)
        last_index, last_len, _ = self.q.chains[head][-1]
        status_at = self.q.buf_addr(last_index) + last_len - 1
        if self.kick is not None:
            os.eventfd_write(self.kick, 1)
        else:
            self.driver.notify(0)
        wait_until(lambda: self.q.used_idx() != before, what="the request")
        [(_, written, data)] = self.q.take_used()
        return data[:max(0, written - 1)], self.memory.read(status_at, 1)[0]

    def close(self) -> None:
        self.dev.close()
        for fd in (self.irq, self.kick):
            if fd is not None:
                os.close(fd)


@pytest.fixture
def slot(loop: EventLoop, memory: GuestMemory) -> Iterator[SlotEnv]:  # noqa: F811
    env = SlotEnv(loop, memory)
    yield env
    env.close()


@pytest.fixture
def volume_file(tmp_path: Path) -> Path:
    path = tmp_path / "vol.img"
    path.write_bytes(os.urandom(DISK_BYTES))
    return path


# -- the slot device ------------------------------------------------------------------

def test_an_empty_slot_offers_flush_not_ro_and_has_no_capacity(slot: SlotEnv) -> None:
    offered = 0
    for sel in (0, 1):
        slot.driver.w(mmio.REG_DEVICE_FEATURES_SEL, sel)
        offered |= slot.driver.r(mmio.REG_DEVICE_FEATURES) << (32 * sel)
    assert offered == ACKED_SLOT   # either kind of media can come later
    assert slot.capacity_sectors() == 0
    _, status = slot.request([header(blk.T_IN, 0)], [512, 1])
    assert status == blk.S_IOERR


def test_inserted_read_only_media_read_and_refuse_writes(slot: SlotEnv,
                                                         volume_file: Path) -> None:
    """The media go in while the driver runs; the driver learns of them from the
    configuration change (a new generation, InterruptStatus bit 1, the irqfd), and its
    requests are served from then on through the queue's new ioeventfd."""
    generation = slot.driver.r(mmio.REG_CONFIG_GENERATION)
    slot.driver.ack_interrupts()
    fd, size = blk.open_disk(str(volume_file))
    try:
        slot.insert(fd, size, KEY, read_only=True)
        assert os.eventfd_read(slot.irq) >= 1
        assert slot.capacity_sectors() == DISK_BYTES // 512
        assert slot.driver.r(mmio.REG_CONFIG_GENERATION) == generation + 1
        assert slot.driver.ack_interrupts() & mmio.INT_CONFIG_CHANGE
        data, status = slot.request([header(blk.T_IN, 2)], [1024, 1])
        assert status == blk.S_OK and data == volume_file.read_bytes()[1024:2048]
        before = volume_file.read_bytes()
        _, status = slot.request([header(blk.T_OUT, 0), b"\x01" * 512], [1])
        assert status == blk.S_IOERR and volume_file.read_bytes() == before
        assert slot.request([header(blk.T_FLUSH)], [1])[1] == blk.S_OK
        with pytest.raises(ValueError, match=f"already holds {KEY}"):
            slot.dev.insert_media(fd, KEY, size, True, "/x")
    finally:
        os.close(fd)   # the device holds its own duplicate
    data, status = slot.request([header(blk.T_IN, 0)], [512, 1])
    assert status == blk.S_OK and data == volume_file.read_bytes()[:512]


def test_inserted_read_write_media_take_writes(slot: SlotEnv, volume_file: Path) -> None:
    fd, size = blk.open_disk(str(volume_file), writable=True)
    try:
        slot.insert(fd, size, KEY, read_only=False)
    finally:
        os.close(fd)
    payload = os.urandom(512)
    _, status = slot.request([header(blk.T_OUT, 3), payload], [1])
    assert status == blk.S_OK
    assert volume_file.read_bytes()[3 * 512:4 * 512] == payload
    assert dict(slot.dev.blk_counters())["writes"] == 1


def test_a_root_disk_takes_no_media_and_a_slot_only_a_disk(
        loop: EventLoop, memory: GuestMemory, volume_file: Path) -> None:  # noqa: F811
    assert isinstance(loop, NativeEventLoop) and memory.native is not None
    fd, size = blk.open_disk(str(volume_file))
    irq = _eventfd()
    root = _core.NativeDevice.restore(
        boot_plan("blk", disk=blk.BlkState(0, KEY, size)), memory.native,
        loop.native_loop, irq, [None], disk_file=fd)
    slot = SlotEnv(loop, memory)
    try:
        with pytest.raises(ValueError, match="not a volume slot"):
            root.insert_media(fd, KEY, size, True, "/x")
        with pytest.raises(ValueError, match="not empty"):
            slot.dev.insert_media(fd, "", 0, True, "/x")
        with pytest.raises(ValueError, match=f"its file has {size}"):
            slot.dev.insert_media(fd, KEY, size + 512, True, "/x")
        refused = plan_state(slot.dev.plan(), 0, 5).state   # nothing changed
        assert isinstance(refused, VolumeSlotState) and refused.disk.capacity_bytes == 0
        assert slot.capacity_sectors() == 0
    finally:
        root.close()
        slot.close()
        os.close(irq)
        os.close(fd)


def test_slot_state_round_trips_with_its_media(slot: SlotEnv, volume_file: Path) -> None:
    empty = plan_state(slot.dev.plan(), 0, 5).state
    assert isinstance(empty, VolumeSlotState)
    assert (empty.disk.volume_slot, empty.disk.disk_key, empty.disk.capacity_bytes,
            empty.guest_path) == (True, "", 0, "")
    fd, size = blk.open_disk(str(volume_file))
    try:
        slot.insert(fd, size, KEY, read_only=True, guest_path="/data")
        saved = plan_state(slot.dev.plan(), 0, 5)
        again = stateformat.decode_state(stateformat.encode_state(saved), DeviceState)
        assert again == saved and isinstance(again.state, VolumeSlotState)
        assert again.state.disk == blk.BlkState(ACKED_SLOT, KEY, size, True, True)
        assert again.state.guest_path == "/data"
        # A child of this snapshot: the slot holds the disk from the start.
        irq = _eventfd()
        child = _core.NativeDevice.restore(device_plan(again), slot.memory.native,  # type: ignore[arg-type]
                                           slot.loop.native_loop, irq, [None], disk_file=fd)
        try:
            assert child.active and plan_state(child.plan(), 0, 5) == saved
        finally:
            child.close()
            os.close(irq)
    finally:
        os.close(fd)


def _add_volume(state: vmstate.MachineState, key: str = "", read_only: bool = True,
                guest_path: str = "") -> None:
    transport = mmio.MmioTransportState(
        device_type=blk.DEVICE_ID_BLK, status=0xF, device_features_sel=0,
        driver_features_sel=0, driver_features=ACKED_SLOT, driver_features_bad=False,
        queue_sel=0, interrupt_status=0, config_generation=0)
    add_device(state, VOLUME, VolumeSlotState(blk.BlkState(
        ACKED_SLOT, key, DISK_BYTES if key else 0, read_only, True), guest_path), transport)


def test_machine_state_with_volumes_round_trips_and_older_files_have_none() -> None:
    state = make_state()
    _add_volume(state, KEY, True, "/data")
    _add_volume(state)
    assert [d.irq for d in state.devices] == [4, 5, 6]
    assert stateformat.decode_state(stateformat.encode_state(state),
                                    vmstate.MachineState) == state
    old = format_1_file(make_state())   # format 1, written before volumes existed
    decoded = stateformat.decode_state(old, vmstate.MachineState)
    assert decoded.devices_of(VOLUME) == [] and decoded == make_state()


def test_machine_config_volume_rules(volume_file: Path) -> None:
    media = VolumeMedia(0, str(volume_file), KEY, True, "/data")
    MachineConfig(kernel="/vmlinux", volume_slots=2, volumes=(media,)).validate()
    for config, words in [
        (MachineConfig(kernel="/vmlinux", volume_slots=25), "0..24"),
        (MachineConfig(kernel="/vmlinux", volume_slots=1, volumes=(replace(media, slot=1),)),
         "has 1 slots"),
        (MachineConfig(kernel="/vmlinux", volume_slots=2, volumes=(media, media)), "two disks"),
        (MachineConfig(kernel="/vmlinux", volume_slots=1, volumes=(replace(media, key="X"),)),
         "content key"),
    ]:
        with pytest.raises(ValueError, match=words):
            config.validate()
    state = make_state()
    _add_volume(state, KEY, True, "/data")
    _add_volume(state)
    restore = MachineConfig(restore_state=state, memory_file="/m", mem_mib=64)
    with pytest.raises(ValueError, match=r"slots \[0\] hold disks"):
        restore.validate()
    replace(restore, volumes=(media,)).validate()
    with pytest.raises(ValueError, match="hold disks"):
        replace(restore, volumes=(replace(media, slot=1),)).validate()


# -- placing volumes in a restored machine's slots (runtime.vmmchild) -------------------

def _prepared(key: str, read_only: bool, guest_path: str) -> rv.PreparedVolume:
    return rv.PreparedVolume(guest_path, read_only, key, f"/disks/{key}", "/src", DISK_BYTES)


def test_new_volumes_take_the_free_slots_and_rw_slots_need_their_file() -> None:
    state = make_state()
    _add_volume(state)
    _add_volume(state, KEY, True, "/data")
    _add_volume(state)
    held, new = snapshot_slot_media(state, [_prepared(OTHER_KEY, False, "/w")])
    assert [m.slot for m in held] == [1] and held[0].path.endswith(f"volumes/{KEY}/volume.img")
    assert [(m.slot, m.key, m.read_only) for m in new] == [(0, OTHER_KEY, False)]
    with pytest.raises(ValueError, match="2 empty volume slots"):
        snapshot_slot_media(state, [_prepared(f"{i:032x}", True, f"/v{i}") for i in range(3)])
    state.devices_of(VOLUME)[1].disk.read_only = False
    state.devices_of(VOLUME)[1].guest_path = "/work"
    with pytest.raises(ValueError, match="needs its file"):
        snapshot_slot_media(state, [])
    held, new = snapshot_slot_media(state, [_prepared(KEY, False, "/work")])
    assert held[0].path == f"/disks/{KEY}" and new == []


def test_a_native_childs_own_volumes_are_placed_as_a_python_childs(tmp_path: Path) -> None:
    """``vmmchild._child_volumes``: the read-write volume a slot holds and the new ones,
    at their virtio-mmio slots, sized from their files, from the jail's read-only or
    read-write files; the agent mounts only the new ones."""
    state = make_state()
    _add_volume(state, KEY, False, "/work")     # held, read-write
    _add_volume(state)
    _add_volume(state, OTHER_KEY, True, "/data")   # held, read-only: a snapshot disk
    _add_volume(state)
    slots = [d.slot for d in state.devices if d.kind == VOLUME.name]
    held_file, new_file = tmp_path / "work.img", tmp_path / "new.img"
    held_file.write_bytes(bytes(DISK_BYTES))
    new_file.write_bytes(bytes(2 * DISK_BYTES))
    held = replace(_prepared(KEY, False, "/work"), path=str(held_file))
    new = replace(_prepared("ab" * 16, True, "/new"), path=str(new_file))
    args = {"volumes": [held.to_json(), new.to_json()]}
    volumes, mounts = vmmchild._child_volumes(state, args, None)
    assert volumes == [(slots[0], str(held_file), KEY, DISK_BYTES, False, "/work", None),
                       (slots[1], str(new_file), "ab" * 16, 2 * DISK_BYTES, True, "/new",
                        None)]
    assert mounts == [(slots[1], "/new", True, 2 * DISK_BYTES // 512)]
    jail = JailSpec(root="/j", uid=1, gid=1, preopen=("/m", str(new_file)),
                    preopen_rw=(str(held_file),))
    volumes, _ = vmmchild._child_volumes(state, args, jail)
    assert [v[6] for v in volumes] == [0, 1]
    with pytest.raises(ValueError, match=f"the jail opens no {held_file}"):
        vmmchild._child_volumes(state, args, replace(jail, preopen_rw=()))
    new_file.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="100 bytes; a disk image must be"):
        vmmchild._child_volumes(state, args, None)
    assert vmmchild._child_volumes(state, {}, None) == ([], [])


# -- SRC:GUEST_PATH[:ro|:rw] ------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("/src:/data", rv.VolumeSpec("/src", "/data", True)),
    ("/src:/data:ro", rv.VolumeSpec("/src", "/data", True)),
    ("/img:/mnt/w:rw", rv.VolumeSpec("/img", "/mnt/w", False)),
    ("/src:/usr/local/data", rv.VolumeSpec("/src", "/usr/local/data", True)),
])
def test_volume_specs_parse(text: str, expected: rv.VolumeSpec) -> None:
    assert rv.parse_volume(text) == expected
    assert rv.parse_volume({"source": expected.source, "guest_path": expected.guest_path,
                            "mode": "ro" if expected.read_only else "rw"}) == expected


@pytest.mark.parametrize("item, words", [
    ("/src", "SRC:GUEST_PATH"),
    ("/a:/b:/c:ro", "SRC:GUEST_PATH"),
    (":/data", "source"),
    ("/src:/data:rx", "neither ro nor rw"),
    ("/src:data", "relative"),
    ("/src:/", "cannot be mounted on /"),
    ("/src:/a/../b", "'..'"),
    ("/src:/a/./b", "'.'"),
    ("/src:/a//b", "empty component"),
    ("/src:/a/", "trailing slash"),
    ("/src:/proc", "/proc"),
    ("/src:/sys/x", "/sys"),
    ("/src:/dev/shm", "/dev"),
    ("/src:/opt/vmfork/x", "/opt/vmfork"),
    ("/src:/usr", "hide"),
    ("/src:/etc", "hide"),
    ("/src:/a b", "characters"),
    ("/src:/" + "a" * 300, "longer"),
    ({"source": "/s"}, "guest_path"),
    ({"source": "/s", "guest_path": "/d", "extra": 1}, "unknown fields"),
    (42, "not int"),
])
def test_bad_volume_specs_name_what_to_fix(item: object, words: str) -> None:
    with pytest.raises(rv.VolumeError, match=words):
        rv.parse_volume(item)  # type: ignore[arg-type]


def test_volume_sets_are_bounded_and_do_not_nest() -> None:
    rv.check_volume_set([("/a", True), ("/ab", True), ("/b/c", False)])
    with pytest.raises(rv.VolumeError, match="nested"):
        rv.check_volume_set([("/a", True), ("/a/b", True)])
    with pytest.raises(rv.VolumeError, match="the same as"):
        rv.check_volume_set([("/a", True), ("/a", False)])
    with pytest.raises(rv.VolumeError, match="the snapshot's volume at /data"):
        rv.check_volume_set([("/data/x", True)], existing=["/data"])
    with pytest.raises(rv.VolumeError, match="at most 24"):
        rv.check_volume_set([(f"/v{i}", True) for i in range(23)], existing=["/a", "/b"])


# -- sources into disks -------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\n")
    (root / "sub" / "b.bin").write_bytes(os.urandom(10_000))
    (root / "link").symlink_to("a.txt")
    return root


def test_tree_keys_follow_content_not_time(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "t")
    key = rv.tree_key(tree, "erofs")
    os.utime(tree / "a.txt", (0, 0))
    assert rv.tree_key(tree, "erofs") == key
    (tree / "a.txt").write_text("beta\n")
    assert rv.tree_key(tree, "erofs") != key
    assert rv.tree_key(tree, "squashfs") != rv.tree_key(tree, "erofs")


@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")
def test_a_directory_becomes_one_cached_erofs_image(tmp_path: Path, cache: Path) -> None:
    tree = _tree(tmp_path / "t")
    first = rv.prepare(rv.VolumeSpec(str(tree), "/data", True))
    again = rv.prepare(rv.VolumeSpec(str(tree), "/elsewhere", True))
    assert first.key == again.key and first.path == again.path
    assert Path(first.path).is_relative_to(cache) and first.size_bytes % 512 == 0
    with open(first.path, "rb") as f:
        assert agent_volumes.file_system_type(f.read(2048)) == "erofs"
    out = tmp_path / "out"
    subprocess.run(["fsck.erofs", f"--extract={out}", first.path], check=True,
                   capture_output=True)
    assert (out / "a.txt").read_text() == "alpha\n"
    assert (out / "sub" / "b.bin").read_bytes() == (tree / "sub" / "b.bin").read_bytes()


def test_image_files_are_imported_read_only_or_used_in_place(tmp_path: Path,
                                                             cache: Path) -> None:
    image = tmp_path / "disk.img"
    image.write_bytes(os.urandom(8192))
    ro = rv.prepare(rv.VolumeSpec(str(image), "/d", True))
    assert Path(ro.path).is_relative_to(cache) and Path(ro.path).read_bytes() == \
        image.read_bytes()
    image.write_bytes(os.urandom(8192))   # the user's file changes; the cached one not
    assert Path(ro.path).read_bytes() != image.read_bytes()
    rw = rv.prepare(rv.VolumeSpec(str(image), "/w", False))
    assert rw.path == str(image) and not rw.read_only
    assert rw.key == rv.prepare(rv.VolumeSpec(str(image), "/other", False)).key


@pytest.mark.parametrize("make, spec_text, words", [
    (None, "{d}/missing:/x", "No such file"),
    ("dir", "{d}/src:/x:rw", "read-only image"),
    ("odd", "{d}/src:/x", "multiple of 512"),
    ("empty", "{d}/src:/x:rw", "multiple of 512"),
    ("fifo", "{d}/src:/x", "neither a directory nor a regular file"),
    ("dir", "relative/src:/x", "relative"),
])
def test_sources_that_cannot_be_volumes_are_refused(tmp_path: Path, cache: Path,
                                                    make: str | None, spec_text: str,
                                                    words: str) -> None:
    src = tmp_path / "src"
    if make == "dir":
        src.mkdir()
    elif make == "odd":
        src.write_bytes(b"x" * 1000)
    elif make == "empty":
        src.write_bytes(b"")
    elif make == "fifo":
        os.mkfifo(src)
    with pytest.raises(rv.VolumeError, match=words):
        rv.prepare(rv.parse_volume(spec_text.format(d=tmp_path)))
    assert not (cache / "volumes").exists() or not any(
        p for p in (cache / "volumes").iterdir() if not p.name.startswith("."))


def test_snapshot_volumes_are_read_only_and_slots_bounded(tmp_path: Path, cache: Path) -> None:
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(4096))
    with pytest.raises(rv.VolumeError, match="read-only"):
        rv.prepare_snapshot_volumes([f"{image}:/w:rw"], None)
    prepared, free = rv.prepare_snapshot_volumes([f"{image}:/d"], None)
    assert len(prepared) == 1 and free == rv.DEFAULT_FREE_SLOTS
    assert rv.prepare_snapshot_volumes([], 24)[1] == 24
    with pytest.raises(rv.VolumeError, match="lower volume_slots"):
        rv.prepare_snapshot_volumes([f"{image}:/d"], 24)
    many = [f"{image}:/v{i}" for i in range(22)]
    assert rv.prepare_snapshot_volumes(many, None)[1] == 2


# -- the agent's side ---------------------------------------------------------------------

def test_file_systems_are_recognised_by_their_superblock(tmp_path: Path) -> None:
    assert agent_volumes.file_system_type(b"hsqs" + bytes(2044)) == "squashfs"
    assert agent_volumes.file_system_type(bytes(2048)) is None
    assert agent_volumes.file_system_type(b"") is None
    mkfs = shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4"
    if os.path.exists(mkfs):
        image = tmp_path / "e.img"
        with open(image, "wb") as f:
            f.truncate(4 << 20)
        subprocess.run([mkfs, "-q", "-F", str(image)], check=True, capture_output=True)
        with open(image, "rb") as f:
            assert agent_volumes.file_system_type(f.read(2048)) == "ext4"


def test_a_slot_is_found_by_its_platform_device(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    (sys_root / "bus/platform/devices/virtio-mmio.4/virtio4/block/vdb").mkdir(parents=True)
    (sys_root / "bus/platform/devices/virtio-mmio.0/virtio0").mkdir(parents=True)
    assert agent_volumes.slot_block_device(4, str(sys_root)) == "vdb"
    assert agent_volumes.slot_block_device(0, str(sys_root)) is None
    assert agent_volumes.slot_block_device(7, str(sys_root)) is None


@pytest.mark.parametrize("req, words", [
    ({"guest_path": "/d", "sectors": 8}, "device"),
    ({"device": 64, "guest_path": "/d", "sectors": 8}, "device"),
    ({"device": 0, "guest_path": "/d"}, "sectors"),
    ({"device": 0, "guest_path": "/d", "sectors": 0}, "sectors"),
    ({"device": 0, "guest_path": "d", "sectors": 8}, "absolute"),
    ({"device": 0, "guest_path": "/", "sectors": 8}, "on /"),
    ({"device": 0, "guest_path": "/d", "sectors": 8, "read_only": "yes"}, "true or false"),
])
def test_mount_volume_refuses_bad_requests(req: dict[str, object], words: str) -> None:
    with pytest.raises(OpError, match=words) as exc:
        agent_volumes.mount_volume(req)
    assert exc.value.code == "bad_request"


# -- the registry's read-write holds --------------------------------------------------------

def _hold(key: str, holder: str, guest_path: str = "/w") -> VolumeHold:
    return VolumeHold(key, f"/img/{key}", guest_path, DISK_BYTES, holder, 1.0)


def test_a_read_write_volume_has_one_holder_at_a_time(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "registry.db")
    assert reg.hold_volumes([_hold(KEY, "spawn:1")]) is None
    taken = reg.hold_volumes([_hold(OTHER_KEY, "spawn:2"), _hold(KEY, "spawn:2")])
    assert taken is not None and taken.holder == "spawn:1"
    assert reg.volumes_held_by("spawn:2") == []       # all or nothing
    assert reg.move_volume_holds("spawn:1", "workspace:w") == 1
    assert [h.key for h in reg.volumes_held_by("workspace:w")] == [KEY]
    assert reg.hold_volumes([_hold(OTHER_KEY, "spawn:3")]) is None
    assert reg.release_volumes_of_unfinished_spawns() == 1
    assert reg.release_volumes("workspace:w") == 1
    assert reg.list_volume_holds() == []
    assert reg.hold_volumes([_hold(KEY, "sandbox:x")]) is None
    reg.close()


def test_a_version_3_registry_gains_the_holds_table(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    reg = Registry(path)
    reg.close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE volume_holds")
        db.execute("UPDATE schema_version SET version = 3")
    reg = Registry(path)
    assert reg.schema_version() == SCHEMA_VERSION and reg.hold_volumes([_hold(KEY, "sandbox:a")]) is None
    reg.close()


# -- the CLI's --volume ---------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["spawn", "--tag", "t", "--volume", "/src:data"], "relative"),
    (["spawn", "--tag", "t", "--volume", "/src:/data:rx"], "neither ro nor rw"),
    (["workspace", "create", "w", "--tag", "t", "--volume", "/src"], "SRC:GUEST_PATH"),
    (["snapshot", "--tag", "t", "--volume", "/src:/proc"], "/proc"),
])
def test_cli_volume_mistakes_exit_2_before_any_request(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, argv: list[str], words: str) -> None:
    from vmfork.cli import main
    # A daemon address nothing listens on: the CLI must stop before it tries.
    monkeypatch.setenv("VMFORK_URL", f"unix://{tmp_path}/nobody.sock")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--volume" in err and words in err


def test_cli_volume_sources_are_made_absolute(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    from vmfork.cli import volume_args
    monkeypatch.chdir(tmp_path)
    assert volume_args(["data:/d", "img:/w:rw"]) == [f"{tmp_path}/data:/d:ro",
                                                     f"{tmp_path}/img:/w:rw"]
