"""Workspaces (forkd's named, long-lived sandboxes): create, suspend into a
snapshot, resume from it, delete."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from vmfork.server.controller.branches import Branches
from vmfork.server.controller.core import Core, Part, sandbox_info
from vmfork.server.controller.sandboxes import Sandboxes
from vmfork.server.errors import BadRequest, Conflict, NotFound
from vmfork.server.registry import RUNNING, WorkspaceRecord
from vmfork.server.requests import Branch, SandboxCreate, WorkspaceCreate
from vmfork.store import SnapshotNotFound, StoreError

log = logging.getLogger(__name__)


class Workspaces(Part):
    """One workspace change at a time (its own lock): a workspace's sandbox is
    spawned, branched and deleted through the sandbox and BRANCH parts."""

    def __init__(self, core: Core, sandboxes: Sandboxes, branches: Branches) -> None:
        super().__init__(core)
        self.sandboxes = sandboxes
        self.branches = branches
        self._workspace_lock = threading.Lock()

    def _workspace(self, name: str) -> WorkspaceRecord:
        record = self.registry.get_workspace(name)
        if record is None:
            raise NotFound(f"no workspace {name!r}; GET /v1/workspaces lists them")
        return record

    def workspace_info(self, w: WorkspaceRecord) -> dict[str, Any]:
        sandbox = self.registry.get_sandbox(w.sandbox_id) if w.sandbox_id else None
        if sandbox is not None and sandbox.status == RUNNING:
            state = "running"
        elif w.sandbox_id is None and w.suspended_tag is not None:
            state = "suspended"
        else:
            state = "lost"   # its sandbox ended; suspend is impossible, resume is not
        return {"name": w.name, "snapshot_tag": w.snapshot_tag, "state": state,
                "sandbox_id": w.sandbox_id,
                "sandbox": None if sandbox is None else sandbox_info(sandbox),
                "suspended_snapshot": w.suspended_tag,
                # vmfork's extension: the read-write volumes the workspace holds.
                "volumes": [{"source": h.path, "guest_path": h.guest_path, "mode": "rw"}
                            for h in self.registry.volumes_held_by(f"workspace:{w.name}")],
                "memory_limit_mib": w.memory_limit_mib,
                "created_at_unix": int(w.created_at), "updated_at_unix": int(w.updated_at)}

    def list_workspaces(self) -> list[dict[str, Any]]:
        return [self.workspace_info(w) for w in self.registry.list_workspaces()]

    def get_workspace(self, name: str) -> dict[str, Any]:
        return self.workspace_info(self._workspace(name))

    def _spawn_one(self, tag: str, memory_limit_mib: int | None, workspace: str,
                   volume_items: list[Any] | None = None) -> str:
        infos = self.sandboxes.create_sandboxes(SandboxCreate(
            snapshot_tag=tag, memory_limit_mib=memory_limit_mib, volumes=volume_items),
            workspace=workspace)
        return str(infos[0]["id"])

    def create_workspace(self, request: WorkspaceCreate) -> dict[str, Any]:
        name = request.name
        if request.per_child_netns:
            raise BadRequest("per_child_netns=true is not supported for workspaces yet (a "
                             "suspended workspace would lose its network); omit it, or spawn "
                             "a networked sandbox with POST /v1/sandboxes")
        with self._workspace_lock:
            if self.registry.get_workspace(name) is not None:
                raise Conflict(f"workspace {name!r} already exists; choose another name or "
                               f"delete it (DELETE /v1/workspaces/{name})")
            sandbox_id = self._spawn_one(request.snapshot_tag, request.memory_limit_mib, name,
                                         request.volumes)
            now = time.time()
            self.registry.add_workspace(WorkspaceRecord(
                name, request.snapshot_tag, sandbox_id, None, request.memory_limit_mib, now,
                now))
            return self.workspace_info(self._workspace(name))

    def suspend_workspace(self, name: str, diff: bool) -> dict[str, Any]:
        """BRANCH the workspace's sandbox to a snapshot of its own, then stop it."""
        with self._workspace_lock:
            w = self._workspace(name)
            if self.workspace_info(w)["state"] != "running":
                raise Conflict(f"workspace {name!r} is not running; resume it first "
                               f"(POST /v1/workspaces/{name}/resume)")
            assert w.sandbox_id is not None
            tag = f"ws-{secrets.token_hex(4)}-{name}"[:64]
            self.branches.branch_sandbox(
                w.sandbox_id, Branch(tag=tag, mode="diff" if diff else "full"),
                suspending=True)
            self.sandboxes.delete_sandbox(w.sandbox_id)
            self.registry.set_workspace(name, None, tag)
            self._drop_suspension(w.suspended_tag)
            return self.workspace_info(self._workspace(name))

    def resume_workspace(self, name: str) -> dict[str, Any]:
        """Spawn the workspace's sandbox again from its suspension snapshot."""
        with self._workspace_lock:
            w = self._workspace(name)
            if w.suspended_tag is None:
                raise Conflict(f"workspace {name!r} was never suspended; there is nothing to "
                               "resume")
            if self.workspace_info(w)["state"] == "running":
                raise Conflict(f"workspace {name!r} is already running")
            sandbox_id = self._spawn_one(w.suspended_tag, w.memory_limit_mib, name)
            self.registry.set_workspace(name, sandbox_id, w.suspended_tag)
            return self.workspace_info(self._workspace(name))

    def delete_workspace(self, name: str) -> None:
        with self._workspace_lock:
            w = self._workspace(name)
            if w.sandbox_id is not None and self.registry.get_sandbox(w.sandbox_id):
                self.sandboxes.delete_sandbox(w.sandbox_id)
            self._drop_suspension(w.suspended_tag)
            self.registry.release_volumes(f"workspace:{name}")
            self.registry.remove_workspace(name)

    def _drop_suspension(self, tag: str | None) -> None:
        if tag is None:
            return
        try:
            self.store.delete(tag)
        except SnapshotNotFound:
            pass
        except StoreError as err:
            log.warning("cannot delete the old suspension snapshot %s: %s", tag, err)

