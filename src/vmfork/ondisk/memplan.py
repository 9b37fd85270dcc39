"""Memory plans: guest RAM as a chain's files mapped layer over layer.

A diff snapshot does not store its memory image. It stores the pages it changed
(``layer.bin``, ``ondisk.layerfile``) and a *plan*: for every range of guest RAM
(in memory-file layout) the file and file offset that holds its bytes -- the
chain's base ``memory.bin`` everywhere, except where a link's layer provides
the page, the topmost link winning. The store computes it once, when the
snapshot is published; a restore then only maps:

1. the base ``memory.bin`` ``MAP_PRIVATE`` over the whole of RAM, as for a flat
   snapshot;
2. each run of the plan from its layer file, ``MAP_PRIVATE | MAP_FIXED`` over
   the range it provides (a layer's page data is page-aligned in its file, so
   every run starts at a mappable offset).

No guest memory is read, hashed or copied at restore, so a spawn costs the same
at any chain depth, up to the cost of one ``mmap`` per run; and disk per link is
the pages it changed. To the kernel every page of the result is still a file
page until written, so dirty tracking (``vmfork.vmm.dirty``: "present and not a file
page" = changed since the restore) and copy-on-write work as for one file.

**The VMA budget.** Each run splits a mapping: ``n`` runs cost up to ``2n + 1``
VMAs, and a process may have ``vm.max_map_count`` (65530 by default) of them.
``MAX_RUNS`` keeps a plan at a quarter of that limit's worth of runs, leaving
the rest to the VMM's own mappings; a chain whose plan would need more is
materialised into a flat ``memory.bin`` at publish time instead (the store does
that, ``vmfork.store.layers``).

File layout (little-endian)::

    0    header   magic "VMFKPLAN", format version, page size, guest RAM size,
                  source count, run count, sources length, CRC-32 of the body,
                  CRC-32 of the header fields before it
    64   sources  JSON: a list of {"path", "size", "owner_content_hash",
                  "file_hash"}; source 0 is the base memory file
    ...  runs     run_count x (offset u64, length u64, source u64, source offset
                  u64), starting 8-aligned after the sources, sorted, disjoint

A source's ``path`` is ``<tag>/<file>``, relative to the store's snapshots
directory (the directory above the one holding the plan), so a store can be
moved whole. A restore refuses (``PlanError``) a plan whose sources are missing
or not the size it recorded -- it never maps a file that is not the one the
plan was computed from; the store additionally checks each source's owner tag
and content hash (``vmfork.store.chains.check_plan``). Readers treat a plan as
hostile: sizes and counts are bounded, runs must be aligned, in order, inside
guest RAM and inside their source file.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from vmfork.ondisk.errors import OnDiskError
from vmfork.ondisk.layerfile import PAGE_SIZE, LayerIndex, check_header
from vmfork.ondisk.readonly import open_ro

PLAN_FILE = "memory.plan"
MAGIC = b"VMFKPLAN"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQIIIII")
HEADER_SIZE = 64
_RUN = struct.Struct("<QQQQ")
# A quarter of the default vm.max_map_count in runs (each costs up to two VMAs).
MAX_RUNS = 16384
MAX_SOURCES = 64
_MAX_SOURCES_BYTES = 1 << 20
MAX_PLAN_BYTES = HEADER_SIZE + _MAX_SOURCES_BYTES + 8 + MAX_RUNS * _RUN.size
_SOURCE_PATH = re.compile(r"[A-Za-z0-9_-]{1,64}/(memory|layer)\.bin")


class PlanError(OnDiskError):
    """A memory plan is malformed, or a file it maps is missing or changed."""


class PlanTooLarge(PlanError):
    """A plan needs more runs than ``MAX_RUNS`` (its chain must be materialised)."""


@dataclass(frozen=True)
class PlanSource:
    """A file a plan maps from. ``file_hash`` is the hash the store recorded for it
    (None where it recorded none); ``owner_content_hash`` the content hash of the
    snapshot that holds it."""

    path: str
    size: int
    owner_content_hash: str | None = None
    file_hash: str | None = None

    @property
    def owner_tag(self) -> str:
        return self.path.split("/", 1)[0]


@dataclass(frozen=True)
class PlanRun:
    """``length`` bytes of RAM at ``offset`` (memory-file layout) come from source
    ``source`` at ``source_offset``."""

    offset: int
    length: int
    source: int
    source_offset: int


@dataclass(frozen=True)
class MemoryPlan:
    mem_size: int
    sources: tuple[PlanSource, ...]
    runs: tuple[PlanRun, ...]
    # Where the plan was read from: its sources' paths are relative to the directory
    # above this one (the store's snapshots directory). Not part of the file.
    directory: str | None = field(default=None, compare=False)

    def source_path(self, index: int) -> str:
        if self.directory is None:
            raise PlanError("this plan was not read from a file; its sources have no "
                            "directory", op="memory_plan")
        return os.path.join(os.path.dirname(self.directory), self.sources[index].path)


# -- computing a plan -------------------------------------------------------------------

def resolve_runs(layers: Sequence[tuple[int, LayerIndex]]) -> list[PlanRun]:
    """The runs of a chain's layers, given base to head as (source index, index):
    for each range some layer provides, the topmost one's bytes, with adjacent
    runs of one file coalesced. Ranges no layer provides come from the base."""
    runs: list[PlanRun] = []
    for source, index in layers:
        upper: list[PlanRun] = []
        file_offset = index.data_offset
        for offset, length in index.extents:
            upper.append(PlanRun(offset, length, source, file_offset))
            file_offset += length
        runs = _overlay(runs, upper)
    return _coalesce(runs)


def _overlay(lower: list[PlanRun], upper: list[PlanRun]) -> list[PlanRun]:
    """Sorted, disjoint ``lower`` with sorted, disjoint ``upper`` laid over it."""
    out: list[PlanRun] = []
    u = 0
    for run in lower:
        start, end = run.offset, run.offset + run.length
        while u < len(upper) and upper[u].offset + upper[u].length <= start:
            out.append(upper[u])
            u += 1
        k = u
        while start < end:
            if k >= len(upper) or upper[k].offset >= end:
                out.append(_piece(run, start, end))
                break
            if upper[k].offset > start:
                out.append(_piece(run, start, upper[k].offset))
            start = max(start, upper[k].offset + upper[k].length)
            k += 1
    out.extend(upper[u:])
    out.sort(key=lambda r: r.offset)
    return out


def _piece(run: PlanRun, start: int, end: int) -> PlanRun:
    return PlanRun(start, end - start, run.source, run.source_offset + start - run.offset)


def _coalesce(runs: list[PlanRun]) -> list[PlanRun]:
    out: list[PlanRun] = []
    for run in runs:
        last = out[-1] if out else None
        if (last is not None and last.source == run.source
                and last.offset + last.length == run.offset
                and last.source_offset + last.length == run.source_offset):
            out[-1] = PlanRun(last.offset, last.length + run.length, last.source,
                              last.source_offset)
        else:
            out.append(run)
    return out


# -- the file ---------------------------------------------------------------------------

def encode_plan(plan: MemoryPlan) -> bytes:
    _check(plan, PlanError)
    if len(plan.runs) > MAX_RUNS:
        raise PlanTooLarge(f"a plan of {len(plan.runs)} runs exceeds the budget of {MAX_RUNS}",
                           op="memory_plan")
    sources = json.dumps([{"path": s.path, "size": s.size,
                           "owner_content_hash": s.owner_content_hash,
                           "file_hash": s.file_hash} for s in plan.sources],
                         separators=(",", ":")).encode()
    padded = sources.ljust(_align8(len(sources)), b"\0")
    body = padded + b"".join(_RUN.pack(r.offset, r.length, r.source, r.source_offset)
                             for r in plan.runs)
    fields = (MAGIC, FORMAT_VERSION, PAGE_SIZE, plan.mem_size, len(plan.sources),
              len(plan.runs), len(sources), zlib.crc32(body))
    header = _HEADER.pack(*fields, 0)
    header = _HEADER.pack(*fields, zlib.crc32(header[:_HEADER.size - 4]))
    return header.ljust(HEADER_SIZE, b"\0") + body


def decode_plan(data: bytes, directory: str | None = None) -> MemoryPlan:
    """Parse and validate a plan file's bytes (see the module notes for what is refused)."""
    if len(data) < HEADER_SIZE:
        raise PlanError(f"memory plan is {len(data)} bytes, shorter than its header",
                        op="memory_plan")
    if len(data) > MAX_PLAN_BYTES:
        raise PlanError(f"memory plan is {len(data)} bytes (limit {MAX_PLAN_BYTES})",
                        op="memory_plan")
    (magic, version, page_size, mem_size, source_count, run_count, sources_len, body_crc,
     header_crc) = _HEADER.unpack(data[:_HEADER.size])
    check_header(PlanError, "memory plan", "memory plan", "memory_plan",
                 magic_ok=magic == MAGIC,
                 crc_ok=zlib.crc32(data[:_HEADER.size - 4]) == header_crc,
                 version=version, expected_version=FORMAT_VERSION, page_size=page_size)
    body = data[HEADER_SIZE:]
    runs_at = _align8(sources_len)
    if (not 1 <= source_count <= MAX_SOURCES or run_count > MAX_RUNS
            or sources_len > _MAX_SOURCES_BYTES
            or len(body) != runs_at + run_count * _RUN.size):
        raise PlanError(f"memory plan sizes do not add up ({source_count} sources, "
                        f"{run_count} runs, {len(data)} bytes)", op="memory_plan")
    if zlib.crc32(body) != body_crc:
        raise PlanError("memory plan body checksum mismatch (torn or damaged file)",
                        op="memory_plan")
    sources = _decode_sources(body[:sources_len], source_count)
    runs = tuple(PlanRun(*fields) for fields in _RUN.iter_unpack(body[runs_at:]))
    plan = MemoryPlan(mem_size, sources, runs, directory)
    _check(plan, PlanError)
    return plan


