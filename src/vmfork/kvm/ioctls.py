"""KVM ioctl request numbers, computed from ``_IOC(dir, type, nr, size)``.

The encoding is the generic Linux one (asm-generic/ioctl.h), which x86 uses:
``nr`` in bits 0-7, ``type`` in 8-15, ``size`` in 16-29, ``dir`` in 30-31. Sizes
come from the ctypes structs, so a wrong struct shows up as a wrong number in
``tests/unit/test_kvm_abi.py``, which compares every number to the kernel
headers' value.
"""

from __future__ import annotations

import ctypes

from vmfork.kvm import structs as s

_IOC_NONE = 0
_IOC_WRITE = 1
_IOC_READ = 2

KVMIO = 0xAE


def _IOC(direction: int, type_: int, nr: int, size: int) -> int:
    assert 0 <= nr < 256 and 0 <= type_ < 256 and 0 <= size < (1 << 14)
    return (direction << 30) | (size << 16) | (type_ << 8) | nr


def _IO(nr: int) -> int:
    return _IOC(_IOC_NONE, KVMIO, nr, 0)


def _IOR(nr: int, struct: type) -> int:
    return _IOC(_IOC_READ, KVMIO, nr, ctypes.sizeof(struct))


def _IOW(nr: int, struct: type) -> int:
    return _IOC(_IOC_WRITE, KVMIO, nr, ctypes.sizeof(struct))


def _IOWR(nr: int, struct: type) -> int:
    return _IOC(_IOC_READ | _IOC_WRITE, KVMIO, nr, ctypes.sizeof(struct))


# /dev/kvm
KVM_GET_API_VERSION = _IO(0x00)
KVM_CREATE_VM = _IO(0x01)
KVM_GET_MSR_INDEX_LIST = _IOWR(0x02, s.kvm_msr_list)
KVM_CHECK_EXTENSION = _IO(0x03)
KVM_GET_VCPU_MMAP_SIZE = _IO(0x04)
KVM_GET_SUPPORTED_CPUID = _IOWR(0x05, s.kvm_cpuid2)
KVM_GET_MSR_FEATURE_INDEX_LIST = _IOWR(0x0A, s.kvm_msr_list)

# VM fd
KVM_CREATE_VCPU = _IO(0x41)
KVM_GET_DIRTY_LOG = _IOW(0x42, s.kvm_dirty_log)
KVM_SET_USER_MEMORY_REGION = _IOW(0x46, s.kvm_userspace_memory_region)
KVM_SET_TSS_ADDR = _IO(0x47)
KVM_SET_IDENTITY_MAP_ADDR = _IOW(0x48, ctypes.c_uint64)
KVM_CREATE_IRQCHIP = _IO(0x60)
KVM_IRQ_LINE = _IOW(0x61, s.kvm_irq_level)
KVM_GET_IRQCHIP = _IOWR(0x62, s.kvm_irqchip)
KVM_SET_IRQCHIP = _IOR(0x63, s.kvm_irqchip)  # sic: the kernel declares SET with _IOR
KVM_IRQFD = _IOW(0x76, s.kvm_irqfd)
KVM_CREATE_PIT2 = _IOW(0x77, s.kvm_pit_config)
KVM_IOEVENTFD = _IOW(0x79, s.kvm_ioeventfd)
KVM_SET_CLOCK = _IOW(0x7B, s.kvm_clock_data)
KVM_GET_CLOCK = _IOR(0x7C, s.kvm_clock_data)
KVM_GET_PIT2 = _IOR(0x9F, s.kvm_pit_state2)
KVM_SET_PIT2 = _IOW(0xA0, s.kvm_pit_state2)

# vCPU fd
KVM_RUN = _IO(0x80)
KVM_GET_REGS = _IOR(0x81, s.kvm_regs)
KVM_SET_REGS = _IOW(0x82, s.kvm_regs)
KVM_GET_SREGS = _IOR(0x83, s.kvm_sregs)
KVM_SET_SREGS = _IOW(0x84, s.kvm_sregs)
KVM_GET_MSRS = _IOWR(0x88, s.kvm_msrs)
KVM_SET_MSRS = _IOW(0x89, s.kvm_msrs)
KVM_GET_FPU = _IOR(0x8C, s.kvm_fpu)
KVM_SET_FPU = _IOW(0x8D, s.kvm_fpu)
KVM_GET_LAPIC = _IOR(0x8E, s.kvm_lapic_state)
KVM_SET_LAPIC = _IOW(0x8F, s.kvm_lapic_state)
KVM_SET_CPUID2 = _IOW(0x90, s.kvm_cpuid2)
KVM_GET_CPUID2 = _IOWR(0x91, s.kvm_cpuid2)
KVM_GET_MP_STATE = _IOR(0x98, s.kvm_mp_state)
KVM_SET_MP_STATE = _IOW(0x99, s.kvm_mp_state)
KVM_GET_VCPU_EVENTS = _IOR(0x9F, s.kvm_vcpu_events)
KVM_SET_VCPU_EVENTS = _IOW(0xA0, s.kvm_vcpu_events)
KVM_GET_DEBUGREGS = _IOR(0xA1, s.kvm_debugregs)
KVM_SET_DEBUGREGS = _IOW(0xA2, s.kvm_debugregs)
KVM_SET_TSC_KHZ = _IO(0xA2)
KVM_GET_TSC_KHZ = _IO(0xA3)
KVM_ENABLE_CAP = _IOW(0xA3, s.kvm_enable_cap)
KVM_GET_XSAVE = _IOR(0xA4, s.kvm_xsave)
KVM_SET_XSAVE = _IOW(0xA5, s.kvm_xsave)
KVM_GET_XCRS = _IOR(0xA6, s.kvm_xcrs)
KVM_SET_XCRS = _IOW(0xA7, s.kvm_xcrs)
KVM_KVMCLOCK_CTRL = _IO(0xAD)
KVM_GET_XSAVE2 = _IOR(0xCF, s.kvm_xsave)

ALL = {name: value for name, value in globals().items() if name.startswith("KVM_")}
