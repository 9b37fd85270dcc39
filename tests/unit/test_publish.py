"""The store's one publish path (``PendingSnapshot.publish``): the same guarantees for a
root and a link, whoever writes it -- a capture, a BRANCH, a compaction, an unpack.

Real stores in a temporary directory, real layer files (``test_chains``'s helpers); a
failure is injected where the store makes its files durable (``fsync_tree`` raising
ENOSPC), the last step before the rename.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from test_chains import MEM, make_link, make_root, meta

from vmfork.store import Store, StoreError, chains
from vmfork.store import store as store_module
from vmfork.store.layers import LAYER_FILE, hash_file, hash_memory, snapshot_content_hash
from vmfork.store.meta import MEMORY_SOURCE_PLAN


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "home")


def leftovers(store: Store) -> list[str]:
    return [e for e in os.listdir(store.snapshots_dir) if e.startswith(".")]


def test_a_root_records_its_hashes_and_content_hash(store: Store) -> None:
    """A parent from `vmfork snapshot` or a full BRANCH goes through here: its memory is
    hashed and its content hash recorded, so verify has nothing unhashed."""
    make_root(store, "base", {1: b"b", 700: b"z"})
    snap = store.get("base")
    state, memory = hash_file(snap.state_path), hash_memory(snap.memory_path)
    assert snap.meta.file_hashes == {"state.bin": state, "memory.bin": memory}
    assert snap.meta.content_hash == snapshot_content_hash(state, memory, None)
    assert {(c.name, c.status) for c in chains.verify(store, "base")} == {
        ("state.bin", "ok"), ("memory.bin", "ok")}


def test_a_link_records_the_chain_below_it(store: Store) -> None:
    make_root(store, "base", {1: b"b"})
    make_link(store, "base", "child", {2: b"c"})
    base, child = store.get("base"), store.get("child")
    layer = hash_file(child.path / LAYER_FILE)
    assert child.meta.parent_tag == "base" and child.meta.root_tag == "base"
    assert child.meta.parent_content_hash == base.meta.content_hash
    assert child.meta.content_hash == snapshot_content_hash(
        hash_file(child.state_path), layer, base.meta.content_hash)
    assert [r.tag for r in child.meta.memory_layers] == ["child"]
    assert child.meta.memory_layers[0].content_hash == layer
    assert {c.status for c in chains.verify(store, "child")} == {"ok"}


def test_a_root_keeps_a_recorded_content_hash_even_none(store: Store) -> None:
    with store.begin("old") as pending:
        pending.state_path.write_bytes(b"STATE")
        with open(pending.memory_path, "wb") as f:
            f.truncate(MEM)
        snap = pending.publish(meta("old"), recorded_content_hash=None)
    assert snap.meta.content_hash is None
    assert set(snap.meta.file_hashes) == {"state.bin", "memory.bin"}   # hashed all the same


def test_a_link_whose_content_hash_differs_from_the_record_is_refused(store: Store) -> None:
    make_root(store, "base", {1: b"b"})
    make_link(store, "base", "child", {2: b"c"})
    with store.begin("copy") as pending:
        pending.state_path.write_bytes(store.get("child").state_path.read_bytes())
        pending.layer_path.write_bytes((store.get("child").path / LAYER_FILE).read_bytes())
        with pytest.raises(StoreError, match="is not the recorded"):
            pending.publish(meta("copy"), parent=store.get("base"),
                            recorded_content_hash="blake2b-256:" + "0" * 64)
    assert not store.exists("copy") and leftovers(store) == []


def test_a_plan_without_a_parent_is_refused(store: Store) -> None:
    with store.begin("orphan") as pending:
        pending.state_path.write_bytes(b"STATE")
        with pytest.raises(StoreError, match="a memory plan needs a parent"):
            pending.publish(replace(meta("orphan"), memory_source=MEMORY_SOURCE_PLAN))
    assert not store.exists("orphan") and leftovers(store) == []


@pytest.mark.parametrize("kind", ["root", "link"])
def test_a_failed_publish_leaves_nothing_listed_or_behind(
        store: Store, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    make_root(store, "base", {1: b"b"})

    def full_disk(root: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "fsync_tree", full_disk)
    with pytest.raises(StoreError, match="fsync the files failed"):
        if kind == "root":
            make_root(store, "new", {3: b"n"})
        else:
            make_link(store, "base", "new", {3: b"n"})
    assert [s.tag for s in store.list()] == ["base"] and leftovers(store) == []
    assert store.dependents_map() == {}


def test_a_missing_file_is_named(store: Store) -> None:
    with store.begin("half") as pending:
        pending.state_path.write_bytes(b"STATE")
        with pytest.raises(StoreError, match="memory.bin was not written"):
            pending.publish(meta("half"))
        make_root(store, "base", {1: b"b"})
        with pytest.raises(StoreError, match="layer.bin was not written"):
            pending.publish(meta("half"), parent=store.get("base"))
    assert not store.exists("half")
