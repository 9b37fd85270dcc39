"""Capturing and restoring the state of a paused machine: vCPUs, VM, devices.

Everything here is plain data (``*State`` dataclasses); the live machine is an
argument. KVM's own structs are kept as their raw bytes (their layout is the
kernel's ABI, checked by ``tests/unit/test_kvm_abi.py``); our own state is
field-named, so the state file (``stateformat``) stays readable and extensible.

Ordering requirements -- vCPU save (``save_vcpu``):

1. ``MP_STATE`` first: the other GET ioctls may process pending events (an INIT
   or SIPI) and change it; we want the state as the vCPU was parked.
2. REGS, SREGS, XSAVE, XCRS, DEBUGREGS, LAPIC, CPUID, TSC kHz, then MSRs.
3. ``VCPU_EVENTS`` last: reading MSRs and the LAPIC can make KVM inject or
   queue events (e.g. a pending timer interrupt); capture them after everything
   that could create them.

vCPU restore (``restore_vcpu``):

1. ``CPUID`` first: KVM derives what the other SET ioctls accept (XSAVE size,
   valid MSRs, CR4 bits) from the guest CPUID.
2. ``MP_STATE``, REGS, SREGS (the paging mode), XSAVE and XCRS (XSAVE before
   XCRS: XCR0 must allow the features the XSAVE area holds), DEBUGREGS.
3. LAPIC after SREGS (the APIC base MSR lives in SREGS) and before MSRs: the
   TSC-deadline MSR is only accepted once the LAPIC is in TSC-deadline mode.
4. MSRs, with ``IA32_TSC`` before ``IA32_TSC_DEADLINE`` (the deadline is
   relative to the TSC value).
5. ``VCPU_EVENTS`` after REGS (they refer to the restored RIP) and last.
6. ``KVM_KVMCLOCK_CTRL``: tell the guest it was paused, so its watchdogs do not
   fire for the time the snapshot sat on disk.

VM state: the PIT, the kvmclock and the three irqchips (PIC master, PIC slave,
IOAPIC) are restored before any vCPU runs.

Restoring is split in two: ``prepare_restore`` turns the plain-data state into
the buffers the SET ioctls take (checking every size), and ``apply_restore``
only issues the ioctls: all vCPUs are created first, then the VM state, then each
vCPU in index order. The spawner prepares once per snapshot before it forks, so a
forked child neither decodes nor builds anything: it passes buffers it shares
copy-on-write with the spawner to the kernel, which only reads them.

The ioctls are issued by the native core (``vmfork._core.restore``, Rust on
kvm-ioctls): one call per restore, the GIL released, no Python between ioctls.
``apply_vm``/``apply_vcpu`` below are the same restore in Python; they run only
when the native core is not built (see ``NATIVE``), and are the reference the
native path is tested against (``tests/kvm/test_native_restore.py``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vmfork.kvm import api
from vmfork.kvm import structs as s
from vmfork.vmm import native as _native
from vmfork.vmm.devices import manager
from vmfork.vmm.devices.manager import DeviceKind, DeviceState
from vmfork.vmm.devices.virtio.vsock import DEFAULT_GUEST_CID
from vmfork.vmm.errors import HostError

# Where the core is not built the restore runs in Python; that fallback is the only
# reason the Python path below is kept; the state formats and their preparation stay
# Python's either way.
NATIVE = _native.CORE_BUILT  # read here by tests and bench

try:  # the tests compare the two paths in one process
    from vmfork import _core
except ImportError:
    pass

log = logging.getLogger(__name__)

MSR_IA32_TSC = 0x10
MSR_IA32_TSC_DEADLINE = 0x6E0


@dataclass
class VcpuState:
    index: int
    mp_state: int
    regs: bytes
    sregs: bytes
    xsave: bytes
    xcrs: bytes
    debugregs: bytes
    lapic: bytes
    cpuid: bytes          # kvm_cpuid_entry2[] as set on the vCPU
    msrs: dict[str, int]  # "0x<index>" -> value, every MSR KVM would read
    tsc_khz: int
    vcpu_events: bytes


@dataclass
class VmState:
    pic_master: bytes
    pic_slave: bytes
    ioapic: bytes
    pit: bytes
    clock: int
    clock_flags: int


R = TypeVar("R")


@dataclass
class MachineState:
    """Everything but guest memory. ``mem_size``, the vCPUs and the device list must
    match the machine it is restored into (``Machine`` rebuilds the same devices in
    the same slots; ``devices.manager``). The list is checked whole on construction
    (``manager.check_devices``), so a decoded state never lacks its serial device or
    holds two of a single kind."""

    mem_size: int
    vcpus: list[VcpuState]
    vm: VmState
    devices: list[DeviceState]
    cmdline: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        manager.check_devices(self.devices)

    @classmethod
    def upgrade_state_payload(cls, version: int, tree: Any) -> Any:
        """For ``stateformat``: format 1 had a field per device (``manager``)."""
        if version == 1:
            return manager.upgrade_format_1(tree)
        raise ValueError(f"no conversion from version {version}")

    def device(self, kind: DeviceKind[R]) -> R | None:
        """The record of the machine's one device of ``kind`` (``manager.VSOCK``, ...),
        None if it has none."""
        return manager.device_record(self.devices, kind)

    def devices_of(self, kind: DeviceKind[R]) -> list[R]:
        """The records of the machine's devices of ``kind`` (``manager.VOLUME``), in
        slot order."""
        return manager.device_records(self.devices, kind)

    @property
    def guest_cid(self) -> int:
        """The guest's vsock CID (the vsock device's; the default without one)."""
        vsock = self.device(manager.VSOCK)
        return vsock.guest_cid if vsock is not None else DEFAULT_GUEST_CID


def _raw(obj: ctypes.Structure) -> bytes:
    return ctypes.string_at(ctypes.addressof(obj), ctypes.sizeof(obj))


def _load(struct: type[ctypes.Structure], data: bytes, what: str) -> ctypes.Structure:
    if len(data) != ctypes.sizeof(struct):
        raise HostError(f"snapshot {what}: {len(data)} bytes, expected {ctypes.sizeof(struct)}",
                        op="restore")
    return struct.from_buffer_copy(data)


# -- MSRs -----------------------------------------------------------------------------
def readable_msrs(vcpu_fd: int, candidates: list[int]) -> dict[int, int]:
    """Read every MSR in ``candidates`` that KVM can read.

    ``KVM_GET_MSRS`` stops at the first MSR it cannot read and returns how many
    it read; we skip that one and continue, so the cost is one ioctl per
    unreadable MSR plus one.
    """
    values: dict[int, int] = {}
    rest = list(candidates)
    while rest:
        got = api.get_msrs(vcpu_fd, rest)
        values.update(got)
        if len(got) == len(rest):
            break
        rest = rest[len(got) + 1:]
    return values


def _ordered_msrs(msrs: dict[int, int]) -> dict[int, int]:
    """TSC first, TSC deadline last (see the ordering requirements)."""
    ordered = {}
    if MSR_IA32_TSC in msrs:
        ordered[MSR_IA32_TSC] = msrs[MSR_IA32_TSC]
    for index, value in msrs.items():
        if index not in (MSR_IA32_TSC, MSR_IA32_TSC_DEADLINE):
            ordered[index] = value
    if MSR_IA32_TSC_DEADLINE in msrs:
        ordered[MSR_IA32_TSC_DEADLINE] = msrs[MSR_IA32_TSC_DEADLINE]
    return ordered


# -- vCPUs ----------------------------------------------------------------------------
def save_vcpu(index: int, fd: int, msr_candidates: list[int]) -> VcpuState:
    mp_state = api.get_mp_state(fd)
    regs = _raw(api.get_regs(fd))
    sregs = _raw(api.get_sregs(fd))
    xsave = _raw(api.get_xsave(fd))
    xcrs = _raw(api.get_xcrs(fd))
    debugregs = _raw(api.get_debugregs(fd))
    lapic = _raw(api.get_lapic(fd))
    entries = api.get_cpuid2(fd)
    cpuid = b"".join(_raw(e) for e in entries)
    tsc_khz = api.get_tsc_khz(fd)
    msrs = readable_msrs(fd, msr_candidates)
    events = _raw(api.get_vcpu_events(fd))
    return VcpuState(index=index, mp_state=mp_state, regs=regs, sregs=sregs, xsave=xsave,
                     xcrs=xcrs, debugregs=debugregs, lapic=lapic, cpuid=cpuid,
                     msrs={f"{k:#x}": v for k, v in msrs.items()}, tsc_khz=tsc_khz,
                     vcpu_events=events)


@dataclass(frozen=True)
class PreparedVcpu:
    """One vCPU's state as the buffers its SET ioctls take (``prepare_vcpu``)."""

    index: int
    cpuid: ctypes.Structure          # kvm_cpuid2 with its entries
    tsc_khz: int
    mp_state: int
    regs: s.kvm_regs
    sregs: s.kvm_sregs
    xsave: s.kvm_xsave
    xcrs: s.kvm_xcrs
    debugregs: s.kvm_debugregs
    lapic: s.kvm_lapic_state
    msrs: ctypes.Structure           # kvm_msrs: every MSR, in the required order ...
    msr_values: tuple[tuple[int, int], ...]   # ... and the same as values, for retries
    vcpu_events: s.kvm_vcpu_events


