"""What the daemon does, independent of HTTP: snapshots, sandboxes and (through
``server.images``) guest images.

Every method takes validated input, raises an ``ApiError`` subclass that names
what failed and what to do, and returns plain JSON-ready data in forkd's wire
shapes (``SnapshotInfo``, ``SandboxInfo``; REFERENCE-forkd.md).

The work is split by resource, one module each: ``snapshots``, ``sandboxes`` (spawn,
list, delete, ports and egress), ``branches`` (BRANCH), ``lifecycle`` (timeouts,
pause/resume, connect), ``sandbox_io`` (exec, eval, files), ``usage`` (metrics),
``workspaces`` and ``reconcile`` (start-up reconciliation, the exit watcher, the
reaper). They share one ``core.Core``: the store, the registry, the spawner, the
networks and the locks. ``Controller`` puts them together and is the one object
the routes (``server.api``) and the E2B translator (``server.e2b``) call.

State: the store owns ready snapshots; the registry owns sandboxes and snapshots
still being written (``writing``, never spawnable: 409) or that failed. A
watcher thread turns the spawner's exit events into registry updates, so a
sandbox that dies on its own is shown with its reason, not as running.

Heavy operations (sandbox create, snapshot create) take a slot from a bounded
semaphore without blocking; when none is free the caller gets 503 with
``Retry-After`` instead of piling more VMs onto a saturated host. BRANCH has a
cap of its own (forkd's ``--branch-concurrency``).

Restarts. ``start`` reconciles the registry with the zygote, which outlives
daemon restarts (see ``spawner``): sandboxes the zygote still runs are re-adopted
as they are (their agents and control sockets live in their run directories),
sandboxes it no longer runs are marked ``lost`` with how they ended, children the
registry does not know (a spawn cut short by the crash) are killed, stale run
directories are removed, and snapshots a crash left ``writing`` become ``failed``
(the store removes their partial files).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmfork import __version__
from vmfork.agent.client import AgentClient
from vmfork.server.controller.branches import BRANCH_MODES, Branches
from vmfork.server.controller.core import (
    PAUSE_TAG_PREFIX,
    Core,
    Limits,
    Part,
    agent_errors,
    host_memory_mib,
    sandbox_info,
)
from vmfork.server.controller.lifecycle import Lifecycle
from vmfork.server.controller.reconcile import REAP_PER_CYCLE, REAPER_INTERVAL_S, Reconciler
from vmfork.server.controller.sandbox_io import (
    STREAMED_KEPT_BYTES,
    SandboxIO,
    exec_result_json,
    file_info_json,
)
from vmfork.server.controller.sandboxes import Sandboxes
from vmfork.server.controller.snapshots import SnapshotMaker, Snapshots, snapshot_json
from vmfork.server.controller.usage import Usage
from vmfork.server.controller.workspaces import Workspaces
from vmfork.server.images import ImageBuilds
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.networking import SandboxNetworks
from vmfork.server.registry import RUNNING, Registry, WorkspaceRecord
from vmfork.server.requests import (
    Branch,
    Egress,
    Eval,
    Exec,
    PortExpose,
    RemoveFile,
    SandboxCreate,
    SnapshotCreate,
    WorkspaceCreate,
)
from vmfork.server.spawner import Spawner
from vmfork.store import Store

__all__ = ["BRANCH_MODES", "PAUSE_TAG_PREFIX", "REAPER_INTERVAL_S", "REAP_PER_CYCLE",
           "STREAMED_KEPT_BYTES", "Controller", "Limits", "SnapshotMaker", "agent_errors",
           "exec_result_json", "file_info_json", "host_memory_mib", "snapshot_json"]

DEFAULT_LIMITS = Limits()


class Controller(Part):
    """The daemon's operations, one method per thing a client can ask, each handed to
    the part that owns its resource. It is a ``Part`` itself only to read the shared
    state as the parts do."""

    def __init__(self, store: Store, registry: Registry, spawner: Spawner | None,
                 metrics: DaemonMetrics, *, make_snapshot: SnapshotMaker | None = None,
                 limits: Limits = DEFAULT_LIMITS, networks: SandboxNetworks | None = None) -> None:
        core = Core(store, registry, spawner, metrics, limits, networks)
        super().__init__(core)
        self.snapshots = Snapshots(core, make_snapshot)
        self.sandboxes = Sandboxes(core)
        self.branches = Branches(core)
        self.lifecycle = Lifecycle(core, self.branches)
        self.io = SandboxIO(core)
        self.usage = Usage(core)
        self.workspaces = Workspaces(core, self.sandboxes, self.branches)
        self.reconciler = Reconciler(core, self.lifecycle, self.usage)
        self.images = ImageBuilds(store, metrics, concurrency=limits.image_builds,
                                  retry_after_s=limits.retry_after_s)
        metrics.set_sources(lambda: registry.count_sandboxes(RUNNING),
                            self.snapshots.snapshot_counts, lambda: self.branches.in_flight)

    # What the routes and the daemon read of the shared state: ``Part``'s properties
    # (store, registry, spawner, metrics, limits, networks), and:

    @property
    def max_guest_mib(self) -> int:
        return self.core.max_guest_mib

    # -- the daemon's own lifetime --------------------------------------------------------

    def start(self) -> None:
        """Reconcile the registry with the zygote and the store, then watch for exits."""
        self.reconciler.start()

    def reconcile(self) -> dict[str, list[str]]:
        return self.reconciler.reconcile()

    def reap_expired(self, now: float | None = None) -> list[str]:
        return self.reconciler.reap_expired(now)

    def stop(self, kill_sandboxes: bool = False) -> None:
        """Stop watching and let go of the zygote. Sandboxes keep running for the next
        daemon (within the zygote's lease) unless ``kill_sandboxes``."""
        self.reconciler.stop_watching()
        self.branches.join()
        self.images.stop()
        self.reconciler.let_go(kill_sandboxes)

    @staticmethod
    def version() -> dict[str, Any]:
        return {"version": __version__, "api": "v1", "implementation": "vmfork"}

    # -- snapshots ------------------------------------------------------------------------

    def snapshot_counts(self) -> dict[str, int]:
        return self.snapshots.snapshot_counts()

    def list_snapshots(self) -> list[dict[str, Any]]:
        return self.snapshots.list_snapshots()

    def snapshot_info(self, tag: str) -> dict[str, Any]:
        return self.snapshots.snapshot_info(tag)

    def create_snapshot(self, request: SnapshotCreate) -> dict[str, Any]:
        return self.snapshots.create_snapshot(request)

    def compact_snapshot(self, tag: str, to: str) -> dict[str, Any]:
        return self.snapshots.compact_snapshot(tag, to)

    def pack_snapshot(self, tag: str, *, with_image: bool) -> Path:
        return self.snapshots.pack_snapshot(tag, with_image=with_image)

    def delete_snapshot(self, tag: str, cascade: bool, force: bool) -> None:
        self.snapshots.delete_snapshot(tag, cascade, force)

    # -- sandboxes --------------------------------------------------------------------------

    sandbox_info = staticmethod(sandbox_info)

    def create_sandboxes(self, request: SandboxCreate, *,
                         workspace: str | None = None) -> list[dict[str, Any]]:
        return self.sandboxes.create_sandboxes(request, workspace=workspace)

    def list_sandboxes(self, metadata: dict[str, str] | None = None,
                       states: set[str] | None = None) -> list[dict[str, Any]]:
        return self.sandboxes.list_sandboxes(metadata, states)

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return self.sandboxes.get_sandbox(sandbox_id)

    def sandbox_run_dir(self, sandbox_id: str) -> str:
        return self.sandboxes.sandbox_run_dir(sandbox_id)

    def delete_sandbox(self, sandbox_id: str) -> None:
        self.sandboxes.delete_sandbox(sandbox_id)

    def list_ports(self, sandbox_id: str) -> list[dict[str, Any]]:
        return self.sandboxes.list_ports(sandbox_id)

    def expose_port(self, sandbox_id: str, request: PortExpose) -> dict[str, Any]:
        return self.sandboxes.expose_port(sandbox_id, request)

    def unexpose_port(self, sandbox_id: str, host_port: int, protocol: str) -> None:
        self.sandboxes.unexpose_port(sandbox_id, host_port, protocol)

    def set_egress(self, sandbox_id: str, request: Egress) -> dict[str, Any]:
        return self.sandboxes.set_egress(sandbox_id, request)

    # -- BRANCH -----------------------------------------------------------------------------

    branch_mode = staticmethod(Branches.branch_mode)

    def branch_sandbox(self, sandbox_id: str, request: Branch) -> tuple[int, dict[str, Any]]:
        return self.branches.branch_sandbox(sandbox_id, request)

    # -- lifecycle: timeouts, pause/resume, connect, metrics (issue 15) ---------------------

    def set_timeout(self, sandbox_id: str, timeout_secs: float | None) -> dict[str, Any]:
        return self.lifecycle.set_timeout(sandbox_id, timeout_secs)

    def pause_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return self.lifecycle.pause_sandbox(sandbox_id)

    def resume_sandbox(self, sandbox_id: str, timeout_secs: float | None = None
                       ) -> dict[str, Any]:
        return self.lifecycle.resume_sandbox(sandbox_id, timeout_secs)

    def connect_sandbox(self, sandbox_id: str, timeout_secs: float | None = None
                        ) -> dict[str, Any]:
        return self.lifecycle.connect_sandbox(sandbox_id, timeout_secs)

    def sandbox_metrics(self, sandbox_id: str, *, disk: bool = True) -> dict[str, Any]:
        return self.usage.sandbox_metrics(sandbox_id, disk=disk)

    def sandbox_metric_samples(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The host's kept samples of a running sandbox (``Usage.samples``)."""
        return self.usage.samples(sandbox_id)

    # -- in the sandbox: its agent, exec, eval, files ---------------------------------------

    def agent(self, sandbox_id: str) -> AgentClient:
        """The running sandbox's agent (409 if it is paused or ended)."""
        return self.core.agent(sandbox_id)

    def command_env(self, sandbox_id: str, env: dict[str, Any] | None
                    ) -> dict[str, Any] | None:
        return self.io.command_env(sandbox_id, env)

    def ping(self, sandbox_id: str) -> dict[str, Any]:
        return self.io.ping(sandbox_id)

    def exec(self, sandbox_id: str, request: Exec,
             on_stdout: Callable[[bytes], None] | None = None,
             on_stderr: Callable[[bytes], None] | None = None) -> dict[str, Any]:
        return self.io.exec(sandbox_id, request, on_stdout, on_stderr)

    def eval(self, sandbox_id: str, request: Eval) -> dict[str, Any]:
        return self.io.eval(sandbox_id, request)

    def stat_file(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return self.io.stat_file(sandbox_id, path)

    def list_files(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return self.io.list_files(sandbox_id, path)

    def remove_file(self, sandbox_id: str, query: RemoveFile) -> None:
        self.io.remove_file(sandbox_id, query)

    # -- workspaces -------------------------------------------------------------------------

    def workspace_info(self, w: WorkspaceRecord) -> dict[str, Any]:
        return self.workspaces.workspace_info(w)

    def list_workspaces(self) -> list[dict[str, Any]]:
        return self.workspaces.list_workspaces()

    def get_workspace(self, name: str) -> dict[str, Any]:
        return self.workspaces.get_workspace(name)

    def create_workspace(self, request: WorkspaceCreate) -> dict[str, Any]:
        return self.workspaces.create_workspace(request)

    def suspend_workspace(self, name: str, diff: bool) -> dict[str, Any]:
        return self.workspaces.suspend_workspace(name, diff)

    def resume_workspace(self, name: str) -> dict[str, Any]:
        return self.workspaces.resume_workspace(name)

    def delete_workspace(self, name: str) -> None:
        self.workspaces.delete_workspace(name)
