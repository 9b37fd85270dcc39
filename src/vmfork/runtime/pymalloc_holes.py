"""Fill the free blocks of CPython's partly used memory pools before a fork.

CPython's small-object allocator (pymalloc) carves 16 KiB pools into blocks of one
size class and serves an allocation from the first partly used pool of its class.
A zygote that has run for a while (decoded snapshots, warmed the restore path up,
answered requests) has freed many objects, so its partly used pools are full of
holes, spread over pages a forked child shares with it copy-on-write. Every object
the child then allocates lands in one of those holes, and each hole it writes costs
the child a copied 4 KiB page, however small the object: a child that allocates a
few thousand objects copies nearly as many pages.

``fill()`` allocates, just before the batch is forked, one object per free block of
each size class (the counts come from ``sys._debugmallocstats``), so that the
children's allocations start in fresh pools and pack densely into as few pages as
their size needs. The zygote keeps the objects while it forks the batch and drops
them afterwards, so it never holds more than the holes it had (no growth batch after
batch). Measured with ``bench/spawn.py --breakdown``: see docs/design-notes.md.
"""

from __future__ import annotations

import os
import re
import sys

_ROW = re.compile(rb"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", re.MULTILINE)
BYTES_HEADER = sys.getsizeof(b"")   # a bytes object of length n takes this + n bytes
FILL_MAX = 1 << 20
"""Objects allocated at most per fill (a pathological heap is not worth more)."""


def free_blocks() -> dict[int, int]:
    """Block size -> free blocks in the partly used pools of that size class, as
    ``sys._debugmallocstats`` reports them (it writes to the C stderr, so fd 2 is
    pointed at a memfd for the call). Empty if the report cannot be read."""
    report = os.memfd_create("vmfork-mallocstats", os.MFD_CLOEXEC)
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(report, 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
        size = os.lseek(report, 0, os.SEEK_END)
        text = os.pread(report, min(size, 1 << 20), 0)
    finally:
        os.close(saved)
        os.close(report)
    table = text.split(b"# arenas allocated total", 1)[0]
    return {int(m.group(2)): int(m.group(5)) for m in _ROW.finditer(table)
            if int(m.group(5)) > 0}


def _one(block_size: int, serial: int) -> object:
    """A new object whose allocation is served from the pools of ``block_size``."""
    if block_size <= 16:
        return object()                  # 16 bytes, no GC header
    if block_size <= 32:
        return float(serial) + 0.5       # 24 bytes (the float freelist may serve a few)
    return bytes(block_size - BYTES_HEADER)


def fill() -> list[object]:
    """Allocate one object per free block of every partly used pool; the caller holds
    the list while it forks and drops it after. Bounded by ``FILL_MAX``."""
    held: list[object] = []
    for block_size, count in sorted(free_blocks().items()):
        for _ in range(min(count, FILL_MAX - len(held))):
            held.append(_one(block_size, len(held)))
    return held