def prepare_vcpu(state: VcpuState) -> PreparedVcpu:
    """Check ``state`` and build its ioctl buffers; ``HostError`` names a bad field."""
    entry_size = ctypes.sizeof(s.kvm_cpuid_entry2)
    if len(state.cpuid) % entry_size:
        raise HostError("snapshot cpuid: not a whole number of entries", op="restore")
    count = len(state.cpuid) // entry_size
    cpuid = s.kvm_cpuid2_with(count)()
    cpuid.nent = count
    ctypes.memmove(ctypes.addressof(cpuid.entries), state.cpuid, len(state.cpuid))
    ordered = tuple(_ordered_msrs({int(k, 16): v for k, v in state.msrs.items()}).items())
    return PreparedVcpu(
        index=state.index, cpuid=cpuid, tsc_khz=state.tsc_khz, mp_state=state.mp_state,
        regs=_load(s.kvm_regs, state.regs, "regs"),  # type: ignore[arg-type]
        sregs=_load(s.kvm_sregs, state.sregs, "sregs"),  # type: ignore[arg-type]
        xsave=_load(s.kvm_xsave, state.xsave, "xsave"),  # type: ignore[arg-type]
        xcrs=_load(s.kvm_xcrs, state.xcrs, "xcrs"),  # type: ignore[arg-type]
        debugregs=_load(s.kvm_debugregs, state.debugregs, "debugregs"),  # type: ignore[arg-type]
        lapic=_load(s.kvm_lapic_state, state.lapic, "lapic"),  # type: ignore[arg-type]
        msrs=api.msrs_buffer(dict(ordered)), msr_values=ordered,
        vcpu_events=_load(s.kvm_vcpu_events, state.vcpu_events, "vcpu_events"),  # type: ignore[arg-type]
    )


