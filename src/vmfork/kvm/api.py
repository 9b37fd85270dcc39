"""Flat wrappers around the KVM ioctls, one function per ioctl.

Every call goes through libc's ``ioctl`` via ctypes, not ``fcntl.ioctl``: ctypes
releases the GIL for the duration of the call, and buffers are ctypes objects passed
by reference (no 1024-byte limit, no copies). ``KVM_RUN`` is not here: the vCPU loop
is the native core's (``vmm/vcpu.py``).

Errors raise ``KvmError`` carrying the ioctl name and errno.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os

from vmfork.kvm import ioctls as io
from vmfork.kvm import structs as s

_libc = ctypes.CDLL(None, use_errno=True)
_libc_ioctl = _libc.ioctl
_libc_ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc_ioctl.restype = ctypes.c_int

KVM_API_VERSION = 12

# Exit reasons (struct kvm_run.exit_reason)
EXIT_UNKNOWN = 0
EXIT_EXCEPTION = 1
EXIT_IO = 2
EXIT_HYPERCALL = 3
EXIT_DEBUG = 4
EXIT_HLT = 5
EXIT_MMIO = 6
EXIT_IRQ_WINDOW_OPEN = 7
EXIT_SHUTDOWN = 8
EXIT_FAIL_ENTRY = 9
EXIT_INTR = 10
EXIT_INTERNAL_ERROR = 17
EXIT_SYSTEM_EVENT = 24
EXIT_NAMES = {
    0: "unknown", 1: "exception", 2: "io", 3: "hypercall", 4: "debug", 5: "hlt", 6: "mmio",
    7: "irq_window_open", 8: "shutdown", 9: "fail_entry", 10: "intr", 11: "set_tpr",
    12: "tpr_access", 17: "internal_error", 24: "system_event",
}

EXIT_IO_IN = 0
EXIT_IO_OUT = 1

SYSTEM_EVENT_SHUTDOWN = 1
SYSTEM_EVENT_RESET = 2
SYSTEM_EVENT_CRASH = 3

# Capabilities (KVM_CHECK_EXTENSION)
CAP_IRQCHIP = 0
CAP_HLT = 1
CAP_USER_MEMORY = 3
CAP_SET_TSS_ADDR = 4
CAP_EXT_CPUID = 7
CAP_NR_VCPUS = 9
CAP_MP_STATE = 14
CAP_IRQFD = 32
CAP_PIT2 = 33
CAP_PIT_STATE2 = 35
CAP_IOEVENTFD = 36
CAP_SET_IDENTITY_MAP_ADDR = 37
CAP_ADJUST_CLOCK = 39
CAP_VCPU_EVENTS = 41
CAP_DEBUGREGS = 50
CAP_XSAVE = 55
CAP_XCRS = 56
CAP_TSC_CONTROL = 60
CAP_GET_TSC_KHZ = 61
CAP_MAX_VCPUS = 66
CAP_KVMCLOCK_CTRL = 76
CAP_IMMEDIATE_EXIT = 136
CAP_XSAVE2 = 208

# The capabilities the VMM cannot work without, with what each is for.
REQUIRED_CAPS = {
    CAP_IRQCHIP: "in-kernel interrupt controllers",
    CAP_HLT: "HLT handled in the kernel",
    CAP_USER_MEMORY: "user-space guest memory slots",
    CAP_SET_TSS_ADDR: "TSS address for the vCPU",
    CAP_EXT_CPUID: "guest CPUID",
    CAP_PIT2: "in-kernel PIT",
    CAP_IRQFD: "interrupts from device threads without exits",
    CAP_IOEVENTFD: "virtio notifications without user-space exits",
    CAP_IMMEDIATE_EXIT: "kicking a vCPU out of KVM_RUN",
    CAP_MP_STATE: "vCPU MP state (snapshots)",
    CAP_VCPU_EVENTS: "pending events (snapshots)",
    CAP_DEBUGREGS: "debug registers (snapshots)",
    CAP_XSAVE: "extended FPU state (snapshots)",
    CAP_XCRS: "XCR0 (snapshots)",
    CAP_ADJUST_CLOCK: "kvmclock (snapshots)",
}

# Flags
MEM_LOG_DIRTY_PAGES = 1 << 0
MEM_READONLY = 1 << 1
IOEVENTFD_FLAG_DATAMATCH = 1 << 0
IOEVENTFD_FLAG_PIO = 1 << 1
IOEVENTFD_FLAG_DEASSIGN = 1 << 2
IRQFD_FLAG_DEASSIGN = 1 << 0
PIT_SPEAKER_DUMMY = 1
MP_STATE_RUNNABLE = 0
MP_STATE_UNINITIALIZED = 1
MP_STATE_INIT_RECEIVED = 2
MP_STATE_HALTED = 3
MP_STATE_SIPI_RECEIVED = 4
IRQCHIP_PIC_MASTER = 0
IRQCHIP_PIC_SLAVE = 1
IRQCHIP_IOAPIC = 2
CLOCK_TSC_STABLE = 2


class KvmError(OSError):
    """An ioctl failed. ``op`` names it; ``errno`` is the kernel's answer."""

    def __init__(self, op: str, err: int, detail: str = "") -> None:
        msg = f"{op}: {os.strerror(err)}"
        if detail:
            msg += f" ({detail})"
        super().__init__(err, msg)
        self.op = op


