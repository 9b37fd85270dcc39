"""Snapshots: list, create (boot, warm, capture), info, compact, pack, delete."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmfork.server.controller.core import Core, Part
from vmfork.server.errors import ApiError, BadGateway, BadRequest, Conflict, NotFound
from vmfork.server.registry import FAILED, WRITING
from vmfork.server.requests import SnapshotCreate
from vmfork.store import (
    Snapshot,
    SnapshotCorrupt,
    SnapshotNotFound,
    Store,
    StoreError,
    TagBusy,
    TagExists,
    chains,
)
from vmfork.store.errors import HasDependents

log = logging.getLogger(__name__)

SnapshotMaker = Callable[[Store, SnapshotCreate], Snapshot]
"""Boots, warms and snapshots a parent (``runtime.parent.snapshot_parent`` in the
daemon; a fake in unit tests). Gets the store and the request."""


def snapshot_json(snap: Snapshot) -> dict[str, Any]:
    """forkd's ``SnapshotInfo`` of a ready snapshot."""
    meta = snap.meta
    info: dict[str, Any] = {
        "tag": snap.tag, "dir": str(snap.path), "created_at_unix": int(meta.created_at_unix),
        "status": "ready", "bootable": True,
        "image": meta.image, "mem_mib": meta.mem_mib, "vcpus": meta.vcpus,
        "warm_up": meta.warm_up}
    branched_from = (meta.branched_from or meta.extra.get("branched_from")
                     or meta.parent_tag)
    if branched_from is not None:
        info["branched_from"] = branched_from
    if meta.parent_tag is not None:
        info["parent_tag"] = meta.parent_tag
    branch_mode = meta.branch_mode or meta.extra.get("branch_mode")
    if branch_mode:
        info["branch_mode"] = branch_mode
    if meta.timings.pause_ms is not None:
        info["pause_ms"] = round(meta.timings.pause_ms, 3)
    if meta.extra.get("network"):
        info["network"] = True  # its sandboxes can be spawned with per_child_netns
    if "volume_slots" in meta.extra:   # a parent's (a BRANCH keeps its parent's slots)
        info["volume_slots"] = meta.extra["volume_slots"]
        info["volumes"] = [{"guest_path": v["guest_path"], "mode": "ro", "key": v["key"],
                            "source": v["source"]}
                           for v in meta.extra.get("volumes", [])]
    return info


