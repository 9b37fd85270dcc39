"""The device manager (``vmm.devices.manager``) and the machine state's device list.

Real devices on a real I/O thread and guest memory (no /dev/kvm: the transports are
built without ioeventfds): the slot and pin order, a save through the state file and
a restore into a machine built the same way, a refusal of a different machine, the
close order; format 1's per-device fields read into the list; every malformed list
(unknown kind, newer record, duplicate, missing serial, out of slot order) is a
``StateFormatError`` naming the entry, never a crash or a half-built state.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_restore_prepared import add_device, format_1_file, make_state
from test_virtio_harness import loop, memory  # noqa: F401

from vmfork import _core
from vmfork.ondisk import stateformat
from vmfork.ondisk.stateformat import StateFormatError
from vmfork.vmm import vmstate
from vmfork.vmm.devices import manager
from vmfork.vmm.devices.manager import (
    BALLOON,
    BLK,
    NET,
    RNG,
    SERIAL,
    VOLUME,
    VSOCK,
    DeviceKind,
    DeviceManager,
    DeviceState,
    VolumeSlotState,
)
from vmfork.vmm.devices.plan import DISK_KINDS, NativeVirtio, boot_plan, device_plan, empty_slot
from vmfork.vmm.devices.serial import Serial, SerialState
from vmfork.vmm.devices.virtio import blk
from vmfork.vmm.devices.virtio.balloon import BalloonState
from vmfork.vmm.devices.virtio.device import run_on_loop
from vmfork.vmm.devices.virtio.mmio import MmioTransportState
from vmfork.vmm.devices.virtio.net import NetState
from vmfork.vmm.devices.virtio.rng import RngState
from vmfork.vmm.devices.virtio.vsock import VsockState
from vmfork.vmm.errors import HostError
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop
from vmfork.vmm.irq import IrqLine
from vmfork.vmm.machine import MAX_VOLUME_SLOTS, OpenedDisk
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.vmstate import MachineState
from vmfork.vmm.x86 import layout as L

GOLDEN = Path(__file__).parent / "golden"
KEY = "c" * 64
MAC = "02:00:00:00:00:01"
DISK_BYTES = 64 * 1024
V1 = 1 << 32


def old_rule_irqs(own: int, volumes: int) -> list[int]:
    """The pins the machine gave its virtio devices before the manager: its own to each
    of the first ``own`` (FIRST_DEVICE_IRQ + slot), then the volume slots round-robin
    over the pins left (``Machine._add_volume_slots`` as it was)."""
    first_pin = L.FIRST_DEVICE_IRQ + own
    pins = L.IOAPIC_PINS - first_pin
    return [L.FIRST_DEVICE_IRQ + s for s in range(own)] + \
        [first_pin + i % pins for i in range(volumes)]


# -- format 1 ---------------------------------------------------------------------------------

def test_a_format_1_file_converts_into_the_device_list() -> None:
    state = stateformat.read_state_file(GOLDEN / "state-v1.bin", MachineState)
    assert [(d.kind, d.slot, d.irq) for d in state.devices] == [
        ("serial", None, L.COM1_IRQ), ("vsock", 0, 5), ("rng", 1, 6), ("net", 2, 7),
        ("blk", 3, 8), ("balloon", 4, 9), ("volume", 5, 10), ("volume", 6, 11)]
    assert [d.irq for d in state.devices[1:]] == old_rule_irqs(5, 2)
    assert all(d.version == 1 for d in state.devices)
    assert [d.transport.device_type for d in state.devices if d.transport is not None] == \
        [19, 4, 1, 2, 5, 2, 2]
    serial = state.device(SERIAL)
    assert serial == SerialState(ier=1, lcr=3, scr=0x5A, thre_pending=True, rx=b"ls\n")
    vsock = state.device(VSOCK)
    assert vsock is not None and vsock.guest_cid == 7 and state.guest_cid == 7
    net = state.device(NET)
    assert net is not None and net.mac == "02:00:00:00:00:07"
    root = state.device(BLK)
    assert root is not None and (root.disk_key, root.capacity_bytes) == ("a" * 64, 1 << 20)
    assert state.device(RNG) is not None and state.device(BALLOON) is not None
    volumes = state.devices_of(VOLUME)
    assert [(v.guest_path, v.disk.disk_key, v.disk.volume_slot) for v in volumes] == [
        ("/data", "b" * 64, True), ("", "", True)]
    assert state.extra == {"note": "written by format 1"} and state.mem_size == 64 << 20
    assert len(vmstate.prepare_restore(state, native=False).vcpus) == 1


def test_a_format_1_file_has_only_the_devices_it_had() -> None:
    vsock = {"transport": stateformat.to_json_value(_transport(19, 3)),
             "device": {"guest_cid": 9, "acked_features": V1}}
    state = stateformat.decode_state(format_1_file(make_state(), vsock=vsock, net=None),
                                     MachineState)
    assert [(d.kind, d.slot, d.irq) for d in state.devices] == [("serial", None, 4),
                                                                ("vsock", 0, 5)]
    assert state.guest_cid == 9 and state.device(NET) is None
    assert state.devices_of(VOLUME) == []


@pytest.mark.parametrize("fields, words", [
    ({"vsock": 5}, "field 'vsock': expected an object with transport and device"),
    ({"blk": {"device": {}}}, "field 'blk': expected an object with transport and device"),
    ({"volumes": {}}, "field 'volumes': expected an array"),
    ({"volumes": [7]}, r"field 'volumes\[0\]': expected an object"),
])
def test_a_malformed_format_1_file_is_refused_by_name(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(StateFormatError, match="version 1 does not convert to MachineState: "
                                               + words) as info:
        stateformat.decode_state(format_1_file(make_state(), **fields), MachineState)
    assert info.value.kind == "field"


def test_a_format_1_file_without_its_serial_is_refused() -> None:
    tree = json.loads(format_1_file(make_state())[stateformat.HEADER_SIZE:])
    del tree["serial"]
    with pytest.raises(ValueError, match="field 'serial' is missing"):
        manager.upgrade_format_1(tree)
    with pytest.raises(ValueError, match="not an object"):
        manager.upgrade_format_1([])


# -- the list, as a state file reads it ------------------------------------------------------

def _transport(device_type: int, queues: int = 1) -> MmioTransportState:
    return MmioTransportState(device_type=device_type, status=0xF, device_features_sel=0,
                              driver_features_sel=0, driver_features=V1,
                              driver_features_bad=False, queue_sel=0, interrupt_status=0,
                              config_generation=0)


def _full_state() -> MachineState:
    state = make_state()
    add_device(state, VSOCK, VsockState(guest_cid=5, acked_features=V1), _transport(19))
    add_device(state, RNG, RngState(acked_features=V1), _transport(4))
    add_device(state, NET, NetState(mac="02:00:00:00:00:01", acked_features=V1),
               _transport(1))
    add_device(state, BLK, blk.BlkState(V1, KEY, DISK_BYTES), _transport(2))
    add_device(state, BALLOON, BalloonState(V1, 2), _transport(5))
    for key, path in ((KEY, "/data"), ("", "")):
        add_device(state, VOLUME, VolumeSlotState(
            blk.BlkState(V1, key, DISK_BYTES if key else 0, True, True), path), _transport(2))
    return state


def test_every_kind_round_trips_through_the_list() -> None:
    state = _full_state()
    assert {d.kind for d in state.devices} == set(manager.KINDS)
    back = stateformat.decode_state(stateformat.encode_state(state), MachineState)
    assert back == state
    for saved, again in zip(state.devices, back.devices):
        assert type(again.state) is type(saved.state) is manager.KINDS[saved.kind].record
    assert back.guest_cid == 5


def _mutated(change: Callable[[Any], None]) -> Any:
    tree = stateformat.to_json_value(_full_state())
    change(tree)
    return tree


def _set(path: list[Any], value: Any) -> Callable[[Any], None]:
    def change(tree: Any) -> None:
        for step in path[:-1]:
            tree = tree[step]
        tree[path[-1]] = value
    return change


@pytest.mark.parametrize("change, where, words", [
    (_set(["devices", 1, "kind"], "gpu"), "devices[1]",
     re.escape("unknown device kind 'gpu' (this vmfork knows serial, vsock, rng, net, blk, "
               "balloon, volume): the snapshot was written by a newer vmfork; upgrade vmfork")),
    (_set(["devices", 2, "kind"], 7), "devices[2]", "unknown device kind '7'"),
    (_set(["devices", 3, "version"], 2), "devices[3]",
     "the net device's record is version 2, this vmfork reads version 1: written by a newer "
     "vmfork"),
    (_set(["devices", 3, "version"], 0), "devices[3]", "take the snapshot again"),
    (_set(["devices", 1, "state", "guest_cid"], "x"), "devices[1].state.guest_cid",
     "expected int, found str"),
    (_set(["devices", 4, "state"], {"disk_key": KEY}), "devices[4].state.acked_features",
     "missing"),
    (_set(["devices", 2, "transport"], None), "devices[2]", "needs its transport's state"),
    (_set(["devices", 0, "transport"], stateformat.to_json_value(_transport(4))), "devices[0]",
     "has no virtio transport"),
    (_set(["devices", 0, "slot"], 3), "devices[0]", "serial device has no slot"),
    (_set(["devices", 1, "slot"], None), "devices[1]", "vsock device has a virtio-mmio slot"),
    (_set(["devices", 5, "irq"], 24), "devices[5]", r"IRQ 24 is not an IOAPIC pin \(0..23\)"),
    (lambda t: t["devices"].insert(2, copy.deepcopy(t["devices"][1])), None,
     r"two vsock devices \(devices\[1\] and devices\[2\]\); a machine has at most one"),
    (lambda t: t["devices"].pop(0), None, "the machine has no serial device"),
    (lambda t: t["devices"].insert(1, t["devices"].pop(2)), None,
     r"devices\[1\] \(rng\) is at virtio-mmio.1, expected virtio-mmio.0: the list is in "
     "slot order"),
    (lambda t: t.pop("devices"), "devices", "missing"),
])
def test_a_malformed_list_is_a_format_error_naming_the_entry(
        change: Callable[[Any], None], where: str | None, words: str) -> None:
    """``where`` is the field path, None for a fault of the whole list (its message
    names the entries)."""
    tree = _mutated(change)
    with pytest.raises(StateFormatError, match=words) as info:
        stateformat.from_json_value(tree, MachineState)
    assert info.value.kind == "field"
    assert info.value.field == where


def test_a_malformed_list_in_a_file_is_a_format_error() -> None:
    body = json.dumps(_mutated(_set(["devices", 1, "kind"], "gpu"))).encode()
    data = struct.pack("<8sIIQ32s", stateformat.MAGIC, stateformat.FORMAT_VERSION, 0,
                       len(body), hashlib.sha256(body).digest()) + body
    with pytest.raises(StateFormatError, match="unknown device kind 'gpu'"):
        stateformat.decode_state(data, MachineState)


def test_a_record_of_the_wrong_class_is_refused_in_code() -> None:
    with pytest.raises(ValueError, match="a vsock device's record is a VsockState, not a "
                                         "RngState"):
        DeviceState("vsock", 1, 0, 5, RngState(V1), _transport(19))
    with pytest.raises(TypeError, match="use device_records"):
        _full_state().device(VOLUME)


# -- the manager ------------------------------------------------------------------------------

class Built:
    """A machine's devices as ``Machine._add_virtio_devices`` attaches them, on the test's
    I/O thread and memory, with transports without ioeventfds: every virtio device served
    natively, built from ``saved``'s records (a restore; a filled slot's disk is
    ``vol.img``) or fresh."""

    def __init__(self, loop: EventLoop, memory: GuestMemory, tmp: Path, *,  # noqa: F811
                 rng: bool = True, volumes: int = 2, cid: int = 3, disk_key: str = KEY,
                 saved: list[DeviceState] | None = None) -> None:
        self.lines: dict[int, IrqLine] = {}

        def native(kind: DeviceKind[Any], disk: OpenedDisk | None = None, **host: Any
                   ) -> Callable[[int, int], NativeVirtio]:
            def build(slot: int, irq: int) -> NativeVirtio:
                line = self.lines.setdefault(irq, IrqLine(irq))
                record = next((d for d in saved or () if d.slot == slot), None)
                if record is None:
                    plan = (boot_plan(kind.name, guest_cid=cid, mac=MAC)
                            if kind.name not in DISK_KINDS else
                            boot_plan(kind.name, disk=disk.record if disk else empty_slot()))
                else:
                    plan = device_plan(record)
                    if disk is not None:
                        disk.check_restores(record, "test")
                fd = disk.fd if disk is not None else None
                if record is not None and isinstance(record.state, VolumeSlotState) \
                        and record.state.disk.disk_key:
                    fd = self.volume_fd
                assert isinstance(loop, NativeEventLoop) and memory.native is not None
                return NativeVirtio(_core.NativeDevice.restore(
                    plan, memory.native, loop.native_loop, line.fd, [None] * len(plan[2]),
                    disk_file=fd, **host), record)
            return build

        self.manager = DeviceManager()
        self.serial = Serial(self.lines.setdefault(4, IrqLine(4)))
        self.manager.attach_legacy(SERIAL, self.serial, L.COM1_IRQ)
        uds = str(tmp / f"vsock-{os.urandom(4).hex()}.sock")
        self.vsock = self.manager.attach_native(VSOCK, native(VSOCK, vsock_listener=(uds, None)))
        if rng:
            self.rng = self.manager.attach_native(RNG, native(RNG))
        self.net = self.manager.attach_native(NET, native(NET))
        path, volume = tmp / "disk.img", tmp / "vol.img"
        for made in (path, volume):
            if not made.exists():
                made.write_bytes(os.urandom(DISK_BYTES))
        fd, size = blk.open_disk(str(path))
        self.volume_fd, _ = blk.open_disk(str(volume))
        try:
            self.blk = self.manager.attach_native(BLK, native(BLK, OpenedDisk(
                blk.BlkState(0, disk_key, size), "", str(path), fd)))
        finally:
            os.close(fd)   # the device holds its own duplicate
        self.balloon = self.manager.attach_native(BALLOON, native(BALLOON))
        self.volumes = [self.manager.attach_native(VOLUME, native(VOLUME))
                        for _ in range(volumes)]

    def places(self) -> list[tuple[str, int | None, int]]:
        return [(d.kind, d.slot, d.irq) for d in self.manager.save()]

    def close(self) -> None:
        self.manager.close()
        os.close(self.volume_fd)
        for line in self.lines.values():
            line.close()


def guest_cid(built: Built) -> int:
    """The CID the guest reads in the vsock device's config space."""
    cid: int = struct.unpack("<Q", built.vsock.device.registers.read(0x100, 8))[0]
    return cid