def _ioctl(fd: int, request: int, arg: object = None, op: str = "ioctl") -> int:
    if arg is None:
        ptr: int | None = None
    elif isinstance(arg, int):
        ptr = arg
    else:
        ptr = ctypes.addressof(arg)  # type: ignore[arg-type]
    ret = _libc_ioctl(fd, request, ptr)
    if ret < 0:
        raise KvmError(op, ctypes.get_errno())
    return int(ret)


# -- /dev/kvm -------------------------------------------------------------------------
KVM_PATH = "/dev/kvm"


def open_kvm(path: str = KVM_PATH) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise KvmError("open /dev/kvm", errno_mod.ENOENT,
                       "no KVM on this host: load kvm_intel/kvm_amd, or use a host with "
                       "hardware virtualisation") from err
    except PermissionError as err:
        raise KvmError("open /dev/kvm", errno_mod.EACCES,
                       "add your user to the kvm group or run as root") from err


def get_api_version(kvm_fd: int) -> int:
    return _ioctl(kvm_fd, io.KVM_GET_API_VERSION, op="KVM_GET_API_VERSION")


def check_extension(fd: int, cap: int) -> int:
    return _ioctl(fd, io.KVM_CHECK_EXTENSION, cap, op="KVM_CHECK_EXTENSION")


def create_vm(kvm_fd: int) -> int:
    return _ioctl(kvm_fd, io.KVM_CREATE_VM, 0, op="KVM_CREATE_VM")


def get_supported_cpuid(kvm_fd: int, max_entries: int = 256) -> list[s.kvm_cpuid_entry2]:
    while True:
        buf = s.kvm_cpuid2_with(max_entries)()
        buf.nent = max_entries
        try:
            _ioctl(kvm_fd, io.KVM_GET_SUPPORTED_CPUID, buf, op="KVM_GET_SUPPORTED_CPUID")
        except KvmError as err:
            if err.errno == errno_mod.E2BIG and max_entries < 4096:
                max_entries *= 2
                continue
            raise
        return [buf.entries[i] for i in range(buf.nent)]


def _get_msr_list(kvm_fd: int, request: int, op: str) -> list[int]:
    probe = s.kvm_msr_list()
    probe.nmsrs = 0
    try:
        _ioctl(kvm_fd, request, probe, op=op)
    except KvmError as err:
        if err.errno != errno_mod.E2BIG:
            raise
    buf = s.kvm_msr_list_with(probe.nmsrs)()
    buf.nmsrs = probe.nmsrs
    _ioctl(kvm_fd, request, buf, op=op)
    return [int(buf.indices[i]) for i in range(buf.nmsrs)]