class Snapshots(Part):
    """Ready snapshots are the store's; those being written or that failed are
    the registry's snapshot jobs, listed beside them."""

    def __init__(self, core: Core, make_snapshot: SnapshotMaker | None) -> None:
        super().__init__(core)
        self.make_snapshot = make_snapshot

    def snapshot_counts(self) -> dict[str, int]:
        counts = {"ready": 0, WRITING: 0, FAILED: 0}
        ready = {s.tag for s in self.store.list()}
        counts["ready"] = len(ready)
        for job in self.registry.list_snapshot_jobs():
            if job.tag not in ready:
                counts[job.status] = counts.get(job.status, 0) + 1
        return counts


    def list_snapshots(self) -> list[dict[str, Any]]:
        # Jobs first, the store second: a job publishes its snapshot before it is
        # marked finished, so one that finishes between the two reads is in the store
        # by the second. In the other order it could be in neither (seen: a wait:false
        # BRANCH that completed mid-listing was missing from the list).
        jobs = self.registry.list_snapshot_jobs()
        out = [snapshot_json(s) for s in self.store.list()]
        ready = {i["tag"] for i in out}
        for job in jobs:
            if job.tag in ready:
                continue
            entry: dict[str, Any] = {
                "tag": job.tag, "dir": str(self.store.snapshots_dir / job.tag),
                "created_at_unix": int(job.started_at), "status": job.status,
                "bootable": False}
            if job.error:
                entry["error"] = job.error
            out.append(entry)
        return sorted(out, key=lambda i: str(i["tag"]))

    def snapshot_info(self, tag: str) -> dict[str, Any]:
        self.core.ready_snapshot(tag)
        try:
            return chains.snapshot_info(self.store, tag)
        except SnapshotNotFound as err:
            raise NotFound(str(err)) from err
        except SnapshotCorrupt as err:
            raise Conflict(str(err)) from err

    def compact_snapshot(self, tag: str, to: str) -> dict[str, Any]:
        """Publish ``to``: ``tag``'s chain as one flat snapshot (atomically)."""
        self.core.ready_snapshot(tag)
        if self.store.exists(to):
            raise Conflict(f"snapshot tag {to!r} already exists; choose another tag or delete "
                           f"it first (DELETE /v1/snapshots/{to})")
        with self.core.heavy_slot(f"compact snapshot {tag!r}"):
            try:
                snap = chains.compact(self.store, tag, to)
            except (TagExists, TagBusy) as err:
                raise Conflict(str(err)) from err
            except SnapshotNotFound as err:
                raise NotFound(str(err)) from err
            except SnapshotCorrupt as err:
                raise Conflict(str(err)) from err
            except (StoreError, OSError) as err:
                raise BadGateway(f"compacting {tag!r} into {to!r} failed: {err}") from err
        return snapshot_json(snap)

    def pack_snapshot(self, tag: str, *, with_image: bool) -> Path:
        """``tag``'s chain (and its image) as a pack in a private temporary file of the
        store's, which the caller streams and removes. A heavy operation: compression
        takes a core for as long as the chain is large."""
        from vmfork.store import packs
        self.core.ready_snapshot(tag)
        with self.core.heavy_slot(f"pack snapshot {tag!r}"):
            scratch = self.store.root / "pack-downloads"
            scratch.mkdir(mode=0o700, exist_ok=True)
            # A download whose client went before the first byte leaves its file:
            # what is older than an hour is such a leftover.
            for old in scratch.iterdir():
                with contextlib.suppress(OSError):
                    if time.time() - old.lstat().st_mtime > 3600:
                        old.unlink()
            out = scratch / f"{tag}.{secrets.token_hex(8)}.tar.zst"
            try:
                packs.pack(self.store, tag, out, with_image=with_image)
            except SnapshotNotFound as err:
                raise NotFound(str(err)) from err
            except (SnapshotCorrupt, packs.PackError) as err:
                raise Conflict(f"cannot pack {tag!r}: {err}") from err
            except (StoreError, OSError) as err:
                raise BadGateway(f"packing {tag!r} failed: {err}") from err
        return out

    def create_snapshot(self, request: SnapshotCreate) -> dict[str, Any]:
        tag = request.tag
        if self.make_snapshot is None:
            raise BadGateway("this daemon cannot boot parents (started without a guest "
                             "image); create the snapshot with `vmfork snapshot` instead")
        if self.store.exists(tag):
            raise BadRequest(f"snapshot tag {tag!r} already exists; choose another tag or "
                             f"delete it first (DELETE /v1/snapshots/{tag})")
        with self.core.heavy_slot(f"create snapshot {tag!r}"):
            if not self.registry.begin_snapshot_job(tag, os.getpid()):
                raise Conflict(f"snapshot {tag!r} is already being written; wait for it")
            try:
                snap = self.make_snapshot(self.store, request)
            except (TagExists, TagBusy) as err:
                self.registry.finish_snapshot_job(tag, str(err))
                self.registry.forget_snapshot_job(tag)
                raise Conflict(str(err)) from err
            except ApiError as err:
                self.registry.finish_snapshot_job(tag, err.message)
                if err.status < 500:  # refused before anything started: nothing to show
                    self.registry.forget_snapshot_job(tag)
                raise
            except Exception as err:
                self.registry.finish_snapshot_job(tag, f"{type(err).__name__}: {err}")
                raise BadGateway(f"creating snapshot {tag!r} failed: {err}") from err
            self.registry.finish_snapshot_job(tag, None)
        return snapshot_json(snap)

    def delete_snapshot(self, tag: str, cascade: bool, force: bool) -> None:
        if cascade and force:
            raise BadRequest("pass cascade=true or force=true, not both: cascade deletes the "
                             "snapshots built on this one, force leaves them orphaned")
        job = self.registry.get_snapshot_job(tag)
        if job is not None and job.status == WRITING:
            raise Conflict(f"snapshot {tag!r} is being written; wait until it is ready or "
                           "failed, then delete it")
        for record in self.registry.list_sandboxes():
            if record.paused_tag == tag:
                raise Conflict(f"snapshot {tag!r} is what sandbox {record.id} "
                               f"({record.status}) resumes or runs from; it goes when that "
                               f"sandbox is deleted (DELETE /v1/sandboxes/{record.id})")
        try:
            deleted = self.store.delete(tag, cascade=cascade, force=force)
        except SnapshotNotFound as err:
            if job is not None and self.registry.forget_snapshot_job(tag):
                return
            raise NotFound(str(err)) from err
        except HasDependents as err:
            raise Conflict(str(err), extra={"dependents": err.dependents}) from err
        except TagBusy as err:
            raise Conflict(str(err)) from err
        except StoreError as err:
            raise BadGateway(str(err)) from err
        for gone in deleted:
            self.registry.forget_snapshot_job(gone)

