"""Chains of diff snapshots: walk, inspect, verify, compact, and publish a link.

A chain is followed through ``meta.parent_tag`` (checked against the parent's
content hash). Each link's own data is its ``layer.bin``; the root's is its
``memory.bin``. A link's memory is its ``memory.plan`` (``vmfork.store.layers``,
``vmfork.ondisk.memplan``), computed here once when the link is published, over the
nearest snapshot below it that has a ``memory.bin`` (the root, or a head that
was materialised because its plan was over the VMA budget); children map that
plan, so none of this runs on a spawn. ``make_standalone`` and ``replan`` keep
every snapshot spawnable when an ancestor is deleted with ``force``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmfork.ondisk import layerfile, memplan
from vmfork.ondisk.durable import fsync_dir
from vmfork.store.errors import SnapshotCorrupt, SnapshotNotFound, StoreError
from vmfork.store.layers import (
    LAYER_FILE,
    PLAN_FILE,
    PlanInput,
    build_plan,
    hash_file,
    hash_memory,
    materialise,
    snapshot_content_hash,
    write_plan,
)
from vmfork.store.meta import (
    MEMORY_SOURCE_FILE,
    MEMORY_SOURCE_PLAN,
    META_FORMAT_VERSION,
    LayerRef,
    SnapshotMeta,
    SnapshotSizes,
)
from vmfork.store.store import (
    MEMORY_FILE,
    STATE_FILE,
    PendingSnapshot,
    Snapshot,
    Store,
    disk_usage,
)
from vmfork.store.tags import validate_tag
from vmfork.vmm.memory import PAGE_SIZE

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
    this snapshot holds (not hard-linked into another one): what deleting it frees.
    All count this snapshot's own directory: a link's memory is mapped from its
    ancestors' files (``memory_mapping``), which it does not hold; ``changed_bytes``
    is the pages its own layer changed."""
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
    own_layer = meta.memory_layers[-1] if snap.layer_path is not None else None
    return {
        "tag": snap.tag, "dir": str(snap.path), "created_at_unix": int(meta.created_at_unix),
        "status": "ready", "bootable": True,
        "memory_logical_bytes": meta.sizes.memory_logical_bytes,
        "memory_physical_bytes": files[MEMORY_FILE].physical_bytes if MEMORY_FILE in files
        else 0,
        "memory_mapping": _mapping_info(snap),
        "vmstate_bytes": files[STATE_FILE].logical_bytes if STATE_FILE in files else 0,
        "parent_tag": meta.parent_tag, "parent_content_hash": meta.parent_content_hash,
        "content_hash": meta.content_hash, "chain_depth": len(links) - 1,
        "ancestors": [s.tag for s in links[:-1]], "dependents": children.get(snap.tag, []),
        "descendants": descendants,
        "layer_bytes": layer.logical_bytes if layer else 0,
        "changed_bytes": own_layer.pages * PAGE_SIZE if own_layer else 0,
        "logical_bytes": usage.logical_bytes, "physical_bytes": usage.physical_bytes,
        "unique_bytes": unique,
        "orphaned_from": (meta.extra.get("orphaned_from") or {}).get("tag"),
        "mem_mib": meta.mem_mib, "vcpus": meta.vcpus, "image": meta.image,
        "warm_up": meta.warm_up, "branch_mode": meta.branch_mode,
        "branched_from": meta.branched_from,
    }


def _mapping_info(snap: Snapshot) -> dict[str, Any]:
    """How a child maps this snapshot's memory: ``plan`` (its chain's files, layer over
    layer: ``runs`` mappings over ``files`` files) or ``file`` (one memory.bin; for a
    link, ``materialised`` says why its plan was not used)."""
    recorded = snap.meta.extra.get("memory_mapping")
    info: dict[str, Any] = dict(recorded) if isinstance(recorded, dict) else {}
    info["kind"] = "plan" if snap.is_layered else "file"
    return info


@dataclass(frozen=True)
class FileCheck:
    tag: str
    name: str
    status: str           # ok | mismatch | missing | unhashed
    detail: str = ""