def get_msr_index_list(kvm_fd: int) -> list[int]:
    return _get_msr_list(kvm_fd, io.KVM_GET_MSR_INDEX_LIST, "KVM_GET_MSR_INDEX_LIST")


# -- VM fd ----------------------------------------------------------------------------
def create_vcpu(vm_fd: int, vcpu_id: int) -> int:
    return _ioctl(vm_fd, io.KVM_CREATE_VCPU, vcpu_id, op="KVM_CREATE_VCPU")


def set_tss_addr(vm_fd: int, addr: int) -> None:
    # The address is an unsigned long above 2 GiB: passed as a plain integer
    # argument through c_void_p, never through fcntl's signed int.
    _ioctl(vm_fd, io.KVM_SET_TSS_ADDR, addr, op="KVM_SET_TSS_ADDR")


def create_irqchip(vm_fd: int) -> None:
    _ioctl(vm_fd, io.KVM_CREATE_IRQCHIP, 0, op="KVM_CREATE_IRQCHIP")


def create_pit2(vm_fd: int, flags: int = PIT_SPEAKER_DUMMY) -> None:
    _ioctl(vm_fd, io.KVM_CREATE_PIT2, s.kvm_pit_config(flags=flags), op="KVM_CREATE_PIT2")


def irq_line(vm_fd: int, irq: int, level: int) -> None:
    _ioctl(vm_fd, io.KVM_IRQ_LINE, s.kvm_irq_level(irq=irq, level=level), op="KVM_IRQ_LINE")


def irqfd(vm_fd: int, fd: int, gsi: int, deassign: bool = False) -> None:
    arg = s.kvm_irqfd(fd=fd, gsi=gsi, flags=IRQFD_FLAG_DEASSIGN if deassign else 0)
    _ioctl(vm_fd, io.KVM_IRQFD, arg, op="KVM_IRQFD")


def ioeventfd(vm_fd: int, fd: int, addr: int, length: int, datamatch: int | None = None,
              pio: bool = False, deassign: bool = False) -> None:
    flags = (IOEVENTFD_FLAG_DATAMATCH if datamatch is not None else 0) \
        | (IOEVENTFD_FLAG_PIO if pio else 0) | (IOEVENTFD_FLAG_DEASSIGN if deassign else 0)
    arg = s.kvm_ioeventfd(datamatch=datamatch or 0, addr=addr, len=length, fd=fd, flags=flags)
    _ioctl(vm_fd, io.KVM_IOEVENTFD, arg, op="KVM_IOEVENTFD")


def get_irqchip(vm_fd: int, chip_id: int) -> s.kvm_irqchip:
    chip = s.kvm_irqchip(chip_id=chip_id)
    _ioctl(vm_fd, io.KVM_GET_IRQCHIP, chip, op="KVM_GET_IRQCHIP")
    return chip


def set_irqchip(vm_fd: int, chip: s.kvm_irqchip) -> None:
    _ioctl(vm_fd, io.KVM_SET_IRQCHIP, chip, op="KVM_SET_IRQCHIP")


def get_pit2(vm_fd: int) -> s.kvm_pit_state2:
    pit = s.kvm_pit_state2()
    _ioctl(vm_fd, io.KVM_GET_PIT2, pit, op="KVM_GET_PIT2")
    return pit


def set_pit2(vm_fd: int, pit: s.kvm_pit_state2) -> None:
    _ioctl(vm_fd, io.KVM_SET_PIT2, pit, op="KVM_SET_PIT2")


def get_clock(vm_fd: int) -> s.kvm_clock_data:
    clock = s.kvm_clock_data()
    _ioctl(vm_fd, io.KVM_GET_CLOCK, clock, op="KVM_GET_CLOCK")
    return clock


