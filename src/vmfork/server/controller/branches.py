"""BRANCH: a running sandbox captured into a snapshot of its own (full, diff or
live), synchronously or in the background, with a cap of its own (forkd's
``--branch-concurrency``)."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any

from vmfork.runtime.branch import BranchFailed
from vmfork.server.controller.core import Core, Part
from vmfork.server.controller.snapshots import snapshot_json
from vmfork.server.errors import ApiError, BadGateway, BadRequest, Busy, Conflict
from vmfork.server.registry import RUNNING, WRITING, SandboxRecord
from vmfork.server.requests import Branch
from vmfork.store import PendingSnapshot, StoreError, TagBusy, TagExists

log = logging.getLogger(__name__)

BRANCH_MODES = ("full", "diff", "live")
PAGE_SIZE = 4096   # the guest's page, the unit of a diff's dirty-page count


class Branches(Part):
    """BRANCH of a running sandbox; pauses and workspace suspends are BRANCHes
    too (``suspending``: the read-write volumes go with the sandbox)."""

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._branches = threading.BoundedSemaphore(self.limits.branch_concurrency)
        self.in_flight = 0
        self._branch_lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    @staticmethod
    def branch_mode(request: Branch) -> str:
        """forkd's ``mode``, or its legacy ``diff``/``live`` booleans (live implies a
        diff capture); a ``mode`` that contradicts the booleans is refused."""
        legacy = "live" if request.live else "diff" if request.diff else None
        mode = request.mode
        if mode is not None and legacy is not None and mode != legacy:
            raise BadRequest(f"mode {mode!r} contradicts the legacy flags (diff={request.diff}, "
                             f"live={request.live}); give mode alone")
        mode = mode or legacy or "full"
        if mode == "full" and request.parent_tag is not None:
            raise BadRequest("parent_tag names the base of a diff or live BRANCH; a full "
                             "BRANCH is self-contained: drop parent_tag or use mode diff")
        return str(mode)

    def _refuse_branch_with_rw_volume(self, sandbox_id: str) -> None:
        holders = [f"sandbox:{sandbox_id}"] + [
            f"workspace:{w.name}" for w in self.registry.list_workspaces()
            if w.sandbox_id == sandbox_id]
        for holder in holders:
            for hold in self.registry.volumes_held_by(holder):
                raise Conflict(
                    f"sandbox {sandbox_id} has the read-write volume {hold.path} at "
                    f"{hold.guest_path}: a BRANCH's children would each need that disk as "
                    "it was at the pause, but it is a file outside guest memory that the "
                    "sandbox goes on writing, and it cannot be attached to two sandboxes; "
                    "BRANCH is refused (a workspace suspend captures it, keeping the "
                    "volume with the workspace)")

    def branch_sandbox(self, sandbox_id: str, request: Branch, *,
                       suspending: bool = False) -> tuple[int, dict[str, Any]]:
        """Snapshot a running sandbox as ``tag`` (201 with ``SnapshotInfo`` and
        ``pause_ms``), or with ``wait: false`` start it and answer 202 with status
        ``writing`` (poll GET /v1/snapshots until ``ready`` or ``failed``)."""
        mode = self.branch_mode(request)
        record = self.core.record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); only a "
                           "running sandbox can be branched")
        if not suspending:
            self._refuse_branch_with_rw_volume(sandbox_id)
        self.core.require_spawner()  # 502 now if this daemon has none, before any tag is claimed
        tag = request.tag or self._branch_tag(record)
        if request.parent_tag is not None:
            self.core.ready_snapshot(request.parent_tag)  # 404/409 before anything starts
        if self.store.exists(tag):
            raise Conflict(f"snapshot tag {tag!r} already exists; choose another tag or "
                           f"delete it first (DELETE /v1/snapshots/{tag})")
        if not self._branches.acquire(blocking=False):
            self.metrics.heavy_rejected.inc()
            raise Busy(f"branch of {sandbox_id}: {self.limits.branch_concurrency} BRANCH "
                       "operations are already running; retry after "
                       f"{self.limits.retry_after_s} s", self.limits.retry_after_s)
        try:
            if not self.registry.begin_snapshot_job(tag, os.getpid()):
                raise Conflict(f"snapshot {tag!r} is already being written (a BRANCH in "
                               "flight); wait for it or choose another tag")
            try:
                pending = self.store.begin(tag)
            except (TagExists, TagBusy) as err:
                self.registry.finish_snapshot_job(tag, str(err))
                self.registry.forget_snapshot_job(tag)
                raise Conflict(str(err)) from err
        except BaseException:
            self._branches.release()
            raise
        with self._branch_lock:
            self.in_flight += 1
        started = time.time()

        def work() -> dict[str, Any]:
            try:
                return self._branch(record, mode, request, pending)
            finally:
                with self._branch_lock:
                    self.in_flight -= 1
                self._branches.release()

        if request.wait:
            return 201, work()

        def background() -> None:
            try:
                work()
            except ApiError as err:
                log.warning("BRANCH %s of %s failed: %s", tag, sandbox_id, err.message)
            finally:
                self.threads.remove(threading.current_thread())

        thread = threading.Thread(target=background, name=f"branch-{tag}", daemon=True)
        self.threads.append(thread)
        thread.start()
        return 202, {"tag": tag, "dir": str(self.store.snapshots_dir / tag),
                     "created_at_unix": int(started), "status": WRITING, "bootable": False,
                     "branched_from": sandbox_id, "branch_mode": mode}

    def _branch_tag(self, record: SandboxRecord) -> str:
        for _ in range(8):
            tag = f"{record.id}-branch-{record.branch_count + 1}-{secrets.token_hex(3)}"
            if not self.store.exists(tag) and self.registry.get_snapshot_job(tag) is None:
                return tag
        raise Conflict(f"cannot find a free tag for a BRANCH of {record.id}; pass one in "
                       "\"tag\"")

    def _branch(self, record: SandboxRecord, mode: str, request: Branch,
                pending: PendingSnapshot) -> dict[str, Any]:
        """Have the spawner capture the sandbox into ``pending`` and publish it
        (``runtime.branch``: the VMM's control op, a diff resolved into a spawnable
        head, content hashes). Any failure aborts ``pending`` (nothing partial is ever
        listed as ready) and leaves the job ``failed`` with the reason."""
        tag = pending.tag
        spawner = self.core.require_spawner()
        try:
            try:
                result = spawner.branch(record.run_dir, self.store, pending, mode,
                                        parent_tag=request.parent_tag, sandbox_id=record.id,
                                        settle_free_pages=request.settle_free_pages)
            except BranchFailed as err:
                if err.stage == "base":
                    raise Conflict(f"BRANCH {tag!r} of {record.id}: {err}") from err
                if err.stage == "control":
                    raise BadGateway(f"BRANCH of {record.id}: {err}; check GET "
                                     f"/v1/sandboxes/{record.id}") from err
                raise BadGateway(f"BRANCH of {record.id} failed in its VMM: {err}") from err
            except StoreError as err:
                raise BadGateway(f"BRANCH {tag!r}: {err}") from err
        except ApiError as err:
            pending.abort()
            self.registry.finish_snapshot_job(tag, err.message)
            raise
        except Exception as err:
            pending.abort()
            self.registry.finish_snapshot_job(tag, f"{type(err).__name__}: {err}")
            raise BadGateway(f"BRANCH {tag!r} failed: {err}") from err
        snap = result.snapshot
        self.registry.finish_snapshot_job(tag, None)
        # A diff branch has no memory image of its own: its plan says what maps it.
        self.registry.record_branch(
            record.id, str(snap.plan_path if snap.is_layered else snap.memory_path))
        self.metrics.branch_pause_seconds.observe(result.pause_ms / 1000, mode=mode)
        self.metrics.branches.inc(mode=mode)
        info = snapshot_json(snap)
        info["pause_ms"] = round(result.pause_ms, 3)
        if request.measure_diff:
            # What this capture wrote for the memory: the changed pages of a diff, the
            # whole image otherwise (forkd's diff_* fields; measured, not estimated).
            info["diff_ms"] = round(result.total_ms, 3)
            info["diff_physical_bytes"] = result.memory_bytes
            info["diff_logical_bytes"] = (result.dirty_pages * PAGE_SIZE
                                          if result.dirty_pages is not None
                                          else result.memory_bytes)
        return info



    def join(self) -> None:
        """Wait for the wait:false BRANCHes still finishing their files."""
        for thread in list(self.threads):
            thread.join(60.0)