def verify(store: Store, tag: str | None = None) -> list[FileCheck]:
    """Re-hash the files of ``tag`` (or of every snapshot) and compare with the hashes
    recorded when they entered the store. ``unhashed`` marks files for which nothing
    was recorded (snapshots from before hashes were kept; a diff head materialised
    over the VMA budget, whose memory.bin is derived from its verified chain). A
    layered snapshot's ``memory.plan`` is checked against the files it maps
    (``check_plan``: their owners' tags, content hashes and sizes)."""
    snapshots = [store.get(tag)] if tag is not None else store.list()
    checks: list[FileCheck] = []
    for snap in snapshots:
        recorded = dict(snap.meta.file_hashes)
        own = [r for r in snap.meta.memory_layers if r.tag == snap.tag]
        if own and snap.layer_path is not None:
            recorded.setdefault(LAYER_FILE, own[-1].content_hash)
        if snap.is_layered:
            try:
                check_plan(store, snap)
                checks.append(FileCheck(snap.tag, PLAN_FILE, "ok"))
            except SnapshotCorrupt as err:
                checks.append(FileCheck(snap.tag, PLAN_FILE, "mismatch", str(err)))
        names = (STATE_FILE, LAYER_FILE) if snap.is_layered else (STATE_FILE, MEMORY_FILE,
                                                                   LAYER_FILE)
        for name in names:
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
        parent_content_hash=None, memory_source=MEMORY_SOURCE_FILE,
        content_hash=snapshot_content_hash(state_hash, memory_hash, None),
        file_hashes={STATE_FILE: state_hash, MEMORY_FILE: memory_hash},
        extra={**{k: v for k, v in source.extra.items()
                  if k not in ("orphaned_from", "memory_mapping")}, **extra})


def compact(store: Store, source_tag: str, new_tag: str) -> Snapshot:
    """Publish ``new_tag``: a flat snapshot with the memory and state of ``source_tag``
    (any depth; a layered one's plan is materialised into one memory.bin). Written
    into a pending directory, fsynced, renamed into place: the tag appears complete
    or not at all."""
    source = store.get(validate_tag(source_tag))
    with store.begin(new_tag) as pending:
        shutil.copyfile(source.state_path, pending.state_path)
        if source.is_layered:
            check_plan(store, source)
            plan = memplan.read_plan(str(source.plan_path))
            materialise(plan, [Path(plan.source_path(i)) for i in range(len(plan.sources))],
                        pending.memory_path)
        else:
            with open(source.memory_path, "rb", buffering=0) as src:
                size = os.fstat(src.fileno()).st_size
                fd = os.open(pending.memory_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                             | os.O_CLOEXEC, 0o600)
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


def _plan_over(links: list[Snapshot], head: PlanInput) -> memplan.MemoryPlan:
    """The plan of ``head`` (a layer) on the chain ``links`` (root to parent): over the
    nearest snapshot of the chain that has a memory.bin, with every layer above it."""
    base_at = max(i for i, link in enumerate(links) if not link.is_layered)
    base = links[base_at]
    layers = []
    for link in links[base_at + 1:]:
        if link.layer_path is None:
            raise SnapshotCorrupt(link.tag, link.path, "it maps its memory through a plan but "
                                  "has no layer of its own", remedy="delete it")
        layers.append(PlanInput(f"{link.tag}/{LAYER_FILE}", link.layer_path,
                                link.meta.content_hash, link.meta.file_hashes.get(LAYER_FILE)))
    return build_plan(PlanInput(f"{base.tag}/{MEMORY_FILE}", base.memory_path,
                                base.meta.content_hash, base.meta.file_hashes.get(MEMORY_FILE)),
                      [*layers, head])


def _source_paths(store: Store, plan: memplan.MemoryPlan, head: PlanInput) -> list[Path]:
    return [head.path if source.path == head.store_path else store.snapshots_dir / source.path
            for source in plan.sources]