def set_clock(vm_fd: int, clock: s.kvm_clock_data) -> None:
    _ioctl(vm_fd, io.KVM_SET_CLOCK, clock, op="KVM_SET_CLOCK")


def get_dirty_log(vm_fd: int, slot: int, bitmap: ctypes.Array[ctypes.c_uint64]) -> None:
    arg = s.kvm_dirty_log(slot=slot, dirty_bitmap=ctypes.addressof(bitmap))
    _ioctl(vm_fd, io.KVM_GET_DIRTY_LOG, arg, op="KVM_GET_DIRTY_LOG")


# -- vCPU fd --------------------------------------------------------------------------
def _get(vcpu_fd: int, request: int, struct: type, op: str):  # type: ignore[no-untyped-def]
    buf = struct()
    _ioctl(vcpu_fd, request, buf, op=op)
    return buf


def get_regs(vcpu_fd: int) -> s.kvm_regs:
    return _get(vcpu_fd, io.KVM_GET_REGS, s.kvm_regs, "KVM_GET_REGS")  # type: ignore[no-any-return]


def set_regs(vcpu_fd: int, regs: s.kvm_regs) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_REGS, regs, op="KVM_SET_REGS")


def get_sregs(vcpu_fd: int) -> s.kvm_sregs:
    return _get(vcpu_fd, io.KVM_GET_SREGS, s.kvm_sregs, "KVM_GET_SREGS")  # type: ignore[no-any-return]


def set_sregs(vcpu_fd: int, sregs: s.kvm_sregs) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_SREGS, sregs, op="KVM_SET_SREGS")


def get_fpu(vcpu_fd: int) -> s.kvm_fpu:
    return _get(vcpu_fd, io.KVM_GET_FPU, s.kvm_fpu, "KVM_GET_FPU")  # type: ignore[no-any-return]


def set_fpu(vcpu_fd: int, fpu: s.kvm_fpu) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_FPU, fpu, op="KVM_SET_FPU")


def get_lapic(vcpu_fd: int) -> s.kvm_lapic_state:
    return _get(vcpu_fd, io.KVM_GET_LAPIC, s.kvm_lapic_state, "KVM_GET_LAPIC")  # type: ignore[no-any-return]


def set_lapic(vcpu_fd: int, lapic: s.kvm_lapic_state) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_LAPIC, lapic, op="KVM_SET_LAPIC")


def get_mp_state(vcpu_fd: int) -> int:
    st = _get(vcpu_fd, io.KVM_GET_MP_STATE, s.kvm_mp_state, "KVM_GET_MP_STATE")
    return int(st.mp_state)


def set_mp_state(vcpu_fd: int, state: int) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_MP_STATE, s.kvm_mp_state(mp_state=state), op="KVM_SET_MP_STATE")


def get_vcpu_events(vcpu_fd: int) -> s.kvm_vcpu_events:
    return _get(vcpu_fd, io.KVM_GET_VCPU_EVENTS, s.kvm_vcpu_events, "KVM_GET_VCPU_EVENTS")  # type: ignore[no-any-return]


def set_vcpu_events(vcpu_fd: int, events: s.kvm_vcpu_events) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_VCPU_EVENTS, events, op="KVM_SET_VCPU_EVENTS")


def get_debugregs(vcpu_fd: int) -> s.kvm_debugregs:
    return _get(vcpu_fd, io.KVM_GET_DEBUGREGS, s.kvm_debugregs, "KVM_GET_DEBUGREGS")  # type: ignore[no-any-return]


def set_debugregs(vcpu_fd: int, dregs: s.kvm_debugregs) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_DEBUGREGS, dregs, op="KVM_SET_DEBUGREGS")


def get_xsave(vcpu_fd: int) -> s.kvm_xsave:
    return _get(vcpu_fd, io.KVM_GET_XSAVE, s.kvm_xsave, "KVM_GET_XSAVE")  # type: ignore[no-any-return]


