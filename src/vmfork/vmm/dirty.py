"""Which guest pages changed, read from the kernel's page tables: no tracking until asked.

A diff snapshot needs the pages changed since some base. KVM's dirty log
(``KVM_MEM_LOG_DIRTY_PAGES``) would give the guest's writes, but it must be armed
before the writes happen (a cost every sandbox pays, branched or not) and it does
not see the VMM's own writes into guest RAM (virtio buffers, used rings). The
host kernel already knows both, for free, through ``/proc/self/pagemap``
(Documentation/admin-guide/mm/pagemap.rst): one u64 per virtual page, with

* bit 63 page present, bit 62 page swapped,
* bit 61 "page is a file page or shared anonymous",
* bit 55 "PTE is soft-dirty" (Documentation/admin-guide/mm/soft-dirty.rst).

**Changed since the snapshot the sandbox was restored from.** A restored child
maps the snapshot's ``memory.bin`` ``MAP_PRIVATE``. A page nobody wrote is the
file's page cache page (bit 61 set, or not present at all); the first write,
by a vCPU through KVM's fault path or by the VMM through its mapping, breaks
copy-on-write and installs a private anonymous page (bit 61 clear, bit 63 or 62
set). So "present or swapped, and not file" is exactly the set of pages that
differ from the base file, with no tracking at all before the first branch.
It stays exact over the sandbox's life, so it is always a valid diff against
the restore base: a COW page turns back into a file page only when the VMM drops
it (``MADV_DONTNEED``), which it does for pages the guest reported free
(``devices/virtio/balloon.py``), and then it reads as the file's page again.

**Changed since the previous capture.** Writing ``4`` to
``/proc/self/clear_refs`` clears every soft-dirty bit of the process and
write-protects its PTEs; the next write to a page faults and sets the bit again.
KVM takes part: clearing invalidates its secondary page tables through an MMU
notifier (``MMU_NOTIFY_SOFT_DIRTY``), so a vCPU's next write goes through the
host fault path too, and VMM writes fault like any user write. Clearing costs a
walk over the process's page tables during the pause and one write fault per
page written afterwards -- the same price as KVM dirty logging, paid only by
sandboxes that have branched. ``CONFIG_MEM_SOFT_DIRTY`` is optional: where the
kernel lacks it (``soft_dirty_supported``), diffs are taken against the restore
base instead, which is correct and only larger.

The bitmaps are classified without a Python loop per page: the flag bytes of
every entry are sliced out (``data[7::8]``), mapped to 0/1 with
``bytes.translate``, and the runs of ones are found with ``bytes.find``, so
the Python work is per run of changed pages, not per page.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

from vmfork.vmm import openfiles
from vmfork.vmm.errors import HostError
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory

Run = tuple[int, int]   # (offset in backing-file layout, length), both page-aligned bytes

_ENTRY = 8
# Byte 7 of an entry holds bits 56..63, byte 6 bits 48..55.
_PRESENT, _SWAPPED, _FILE_OR_SHARED = 0x80, 0x40, 0x20     # bits 63, 62, 61 in byte 7
_SOFT_DIRTY = 0x80                                          # bit 55 in byte 6

_PRIVATE_CHANGED = bytes(1 if (b & (_PRESENT | _SWAPPED)) and not b & _FILE_OR_SHARED else 0
                         for b in range(256))
_IN_MEMORY = bytes(1 if b & (_PRESENT | _SWAPPED) else 0 for b in range(256))
_SOFT_DIRTY_SET = bytes(1 if b & _SOFT_DIRTY else 0 for b in range(256))


def _read_pagemap(host_addr: int, pages: int) -> bytes:
    fd = openfiles.open_proc_self("pagemap", os.O_RDONLY)
    try:
        want = pages * _ENTRY
        offset = (host_addr // PAGE_SIZE) * _ENTRY
        chunks = []
        got = 0
        while got < want:
            chunk = os.pread(fd, want - got, offset + got)
            if not chunk:
                raise HostError(f"pagemap read stopped at entry {got // _ENTRY} of {pages}",
                                op="read_pagemap")
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def _runs(flags: bytes, backing_offset: int) -> list[Run]:
    """Runs of 1 bytes in ``flags`` (one per page) as byte ranges in backing layout."""
    runs = []
    pos = flags.find(1)
    while pos >= 0:
        end = flags.find(0, pos)
        if end < 0:
            end = len(flags)
        runs.append((backing_offset + pos * PAGE_SIZE, (end - pos) * PAGE_SIZE))
        pos = flags.find(1, end)
    return runs


def changed_private_pages(memory: GuestMemory) -> list[Run]:
    """Pages that differ from the memory file a ``MAP_PRIVATE`` guest was restored from."""
    if not memory.private_file:
        raise HostError("changed pages against the restore base need guest memory mapped "
                        "MAP_PRIVATE from a snapshot file", op="changed_private_pages")
    runs: list[Run] = []
    for region in memory.regions:
        data = _read_pagemap(region.host_addr, region.size // PAGE_SIZE)
        runs += _runs(data[7::_ENTRY].translate(_PRIVATE_CHANGED), region.backing_offset)
    return runs


def soft_dirty_pages(memory: GuestMemory) -> list[Run]:
    """Pages written since the last ``clear_soft_dirty`` (present or swapped ones:
    a never-touched page can carry the bit of a fresh mapping but has no data)."""
    runs: list[Run] = []
    for region in memory.regions:
        data = _read_pagemap(region.host_addr, region.size // PAGE_SIZE)
        dirty = data[6::_ENTRY].translate(_SOFT_DIRTY_SET)
        present = data[7::_ENTRY].translate(_IN_MEMORY)
        both = (int.from_bytes(dirty, "little") & int.from_bytes(present, "little"))
        runs += _runs(both.to_bytes(len(dirty), "little"), region.backing_offset)
    return runs


def clear_soft_dirty() -> None:
    """Clear the soft-dirty bits of every page of this process (see the module notes)."""
    fd = openfiles.open_proc_self("clear_refs", os.O_WRONLY)
    try:
        os.write(fd, b"4")
    except OSError as err:
        raise HostError(f"clearing soft-dirty bits failed: {err}", op="clear_refs",
                        errno=err.errno) from err
    finally:
        os.close(fd)


@functools.cache
def soft_dirty_supported() -> bool:
    """Whether this kernel tracks soft-dirty bits (``CONFIG_MEM_SOFT_DIRTY``).

    A new mapping starts soft-dirty (``VM_SOFTDIRTY``), so a touched page of a
    fresh mapping reports bit 55 exactly when the kernel has the feature; the
    probe clears nothing.
    """
    probe = mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = ctypes.c_char.from_buffer(probe)
        addr = ctypes.addressof(view)
        del view
        probe[0:1] = b"\1"
        entry = _read_pagemap(addr, 1)
    finally:
        probe.close()
    return bool(entry[6] & _SOFT_DIRTY) and bool(entry[7] & _PRESENT)


# A diff layer's runs are merged across the smallest gaps between them (the gaps'
# unchanged pages written too) while the pages added stay within this share of the
# changed ones. Every run of a layer is a mapping in each process that maps its chain
# (two: it splits the mapping of the layer below), and a fork copies each mapping: a
# chain's premap of ~600 runs made a native fork ~0.6 ms slower than a flat snapshot's
# (~10 ms in the emulated test host). On the chain bench's layers, gaps of up to four
# pages hold 40-45% of the runs, for 4-9% more bytes (design notes, "A diff layer's
# runs merged across small gaps").
COALESCE_SHARE = 0.05


def coalesced(runs: list[Run], share: float = COALESCE_SHARE) -> list[Run]:
    """``runs`` (sorted, disjoint) merged across their gaps, the smallest first, while
    the bytes of the gaps merged stay within ``share`` of the runs' own bytes."""
    if len(runs) < 2:
        return list(runs)
    allowed = int(sum(length for _, length in runs) * share)
    gaps = sorted((runs[i + 1][0] - runs[i][0] - runs[i][1], i) for i in range(len(runs) - 1))
    merged: set[int] = set()     # i: runs[i] and runs[i + 1] become one
    for gap, i in gaps:
        if gap < 0:
            raise ValueError(f"runs overlap or are out of order at {runs[i + 1][0]:#x}")
        if gap > allowed:
            break
        allowed -= gap
        merged.add(i)
    out: list[Run] = []
    for i, (offset, length) in enumerate(runs):
        if i - 1 in merged:
            start = out[-1][0]
            out[-1] = (start, offset + length - start)
        else:
            out.append((offset, length))
    return out


def page_count(runs: list[Run]) -> int:
    return sum(length for _, length in runs) // PAGE_SIZE
