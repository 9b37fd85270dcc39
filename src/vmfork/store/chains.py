"""Chains of diff snapshots: inspect, verify and compact them.

A chain is followed through ``meta.parent_tag`` (checked against the parent's
content hash; ``store.chain_of``). Each link's own data is its ``layer.bin``; the
root's is its ``memory.bin``. A link's memory is its ``memory.plan``
(``vmfork.store.layers``, ``vmfork.ondisk.memplan``), computed once when the link
is published (``PendingSnapshot.publish``, the store's one publish path), over the
nearest snapshot below it that has a ``memory.bin`` (the root, or a head that was
materialised because its plan was over the VMA budget); children map that plan, so
none of this runs on a spawn. ``store.make_standalone`` and ``store.replan`` keep
every snapshot spawnable when an ancestor is deleted with ``force``. Those, the
chain walk and the depth limit live in ``vmfork.store.store``, which needs them to
publish and delete; this module builds on it (never the other way round).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmfork.ondisk import layerfile, memplan
from vmfork.ondisk.layerfile import PAGE_SIZE
from vmfork.store.errors import SnapshotCorrupt, SnapshotNotFound
from vmfork.store.layers import (
    LAYER_FILE,
    PLAN_FILE,
    hash_file,
    hash_memory,
    materialise,
)
from vmfork.store.meta import MEMORY_SOURCE_FILE, SnapshotMeta
from vmfork.store.store import (
    MEMORY_FILE,
    STATE_FILE,
    Snapshot,
    Store,
    chain_of,
    disk_usage,
)
from vmfork.store.tags import validate_tag


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
        "changed_bytes": changed_pages(meta) * PAGE_SIZE if own_layer else 0,
        "logical_bytes": usage.logical_bytes, "physical_bytes": usage.physical_bytes,
        "unique_bytes": unique,
        "orphaned_from": (meta.extra.get("orphaned_from") or {}).get("tag"),
        "mem_mib": meta.mem_mib, "vcpus": meta.vcpus, "image": meta.image,
        "warm_up": meta.warm_up, "branch_mode": meta.branch_mode,
        "branched_from": meta.branched_from,
    }


def changed_pages(meta: SnapshotMeta) -> int:
    """The pages a link's own layer changed: what its capture counted (``changed_pages``
    in ``extra``: the layer's pages that differ from its base), else the pages its layer
    holds, which may be up to 5% more: the unchanged pages of the small gaps its runs
    were merged across (``vmm.dirty.coalesced``)."""
    counted = meta.extra.get("changed_pages")
    layer = meta.memory_layers[-1].pages if meta.memory_layers else 0
    if isinstance(counted, int) and not isinstance(counted, bool) and 0 <= counted <= layer:
        return counted
    return layer


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
        # A root: publish derives its hashes and content hash from the new files.
        extra = {k: v for k, v in source.meta.extra.items()
                 if k not in ("orphaned_from", "memory_mapping")}
        return pending.publish(dataclasses.replace(
            source.meta, tag=pending.tag, memory_source=MEMORY_SOURCE_FILE,
            branched_from=f"compact:{source.tag}", branch_mode=None, extra={**extra, "compacted_from": {
                "tag": source.tag, "content_hash": source.meta.content_hash}}))


_Identity = tuple[int, int, int, int, int]
"""``st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns``."""

# ``check_plan``'s passes, by plan file: the identities of the files it read to pass
# (the plan, and each source's meta.json and file). A spawn whose files all still
# have them passes again on 1 + 2 x sources stats, without reading the plan and
# every owner's meta.json again: that read was 13-25 ms of a depth-1 to depth-5
# spawn in the emulated test host (design notes, "A chain spawn read its chain
# again"). Bounded; a miss is only the full check.
_CHECKED_PLANS_KEPT = 256
_checked_plans: OrderedDict[str, tuple[tuple[str, ...], tuple[_Identity, ...]]] = OrderedDict()
_checked_lock = threading.Lock()
# A pass is kept only once every file it read is older than this, in seconds: a file
# replaced within the file system's timestamp granularity of the pass (coarse, a few
# ms) by one of the same size could otherwise reuse the inode and read as unchanged
# (git's "racily clean" entries). Every later change gets a newer ctime.
_SETTLED_S = 2.0


def check_plan(store: Store, snap: Snapshot) -> None:
    """``SnapshotCorrupt`` unless every file ``snap``'s plan maps is still the one it
    was computed from: the snapshot holding it exists under that tag with the
    content hash and file hash the plan recorded, and the file has its size. Reads
    metadata only (no guest memory), and only stats on a plan that passed before
    and whose files are unchanged since: cheap enough for every spawn."""
    if not snap.is_layered:
        return
    plan_path = str(snap.plan_path)
    with _checked_lock:
        passed = _checked_plans.get(plan_path)
    if passed is not None and _identities(passed[0]) == passed[1]:
        return
    try:
        plan = memplan.read_plan(plan_path)
    except memplan.PlanError as err:
        raise SnapshotCorrupt(snap.tag, snap.path, str(err), remedy="delete it") from None
    read = [plan_path]
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
            read += [str(owner.meta_path), str(path)]
            if owner.meta.content_hash != source.owner_content_hash or (
                    source.file_hash is not None and recorded is not None
                    and recorded != source.file_hash):
                why = "that tag now names another snapshot"
            elif not path.is_file() or path.stat().st_size != source.size:
                why = f"the file is missing or not {source.size} bytes"
        if why is not None:
            raise SnapshotCorrupt(snap.tag, snap.path, f"its memory plan maps {source.path}, "
                                  f"but {why}", remedy="compact it from a backup, or delete it")
    paths = tuple(read)
    identities = _identities(paths)
    settled = time.time_ns() - int(_SETTLED_S * 1e9)
    if identities is not None and all(i[4] < settled for i in identities):
        with _checked_lock:
            _checked_plans.pop(plan_path, None)
            _checked_plans[plan_path] = (paths, identities)
            while len(_checked_plans) > _CHECKED_PLANS_KEPT:
                _checked_plans.popitem(last=False)


def _identities(paths: tuple[str, ...]) -> tuple[_Identity, ...] | None:
    """The ``_Identity`` of each of ``paths``; None if one cannot be stat'ed."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            return None
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


