"""ctypes mirrors of the x86-64 KVM uapi structs (linux/kvm.h, asm/kvm.h).

Each struct spells out its padding so its layout is obvious and matches the
kernel's exactly; ``tests/unit/test_kvm_abi.py`` checks the size and the offset
of every field against the kernel headers. Variable-length structs
(``kvm_msrs``, ``kvm_cpuid2``, ``kvm_msr_list``) are declared with their fixed
header only; ``*_with(n)`` builds the concrete type with room for ``n`` entries.
"""

from __future__ import annotations

import ctypes
from ctypes import c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64
from typing import Any

KVM_NR_INTERRUPTS = 256


class _Struct(ctypes.Structure):
    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name, *_ in self._fields_
                           if not name.startswith("pad"))
        return f"{type(self).__name__}({fields})"


class kvm_regs(_Struct):
    _fields_ = [(name, c_uint64) for name in (
        "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rsp", "rbp",
        "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip", "rflags")]


class kvm_segment(_Struct):
    _fields_ = [
        ("base", c_uint64), ("limit", c_uint32), ("selector", c_uint16),
        ("type", c_uint8), ("present", c_uint8), ("dpl", c_uint8), ("db", c_uint8),
        ("s", c_uint8), ("l", c_uint8), ("g", c_uint8), ("avl", c_uint8),
        ("unusable", c_uint8), ("padding", c_uint8),
    ]


class kvm_dtable(_Struct):
    _fields_ = [("base", c_uint64), ("limit", c_uint16), ("padding", c_uint16 * 3)]