def apply_vcpu(fd: int, vcpu: PreparedVcpu, host_tsc_khz: int | None = None) -> list[int]:
    """Restore one vCPU in the order the module docstring gives; returns the MSRs KVM
    refused (logged, not fatal). ``vcpu`` is only read: its buffers may be shared."""
    api.set_cpuid2_buffer(fd, vcpu.cpuid)
    if host_tsc_khz is not None and vcpu.tsc_khz and vcpu.tsc_khz != host_tsc_khz:
        try:
            api.set_tsc_khz(fd, vcpu.tsc_khz)
        except OSError as err:
            log.warning("guest TSC was %d kHz, host is %d kHz and cannot scale it (%s): "
                        "guest time may drift", vcpu.tsc_khz, host_tsc_khz, err)
    api.set_mp_state(fd, vcpu.mp_state)
    api.set_regs(fd, vcpu.regs)
    api.set_sregs(fd, vcpu.sregs)
    api.set_xsave(fd, vcpu.xsave)
    api.set_xcrs(fd, vcpu.xcrs)
    api.set_debugregs(fd, vcpu.debugregs)
    api.set_lapic(fd, vcpu.lapic)
    # KVM_SET_MSRS stops at the first MSR it refuses: skip that one and set the
    # rest, from one private buffer (the prepared one is shared and only read;
    # building a buffer per refusal would create a ctypes type each time).
    refused = []
    total = len(vcpu.msr_values)
    done = api.set_msrs_buffer(fd, vcpu.msrs)
    retry = None
    entry_size = ctypes.sizeof(s.kvm_msr_entry)
    while done < total:
        refused.append(vcpu.msr_values[done][0])
        done += 1
        left = total - done
        if left == 0:
            break
        if retry is None:
            retry = type(vcpu.msrs)()
        retry.nmsrs = left
        ctypes.memmove(ctypes.addressof(retry.entries),
                       ctypes.addressof(vcpu.msrs.entries) + done * entry_size,
                       left * entry_size)
        done += api.set_msrs_buffer(fd, retry)
    if refused:
        log.debug("vcpu%d: KVM refused MSRs %s", vcpu.index, [hex(m) for m in refused])
    api.set_vcpu_events(fd, vcpu.vcpu_events)
    try:
        api.kvmclock_ctrl(fd)
    except OSError as err:
        if err.errno != errno.EINVAL:  # EINVAL: the guest has no kvmclock page yet
            raise
    return refused