def _resolve_memory(store: Store, directory: Path, links: list[Snapshot],
                    head: PlanInput) -> tuple[str, dict[str, Any]]:
    """Write the memory of ``head`` on ``links`` into ``directory`` (a pending snapshot,
    or a published one being re-based): its plan, or -- over the VMA budget -- the
    chain materialised into memory.bin. Returns the meta's memory_source and what
    snapshot-info reports about it. The file is written under a temporary name and
    renamed into place."""
    started = time.monotonic()
    plan = _plan_over(links, head)
    if len(plan.runs) <= memplan.MAX_RUNS:
        temp = directory / f".{PLAN_FILE}.{secrets.token_hex(8)}"
        write_plan(plan, temp)
        os.rename(temp, directory / PLAN_FILE)
        fsync_dir(directory)
        return MEMORY_SOURCE_PLAN, {"memory_mapping": {
            "runs": len(plan.runs), "files": len(plan.sources),
            "resolve_ms": (time.monotonic() - started) * 1000}}
    temp = directory / f".{MEMORY_FILE}.{secrets.token_hex(8)}"
    try:
        materialise(plan, _source_paths(store, plan, head), temp)
        os.rename(temp, directory / MEMORY_FILE)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_dir(directory)
    return MEMORY_SOURCE_FILE, {"memory_mapping": {
        "runs": len(plan.runs), "files": len(plan.sources),
        "resolve_ms": (time.monotonic() - started) * 1000,
        "materialised": f"its plan needs {len(plan.runs)} mappings, over the budget of "
                        f"{memplan.MAX_RUNS}: its chain was copied into its own memory.bin "
                        "once, at publish"}}


def publish_link(pending: PendingSnapshot, parent: Snapshot, meta: SnapshotMeta, *,
                 expect_content_hash: str | None = None) -> Snapshot:
    """Publish a diff snapshot whose ``state.bin`` and ``layer.bin`` are in ``pending``:
    compute its memory plan over ``parent``'s chain (or materialise it, over the VMA
    budget) and record the chain in its meta. The layer's index is validated (a
    hostile layer cannot map outside guest RAM). ``expect_content_hash``: refuse
    (``StoreError``) unless the link's content hash, which covers its parent's,
    comes out as this (an unpacked link)."""
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
    links = chain_of(pending.store, parent.tag)
    source, mapping = _resolve_memory(
        pending.store, pending.path, links,
        PlanInput(f"{pending.tag}/{LAYER_FILE}", pending.layer_path, content_hash, layer_hash))
    ref = LayerRef(pending.tag, layer_hash, index.data_bytes, index.pages)
    return pending.publish(dataclasses.replace(
        meta, tag=pending.tag, parent_tag=parent.tag,
        root_tag=links[0].tag,
        memory_layers=[*parent.meta.memory_layers, ref], memory_source=source,
        parent_content_hash=parent.meta.content_hash, content_hash=content_hash,
        file_hashes={STATE_FILE: state_hash, LAYER_FILE: layer_hash},
        extra={**meta.extra, **mapping}))


