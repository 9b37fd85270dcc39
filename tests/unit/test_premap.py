"""A diff chain's RAM mapped once in the forking process (the zygote's prefork) and
adopted by the children that inherit it (``vmmchild.premap_memory`` /
``inherited_premap``, ``memory.PremappedRam``, ``GuestMemory.from_file_private``).

Real files, real mmaps, real forks: this process plays the zygote."""

from __future__ import annotations

import faulthandler
import json
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vmfork.ondisk.memplan import PLAN_FILE, MemoryPlan, PlanRun, PlanSource, encode_plan
from vmfork.runtime import vmmchild
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory, PremappedRam, _mapping_address

MEM = 64 * PAGE_SIZE
LAYER_PAGES = (3, 4, 10, 40)   # RAM pages the layer holds (a run per contiguous range)


def _layer_byte(page: int) -> int:
    return 0x40 + page


def _write_chain(snaps: Path, tag: str = "link", layer_fill: Callable[[int], int] = _layer_byte
                 ) -> Path:
    """``snaps/base/memory.bin`` (page p full of byte p) and ``snaps/<tag>``: a layer of
    LAYER_PAGES and its plan."""
    base = snaps / "base" / "memory.bin"
    base.parent.mkdir(parents=True, exist_ok=True)
    if not base.exists():
        base.write_bytes(b"".join(bytes([p]) * PAGE_SIZE for p in range(MEM // PAGE_SIZE)))
    link = snaps / tag
    link.mkdir(exist_ok=True)
    layer = link / "layer.bin"
    tmp = link / "layer.tmp"   # replaced, never rewritten in place: a new inode
    tmp.write_bytes(b"".join(bytes([layer_fill(p)]) * PAGE_SIZE for p in LAYER_PAGES))
    os.replace(tmp, layer)
    runs = [PlanRun(3 * PAGE_SIZE, 2 * PAGE_SIZE, 1, 0),
            PlanRun(10 * PAGE_SIZE, PAGE_SIZE, 1, 2 * PAGE_SIZE),
            PlanRun(40 * PAGE_SIZE, PAGE_SIZE, 1, 3 * PAGE_SIZE)]
    plan = MemoryPlan(MEM, (PlanSource("base/memory.bin", MEM),
                            PlanSource(f"{tag}/layer.bin", len(LAYER_PAGES) * PAGE_SIZE)),
                      tuple(runs))
    tmp = link / "plan.tmp"
    tmp.write_bytes(encode_plan(plan))
    os.replace(tmp, link / PLAN_FILE)
    return link


def _expected(layer_fill: Callable[[int], int] = _layer_byte) -> bytes:
    return b"".join(bytes([layer_fill(p) if p in LAYER_PAGES else p]) * PAGE_SIZE
                    for p in range(MEM // PAGE_SIZE))


@pytest.fixture(autouse=True)
def _clean_caches() -> Iterator[None]:
    yield
    for path in list(vmmchild._premaps):
        vmmchild._drop_premap(path)
    vmmchild._plans.clear()


def _in_child(body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``body()`` in a forked child; its result (JSON) or the child's traceback."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = json.dumps(body())
        except BaseException:  # noqa: BLE001 - reported to the test
            out = json.dumps({"error": traceback.format_exc()})
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result: dict[str, Any] = json.loads(data)
    assert "error" not in result, result["error"]
    return result


def _mapped_ranges() -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = line.split()[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def _rss_kib(addr: int, size: int) -> int:
    """Resident KiB of the VMAs inside ``[addr, addr + size)`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = addr <= lo and hi <= addr + size
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


def _child_memory(link: Path) -> tuple[GuestMemory, PremappedRam | None]:
    """A child's RAM for ``link`` as its restore makes it: the inherited premap adopted
    when there is one, and which premap that was (None: mapped afresh)."""
    memory_file, plan = vmmchild.load_memory(str(link))
    assert plan is not None
    premapped = vmmchild.inherited_premap(str(link), plan)
    return GuestMemory.from_file_private(memory_file, MEM, plan, premapped), premapped


def _restore_in_child(link: Path, write: bool = False) -> dict[str, Any]:
    """What a child's restore does with its memory: the inherited premap, adopted."""
    memory, premapped = _child_memory(link)
    adopted = premapped is not None and memory.regions[0].mapping is premapped.mappings[0]
    seen = memory.read(0, MEM)
    if write:
        memory.write(3 * PAGE_SIZE, b"child wrote this")
        memory.write(0, b"and this")
    overlays = [(o.offset, o.length, o.file_offset) for o in memory.overlays]
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in (memory.backing_fd,
                                                         *memory._overlay_fds)]
    return {"inherited": premapped is not None, "adopted": adopted,
            "matches": seen == _expected(), "first_page": seen[:16].hex(),
            "overlays": overlays, "fds": fds, "vmas": len(_mapped_ranges())}


def test_a_child_adopts_the_premapped_chain_and_its_writes_stay_its_own(
        tmp_path: Path) -> None:
    link = _write_chain(tmp_path / "snaps")
    vmmchild.premap_memory({str(link)})
    entry = vmmchild._premaps[str(link / PLAN_FILE)]
    assert entry.inherited
    start = _mapping_address(entry.ram.mappings[0])
    assert _rss_kib(start, MEM) == 0   # mapped, never touched here

    first = _in_child(lambda: _restore_in_child(link, write=True))
    assert first["inherited"] and first["adopted"] and first["matches"]
    # The overlays a capture reads, and the fds it reads them through, as a child
    # mapping the plan itself records them.
    fresh = GuestMemory.from_file_private(str(tmp_path / "snaps/base/memory.bin"), MEM,
                                          entry.plan)
    try:
        assert first["overlays"] == [[o.offset, o.length, o.file_offset]
                                     for o in fresh.overlays]
    finally:
        fresh.close()
    assert first["fds"] == [str(tmp_path / "snaps/base/memory.bin"),
                            str(link / "layer.bin")]

    # The first child's writes are in no one else's view: not a second child's, not
    # the files', and the zygote still has not a resident page of it.
    second = _in_child(lambda: _restore_in_child(link))
    assert second["adopted"] and second["matches"]
    assert (tmp_path / "snaps/base/memory.bin").read_bytes()[:PAGE_SIZE] == bytes(PAGE_SIZE)
    assert (link / "layer.bin").read_bytes()[:PAGE_SIZE] == bytes([_layer_byte(3)]) * PAGE_SIZE
    assert _rss_kib(start, MEM) == 0


def test_the_zygote_cannot_write_the_premap(tmp_path: Path) -> None:
    """It is mapped read-only where it is made: a write faults (here, in a child that
    did not adopt it), so no page of it can be written for every later child."""
    link = _write_chain(tmp_path / "snaps")
    vmmchild.premap_memory({str(link)})
    mapping = vmmchild._premaps[str(link / PLAN_FILE)].ram.mappings[0]
    pid = os.fork()
    if pid == 0:
        faulthandler.disable()   # the fault's report is not the test's
        mapping[0] = 1
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 11   # SIGSEGV


def test_a_changed_layer_is_not_adopted_and_the_zygote_drops_it(tmp_path: Path) -> None:
    link = _write_chain(tmp_path / "snaps")
    vmmchild.premap_memory({str(link)})
    old = vmmchild._premaps[str(link / PLAN_FILE)].ram
    # The layer replaced (same size, new inode) after the zygote mapped it: the child
    # must not restore the old bytes.
    _write_chain(tmp_path / "snaps", layer_fill=lambda p: 0xEE)

    def restore() -> dict[str, Any]:
        memory, premapped = _child_memory(link)
        return {"inherited": premapped is not None,
                "adopted": memory.regions[0].mapping is old.mappings[0],
                "page3": memory.read(3 * PAGE_SIZE, 1).hex()}

    # (The plan was rewritten too, so the child sees a new plan file: not inherited.)
    out = _in_child(restore)
    assert not out["adopted"] and out["page3"] == "ee"
    vmmchild.premap_memory({str(link)})
    assert vmmchild._premaps[str(link / PLAN_FILE)].ram is not old


def test_a_replaced_source_under_an_unchanged_plan_is_mapped_afresh(tmp_path: Path) -> None:
    """The plan file is the same, a file it maps is not: the files' identities catch it."""
    link = _write_chain(tmp_path / "snaps")
    vmmchild.premap_memory({str(link)})
    plan_path = str(link / PLAN_FILE)
    st = os.stat(plan_path)
    layer = link / "layer.bin"
    tmp = link / "layer.tmp"
    tmp.write_bytes(bytes([0xEE]) * layer.stat().st_size)
    os.replace(tmp, layer)
    os.utime(plan_path, ns=(st.st_atime_ns, st.st_mtime_ns))

    def restore() -> dict[str, Any]:
        memory, premapped = _child_memory(link)
        return {"inherited": premapped is not None,
                "adopted": premapped is not None
                and memory.regions[0].mapping is premapped.mappings[0],
                "page3": memory.read(3 * PAGE_SIZE, 1).hex()}

    out = _in_child(restore)
    assert out == {"inherited": True, "adopted": False, "page3": "ee"}
    vmmchild.premap_memory({str(link)})   # the zygote notices too, and maps it again
    out = _in_child(restore)
    assert out == {"inherited": True, "adopted": True, "page3": "ee"}


def test_children_of_other_snapshots_do_not_inherit_it(tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    link = _write_chain(snaps)
    other = _write_chain(snaps, "other")
    vmmchild.premap_memory({str(link)})
    link_addr = _mapping_address(vmmchild._premaps[str(link / PLAN_FILE)].ram.mappings[0])
    vmmchild.premap_memory({str(other)})   # the next batch: another snapshot
    assert not vmmchild._premaps[str(link / PLAN_FILE)].inherited
    assert vmmchild._premaps[str(other / PLAN_FILE)].inherited

    def child() -> dict[str, Any]:
        present = any(lo <= link_addr < hi for lo, hi in _mapped_ranges())
        out = _restore_in_child(other)
        return {"link_present": present, **out}

    out = _in_child(child)
    assert not out["link_present"] and out["adopted"] and out["matches"]
    # A batch of both: each child adopts its own and unmaps the other's.
    vmmchild.premap_memory({str(link), str(other)})

    def child_of_both() -> dict[str, Any]:
        other_addr = _mapping_address(vmmchild._premaps[str(other / PLAN_FILE)]
                                      .ram.mappings[0])
        out = _restore_in_child(link)
        return {"other_present": any(lo <= other_addr < hi for lo, hi in _mapped_ranges()),
                **out}

    out = _in_child(child_of_both)
    assert not out["other_present"] and out["adopted"] and out["matches"]


def test_not_in_a_fork_nothing_is_adopted_and_a_full_cache_drops_the_oldest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snaps = tmp_path / "snaps"
    links = [_write_chain(snaps, f"l{i}") for i in range(3)]
    monkeypatch.setattr(vmmchild, "PREMAP_RUNS_KEPT", 6)   # two plans of 3 runs
    for link in links:
        vmmchild.premap_memory({str(link)})
    assert list(vmmchild._premaps) == [str(links[1] / PLAN_FILE), str(links[2] / PLAN_FILE)]
    monkeypatch.setattr(vmmchild, "SNAPSHOTS_KEPT", 1)
    vmmchild.premap_memory({str(links[0])})
    assert list(vmmchild._premaps) == [str(links[0] / PLAN_FILE)]
    # A deleted snapshot's files are not kept mapped past the next batch.
    (links[0] / PLAN_FILE).unlink()
    vmmchild.premap_memory(set())
    assert not vmmchild._premaps


def test_a_restore_outside_a_zygote_child_maps_its_own(tmp_path: Path) -> None:
    """The zygote's own warm-up restore must never take (and later unmap) the premap."""
    link = _write_chain(tmp_path / "snaps")
    vmmchild.premap_memory({str(link)})
    entry = vmmchild._premaps[str(link / PLAN_FILE)]
    assert vmmchild.zygote_child.current() is None
    memory_file, plan = vmmchild.load_memory(str(link))
    memory = GuestMemory.from_file_private(memory_file, MEM, plan)
    try:
        assert memory.read(0, MEM) == _expected()
        assert memory.regions[0].mapping is not entry.ram.mappings[0]
    finally:
        memory.close()
    assert entry.inherited and not entry.ram.mappings[0].closed


def test_a_diff_of_an_adopted_mapping_leaves_out_pages_written_back(tmp_path: Path) -> None:
    """The diff writer's comparison with the restore base reads through the overlays and
    fds of an adopted mapping as of one the child mapped itself."""
    from vmfork.vmm import capture, dirty

    link = _write_chain(tmp_path / "snaps")
    vmmchild.premap_memory({str(link)})

    def body() -> dict[str, Any]:
        memory, premapped = _child_memory(link)
        memory.write(3 * PAGE_SIZE, bytes([_layer_byte(3)]) * 8)   # the layer's bytes
        memory.write(5 * PAGE_SIZE, bytes([5]) * 8)                # the base file's
        memory.write(10 * PAGE_SIZE + 7, b"\0")                    # not the layer's
        kept = capture._without_unchanged(memory, dirty.changed_private_pages(memory))
        return {"adopted": premapped is not None, "kept": kept}

    result = _in_child(body)
    assert result["adopted"]
    assert result["kept"] == [[10 * PAGE_SIZE, PAGE_SIZE]]


def test_a_native_child_is_given_its_premap_and_the_others_to_unmap(tmp_path: Path) -> None:
    """What a child that runs no Python is told of the premaps its fork copies
    (``vmmchild.inherited_ram``, for ``SnapshotMachinePlan.for_child``): its own RAM's
    regions, and every other inherited premap's range, which it unmaps."""
    link = _write_chain(tmp_path / "snaps")
    other = _write_chain(tmp_path / "snaps", tag="other")
    vmmchild.premap_memory({str(link), str(other)})
    mine = vmmchild._premaps[str(link / PLAN_FILE)].ram
    theirs = vmmchild._premaps[str(other / PLAN_FILE)].ram
    assert vmmchild.inherited_ram(str(link)) == (
        [(0, MEM, _mapping_address(mine.mappings[0]))],
        [(_mapping_address(theirs.mappings[0]), MEM)])
    # A flat snapshot's child in the same batch maps its file and unmaps both.
    flat, others = vmmchild.inherited_ram(str(tmp_path / "snaps/base"))
    assert flat is None and sorted(others) == sorted(
        (_mapping_address(m.mappings[0]), MEM) for m in (mine, theirs))
    # Not this batch's (MADV_DONTFORK: not inherited): a native child cannot adopt it,
    # nor unmap it.
    vmmchild.premap_memory({str(other)})
    with pytest.raises(ValueError, match="did not map ahead"):
        vmmchild.inherited_ram(str(link))
    assert vmmchild.inherited_ram(str(other)) == (
        [(0, MEM, _mapping_address(theirs.mappings[0]))], [])
