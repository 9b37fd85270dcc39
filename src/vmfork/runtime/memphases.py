"""Where a VMM child's own memory goes: by mapping, and by phase of its life.

A forked VMM's memory is the zygote's, shared copy-on-write, until someone writes to
it; what a child owns is its ``Private_Dirty``. This module says which mappings hold
those pages (``classify``: the classes of ``CLASSES``) and, when the zygote was started
with ``VMFORK_MEMORY_PHASES`` set, lets each child record its own breakdown at the
phases of its life (``record``): right after ``fork()``, after the child's set-up,
after the jail, after restore, once the agent answered, after the start-up memory was
given back, and once idle (``VMFORK_MEMORY_PHASES`` = the idle seconds, e.g. ``5``).

Off by default and free then: ``record`` returns at once. When on, each record reads
``/proc/self/smaps`` (which itself allocates a little: the figures of later phases
include that) and appends one JSON line to ``<run_dir>/memory-phases.jsonl``, the
directory the jail leaves writable; ``bench/spawn.py --breakdown`` reads it.

The setting is read once, at import, in the zygote: a jailed child's environment is
emptied before most of its phases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import re
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

ENV = "VMFORK_MEMORY_PHASES"
PHASES_FILE = "memory-phases.jsonl"
SMAPS_MAX = 16 << 20
"""Bytes of smaps read at most (a VMM's is ~100 KiB; a mapping per diff-chain run adds ~1 KiB)."""


def _idle_seconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise SystemExit(f"{ENV} must be the idle seconds before the last phase, got "
                         f"{value!r}") from None
    if not 0 <= seconds <= 3600:
        raise SystemExit(f"{ENV} must be 0-3600 seconds, got {value!r}")
    return seconds


IDLE_S = _idle_seconds(os.environ.get(ENV))
"""None: phases are not recorded. Else the seconds after ``ready`` of the ``idle`` phase."""

CLASSES = ("python_heap_anon", "malloc_arenas", "brk_heap", "child_heap", "thread_stacks",
           "main_stack", "python_binary", "core_so", "other_libraries", "guest_ram", "other")
"""What each holds:

* ``python_heap_anon``: anonymous mappings: pymalloc's arenas (CPython's small
  objects), glibc's mmap'd blocks (objects over 128 KiB), Rust's heap allocations when
  they are mmap'd;
* ``malloc_arenas``: glibc's per-thread malloc arenas (a thread's first ``malloc``
  gives it one, up to 8 per core, each a 64 MiB-aligned reservation of which the part
  in use is readable): the allocations of threads other than the main one;
* ``brk_heap``: ``[heap]``, glibc's main arena (objects over 512 bytes, C
  allocations of the main thread, and Rust's but in a native child);
* ``child_heap``: a native child's own heap (``native/src/child_heap.rs``), where its
  Rust allocations under 128 KiB go: named ``[anon:vmfork-child-heap]`` where the
  kernel names anonymous mappings, else the anonymous ``rw-p`` mapping of exactly
  ``CHILD_HEAP_BYTES``;
* ``thread_stacks``: an anonymous mapping right above a ``---p`` guard page (how glibc
  lays out every ``pthread`` stack: Python's threads and Rust's), but for the one page
  that guards a native child's heap from above;
* ``main_stack``: ``[stack]``;
* ``python_binary``: the interpreter's (or ``libpython``'s) file mappings, its data
  and the anonymous bss right after them (type objects, freelists, the GIL state,
  interned strings of the core);
* ``core_so``: ``vmfork._core``'s file mappings and bss;
* ``other_libraries``: every other file-backed object (libc, ld.so, extension modules);
* ``guest_ram``: the mappings ``is_guest_ram`` picks (not the VMM's own);
* ``other``: the rest (``[vvar]``, ``[vdso]``, files that are not libraries).
"""

# One match per line that matters: a mapping's header or its Private_Dirty.
_LINE = re.compile(rb"^(?:([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ *(.*)"
                   rb"|Private_Dirty: +(\d+) kB)$", re.MULTILINE)
PAGE = 4096
ARENA_BYTES = 64 << 20
"""glibc's ``HEAP_MAX_SIZE`` on 64-bit: a non-main arena's reservation, mapped at a
multiple of its size."""
CHILD_HEAP_BYTES = 48 << 20
"""A native child's heap's size (``_core.CHILD_HEAP_BYTES``, checked equal by
``test_memphases.py``; this module does not import the core)."""
CHILD_HEAP_NAME = "[anon:vmfork-child-heap]"
_bss_sizes: dict[str, int] = {}


def bss_bytes(path: str) -> int:
    """Bytes of anonymous memory (page-rounded) the loader maps after the file's last
    data page for the ELF object at ``path``: its bss. 0 if not an ELF64 or unreadable."""
    if path in _bss_sizes:
        return _bss_sizes[path]
    size = 0
    try:
        with open(path, "rb") as f:
            header = f.read(64)
            if header[:4] == b"\x7fELF" and header[4] == 2:
                phoff, = struct.unpack_from("<Q", header, 0x20)
                phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
                f.seek(phoff)
                table = f.read(phentsize * min(phnum, 64))
                for i in range(len(table) // phentsize):
                    p_type, _, _, vaddr, _, filesz, memsz, _ = struct.unpack_from(
                        "<IIQQQQQQ", table, i * phentsize)
                    if p_type == 1 and memsz > filesz:   # PT_LOAD with a bss
                        file_end = -(-(vaddr + filesz) // PAGE) * PAGE
                        size += max(0, -(-(vaddr + memsz) // PAGE) * PAGE - file_end)
    except OSError:
        size = 0
    _bss_sizes[path] = size
    return size


def _object_class(path: str) -> str | None:
    name = os.path.basename(path)
    if name.startswith("_core.") and name.endswith(".so"):
        return "core_so"
    if name.startswith("libpython") or name.startswith("python3"):
        return "python_binary"
    if ".so" in name:
        return "other_libraries"
    return None


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One mapping of a ``/proc/<pid>/smaps``: its range, ``perms`` (``rw-p``), the
    path or pseudo-name (empty when anonymous), its Private_Dirty (KiB) and its class
    (one of ``CLASSES``)."""
    start: int
    end: int
    perms: str
    path: str
    private_dirty_kib: int
    cls: str


def mappings(smaps: bytes | memoryview,
             is_guest_ram: Callable[[int, str], bool]) -> list[Mapping]:
    """Every mapping of the contents of a ``/proc/<pid>/smaps``, classified.
    ``is_guest_ram(size_bytes, path)`` picks guest RAM. An anonymous mapping right after
    an object's file mappings is that object's bss when it is no larger than the ELF
    says its bss is (the kernel merges a bss with the anonymous memory mapped just
    above it, which is then heap)."""
    raw: list[list[Any]] = []      # [start, end, perms, path, dirty], dirty filled in
    for match in _LINE.finditer(smaps):
        dirty = match.group(5)
        if dirty is not None:
            if raw:
                raw[-1][4] += int(dirty)
            continue
        raw.append([int(match.group(1), 16), int(match.group(2), 16),
                    match.group(3).decode(), match.group(4).strip().decode(errors="replace"), 0])
    out: list[Mapping] = []
    for i, (start, end, perms, path, dirty) in enumerate(raw):
        previous = raw[i - 1] if i else None
        following = raw[i + 1] if i + 1 < len(raw) else None
        adjacent = previous is not None and previous[1] == start
        previous_path = previous[3] if adjacent and previous and previous[3].startswith("/") else ""
        obj = _object_class(path) if path.startswith("/") else None
        owner = _object_class(previous_path) if previous_path else None
        reserve_follows = (following is not None and following[0] == end
                           and not following[3] and following[2].startswith("---"))
        if is_guest_ram(end - start, path):
            cls = "guest_ram"
        elif path == "[heap]":
            cls = "brk_heap"
        elif _is_child_heap(path, perms, end - start):
            cls = "child_heap"
        elif path == "[stack]":
            cls = "main_stack"
        elif obj is not None:
            cls = obj
        elif not path and owner is not None and end - start <= bss_bytes(previous_path):
            cls = owner                   # the object's bss, right after its data
        elif (not path and start % ARENA_BYTES == 0
              and (reserve_follows or end - start == ARENA_BYTES)):
            cls = "malloc_arenas"
        elif (not path and adjacent and previous is not None and previous[2].startswith("---")
              and not _is_child_heap_guard(raw, i - 1)):
            cls = "thread_stacks"
        elif not path:
            cls = "python_heap_anon"
        else:
            cls = "other"
        out.append(Mapping(start, end, perms, path, dirty, cls))
    return out


def _is_child_heap(path: str, perms: str, size: int) -> bool:
    return path == CHILD_HEAP_NAME or (not path and perms == "rw-p" and size == CHILD_HEAP_BYTES)


def _is_child_heap_guard(raw: list[list[Any]], i: int) -> bool:
    """Whether ``raw[i]`` is a native child's heap's upper guard page and no more: the
    mapping right above it is then not a thread's stack. (A stack's own guard placed
    there would have merged with it: two pages or more.)"""
    if i < 1 or raw[i][1] - raw[i][0] != PAGE:
        return False
    start, end, perms, path, _ = raw[i - 1]
    return end == raw[i][0] and _is_child_heap(path, perms, end - start)


def classify(smaps: bytes | memoryview, is_guest_ram: Callable[[int, str], bool]) -> dict[str, int]:
    """Private_Dirty in KiB per class of ``CLASSES`` (every class present), from the
    contents of a ``/proc/<pid>/smaps`` (``mappings``)."""
    out = dict.fromkeys(CLASSES, 0)
    for mapping in mappings(smaps, is_guest_ram):
        out[mapping.cls] += mapping.private_dirty_kib
    return out


@contextlib.contextmanager
def read_smaps(pid: int | str = "self") -> Iterator[memoryview]:
    """``/proc/<pid>/smaps``, read into an anonymous mapping of its own (unmapped on
    exit), not into the Python heap: a probe must not grow the heap it measures, and a
    large bytes object, once freed, would raise glibc's mmap threshold for good."""
    with mmap.mmap(-1, SMAPS_MAX) as buffer:
        view = memoryview(buffer)
        try:
            fd = os.open(f"/proc/{pid}/smaps", os.O_RDONLY | os.O_CLOEXEC)
            try:
                filled = 0
                while filled < SMAPS_MAX and (got := os.readv(fd, [view[filled:]])) > 0:
                    filled += got
            finally:
                os.close(fd)
            with view[:filled] as contents:
                yield contents
        finally:
            view.release()


def own_private_dirty(classes: dict[str, int]) -> int:
    """KiB: every class but guest RAM."""
    return sum(kib for name, kib in classes.items() if name != "guest_ram")


def guest_ram_paths(paths: Iterable[str], size: int | None = None) -> Callable[[int, str], bool]:
    """``is_guest_ram`` for guest RAM mapped from these files (a snapshot's memory file,
    a diff chain's layers) or, with ``size``, any file mapping of exactly the guest's
    RAM size: a jailed VMM opened its files before ``pivot_root``, and its smaps names
    them by a path outside its new root."""
    wanted = frozenset(os.path.realpath(p) for p in paths)   # smaps names the real file
    # A file mapped in another mount namespace (the zygote's own, which premaps a
    # snapshot's RAM) that the reader cannot reach from its root is named from that
    # namespace's root: with the reader in a chroot (the emulated test host's
    # /newroot), that is the real path behind a prefix (at a component boundary: every
    # wanted path starts with "/").
    return lambda length, path: any(path.endswith(w) for w in wanted) or (
        size is not None and length == size and path.startswith("/"))


def warm_up() -> None:
    """With phases on, run the probe once here, in the zygote (before a batch is
    forked): the ELF headers it reads are then cached, and its code quickened, in
    every child, so that a child's first phases do not count the probe's own start."""
    if IDLE_S is not None:
        with read_smaps() as smaps:
            classify(smaps, no_guest_ram)


def no_guest_ram(size: int, path: str) -> bool:
    return False


def record(phase: str, run_dir: str | None,
           is_guest_ram: Callable[[int, str], bool] = no_guest_ram) -> None:
    """Append this process's breakdown at ``phase`` to ``<run_dir>/memory-phases.jsonl``,
    if the zygote was started with ``VMFORK_MEMORY_PHASES``; else nothing. A failure is
    a line on stderr: a probe never fails the sandbox it measures."""
    if IDLE_S is None or run_dir is None:
        return
    try:
        with read_smaps() as smaps:
            classes = classify(smaps, is_guest_ram)
        line = json.dumps({"phase": phase, "mono_ns": time.monotonic_ns(),
                           "threads": len(os.listdir("/proc/self/task")),
                           "own_private_dirty_kib": own_private_dirty(classes),
                           "classes_kib": classes}) + "\n"
        fd = os.open(os.path.join(run_dir, PHASES_FILE),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            # The first phases are written as root, the later ones by the jail's uid:
            # the file is in the child's own run directory, which nobody else can enter.
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, 0o666)
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as err:
        print(f"vmfork memphases: phase {phase} not recorded: {err}", file=sys.stderr)


def read_phases(run_dir: str) -> list[dict[str, object]]:
    """The phases a child recorded, in order (empty if none)."""
    try:
        with open(os.path.join(run_dir, PHASES_FILE)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
