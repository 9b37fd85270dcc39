"""The native restore (``vmfork._core.restore``) sets exactly what the Python
restore (``vmstate.apply_vm``/``apply_vcpu``) sets.

One snapshot of a running tiny guest with two vCPUs (the second never started, so
its MP state differs from the first's) and two MSRs this KVM refuses, restored
into one fresh machine through each path; every VM and vCPU state that KVM reports
back must be the same in both, and the same as the snapshot's. Only what the
kernel derives from the host's clock at the moment it is read or set differs
between two restores, and is compared with a tolerance: the kvmclock value, the
PIT channels' load times, the guest TSC (IA32_TSC), the LAPIC timer's current
count, and two Hyper-V MSRs KVM computes when they are read (the reference time
counter from the kvmclock, the vCPU's run time from the host thread's).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import pytest

from tests.kvm.tinyguest import Script, script_machine, wait_until
from vmfork.kvm import api
from vmfork.kvm import structs as s
from vmfork.vmm import vmstate
from vmfork.vmm.machine import Machine, MachineConfig

pytestmark = pytest.mark.skipif(not vmstate.NATIVE, reason="the native core is not built "
                                "(scripts/lib.sh setup_native)")

COUNTER = 0x300000
BOGUS_A, BOGUS_B = 0x4B56_0F01, 0x4B56_0F02   # in no MSR range KVM emulates
SYSENTER_ESP = 0x175
MSR_IA32_TSC = 0x10
HV_X64_MSR_VP_RUNTIME, HV_X64_MSR_TIME_REF_COUNT = 0x4000_0010, 0x4000_0020
CLOCK_DERIVED_MSRS = {f"{m:#x}" for m in (MSR_IA32_TSC, HV_X64_MSR_VP_RUNTIME,
                                           HV_X64_MSR_TIME_REF_COUNT)}
APIC_TMCCT = 0x390          # the LAPIC timer's current count, computed when read
SECOND_NS = 1_000_000_000
PIT_CHANNEL = ctypes.sizeof(s.kvm_pit_channel_state)
PIT_LOAD_TIME = s.kvm_pit_channel_state.count_load_time.offset


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[vmstate.MachineState,
                                                                         str]]:
    mem = str(tmp_path_factory.mktemp("native-restore") / "memory.bin")
    parent, _ = script_machine(Script().count_forever(COUNTER), memfd=True, vcpus=2)
    with parent:
        parent.start()
        assert wait_until(lambda: parent.memory.read_u64(COUNTER) > 10_000)
        state, _ = parent.snapshot(mem, resume=False)
        parent.stop()
    # A mix of MSRs KVM refuses between ones it sets: both paths skip exactly those.
    msrs = state.vcpus[0].msrs
    msrs[f"{BOGUS_A:#x}"] = 1
    msrs[f"{SYSENTER_ESP:#x}"] = 0x2000
    msrs[f"{BOGUS_B:#x}"] = 2
    yield state, mem


def restored(state: vmstate.MachineState, mem: str, native: bool) -> Machine:
    prepared = vmstate.prepare_restore(state, native=native)
    assert (prepared.native is not None) == native
    return Machine(MachineConfig(restore_state=state, restore_prepared=prepared,
                                 memory_file=mem, mem_mib=64, vcpus=len(state.vcpus),
                                 rng=False, memfd=False))


def read_back(m: Machine) -> tuple[vmstate.VmState, list[vmstate.VcpuState]]:
    """What KVM holds now, read by the ordinary save path (the vCPUs never ran)."""
    candidates = api.get_msr_index_list(m.kvm_fd)
    return (vmstate.save_vm(m.vm_fd),
            [vmstate.save_vcpu(v.index, v.fd, candidates) for v in m.vcpus])


def without_pit_load_times(pit: bytes) -> bytes:
    out = bytearray(pit)
    for channel in range(3):
        at = channel * PIT_CHANNEL + PIT_LOAD_TIME
        out[at:at + 8] = bytes(8)
    return bytes(out)


def without_timer_count(lapic: bytes) -> bytes:
    return lapic[:APIC_TMCCT] + bytes(4) + lapic[APIC_TMCCT + 4:]


def assert_same_vcpu(a: vmstate.VcpuState, b: vmstate.VcpuState, what: str) -> None:
    for name in ("index", "mp_state", "regs", "sregs", "xsave", "xcrs", "debugregs", "cpuid",
                 "tsc_khz", "vcpu_events"):
        assert getattr(a, name) == getattr(b, name), f"vcpu{a.index} {name}: {what}"
    assert without_timer_count(a.lapic) == without_timer_count(b.lapic), \
        f"vcpu{a.index} lapic: {what}"
    assert a.msrs.keys() == b.msrs.keys(), f"vcpu{a.index} msr list: {what}"
    assert {k: v for k, v in a.msrs.items() if k not in CLOCK_DERIVED_MSRS} == \
        {k: v for k, v in b.msrs.items() if k not in CLOCK_DERIVED_MSRS}, \
        f"vcpu{a.index} msrs: {what}"


def test_native_and_python_restores_leave_the_same_state(
        snapshot: tuple[vmstate.MachineState, str]) -> None:
    state, mem = snapshot
    with restored(state, mem, native=True) as native, \
            restored(state, mem, native=False) as python:
        assert native.restore_refused_msrs == python.restore_refused_msrs == [
            [BOGUS_A, BOGUS_B], []]
        native_vm, native_vcpus = read_back(native)
        python_vm, python_vcpus = read_back(python)

        for vm in (native_vm, python_vm):
            assert (vm.pic_master, vm.pic_slave, vm.ioapic) == (
                state.vm.pic_master, state.vm.pic_slave, state.vm.ioapic)
            assert without_pit_load_times(vm.pit) == without_pit_load_times(state.vm.pit)
            assert state.vm.clock <= vm.clock < state.vm.clock + 120 * SECOND_NS
        assert abs(native_vm.clock - python_vm.clock) < 60 * SECOND_NS

        assert native_vcpus[0].mp_state != native_vcpus[1].mp_state  # both kinds covered
        for n, p, snap in zip(native_vcpus, python_vcpus, state.vcpus):
            assert_same_vcpu(n, p, "native and Python restores differ")
            snapshot_msrs = {k: v for k, v in snap.msrs.items()
                             if int(k, 16) not in (BOGUS_A, BOGUS_B)}
            assert_same_vcpu(n, vmstate.VcpuState(**{**vars(snap), "msrs": snapshot_msrs}),
                             "the restore differs from the snapshot")
            # IA32_TSC is not compared with the snapshot's: KVM takes a host write
            # that is within a second's worth of cycles of what it expects (here:
            # of a vCPU created an instant ago, as a young snapshot's TSC is) for a
            # synchronisation, and keeps its own offset.
        assert native_vcpus[0].msrs[f"{SYSENTER_ESP:#x}"] == 0x2000

        at_snapshot = native.memory.read_u64(COUNTER)
        for m in (native, python):
            m.start()
        for m in (native, python):
            assert wait_until(lambda m=m: m.memory.read_u64(COUNTER) > at_snapshot + 1000)


def test_a_native_restore_names_the_failed_ioctl(
        snapshot: tuple[vmstate.MachineState, str]) -> None:
    state, _ = snapshot
    prepared = vmstate.prepare_restore(state)
    assert prepared.native is not None
    with contextlib.ExitStack() as fds:
        kvm = api.open_kvm()
        fds.callback(os.close, kvm)
        vm = api.create_vm(kvm)    # no PIT: KVM_SET_PIT2 has nothing to set
        fds.callback(os.close, vm)
        vcpus = []
        for v in state.vcpus:
            vcpus.append(api.create_vcpu(vm, v.index))
            fds.callback(os.close, vcpus[-1])
        with pytest.raises(api.KvmError, match="KVM_SET_PIT2"):
            vmstate.apply_restore(kvm, vm, vcpus, prepared)