@pytest.fixture
def build(loop: EventLoop, memory: GuestMemory,  # noqa: F811
          tmp_path: Path) -> Iterator[Callable[..., Built]]:
    made: list[Built] = []

    def make(**kwargs: Any) -> Built:
        made.append(Built(loop, memory, tmp_path, **kwargs))
        return made[-1]

    yield make
    for built in made:
        built.close()
    run_on_loop(loop, lambda: None)
    assert not loop.errors


def test_the_slot_order_is_fixed_and_the_pins_are_those_of_before(
        build: Callable[..., Built]) -> None:
    first = build(volumes=MAX_VOLUME_SLOTS)
    places = first.places()
    assert places == build(volumes=MAX_VOLUME_SLOTS).places()
    assert [k for k, _, _ in places] == ["serial", "vsock", "rng", "net", "blk", "balloon"] + \
        ["volume"] * MAX_VOLUME_SLOTS
    assert [s for _, s, _ in places] == [None, *range(5 + MAX_VOLUME_SLOTS)]
    assert [irq for _, _, irq in places[1:]] == old_rule_irqs(5, MAX_VOLUME_SLOTS)
    assert first.manager.next_slot == 5 + MAX_VOLUME_SLOTS
    # Without the entropy source every later device moves up a slot (as it always did).
    assert [irq for _, _, irq in build(rng=False, volumes=3).places()[1:]] == \
        old_rule_irqs(4, 3)


