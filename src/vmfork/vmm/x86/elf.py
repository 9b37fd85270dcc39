"""Loading an uncompressed ELF ``vmlinux`` into guest memory.

Only what the x86-64 Linux image needs: 64-bit little-endian ``ET_EXEC``,
``PT_LOAD`` segments copied to their *physical* addresses (``p_paddr``), the
rest of each segment (``.bss``) zeroed, and ``e_entry`` (the physical address of
``startup_64``) returned. Every header field is checked against the file size
and guest memory before anything is copied.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from vmfork.vmm import openfiles
from vmfork.vmm.errors import BootError, GuestMemoryError
from vmfork.vmm.memory import GuestMemory

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
PT_LOAD = 1
ET_EXEC = 2
EM_X86_64 = 62


@dataclass(frozen=True)
class LoadedKernel:
    entry: int
    low: int       # lowest physical address loaded
    high: int      # end of the highest segment (memsz included)


def load_elf_kernel(memory: GuestMemory, path: str) -> LoadedKernel:
    try:
        f = os.fdopen(openfiles.open_ro(path), "rb")
    except OSError as err:
        raise BootError(f"kernel {path}: {err.strerror}", op="open_kernel") from err
    with f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as data:
        if len(data) < _EHDR.size or data[:4] != b"\x7fELF":
            raise BootError(f"kernel {path}: not an ELF file (an uncompressed vmlinux is "
                            "needed, not a bzImage)", op="parse_elf")
        (ident, e_type, machine, _, entry, phoff, _, _, _, phentsize, phnum,
         *_) = _EHDR.unpack_from(data, 0)
        if ident[4] != 2 or ident[5] != 1 or machine != EM_X86_64 or e_type != ET_EXEC:
            raise BootError(f"kernel {path}: not a 64-bit little-endian x86-64 executable ELF",
                            op="parse_elf")
        if phentsize != _PHDR.size or phoff + phnum * phentsize > len(data):
            raise BootError(f"kernel {path}: program headers out of bounds", op="parse_elf")
        low, high = 1 << 64, 0
        for i in range(phnum):
            p_type, _, offset, _, paddr, filesz, memsz, _ = _PHDR.unpack_from(
                data, phoff + i * phentsize)
            if p_type != PT_LOAD or memsz == 0:
                continue
            if filesz > memsz or offset + filesz > len(data):
                raise BootError(f"kernel {path}: segment {i} out of bounds", op="parse_elf")
            if paddr < 0x100000:
                raise BootError(f"kernel {path}: segment {i} loads below 1 MiB at {paddr:#x}",
                                op="load_elf")
            try:
                memory.write(paddr, data[offset:offset + filesz])
                memory.view(paddr + filesz, memsz - filesz)[:] = bytes(memsz - filesz)
            except GuestMemoryError as err:
                raise BootError(f"kernel {path}: segment {i} ({paddr:#x}+{memsz:#x}) does not "
                                "fit in guest memory; give the VM more memory",
                                op="load_elf") from err
            low, high = min(low, paddr), max(high, paddr + memsz)
        if high == 0:
            raise BootError(f"kernel {path}: no loadable segments", op="parse_elf")
        if not low <= entry < high:
            raise BootError(f"kernel {path}: entry {entry:#x} outside its segments",
                            op="parse_elf")
        return LoadedKernel(entry=entry, low=low, high=high)