def make_standalone(store: Store, tag: str, parent_tag: str) -> Snapshot:
    """Turn the link ``tag`` into a flat snapshot (``rmi --force`` of its parent): its
    chain is materialised into its own memory.bin (unless it already has one), then its
    meta.json is rewritten atomically without the parent, then its plan and layer go.
    The caller holds the chains lock and the tag's lock. A crash part-way leaves a
    spawnable snapshot (the plan stays valid until the parent is deleted, after this)."""
    snap = store.get(tag)
    if snap.is_layered:
        plan = memplan.read_plan(str(snap.plan_path))
        temp = snap.path / f".{MEMORY_FILE}.{secrets.token_hex(8)}"
        try:
            materialise(plan, [Path(plan.source_path(i)) for i in range(len(plan.sources))],
                        temp)
            os.rename(temp, snap.memory_path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        fsync_dir(snap.path)
    memory_hash = snap.meta.file_hashes.get(MEMORY_FILE) or hash_memory(snap.memory_path)
    st = os.stat(snap.memory_path)
    meta = snap.meta
    snap = store.rewrite_meta(snap, dataclasses.replace(
        meta, parent_tag=None, root_tag=None, memory_layers=[], parent_content_hash=None,
        memory_source=MEMORY_SOURCE_FILE, format_version=META_FORMAT_VERSION,
        file_hashes={STATE_FILE: meta.file_hashes.get(STATE_FILE) or hash_file(snap.state_path),
                     MEMORY_FILE: memory_hash},
        sizes=SnapshotSizes(memory_logical_bytes=st.st_size,
                            memory_physical_bytes=st.st_blocks * 512,
                            state_bytes=meta.sizes.state_bytes),
        extra={**{k: v for k, v in meta.extra.items() if k != "memory_mapping"},
               "orphaned_from": {"tag": parent_tag, "content_hash": meta.parent_content_hash}}))
    # No longer part of its meta; a crash before these unlinks leaves unlisted files.
    for name in (PLAN_FILE, LAYER_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(snap.path / name)
    return snap


def replan(store: Store, tag: str) -> Snapshot:
    """Recompute the memory of the link ``tag`` over its chain as it is now (after an
    ancestor was made standalone) and trim its meta's chain to match. The caller holds
    the chains lock and the tag's lock. The new plan replaces the old one atomically;
    both are valid until the old ancestor is deleted, after this."""
    links = chain_of(store, tag)
    snap = links[-1]
    meta = snap.meta
    in_chain = {link.tag for link in links[1:]}
    changes: dict[str, Any] = {
        "root_tag": links[0].tag,
        "memory_layers": [r for r in meta.memory_layers if r.tag in in_chain]}
    source = meta.memory_source
    if snap.is_layered:
        own = snap.layer_path
        assert own is not None
        source, mapping = _resolve_memory(store, snap.path, links[:-1], PlanInput(
            f"{tag}/{LAYER_FILE}", own, meta.content_hash, meta.file_hashes.get(LAYER_FILE)))
        changes["extra"] = {**meta.extra, **mapping}
        if source == MEMORY_SOURCE_FILE:     # over the budget now: materialised
            changes.update(memory_source=source, format_version=META_FORMAT_VERSION,
                           sizes=dataclasses.replace(meta.sizes, memory_physical_bytes=os.stat(
                               snap.memory_path).st_blocks * 512))
    snap = store.rewrite_meta(snap, dataclasses.replace(meta, **changes))
    if source == MEMORY_SOURCE_FILE:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(snap.plan_path)
    return snap


def check_plan(store: Store, snap: Snapshot) -> None:
    """``SnapshotCorrupt`` unless every file ``snap``'s plan maps is still the one it
    was computed from: the snapshot holding it exists under that tag with the
    content hash and file hash the plan recorded, and the file has its size. Reads
    metadata only (no guest memory): cheap enough for every spawn."""
    if not snap.is_layered:
        return
    try:
        plan = memplan.read_plan(str(snap.plan_path))
    except memplan.PlanError as err:
        raise SnapshotCorrupt(snap.tag, snap.path, str(err), remedy="delete it") from None
    for source in plan.sources:
        why = None
        try:
            owner = store.get(source.owner_tag)
        except (SnapshotNotFound, SnapshotCorrupt) as err:
            owner, why = None, f"that snapshot is gone or damaged ({err})"
        if owner is not None:
            name = source.path.split("/", 1)[1]
            recorded = owner.meta.file_hashes.get(name)
            path = owner.path / name
            if owner.meta.content_hash != source.owner_content_hash or (
                    source.file_hash is not None and recorded is not None
                    and recorded != source.file_hash):
                why = "that tag now names another snapshot"
            elif not path.is_file() or path.stat().st_size != source.size:
                why = f"the file is missing or not {source.size} bytes"
        if why is not None:
            raise SnapshotCorrupt(snap.tag, snap.path, f"its memory plan maps {source.path}, "
                                  f"but {why}", remedy="compact it from a backup, or delete it")


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