def restore_vcpu(fd: int, state: VcpuState, host_tsc_khz: int | None = None) -> list[int]:
    """Restore one vCPU from plain state; returns the MSRs KVM refused."""
    return apply_vcpu(fd, prepare_vcpu(state), host_tsc_khz)


# -- the VM ---------------------------------------------------------------------------
def save_vm(vm_fd: int) -> VmState:
    clock = api.get_clock(vm_fd)
    return VmState(
        pic_master=_raw(api.get_irqchip(vm_fd, api.IRQCHIP_PIC_MASTER)),
        pic_slave=_raw(api.get_irqchip(vm_fd, api.IRQCHIP_PIC_SLAVE)),
        ioapic=_raw(api.get_irqchip(vm_fd, api.IRQCHIP_IOAPIC)),
        pit=_raw(api.get_pit2(vm_fd)),
        clock=int(clock.clock),
        clock_flags=int(clock.flags),
    )


@dataclass(frozen=True)
class PreparedVm:
    """The VM-wide state as the buffers its SET ioctls take."""

    pit: s.kvm_pit_state2
    clock: s.kvm_clock_data
    irqchips: tuple[s.kvm_irqchip, ...]   # PIC master, PIC slave, IOAPIC


@dataclass(frozen=True)
class PreparedRestore:
    """Everything a restore sets through KVM, built once per snapshot: as ctypes
    buffers for the Python path and, where the native core is built, as its own
    (``native``, the same bytes as KVM structs in Rust)."""

    vm: PreparedVm
    vcpus: tuple[PreparedVcpu, ...]
    native: _core.PreparedRestore | None = None


def prepare_vm(state: VmState) -> PreparedVm:
    return PreparedVm(
        pit=_load(s.kvm_pit_state2, state.pit, "pit"),  # type: ignore[arg-type]
        # Only the clock value: the TSC-stable flag describes the source host.
        clock=s.kvm_clock_data(clock=state.clock),
        irqchips=tuple(_load(s.kvm_irqchip, getattr(state, name), name)  # type: ignore[misc]
                       for name in ("pic_master", "pic_slave", "ioapic")))


def prepare_restore(state: MachineState, *, native: bool = NATIVE) -> PreparedRestore:
    """Check ``state`` and build every buffer its restore sets (``HostError`` if bad);
    ``native=False`` leaves out the native core's buffers (``apply_restore`` then
    runs the Python path)."""
    vcpus = tuple(prepare_vcpu(v) for v in state.vcpus)
    return PreparedRestore(prepare_vm(state.vm), vcpus,
                           _prepare_native(state, vcpus) if native else None)


