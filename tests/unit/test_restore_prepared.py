"""Restore buffers built once per snapshot (``vmstate.prepare_restore``) and the
per-snapshot cache a zygote fills before it forks (``vmmchild.load_snapshot``).
No /dev/kvm: these check what the buffers hold and when the cache is trusted."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from vmfork.kvm import structs as s
from vmfork.ondisk import stateformat
from vmfork.ondisk.stateformat import StateFormatError, write_state_file
from vmfork.runtime import vmmchild
from vmfork.vmm import vmstate
from vmfork.vmm.devices.manager import BALLOON, KINDS, RNG, VSOCK, DeviceKind, DeviceState, slot_irq
from vmfork.vmm.devices.plan import device_plan
from vmfork.vmm.devices.serial import SerialState
from vmfork.vmm.devices.virtio.balloon import BalloonState
from vmfork.vmm.devices.virtio.mmio import MmioTransportState
from vmfork.vmm.devices.virtio.queue import QueueState
from vmfork.vmm.devices.virtio.rng import RngState
from vmfork.vmm.devices.virtio.vsock import VsockState
from vmfork.vmm.errors import HostError
from vmfork.vmm.vmstate import (
    MSR_IA32_TSC,
    MSR_IA32_TSC_DEADLINE,
    MachineState,
    VcpuState,
    VmState,
    prepare_restore,
)


def pattern(struct: type[ctypes.Structure], seed: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(ctypes.sizeof(struct)))


def make_state(cpuid_entries: int = 3) -> MachineState:
    cpuid = b"".join(pattern(s.kvm_cpuid_entry2, 40 + i) for i in range(cpuid_entries))
    vcpu = VcpuState(
        index=0, mp_state=3, regs=pattern(s.kvm_regs, 1), sregs=pattern(s.kvm_sregs, 2),
        xsave=pattern(s.kvm_xsave, 3), xcrs=pattern(s.kvm_xcrs, 4),
        debugregs=pattern(s.kvm_debugregs, 5), lapic=pattern(s.kvm_lapic_state, 6),
        cpuid=cpuid,
        msrs={f"{MSR_IA32_TSC_DEADLINE:#x}": 9, "0x174": 7, f"{MSR_IA32_TSC:#x}": 8},
        tsc_khz=2_000_000, vcpu_events=pattern(s.kvm_vcpu_events, 7))
    vm = VmState(pic_master=pattern(s.kvm_irqchip, 10), pic_slave=pattern(s.kvm_irqchip, 11),
                 ioapic=pattern(s.kvm_irqchip, 12), pit=pattern(s.kvm_pit_state2, 13),
                 clock=123456789, clock_flags=2)
    return MachineState(mem_size=64 << 20, vcpus=[vcpu], vm=vm,
                        devices=[DeviceState("serial", 1, None, 4, SerialState())])


def add_device(state: MachineState, kind: DeviceKind[Any], record: object,
               transport: MmioTransportState) -> DeviceState:
    """Put a virtio device into ``state``'s next slot, on the pin a machine gives it."""
    slot = sum(d.slot is not None for d in state.devices)
    first_shared = next((d.slot for d in state.devices if KINDS[d.kind].shares_pin), None)
    if kind.shares_pin and first_shared is None:
        first_shared = slot
    entry = DeviceState(kind.name, kind.version, slot, slot_irq(slot, first_shared), record,
                        transport)
    state.devices.append(entry)
    return entry


def format_1_file(state: MachineState, **fields: object) -> bytes:
    """``state`` (serial only) as a format-1 writer wrote it, with these device fields
    (format 1's shapes, as JSON values) besides its serial."""
    tree = stateformat.to_json_value(state)
    del tree["devices"]
    tree.update(serial=stateformat.to_json_value(SerialState()), guest_cid=3, **fields)
    body = json.dumps(tree).encode()
    return struct.pack("<8sIIQ32s", stateformat.MAGIC, 1, 0, len(body),
                       hashlib.sha256(body).digest()) + body


def raw(obj: ctypes.Structure) -> bytes:
    return ctypes.string_at(ctypes.addressof(obj), ctypes.sizeof(obj))


def test_prepared_buffers_hold_the_snapshot_bytes() -> None:
    state = make_state()
    prepared = prepare_restore(state)
    (vcpu,) = prepared.vcpus
    src = state.vcpus[0]
    assert raw(vcpu.regs) == src.regs and raw(vcpu.sregs) == src.sregs
    assert raw(vcpu.xsave) == src.xsave and raw(vcpu.lapic) == src.lapic
    assert raw(vcpu.vcpu_events) == src.vcpu_events
    assert vcpu.cpuid.nent == 3  # type: ignore[attr-defined]
    entries = ctypes.string_at(ctypes.addressof(vcpu.cpuid.entries),  # type: ignore[attr-defined]
                               len(src.cpuid))
    assert entries == src.cpuid
    assert [raw(c) for c in prepared.vm.irqchips] == [state.vm.pic_master, state.vm.pic_slave,
                                                      state.vm.ioapic]
    assert prepared.vm.clock.clock == 123456789 and prepared.vm.clock.flags == 0


def test_prepared_msrs_put_tsc_first_and_tsc_deadline_last() -> None:
    (vcpu,) = prepare_restore(make_state()).vcpus
    order = [index for index, _ in vcpu.msr_values]
    assert order == [MSR_IA32_TSC, 0x174, MSR_IA32_TSC_DEADLINE]
    buf = vcpu.msrs
    assert buf.nmsrs == 3  # type: ignore[attr-defined]
    assert [(buf.entries[i].index, buf.entries[i].data)  # type: ignore[attr-defined]
            for i in range(3)] == [(MSR_IA32_TSC, 8), (0x174, 7), (MSR_IA32_TSC_DEADLINE, 9)]


