"""Chains of diff snapshots: walk, inspect, verify, compact, and publish a link.

A chain is followed through ``meta.parent_tag`` (checked against the parent's
content hash), never through ``meta.memory_layers``, which records the layers
as they were when the snapshot was built and goes stale when an ancestor is
deleted with ``force``. Each link's own data is its ``layer.bin``; the root's is
its ``memory.bin``. Every snapshot also has its chain resolved into its own
``memory.bin`` (``vmfork.store.layers``), which is what children map, so none of
this runs on a spawn.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Any

from vmfork.store.errors import SnapshotCorrupt, SnapshotNotFound, StoreError
from vmfork.store.layers import (
    LAYER_FILE,
    hash_file,
    hash_memory,
    materialise_head,
    snapshot_content_hash,
)
from vmfork.store.meta import LayerRef, SnapshotMeta
from vmfork.store.store import (
    MEMORY_FILE,
    STATE_FILE,
    PendingSnapshot,
    Snapshot,
    Store,
    disk_usage,
)
from vmfork.store.tags import validate_tag
from vmfork.vmm import layerfile

# Each link adds one resolve at build time and one entry to walk when packing; past
# this, `vmfork snapshot-compact` makes a flat snapshot to build on instead.
MAX_CHAIN_DEPTH = 32


class ChainTooDeep(StoreError):
    def __init__(self, tag: str, depth: int) -> None:
        super().__init__(f"snapshot {tag!r} is already at chain depth {depth} (the limit is "
                         f"{MAX_CHAIN_DEPTH}); compact it first with `vmfork snapshot-compact "
                         f"--from {tag} --to NEW` and build on NEW", tag=tag)
        self.depth = depth


def chain_of(store: Store, tag: str) -> list[Snapshot]:
    """The chain ending at ``tag``, root first. ``SnapshotCorrupt`` if a parent it
    names is missing or was replaced (only a hand-edited store gets there: a parent
    cannot be deleted under its dependents)."""
    head = store.get(tag)
    links = [head]
    seen = {head.tag}
    while links[-1].meta.parent_tag is not None:
        child = links[-1]
        parent_tag = child.meta.parent_tag
        assert parent_tag is not None
        if parent_tag in seen or len(links) > MAX_CHAIN_DEPTH * 4:
            raise SnapshotCorrupt(child.tag, child.path, "its chain of parents loops")
        try:
            parent = store.get(parent_tag)
        except SnapshotNotFound:
            raise SnapshotCorrupt(child.tag, child.path, f"its parent {parent_tag!r} is "
                                  "missing", remedy="compact it or delete it") from None
        if (child.meta.parent_content_hash is not None and parent.meta.content_hash is not None
                and child.meta.parent_content_hash != parent.meta.content_hash):
            raise SnapshotCorrupt(child.tag, child.path, f"the snapshot tagged {parent_tag!r} "
                                  "is not the parent it was built on",
                                  remedy="compact it or delete it")
        seen.add(parent_tag)
        links.append(parent)
    links.reverse()
    return links


def check_depth_for_child(store: Store, parent_tag: str) -> int:
    """The depth a new link on ``parent_tag`` would have; ``ChainTooDeep`` past the limit."""
    depth = len(chain_of(store, parent_tag))
    if depth > MAX_CHAIN_DEPTH:
        raise ChainTooDeep(parent_tag, depth - 1)
    return depth


def snapshot_info(store: Store, tag: str) -> dict[str, Any]:
    """``GET /v1/snapshots/:tag/info`` (forkd's fields and ours). Bytes: ``logical`` is
    the files' lengths, ``physical`` the blocks they occupy, ``unique`` the blocks only
    this snapshot holds (not hard-linked into another one): what deleting it frees."""
    links = chain_of(store, tag)
    snap = links[-1]
    children = store.dependents_map()
    descendants: list[str] = []
    frontier = list(children.get(snap.tag, []))
    while frontier:
        t = frontier.pop(0)
        if t not in descendants:
            descendants.append(t)
            frontier.extend(children.get(t, []))
    usage = disk_usage(snap)
    files = {f.name: f for f in usage.files}
    unique = 0
    for name in files:
        st = os.lstat(snap.path / name)
        if st.st_nlink == 1:
            unique += st.st_blocks * 512
    layer = files.get(LAYER_FILE) if snap.layer_path is not None else None
    meta = snap.meta
    return {
        "tag": snap.tag, "dir": str(snap.path), "created_at_unix": int(meta.created_at_unix),
        "status": "ready", "bootable": True,
        "memory_logical_bytes": files[MEMORY_FILE].logical_bytes if MEMORY_FILE in files else 0,
        "memory_physical_bytes": files[MEMORY_FILE].physical_bytes if MEMORY_FILE in files
        else 0,
        "vmstate_bytes": files[STATE_FILE].logical_bytes if STATE_FILE in files else 0,
        "parent_tag": meta.parent_tag, "parent_content_hash": meta.parent_content_hash,
        "content_hash": meta.content_hash, "chain_depth": len(links) - 1,
        "ancestors": [s.tag for s in links[:-1]], "dependents": children.get(snap.tag, []),
        "descendants": descendants,
        "layer_bytes": layer.logical_bytes if layer else 0,
        "logical_bytes": usage.logical_bytes, "physical_bytes": usage.physical_bytes,
        "unique_bytes": unique,
        "orphaned_from": (meta.extra.get("orphaned_from") or {}).get("tag"),
        "mem_mib": meta.mem_mib, "vcpus": meta.vcpus, "image": meta.image,
        "warm_up": meta.warm_up, "branch_mode": meta.branch_mode,
        "branched_from": meta.branched_from,
    }


@dataclass(frozen=True)
class FileCheck:
    tag: str
    name: str
    status: str           # ok | mismatch | missing | unhashed
    detail: str = ""


def verify(store: Store, tag: str | None = None) -> list[FileCheck]:
    """Re-hash the files of ``tag`` (or of every snapshot) and compare with the hashes
    recorded when they entered the store. ``unhashed`` marks files for which nothing
    was recorded (snapshots from before hashes were kept; a diff head's memory.bin,
    which is derived from its verified parent and layer)."""
    snapshots = [store.get(tag)] if tag is not None else store.list()
    checks: list[FileCheck] = []
    for snap in snapshots:
        recorded = dict(snap.meta.file_hashes)
        own = [r for r in snap.meta.memory_layers if r.tag == snap.tag]
        if own and snap.layer_path is not None:
            recorded.setdefault(LAYER_FILE, own[-1].content_hash)
        for name in (STATE_FILE, MEMORY_FILE, LAYER_FILE):
            path = snap.path / name
            want = recorded.get(name)
            if want is None:
                if name != LAYER_FILE or snap.layer_path is not None:
                    checks.append(FileCheck(snap.tag, name, "unhashed"))
                continue
            if not path.is_file():
                checks.append(FileCheck(snap.tag, name, "missing", str(path)))
                continue
            got = hash_memory(path) if name == MEMORY_FILE else hash_file(path)
            if own and name == LAYER_FILE and own[-1].content_hash != want:
                checks.append(FileCheck(snap.tag, name, "mismatch",
                                        "meta.json's layer list and file hashes disagree"))
            elif got == want:
                checks.append(FileCheck(snap.tag, name, "ok", got))
            else:
                checks.append(FileCheck(snap.tag, name, "mismatch",
                                        f"recorded {want}, now {got}"))
    return checks


def _flat_meta(source: SnapshotMeta, tag: str, state_hash: str, memory_hash: str,
               **extra: Any) -> SnapshotMeta:
    return dataclasses.replace(
        source, tag=tag, parent_tag=None, root_tag=None, memory_layers=[],
        parent_content_hash=None,
        content_hash=snapshot_content_hash(state_hash, memory_hash, None),
        file_hashes={STATE_FILE: state_hash, MEMORY_FILE: memory_hash},
        extra={**{k: v for k, v in source.extra.items() if k != "orphaned_from"}, **extra})


def compact(store: Store, source_tag: str, new_tag: str) -> Snapshot:
    """Publish ``new_tag``: a flat snapshot with the memory and state of ``source_tag``
    (any depth). Written into a pending directory, fsynced, renamed into place: the
    tag appears complete or not at all."""
    source = store.get(validate_tag(source_tag))
    with store.begin(new_tag) as pending:
        shutil.copyfile(source.state_path, pending.state_path)
        with open(source.memory_path, "rb", buffering=0) as src:
            size = os.fstat(src.fileno()).st_size
            fd = os.open(pending.memory_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | os.O_CLOEXEC, 0o644)
            try:
                os.ftruncate(fd, size)
                layerfile.copy_sparse(src.fileno(), fd, size)
            finally:
                os.close(fd)
        meta = _flat_meta(source.meta, pending.tag, hash_file(pending.state_path),
                          hash_memory(pending.memory_path),
                          compacted_from={"tag": source.tag,
                                          "content_hash": source.meta.content_hash})
        return pending.publish(dataclasses.replace(
            meta, branched_from=f"compact:{source.tag}", branch_mode=None))


def publish_link(pending: PendingSnapshot, parent: Snapshot, meta: SnapshotMeta, *,
                 expect_content_hash: str | None = None) -> Snapshot:
    """Publish a diff snapshot whose ``state.bin`` and ``layer.bin`` are in ``pending``:
    resolve its ``memory.bin`` from ``parent`` and record the chain in its meta. The
    layer's index is validated (a hostile layer cannot write outside guest RAM).
    ``expect_content_hash``: refuse (``StoreError``) unless the link's content hash,
    which covers its parent's, comes out as this (an unpacked link)."""
    check_depth_for_child(pending.store, parent.tag)
    state_hash = hash_file(pending.state_path)
    layer_hash = hash_file(pending.layer_path)
    content_hash = snapshot_content_hash(state_hash, layer_hash, parent.meta.content_hash)
    if expect_content_hash is not None and content_hash != expect_content_hash:
        raise StoreError(f"snapshot {pending.tag!r}: its content hash {content_hash} is not "
                         f"the recorded {expect_content_hash} (its parent {parent.tag!r} is "
                         "not the snapshot it was built on)", tag=pending.tag)
    with open(pending.layer_path, "rb", buffering=0) as f:
        index = layerfile.read_layer_index(f.fileno())
    materialise_head(parent.memory_path, pending.layer_path, pending.memory_path)
    ref = LayerRef(pending.tag, layer_hash, index.data_bytes, index.pages)
    return pending.publish(dataclasses.replace(
        meta, tag=pending.tag, parent_tag=parent.tag,
        root_tag=parent.meta.root_tag or parent.tag,
        memory_layers=[*parent.meta.memory_layers, ref],
        parent_content_hash=parent.meta.content_hash, content_hash=content_hash,
        file_hashes={STATE_FILE: state_hash, LAYER_FILE: layer_hash}))


def publish_root(pending: PendingSnapshot, meta: SnapshotMeta, *,
                 keep_content_hash: bool = False) -> Snapshot:
    """Publish a flat snapshot whose ``state.bin`` and ``memory.bin`` are in ``pending``,
    hashing both; its content hash is derived from the two, unless ``keep_content_hash``
    (an unpacked root keeps ``meta.content_hash``, even none, because its dependents'
    hashes were derived from it)."""
    state_hash = hash_file(pending.state_path)
    memory_hash = hash_memory(pending.memory_path)
    content_hash = (meta.content_hash if keep_content_hash
                    else snapshot_content_hash(state_hash, memory_hash, None))
    return pending.publish(dataclasses.replace(
        meta, tag=pending.tag, parent_tag=None, root_tag=None, memory_layers=[],
        parent_content_hash=None, content_hash=content_hash,
        file_hashes={STATE_FILE: state_hash, MEMORY_FILE: memory_hash}))