def test_a_saved_machine_restores_into_one_built_the_same_way(
        build: Callable[..., Built], loop: EventLoop) -> None:  # noqa: F811
    source = build(cid=7)
    source.serial.console.write(7, b"\x5a")   # the scratch register
    source.volumes[0].device.insert_media(source.volume_fd, KEY, DISK_BYTES, True, "/data")
    devices = run_on_loop(loop, source.manager.save)
    state = make_state()
    state.devices = devices
    back = stateformat.decode_state(stateformat.encode_state(MachineState(
        state.mem_size, state.vcpus, state.vm, devices)), MachineState)
    assert back.devices == devices
    target = build(cid=3, saved=back.devices)
    target.manager.restore(back.devices)
    assert guest_cid(target) == 7 and target.serial.save().scr == 0x5A
    assert target.volumes[0].disk.disk_key == KEY
    assert target.volumes[0].device.plan()[0][4] == "/data"
    assert run_on_loop(loop, target.manager.save) == devices


def test_a_machine_with_other_devices_is_refused_before_any_restore(
        build: Callable[..., Built], loop: EventLoop) -> None:  # noqa: F811
    devices = run_on_loop(loop, build(cid=7).manager.save)
    target = build(cid=3, rng=False)
    with pytest.raises(HostError, match=r"the snapshot's devices differ from this machine's: "
                                        r"the snapshot has serial \(irq 4\), vsock at "
                                        r"virtio-mmio.0 \(irq 5\), rng at virtio-mmio.1"):
        target.manager.restore(devices)
    assert guest_cid(target) == 3, "nothing was restored"
    with pytest.raises(HostError, match="snapshot's disk is c+, but this machine was given d+"):
        build(cid=3, disk_key="d" * 64, saved=devices)


