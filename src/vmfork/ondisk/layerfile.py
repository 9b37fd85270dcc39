"""Memory layer files: the pages a diff snapshot changed, plus an index.

A layer says "these byte ranges of guest RAM (in memory-file layout) now hold
these bytes" relative to a base memory image. Applying the layers of a chain
base to head over the base's ``memory.bin`` gives the head's memory image.

Layout (little-endian; every offset and length a multiple of 4096)::

    0      header   magic "VMFKLAYR", format version, page size, guest RAM size,
                    extent count, data offset, data bytes, CRC-32 of the index,
                    CRC-32 of the header fields before it
    64     index    extent_count x (offset u64, length u64), sorted, disjoint
    data_offset     the extents' bytes, in index order, page-aligned

The data starts page-aligned so that extents can be copied with
``copy_file_range`` (or one day mapped) straight from the file. The header and
index carry CRCs against torn or foreign files; the content hash that names a
layer in the store covers the whole file and is computed by the store
(``vmfork.store.layers``). Readers treat a layer as hostile input: counts are
bounded by the file's size, extents must be sorted, disjoint, aligned and
inside guest RAM, and the data must be exactly as long as the index says.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Protocol

from vmfork.ondisk.errors import OnDiskError

# The page size of every vmfork file that holds guest memory (``vmm.memory`` uses it
# for guest RAM); a file recording another is refused (``check_header``).
PAGE_SIZE = 4096
MAGIC = b"VMFKLAYR"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQQQII")
HEADER_SIZE = 64
_EXTENT = struct.Struct("<QQ")
_MAX_CHUNK = 1 << 30     # one pwrite/copy_file_range call; the kernel caps at ~2 GiB

Extent = tuple[int, int]    # (offset in memory-file layout, length)


class LayerError(OnDiskError):
    """A layer file is malformed, truncated or not a layer file."""


class PageSource(Protocol):
    """Guest RAM as ``write_layer`` reads it (``vmm.memory.GuestMemory``): its size and
    a view of its backing, in memory-file layout."""

    @property
    def size(self) -> int: ...

    def backing_view(self, offset: int, length: int) -> memoryview: ...


@dataclass(frozen=True)
class LayerIndex:
    mem_size: int
    extents: tuple[Extent, ...]
    data_offset: int
    data_bytes: int

    @property
    def pages(self) -> int:
        return self.data_bytes // PAGE_SIZE


def _align_up(value: int) -> int:
    return (value + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE


def _check_extents(extents: list[Extent] | tuple[Extent, ...], mem_size: int,
                   error: type[OnDiskError]) -> None:
    previous_end = 0
    for offset, length in extents:
        if offset % PAGE_SIZE or length % PAGE_SIZE or length <= 0:
            raise error(f"layer extent {offset:#x}+{length:#x} is not page-aligned",
                        op="layer_index")
        if offset < previous_end:
            raise error(f"layer extent {offset:#x} overlaps or is out of order",
                        op="layer_index")
        if offset + length > mem_size:
            raise error(f"layer extent {offset:#x}+{length:#x} is beyond guest RAM "
                        f"({mem_size:#x})", op="layer_index")
        previous_end = offset + length


def _encode_head(mem_size: int, extents: list[Extent]) -> tuple[bytes, int, int]:
    index = b"".join(_EXTENT.pack(o, n) for o, n in extents)
    data_offset = _align_up(HEADER_SIZE + len(index))
    data_bytes = sum(n for _, n in extents)
    fields = (MAGIC, FORMAT_VERSION, PAGE_SIZE, mem_size, len(extents), data_offset,
              data_bytes, zlib.crc32(index))
    header = _HEADER.pack(*fields, 0)
    header = _HEADER.pack(*fields, zlib.crc32(header[:_HEADER.size - 4]))
    return header.ljust(HEADER_SIZE, b"\0") + index, data_offset, data_bytes


def write_layer(fd: int, memory: PageSource, extents: list[Extent]) -> int:
    """Write a layer of ``extents`` of ``memory`` to the open file ``fd`` (from
    offset 0; the caller owns fsync and naming). Returns the data bytes written."""
    _check_extents(extents, memory.size, OnDiskError)
    head, data_offset, data_bytes = _encode_head(memory.size, extents)
    os.ftruncate(fd, data_offset + data_bytes)
    pwrite_all(fd, memoryview(head), 0)
    pos = data_offset
    for offset, length in extents:
        done = 0
        while done < length:
            n = min(length - done, _MAX_CHUNK)
            view = memory.backing_view(offset + done, n)
            try:
                pwrite_all(fd, view, pos)
            finally:
                view.release()
            pos += n
            done += n
    return data_bytes


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (``pwrite`` may write less than asked)."""
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OnDiskError(f"layer write stopped at {offset:#x}", op="write_layer")
        view = view[n:]
        offset += n


