"""Diff snapshots in the store: layer files, content hashes, materialised heads.

A diff snapshot directory holds, besides ``state.bin`` and ``meta.json``:

* ``layer.bin`` -- the pages it changed over its parent (``vmfork.vmm.layerfile``),
  immutable once published, named in ``meta.memory_layers`` by its content hash
  (BLAKE2b-256 from ``hashlib``, computed as the file enters the store);
* ``memory.bin`` -- its chain resolved once, at publish time: the parent's
  ``memory.bin`` (itself already resolved) with the layer's pages copied over
  it, sparse (only the parent's data extents and the layer's pages are
  copied, in the kernel with ``copy_file_range``, which shares extents on file
  systems that reflink).

So a child of a chain head maps one ``memory.bin`` ``MAP_PRIVATE``, exactly like
a child of a flat snapshot: a spawn never hashes, copies or assembles memory,
at any depth (issue 6 item 3). Resolving costs one copy of the parent's data per
link at publish time, off the source's pause. On file systems without reflink
the head image is a full copy on disk; the layer stays the unit a pack
ships and a compaction or verification works on.

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
from pathlib import Path

from vmfork.vmm import layerfile

LAYER_FILE = "layer.bin"
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


def materialise_head(parent_memory: Path, layer: Path, out: Path) -> int:
    """Write ``out`` = ``parent_memory`` with ``layer``'s pages over it (sparse,
    fsynced). Checks the layer's index and that it fits the parent's RAM size.
    Returns the data bytes copied."""
    with open(parent_memory, "rb", buffering=0) as base, \
            open(layer, "rb", buffering=0) as lay:
        size = os.fstat(base.fileno()).st_size
        index = layerfile.read_layer_index(lay.fileno())
        if index.mem_size != size:
            raise layerfile.LayerError(
                f"the layer is for {index.mem_size} bytes of RAM, its parent's memory file "
                f"{parent_memory} has {size}", op="materialise")
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, size)
            copied = layerfile.copy_sparse(base.fileno(), fd, size)
            copied += layerfile.apply_layer(lay.fileno(), fd, index)
            os.fsync(fd)
        finally:
            os.close(fd)
    return copied