def set_xsave(vcpu_fd: int, xsave: s.kvm_xsave) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_XSAVE, xsave, op="KVM_SET_XSAVE")


def get_xcrs(vcpu_fd: int) -> s.kvm_xcrs:
    return _get(vcpu_fd, io.KVM_GET_XCRS, s.kvm_xcrs, "KVM_GET_XCRS")  # type: ignore[no-any-return]


def set_xcrs(vcpu_fd: int, xcrs: s.kvm_xcrs) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_XCRS, xcrs, op="KVM_SET_XCRS")


def set_cpuid2(vcpu_fd: int, entries: list[s.kvm_cpuid_entry2]) -> None:
    buf = s.kvm_cpuid2_with(len(entries))()
    buf.nent = len(entries)
    for i, e in enumerate(entries):
        buf.entries[i] = e
    _ioctl(vcpu_fd, io.KVM_SET_CPUID2, buf, op="KVM_SET_CPUID2")


def set_cpuid2_buffer(vcpu_fd: int, buf: ctypes.Structure) -> None:
    """``KVM_SET_CPUID2`` with a ``kvm_cpuid2_with(n)`` buffer built beforehand."""
    _ioctl(vcpu_fd, io.KVM_SET_CPUID2, buf, op="KVM_SET_CPUID2")


def get_cpuid2(vcpu_fd: int, max_entries: int = 256) -> list[s.kvm_cpuid_entry2]:
    buf = s.kvm_cpuid2_with(max_entries)()
    buf.nent = max_entries
    _ioctl(vcpu_fd, io.KVM_GET_CPUID2, buf, op="KVM_GET_CPUID2")
    return [buf.entries[i] for i in range(buf.nent)]


def get_msrs(vcpu_fd: int, indices: list[int]) -> dict[int, int]:
    """Read MSRs. KVM stops at the first one it cannot read and returns how many
    it did; we return exactly those (the caller decides whether that is fatal)."""
    buf = s.kvm_msrs_with(len(indices))()
    buf.nmsrs = len(indices)
    for i, index in enumerate(indices):
        buf.entries[i].index = index
    n = _ioctl(vcpu_fd, io.KVM_GET_MSRS, buf, op="KVM_GET_MSRS")
    return {int(buf.entries[i].index): int(buf.entries[i].data)
            for i in range(n)}


def msrs_buffer(values: dict[int, int]) -> ctypes.Structure:
    """A ``kvm_msrs`` buffer holding ``values`` in their order, for ``set_msrs_buffer``."""
    buf = s.kvm_msrs_with(len(values))()
    buf.nmsrs = len(values)
    for i, (index, data) in enumerate(values.items()):
        buf.entries[i].index = index
        buf.entries[i].data = data
    return buf


def set_msrs(vcpu_fd: int, values: dict[int, int]) -> int:
    """Write MSRs; returns how many KVM accepted (it stops at the first refusal)."""
    return set_msrs_buffer(vcpu_fd, msrs_buffer(values))


def set_msrs_buffer(vcpu_fd: int, buf: ctypes.Structure) -> int:
    """``set_msrs`` with a buffer built beforehand (``msrs_buffer``)."""
    return _ioctl(vcpu_fd, io.KVM_SET_MSRS, buf, op="KVM_SET_MSRS")


def get_tsc_khz(vcpu_fd: int) -> int:
    return _ioctl(vcpu_fd, io.KVM_GET_TSC_KHZ, op="KVM_GET_TSC_KHZ")


def set_tsc_khz(vcpu_fd: int, khz: int) -> None:
    _ioctl(vcpu_fd, io.KVM_SET_TSC_KHZ, khz, op="KVM_SET_TSC_KHZ")


def kvmclock_ctrl(vcpu_fd: int) -> None:
    _ioctl(vcpu_fd, io.KVM_KVMCLOCK_CTRL, op="KVM_KVMCLOCK_CTRL")