def _prepare_native(state: MachineState, vcpus: tuple[PreparedVcpu, ...]) -> _core.PreparedRestore:
    """The native core's buffers, from the same bytes (sizes already checked) and the
    MSRs in the order ``prepare_vcpu`` gave them."""
    try:
        return _core.PreparedRestore(
            pit=state.vm.pit, clock=state.vm.clock,
            irqchips=(state.vm.pic_master, state.vm.pic_slave, state.vm.ioapic),
            vcpus=[_core.PreparedVcpu(
                index=v.index, cpuid=v.cpuid, tsc_khz=v.tsc_khz, mp_state=v.mp_state,
                regs=v.regs, sregs=v.sregs, xsave=v.xsave, xcrs=v.xcrs,
                debugregs=v.debugregs, lapic=v.lapic, msrs=list(p.msr_values),
                vcpu_events=v.vcpu_events) for v, p in zip(state.vcpus, vcpus)])
    except (ValueError, OverflowError) as err:
        raise HostError(f"native restore buffers: {err}", op="restore") from err


def apply_restore(kvm_fd: int, vm_fd: int, vcpu_fds: list[int],
                  prepared: PreparedRestore) -> list[list[int]]:
    """Set a snapshot's VM and vCPU state on a fresh VM whose vCPUs exist
    (``vcpu_fds[i]`` is vCPU ``prepared.vcpus[i].index``): the VM state, then each
    vCPU, in the order the module docstring gives. Returns the MSRs KVM refused, per
    vCPU (logged, not fatal). Natively when ``prepared`` has the native buffers.
    (A machine restores through its VM core, ``Machine._create``; this is the
    reference path the tests hold the native one to, and bench/restore.py's.)"""
    if len(vcpu_fds) != len(prepared.vcpus):
        raise HostError(f"{len(vcpu_fds)} vCPUs for a snapshot of {len(prepared.vcpus)}",
                        op="restore")
    if prepared.native is not None:
        try:
            refused, unscaled = _core.restore(kvm_fd, vm_fd, vcpu_fds, prepared.native)
        except _core.IoctlError as err:
            raise kvm_error(err) from err
        return report_native_restore(prepared, refused, unscaled)
    apply_vm(vm_fd, prepared.vm)
    host_tsc_khz = None
    refused = []
    for fd, vcpu in zip(vcpu_fds, prepared.vcpus):
        if host_tsc_khz is None:
            host_tsc_khz = api.get_tsc_khz(fd)
        refused.append(apply_vcpu(fd, vcpu, host_tsc_khz))
    return refused


def kvm_error(err: _core.IoctlError) -> api.KvmError:
    """A native call's failed ioctl as the ``KvmError`` the Python wrappers raise
    (the same op name and errno, the vCPU as detail). Read by attribute: an
    ``OSError`` made with three arguments keeps only two in ``args`` (the third is
    its ``filename``, here the vCPU index), so unpacking ``args`` failed exactly for
    a per-vCPU ioctl."""
    index = err.filename
    return api.KvmError(str(err.strerror), int(err.errno or 0),
                        "" if index is None else f"vcpu{index}")


def report_native_restore(prepared: PreparedRestore, refused: list[list[int]],
                          unscaled: list[tuple[int, int, int, int]]) -> list[list[int]]:
    """Log what a native restore reported (TSC frequencies this host could not set,
    MSRs KVM refused); returns the refused MSRs, per vCPU."""
    for index, wanted, host, code in unscaled:
        log.warning("guest TSC was %d kHz, host is %d kHz and cannot scale it (%s): "
                    "guest time may drift (vcpu%d)", wanted, host, os.strerror(code), index)
    for vcpu, msrs in zip(prepared.vcpus, refused):
        if msrs:
            log.debug("vcpu%d: KVM refused MSRs %s", vcpu.index, [hex(m) for m in msrs])
    return refused


def apply_vm(vm_fd: int, vm: PreparedVm) -> None:
    api.set_pit2(vm_fd, vm.pit)
    api.set_clock(vm_fd, vm.clock)
    for chip in vm.irqchips:
        api.set_irqchip(vm_fd, chip)


def restore_vm(vm_fd: int, state: VmState) -> None:
    apply_vm(vm_fd, prepare_vm(state))
