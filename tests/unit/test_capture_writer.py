"""The forked snapshot writer (``vmm.capture._Writer``) without a guest: what a diff's
layer holds when the source writes its memory after the fork, and what a failing writer
leaves behind. The memory is mapped like a sandbox's (a file, ``MAP_PRIVATE``), so the
fork's copy-on-write is the kernel's, as it is under a running guest; the KVM tier
(tests/kvm/test_branch_tiny.py) checks the same with vCPUs writing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.ondisk import layerfile
from vmfork.vmm.capture import CaptureError, _write_layer_file, _Writer
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory

MEM = 4 << 20


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[GuestMemory]:
    backing = tmp_path / "base.bin"
    backing.write_bytes(b"\xbb" * MEM)
    memory = GuestMemory.from_file_private(str(backing), MEM)
    try:
        yield memory
    finally:
        memory.close()


def _children() -> list[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return [int(pid) for pid in f.read().split()]


def _layer_pages(path: Path) -> dict[int, bytes]:
    """The layer's pages as {page number: bytes}."""
    base = bytes(MEM)
    out = path.with_suffix(".head")
    with open(path, "rb") as layer, open(out, "wb") as head:
        head.write(base)
        head.flush()
        layerfile.apply_layer(layer.fileno(), head.fileno())
        index = layerfile.read_layer_index(layer.fileno())
    data = out.read_bytes()
    pages = {}
    for offset, length in index.extents:
        for at in range(offset, offset + length, PAGE_SIZE):
            pages[at // PAGE_SIZE] = data[at:at + PAGE_SIZE]
    return pages


def _write_layer_gated(memory: GuestMemory, path: Path, runs: list[tuple[int, int]],
                       overwritten: tuple[int, ...]) -> tuple[_Writer, int]:
    """A forked writer writes the layer of ``runs``, held by a gate until the source has
    overwritten the pages ``overwritten`` with 0xaa ("after the resume"): the writer
    and the data bytes it wrote."""
    gate_r, gate_w = os.pipe2(os.O_CLOEXEC)

    def write() -> tuple[int, int | None]:
        os.read(gate_r, 1)
        return _write_layer_file(str(path), memory, runs), None

    try:
        writer = _Writer.fork(str(path), write)
        for page in overwritten:
            memory.write(page * PAGE_SIZE, b"\xaa" * PAGE_SIZE)
        os.write(gate_w, b"x")
        written, _ = writer.wait()
    finally:
        os.close(gate_r)
        os.close(gate_w)
    return writer, written


def test_the_layer_holds_memory_as_of_the_fork(memory: GuestMemory, tmp_path: Path) -> None:
    """The source overwrites every page of the diff after the fork, before the writer
    reads any of them (a gate holds it): the layer still has the old bytes."""
    for page in (3, 4, 9):
        memory.write(page * PAGE_SIZE, bytes([page]) * PAGE_SIZE)
    runs = [(3 * PAGE_SIZE, 2 * PAGE_SIZE), (9 * PAGE_SIZE, PAGE_SIZE)]
    path = tmp_path / "layer.bin"
    writer, written = _write_layer_gated(memory, path, runs, overwritten=(3, 4, 9, 10))
    assert written == 3 * PAGE_SIZE
    assert _layer_pages(path) == {p: bytes([p]) * PAGE_SIZE for p in (3, 4, 9)}
    assert memory.read(3 * PAGE_SIZE, 1) == b"\xaa"      # the source kept its new bytes
    assert writer.pid not in _children()


def test_a_failing_writer_is_reaped_and_reported(memory: GuestMemory, tmp_path: Path) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    path = tmp_path / "missing-dir" / "layer.bin"       # the writer cannot create it
    writer = _Writer.fork(str(path),
                          lambda: (_write_layer_file(str(path), memory, [(0, PAGE_SIZE)]), 1))
    with pytest.raises(CaptureError, match="snapshot writer failed: FileNotFoundError"):
        writer.wait()
    assert writer.pid not in _children()
    assert len(os.listdir("/proc/self/fd")) == fds
    writer.kill()                                        # after a wait: nothing to do


def test_a_killed_writer_leaves_no_process_or_descriptor(memory: GuestMemory,
                                                         tmp_path: Path) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
    try:
        writer = _Writer.fork(str(tmp_path / "layer.bin"),
                              lambda: (len(os.read(gate_r, 1)), None))   # blocks
        assert writer.pid in _children()
        writer.kill()
    finally:
        os.close(gate_r)
        os.close(gate_w)
    assert writer.pid not in _children()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_layer_spans_its_smallest_gaps_with_their_pages_as_of_the_fork(
        memory: GuestMemory, tmp_path: Path) -> None:
    """Runs of 40, 39 and 1 pages with gaps of 1 and 3 pages between them, and a last
    run 116 pages further: the two small gaps (4 pages, 5% of the 81 changed) are
    written as of the fork, the large one is not."""
    changed = [*range(0, 40), *range(41, 80), 83, 200]
    for page in changed:
        memory.write(page * PAGE_SIZE, bytes([page % 251 + 1]) * PAGE_SIZE)
    runs = [(0, 40 * PAGE_SIZE), (41 * PAGE_SIZE, 39 * PAGE_SIZE), (83 * PAGE_SIZE, PAGE_SIZE),
            (200 * PAGE_SIZE, PAGE_SIZE)]
    path = tmp_path / "layer.bin"
    _, written = _write_layer_gated(memory, path, runs, overwritten=(40, 81, 120))
    with open(path, "rb") as layer:
        assert layerfile.read_layer_index(layer.fileno()).extents == (
            (0, 84 * PAGE_SIZE), (200 * PAGE_SIZE, PAGE_SIZE))
    assert written == 85 * PAGE_SIZE
    pages = _layer_pages(path)
    assert pages == {**{p: bytes([p % 251 + 1]) * PAGE_SIZE for p in changed},
                     **{p: b"\xbb" * PAGE_SIZE for p in (40, 80, 81, 82)}}
