"""Just enough ELF reading to check that every binary in the guest can be loaded.

The package allow-list in ``debian.py`` decides which shared libraries reach the
guest. A mistake there does not fail the build: it fails in the guest, at the
first ``import`` of the module that needed the library, long after the image
was cached. So the build reads each ELF file's ``PT_INTERP`` and ``DT_NEEDED``
entries and checks them against the staging tree, without running anything
(the staging tree's binaries are for the guest, and the build may run
unprivileged, so ``chroot`` + ``ldd`` is not an option).

Only 64-bit little-endian ELF is handled; that is the only guest architecture.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
_PT_LOAD, _PT_DYNAMIC, _PT_INTERP = 1, 2, 3
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ = 0, 1, 5, 10


class ElfError(ValueError):
    """A file that starts like ELF but cannot be read as 64-bit little-endian ELF."""


@dataclass(frozen=True)
class ElfDeps:
    interpreter: str | None
    needed: tuple[str, ...]


def is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == ELF_MAGIC


def read_deps(path: Path) -> ElfDeps:
    """The program interpreter and ``DT_NEEDED`` sonames of an ELF file."""
    data = path.read_bytes()
    if data[:4] != ELF_MAGIC or data[4] != 2 or data[5] != 1:
        raise ElfError(f"{path}: not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None
    interpreter: str | None = None
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
        elif p_type == _PT_INTERP:
            interpreter = data[p_offset : p_offset + p_filesz].rstrip(b"\0").decode()
    if dynamic is None:
        return ElfDeps(interpreter, ())

    def file_offset(vaddr: int) -> int:
        # DT_STRTAB holds a virtual address; map it back through the PT_LOAD segments.
        for seg_vaddr, seg_offset, seg_size in loads:
            if seg_vaddr <= vaddr < seg_vaddr + seg_size:
                return vaddr - seg_vaddr + seg_offset
        raise ElfError(f"{path}: address {vaddr:#x} is not in a loaded segment")

    needed_offsets: list[int] = []
    strtab = strsz = 0
    offset, size = dynamic
    for pos in range(offset, offset + size, 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == _DT_NULL:
            break
        if tag == _DT_NEEDED:
            needed_offsets.append(value)
        elif tag == _DT_STRTAB:
            strtab = value
        elif tag == _DT_STRSZ:
            strsz = value
    if not needed_offsets:
        return ElfDeps(interpreter, ())
    table = data[file_offset(strtab) : file_offset(strtab) + strsz]
    needed = tuple(table[o : table.index(b"\0", o)].decode() for o in needed_offsets)
    return ElfDeps(interpreter, needed)