def test_attach_refuses_a_second_single_device_and_an_own_pin_after_shared_ones(
        build: Callable[..., Built]) -> None:
    built = build(volumes=1, rng=False)
    with pytest.raises(ValueError, match="at most one balloon"):
        built.manager.attach_native(BALLOON, lambda slot, irq: pytest.fail("built"))
    with pytest.raises(ValueError, match="rng has a pin of its own: it goes before"):
        built.manager.attach_native(RNG, lambda slot, irq: pytest.fail("built"))
    with pytest.raises(ValueError, match="serial is not a virtio device"):
        built.manager.attach_native(SERIAL, lambda slot, irq: pytest.fail("built"))
    with pytest.raises(ValueError, match="vsock is a virtio device"):
        built.manager.attach_legacy(VSOCK, built.serial, 5)


def test_pins_run_out_with_a_clear_error() -> None:
    assert manager.slot_irq(L.IOAPIC_PINS - L.FIRST_DEVICE_IRQ - 1, None) == L.IOAPIC_PINS - 1
    with pytest.raises(ValueError, match="no IOAPIC pins left for another virtio device"):
        manager.slot_irq(L.IOAPIC_PINS - L.FIRST_DEVICE_IRQ, None)
    with pytest.raises(ValueError, match="no IOAPIC pins left for volume slots"):
        manager.slot_irq(30, L.IOAPIC_PINS - L.FIRST_DEVICE_IRQ)


