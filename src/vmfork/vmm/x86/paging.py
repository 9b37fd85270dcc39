"""Boot page tables and GDT for entering Linux directly in 64-bit mode.

The 64-bit boot protocol wants long mode with paging on, an identity mapping
covering the kernel, the zero page and the command line, and flat 4 GiB
segments. We identity-map the first 4 GiB with 2 MiB pages (PML4 -> PDPT -> four
PDs): Linux's ``startup_64`` builds its own tables right away, but the tiny test
guests run on these and reach the MMIO windows below 4 GiB.
"""

from __future__ import annotations

import struct

from vmfork.vmm.x86.layout import PD_ADDR, PDPT_ADDR

PTE_PRESENT = 1 << 0
PTE_WRITE = 1 << 1
PTE_HUGE = 1 << 7
HUGE_PAGE = 2 << 20


IDENTITY_MAPPED_GIB = 4


def build_page_tables() -> tuple[bytes, bytes, bytes]:
    """Return the PML4 page, the PDPT page and the PD pages (4 KiB each,
    consecutive from ``PD_ADDR``) of a 4 GiB identity map."""
    pml4 = struct.pack("<Q", PDPT_ADDR | PTE_PRESENT | PTE_WRITE).ljust(4096, b"\0")
    pdpt = b"".join(struct.pack("<Q", (PD_ADDR + 4096 * g) | PTE_PRESENT | PTE_WRITE)
                    for g in range(IDENTITY_MAPPED_GIB)).ljust(4096, b"\0")
    pds = b"".join(struct.pack("<Q", (i * HUGE_PAGE) | PTE_PRESENT | PTE_WRITE | PTE_HUGE)
                   for i in range(512 * IDENTITY_MAPPED_GIB))
    return pml4, pdpt, pds


def gdt_entry(flags: int, base: int, limit: int) -> int:
    """Pack a segment descriptor. ``flags`` holds the access byte (bits 0-7) and
    the granularity nibble (bits 12-15), as in the Linux ``GDT_ENTRY`` macro."""
    return (((base & 0xFF000000) << 32) | ((flags & 0xF0FF) << 40)
            | ((limit & 0xF0000) << 32) | ((base & 0x00FFFFFF) << 16) | (limit & 0xFFFF))


# Index in the GDT -> (flags, base, limit). Selector = index * 8.
GDT = [
    (0, 0, 0),              # null
    (0xA09B, 0, 0xFFFFF),   # 0x08: 64-bit code, present, ring 0, 4 KiB granular
    (0xC093, 0, 0xFFFFF),   # 0x10: data, read/write
    (0x808B, 0, 0xFFFFF),   # 0x18: 64-bit TSS, busy
]
CODE_SELECTOR = 0x08
DATA_SELECTOR = 0x10
TSS_SELECTOR = 0x18


def build_gdt() -> bytes:
    return b"".join(struct.pack("<Q", gdt_entry(*e)) for e in GDT)