def read_plan(path: str) -> MemoryPlan:
    """Read and validate the plan file at ``path`` (bounded: it is never large)."""
    try:
        fd = open_ro(path)
    except OSError as err:
        raise PlanError(f"cannot open memory plan {path}: {err.strerror}", op="memory_plan",
                        errno=err.errno) from err
    try:
        size = os.fstat(fd).st_size
        if size > MAX_PLAN_BYTES:
            raise PlanError(f"memory plan {path} is {size} bytes (limit {MAX_PLAN_BYTES})",
                            op="memory_plan")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    try:
        return decode_plan(data, os.path.dirname(os.path.abspath(path)))
    except PlanError as err:
        raise PlanError(f"{path}: {err}", op="memory_plan") from None


def _decode_sources(raw: bytes, count: int) -> tuple[PlanSource, ...]:
    try:
        items = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise PlanError("memory plan sources are not valid JSON", op="memory_plan") from None
    if not isinstance(items, list) or len(items) != count:
        raise PlanError("memory plan sources do not match the header's count",
                        op="memory_plan")
    sources = []
    for item in items:
        if not isinstance(item, dict):
            raise PlanError("memory plan source is not an object", op="memory_plan")
        path, size = item.get("path"), item.get("size")
        owner, digest = item.get("owner_content_hash"), item.get("file_hash")
        if (not isinstance(path, str) or not isinstance(size, int) or isinstance(size, bool)
                or not all(h is None or isinstance(h, str) for h in (owner, digest))):
            raise PlanError("memory plan source has malformed fields", op="memory_plan")
        sources.append(PlanSource(path, size, owner, digest))
    return tuple(sources)