def check_header(error: type[OnDiskError], name: str, noun: str, op: str, *, magic_ok: bool,
                 crc_ok: bool, version: int, expected_version: int, page_size: int) -> None:
    """The checks a vmfork binary file's header starts with, in this order: its magic,
    its own CRC (a torn write), its format version, its page size. ``name`` is the
    format's name ("layer file"), ``noun`` how messages start ("layer")."""
    if not magic_ok:
        raise error(f"not a vmfork {name} (bad magic)", op=op)
    if not crc_ok:
        raise error(f"{noun} header checksum mismatch (torn or damaged file)", op=op)
    if version != expected_version:
        raise error(f"{noun} format version {version} is not one this vmfork reads "
                    f"({expected_version})", op=op)
    if page_size != PAGE_SIZE:
        raise error(f"{noun} page size {page_size}, expected {PAGE_SIZE}", op=op)


def read_layer_index(fd: int) -> LayerIndex:
    """Read and validate a layer's header and index from the open file ``fd``."""
    file_size = os.fstat(fd).st_size
    raw = os.pread(fd, HEADER_SIZE, 0)
    if len(raw) < HEADER_SIZE:
        raise LayerError(f"layer file is {file_size} bytes, shorter than its header",
                         op="layer_index")
    (magic, version, page_size, mem_size, count, data_offset, data_bytes, index_crc,
     header_crc) = _HEADER.unpack(raw[:_HEADER.size])
    check_header(LayerError, "layer file", "layer", "layer_index",
                 magic_ok=magic == MAGIC,
                 crc_ok=zlib.crc32(raw[:_HEADER.size - 4]) == header_crc,
                 version=version, expected_version=FORMAT_VERSION, page_size=page_size)
    index_end = HEADER_SIZE + count * _EXTENT.size
    if index_end > file_size or data_offset != _align_up(index_end) \
            or data_offset + data_bytes != file_size:
        raise LayerError(f"layer sizes do not add up (extents {count}, data at "
                         f"{data_offset:#x} + {data_bytes:#x}, file {file_size:#x})",
                         op="layer_index")
    index = os.pread(fd, count * _EXTENT.size, HEADER_SIZE)
    if len(index) != count * _EXTENT.size or zlib.crc32(index) != index_crc:
        raise LayerError("layer index checksum mismatch (torn or damaged file)",
                         op="layer_index")
    extents = tuple(_EXTENT.iter_unpack(index))
    _check_extents(extents, mem_size, LayerError)
    if sum(n for _, n in extents) != data_bytes:
        raise LayerError("layer index and data length disagree", op="layer_index")
    return LayerIndex(mem_size, extents, data_offset, data_bytes)


def apply_layer(layer_fd: int, out_fd: int, index: LayerIndex | None = None) -> int:
    """Copy a layer's extents into the memory image ``out_fd`` at their offsets
    (in the kernel, ``copy_file_range``). Returns the bytes copied."""
    if index is None:
        index = read_layer_index(layer_fd)
    src = index.data_offset
    for offset, length in index.extents:
        copy_range(layer_fd, src, out_fd, offset, length)
        src += length
    return index.data_bytes


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int,
               length: int) -> None:
    """Copy ``length`` bytes between files in the kernel: ``copy_file_range`` (which
    shares extents where the file system can reflink), or ``sendfile`` where the two
    files are on file systems that cannot copy between each other."""
    while length > 0:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(length, _MAX_CHUNK), src_offset,
                                   dst_offset)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            os.lseek(dst_fd, dst_offset, os.SEEK_SET)
            n = os.sendfile(dst_fd, src_fd, src_offset, min(length, _MAX_CHUNK))
        if n <= 0:
            raise OnDiskError(f"copy stopped at {src_offset:#x} (source shorter than expected)",
                            op="copy_range")
        src_offset += n
        dst_offset += n
        length -= n


def data_extents(fd: int, size: int) -> list[Extent]:
    """The data (non-hole) extents of a sparse file, found with ``SEEK_DATA``/``SEEK_HOLE``."""
    extents = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:   # ENXIO: no data after offset
            break
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        extents.append((start, end - start))
        offset = end
    return extents


def copy_sparse(src_fd: int, dst_fd: int, size: int) -> int:
    """Copy the data extents of ``src_fd`` into ``dst_fd`` at the same offsets (the
    destination must already be ``size`` bytes long, all hole). Returns bytes copied."""
    copied = 0
    for offset, length in data_extents(src_fd, size):
        copy_range(src_fd, offset, dst_fd, offset, length)
        copied += length
    return copied
