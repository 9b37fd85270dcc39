"""The Intel MultiProcessor Specification table (v1.4), for SMP without ACPI.

Our guest kernel has no ACPI; Linux finds CPUs and the IOAPIC through the MP
table, scanning the last KiB of base memory for the ``_MP_`` floating pointer.
We describe: one processor entry per vCPU (LAPIC id = vCPU index, the first is
the boot processor), one ISA bus, one IOAPIC (id after the last LAPIC), an
identity routing of ISA IRQs 0..23 to IOAPIC pins 0..23 (default polarity and
trigger: edge, active high, which is what irqfd injection gives), and the local
interrupts ExtINT on LINT0 and NMI on LINT1.
"""

from __future__ import annotations

import struct

from vmfork.vmm.x86.layout import IOAPIC_ADDR, IOAPIC_PINS, LAPIC_ADDR

MPC_SPEC_REV = 4
APIC_VERSION = 0x14
IOAPIC_VERSION = 0x11
CPU_ENABLED = 1
CPU_BOOTPROCESSOR = 2
CPU_SIGNATURE = 0x600          # family 6: only informative
CPU_FEATURES = 0x201           # FPU and APIC present
MP_IRQ_INT = 0
MP_IRQ_NMI = 1
MP_IRQ_EXTINT = 3


def _checksum(data: bytes) -> int:
    return (-sum(data)) & 0xFF


def build_mptable(addr: int, num_cpus: int) -> bytes:
    """The floating pointer at ``addr`` followed by the configuration table."""
    if not 1 <= num_cpus <= 254:
        raise ValueError(f"the MP table describes 1..254 CPUs, not {num_cpus}")
    ioapic_id = num_cpus
    entries = bytearray()
    count = 0
    for cpu in range(num_cpus):
        flags = CPU_ENABLED | (CPU_BOOTPROCESSOR if cpu == 0 else 0)
        entries += struct.pack("<BBBBII8x", 0, cpu, APIC_VERSION, flags, CPU_SIGNATURE,
                               CPU_FEATURES)
        count += 1
    entries += struct.pack("<BB6s", 1, 0, b"ISA   ")
    count += 1
    entries += struct.pack("<BBBBI", 2, ioapic_id, IOAPIC_VERSION, 1, IOAPIC_ADDR)
    count += 1
    for irq in range(IOAPIC_PINS):
        entries += struct.pack("<BBHBBBB", 3, MP_IRQ_INT, 0, 0, irq, ioapic_id, irq)
        count += 1
    for irqtype, lint in ((MP_IRQ_EXTINT, 0), (MP_IRQ_NMI, 1)):
        entries += struct.pack("<BBHBBBB", 4, irqtype, 0, 0, 0, 0xFF, lint)
        count += 1

    header_fmt = "<4sHBB8s12sIHHIHBB"
    header_size = struct.calcsize(header_fmt)
    length = header_size + len(entries)
    header = struct.pack(header_fmt, b"PCMP", length, MPC_SPEC_REV, 0, b"VMFORK  ",
                         b"MICROVM     ", 0, 0, count, LAPIC_ADDR, 0, 0, 0)
    table = bytearray(header + entries)
    table[7] = _checksum(bytes(table))

    config_addr = addr + 16
    floating = bytearray(struct.pack("<4sIBBB5x", b"_MP_", config_addr, 1, MPC_SPEC_REV, 0))
    floating[10] = _checksum(bytes(floating))
    return bytes(floating) + bytes(table)
