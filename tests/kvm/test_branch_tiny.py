"""BRANCH on tiny guests: full, diff and live captures of a running, restored machine.

The guest (``Script.fill_pages_forever``) keeps bumping a counter and writing it
at the start of each of ``PAGES`` pages in order, so any instant's memory holds
``c, ..., c, c-1, ..., c-1``: a capture whose pages come from different instants
breaks that shape. Between captures the host (the VMM) also writes a pattern into
guest RAM, which checks that VMM-side writes reach the snapshots too.
"""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kvm.tinyguest import Script, script_machine, wait_until
from vmfork.ondisk import layerfile
from vmfork.ondisk.stateformat import read_state_file
from vmfork.vmm import dirty
from vmfork.vmm.capture import CaptureError, SnapshotTaker
from vmfork.vmm.machine import Machine, MachineConfig
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.vmstate import MachineState

MEM_MIB = 64
FILL_AT = 0x400000
PAGES = 48
PATTERN_AT = 0x800000


def _page_values(read_u64: object, base: int = FILL_AT) -> list[int]:
    return [read_u64(base + i * 4096) for i in range(PAGES)]  # type: ignore[operator]


def _check_consistent(values: list[int]) -> int:
    """The pages of one instant: a prefix holds c, the rest c-1. Returns c."""
    top = values[0]
    assert top > 0
    split = next((i for i, v in enumerate(values) if v != top), PAGES)
    assert all(v == top - 1 for v in values[split:]), values
    return top


