"""Diff snapshots in the store: layer files, memory plans, content hashes.

A diff snapshot directory holds, besides ``state.bin`` and ``meta.json``:

* ``layer.bin`` -- the pages it changed over its parent (``vmfork.ondisk.layerfile``),
  immutable once published, named in ``meta.memory_layers`` by its content hash
  (BLAKE2b-256 from ``hashlib``, computed as the file enters the store);
* ``memory.plan`` -- its chain resolved once, at publish time, into a map
  (``vmfork.ondisk.memplan``): for every range of guest RAM, which file of the chain
  (the base's ``memory.bin`` or one link's ``layer.bin``) holds it, topmost link
  winning. A child maps the base ``MAP_PRIVATE`` and each run of the plan from its
  layer over it: a spawn never hashes, copies or assembles memory, at any depth
  (issue 6 item 3), and a link costs on disk only the pages it changed (item 1),
  on any file system -- the alternative, a resolved ``memory.bin`` per link, is a
  full copy of the image per link wherever the file system cannot reflink.

A plan whose runs would exceed the VMA budget (``memplan.MAX_RUNS``) is not used:
that head is materialised once, at publish time, into its own ``memory.bin``
(``materialise``), which its own dependents' plans then use as their base.

A memory image is hashed with ``hash_memory``: per-MiB block hashes under one
outer hash, with all-zero blocks (holes included) marked rather than hashed, so
that hashing a sparse 512 MiB image reads only its data and two copies of one
image hash alike whatever their hole layout (a pack's memory.bin is written back
sparse by ``unpack``).

A snapshot's content hash covers its state file, its own layer and its parent's
content hash, so it names the whole chain below it (like a commit hash).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from vmfork.ondisk import layerfile, memplan
from vmfork.ondisk.durable import write_new_file

LAYER_FILE = "layer.bin"
PLAN_FILE = memplan.PLAN_FILE
HASH_NAME = "blake2b-256"
_BLOCK = 1 << 20


def hash_file(path: str | os.PathLike[str]) -> str:
    """``blake2b-256:<hex>`` of a file's bytes (holes read as zeros)."""
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return f"{HASH_NAME}:{digest.hexdigest()}"


MEMORY_HASH_NAME = "blake2b-256-mib"
_ZERO_BLOCK = bytes(_BLOCK)


def hash_memory(path: str | os.PathLike[str]) -> str:
    """``blake2b-256-mib:<hex>`` of a (sparse) memory image: its length, then per 1 MiB
    block either a zero marker or the block's own BLAKE2b-256. Reads data extents only."""
    outer = hashlib.blake2b(digest_size=32)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        outer.update(size.to_bytes(8, "little"))
        data_blocks: set[int] = set()
        for offset, length in layerfile.data_extents(f.fileno(), size):
            data_blocks.update(range(offset // _BLOCK, (offset + length - 1) // _BLOCK + 1))
        buf = bytearray(_BLOCK)
        for block in range((size + _BLOCK - 1) // _BLOCK):
            if block not in data_blocks:
                outer.update(b"Z")
                continue
            want = min(_BLOCK, size - block * _BLOCK)
            n = os.preadv(f.fileno(), [memoryview(buf)[:want]], block * _BLOCK)
            if n != want:
                raise OSError(f"{path}: short read at block {block} (file changed?)")
            chunk = memoryview(buf)[:want]
            if chunk == _ZERO_BLOCK[:want]:
                outer.update(b"Z")
            else:
                outer.update(b"D" + hashlib.blake2b(chunk, digest_size=32).digest())
    return f"{MEMORY_HASH_NAME}:{outer.hexdigest()}"


def snapshot_content_hash(state_hash: str, layer_hash: str | None,
                          parent_content_hash: str | None) -> str:
    """The content hash of a snapshot: its state, its own layer, and its parent's hash."""
    digest = hashlib.blake2b(digest_size=32)
    for part in (state_hash, layer_hash or "-", parent_content_hash or "-"):
        digest.update(part.encode() + b"\n")
    return f"{HASH_NAME}:{digest.hexdigest()}"


@dataclass(frozen=True)
class PlanInput:
    """One file of a chain for ``build_plan``: ``store_path`` is where the plan will
    find it (``<tag>/<file>`` under the snapshots directory), ``path`` where it is
    now (a pending snapshot's own layer is not at its final path yet)."""

    store_path: str
    path: Path
    owner_content_hash: str | None
    file_hash: str | None


def build_plan(base: PlanInput, layers: list[PlanInput]) -> memplan.MemoryPlan:
    """The memory plan of ``base`` (a memory.bin) with ``layers`` (base to head) over
    it. Reads the layers' indexes only, checking each against the base's RAM size (a
    hostile layer cannot map outside guest RAM). ``PlanTooLarge`` is not raised here:
    the caller compares ``len(plan.runs)`` with ``memplan.MAX_RUNS``."""
    mem_size = os.stat(base.path).st_size
    sources = [memplan.PlanSource(base.store_path, mem_size, base.owner_content_hash,
                                  base.file_hash)]
    indexes = []
    for number, layer in enumerate(layers, start=1):
        with open(layer.path, "rb", buffering=0) as f:
            index = layerfile.read_layer_index(f.fileno())
            size = os.fstat(f.fileno()).st_size
        if index.mem_size != mem_size:
            raise layerfile.LayerError(
                f"the layer {layer.store_path} is for {index.mem_size} bytes of RAM, the "
                f"chain's base {base.store_path} has {mem_size}", op="build_plan")
        sources.append(memplan.PlanSource(layer.store_path, size, layer.owner_content_hash,
                                          layer.file_hash))
        indexes.append((number, index))
    return memplan.MemoryPlan(mem_size, tuple(sources), tuple(memplan.resolve_runs(indexes)))


def materialise(plan: memplan.MemoryPlan, paths: list[Path], out: Path) -> int:
    """Write ``out``: the memory image ``plan`` maps, from its sources at ``paths``
    (source order), sparse and fsynced. Returns the data bytes copied."""
    fds = []
    try:
        for path in paths:
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, plan.mem_size)
            copied = layerfile.copy_sparse(fds[0], fd, plan.mem_size)
            for run in plan.runs:
                layerfile.copy_range(fds[run.source], run.source_offset, fd, run.offset,
                                     run.length)
                copied += run.length
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        for source_fd in fds:
            os.close(source_fd)
    return copied


def write_plan(plan: memplan.MemoryPlan, path: Path) -> None:
    """Write a plan file (new, fsynced; the store renames or publishes it)."""
    write_new_file(path, memplan.encode_plan(plan))