class _Handle:
    """A ``NativeVirtio`` whose close is recorded, and fails if asked to."""

    def __init__(self, name: str, closed: list[str], fails: bool = False) -> None:
        self.name, self.closed, self.fails = name, closed, fails
        self.restored_from: DeviceState | None = None

    def save_state(self, slot: int, irq: int) -> DeviceState:
        raise AssertionError("not saved here")

    def close(self) -> None:
        self.closed.append(self.name)
        if self.fails:
            raise OSError(f"{self.name} failed to close")


def test_close_releases_each_device_last_attached_first() -> None:
    closed: list[str] = []
    devices = DeviceManager()
    for name, fails in (("first", False), ("second", True), ("third", False)):
        devices.attach_native(VOLUME, lambda slot, irq, n=name, f=fails: _Handle(n, closed, f))
    with pytest.raises(OSError, match="second failed to close"):
        devices.close()
    assert closed == ["third", "second", "first"], "a failing close stops none of the others"
    devices.close()   # idempotent: nothing is left to close
    assert closed == ["third", "second", "first"]


def test_machines_built_and_closed_leave_no_descriptors(loop: EventLoop,  # noqa: F811
                                                        memory: GuestMemory,  # noqa: F811
                                                        tmp_path: Path) -> None:
    """Real native devices (vsock's listener, the disks' files, the eventfds their
    servers duplicate), machine after machine: a close leaves vsock's socket file gone
    and no descriptor behind that the next machine's does not replace (the loop lets go
    of a removed server's last reference on its next turn, so one descriptor may live
    until then; the count never grows)."""
    counts = []
    for index in range(4):
        made = tmp_path / str(index)
        made.mkdir()
        built = Built(loop, memory, made)
        [uds] = [p for p in made.iterdir() if p.name.startswith("vsock-")]
        built.close()
        run_on_loop(loop, lambda: None)
        assert not uds.exists()
        counts.append(len(os.listdir("/proc/self/fd")))
    assert len(set(counts)) == 1, counts