class kvm_sregs(_Struct):
    _fields_ = [
        ("cs", kvm_segment), ("ds", kvm_segment), ("es", kvm_segment), ("fs", kvm_segment),
        ("gs", kvm_segment), ("ss", kvm_segment), ("tr", kvm_segment), ("ldt", kvm_segment),
        ("gdt", kvm_dtable), ("idt", kvm_dtable),
        ("cr0", c_uint64), ("cr2", c_uint64), ("cr3", c_uint64), ("cr4", c_uint64),
        ("cr8", c_uint64), ("efer", c_uint64), ("apic_base", c_uint64),
        ("interrupt_bitmap", c_uint64 * ((KVM_NR_INTERRUPTS + 63) // 64)),
    ]


class kvm_fpu(_Struct):
    _fields_ = [
        ("fpr", (c_uint8 * 16) * 8), ("fcw", c_uint16), ("fsw", c_uint16),
        ("ftwx", c_uint8), ("pad1", c_uint8), ("last_opcode", c_uint16),
        ("last_ip", c_uint64), ("last_dp", c_uint64), ("xmm", (c_uint8 * 16) * 16),
        ("mxcsr", c_uint32), ("pad2", c_uint32),
    ]


class kvm_msr_entry(_Struct):
    _fields_ = [("index", c_uint32), ("reserved", c_uint32), ("data", c_uint64)]


class kvm_msrs(_Struct):
    _fields_ = [("nmsrs", c_uint32), ("pad", c_uint32)]


class kvm_msr_list(_Struct):
    _fields_ = [("nmsrs", c_uint32)]


class kvm_cpuid_entry2(_Struct):
    _fields_ = [
        ("function", c_uint32), ("index", c_uint32), ("flags", c_uint32),
        ("eax", c_uint32), ("ebx", c_uint32), ("ecx", c_uint32), ("edx", c_uint32),
        ("padding", c_uint32 * 3),
    ]


class kvm_cpuid2(_Struct):
    _fields_ = [("nent", c_uint32), ("padding", c_uint32)]


class kvm_lapic_state(_Struct):
    _fields_ = [("regs", c_uint8 * 1024)]


class kvm_mp_state(_Struct):
    _fields_ = [("mp_state", c_uint32)]


class _events_exception(_Struct):
    _fields_ = [("injected", c_uint8), ("nr", c_uint8), ("has_error_code", c_uint8),
                ("pending", c_uint8), ("error_code", c_uint32)]


class _events_interrupt(_Struct):
    _fields_ = [("injected", c_uint8), ("nr", c_uint8), ("soft", c_uint8), ("shadow", c_uint8)]


class _events_nmi(_Struct):
    _fields_ = [("injected", c_uint8), ("pending", c_uint8), ("masked", c_uint8),
                ("pad", c_uint8)]


class _events_smi(_Struct):
    _fields_ = [("smm", c_uint8), ("pending", c_uint8), ("smm_inside_nmi", c_uint8),
                ("latched_init", c_uint8)]


class kvm_vcpu_events(_Struct):
    _fields_ = [
        ("exception", _events_exception), ("interrupt", _events_interrupt),
        ("nmi", _events_nmi), ("sipi_vector", c_uint32), ("flags", c_uint32),
        ("smi", _events_smi), ("reserved", c_uint8 * 27),
        ("exception_has_payload", c_uint8), ("exception_payload", c_uint64),
    ]


class kvm_debugregs(_Struct):
    _fields_ = [("db", c_uint64 * 4), ("dr6", c_uint64), ("dr7", c_uint64),
                ("flags", c_uint64), ("reserved", c_uint64 * 9)]


class kvm_xsave(_Struct):
    _fields_ = [("region", c_uint32 * 1024)]


class kvm_xcr(_Struct):
    _fields_ = [("xcr", c_uint32), ("reserved", c_uint32), ("value", c_uint64)]


class kvm_xcrs(_Struct):
    _fields_ = [("nr_xcrs", c_uint32), ("flags", c_uint32), ("xcrs", kvm_xcr * 16),
                ("padding", c_uint64 * 16)]


class kvm_irqchip(_Struct):
    # The union of pic/ioapic state is kept as raw bytes: we save and restore it
    # whole and never interpret it.
    _fields_ = [("chip_id", c_uint32), ("pad", c_uint32), ("chip", c_uint8 * 512)]


class kvm_pit_channel_state(_Struct):
    _fields_ = [
        ("count", c_uint32), ("latched_count", c_uint16), ("count_latched", c_uint8),
        ("status_latched", c_uint8), ("status", c_uint8), ("read_state", c_uint8),
        ("write_state", c_uint8), ("write_latch", c_uint8), ("rw_mode", c_uint8),
        ("mode", c_uint8), ("bcd", c_uint8), ("gate", c_uint8), ("count_load_time", c_int64),
    ]


class kvm_pit_state2(_Struct):
    _fields_ = [("channels", kvm_pit_channel_state * 3), ("flags", c_uint32),
                ("reserved", c_uint32 * 9)]


class kvm_pit_config(_Struct):
    _fields_ = [("flags", c_uint32), ("pad", c_uint32 * 15)]


class kvm_clock_data(_Struct):
    _fields_ = [("clock", c_uint64), ("flags", c_uint32), ("pad0", c_uint32),
                ("realtime", c_uint64), ("host_tsc", c_uint64), ("pad", c_uint32 * 4)]


class kvm_userspace_memory_region(_Struct):
    _fields_ = [("slot", c_uint32), ("flags", c_uint32), ("guest_phys_addr", c_uint64),
                ("memory_size", c_uint64), ("userspace_addr", c_uint64)]


class kvm_irq_level(_Struct):
    _fields_ = [("irq", c_uint32), ("level", c_uint32)]


class kvm_ioeventfd(_Struct):
    _fields_ = [("datamatch", c_uint64), ("addr", c_uint64), ("len", c_uint32),
                ("fd", c_int32), ("flags", c_uint32), ("pad", c_uint8 * 36)]


class kvm_irqfd(_Struct):
    _fields_ = [("fd", c_uint32), ("gsi", c_uint32), ("flags", c_uint32),
                ("resamplefd", c_uint32), ("pad", c_uint8 * 16)]


class kvm_dirty_log(_Struct):
    _fields_ = [("slot", c_uint32), ("padding1", c_uint32), ("dirty_bitmap", c_uint64)]


class kvm_enable_cap(_Struct):
    _fields_ = [("cap", c_uint32), ("flags", c_uint32), ("args", c_uint64 * 4),
                ("pad", c_uint8 * 64)]


# -- struct kvm_run: the page shared with the kernel per vCPU --------------------------
class kvm_run_io(_Struct):
    _fields_ = [("direction", c_uint8), ("size", c_uint8), ("port", c_uint16),
                ("count", c_uint32), ("data_offset", c_uint64)]


class kvm_run_mmio(_Struct):
    _fields_ = [("phys_addr", c_uint64), ("data", c_uint8 * 8), ("len", c_uint32),
                ("is_write", c_uint8)]


class kvm_run_fail_entry(_Struct):
    _fields_ = [("hardware_entry_failure_reason", c_uint64), ("cpu", c_uint32)]


class kvm_run_internal(_Struct):
    _fields_ = [("suberror", c_uint32), ("ndata", c_uint32), ("data", c_uint64 * 16)]


class kvm_run_system_event(_Struct):
    _fields_ = [("type", c_uint32), ("ndata", c_uint32), ("data", c_uint64 * 16)]


class kvm_run_exit(ctypes.Union):
    _fields_ = [
        ("io", kvm_run_io), ("mmio", kvm_run_mmio), ("fail_entry", kvm_run_fail_entry),
        ("internal", kvm_run_internal), ("system_event", kvm_run_system_event),
        ("padding", c_uint8 * 256),
    ]


class kvm_run(_Struct):
    _fields_ = [
        ("request_interrupt_window", c_uint8), ("immediate_exit", c_uint8),
        ("padding1", c_uint8 * 6), ("exit_reason", c_uint32),
        ("ready_for_interrupt_injection", c_uint8), ("if_flag", c_uint8), ("flags", c_uint16),
        ("cr8", c_uint64), ("apic_base", c_uint64), ("exit", kvm_run_exit),
        ("kvm_valid_regs", c_uint64), ("kvm_dirty_regs", c_uint64),
    ]


def _with_entries(header: type[ctypes.Structure], entry: Any, n: int) -> type[ctypes.Structure]:
    return type(f"{header.__name__}_{n}", (_Struct,),
                {"_fields_": list(header._fields_) + [("entries", entry * n)]})


def kvm_msrs_with(n: int) -> type[ctypes.Structure]:
    return _with_entries(kvm_msrs, kvm_msr_entry, n)


def kvm_cpuid2_with(n: int) -> type[ctypes.Structure]:
    return _with_entries(kvm_cpuid2, kvm_cpuid_entry2, n)


def kvm_msr_list_with(n: int) -> type[ctypes.Structure]:
    return type(f"kvm_msr_list_{n}", (_Struct,),
                {"_fields_": [("nmsrs", c_uint32), ("indices", c_uint32 * n)]})