@pytest.mark.parametrize("field", ["regs", "xsave", "cpuid"])
def test_prepare_names_a_field_of_the_wrong_size(field: str) -> None:
    state = make_state()
    setattr(state.vcpus[0], field, getattr(state.vcpus[0], field)[:-1])
    with pytest.raises(HostError, match=field):
        prepare_restore(state)


@pytest.fixture
def snapshot_dir(tmp_path: Path) -> Path:
    vmmchild._snapshots.clear()
    write_state_file(tmp_path / "state.bin", make_state())
    yield tmp_path
    vmmchild._snapshots.clear()


def test_load_snapshot_decodes_once_while_the_file_is_unchanged(snapshot_dir: Path) -> None:
    state, prepared = vmmchild.load_snapshot(str(snapshot_dir))
    again, prepared_again = vmmchild.load_snapshot(str(snapshot_dir))
    assert again is state and prepared_again is prepared
    assert state == make_state()


def test_load_snapshot_rereads_a_replaced_file(snapshot_dir: Path) -> None:
    state, _ = vmmchild.load_snapshot(str(snapshot_dir))
    changed = make_state(cpuid_entries=4)
    write_state_file(snapshot_dir / "state.bin", changed)  # a new inode (rename)
    fresh, prepared = vmmchild.load_snapshot(str(snapshot_dir))
    assert fresh is not state and fresh == changed
    assert prepared.vcpus[0].cpuid.nent == 4  # type: ignore[attr-defined]


def test_a_damaged_file_is_reported_and_never_cached(snapshot_dir: Path) -> None:
    vmmchild.load_snapshot(str(snapshot_dir))
    path = snapshot_dir / "state.bin"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    tmp = snapshot_dir / "state.tmp"
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)
    with pytest.raises(StateFormatError, match="checksum"):
        vmmchild.load_snapshot(str(snapshot_dir))
    with pytest.raises(StateFormatError, match="checksum"):
        vmmchild.load_snapshot(str(snapshot_dir))
    vmmchild.prefork([{"snapshot_dir": str(snapshot_dir)}])  # logs, never raises


native = pytest.mark.skipif(not vmstate.NATIVE, reason="the native core is not built "
                            "(scripts/lib.sh setup_native)")


@native
def test_prepare_builds_the_native_buffers_unless_asked_not_to() -> None:
    prepared = prepare_restore(make_state())
    assert prepared.native is not None and prepared.native.vcpu_count == 1
    assert prepare_restore(make_state(), native=False).native is None


@native
@pytest.mark.parametrize("field", ["regs", "sregs", "xsave", "xcrs", "debugregs", "lapic",
                                   "vcpu_events", "cpuid"])
def test_the_native_core_checks_every_size_itself(field: str) -> None:
    from vmfork import _core
    v = make_state().vcpus[0]
    fields = {name: getattr(v, name) for name in (
        "index", "cpuid", "tsc_khz", "mp_state", "regs", "sregs", "xsave", "xcrs",
        "debugregs", "lapic", "vcpu_events")}
    _core.PreparedVcpu(**fields, msrs=[(0x174, 7)])
    fields[field] = fields[field][:-1]
    with pytest.raises(ValueError, match=f"snapshot {field}"):
        _core.PreparedVcpu(**fields, msrs=[(0x174, 7)])


@native
def test_more_msrs_than_one_kvm_set_msrs_takes_are_refused_by_name() -> None:
    state = make_state()
    state.vcpus[0].msrs = {f"{0xC000_0000 + i:#x}": i for i in range(257)}
    with pytest.raises(HostError, match="msrs: 257 entries, at most 256"):
        prepare_restore(state)


def test_load_snapshot_builds_the_native_devices_plans_once(snapshot_dir: Path) -> None:
    """The zygote's cache holds the plans a forked child's ``Machine`` is handed
    (``MachineConfig.restore_plans``): those of the kinds it serves natively, here
    rng's, the balloon's and vsock's, built once while the file is unchanged."""
    state = make_state()
    queue = QueueState(64, 64, True, 0x1000, 0x2000, 0x3000, 5, 4)
    for kind, record, device_type, queues in (
            (RNG, RngState(acked_features=0), 4, 1),
            (BALLOON, BalloonState(acked_features=0, actual=9), 5, 3),
            (VSOCK, VsockState(guest_cid=7, acked_features=0), 19, 3)):
        add_device(state, kind, record, MmioTransportState(
            device_type=device_type, status=0, device_features_sel=0, driver_features_sel=0,
            driver_features=0, driver_features_bad=False, queue_sel=0, interrupt_status=0,
            config_generation=0, queues=[queue] * queues))
    write_state_file(snapshot_dir / "state.bin", state)
    loaded = vmmchild._load_snapshot(str(snapshot_dir))
    assert loaded.plans == {d.slot: device_plan(d) for d in state.devices
                            if d.kind in ("rng", "balloon", "vsock")}
    assert vmmchild._load_snapshot(str(snapshot_dir)).plans is loaded.plans


def test_a_record_that_fits_no_plan_leaves_the_plans_to_the_machine(
        snapshot_dir: Path) -> None:
    state = make_state()
    add_device(state, RNG, RngState(acked_features=0), MmioTransportState(
        device_type=5, status=0, device_features_sel=0, driver_features_sel=0,
        driver_features=0, driver_features_bad=False, queue_sel=0, interrupt_status=0,
        config_generation=0))   # a balloon's transport: device_plan refuses it
    write_state_file(snapshot_dir / "state.bin", state)
    loaded = vmmchild._load_snapshot(str(snapshot_dir))
    assert loaded.plans is None and loaded.state == state
