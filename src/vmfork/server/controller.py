"""What the daemon does, independent of HTTP: snapshots and sandboxes.

Every method takes validated input, raises an ``ApiError`` subclass that names
what failed and what to do, and returns plain JSON-ready data in forkd's wire
shapes (``SnapshotInfo``, ``SandboxInfo``; REFERENCE-forkd.md).

State: the store owns ready snapshots; the registry owns sandboxes and snapshots
still being written (``writing``, never spawnable: 409) or that failed. A
watcher thread turns the spawner's exit events into registry updates, so a
sandbox that dies on its own is shown with its reason, not as running.

Heavy operations (sandbox create, snapshot create) take a slot from a bounded
semaphore without blocking; when none is free the caller gets 503 with
``Retry-After`` instead of piling more VMs onto a saturated host.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vmfork import __version__
from vmfork.agent.client import (
    AgentClient,
    AgentError,
    AgentProtocolError,
    AgentTimeout,
    AgentUnavailable,
    ExecResult,
    FileInfo,
)
from vmfork.server.errors import (
    ApiError,
    BadGateway,
    BadRequest,
    Busy,
    Conflict,
    GatewayTimeout,
    NotFound,
    Unprocessable,
)
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.registry import (
    EXITED,
    FAILED,
    RUNNING,
    WRITING,
    Registry,
    SandboxRecord,
)
from vmfork.server.spawner import Spawner, SpawnerError
from vmfork.store import (
    Snapshot,
    SnapshotCorrupt,
    SnapshotNotFound,
    Store,
    StoreError,
    TagBusy,
    TagExists,
    disk_usage,
)

log = logging.getLogger(__name__)

SnapshotMaker = Callable[[Store, dict[str, Any]], Snapshot]
"""Boots, warms and snapshots a parent (``runtime.parent.snapshot_parent`` in the
daemon; a fake in unit tests). Gets the store and the validated request body."""


@dataclass(frozen=True)
class Limits:
    heavy_concurrency: int = 4
    retry_after_s: int = 2


class Controller:
    def __init__(self, store: Store, registry: Registry, spawner: Spawner | None,
                 metrics: DaemonMetrics, *, make_snapshot: SnapshotMaker | None = None,
                 limits: Limits = Limits()) -> None:
        self.store = store
        self.registry = registry
        self.spawner = spawner
        self.metrics = metrics
        self.make_snapshot = make_snapshot
        self.limits = limits
        self._heavy = threading.BoundedSemaphore(limits.heavy_concurrency)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        metrics.set_sources(lambda: registry.count_sandboxes(RUNNING), self.snapshot_counts)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Reconcile the registry with a fresh start and watch for sandbox exits."""
        lost = self.registry.mark_all_running_lost(
            "daemon-restart", "the daemon restarted; its zygote (and with it this sandbox's "
            "VMM process) stopped with the previous daemon. Re-adoption across restarts is "
            "not implemented yet; delete this entry and spawn again")
        if lost:
            log.warning("%d sandboxes of a previous daemon marked lost", len(lost))
        failed = self.registry.fail_orphaned_snapshot_jobs(os.getpid())
        if failed:
            log.warning("snapshots left writing by a previous daemon marked failed: %s",
                        ", ".join(failed))
        self.store.cleanup_stale()
        if self.spawner is not None:
            self._watcher = threading.Thread(target=self._watch_exits, name="exit-watcher",
                                             daemon=True)
            self._watcher.start()

    def stop(self) -> None:
        """Stop watching, kill every sandbox (through the spawner) and record why."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
        if self.spawner is not None:
            self.spawner.close()
        for record in self.registry.list_sandboxes(RUNNING):
            self.registry.mark_ended(record.id, EXITED, "daemon-stopped",
                                     "the daemon shut down and stopped its sandboxes")

    def _watch_exits(self) -> None:
        assert self.spawner is not None
        while not self._stop.wait(0.2):
            try:
                notices = self.spawner.exits()
            except Exception as err:  # noqa: BLE001 - keep watching; say why once a cycle
                log.error("cannot read sandbox exit events: %s", err)
                continue
            for notice in notices:
                if self.registry.mark_ended(notice.vm_id, EXITED, notice.reason,
                                            notice.description):
                    self.metrics.sandbox_exits.inc(reason=notice.reason)
                    log.info("sandbox %s ended: %s", notice.vm_id, notice.description)

    @contextmanager
    def _heavy_slot(self, what: str) -> Iterator[None]:
        if not self._heavy.acquire(blocking=False):
            self.metrics.heavy_rejected.inc()
            raise Busy(f"{what}: {self.limits.heavy_concurrency} heavy operations (sandbox or "
                       "snapshot creation) are already running; retry after "
                       f"{self.limits.retry_after_s} s", self.limits.retry_after_s)
        try:
            yield
        finally:
            self._heavy.release()

    # -- service --------------------------------------------------------------------

    @staticmethod
    def version() -> dict[str, Any]:
        return {"version": __version__, "api": "v1", "implementation": "vmfork"}

    # -- snapshots ------------------------------------------------------------------

    def snapshot_counts(self) -> dict[str, int]:
        counts = {"ready": 0, WRITING: 0, FAILED: 0}
        ready = {s.tag for s in self.store.list()}
        counts["ready"] = len(ready)
        for job in self.registry.list_snapshot_jobs():
            if job.tag not in ready:
                counts[job.status] = counts.get(job.status, 0) + 1
        return counts

    @staticmethod
    def _snapshot_info(snap: Snapshot) -> dict[str, Any]:
        meta = snap.meta
        info: dict[str, Any] = {
            "tag": snap.tag, "dir": str(snap.path), "created_at_unix": int(meta.created_at_unix),
            "status": "ready", "bootable": True,
            "image": meta.image, "mem_mib": meta.mem_mib, "vcpus": meta.vcpus,
            "warm_up": meta.warm_up}
        if meta.parent_tag is not None:
            info["branched_from"] = meta.parent_tag
        if meta.timings.pause_ms is not None:
            info["pause_ms"] = round(meta.timings.pause_ms, 3)
        return info

    def list_snapshots(self) -> list[dict[str, Any]]:
        out = [self._snapshot_info(s) for s in self.store.list()]
        ready = {i["tag"] for i in out}
        for job in self.registry.list_snapshot_jobs():
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

    def _ready_snapshot(self, tag: str) -> Snapshot:
        job = self.registry.get_snapshot_job(tag)
        if job is not None and job.status == WRITING:
            raise Conflict(f"snapshot {tag!r} is still being written (status writing) and is "
                           "not bootable yet; poll GET /v1/snapshots until it is ready")
        try:
            return self.store.get(tag)
        except SnapshotNotFound as err:
            if job is not None and job.status == FAILED:
                raise Conflict(f"snapshot {tag!r} failed and is not bootable: {job.error}; "
                               f"delete it (DELETE /v1/snapshots/{tag}) and create it "
                               "again") from err
            raise NotFound(str(err)) from err
        except SnapshotCorrupt as err:
            raise Conflict(str(err)) from err

    def snapshot_info(self, tag: str) -> dict[str, Any]:
        snap = self._ready_snapshot(tag)
        usage = disk_usage(snap)
        files = {f.name: f for f in usage.files}
        memory = files.get(snap.memory_path.name)
        state = files.get(snap.state_path.name)
        return {
            "tag": snap.tag, "dir": str(snap.path),
            "created_at_unix": int(snap.meta.created_at_unix),
            "memory_logical_bytes": memory.logical_bytes if memory else 0,
            "memory_physical_bytes": memory.physical_bytes if memory else 0,
            "vmstate_bytes": state.logical_bytes if state else 0,
            "parent_tag": snap.meta.parent_tag, "parent_content_hash": None,
            "chain_depth": 0, "dependents": [], "ancestors": [],
            "status": "ready", "bootable": True, "mem_mib": snap.meta.mem_mib,
            "vcpus": snap.meta.vcpus, "image": snap.meta.image, "warm_up": snap.meta.warm_up}

    def create_snapshot(self, body: dict[str, Any]) -> dict[str, Any]:
        tag = body["tag"]
        if self.make_snapshot is None:
            raise BadGateway("this daemon cannot boot parents (started without a guest "
                             "image); create the snapshot with `vmfork snapshot` instead")
        if self.store.exists(tag):
            raise BadRequest(f"snapshot tag {tag!r} already exists; choose another tag or "
                             f"delete it first (DELETE /v1/snapshots/{tag})")
        with self._heavy_slot(f"create snapshot {tag!r}"):
            if not self.registry.begin_snapshot_job(tag, os.getpid()):
                raise Conflict(f"snapshot {tag!r} is already being written; wait for it")
            try:
                snap = self.make_snapshot(self.store, body)
            except (TagExists, TagBusy) as err:
                self.registry.finish_snapshot_job(tag, str(err))
                self.registry.forget_snapshot_job(tag)
                raise Conflict(str(err)) from err
            except ApiError as err:
                self.registry.finish_snapshot_job(tag, err.message)
                raise
            except Exception as err:
                self.registry.finish_snapshot_job(tag, f"{type(err).__name__}: {err}")
                raise BadGateway(f"creating snapshot {tag!r} failed: {err}") from err
            self.registry.finish_snapshot_job(tag, None)
        return self._snapshot_info(snap)

    def delete_snapshot(self, tag: str, cascade: bool, force: bool) -> None:
        if cascade and force:
            raise BadRequest("pass cascade=true or force=true, not both: cascade deletes the "
                             "snapshots built on this one, force leaves them orphaned")
        job = self.registry.get_snapshot_job(tag)
        if job is not None and job.status == WRITING:
            raise Conflict(f"snapshot {tag!r} is being written; wait until it is ready or "
                           "failed, then delete it")
        try:
            self.store.delete(tag)
        except SnapshotNotFound as err:
            if job is not None and self.registry.forget_snapshot_job(tag):
                return
            raise NotFound(str(err)) from err
        except TagBusy as err:
            raise Conflict(str(err)) from err
        except StoreError as err:
            raise BadGateway(str(err)) from err
        self.registry.forget_snapshot_job(tag)

    # -- sandboxes ------------------------------------------------------------------

    @staticmethod
    def sandbox_info(r: SandboxRecord) -> dict[str, Any]:
        info: dict[str, Any] = {
            "id": r.id, "snapshot_tag": r.snapshot_tag, "netns": None, "guest_addr": None,
            "created_at_unix": int(r.created_at), "pid": r.pid,
            "memory_limit_mib": r.memory_limit_mib, "has_branched": r.branch_count > 0,
            "last_branch_memory_path": r.last_branch_memory_path,
            "branch_count": r.branch_count, "status": r.status}
        if r.status != RUNNING:
            info["exit_reason"] = r.exit_reason
            info["exit_description"] = r.exit_description
        return info

    def _spawner(self) -> Spawner:
        if self.spawner is None:
            raise BadGateway("this daemon runs without a spawner (no sandboxes); start it "
                             "with `vmfork serve` on a host with KVM")
        return self.spawner

    def create_sandboxes(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        for flag, why in (("per_child_netns", "networking is not implemented yet"),
                          ("live_fork", ("children always map the snapshot copy-on-write; "
                                         "forkd's live_fork copies RAM per child and is not "
                                         "offered")),
                          ("hugepages", "hugepage-backed guest RAM is not implemented yet")):
            if body[flag]:
                raise BadRequest(f"{flag}=true is not supported: {why}; omit it")
        tag = body["snapshot_tag"]
        n = body["n"]
        snap = self._ready_snapshot(tag)
        spawner = self._spawner()
        with self._heavy_slot(f"spawn {n} sandboxes of {tag!r}"):
            started = time.time()
            try:
                outcome = spawner.spawn(snap, n, body["memory_limit_mib"])
            except SpawnerError as err:
                self.metrics.spawn_seconds.observe(time.time() - started, outcome="failed")
                raise BadGateway(str(err)) from err
            if outcome.failed:
                for child in outcome.children:
                    spawner.kill(child.vm_id)
                self.metrics.spawn_seconds.observe(outcome.ready_s, outcome="failed")
                reasons = "; ".join(f"{vm}: {why}" for vm, why in outcome.failed[:5])
                raise BadGateway(
                    f"{len(outcome.failed)} of {n} sandboxes of {tag!r} failed to start "
                    f"({reasons}); none were kept. See the daemon log and the snapshot's "
                    "health (GET /v1/snapshots/{tag}/info)",
                    extra={"failed": [{"id": vm, "reason": why} for vm, why in outcome.failed]})
            records = [SandboxRecord(id=c.vm_id, snapshot_tag=tag, pid=c.pid,
                                     run_dir=c.run_dir, status=RUNNING, created_at=started,
                                     memory_limit_mib=body["memory_limit_mib"])
                       for c in outcome.children]
            self.registry.add_sandboxes(records)
        self.metrics.spawn_seconds.observe(outcome.ready_s, outcome="ok")
        self.metrics.restore_seconds.observe(outcome.restored_s)
        self.metrics.sandboxes_spawned.inc(len(records))
        return [self.sandbox_info(r) for r in records]

    def list_sandboxes(self) -> list[dict[str, Any]]:
        return [self.sandbox_info(r) for r in self.registry.list_sandboxes()]

    def _record(self, sandbox_id: str) -> SandboxRecord:
        record = self.registry.get_sandbox(sandbox_id)
        if record is None:
            raise NotFound(f"no sandbox {sandbox_id!r}; GET /v1/sandboxes lists them")
        return record

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return self.sandbox_info(self._record(sandbox_id))

    def delete_sandbox(self, sandbox_id: str) -> None:
        record = self._record(sandbox_id)
        if record.status == RUNNING:
            try:
                self._spawner().kill(sandbox_id)
            except SpawnerError as err:
                raise BadGateway(str(err)) from err
            if self.registry.mark_ended(sandbox_id, EXITED, "killed", "deleted through the API"):
                self.metrics.sandbox_exits.inc(reason="killed")
        self.registry.remove_sandbox(sandbox_id)

    def agent(self, sandbox_id: str) -> AgentClient:
        record = self._record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}: "
                           f"{record.exit_description}); delete it with DELETE "
                           f"/v1/sandboxes/{sandbox_id} and spawn another")
        return self._spawner().agent(record.run_dir)

    def ping(self, sandbox_id: str) -> dict[str, Any]:
        with agent_errors(sandbox_id, "ping"):
            result = self.agent(sandbox_id).ping()
        return {"pong": True, "pid": result.pid, "version": result.version,
                "protocol": result.protocol, "uptime": result.uptime, "boot_id": result.boot_id}

    def exec(self, sandbox_id: str, body: dict[str, Any],
             on_stdout: Callable[[bytes], None] | None = None,
             on_stderr: Callable[[bytes], None] | None = None) -> dict[str, Any]:
        agent = self.agent(sandbox_id)
        timeout = float(body["timeout_secs"])
        try:
            with agent_errors(sandbox_id, "exec"):
                result = agent.exec(body["args"], env=body["env"], cwd=body["cwd"],
                                    stdin=body["stdin"], timeout=timeout,
                                    on_stdout=on_stdout, on_stderr=on_stderr)
        except AgentError as err:
            if err.code == "not_found":
                # As a shell would: the program is missing, exit status 127.
                return {"stdout": "", "stderr": err.message + "\n", "exit_code": 127,
                        "signal": None, "duration_secs": 0.0}
            raise
        return exec_result_json(result)

    def eval(self, sandbox_id: str, body: dict[str, Any]) -> dict[str, Any]:
        agent = self.agent(sandbox_id)
        with agent_errors(sandbox_id, "eval"):
            result = agent.eval(body["code"], timeout=body["timeout_secs"])
        exc = result.exception
        return {"result": result.value,
                "error": None if exc is None else f"{exc.type}: {exc.message}",
                "exit_code": 0 if exc is None else 1,
                "stdout": result.stdout, "stderr": result.stderr,
                "traceback": None if exc is None else exc.traceback,
                "value_truncated": result.value_truncated}

    def stat_file(self, sandbox_id: str, path: str) -> dict[str, Any]:
        with agent_errors(sandbox_id, "stat"):
            return file_info_json(self.agent(sandbox_id).stat(path))

    def list_files(self, sandbox_id: str, path: str) -> dict[str, Any]:
        with agent_errors(sandbox_id, "list"):
            entries = self.agent(sandbox_id).list_dir(path)
        return {"path": path, "entries": [file_info_json(e) for e in entries]}

    def remove_file(self, sandbox_id: str, query: dict[str, Any]) -> None:
        with agent_errors(sandbox_id, "remove"):
            self.agent(sandbox_id).remove(query["path"], recursive=query["recursive"],
                                          missing_ok=query["missing_ok"])


def exec_result_json(result: ExecResult) -> dict[str, Any]:
    return {"stdout": result.stdout.decode("utf-8", "replace"),
            "stderr": result.stderr.decode("utf-8", "replace"),
            "exit_code": result.exit_code, "signal": result.signal,
            "duration_secs": round(result.duration, 6)}


def file_info_json(info: FileInfo) -> dict[str, Any]:
    return {"name": info.name, "path": info.path, "type": info.type, "size": info.size,
            "mode": info.mode, "mtime": info.mtime, "target": info.target}


@contextmanager
def agent_errors(sandbox_id: str, op: str) -> Iterator[None]:
    """Map the agent's errors to HTTP errors that say which sandbox and what to do.
    ``not_found`` from exec is handled by the caller (it is a result, exit 127)."""
    try:
        yield
    except AgentTimeout as err:
        raise GatewayTimeout(
            f"{op} in sandbox {sandbox_id} timed out after {err.timeout} s and was killed; "
            "raise timeout_secs to allow longer",
            extra={"timed_out": True, "exit_code": None,
                   "stdout": err.stdout.decode("utf-8", "replace"),
                   "stderr": err.stderr.decode("utf-8", "replace")}) from err
    except (AgentUnavailable, AgentProtocolError) as err:
        raise BadGateway(f"{op}: the agent of sandbox {sandbox_id} cannot be reached: "
                         f"{err.message}; check GET /v1/sandboxes/{sandbox_id}") from err
    except AgentError as err:
        if err.code == "not_found" and op != "exec":
            raise NotFound(f"{op} in sandbox {sandbox_id}: {err.message}") from err
        if err.code == "not_found":
            raise
        raise Unprocessable(f"{op} in sandbox {sandbox_id} failed: {err.message}") from err