def _check(plan: MemoryPlan, error: type[OnDiskError]) -> None:
    if plan.mem_size <= 0 or plan.mem_size % PAGE_SIZE:
        raise error(f"memory plan RAM size {plan.mem_size:#x} is not page-aligned",
                    op="memory_plan")
    if not plan.sources or len(plan.sources) > MAX_SOURCES:
        raise error(f"memory plan has {len(plan.sources)} sources (1 to {MAX_SOURCES})",
                    op="memory_plan")
    for i, source in enumerate(plan.sources):
        if _SOURCE_PATH.fullmatch(source.path) is None:
            raise error(f"memory plan source path {source.path!r} is not <tag>/memory.bin "
                        "or <tag>/layer.bin", op="memory_plan")
        if (i == 0) != source.path.endswith("/memory.bin"):
            raise error("a memory plan maps exactly one memory.bin, as its first source",
                        op="memory_plan")
        if source.size < 0:
            raise error("memory plan source has a negative size", op="memory_plan")
    if plan.sources[0].size != plan.mem_size:
        raise error(f"memory plan base {plan.sources[0].path} is {plan.sources[0].size} bytes,"
                    f" the RAM is {plan.mem_size}", op="memory_plan")
    previous_end = 0
    for run in plan.runs:
        if run.offset % PAGE_SIZE or run.length % PAGE_SIZE or run.length <= 0 \
                or run.source_offset % PAGE_SIZE:
            raise error(f"memory plan run {run.offset:#x}+{run.length:#x} is not page-aligned",
                        op="memory_plan")
        if run.offset < previous_end:
            raise error(f"memory plan run {run.offset:#x} overlaps or is out of order",
                        op="memory_plan")
        if run.offset + run.length > plan.mem_size:
            raise error(f"memory plan run {run.offset:#x}+{run.length:#x} is beyond guest RAM",
                        op="memory_plan")
        if not 1 <= run.source < len(plan.sources):
            raise error(f"memory plan run names source {run.source}, not a layer",
                        op="memory_plan")
        if run.source_offset + run.length > plan.sources[run.source].size:
            raise error(f"memory plan run {run.offset:#x} reads beyond its source "
                        f"{plan.sources[run.source].path}", op="memory_plan")
        previous_end = run.offset + run.length


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


