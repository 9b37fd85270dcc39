"""Booting Linux on x86-64: the recipe, one named step at a time.

1. ``load_kernel``      copy the ELF ``vmlinux`` segments to their physical addresses
2. ``load_initrd``      place the initramfs at the top of low RAM, page aligned
3. ``write_cmdline``    the NUL-terminated command line at ``CMDLINE_ADDR``
4. ``write_zero_page``  boot_params: command line, initrd, e820 map
5. ``write_mptable``    CPUs, IOAPIC and IRQ routing for an SMP guest without ACPI
6. ``write_paging``     identity-mapped page tables and the GDT/IDT
7. ``setup_vcpu``       per vCPU: CPUID, MSRs, FPU, registers; the boot CPU's
                        registers enter ``startup_64`` in long mode, the others
                        wait for INIT/SIPI from the boot CPU (KVM's default state)
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass

from vmfork.kvm import api
from vmfork.kvm.structs import kvm_cpuid_entry2, kvm_segment
from vmfork.vmm import openfiles
from vmfork.vmm.errors import BootError
from vmfork.vmm.memory import FOUR_GIB, PAGE_SIZE, GuestMemory
from vmfork.vmm.x86 import layout as L
from vmfork.vmm.x86.bootparams import E820_RAM, E820_RESERVED, E820Entry, build_zero_page
from vmfork.vmm.x86.cpuid import guest_cpuid
from vmfork.vmm.x86.elf import load_elf_kernel
from vmfork.vmm.x86.mptable import build_mptable
from vmfork.vmm.x86.paging import (
    CODE_SELECTOR,
    DATA_SELECTOR,
    GDT,
    TSS_SELECTOR,
    build_gdt,
    build_page_tables,
)

# MSRs set on every vCPU before the first run (the values Linux expects from a
# freshly reset CPU, plus fast strings).
MSR_IA32_SYSENTER_CS = 0x174
MSR_IA32_SYSENTER_ESP = 0x175
MSR_IA32_SYSENTER_EIP = 0x176
MSR_STAR = 0xC0000081
MSR_LSTAR = 0xC0000082
MSR_CSTAR = 0xC0000083
MSR_SYSCALL_MASK = 0xC0000084
MSR_KERNEL_GS_BASE = 0xC0000102
MSR_IA32_TSC = 0x10
MSR_IA32_MISC_ENABLE = 0x1A0
MISC_ENABLE_FAST_STRING = 1

X86_CR0_PE = 1 << 0
X86_CR0_PG = 1 << 31
X86_CR4_PAE = 1 << 5
EFER_LME = 1 << 8
EFER_LMA = 1 << 10

APIC_LVT0 = 0x350
APIC_LVT1 = 0x360
APIC_MODE_NMI = 0x4
APIC_MODE_EXTINT = 0x7


@dataclass(frozen=True)
class BootInfo:
    entry: int
    kernel_end: int
    initrd_addr: int
    initrd_size: int
    cmdline: str


def e820_map(memory: GuestMemory) -> list[E820Entry]:
    low = memory.regions[0]
    table = [
        E820Entry(0, L.MPTABLE_ADDR, E820_RAM),
        E820Entry(L.MPTABLE_ADDR, L.BASE_MEMORY_END - L.MPTABLE_ADDR, E820_RESERVED),
        E820Entry(L.HIGH_MEMORY_START, low.end - L.HIGH_MEMORY_START, E820_RAM),
    ]
    for region in memory.regions[1:]:
        table.append(E820Entry(region.guest_phys, region.size, E820_RAM))
    return table


def load_initrd(memory: GuestMemory, path: str, kernel_end: int) -> tuple[int, int]:
    try:
        size = os.stat(path).st_size
    except OSError as err:
        raise BootError(f"initrd {path}: {err.strerror}", op="load_initrd") from err
    top = min(memory.regions[0].end, FOUR_GIB)
    addr = (top - size) & ~(PAGE_SIZE - 1)
    if addr < kernel_end:
        raise BootError(
            f"initrd {path} ({size >> 20} MiB) does not fit above the kernel in "
            f"{memory.regions[0].size >> 20} MiB of low memory; give the VM more memory",
            op="load_initrd")
    view = memory.view(addr, size)
    with os.fdopen(openfiles.open_ro(path), "rb") as f:
        got = f.readinto(view)
    if got != size:
        raise BootError(f"initrd {path}: short read ({got} of {size} bytes)", op="load_initrd")
    return addr, size


def write_paging(memory: GuestMemory) -> None:
    """Identity-mapped page tables, the GDT and an empty IDT for a 64-bit entry."""
    pml4, pdpt, pds = build_page_tables()
    memory.write(L.PML4_ADDR, pml4)
    memory.write(L.PDPT_ADDR, pdpt)
    memory.write(L.PD_ADDR, pds)
    memory.write(L.GDT_ADDR, build_gdt())
    memory.write(L.IDT_ADDR, bytes(8))


def load_linux(memory: GuestMemory, kernel: str, initrd: str | None, cmdline: str,
               num_vcpus: int) -> BootInfo:
    # 1. kernel
    loaded = load_elf_kernel(memory, kernel)
    # 2. initrd
    initrd_addr = initrd_size = 0
    if initrd:
        initrd_addr, initrd_size = load_initrd(memory, initrd, loaded.high)
    # 3. command line
    raw = cmdline.encode() + b"\0"
    if len(raw) > L.CMDLINE_MAX:
        raise BootError(f"kernel command line is {len(raw)} bytes; the limit is "
                        f"{L.CMDLINE_MAX}", op="write_cmdline")
    memory.write(L.CMDLINE_ADDR, raw)
    # 4. zero page
    memory.write(L.ZERO_PAGE_ADDR, build_zero_page(
        cmdline_addr=L.CMDLINE_ADDR, cmdline_size=len(raw) - 1, initrd_addr=initrd_addr,
        initrd_size=initrd_size, e820=e820_map(memory)))
    # 5. MP table
    memory.write(L.MPTABLE_ADDR, build_mptable(L.MPTABLE_ADDR, num_vcpus))
    # 6. page tables, GDT, empty IDT
    write_paging(memory)
    return BootInfo(entry=loaded.entry, kernel_end=loaded.high, initrd_addr=initrd_addr,
                    initrd_size=initrd_size, cmdline=cmdline)


FLAT_PAYLOAD_ADDR = 0x100000


def load_flat_payload(memory: GuestMemory, code: bytes) -> BootInfo:
    """Load a flat 64-bit binary at 1 MiB for purpose-built test guests.

    The payload runs with the same page tables, GDT and registers a Linux entry
    gets (``%rsi`` = zero page), so tiny guests exercise the real vCPU set-up.
    """
    memory.write(FLAT_PAYLOAD_ADDR, code)
    write_paging(memory)
    return BootInfo(entry=FLAT_PAYLOAD_ADDR, kernel_end=FLAT_PAYLOAD_ADDR + len(code),
                    initrd_addr=0, initrd_size=0, cmdline="")


def _segment(index: int) -> kvm_segment:
    flags, base, limit = GDT[index]
    granular = (flags >> 15) & 1
    return kvm_segment(
        base=base,
        limit=((limit << 12) | 0xFFF) if granular else limit,
        selector=index * 8,
        type=flags & 0xF,
        present=(flags >> 7) & 1,
        dpl=(flags >> 5) & 3,
        db=(flags >> 14) & 1,
        s=(flags >> 4) & 1,
        l=(flags >> 13) & 1,
        g=granular,
        avl=(flags >> 12) & 1,
        unusable=0 if (flags >> 7) & 1 else 1,
    )


def setup_vcpu_cpuid_msrs(vcpu_fd: int, supported: list[kvm_cpuid_entry2], index: int,
                          num_vcpus: int) -> None:
    api.set_cpuid2(vcpu_fd, guest_cpuid(supported, index, num_vcpus))
    msrs = {
        MSR_IA32_SYSENTER_CS: 0, MSR_IA32_SYSENTER_ESP: 0, MSR_IA32_SYSENTER_EIP: 0,
        MSR_STAR: 0, MSR_CSTAR: 0, MSR_KERNEL_GS_BASE: 0, MSR_SYSCALL_MASK: 0, MSR_LSTAR: 0,
        MSR_IA32_TSC: 0, MSR_IA32_MISC_ENABLE: MISC_ENABLE_FAST_STRING,
    }
    accepted = api.set_msrs(vcpu_fd, msrs)
    if accepted != len(msrs):
        refused = list(msrs)[accepted]
        raise BootError(f"KVM refused boot MSR {refused:#x}", op="set_msrs")
    # LINT0 delivers the PIC's ExtINT, LINT1 NMIs, as on a PC after the BIOS.
    lapic = api.get_lapic(vcpu_fd)
    raw = bytearray(lapic.regs)
    for off, mode in ((APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)):
        (value,) = struct.unpack_from("<I", raw, off)
        value = (value & ~0x700) | (mode << 8)
        struct.pack_into("<I", raw, off, value)
    ctypes.memmove(ctypes.addressof(lapic), bytes(raw), len(raw))
    api.set_lapic(vcpu_fd, lapic)


def setup_boot_cpu_registers(vcpu_fd: int, entry: int) -> None:
    fpu = api.get_fpu(vcpu_fd)
    fpu.fcw = 0x37F
    fpu.mxcsr = 0x1F80
    api.set_fpu(vcpu_fd, fpu)

    sregs = api.get_sregs(vcpu_fd)
    code, data, tss = _segment(CODE_SELECTOR // 8), _segment(DATA_SELECTOR // 8), \
        _segment(TSS_SELECTOR // 8)
    sregs.cs = code
    sregs.ds = sregs.es = sregs.fs = sregs.gs = sregs.ss = data
    sregs.tr = tss
    sregs.gdt.base, sregs.gdt.limit = L.GDT_ADDR, len(GDT) * 8 - 1
    sregs.idt.base, sregs.idt.limit = L.IDT_ADDR, 7
    sregs.cr0 |= X86_CR0_PE | X86_CR0_PG
    sregs.cr3 = L.PML4_ADDR
    sregs.cr4 |= X86_CR4_PAE
    sregs.efer |= EFER_LME | EFER_LMA
    api.set_sregs(vcpu_fd, sregs)

    regs = api.get_regs(vcpu_fd)
    ctypes.memset(ctypes.addressof(regs), 0, ctypes.sizeof(regs))
    regs.rflags = 0x2
    regs.rip = entry
    regs.rsp = regs.rbp = L.BOOT_STACK_TOP
    regs.rsi = L.ZERO_PAGE_ADDR
    api.set_regs(vcpu_fd, regs)
