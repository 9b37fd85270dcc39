"""Layer files and diff heads: round trip, hostile files refused, pagemap classification."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest

from vmfork.ondisk import layerfile
from vmfork.ondisk.layerfile import LayerError
from vmfork.store.layers import (
    PlanInput,
    build_plan,
    hash_file,
    materialise,
    snapshot_content_hash,
)
from vmfork.vmm import dirty
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory

MEM = 4 << 20
HEADER = "<8sIIQQQQII"   # ondisk.layerfile's header fields


def _memory_with(pages: dict[int, bytes]) -> GuestMemory:
    memory = GuestMemory.anonymous(MEM)
    for page, data in pages.items():
        memory.write(page * PAGE_SIZE, data)
    return memory


def materialise_head(base: Path, layer: Path, out: Path) -> None:
    """The head image of one layer over ``base``, through a memory plan."""
    plan = build_plan(PlanInput("b/memory.bin", base, None, None),
                      [PlanInput("l/layer.bin", layer, None, None)])
    materialise(plan, [base, layer], out)


def _write(path: Path, memory: GuestMemory, extents: list[tuple[int, int]]) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        return layerfile.write_layer(fd, memory, extents)
    finally:
        os.close(fd)


def test_a_layer_over_a_sparse_base_gives_the_head(tmp_path: Path) -> None:
    base = tmp_path / "base.bin"
    with open(base, "wb") as f:
        f.truncate(MEM)
        f.seek(10 * PAGE_SIZE)
        f.write(b"B" * PAGE_SIZE * 2)
    memory = _memory_with({3: b"x" * PAGE_SIZE, 4: b"y" * 100, 11: b"z" * PAGE_SIZE})
    layer = tmp_path / "layer.bin"
    assert _write(layer, memory, [(3 * PAGE_SIZE, 2 * PAGE_SIZE), (11 * PAGE_SIZE, PAGE_SIZE)]) \
        == 3 * PAGE_SIZE
    head = tmp_path / "head.bin"
    materialise_head(base, layer, head)
    data = head.read_bytes()
    assert len(data) == MEM
    assert data[3 * PAGE_SIZE:4 * PAGE_SIZE] == b"x" * PAGE_SIZE
    assert data[4 * PAGE_SIZE:4 * PAGE_SIZE + 101] == b"y" * 100 + b"\0"
    assert data[10 * PAGE_SIZE:11 * PAGE_SIZE] == b"B" * PAGE_SIZE      # from the base
    assert data[11 * PAGE_SIZE:12 * PAGE_SIZE] == b"z" * PAGE_SIZE      # layer over base
    assert os.stat(head).st_blocks * 512 < MEM // 2                     # still sparse
    h = hash_file(layer)
    assert h.startswith("blake2b-256:") and h == hash_file(layer)
    assert snapshot_content_hash("s", h, None) != snapshot_content_hash("s", h, "p")


@pytest.mark.parametrize("damage", ["magic", "header", "index", "truncated", "overlap",
                                    "beyond", "version"])
def test_damaged_or_hostile_layers_are_refused(damage: str, tmp_path: Path) -> None:
    memory = _memory_with({1: b"a" * PAGE_SIZE, 5: b"b" * PAGE_SIZE})
    layer = tmp_path / "layer.bin"
    extents = [(PAGE_SIZE, PAGE_SIZE), (5 * PAGE_SIZE, PAGE_SIZE)]
    _write(layer, memory, extents)
    raw = bytearray(layer.read_bytes())
    if damage == "magic":
        raw[0:8] = b"NOTALAYR"
    elif damage == "header":
        raw[24] ^= 1                       # mem_size, under the header CRC
    elif damage == "index":
        raw[64] ^= 0x10                    # an extent offset, under the index CRC
    elif damage == "truncated":
        del raw[-100:]
    else:
        # Rewrite a consistent header (valid CRCs) around a hostile index.
        if damage == "overlap":
            bad = [(PAGE_SIZE, 2 * PAGE_SIZE), (2 * PAGE_SIZE, PAGE_SIZE)]
        elif damage == "beyond":
            bad = [(MEM, PAGE_SIZE)]
        else:
            bad = extents
        head, data_offset, data_bytes = layerfile._encode_head(MEM, bad)
        if damage == "version":
            fields = list(struct.unpack(HEADER, head[:56]))
            fields[1] = 99
            fields[-1] = zlib.crc32(struct.pack(HEADER, *fields)[:52])
            head = struct.pack(HEADER, *fields) + head[56:]
        raw = bytearray(head.ljust(data_offset, b"\0") + b"d" * data_bytes)
    layer.write_bytes(bytes(raw))
    with open(layer, "rb") as f, pytest.raises(LayerError):
        layerfile.read_layer_index(f.fileno())


def test_materialise_refuses_a_layer_for_another_size(tmp_path: Path) -> None:
    memory = _memory_with({0: b"a"})
    layer = tmp_path / "layer.bin"
    _write(layer, memory, [(0, PAGE_SIZE)])
    base = tmp_path / "base.bin"
    base.write_bytes(bytes(2 * MEM))
    with pytest.raises(LayerError, match="for 4194304 bytes"):
        materialise_head(base, layer, tmp_path / "head.bin")
    assert not (tmp_path / "head.bin").exists()


def test_private_pages_of_a_file_mapping_are_the_changed_ones(tmp_path: Path) -> None:
    backing = tmp_path / "memory.bin"
    backing.write_bytes(b"\1" * MEM)
    memory = GuestMemory.from_file_private(str(backing), MEM)
    try:
        assert dirty.changed_private_pages(memory) == []
        _ = memory.read(7 * PAGE_SIZE, 10)                 # a read shares the file page
        memory.write(2 * PAGE_SIZE, b"w")                  # writes break copy-on-write
        memory.write(3 * PAGE_SIZE + 100, b"w")
        memory.write(9 * PAGE_SIZE, b"w")
        assert dirty.changed_private_pages(memory) == [(2 * PAGE_SIZE, 2 * PAGE_SIZE),
                                                       (9 * PAGE_SIZE, PAGE_SIZE)]
    finally:
        memory.close()


def test_base_extents_minus_the_changed_pages() -> None:
    from vmfork.vmm.memory import subtract_runs as _subtract
    assert _subtract([(0, 100), (200, 100), (400, 50)],
                     [(10, 10), (50, 200), (290, 20), (420, 100)]) == \
        [(0, 10), (20, 30), (250, 40), (400, 20)]
    assert _subtract([(0, 100)], []) == [(0, 100)]
    assert _subtract([(0, 100)], [(0, 100)]) == []
    assert _subtract([], [(0, 4)]) == []


def test_a_memfd_dump_skips_zero_pages(tmp_path: Path) -> None:
    """A booted parent's RAM (a memfd) is written without the pages that are all zero."""
    memory = GuestMemory.memfd(MEM)
    try:
        memory.write(0, b"\1" * PAGE_SIZE)
        memory.write(PAGE_SIZE, bytes(3 * PAGE_SIZE))      # touched, but zero
        memory.write(4 * PAGE_SIZE + 10, b"x")
        out = tmp_path / "memory.bin"
        assert memory.dump(str(out)) == 2 * PAGE_SIZE
        with open(out, "rb") as f:
            assert layerfile.data_extents(f.fileno(), MEM) == [
                (0, PAGE_SIZE), (4 * PAGE_SIZE, PAGE_SIZE)]
        data = out.read_bytes()
        assert data[:PAGE_SIZE] == b"\1" * PAGE_SIZE and data[4 * PAGE_SIZE + 10] == ord("x")
        assert len(data) == MEM and data.count(0) == MEM - PAGE_SIZE - 1
    finally:
        memory.close()


def test_runs_merge_across_their_smallest_gaps_within_the_share() -> None:
    from vmfork.vmm.dirty import coalesced
    p = 4096
    runs = [(0, 10 * p), (12 * p, 10 * p), (23 * p, 10 * p), (40 * p, 10 * p)]
    # 40 pages changed: a share of 1/20 allows 2 pages of gaps, so only the 1-page gap
    # and then not the 2-page one (3 in all would be over); 1/10 allows 4: both.
    assert coalesced(runs, 1 / 20) == [(0, 10 * p), (12 * p, 21 * p), (40 * p, 10 * p)]
    assert coalesced(runs, 1 / 10) == [(0, 33 * p), (40 * p, 10 * p)]
    assert coalesced(runs, 0) == runs
    assert coalesced(runs, 1) == [(0, 50 * p)]
    assert coalesced([], 1) == [] and coalesced(runs[:1], 1) == runs[:1]
    with pytest.raises(ValueError, match="overlap or are out of order"):
        coalesced([(10 * p, p), (0, p)], 1)
