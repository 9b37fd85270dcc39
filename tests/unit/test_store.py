"""The snapshot store: publish/abort, crash safety across processes, get/list/delete, usage.

Crash and concurrency tests run real child processes (``python -c`` against the
store in ``src``) and kill them with SIGKILL, so the flock/rename logic is
exercised the way a crashing VMM would exercise it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vmfork.store import (
    SnapshotCorrupt,
    SnapshotMeta,
    SnapshotNotFound,
    SnapshotTimings,
    Store,
    StoreError,
    TagBusy,
    TagExists,
    default_root,
    disk_usage,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")
MiB = 1 << 20


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "vmfork-home")


def meta_for(tag: str, **kw: object) -> SnapshotMeta:
    base = SnapshotMeta(tag=tag, image="debian-py311", mem_mib=4, vcpus=2, warm_up="import json",
                        timings=SnapshotTimings(pause_ms=1.5, capture_ms=0.7, write_ms=12.0),
                        extra={"note": "test", "nested": {"k": [1, 2]}})
    return replace(base, **kw)  # type: ignore[arg-type]


def write_files(path: Path, *, mem_bytes: int = 4 * MiB, state: bytes = b"STATE") -> None:
    (path / "state.bin").write_bytes(state)
    with open(path / "memory.bin", "wb") as f:
        f.truncate(mem_bytes)
        f.seek(4096)
        f.write(b"\xaa" * 4096)


def make(store: Store, tag: str, **kw: object) -> None:
    with store.begin(tag) as pending:
        write_files(pending.path)
        pending.publish(meta_for(tag, **kw))


def entries(store: Store) -> list[str]:
    return sorted(os.listdir(store.snapshots_dir))


def run_child(store: Store, body: str) -> subprocess.Popen[str]:
    """A Python child with ``store`` bound to this store; it prints lines we wait on."""
    code = (f"import sys, time, os\nsys.path.insert(0, {SRC!r})\n"
            f"from vmfork.store import *\nstore = Store.open({str(store.root)!r})\n"
            + textwrap.dedent(body))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_line(proc: subprocess.Popen[str], expected: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != expected:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"child said {line!r}, expected {expected!r}; stderr:\n{err}")


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


# --------------------------------------------------------------------------- root

def test_default_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VMFORK_HOME", str(tmp_path / "h"))
    assert default_root() == tmp_path / "h"
    assert Store().root == tmp_path / "h"
    monkeypatch.delenv("VMFORK_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "vmfork"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_root() == tmp_path / "home" / ".local" / "share" / "vmfork"


# --------------------------------------------------------------------------- publish

def test_publish_then_get_and_list(store: Store) -> None:
    with store.begin("warm") as pending:
        assert pending.path.parent == store.snapshots_dir
        assert pending.path.name.startswith(".pending-warm-")
        assert (pending.path.stat().st_mode & 0o777) == 0o700
        assert store.list() == []  # in flight: not listed
        with pytest.raises(SnapshotNotFound):
            store.get("warm")
        write_files(pending.path)
        snap = pending.publish(meta_for("warm"))
    assert snap.path == store.snapshots_dir / "warm"
    assert entries(store) == ["warm"]
    assert sorted(os.listdir(snap.path)) == ["memory.bin", "meta.json", "state.bin"]
    got = store.get("warm")
    assert got == snap
    assert got.state_path.read_bytes() == b"STATE"
    assert got.memory_path.stat().st_size == 4 * MiB
    m = got.meta
    assert (m.tag, m.image, m.mem_mib, m.vcpus, m.status, m.parent_tag) == (
        "warm", "debian-py311", 4, 2, "ready", None)
    assert m.timings.pause_ms == 1.5 and m.warm_up == "import json"
    assert m.extra == {"note": "test", "nested": {"k": [1, 2]}}
    assert m.sizes.memory_logical_bytes == 4 * MiB and m.sizes.state_bytes == 5
    assert 0 < m.sizes.memory_physical_bytes < 4 * MiB
    assert abs(m.created_at_unix - time.time()) < 60
    assert [s.tag for s in store.list()] == ["warm"]
    on_disk = json.loads(got.meta_path.read_text())
    assert on_disk["format_version"] == 1 and on_disk["tag"] == "warm"


def test_published_snapshots_are_the_daemons_alone(store: Store) -> None:
    """0700 directories, the meta file 0600 (the memory and state files are the
    writer's, made 0600 by the VMM or the branch copy): no other local user reads a
    guest's memory or lists the store."""
    make(store, "private")
    snap = store.get("private")
    for d in (store.snapshots_dir, snap.path):
        assert (d.stat().st_mode & 0o777) == 0o700, d
    assert (snap.meta_path.stat().st_mode & 0o777) == 0o600


def test_list_is_sorted(store: Store) -> None:
    for tag in ["b", "A", "c-2", "a"]:
        make(store, tag)
    assert [s.tag for s in store.list()] == sorted(["b", "A", "c-2", "a"])


def test_publish_requires_both_files_and_leaves_nothing(store: Store) -> None:
    with (pytest.raises(StoreError, match="memory.bin was not written"),
          store.begin("half") as pending):
        (pending.path / "state.bin").write_bytes(b"x")
        pending.publish(meta_for("half"))
    assert entries(store) == []
    make(store, "half")  # the tag is free again


def test_publish_refuses_a_meta_for_another_tag(store: Store) -> None:
    with store.begin("one") as pending:
        write_files(pending.path)
        with pytest.raises(StoreError, match="does not match"):
            pending.publish(meta_for("two"))
    assert entries(store) == []


def test_exception_in_block_aborts(store: Store) -> None:
    with pytest.raises(RuntimeError), store.begin("boom") as pending:
        write_files(pending.path)
        raise RuntimeError("capture failed")
    assert entries(store) == []
    make(store, "boom")


def test_leaving_block_without_publish_aborts(store: Store) -> None:
    with store.begin("forgot") as pending:
        write_files(pending.path)
    assert entries(store) == []
    assert "aborted" in repr(pending)


def test_pending_cannot_be_used_twice(store: Store) -> None:
    pending = store.begin("twice")
    write_files(pending.path)
    pending.publish(meta_for("twice"))
    with pytest.raises(StoreError, match="already published"):
        pending.publish(meta_for("twice"))
    pending.abort()  # no-op after publish
    assert store.get("twice")
    other = store.begin("other")
    other.abort()
    other.abort()
    with pytest.raises(StoreError, match="already aborted"):
        other.publish(meta_for("other"))


def test_existing_and_busy_tags(store: Store) -> None:
    make(store, "taken")
    with pytest.raises(TagExists, match="vmfork rmi taken"):
        store.begin("taken")
    pending = store.begin("inflight")
    try:
        with pytest.raises(TagBusy) as info:
            store.begin("inflight")
        assert f"pid {os.getpid()}" in str(info.value)
        with pytest.raises(TagBusy):
            store.delete("inflight")
    finally:
        pending.abort()
    store.begin("inflight").abort()


def test_publish_does_not_replace_an_intruding_directory(store: Store) -> None:
    with store.begin("race") as pending:
        write_files(pending.path)
        (store.snapshots_dir / "race").mkdir()  # someone bypassing the lock
        with pytest.raises(TagExists):
            pending.publish(meta_for("race"))
    assert os.listdir(store.snapshots_dir / "race") == []


# --------------------------------------------------------------------------- crashes

def test_writer_killed_mid_write_leaves_nothing_listed(store: Store,
                                                       children: list[subprocess.Popen[str]]
                                                       ) -> None:
    child = run_child(store, """
        p = store.begin("crashy")
        (p.path / "state.bin").write_bytes(b"S" * 100)
        with open(p.path / "memory.bin", "wb") as f:
            f.write(b"M" * (1 << 20))
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
    """)
    children.append(child)
    wait_line(child, "writing")
    [pending] = [n for n in entries(store) if n.startswith(".pending-crashy-")]
    # While the writer lives: not listed, not openable, and cleanup leaves it alone.
    assert store.list() == []
    assert store.cleanup_stale() == []
    assert pending in entries(store)
    with pytest.raises(SnapshotNotFound):
        store.get("crashy")
    with pytest.raises(TagBusy):
        store.begin("crashy")

    child.send_signal(signal.SIGKILL)
    child.wait()
    assert store.list() == []
    with pytest.raises(SnapshotNotFound):
        store.get("crashy")
    assert entries(store) == []  # list() ran cleanup_stale: the temp dir is gone
    make(store, "crashy")
    assert [s.tag for s in store.list()] == ["crashy"]


def test_cleanup_stale_removes_dead_owners_only(store: Store,
                                                children: list[subprocess.Popen[str]]) -> None:
    live = run_child(store, """
        p = store.begin("live")
        print("ready", flush=True)
        time.sleep(60)
    """)
    children.append(live)
    wait_line(live, "ready")
    # Leftovers of crashed writers/deleters, made the way they would be.
    (store.snapshots_dir / ".pending-dead-0123456789abcdef").mkdir()
    (store.snapshots_dir / ".pending-dead-0123456789abcdef" / "memory.bin").write_bytes(b"x")
    (store.snapshots_dir / ".deleting-gone-fedcba9876543210").mkdir()
    removed = Store(store.root).cleanup_stale()
    assert sorted(p.name for p in removed) == [".deleting-gone-fedcba9876543210",
                                               ".pending-dead-0123456789abcdef"]
    [left] = entries(store)
    assert left.startswith(".pending-live-")
    live.kill()
    live.wait()
    Store.open(store.root)  # open runs cleanup too
    assert entries(store) == []


def test_begin_removes_its_own_tags_leftovers(store: Store) -> None:
    stale = store.snapshots_dir / ".pending-redo-00000000deadbeef"
    stale.mkdir()
    other = store.snapshots_dir / ".pending-redo-x-00000000deadbeef"  # tag "redo-x"
    other.mkdir()
    with store.begin("redo") as pending:
        assert not stale.exists() and other.exists()
        pending.abort()


def test_concurrent_begin_of_one_tag_has_one_winner(store: Store,
                                                    children: list[subprocess.Popen[str]]
                                                    ) -> None:
    go = store.root / "go"
    body = f"""
        while not os.path.exists({str(go)!r}):
            time.sleep(0.001)
        try:
            p = store.begin("contested")
        except TagBusy:
            print("busy", flush=True)
        except TagExists:
            print("exists", flush=True)
        else:
            print("won", flush=True)
            (p.path / "state.bin").write_bytes(str(os.getpid()).encode())
            (p.path / "memory.bin").write_bytes(b"")
            time.sleep(0.5)
            p.publish(SnapshotMeta(tag="contested", image="i", mem_mib=0, vcpus=1))
            print("published", flush=True)
    """
    for _ in range(4):
        children.append(run_child(store, body))
    time.sleep(0.3)  # let them all reach the spin
    go.touch()
    outcomes = []
    for child in children:
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
        outcomes.append(out.split())
    winners = [o for o in outcomes if o[0] == "won"]
    assert len(winners) == 1, outcomes
    assert winners[0] == ["won", "published"]
    assert all(o in (["busy"], ["exists"]) for o in outcomes if o[0] != "won")
    snap = store.get("contested")
    assert int(snap.state_path.read_bytes()) == children[outcomes.index(winners[0])].pid
    assert entries(store) == ["contested"]


def test_forked_child_does_not_inherit_the_tag(store: Store) -> None:
    pending = store.begin("parent-owned")
    pid = os.fork()
    if pid == 0:  # child: it must not be able to publish or remove the parent's work
        code = 0
        try:
            pending.publish(meta_for("parent-owned"))
            code = 1
        except StoreError as err:
            code = 0 if "forked copy" in str(err) else 2
        pending.abort()
        code = code or (0 if pending.path.exists() else 3)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with pytest.raises(TagBusy):  # the parent still holds it
        Store(store.root).begin("parent-owned")
    write_files(pending.path)
    pending.publish(meta_for("parent-owned"))


# --------------------------------------------------------------------------- get / delete

def test_not_found_names_the_tag_and_what_exists(store: Store) -> None:
    with pytest.raises(SnapshotNotFound, match="no snapshots yet"):
        store.get("nope")
    make(store, "alpha")
    make(store, "beta")
    with pytest.raises(SnapshotNotFound) as info:
        store.get("nope")
    assert "'nope'" in str(info.value) and "alpha, beta" in str(info.value)
    for i in range(12):
        make(store, f"t{i:02}")
    with pytest.raises(SnapshotNotFound, match="14 snapshots exist"):
        store.get("nope")


def test_delete(store: Store) -> None:
    make(store, "gone")
    make(store, "kept")
    store.delete("gone")
    assert [s.tag for s in store.list()] == ["kept"]
    assert entries(store) == ["kept"]
    with pytest.raises(SnapshotNotFound):
        store.get("gone")
    with pytest.raises(SnapshotNotFound):
        store.delete("gone")
    make(store, "gone")  # the tag can be reused


def test_interrupted_delete_is_finished_by_cleanup(store: Store) -> None:
    make(store, "half-deleted")
    # What a deleter killed between its rename and its rmtree leaves behind.
    os.rename(store.snapshots_dir / "half-deleted",
              store.snapshots_dir / ".deleting-half-deleted-0123456789abcdef")
    assert store.list() == []
    assert entries(store) == []


# --------------------------------------------------------------------------- corruption

@pytest.mark.parametrize(("damage", "expect"), [
    (lambda p: (p / "memory.bin").unlink(), "memory.bin is missing"),
    (lambda p: os.truncate(p / "memory.bin", MiB), "memory.bin is 1048576 bytes"),
    (lambda p: (p / "state.bin").write_bytes(b"S"), "state.bin is 1 bytes"),
    (lambda p: (p / "meta.json").unlink(), "meta.json is missing"),
    (lambda p: (p / "meta.json").write_text("{not json"), "not valid JSON"),
    (lambda p: (p / "meta.json").write_text("[]"), "not a JSON object"),
    (lambda p: (p / "meta.json").write_text('{"tag": "c", "image": 5}'), "image"),
    (lambda p: (p / "meta.json").write_text('{"format_version": 99, "tag": "c"}'),
     "upgrade vmfork"),
])
def test_damaged_snapshots_are_refused_clearly(store: Store, damage: object,
                                               expect: str) -> None:
    make(store, "c")
    make(store, "fine")
    damage(store.snapshots_dir / "c")  # type: ignore[operator]
    with pytest.raises(SnapshotCorrupt) as info:
        store.get("c")
    assert expect in str(info.value) and "'c'" in str(info.value)
    assert [s.tag for s in store.list()] == ["fine"]
    assert [e.tag for e in store.list_corrupt()] == ["c"]
    store.delete("c")  # the remedy the message gives works
    assert store.list_corrupt() == []


def test_renamed_directory_is_refused(store: Store) -> None:
    make(store, "orig")
    os.rename(store.snapshots_dir / "orig", store.snapshots_dir / "moved")
    with pytest.raises(SnapshotCorrupt, match="says it is 'orig'"):
        store.get("moved")


def test_meta_from_a_newer_writer_is_read(store: Store) -> None:
    make(store, "future")
    meta_path = store.snapshots_dir / "future" / "meta.json"
    tree = json.loads(meta_path.read_text())
    tree["layers"] = [{"hash": "abc", "file": "layer-0.bin"}]
    tree["timings"]["materialise_ms"] = 3.0
    del tree["warm_up"]
    meta_path.write_text(json.dumps(tree))
    meta = store.get("future").meta
    assert meta.warm_up is None and meta.timings.pause_ms == 1.5


def test_foreign_entries_are_ignored(store: Store) -> None:
    make(store, "real")
    (store.snapshots_dir / "not a tag").mkdir()
    (store.snapshots_dir / "file-not-dir").write_text("x")
    (store.snapshots_dir / ".pending-junk").mkdir()
    assert [s.tag for s in store.list()] == ["real"]
    assert (store.snapshots_dir / ".pending-junk").exists()


# --------------------------------------------------------------------------- usage

def test_disk_usage_of_a_sparse_memory_file(store: Store) -> None:
    with store.begin("sparse") as pending:
        (pending.path / "state.bin").write_bytes(b"s" * 1000)
        with open(pending.path / "memory.bin", "wb") as f:
            f.truncate(256 * MiB)
            f.seek(100 * MiB)
            f.write(b"\x01" * 8192)
        snap = pending.publish(meta_for("sparse", mem_mib=256))
    usage = disk_usage(snap)
    by_name = {f.name: f for f in usage.files}
    assert sorted(by_name) == ["memory.bin", "meta.json", "state.bin"]
    mem = by_name["memory.bin"]
    assert mem.logical_bytes == 256 * MiB
    assert 8192 <= mem.physical_bytes < 4 * MiB  # holes are not counted
    assert snap.meta.sizes.memory_physical_bytes == mem.physical_bytes
    assert by_name["state.bin"].logical_bytes == 1000
    assert usage.logical_bytes == sum(f.logical_bytes for f in usage.files)
    assert usage.physical_bytes == sum(f.physical_bytes for f in usage.files)
    assert usage.physical_bytes < usage.logical_bytes