# -- mapping ----------------------------------------------------------------------------

def snapshot_memory(snapshot_dir: str) -> tuple[str, MemoryPlan | None]:
    """What a restore of the snapshot in ``snapshot_dir`` maps: its own ``memory.bin``
    and None (a flat snapshot, or a link materialised because its plan was over the
    VMA budget), else its plan's base and the plan (a diff snapshot).

    ``memory.bin`` wins when both exist: the store writes a link's ``memory.bin`` only
    when it replaces the link's plan (``rmi --force`` of an ancestor), complete and
    renamed into place before the plan is removed, so after a crash between the two
    the image is the file that stays valid."""
    memory_file = os.path.join(snapshot_dir, "memory.bin")
    if os.path.exists(memory_file):
        return memory_file, None
    plan = read_plan(os.path.join(snapshot_dir, PLAN_FILE))
    return plan.source_path(0), plan


def open_sources(plan: MemoryPlan) -> list[int]:
    """Open every source of ``plan`` read-only and check it is the regular file of
    the size the plan recorded. Returns the fds (source order); the caller closes
    them. ``PlanError`` naming the file otherwise: a plan never maps a file that
    was replaced, truncated or deleted."""
    fds: list[int] = []
    try:
        for i, source in enumerate(plan.sources):
            path = plan.source_path(i)
            try:
                fd = open_ro(path)
            except OSError as err:
                raise PlanError(
                    f"the memory plan maps {source.path}, which cannot be opened "
                    f"({err.strerror}); the snapshot {source.owner_tag!r} holding it was "
                    "deleted or changed outside vmfork: compact or delete this snapshot",
                    op="memory_plan", errno=err.errno) from err
            fds.append(fd)
            st = os.fstat(fd)
            if not (st.st_mode & 0o170000 == 0o100000) or st.st_size != source.size:
                raise PlanError(
                    f"the memory plan maps {source.path} of {source.size} bytes, which is now "
                    f"{st.st_size} bytes (or not a regular file); the snapshot "
                    f"{source.owner_tag!r} was replaced outside vmfork: compact or delete "
                    "this snapshot", op="memory_plan")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds
