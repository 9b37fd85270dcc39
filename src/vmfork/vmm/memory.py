"""Guest physical memory.

Guest RAM is one or more regions, each a host mapping registered with KVM as a
memory slot. A region is backed by anonymous memory, a memfd (so that another
process, or a snapshot writer, can map the same pages), or a file mapped
``MAP_PRIVATE`` (a snapshot's memory file: children share its pages until they
write), optionally with a diff chain's layer files mapped over parts of it
(``ondisk.memplan``). The VMM touches guest memory only through ``GuestMemory``, which
bounds-checks every access: a guest-supplied address that is not wholly inside
one region raises ``GuestMemoryError``. Nothing here trusts a guest address.

x86 layout (chosen so that MMIO windows sit below 4 GiB in a hole, as on PCs)::

    0            .. MMIO_HOLE_START   RAM (region 0)
    MMIO_HOLE_START .. 4 GiB          MMIO: virtio-mmio windows, IOAPIC, LAPIC
    4 GiB        .. 4 GiB + rest      RAM (region 1, when RAM exceeds the hole)
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass

from vmfork.ondisk import memplan
from vmfork.ondisk.layerfile import PAGE_SIZE as PAGE_SIZE  # guest RAM's, and its files'
from vmfork.ondisk.memplan import MemoryPlan
from vmfork.vmm.errors import GuestMemoryError, HostError
from vmfork.vmm.native import CORE_BUILT
from vmfork.vmm.openfiles import open_ro

if CORE_BUILT:
    from vmfork import _core

log = logging.getLogger(__name__)

MMIO_HOLE_START = 0xC000_0000  # 3 GiB: RAM below, device windows above
FOUR_GIB = 1 << 32
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MADV_DONTFORK = 10
_MADV_DOFORK = 11


@dataclass(frozen=True)
class RegionLayout:
    """Where one RAM region sits: guest physical address, size, and offset in the backing."""

    guest_phys: int
    size: int
    backing_offset: int


def ram_layout(mem_size: int) -> list[RegionLayout]:
    """Split ``mem_size`` bytes of RAM around the MMIO hole."""
    if mem_size <= 0 or mem_size % PAGE_SIZE:
        raise ValueError(f"guest memory size must be a positive multiple of {PAGE_SIZE}")
    low = min(mem_size, MMIO_HOLE_START)
    regions = [RegionLayout(0, low, 0)]
    if mem_size > low:
        regions.append(RegionLayout(FOUR_GIB, mem_size - low, low))
    return regions


class MemoryRegion:
    """One contiguous range of guest RAM and its host mapping: an ``mmap`` this process
    made, or a byte view of one another owner made (``GuestMemory.borrowed``)."""

    def __init__(self, layout: RegionLayout, mapping: mmap.mmap | memoryview) -> None:
        self.guest_phys = layout.guest_phys
        self.size = layout.size
        self.backing_offset = layout.backing_offset
        self.mapping = mapping
        self.host_addr = ctypes.addressof(ctypes.c_char.from_buffer(mapping))

    @property
    def end(self) -> int:
        return self.guest_phys + self.size


@dataclass(frozen=True)
class Overlay:
    """``length`` bytes of RAM at ``offset`` (backing layout) mapped from ``fd`` at
    ``file_offset``."""

    offset: int
    length: int
    fd: int
    file_offset: int


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _check_plan(path: str, mem_size: int, plan: MemoryPlan) -> None:
    if plan.mem_size != mem_size:
        raise HostError(f"the memory plan is for {plan.mem_size} bytes of RAM, not "
                        f"{mem_size}", op="map_snapshot")
    if os.path.abspath(path) != os.path.abspath(plan.source_path(0)):
        raise HostError(f"the memory plan's base is {plan.source_path(0)}, not {path}",
                        op="map_snapshot")


def _split_run(spans: list[tuple[int, int, int]], offset: int, length: int,
               file_offset: int) -> list[tuple[int, int, int, int]]:
    """A run at ``offset`` (backing layout) split at region boundaries: ``(host
    address, RAM offset, length, file offset)`` per piece. ``spans`` are the regions'
    ``(backing_offset, size, host_addr)``."""
    pieces: list[tuple[int, int, int, int]] = []
    for backing_offset, size, host_addr in spans:
        start = max(offset, backing_offset)
        end = min(offset + length, backing_offset + size)
        if start < end:
            pieces.append((host_addr + start - backing_offset, start, end - start,
                           file_offset + start - offset))
    return pieces


def _map_run(spans: list[tuple[int, int, int]], offset: int, length: int, fd: int,
             file_offset: int, prot: int = mmap.PROT_READ | mmap.PROT_WRITE) -> list[Overlay]:
    """Map ``fd`` at ``file_offset`` over RAM at ``offset`` (backing layout), split at
    region boundaries, MAP_PRIVATE | MAP_FIXED inside the regions' own mappings (so
    closing a region's mmap unmaps its overlays too)."""
    done: list[Overlay] = []
    for addr, start, size, at_file in _split_run(spans, offset, length, file_offset):
        at = _libc.mmap(addr, size, prot, mmap.MAP_PRIVATE | _MAP_FIXED, fd, at_file)
        if at == _MAP_FAILED or at is None:
            err = ctypes.get_errno()
            hint = ("; the process is out of memory mappings: raise vm.max_map_count or "
                    "compact the snapshot" if err == errno.ENOMEM else "")
            raise HostError(f"mapping a memory layer over RAM {start:#x}+{size:#x} "
                            f"failed: {os.strerror(err)}{hint}", op="map_snapshot", errno=err)
        done.append(Overlay(start, size, fd, at_file))
    return done


def _spans(regions: list[MemoryRegion]) -> list[tuple[int, int, int]]:
    return [(r.backing_offset, r.size, r.host_addr) for r in regions]


def _mapping_address(mapping: mmap.mmap) -> int:
    """Where ``mapping`` starts, without keeping a buffer export of it (one would make
    ``mapping.close()`` fail)."""
    view = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def _short_memory_file(path: str, size: int, mem_size: int) -> HostError:
    """A memory file shorter than the machine's RAM, in the words the native restore
    uses (``native/src/machine.rs``, ``map_file``)."""
    return HostError(f"memory file {path} is {size} bytes, shorter than the machine's "
                     f"{mem_size} bytes of RAM: a damaged snapshot (take it again, or "
                     "unpack it again from its pack)", op="map_snapshot")


def _file_identity(fd: int) -> tuple[int, int, int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class PremappedRam:
    """A diff chain's guest RAM mapped ahead of ``fork()``, by the process that forks
    the VMMs restoring it (the zygote, ``runtime.vmmchild.prefork``): the plan's base
    ``MAP_PRIVATE`` and every run ``MAP_FIXED`` over it, as ``from_file_private`` maps
    them, but ``PROT_READ``. A child inherits the mappings with the fork (a private
    mapping is copy-on-write per process) and adopts them as its RAM
    (``from_file_private(premapped=)``) instead of issuing one mmap per run.

    Read-only, so that the forking process can never write a page every later child
    would then inherit (a write faults), and so that it is not charged the RAM's size
    of commit; nobody touches its pages, so it holds no resident memory either. Each
    mapping is an anonymous ``mmap`` object (no file descriptor of its own) with the
    file mapped over it: ``close()`` unmaps the region and its runs, and closes no fd
    (a forked child has closed every inherited fd; one it reused must not be closed).
    """

    base_path: str
    mem_size: int
    runs: int
    sources: tuple[tuple[int, int, int, int], ...]
    """``st_dev, st_ino, st_size, st_mtime_ns`` of each source of the plan, in order:
    the files mapped, as a child must find them again to adopt the mapping."""
    mappings: tuple[mmap.mmap, ...]   # one per region of ``ram_layout(mem_size)``
    overlays: tuple[tuple[int, int, int, int], ...]
    """The runs as mapped, split at regions: ``(offset, length, source, file offset)``."""

    @classmethod
    def map(cls, path: str, mem_size: int, plan: MemoryPlan) -> PremappedRam:
        """Map ``plan`` (whose base is ``path``) for ``mem_size`` bytes of RAM.
        ``HostError``/``PlanError`` as ``from_file_private`` raises them."""
        _check_plan(path, mem_size, plan)
        fds = memplan.open_sources(plan)
        mappings: list[mmap.mmap] = []
        try:
            sources = tuple(_file_identity(fd) for fd in fds)
            if sources[0][2] < mem_size:
                raise _short_memory_file(path, sources[0][2], mem_size)
            spans: list[tuple[int, int, int]] = []
            for layout in ram_layout(mem_size):
                # MAP_NORESERVE: the placeholder is replaced at once, never charged.
                m = mmap.mmap(-1, layout.size, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
                mappings.append(m)
                addr = _mapping_address(m)
                at = _libc.mmap(addr, layout.size, mmap.PROT_READ,
                                mmap.MAP_PRIVATE | _MAP_FIXED, fds[0], layout.backing_offset)
                if at == _MAP_FAILED or at is None:
                    err = ctypes.get_errno()
                    raise HostError(f"mapping memory file {path}: {os.strerror(err)}",
                                    op="map_snapshot", errno=err)
                spans.append((layout.backing_offset, layout.size, addr))
            overlays = tuple((o.offset, o.length, run.source, o.file_offset)
                             for run in plan.runs
                             for o in _map_run(spans, run.offset, run.length, fds[run.source],
                                               run.source_offset, mmap.PROT_READ))
        except BaseException:
            for m in mappings:
                m.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)   # the mappings hold the files
        return cls(os.path.abspath(path), mem_size, len(plan.runs), sources, tuple(mappings),
                   overlays)

    def host_regions(self) -> list[tuple[int, int, int]]:
        """``(guest address, size, host address)`` of each region: where a child that
        runs no Python finds it (``runtime.vmmchild.inherited_ram``)."""
        return [(layout.guest_phys, layout.size, _mapping_address(m))
                for layout, m in zip(ram_layout(self.mem_size), self.mappings)]

    def release(self) -> None:
        """Unmap it (only where it is mapped: the process that made it, or a child
        that inherited it)."""
        for m in self.mappings:
            m.close()

    def set_inherited(self, inherited: bool) -> None:
        """Whether a ``fork()`` copies it (``MADV_DOFORK``/``MADV_DONTFORK``): the
        children of other snapshots need not inherit it, and then need not unmap it.
        ``OSError`` if the kernel refuses."""
        advice = _MADV_DOFORK if inherited else _MADV_DONTFORK
        for m in self.mappings:
            m.madvise(advice)


def subtract_runs(extents: list[tuple[int, int]],
              holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of sorted, disjoint ``extents`` outside sorted, disjoint ``holes``."""
    out: list[tuple[int, int]] = []
    h = 0
    for start, length in extents:
        end = start + length
        while h < len(holes) and holes[h][0] + holes[h][1] <= start:
            h += 1
        k = h
        while start < end:
            if k >= len(holes) or holes[k][0] >= end:
                out.append((start, end - start))
                break
            hole_start, hole_end = holes[k][0], holes[k][0] + holes[k][1]
            if hole_start > start:
                out.append((start, hole_start - start))
            start = max(start, hole_end)
            k += 1
    return out


class GuestMemory:
    """All of guest RAM. Thread-safe for reads and writes of distinct ranges."""

    def __init__(self, regions: list[MemoryRegion], backing_fd: int | None = None,
                 private_file: bool = False,
                 overlays: tuple[Overlay, ...] = (), overlay_fds: tuple[int, ...] = (),
                 overlay_pieces: tuple[tuple[int, int, int, int], ...] | None = None) -> None:
        self.regions = sorted(regions, key=lambda r: r.guest_phys)
        self.backing_fd = backing_fd  # memfd or snapshot file, if any; owned by us
        # True when RAM is a snapshot file mapped MAP_PRIVATE: every page the guest
        # or the VMM wrote is then a private anonymous page (see vmm.dirty).
        self.private_file = private_file
        # Ranges mapped from layer files over the snapshot file (a diff chain's plan),
        # sorted; their fds are ours too. Adopted RAM (PremappedRam) gives them as
        # ``overlay_pieces`` (offset, length, source, file offset; source i >= 1 is
        # overlay_fds[i - 1]), made into Overlays only when a capture asks.
        self._overlays: tuple[Overlay, ...] | None = overlays if overlay_pieces is None else None
        self._overlay_pieces = overlay_pieces or ()
        self._overlay_fds = overlay_fds
        self.size = sum(r.size for r in self.regions)
        # The native core's view of the same mappings (virtqueue walks and copies run
        # there); it forgets them in close(), before they are unmapped.
        self.native: _core.GuestRam | None = (
            _core.GuestRam([(r.guest_phys, r.size, r.host_addr) for r in self.regions])
            if CORE_BUILT else None)

    @property
    def overlays(self) -> tuple[Overlay, ...]:
        if self._overlays is None:
            fds = self._overlay_fds
            self._overlays = tuple(Overlay(offset, length, fds[source - 1], file_offset)
                                   for offset, length, source, file_offset
                                   in self._overlay_pieces)
        return self._overlays

    # -- construction -------------------------------------------------------------
    @classmethod
    def anonymous(cls, mem_size: int) -> GuestMemory:
        regions = []
        for layout in ram_layout(mem_size):
            m = mmap.mmap(-1, layout.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            regions.append(MemoryRegion(layout, m))
        return cls(regions)

    @classmethod
    def memfd(cls, mem_size: int, name: str = "vmfork-guest-ram") -> GuestMemory:
        """RAM in a memfd mapped ``MAP_SHARED``: its pages can be mapped elsewhere."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, mem_size)
            regions = []
            for layout in ram_layout(mem_size):
                m = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED,
                              offset=layout.backing_offset)
                regions.append(MemoryRegion(layout, m))
        except OSError as err:
            os.close(fd)
            raise HostError(f"guest memory: memfd of {mem_size} bytes: {err}",
                            op="memfd", errno=err.errno) from err
        return cls(regions, backing_fd=fd)

    @classmethod
    def from_file_private(cls, path: str, mem_size: int,
                          plan: MemoryPlan | None = None,
                          premapped: PremappedRam | None = None) -> GuestMemory:
        """Map a memory file copy-on-write: reads share the page cache, writes are private.

        With ``plan`` (a diff chain, ``ondisk.memplan``), ``path`` must be the plan's
        base memory file; each run of the plan is then mapped from its layer file
        over the base, ``MAP_PRIVATE | MAP_FIXED``: nothing is read or copied.

        ``premapped``: the same mapping, made before this process was forked and
        inherited (``PremappedRam``). It is adopted, made writable, when it maps
        this very plan: the same base, size and run count, and every source still
        the file it mapped (device, inode, size, mtime of the file opened now);
        otherwise it is unmapped and the plan mapped here, as without it. The
        sources are opened either way: a capture reads the base's extents and the
        layers through them (``base_sources``).
        """
        if plan is not None:
            _check_plan(path, mem_size, plan)
            fds = memplan.open_sources(plan)
        else:
            fds = [open_ro(path)]
        if premapped is not None:
            try:
                reason = (None if plan is not None
                          and premapped.base_path == os.path.abspath(path)
                          and premapped.mem_size == mem_size
                          and premapped.runs == len(plan.runs)
                          and premapped.sources == tuple(_file_identity(fd) for fd in fds)
                          else "it maps other files")
                if reason is None and plan is not None:
                    memory = cls._adopt(premapped, fds)
                    log.info("guest RAM: adopted the premapped %s (%d runs)", path,
                             premapped.runs)
                    return memory
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            log.warning("the premapped RAM of %s is not adopted (%s); mapping it here",
                        path, reason)
            premapped.release()
        regions: list[MemoryRegion] = []
        overlays: list[Overlay] = []
        try:
            if (size := os.fstat(fds[0]).st_size) < mem_size:
                raise _short_memory_file(path, size, mem_size)
            for layout in ram_layout(mem_size):
                m = mmap.mmap(fds[0], layout.size, flags=mmap.MAP_PRIVATE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=layout.backing_offset)
                regions.append(MemoryRegion(layout, m))
            spans = _spans(regions)
            for run in plan.runs if plan is not None else ():
                overlays.extend(_map_run(spans, run.offset, run.length, fds[run.source],
                                         run.source_offset))
        except BaseException:
            for r in regions:
                if isinstance(r.mapping, mmap.mmap):   # (all are: mapped just above)
                    r.mapping.close()
            for fd in fds:
                os.close(fd)
            raise
        return cls(regions, backing_fd=fds[0], private_file=True, overlays=tuple(overlays),
                   overlay_fds=tuple(fds[1:]))

    @classmethod
    def _adopt(cls, premapped: PremappedRam, fds: list[int]) -> GuestMemory:
        """RAM from an inherited ``premapped`` (checked by the caller, who
        closes ``fds`` if this raises): writable, and its overlays those the premap
        recorded, read through this process's fds."""
        layouts = ram_layout(premapped.mem_size)
        if len(layouts) != len(premapped.mappings) or any(
                len(m) != layout.size for m, layout in zip(premapped.mappings, layouts)):
            raise HostError("the premapped RAM does not have the layout of its size",
                            op="map_snapshot")
        regions = [MemoryRegion(layout, m) for layout, m in zip(layouts, premapped.mappings)]
        for r in regions:
            if _libc.mprotect(r.host_addr, r.size, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
                err = ctypes.get_errno()
                raise HostError(f"making the premapped RAM writable: {os.strerror(err)}",
                                op="map_snapshot", errno=err)
        return cls(regions, backing_fd=fds[0], private_file=True, overlay_fds=tuple(fds[1:]),
                   overlay_pieces=premapped.overlays)

    @classmethod
    def borrowed(cls, host_regions: list[tuple[int, int, int]], path: str, mem_size: int,
                 plan: MemoryPlan | None = None) -> GuestMemory:
        """RAM that another owner mapped ``MAP_PRIVATE`` from the memory file ``path``
        (with ``plan``: a diff chain's runs mapped over it, as ``from_file_private``
        maps them) and keeps mapped while this object lives: a native child's
        ``NativeMachine`` (``vmm/native_view.py``). ``host_regions``: its ``(guest
        address, size, host address)`` per region of ``ram_layout(mem_size)``. The
        files are opened here (``open_ro``: the jail's descriptors in a jailed VMM),
        for a capture's ``base_sources``; ``close`` closes them and unmaps nothing."""
        layouts = ram_layout(mem_size)
        if [(gpa, size) for gpa, size, _ in host_regions] != [
                (layout.guest_phys, layout.size) for layout in layouts]:
            raise HostError(f"the machine's RAM regions {host_regions} do not have the "
                            f"layout of {mem_size} bytes", op="map_snapshot")
        if plan is not None:
            _check_plan(path, mem_size, plan)
        fds = memplan.open_sources(plan) if plan is not None else [open_ro(path)]
        regions = [MemoryRegion(layout, memoryview(
                       (ctypes.c_char * size).from_address(host)).cast("B"))
                   for layout, (_, size, host) in zip(layouts, host_regions)]
        spans = _spans(regions)
        pieces = tuple((start, size, run.source, at_file)
                       for run in (plan.runs if plan is not None else ())
                       for _, start, size, at_file in _split_run(
                           spans, run.offset, run.length, run.source_offset))
        return cls(regions, backing_fd=fds[0], private_file=True, overlay_fds=tuple(fds[1:]),
                   overlay_pieces=pieces)

    def close(self) -> None:
        if self.native is not None:
            self.native.close()  # waits for a native access in flight on another thread
        for r in self.regions:
            if isinstance(r.mapping, memoryview):
                continue   # borrowed: its owner unmaps it
            try:
                r.mapping.close()
            except BufferError:
                # A ctypes view still points into it; the mapping goes with the process.
                pass
        if self.backing_fd is not None:
            os.close(self.backing_fd)
            self.backing_fd = None
        for fd in self._overlay_fds:
            os.close(fd)
        self._overlay_fds = ()
        if self._overlays is None:
            self._overlays = ()   # their fds are gone

    def base_sources(self, data_extents: list[tuple[int, int]]) -> Iterator[Overlay]:
        """Where the snapshot this RAM was restored from keeps each range of its data,
        in offset order: ``data_extents`` (the snapshot file's data extents) outside
        the overlays, from the snapshot file, and each overlay from its layer file."""
        assert self.backing_fd is not None
        pieces = [Overlay(offset, length, self.backing_fd, offset)
                  for offset, length in subtract_runs(data_extents,
                                                  [(o.offset, o.length) for o in self.overlays])]
        yield from sorted([*pieces, *self.overlays], key=lambda o: o.offset)

    # -- memory files ---------------------------------------------------------------------
    def dump(self, path: str) -> int:
        """Write all of guest RAM to ``path`` in backing-file layout (region at its
        ``backing_offset``), sparse: only data is written. Returns bytes written.

        A memfd is copied in the kernel (``sendfile``) extent by extent, found with
        ``SEEK_DATA``/``SEEK_HOLE``, so never-touched RAM costs nothing, and the
        all-zero pages inside its extents are skipped (RAM a guest touched but holds
        zeros, e.g. pages it zeroed for an allocation and freed). Other mappings are
        scanned in 1 MiB blocks and all-zero blocks are skipped.
        """
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        written = 0
        try:
            os.ftruncate(fd, self.size)
            if self.backing_fd is not None and self._backing_is_memfd():
                written = self._dump_memfd(fd)
            else:
                written = self._dump_mappings(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        return written

    def _backing_is_memfd(self) -> bool:
        assert self.backing_fd is not None
        return os.readlink(f"/proc/self/fd/{self.backing_fd}").startswith("/memfd:")

    def _dump_memfd(self, out: int) -> int:
        src = self.backing_fd
        assert src is not None
        written, offset = 0, 0
        while offset < self.size:
            try:
                start = os.lseek(src, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after offset
                break
            end = min(os.lseek(src, start, os.SEEK_HOLE), self.size)
            for run_start, run_end in self._nonzero_runs(start, end):
                pos = run_start
                while pos < run_end:
                    os.lseek(out, pos, os.SEEK_SET)
                    n = os.sendfile(out, src, pos, run_end - pos)
                    if n <= 0:
                        raise HostError(f"guest memory dump: sendfile stopped at {pos:#x}",
                                        op="dump_memory")
                    pos += n
                written += run_end - run_start
            offset = end
        return written

    def _nonzero_runs(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """``[start, end)`` (backing layout, page-aligned) as runs of pages that are not
        all zero, read through the mappings."""
        zero_head, zero_page = bytes(64), bytes(PAGE_SIZE)
        run: int | None = None
        for region in self.regions:
            lo = max(start, region.backing_offset)
            hi = min(end, region.backing_offset + region.size)
            if lo >= hi:
                continue
            view = memoryview(region.mapping)
            try:
                for page in range(lo, hi, PAGE_SIZE):
                    rel = page - region.backing_offset
                    zero = (view[rel:rel + 64].tobytes() == zero_head
                            and view[rel:rel + PAGE_SIZE].tobytes() == zero_page)
                    if zero and run is not None:
                        yield run, page
                        run = None
                    elif not zero and run is None:
                        run = page
            finally:
                view.release()
            if run is not None:
                yield run, hi
                run = None

    def _dump_mappings(self, out: int) -> int:
        block = 1 << 20
        zero = bytes(block)
        written = 0
        for region in self.regions:
            view = memoryview(region.mapping)
            for off in range(0, region.size, block):
                chunk = view[off:off + block]
                if chunk != zero[:len(chunk)]:
                    os.pwrite(out, chunk, region.backing_offset + off)
                    written += len(chunk)
            view.release()
        return written

    def backing_view(self, offset: int, length: int) -> memoryview:
        """A view of ``length`` bytes at ``offset`` in backing-file layout (the layout
        of memory files and of layer extents), within one region."""
        for r in self.regions:
            if r.backing_offset <= offset and offset + length <= r.backing_offset + r.size:
                start = offset - r.backing_offset
                return memoryview(r.mapping)[start:start + length]
        raise GuestMemoryError(f"backing range {offset:#x}+{length:#x} is not inside one "
                               "RAM region")

    # -- bounds-checked access ----------------------------------------------------
    def _find(self, gpa: int, length: int) -> tuple[MemoryRegion, int]:
        if gpa < 0 or length < 0:
            raise GuestMemoryError(f"negative guest address or length ({gpa:#x}, {length})")
        for r in self.regions:
            if r.guest_phys <= gpa < r.end:
                if gpa + length > r.end:
                    raise GuestMemoryError(
                        f"guest range {gpa:#x}+{length:#x} crosses the end of RAM region "
                        f"{r.guest_phys:#x}..{r.end:#x}")
                return r, gpa - r.guest_phys
        raise GuestMemoryError(f"guest address {gpa:#x} is not in guest RAM")

    def check_range(self, gpa: int, length: int) -> None:
        self._find(gpa, length)

    def view(self, gpa: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes at ``gpa`` (zero-copy)."""
        region, off = self._find(gpa, length)
        return memoryview(region.mapping)[off:off + length]

    def read(self, gpa: int, length: int) -> bytes:
        return bytes(self.view(gpa, length))

    def write(self, gpa: int, data: bytes | bytearray | memoryview) -> None:
        self.view(gpa, len(data))[:] = data

    def read_u16(self, gpa: int) -> int:
        return int.from_bytes(self.view(gpa, 2), "little")

    def read_u32(self, gpa: int) -> int:
        return int.from_bytes(self.view(gpa, 4), "little")

    def read_u64(self, gpa: int) -> int:
        return int.from_bytes(self.view(gpa, 8), "little")

    def write_u16(self, gpa: int, value: int) -> None:
        self.view(gpa, 2)[:] = (value & 0xFFFF).to_bytes(2, "little")

    def write_u32(self, gpa: int, value: int) -> None:
        self.view(gpa, 4)[:] = (value & 0xFFFF_FFFF).to_bytes(4, "little")

    def write_u64(self, gpa: int, value: int) -> None:
        self.view(gpa, 8)[:] = (value & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little")
