"""Diff chains in the store, without KVM: info, rmi guard/cascade/force, verify, compact.

Chains are built with the store API from synthetic files: a root's memory.bin is
a sparse file, each link's layer.bin is written by ``ondisk.layerfile`` from an
anonymous ``GuestMemory`` holding the pages it "changed", and
``PendingSnapshot.publish`` publishes the link exactly as a BRANCH diff does. A
snapshot's memory is read as a restore maps it: ``GuestMemory.from_file_private``
with its memory plan (real ``MAP_PRIVATE | MAP_FIXED`` mappings, no KVM needed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_server_http import Served, _serve

from vmfork.cli import main
from vmfork.ondisk import layerfile, memplan
from vmfork.store import (
    SnapshotCorrupt,
    SnapshotMeta,
    SnapshotNotFound,
    Store,
    StoreError,
    TagExists,
    chains,
)
from vmfork.store import store as store_module
from vmfork.store.errors import HasDependents, ParentGone
from vmfork.store.layers import LAYER_FILE, PLAN_FILE
from vmfork.store.store import ChainTooDeep, chain_of
from vmfork.vmm import dirty
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory

MEM = 4 << 20


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "home")


def meta(tag: str) -> SnapshotMeta:
    return SnapshotMeta(tag=tag, image="default", mem_mib=MEM >> 20, vcpus=1)


def make_root(store: Store, tag: str, pages: dict[int, bytes]) -> None:
    with store.begin(tag) as pending:
        pending.state_path.write_bytes(b"STATE-" + tag.encode())
        with open(pending.memory_path, "wb") as f:
            f.truncate(MEM)
            for page, data in pages.items():
                f.seek(page * PAGE_SIZE)
                f.write(data.ljust(PAGE_SIZE, b"\0"))
        pending.publish(meta(tag))


def make_link(store: Store, parent: str, tag: str, pages: dict[int, bytes]) -> None:
    memory = GuestMemory.anonymous(MEM)
    for page, data in pages.items():
        memory.write(page * PAGE_SIZE, data.ljust(PAGE_SIZE, b"\0"))
    with store.begin(tag) as pending:
        pending.state_path.write_bytes(b"STATE-" + tag.encode())
        fd = os.open(pending.layer_path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            layerfile.write_layer(fd, memory, [(p * PAGE_SIZE, PAGE_SIZE) for p in sorted(pages)])
        finally:
            os.close(fd)
        pending.publish(meta(tag), parent=store.get(parent))


def image(store: Store, tag: str) -> bytes:
    """The guest RAM a restore of ``tag`` maps (its plan's files, or its memory.bin)."""
    memory_file, plan = memplan.snapshot_memory(str(store.get(tag).path))
    memory = GuestMemory.from_file_private(memory_file, MEM, plan)
    try:
        view = memory.backing_view(0, MEM)
        data = bytes(view)
        view.release()
    finally:
        memory.close()
    return data


def page(store: Store, tag: str, n: int) -> bytes:
    return image(store, tag)[n * PAGE_SIZE:(n + 1) * PAGE_SIZE].rstrip(b"\0")


@pytest.fixture
def chain3(store: Store) -> Store:
    """base <- numpy <- pandas <- sklearn, plus a sibling base <- other."""
    make_root(store, "base", {1: b"base-1", 2: b"base-2"})
    make_link(store, "base", "numpy", {2: b"numpy-2", 3: b"numpy-3"})
    make_link(store, "numpy", "pandas", {4: b"pandas-4"})
    make_link(store, "pandas", "sklearn", {1: b"sklearn-1"})
    make_link(store, "base", "other", {5: b"other-5"})
    return store


def test_every_head_resolves_its_whole_chain(chain3: Store) -> None:
    assert [page(chain3, "sklearn", n) for n in range(1, 6)] == \
        [b"sklearn-1", b"numpy-2", b"numpy-3", b"pandas-4", b""]
    assert [page(chain3, "numpy", n) for n in range(1, 5)] == \
        [b"base-1", b"numpy-2", b"numpy-3", b""]
    assert page(chain3, "other", 2) == b"base-2" and page(chain3, "other", 5) == b"other-5"


def test_info_reports_depth_parents_dependents_and_bytes(chain3: Store) -> None:
    info = chains.snapshot_info(chain3, "pandas")
    assert info["chain_depth"] == 2
    assert info["ancestors"] == ["base", "numpy"]
    assert info["parent_tag"] == "numpy"
    assert info["parent_content_hash"] == chain3.get("numpy").meta.content_hash
    assert info["content_hash"].startswith("blake2b-256:")
    assert info["dependents"] == ["sklearn"] and info["descendants"] == ["sklearn"]
    assert info["layer_bytes"] > PAGE_SIZE                   # header + index + one page
    assert info["memory_logical_bytes"] == MEM
    assert 0 < info["unique_bytes"] <= info["physical_bytes"]
    base = chains.snapshot_info(chain3, "base")
    assert base["chain_depth"] == 0 and base["ancestors"] == []
    assert base["dependents"] == ["numpy", "other"]
    assert sorted(base["descendants"]) == ["numpy", "other", "pandas", "sklearn"]
    assert len({chain3.get(t).meta.content_hash
                for t in ("base", "numpy", "pandas", "sklearn", "other")}) == 5


def test_rmi_refuses_a_snapshot_with_dependents_and_names_them(chain3: Store) -> None:
    with pytest.raises(HasDependents) as err:
        chain3.delete("base")
    assert err.value.dependents == ["numpy", "other"]
    assert "numpy, other" in str(err.value) and "--cascade" in str(err.value)
    assert chain3.exists("base")
    assert chain3.delete("sklearn") == ["sklearn"]           # a leaf goes
    with pytest.raises(StoreError, match="not both"):
        chain3.delete("numpy", cascade=True, force=True)


def test_cascade_removes_the_subtree_deepest_first(chain3: Store) -> None:
    assert chain3.delete("numpy", cascade=True) == ["sklearn", "pandas", "numpy"]
    assert [s.tag for s in chain3.list()] == ["base", "other"]
    assert chains.snapshot_info(chain3, "base")["dependents"] == ["other"]
    assert not [e for e in os.listdir(chain3.snapshots_dir) if e.startswith(".")]


def test_a_crash_mid_cascade_leaves_every_remaining_chain_whole(
        chain3: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    real = Store._rename_to_tomb
    calls: list[str] = []

    def crash_on_second(self: Store, tag: str) -> Path:
        calls.append(tag)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash")
        return real(self, tag)

    monkeypatch.setattr(Store, "_rename_to_tomb", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        chain3.delete("numpy", cascade=True)
    monkeypatch.undo()
    reopened = Store.open(chain3.root)                        # clears the tomb left behind
    assert [s.tag for s in reopened.list()] == ["base", "numpy", "other", "pandas"]
    for snap in reopened.list():
        chain_of(reopened, snap.tag)                    # no dangling parent
    assert not [e for e in os.listdir(reopened.snapshots_dir) if e.startswith(".")]


def test_force_keeps_dependents_spawnable_as_standalone_snapshots(chain3: Store) -> None:
    before = {t: image(chain3, t) for t in ("numpy", "pandas", "sklearn")}
    assert chain3.delete("numpy", force=True) == ["numpy"]
    pandas = chains.snapshot_info(chain3, "pandas")
    assert pandas["chain_depth"] == 0 and pandas["parent_tag"] is None
    assert pandas["orphaned_from"] == "numpy" and pandas["memory_mapping"]["kind"] == "file"
    assert not (chain3.get("pandas").path / LAYER_FILE).exists()
    assert not (chain3.get("pandas").path / PLAN_FILE).exists()
    sklearn = chains.snapshot_info(chain3, "sklearn")
    assert sklearn["ancestors"] == ["pandas"] and sklearn["chain_depth"] == 1
    # sklearn's plan no longer maps anything of numpy or base: it maps pandas' image.
    plan = memplan.read_plan(str(chain3.get("sklearn").plan_path))
    assert [s.path for s in plan.sources] == ["pandas/memory.bin", "sklearn/layer.bin"]
    assert chain3.get("sklearn").meta.root_tag == "pandas"
    for tag in ("pandas", "sklearn"):
        assert image(chain3, tag) == before[tag]
    assert all(c.status in ("ok", "unhashed") for c in chains.verify(chain3))
    assert chain3.plan_references() == {"pandas": ["sklearn"], "base": ["other"]}
    with pytest.raises(SnapshotNotFound):
        chain3.get("numpy")


def test_a_link_is_not_published_onto_a_parent_deleted_meanwhile(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    make_root(store, "base", {1: b"b"})
    real = store_module.write_plan

    def delete_parent_while_resolving(plan: memplan.MemoryPlan, path: Path) -> None:
        real(plan, path)
        store.delete("base")                # no dependents yet: the child is unpublished

    monkeypatch.setattr(store_module, "write_plan", delete_parent_while_resolving)
    with pytest.raises(ParentGone, match="deleted while"):
        make_link(store, "base", "child", {1: b"c"})
    assert store.list() == [] and not os.listdir(store.snapshots_dir)


def test_verify_finds_a_changed_byte(chain3: Store) -> None:
    checks = chains.verify(chain3, "pandas")
    assert {(c.name, c.status) for c in checks} == {
        ("state.bin", "ok"), ("layer.bin", "ok"), ("memory.plan", "ok")}
    assert {(c.name, c.status) for c in chains.verify(chain3, "base")} == {
        ("state.bin", "ok"), ("memory.bin", "ok")}
    layer = chain3.get("pandas").path / LAYER_FILE
    os.chmod(layer.parent, 0o755)
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    bad = [c for c in chains.verify(chain3) if c.status != "ok" and c.status != "unhashed"]
    assert [(c.tag, c.name, c.status) for c in bad] == [("pandas", "layer.bin", "mismatch")]


def test_compact_publishes_one_flat_snapshot(chain3: Store) -> None:
    flat = chains.compact(chain3, "sklearn", "sklearn-flat")
    assert flat.meta.parent_tag is None and flat.meta.memory_layers == []
    assert flat.memory_path.read_bytes() == image(chain3, "sklearn")
    assert not flat.is_layered and not (flat.path / PLAN_FILE).exists()
    assert flat.state_path.read_bytes() == b"STATE-sklearn"
    info = chains.snapshot_info(chain3, "sklearn-flat")
    assert info["chain_depth"] == 0 and info["branched_from"] == "compact:sklearn"
    assert os.stat(flat.memory_path).st_blocks * 512 < MEM // 2      # stays sparse
    assert {c.status for c in chains.verify(chain3, "sklearn-flat")} == {"ok"}
    with pytest.raises(TagExists):
        chains.compact(chain3, "pandas", "sklearn-flat")
    with pytest.raises(SnapshotNotFound):
        chains.compact(chain3, "nope", "x")


def test_a_failed_compact_leaves_nothing(chain3: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(path: object) -> str:
        raise OSError("disk on fire")

    monkeypatch.setattr(store_module, "hash_memory_file", fail)
    with pytest.raises(OSError):
        chains.compact(chain3, "sklearn", "flat")
    assert not chain3.exists("flat")
    assert not [e for e in os.listdir(chain3.snapshots_dir) if e.startswith(".")]


def test_depth_limit_has_a_clear_error(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "MAX_CHAIN_DEPTH", 2)
    make_root(store, "d0", {1: b"0"})
    make_link(store, "d0", "d1", {1: b"1"})
    make_link(store, "d1", "d2", {1: b"2"})
    with pytest.raises(ChainTooDeep, match="snapshot-compact --from d2"):
        make_link(store, "d2", "d3", {1: b"3"})
    assert not store.exists("d3")


def test_a_hostile_layer_cannot_write_outside_guest_ram(store: Store) -> None:
    make_root(store, "base", {1: b"b"})
    with store.begin("evil") as pending:
        pending.state_path.write_bytes(b"S")
        big = GuestMemory.anonymous(MEM * 2)
        fd = os.open(pending.layer_path, os.O_RDWR | os.O_CREAT)
        layerfile.write_layer(fd, big, [(MEM, PAGE_SIZE)])     # beyond the parent's RAM
        os.close(fd)
        with pytest.raises(layerfile.LayerError):
            pending.publish(replace(meta("evil")), parent=store.get("base"))
    assert not store.exists("evil")


# -- through the daemon (real HTTP server, controller and store; no VMs) and the CLI ------

@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from _serve(tmp_path, None)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_rest_info_delete_and_compact(served: Served) -> None:
    store = served.store
    make_root(store, "base", {1: b"b"})
    make_link(store, "base", "numpy", {2: b"n"})
    make_link(store, "numpy", "pandas", {3: b"p"})
    status, info, _ = served.request("GET", "/v1/snapshots/pandas/info")
    assert status == 200 and info["chain_depth"] == 2 and info["ancestors"] == ["base", "numpy"]
    assert info["parent_content_hash"] == store.get("numpy").meta.content_hash
    status, reply, _ = served.request("DELETE", "/v1/snapshots/base")
    assert status == 409 and reply["dependents"] == ["numpy"] and "numpy" in reply["error"]
    status, reply, _ = served.request("DELETE", "/v1/snapshots/base?cascade=true&force=true")
    assert status == 400
    status, reply, _ = served.request("POST", "/v1/snapshots/pandas/compact", {"to": "flat"})
    assert status == 200 and reply["branched_from"] == "compact:pandas"
    status, reply, _ = served.request("POST", "/v1/snapshots/pandas/compact", {"to": "flat"})
    assert status == 409 and "already exists" in reply["error"]
    status, reply, _ = served.request("POST", "/v1/snapshots/pandas/compact", {"to": "../x"})
    assert status == 400
    status, reply, _ = served.request("POST", "/v1/snapshots/nope/compact", {"to": "y"})
    assert status == 404
    status, _, _ = served.request("DELETE", "/v1/snapshots/numpy?force=true")
    assert status == 204
    status, info, _ = served.request("GET", "/v1/snapshots/pandas/info")
    assert info["chain_depth"] == 0 and info["orphaned_from"] == "numpy"
    status, _, _ = served.request("DELETE", "/v1/snapshots/base?cascade=true")
    assert status == 204
    assert [s.tag for s in store.list()] == ["flat", "pandas"]


def test_cli_chain_verbs_through_the_daemon(served: Served,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--url", served.url)
    make_root(served.store, "base", {1: b"b"})
    make_link(served.store, "base", "numpy", {2: b"n"})
    status, out, _ = run(capsys, "snapshot-info", "numpy", *url)
    assert status == 0 and "chain_depth:             1" in out and "ancestors:               base" \
        in out
    status, out, err = run(capsys, "rmi", "base", *url)
    assert status != 0 and "dependents" in err and "numpy" in err
    status, out, _ = run(capsys, "snapshot-compact", "--from", "numpy", "--to", "numpy-flat",
                         "--json", *url)
    assert status == 0 and json.loads(out)["tag"] == "numpy-flat"
    status, out, _ = run(capsys, "rmi", "--cascade", "base", *url)
    assert status == 0 and served.store.exists("numpy-flat") and not served.store.exists("numpy")


def test_cli_chain_verbs_on_the_local_store(chain3: Store, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMFORK_HOME", str(chain3.root))
    monkeypatch.setenv("VMFORK_RUN_DIR", str(chain3.root / "run"))    # no daemon there
    monkeypatch.delenv("VMFORK_URL", raising=False)
    monkeypatch.delenv("FORKD_URL", raising=False)
    status, out, _ = run(capsys, "snapshot-info", "sklearn", "--json")
    assert status == 0 and json.loads(out)["ancestors"] == ["base", "numpy", "pandas"]
    status, out, err = run(capsys, "rmi", "numpy")
    assert status == 1 and "pandas" in err
    status, out, _ = run(capsys, "verify")
    assert status == 0 and "mismatch" not in out
    layer = chain3.get("numpy").path / LAYER_FILE
    os.chmod(layer, 0o644)
    with open(layer, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x01")
    status, out, err = run(capsys, "verify", "numpy")
    assert status == 1 and "mismatch" in out and "vmfork rmi" in err
    status, out, _ = run(capsys, "rmi", "--cascade", "numpy")
    assert status == 0 and out.split() == ["deleted", "sklearn", "deleted", "pandas",
                                           "deleted", "numpy"]


def test_snapshot_diff_keeps_nothing_when_the_command_fails(
        served: Served, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    url = ("--url", served.url)
    make_root(served.store, "base", {1: b"b"})
    make_link(served.store, "base", "numpy", {2: b"n"})
    # The fake agent's commands print two chunks and exit 3.
    status, out, err = run(capsys, "snapshot-diff", "--from", "numpy", "--tag", "pandas",
                           "--exec", "pip install pandas", *url)
    assert status == 1 and out == "chunk1 chunk2" and "exited with status 3" in err
    assert not served.store.exists("pandas") and served.spawner.branch_requests == []
    assert served.controller.list_sandboxes() == []             # the sandbox was killed
    status, _, err = run(capsys, "snapshot-diff", "--from", "numpy", "--tag", "base",
                         "--exec", "true", *url)
    assert status == 1 and "'base' already exists" in err
    status, _, err = run(capsys, "snapshot-diff", "--from", "numpy", "--tag", "../x",
                         "--exec", "true", *url)
    assert status == 2 and "invalid snapshot tag" in err
    monkeypatch.setattr(store_module, "MAX_CHAIN_DEPTH", 1)
    status, _, err = run(capsys, "snapshot-diff", "--from", "numpy", "--tag", "pandas",
                         "--exec", "true", *url)
    assert status == 1 and "chain depth 1" in err and "snapshot-compact" in err
    assert served.controller.list_sandboxes() == []


# -- memory plans ----------------------------------------------------------------------

def _index(extents: list[tuple[int, int]], data_offset: int = PAGE_SIZE) -> layerfile.LayerIndex:
    return layerfile.LayerIndex(MEM, tuple(extents), data_offset, sum(n for _, n in extents))


def test_plan_runs_topmost_wins_and_adjacent_runs_coalesce() -> None:
    P = PAGE_SIZE
    lower = _index([(0, 4 * P), (10 * P, 2 * P)])               # pages 0-3, 10-11
    upper = _index([(2 * P, 3 * P), (11 * P, P)])               # pages 2-4, 11
    runs = memplan.resolve_runs([(1, lower), (2, upper)])
    assert [(r.offset // P, r.length // P, r.source, r.source_offset // P) for r in runs] == [
        (0, 2, 1, 1),          # lower's pages 0-1 (its data starts at file page 1)
        (2, 3, 2, 1),          # upper wins pages 2-3 and adds 4
        (10, 1, 1, 5),         # lower's page 10 (its 5th data page)
        (11, 1, 2, 4)]         # upper wins page 11
    # Two layers' runs touching in memory but from different files stay apart; one
    # file's extents that are contiguous in memory and in the file become one run.
    runs = memplan.resolve_runs([(1, _index([(0, P), (P, P), (3 * P, P)]))])
    assert [(r.offset // P, r.length // P) for r in runs] == [(0, 2), (3, 1)]
    assert memplan.resolve_runs([]) == []


def test_a_link_stores_only_its_layer_and_a_small_plan(chain3: Store) -> None:
    pandas = chain3.get("pandas")
    assert pandas.is_layered and not pandas.memory_path.exists()
    assert sorted(os.listdir(pandas.path)) == ["layer.bin", "memory.plan", "meta.json",
                                               "state.bin"]
    plan = memplan.read_plan(str(pandas.plan_path))
    assert [s.path for s in plan.sources] == ["base/memory.bin", "numpy/layer.bin",
                                              "pandas/layer.bin"]
    assert plan.sources[1].owner_content_hash == chain3.get("numpy").meta.content_hash
    info = chains.snapshot_info(chain3, "pandas")
    assert info["memory_mapping"]["kind"] == "plan" and info["memory_mapping"]["runs"] == 2
    assert info["changed_bytes"] == PAGE_SIZE
    assert info["memory_physical_bytes"] == 0
    assert chain3.get("pandas").meta.format_version == 2
    assert chain3.plan_references()["base"] == ["numpy", "other", "pandas", "sklearn"]


def _encode_unchecked(plan: memplan.MemoryPlan, monkeypatch: pytest.MonkeyPatch) -> bytes:
    with monkeypatch.context() as m:
        m.setattr(memplan, "_check", lambda plan, error: None)
        return memplan.encode_plan(plan)


@pytest.mark.parametrize(("change", "problem"), [
    (lambda p: replace(p, runs=(*p.runs, p.runs[0])), "overlaps or is out of order"),
    (lambda p: replace(p, runs=(memplan.PlanRun(MEM, PAGE_SIZE, 1, PAGE_SIZE),)),
     "beyond guest RAM"),
    (lambda p: replace(p, runs=(memplan.PlanRun(0, PAGE_SIZE, 1, 1 << 30),)),
     "beyond its source"),
    (lambda p: replace(p, runs=(memplan.PlanRun(0, 100, 1, PAGE_SIZE),)), "page-aligned"),
    (lambda p: replace(p, runs=(memplan.PlanRun(0, PAGE_SIZE, 0, 0),)), "not a layer"),
    (lambda p: replace(p, sources=(replace(p.sources[0], path="../x/memory.bin"),
                                   *p.sources[1:])), "is not <tag>/memory.bin"),
    (lambda p: replace(p, sources=(p.sources[1], p.sources[0])), "exactly one memory.bin"),
])
def test_a_hostile_plan_is_refused(chain3: Store, monkeypatch: pytest.MonkeyPatch,
                                   change: object, problem: str) -> None:
    plan = memplan.read_plan(str(chain3.get("numpy").plan_path))
    assert callable(change)
    data = _encode_unchecked(change(plan), monkeypatch)
    with pytest.raises(memplan.PlanError, match=problem):
        memplan.decode_plan(data)


def test_a_damaged_plan_file_is_refused(chain3: Store) -> None:
    data = chain3.get("numpy").plan_path.read_bytes()
    for damaged, problem in [(b"NOTAPLAN" + data[8:], "bad magic"),
                             (data[:-1] + bytes([data[-1] ^ 1]), "body checksum"),
                             (data[:20] + b"\xff" + data[21:], "header checksum"),
                             (data[:-8], "do not add up"),
                             (data[:10], "shorter than its header")]:
        with pytest.raises(memplan.PlanError, match=problem):
            memplan.decode_plan(damaged)
    with pytest.raises(memplan.PlanError, match="limit"):
        memplan.decode_plan(bytes(memplan.MAX_PLAN_BYTES + 1))


def test_a_spawn_refuses_a_plan_whose_files_are_missing_or_changed(chain3: Store) -> None:
    layer = chain3.get("numpy").path / LAYER_FILE
    saved = layer.read_bytes()
    layer.unlink()
    with pytest.raises(memplan.PlanError, match="numpy/layer.bin, which cannot be opened"):
        image(chain3, "sklearn")
    layer.write_bytes(saved + bytes(PAGE_SIZE))
    with pytest.raises(memplan.PlanError, match="now .* bytes"):
        image(chain3, "sklearn")
    layer.write_bytes(saved)
    assert page(chain3, "sklearn", 2) == b"numpy-2"
    # The store also checks the tag still names the snapshot the plan was computed on.
    numpy = chain3.get("numpy")
    chain3.rewrite_meta(numpy, replace(numpy.meta, content_hash="blake2b-256:" + "0" * 64))
    with pytest.raises(SnapshotCorrupt, match="now names another snapshot"):
        chains.check_plan(chain3, chain3.get("sklearn"))
    assert "mismatch" in {c.status for c in chains.verify(chain3, "sklearn")}


def test_a_plan_that_passed_is_checked_again_by_its_files_identities(
        chain3: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    sklearn = chain3.get("sklearn")
    reads: list[str] = []
    real_read_plan = memplan.read_plan

    def counted(path: str) -> memplan.MemoryPlan:
        reads.append(path)
        return real_read_plan(path)

    monkeypatch.setattr(memplan, "read_plan", counted)
    # Files written just now are not settled: a pass on them is not kept.
    chains.check_plan(chain3, sklearn)
    chains.check_plan(chain3, sklearn)
    assert len(reads) == 2
    monkeypatch.setattr(chains, "_SETTLED_S", -60.0)   # every file counts as settled
    chains.check_plan(chain3, sklearn)
    chains.check_plan(chain3, sklearn)
    chains.check_plan(chain3, sklearn)
    assert len(reads) == 3   # kept: the last two only stat'ed the files
    # A source's meta.json replaced: read again, and refused.
    numpy = chain3.get("numpy")
    chain3.rewrite_meta(numpy, replace(numpy.meta, content_hash="blake2b-256:" + "0" * 64))
    with pytest.raises(SnapshotCorrupt, match="now names another snapshot"):
        chains.check_plan(chain3, sklearn)
    assert len(reads) == 4
    chain3.rewrite_meta(numpy, numpy.meta)
    chains.check_plan(chain3, sklearn)
    chains.check_plan(chain3, sklearn)
    assert len(reads) == 5
    # A source file gone: refused, not passed from the kept identities.
    layer = numpy.path / LAYER_FILE
    saved = layer.read_bytes()
    layer.unlink()
    with pytest.raises(SnapshotCorrupt, match="missing"):
        chains.check_plan(chain3, sklearn)
    layer.write_bytes(saved)
    chains.check_plan(chain3, sklearn)
    # The plan file itself replaced (damaged): read again, refused. Replaced, not
    # written in place: under _SETTLED_S < 0 a same-size write within the file
    # system's timestamp granularity would read as unchanged (why it is 2 s).
    plan_bytes = sklearn.plan_path.read_bytes()
    damaged = sklearn.plan_path.with_suffix(".damaged")
    damaged.write_bytes(plan_bytes[:-1] + bytes([plan_bytes[-1] ^ 1]))
    os.replace(damaged, sklearn.plan_path)
    with pytest.raises(SnapshotCorrupt, match="checksum"):
        chains.check_plan(chain3, sklearn)


def test_over_the_vma_budget_a_head_is_materialised_once(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memplan, "MAX_RUNS", 2)
    make_root(store, "base", {1: b"base-1"})
    make_link(store, "base", "two", {3: b"two-3", 5: b"two-5"})         # 2 runs: a plan
    make_link(store, "two", "four", {7: b"four-7", 9: b"four-9"})       # 4 runs: too many
    make_link(store, "four", "top", {3: b"top-3"})                      # over four's image
    two, four, top = (store.get(t) for t in ("two", "four", "top"))
    assert two.is_layered and not four.is_layered and top.is_layered
    assert four.memory_path.is_file() and not four.plan_path.exists()
    info = chains.snapshot_info(store, "four")
    assert info["memory_mapping"]["kind"] == "file"
    assert "over the budget of 2" in info["memory_mapping"]["materialised"]
    plan = memplan.read_plan(str(top.plan_path))
    assert [s.path for s in plan.sources] == ["four/memory.bin", "top/layer.bin"]
    assert [page(store, "top", n) for n in (1, 3, 5, 7, 9)] == [
        b"base-1", b"top-3", b"two-5", b"four-7", b"four-9"]
    assert store.plan_references() == {"base": ["two"], "four": ["top"]}
    assert chains.compact(store, "top", "flat").memory_path.read_bytes() == image(store, "top")


def test_a_delete_never_removes_files_a_remaining_plan_maps(chain3: Store) -> None:
    with pytest.raises(StoreError, match="maps its files"):
        chain3._check_unreferenced(["numpy"])
    chain3._check_unreferenced(["numpy", "pandas", "sklearn"])


def test_a_full_capture_of_a_layered_restore_is_its_chain_plus_its_writes(
        chain3: Store, tmp_path: Path) -> None:
    from vmfork.vmm import capture

    memory_file, plan = memplan.snapshot_memory(str(chain3.get("sklearn").path))
    memory = GuestMemory.from_file_private(memory_file, MEM, plan)
    try:
        memory.write(6 * PAGE_SIZE, b"written-6")            # a private COW page
        memory.write(3 * PAGE_SIZE, b"written-3")            # over numpy's layer page
        changed = [(o // PAGE_SIZE, n // PAGE_SIZE) for o, n in
                   dirty.changed_private_pages(memory)]
        assert changed == [(3, 1), (6, 1)]
        out = tmp_path / "full.bin"
        capture._write_image_file(str(out), memory)
    finally:
        memory.close()
    data = out.read_bytes()
    pages = [data[n * PAGE_SIZE:(n + 1) * PAGE_SIZE].rstrip(b"\0") for n in range(1, 7)]
    assert pages == [b"sklearn-1", b"numpy-2", b"written-3", b"pandas-4", b"", b"written-6"]


def test_a_crash_while_a_force_delete_rebases_leaves_dependents_spawnable(
        chain3: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {t: image(chain3, t) for t in ("pandas", "sklearn")}
    real = chain3.rewrite_meta

    def crash(snapshot: object, meta: SnapshotMeta) -> object:
        raise KeyboardInterrupt("simulated crash")

    # pandas' memory.bin is written and renamed in; the crash comes before its meta.
    monkeypatch.setattr(chain3, "rewrite_meta", crash)
    with pytest.raises(KeyboardInterrupt):
        chain3.delete("numpy", force=True)
    monkeypatch.setattr(chain3, "rewrite_meta", real)
    reopened = Store.open(chain3.root)
    assert reopened.exists("numpy") and (reopened.get("pandas").path / "memory.bin").exists()
    for tag in ("pandas", "sklearn"):
        assert image(reopened, tag) == before[tag]
    assert reopened.delete("numpy", force=True) == ["numpy"]      # and it can be finished
    for tag in ("pandas", "sklearn"):
        assert image(reopened, tag) == before[tag]


def test_a_diff_against_the_restore_base_leaves_out_pages_written_back(
        chain3: Store) -> None:
    """A page the guest wrote back to what its restore base holds there (the base's
    memory file, or a layer of the chain) is private but unchanged: the writer leaves it
    out, whichever file of the chain the base's bytes come from, and keeps every page
    that differs, even by one byte."""
    from vmfork.vmm import capture

    memory_file, plan = memplan.snapshot_memory(str(chain3.get("sklearn").path))
    memory = GuestMemory.from_file_private(memory_file, MEM, plan)
    try:
        memory.write(1 * PAGE_SIZE, b"sklearn-1")       # the same bytes (sklearn's layer)
        memory.write(2 * PAGE_SIZE, b"numpy-2")         # the same bytes (numpy's layer)
        memory.write(3 * PAGE_SIZE, b"numpy-3!")        # one byte more
        memory.write(5 * PAGE_SIZE, bytes(16))          # zeros over zeros (the base file)
        memory.write(6 * PAGE_SIZE, b"written-6")
        memory.write(7 * PAGE_SIZE + PAGE_SIZE - 1, b"\x01")   # the page's last byte
        listed = dirty.changed_private_pages(memory)
        assert _page_numbers(listed) == \
            [1, 2, 3, 5, 6, 7]
        kept = capture._without_unchanged(memory, listed)
    finally:
        memory.close()
    assert kept == [(3 * PAGE_SIZE, PAGE_SIZE), (6 * PAGE_SIZE, 2 * PAGE_SIZE)]


def test_unchanged_pages_are_compared_across_chunks_and_overlay_edges(
        store: Store) -> None:
    """Runs longer than the writer's compare chunk, and a base whose layers cover part
    of a run: only the pages that differ are kept."""
    from vmfork.vmm import capture

    make_root(store, "flat", {n: b"root-%d" % n for n in range(0, MEM // PAGE_SIZE, 3)})
    make_link(store, "flat", "top", {n: b"top-%d" % n for n in range(10, 700)})
    memory_file, plan = memplan.snapshot_memory(str(store.get("top").path))
    memory = GuestMemory.from_file_private(memory_file, MEM, plan)
    try:
        view = memory.backing_view(0, MEM)
        before = bytes(view)
        view.release()
        memory.write(0, before)                          # every page private, same bytes
        for n in (0, 9, 10, 255, 256, 699, 700, MEM // PAGE_SIZE - 1):
            memory.write(n * PAGE_SIZE + 100, b"\xee")
        kept = capture._without_unchanged(memory, dirty.changed_private_pages(memory))
    finally:
        memory.close()
    assert _page_numbers(kept) == \
        [0, 9, 10, 255, 256, 699, 700, MEM // PAGE_SIZE - 1]


def _page_numbers(runs: list[tuple[int, int]]) -> list[int]:
    return [page for offset, length in runs
            for page in range(offset // PAGE_SIZE, (offset + length) // PAGE_SIZE)]


@pytest.mark.parametrize(("counted", "changed"), [
    (3, 3), (5, 5), (0, 0),                 # the capture's count, at most the layer's
    (6, 5), (-1, 5), (True, 5), ("3", 5), (None, 5)])  # else the layer's pages
def test_a_link_s_changed_pages_are_its_capture_s_count(chain3: Store, counted: object,
                                                          changed: int) -> None:
    meta = chain3.get("pandas").meta
    layer = replace(meta.memory_layers[-1], pages=5)
    meta = replace(meta, memory_layers=[*meta.memory_layers[:-1], layer],
                               extra={**meta.extra, "changed_pages": counted})
    assert chains.changed_pages(meta) == changed
