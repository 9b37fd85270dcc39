"""The Linux x86 boot protocol's "zero page" (struct boot_params), for a 64-bit entry.

We enter the kernel at ``startup_64`` in long mode with ``%rsi`` pointing at a
zero page we fill ourselves (Documentation/arch/x86/boot.rst, "64-bit boot
protocol"). Only the setup-header fields a 64-bit entry reads are set; the rest
of the page is zero, as the protocol requires. Offsets are from
``arch/x86/include/uapi/asm/bootparam.h``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

ZERO_PAGE_SIZE = 4096

# struct boot_params / setup_header offsets
OFF_EXT_RAMDISK_IMAGE = 0x0C0
OFF_EXT_RAMDISK_SIZE = 0x0C4
OFF_EXT_CMD_LINE_PTR = 0x0C8
OFF_E820_ENTRIES = 0x1E8
OFF_BOOT_FLAG = 0x1FE
OFF_HEADER = 0x202
OFF_VERSION = 0x206
OFF_TYPE_OF_LOADER = 0x210
OFF_LOADFLAGS = 0x211
OFF_RAMDISK_IMAGE = 0x218
OFF_RAMDISK_SIZE = 0x21C
OFF_HEAP_END_PTR = 0x224
OFF_CMD_LINE_PTR = 0x228
OFF_CMDLINE_SIZE = 0x238
OFF_E820_TABLE = 0x2D0
E820_MAX_ENTRIES = 128

BOOT_FLAG = 0xAA55
HDRS_MAGIC = 0x53726448      # "HdrS"
PROTOCOL_VERSION = 0x020F
LOADER_UNDEFINED = 0xFF
LOADED_HIGH = 0x01
CAN_USE_HEAP = 0x80

E820_RAM = 1
E820_RESERVED = 2


@dataclass(frozen=True)
class E820Entry:
    addr: int
    size: int
    type: int


def build_zero_page(*, cmdline_addr: int, cmdline_size: int, initrd_addr: int,
                    initrd_size: int, e820: list[E820Entry]) -> bytes:
    if len(e820) > E820_MAX_ENTRIES:
        raise ValueError(f"too many e820 entries ({len(e820)} > {E820_MAX_ENTRIES})")
    page = bytearray(ZERO_PAGE_SIZE)
    struct.pack_into("<H", page, OFF_BOOT_FLAG, BOOT_FLAG)
    struct.pack_into("<I", page, OFF_HEADER, HDRS_MAGIC)
    struct.pack_into("<H", page, OFF_VERSION, PROTOCOL_VERSION)
    struct.pack_into("<B", page, OFF_TYPE_OF_LOADER, LOADER_UNDEFINED)
    struct.pack_into("<B", page, OFF_LOADFLAGS, LOADED_HIGH | CAN_USE_HEAP)
    struct.pack_into("<H", page, OFF_HEAP_END_PTR, 0xFE00)
    struct.pack_into("<I", page, OFF_CMD_LINE_PTR, cmdline_addr & 0xFFFF_FFFF)
    struct.pack_into("<I", page, OFF_EXT_CMD_LINE_PTR, cmdline_addr >> 32)
    struct.pack_into("<I", page, OFF_CMDLINE_SIZE, cmdline_size)
    struct.pack_into("<I", page, OFF_RAMDISK_IMAGE, initrd_addr & 0xFFFF_FFFF)
    struct.pack_into("<I", page, OFF_EXT_RAMDISK_IMAGE, initrd_addr >> 32)
    struct.pack_into("<I", page, OFF_RAMDISK_SIZE, initrd_size & 0xFFFF_FFFF)
    struct.pack_into("<I", page, OFF_EXT_RAMDISK_SIZE, initrd_size >> 32)
    struct.pack_into("<B", page, OFF_E820_ENTRIES, len(e820))
    for i, entry in enumerate(e820):
        struct.pack_into("<QQI", page, OFF_E820_TABLE + 20 * i, entry.addr, entry.size, entry.type)
    return bytes(page)