def _file_u64(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        return int.from_bytes(f.read(8), "little")


def _materialise(base_image: Path, layer: Path, out: Path) -> None:
    size = os.stat(base_image).st_size
    with open(base_image, "rb") as base, open(layer, "rb") as lay, open(out, "wb") as dst:
        os.ftruncate(dst.fileno(), size)
        layerfile.copy_sparse(base.fileno(), dst.fileno(), size)
        layerfile.apply_layer(lay.fileno(), dst.fileno())


@pytest.fixture
def base(tmp_path: Path) -> tuple[MachineState, Path]:
    """A full snapshot of a running filler guest (a booted, memfd-backed machine)."""
    parent, _ = script_machine(Script().fill_pages_forever(FILL_AT, PAGES), memfd=True,
                               mem_mib=MEM_MIB)
    mem = tmp_path / "base-memory.bin"
    with parent:
        parent.start()
        assert wait_until(lambda: parent.memory.read_u64(FILL_AT) > 50)
        state, _ = parent.snapshot(str(mem), resume=False)
    return state, mem


def _restore(state: MachineState, mem: Path) -> Machine:
    return Machine(MachineConfig(restore_state=state, memory_file=str(mem), mem_mib=MEM_MIB,
                                 rng=False, memfd=False))


@pytest.fixture
def source(base: tuple[MachineState, Path]) -> Iterator[Machine]:
    machine = _restore(*base)
    with machine:
        machine.start()
        yield machine


def _child_runs_on(state_path: Path, image: Path) -> int:
    """Restore a child from a capture, check it is consistent and runs on; return c."""
    state = read_state_file(str(state_path), MachineState)
    child = _restore(state, image)
    with child:
        captured = _check_consistent(_page_values(child.memory.read_u64))
        child.start()
        # Generous: a loaded emulated test host can starve a vCPU for seconds; a
        # child that does not run at all stays stuck however long we wait.
        assert wait_until(lambda: child.memory.read_u64(FILL_AT) > captured + 20, 60.0), \
            (f"restored child stuck at {child.memory.read_u64(FILL_AT)} (captured {captured}); "
             f"exit: {child.exit}")
    return captured


@pytest.mark.parametrize("mode", ["full", "diff", "live"])
def test_repeated_branches_are_consistent_and_the_source_runs_on(
        mode: str, source: Machine, base: tuple[MachineState, Path], tmp_path: Path) -> None:
    taker = SnapshotTaker(source, origin_tag="base")
    previous_image, previous_tag, previous_c = base[1], "base", 0
    for n in range(4):
        marker = os.urandom(4096)
        source.memory.write(PATTERN_AT + n * 4096, marker)     # a VMM-side write
        before = source.memory.read_u64(FILL_AT)
        out = tmp_path / f"b{n}"
        out.mkdir()
        result = taker.take(mode, str(out / "memory.part"), str(out / "state.bin"),
                            tag=f"b{n}",
                            base_tag=taker.bases()[0]["tag"] if mode == "diff" else None)
        assert result.timings["pause_s"] <= result.timings["total_s"]
        if mode == "diff":
            # The layer applies to the base it names; with soft-dirty tracking that is
            # the previous capture, else always the restore base.
            expected_base = previous_tag if dirty.soft_dirty_supported() else "base"
            assert result.base_tag == expected_base
            base_image = previous_image if result.base_kind == "previous" else base[1]
            image = out / "memory.bin"
            _materialise(base_image, out / "memory.part", image)
            assert result.dirty_pages is not None and 0 < result.dirty_pages < 2048
        else:
            image = out / "memory.part"
            assert os.stat(image).st_size == MEM_MIB << 20
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
        captured = _child_runs_on(out / "state.bin", image)
        assert before <= captured and captured > previous_c
        with open(image, "rb") as f:
            f.seek(PATTERN_AT + n * 4096)
            assert f.read(4096) == marker
        # The source was not disturbed: it keeps counting.
        assert wait_until(lambda c=captured: source.memory.read_u64(FILL_AT) > c + 20)
        previous_image, previous_tag, previous_c = image, f"b{n}", captured


def test_a_branch_of_a_branch(source: Machine, tmp_path: Path) -> None:
    first = tmp_path / "first"
    first.mkdir()
    SnapshotTaker(source, origin_tag="base").take(
        "live", str(first / "memory.bin"), str(first / "state.bin"), tag="first")
    child = _restore(read_state_file(str(first / "state.bin"), MachineState),
                     first / "memory.bin")
    with child:
        child.start()
        at_first = child.memory.read_u64(FILL_AT)
        assert wait_until(lambda: child.memory.read_u64(FILL_AT) > at_first + 20)
        second = tmp_path / "second"
        second.mkdir()
        result = SnapshotTaker(child, origin_tag="first").take(
            "diff", str(second / "layer.bin"), str(second / "state.bin"), base_tag="first")
        assert result.base_tag == "first" and result.base_kind == "restore"
    _materialise(first / "memory.bin", second / "layer.bin", second / "memory.bin")
    assert _child_runs_on(second / "state.bin", second / "memory.bin") > at_first


def test_failure_leaves_nothing_and_the_source_runs_on(source: Machine,
                                                       tmp_path: Path) -> None:
    taker = SnapshotTaker(source, origin_tag="base")
    out = tmp_path / "out"
    out.mkdir()
    (out / "state.bin").mkdir()      # the state file cannot be written over a directory
    for mode in ("full", "diff", "live"):
        with pytest.raises(CaptureError):
            taker.take(mode, str(out / "memory.bin"), str(out / "state.bin"))
        assert sorted(p.name for p in out.iterdir()) == ["state.bin"]
        at = source.memory.read_u64(FILL_AT)
        assert wait_until(lambda at=at: source.memory.read_u64(FILL_AT) > at + 20)
    with pytest.raises(CaptureError, match="cannot diff against 'elsewhere'"):
        taker.take("diff", str(out / "memory.bin"), str(tmp_path / "s.bin"),
                   base_tag="elsewhere")
    with pytest.raises(CaptureError, match="mode must be one of"):
        taker.take("partial", str(out / "memory.bin"), str(tmp_path / "s.bin"))


def test_live_needs_copy_on_write_memory(tmp_path: Path) -> None:
    parent, _ = script_machine(Script().count_forever(FILL_AT), memfd=True, mem_mib=MEM_MIB)
    with parent:
        parent.start()
        with pytest.raises(CaptureError, match="shared memfd"):
            SnapshotTaker(parent).take("live", str(tmp_path / "m"), str(tmp_path / "s"))
        with pytest.raises(CaptureError, match="no base to diff against"):
            SnapshotTaker(parent).take("diff", str(tmp_path / "m"), str(tmp_path / "s"))
    assert list(tmp_path.iterdir()) == []


def test_soft_dirty_sees_vmm_writes_since_the_clear(tmp_path: Path) -> None:
    """The tracker behind diffs against a previous branch (vmm.dirty), on memory mapped
    like a sandbox's (a file, MAP_PRIVATE: copy-on-write breaks 4 KiB pages, where
    anonymous memory may get transparent huge pages, dirty 2 MiB at a time). This tier
    runs on hosts with a usable KVM, whose kernels (Debian's, the test host's) have it."""
    if not dirty.soft_dirty_supported():
        pytest.skip("this kernel has no CONFIG_MEM_SOFT_DIRTY: diffs are taken against the "
                    "restore base only (test_repeated_branches_... covers that)")
    backing = tmp_path / "memory.bin"
    backing.write_bytes(bytes(4 << 20))
    memory = GuestMemory.from_file_private(str(backing), 4 << 20)
    try:
        memory.write(4096, b"a")
        dirty.clear_soft_dirty()
        assert dirty.soft_dirty_pages(memory) == []
        memory.write(2 * 4096, b"c")
        memory.write(6 * 4096 + 5, b"d")
        assert dirty.soft_dirty_pages(memory) == [(2 * 4096, 4096), (6 * 4096, 4096)]
    finally:
        memory.close()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: too small for any memory image of the test guests."""
    mount_point = tmp_path / "tiny-disk"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                   check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.parametrize("mode", ["full", "diff", "live"])
def test_a_full_disk_fails_the_capture_cleanly(mode: str, source: Machine,
                                               tiny_disk: Path) -> None:
    taker = SnapshotTaker(source, origin_tag="base")
    for n in range(8):      # the guest's counter pages alone fill 64 KiB: dirty more
        source.memory.write(PATTERN_AT + n * 4096 * 8, os.urandom(4096 * 8))
    # Earlier tests' garbage (a machine, a socket) may still hold descriptors; collected
    # now, it cannot be collected during the capture and look like fds it closed.
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CaptureError, match="No space left"):
        taker.take(mode, str(tiny_disk / "memory.bin"), str(tiny_disk / "state.bin"))
    assert list(tiny_disk.iterdir()) == []
    assert _children() == [] and len(os.listdir("/proc/self/fd")) == fds
    at = source.memory.read_u64(FILL_AT)
    assert wait_until(lambda: source.memory.read_u64(FILL_AT) > at + 20)


def _children() -> list[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return [int(pid) for pid in f.read().split()]


def test_a_diff_holds_memory_as_of_the_pause(source: Machine, base: tuple[MachineState, Path],
                                             tmp_path: Path) -> None:
    """A diff's pages are written after the resume, from the writer's copy-on-write view:
    what the source writes once it runs again -- its vCPU at once (the filler), the VMM
    as soon as the capture says the source resumed -- is not in the layer, but in the next
    diff, whose soft-dirty tracking restarted at the pause."""
    taker = SnapshotTaker(source, origin_tag="base")
    # 24 MiB of changed pages, so the writer is still writing when the overwrite lands;
    # the marked page is the highest, written last.
    bulk_at, bulk = 0x1000000, 24 << 20
    source.memory.write(bulk_at, os.urandom(bulk))
    mark_at = bulk_at + bulk - 4096
    before, after = os.urandom(4096), os.urandom(4096)
    source.memory.write(mark_at, before)
    overwrote: list[float] = []

    def overwrite(timings: dict[str, float]) -> None:
        source.memory.write(mark_at, after)
        overwrote.append(timings["pause_s"])

    first = tmp_path / "first"
    first.mkdir()
    result = taker.take("diff", str(first / "layer.bin"), str(first / "state.bin"),
                        tag="first", on_resumed=overwrite)
    assert overwrote and result.base_kind == "restore"
    assert result.dirty_pages is not None and result.dirty_pages >= bulk // 4096
    assert "fork_s" in result.timings       # the layer was written by the forked writer
    # The layer holds the pages that differ from the base (changed_pages, no more than
    # the dirty ones) and the small gaps between their runs: at most 5% more.
    with open(first / "layer.bin", "rb") as f:
        layer_pages = layerfile.read_layer_index(f.fileno()).data_bytes // 4096
    assert result.changed_pages is not None and result.changed_pages <= result.dirty_pages
    assert result.changed_pages <= layer_pages <= result.changed_pages * 1.05
    _materialise(base[1], first / "layer.bin", first / "memory.bin")
    with open(first / "memory.bin", "rb") as f:
        f.seek(mark_at)
        assert f.read(4096) == before
    _child_runs_on(first / "state.bin", first / "memory.bin")
    assert _children() == []
    assert source.memory.read(mark_at, 4096) == after

    second = tmp_path / "second"
    second.mkdir()
    result = taker.take("diff", str(second / "layer.bin"), str(second / "state.bin"),
                        tag="second")
    if dirty.soft_dirty_supported():
        assert result.base_tag == "first" and result.dirty_pages is not None
        assert result.dirty_pages < bulk // 4096        # only what changed since "first"
        _materialise(first / "memory.bin", second / "layer.bin", second / "memory.bin")
    else:
        _materialise(base[1], second / "layer.bin", second / "memory.bin")
    with open(second / "memory.bin", "rb") as f:
        f.seek(mark_at)
        assert f.read(4096) == after
    _child_runs_on(second / "state.bin", second / "memory.bin")
