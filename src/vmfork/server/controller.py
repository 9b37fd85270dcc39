"""What the daemon does, independent of HTTP: snapshots, sandboxes and (through
``server.images``) guest images.

Every method takes validated input, raises an ``ApiError`` subclass that names
what failed and what to do, and returns plain JSON-ready data in forkd's wire
shapes (``SnapshotInfo``, ``SandboxInfo``; REFERENCE-forkd.md).

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

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
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
from vmfork.runtime import cgroups
from vmfork.runtime.branch import BranchFailed
from vmfork.runtime.network import NetworkError
from vmfork.runtime.volumes import PreparedVolume
from vmfork.server import volumes
from vmfork.server.errors import (
    ApiError,
    BadGateway,
    BadRequest,
    Busy,
    Conflict,
    GatewayTimeout,
    NotFound,
    NotImplementedApi,
    QuotaExceeded,
    Unprocessable,
)
from vmfork.server.images import ImageBuilds
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.networking import SandboxNetworks, egress_policy, snapshot_has_network
from vmfork.server.registry import (
    EXITED,
    FAILED,
    LOST,
    PAUSED,
    RUNNING,
    WRITING,
    Registry,
    SandboxRecord,
    WorkspaceRecord,
)
from vmfork.server.spawner import Spawner, SpawnerError, SpawnerGone
from vmfork.store import (
    PendingSnapshot,
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

PAGE_SIZE = 4096   # the guest's page, the unit of a diff's dirty-page count

# The reaper (sandbox timeouts): how often it looks, and how many expired sandboxes it
# ends in one look (each kill or pause is done in turn; the rest wait a cycle).
REAPER_INTERVAL_S = 1.0
REAP_PER_CYCLE = 16
PAUSE_TAG_PREFIX = "pause-"
# What the guest reports about its root (the overlay it writes to), for metrics: run
# by the guest's own Python, which every image has (the agent is Python).
_STATFS_CODE = ("import os;s=os.statvfs('/');"
                "print(s.f_frsize*s.f_blocks,s.f_frsize*s.f_bavail,s.f_files,s.f_ffree)")

SnapshotMaker = Callable[[Store, dict[str, Any]], Snapshot]
"""Boots, warms and snapshots a parent (``runtime.parent.snapshot_parent`` in the
daemon; a fake in unit tests). Gets the store and the validated request body."""


@dataclass(frozen=True)
class Limits:
    heavy_concurrency: int = 4
    branch_concurrency: int = 2
    # Image builds and imports at once: each compresses its disk on every core.
    image_builds: int = 2
    retry_after_s: int = 2
    # What one call may make the daemon hold for a guest (which runs untrusted code):
    # bytes of exec output buffered for a non-streamed exec (stdout + stderr; the stream
    # route forwards output as it comes and keeps none), and entries of a file listing.
    exec_output_bytes: int = 4 << 20
    list_entries: int = 10_000
    # Daemon-wide caps on what clients may start (429 beyond them): running sandboxes,
    # and guest RAM committed to them (each sandbox counts its snapshot's mem_mib, though
    # children share their snapshot's pages until they write: the cap bounds what they
    # could come to hold). None: four times the host's RAM (see docs/security.md).
    max_sandboxes: int = 1000
    max_guest_mib: int | None = None


def host_memory_mib() -> int:
    """MemTotal of this host, in MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise OSError("no MemTotal in /proc/meminfo")


BRANCH_MODES = ("full", "diff", "live")


class Controller:
    def __init__(self, store: Store, registry: Registry, spawner: Spawner | None,
                 metrics: DaemonMetrics, *, make_snapshot: SnapshotMaker | None = None,
                 limits: Limits = Limits(), networks: SandboxNetworks | None = None) -> None:
        self.store = store
        self.networks = networks  # None: this daemon gives sandboxes no networks
        self.registry = registry
        self.spawner = spawner
        self.metrics = metrics
        self.make_snapshot = make_snapshot
        self.limits = limits
        self._heavy = threading.BoundedSemaphore(limits.heavy_concurrency)
        self._branches = threading.BoundedSemaphore(limits.branch_concurrency)
        self._branches_in_flight = 0
        self._branch_lock = threading.Lock()
        self._branch_threads: list[threading.Thread] = []
        self._workspace_lock = threading.Lock()
        # Sandboxes and guest MiB of spawns admitted and still running (not yet in the
        # registry): concurrent spawns must not all pass the caps on the same count.
        self._admission_lock = threading.Lock()
        self._admitted = (0, 0)
        self.max_guest_mib = (limits.max_guest_mib if limits.max_guest_mib is not None
                              else 4 * host_memory_mib())
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._reaper: threading.Thread | None = None
        # Pause, resume, set_timeout and the reaper's kill or pause of one sandbox are
        # done one at a time (so a timeout extended while the reaper looks wins).
        self._lifecycle_locks: dict[str, list[Any]] = {}   # id: [lock, users]
        self._lifecycle_locks_lock = threading.Lock()
        # VMMs stopped by a pause: their exit events are not the sandbox's end.
        self._expected_exits: set[str] = set()
        self._pausing: set[str] = set()   # guest calls are 409 meanwhile, not 502
        self._expected_lock = threading.Lock()
        self.images = ImageBuilds(store, metrics, concurrency=limits.image_builds,
                                  retry_after_s=limits.retry_after_s)
        metrics.set_sources(lambda: registry.count_sandboxes(RUNNING), self.snapshot_counts,
                            lambda: self._branches_in_flight)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Reconcile the registry with the zygote and the store, then watch for exits."""
        failed = self.registry.fail_orphaned_snapshot_jobs(os.getpid())
        if failed:
            log.warning("snapshots left writing by a previous daemon marked failed: %s",
                        ", ".join(failed))
        self.store.cleanup_stale()
        # Holds of spawns a previous daemon did not finish: nothing runs on them.
        self.registry.release_volumes_of_unfinished_spawns()
        if self.spawner is None:
            lost = self.registry.mark_all_running_lost(
                "no-spawner", "this daemon runs without a spawner, so it cannot reach the "
                "sandboxes of a previous daemon; delete this entry")
            if lost:
                log.warning("%d sandboxes of a previous daemon marked lost", len(lost))
            self._start_networks()
            return
        self.reconcile()
        self._start_networks()
        self._watcher = threading.Thread(target=self._watch_exits, name="exit-watcher",
                                         daemon=True)
        self._watcher.start()
        # Deadlines are in the registry: ones that passed while no daemon ran are acted
        # on in the first cycle.
        self._reaper = threading.Thread(target=self._reap_expired_loop, name="reaper",
                                        daemon=True)
        self._reaper.start()

    def reconcile(self) -> dict[str, list[str]]:
        """Match the registry's running sandboxes with the zygote's children (see the
        module docstring). Returns the ids adopted, lost and killed."""
        spawner = self._spawner()
        live = {c.vm_id: c for c in spawner.children()}
        ended = spawner.exit_descriptions()
        adopted: list[str] = []
        lost: list[str] = []
        for record in self.registry.list_sandboxes(RUNNING):
            child = live.get(record.id)
            if child is not None and child.run_dir == record.run_dir:
                del live[record.id]
                adopted.append(record.id)
                continue
            how = ended.get(record.id)
            description = (f"ended while no daemon was running: {how}" if how else
                           "its VMM process was gone when the daemon restarted (the zygote "
                           "stopped: no daemon held its lease, or the host rebooted)")
            if self.registry.mark_ended(record.id, LOST, "daemon-restart", description):
                self.metrics.sandbox_exits.inc(reason="lost")
            self.registry.release_volumes(f"sandbox:{record.id}")
            lost.append(record.id)
        killed = []
        for vm_id in live:  # forked by a spawn the crash cut short: nobody knows them
            try:
                spawner.kill(vm_id)
                killed.append(vm_id)
            except SpawnerError as err:
                log.error("cannot kill unknown sandbox %s: %s", vm_id, err)
        keep = {r.run_dir for r in self.registry.list_sandboxes(RUNNING)}
        removed = spawner.clean_run_dirs(keep)
        if adopted or lost or killed or removed:
            log.warning("reconciled with the zygote: %d sandboxes re-adopted, %d lost, %d "
                        "unknown killed, %d stale run directories removed", len(adopted),
                        len(lost), len(killed), len(removed))
        return {"adopted": adopted, "lost": lost, "killed": killed}

    def _start_networks(self) -> None:
        if self.networks is None:
            return
        try:
            # A paused sandbox keeps its network for its resume.
            self.networks.start({r.id for r in self.registry.list_sandboxes(RUNNING)}
                                | {r.id for r in self.registry.list_sandboxes(PAUSED)})
        except Exception as err:  # noqa: BLE001 - serve without networks, say why
            log.error("sandboxes get no networks of their own (per_child_netns is refused): "
                      "host networking failed to start: %s", err)
            self.networks.host.close(destroy_children=False)
            self.networks = None

    def _release_sandbox(self, sandbox_id: str) -> None:
        """Let go of what a sandbox that ended held: its network and its read-write
        volumes (a workspace's stay held by the workspace)."""
        if self.networks is not None:
            self.networks.release(sandbox_id)
        self.registry.release_volumes(f"sandbox:{sandbox_id}")

    def stop(self, kill_sandboxes: bool = False) -> None:
        """Stop watching and let go of the zygote. Sandboxes keep running for the next
        daemon (within the zygote's lease) unless ``kill_sandboxes``."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
        if self._reaper is not None:
            self._reaper.join(60.0)   # a pause in progress finishes its snapshot
        for thread in list(self._branch_threads):
            thread.join(60.0)  # a wait:false BRANCH finishing its files
        self.images.stop()
        if self.spawner is not None:
            self.spawner.close(kill_sandboxes=kill_sandboxes)
        if kill_sandboxes:
            for record in self.registry.list_sandboxes(RUNNING):
                self.registry.mark_ended(record.id, EXITED, "daemon-stopped",
                                         "the daemon shut down and stopped its sandboxes")
        if self.networks is not None:
            self.networks.close(destroy=kill_sandboxes)

    def _watch_exits(self) -> None:
        assert self.spawner is not None
        while not self._stop.wait(0.2):
            try:
                notices = self.spawner.exits()
            except SpawnerGone as err:
                self._zygote_died(str(err))
                continue
            except Exception as err:  # noqa: BLE001 - keep watching; say why once a cycle
                log.error("cannot read sandbox exit events: %s", err)
                continue
            for notice in notices:
                with self._expected_lock:
                    if notice.vm_id in self._expected_exits:
                        self._expected_exits.discard(notice.vm_id)
                        continue   # a pause stopped it
                record = self.registry.get_sandbox(notice.vm_id)
                if record is not None and (record.status == PAUSED or (
                        notice.pid is not None and notice.pid != record.pid)):
                    continue   # paused, or the VMM of before a pause: not its end
                self._release_sandbox(notice.vm_id)
                if self.registry.mark_ended(notice.vm_id, EXITED, notice.reason,
                                            notice.description):
                    self.metrics.sandbox_exits.inc(reason=notice.reason)
                    log.info("sandbox %s ended: %s", notice.vm_id, notice.description)

    def _zygote_died(self, why: str) -> None:
        assert self.spawner is not None
        log.error("%s; its sandboxes died with it, starting a new zygote", why)
        for record in self.registry.list_sandboxes(RUNNING):
            self._release_sandbox(record.id)
            if self.registry.mark_ended(record.id, LOST, "zygote-died",
                                        f"{why}; the sandbox died with it"):
                self.metrics.sandbox_exits.inc(reason="lost")
        try:
            self.spawner.revive()
        except Exception as err:  # noqa: BLE001 - retried on the next cycle
            log.error("cannot start a new zygote: %s", err)

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

    @contextmanager
    def _admission(self, n: int, mem_mib: int, tag: str) -> Iterator[None]:
        """Admit ``n`` sandboxes of ``mem_mib`` each under the daemon-wide caps, or raise
        ``QuotaExceeded`` (429) saying which cap and how much is in use."""
        with self._admission_lock:
            running = self.registry.list_sandboxes(RUNNING)
            sizes: dict[str, int] = {}
            for record in running:
                if record.snapshot_tag not in sizes:
                    try:
                        sizes[record.snapshot_tag] = self.store.get(record.snapshot_tag
                                                                    ).meta.mem_mib
                    except (SnapshotNotFound, SnapshotCorrupt, ValueError):
                        sizes[record.snapshot_tag] = 0   # deleted since: its size unknown
            count = len(running) + self._admitted[0]
            committed = sum(sizes[r.snapshot_tag] for r in running) + self._admitted[1]
            cap = self.limits.max_sandboxes
            if count + n > cap:
                raise QuotaExceeded(
                    f"spawn {n} sandboxes of {tag!r}: {count} of this daemon's {cap} "
                    "sandboxes are running or starting; delete some, or raise the cap "
                    "(vmfork serve --max-sandboxes)",
                    extra={"quota": "sandboxes", "in_use": count, "limit": cap})
            if committed + n * mem_mib > self.max_guest_mib:
                raise QuotaExceeded(
                    f"spawn {n} sandboxes of {tag!r} ({mem_mib} MiB of guest RAM each): "
                    f"{committed} MiB of this daemon's {self.max_guest_mib} MiB of guest "
                    "RAM are committed; delete some sandboxes, or raise the cap "
                    "(vmfork serve --max-guest-memory-mib)",
                    extra={"quota": "guest_memory_mib", "in_use": committed,
                           "limit": self.max_guest_mib})
            self._admitted = (self._admitted[0] + n, self._admitted[1] + n * mem_mib)
        try:
            yield
        finally:
            with self._admission_lock:
                self._admitted = (self._admitted[0] - n, self._admitted[1] - n * mem_mib)

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

    def list_snapshots(self) -> list[dict[str, Any]]:
        # Jobs first, the store second: a job publishes its snapshot before it is
        # marked finished, so one that finishes between the two reads is in the store
        # by the second. In the other order it could be in neither (seen: a wait:false
        # BRANCH that completed mid-listing was missing from the list).
        jobs = self.registry.list_snapshot_jobs()
        out = [self._snapshot_info(s) for s in self.store.list()]
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
        self._ready_snapshot(tag)
        try:
            return chains.snapshot_info(self.store, tag)
        except SnapshotNotFound as err:
            raise NotFound(str(err)) from err
        except SnapshotCorrupt as err:
            raise Conflict(str(err)) from err

    def compact_snapshot(self, tag: str, to: str) -> dict[str, Any]:
        """Publish ``to``: ``tag``'s chain as one flat snapshot (atomically)."""
        self._ready_snapshot(tag)
        if self.store.exists(to):
            raise Conflict(f"snapshot tag {to!r} already exists; choose another tag or delete "
                           f"it first (DELETE /v1/snapshots/{to})")
        with self._heavy_slot(f"compact snapshot {tag!r}"):
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
        return self._snapshot_info(snap)

    def pack_snapshot(self, tag: str, *, with_image: bool) -> Path:
        """``tag``'s chain (and its image) as a pack in a private temporary file of the
        store's, which the caller streams and removes. A heavy operation: compression
        takes a core for as long as the chain is large."""
        from vmfork.store import packs
        self._ready_snapshot(tag)
        with self._heavy_slot(f"pack snapshot {tag!r}"):
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
                if err.status < 500:  # refused before anything started: nothing to show
                    self.registry.forget_snapshot_job(tag)
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

    # -- sandboxes ------------------------------------------------------------------

    @staticmethod
    def sandbox_info(r: SandboxRecord) -> dict[str, Any]:
        info: dict[str, Any] = {
            "id": r.id, "snapshot_tag": r.snapshot_tag, "netns": None, "guest_addr": None,
            "created_at_unix": int(r.created_at), "pid": r.pid,
            "memory_limit_mib": r.memory_limit_mib, "has_branched": r.branch_count > 0,
            "last_branch_memory_path": r.last_branch_memory_path,
            "branch_count": r.branch_count, "status": r.status,
            # vmfork's lifecycle extensions (issue 15; docs/e2b.md). envs are not
            # shown (they may hold secrets): only their names.
            "timeout_secs": r.timeout_secs, "end_at_unix": r.end_at,
            "on_timeout": r.on_timeout, "metadata": r.metadata,
            "env_names": sorted(r.envs), "volumes": r.volumes,
            "paused_snapshot": r.paused_tag if r.status == PAUSED else None,
            "paused_at_unix": r.paused_at}
        if r.status not in (RUNNING, PAUSED):
            info["exit_reason"] = r.exit_reason
            info["exit_description"] = r.exit_description
        return info

    def _with_network(self, info: dict[str, Any]) -> dict[str, Any]:
        """forkd's ``netns``/``guest_addr`` (the address the host reaches the guest at)
        and vmfork's ``network`` (egress, published ports) for a networked sandbox."""
        described = None if self.networks is None else self.networks.describe(info["id"])
        if described is not None:
            info.update(netns=described["netns"], guest_addr=described["address"],
                        network=described)
        return info

    def _spawner(self) -> Spawner:
        if self.spawner is None:
            raise BadGateway("this daemon runs without a spawner (no sandboxes); start it "
                             "with `vmfork serve` on a host with KVM")
        return self.spawner

    def create_sandboxes(self, body: dict[str, Any], *,
                         workspace: str | None = None) -> list[dict[str, Any]]:
        """``workspace``: the spawn is that workspace's sandbox (its read-write volumes
        are held by the workspace, and a suspension snapshot's are reopened)."""
        for flag, why in (("live_fork", ("children always map the snapshot copy-on-write; "
                                         "forkd's live_fork copies RAM per child and is not "
                                         "offered")),
                          ("hugepages", "hugepage-backed guest RAM is not implemented yet")):
            if body[flag]:
                raise BadRequest(f"{flag}=true is not supported: {why}; omit it")
        tag = body["snapshot_tag"]
        n = body["n"]
        snap = self._ready_snapshot(tag)
        try:
            # A diff snapshot's memory is mapped from its ancestors' files: refuse (409)
            # rather than map files that are not the ones its plan was computed on.
            chains.check_plan(self.store, snap)
        except SnapshotCorrupt as err:
            raise Conflict(str(err)) from err
        spawner = self._spawner()
        network_args = self._network_args(body, snap)
        new_volumes, reopened = self._spawn_volumes(body, snap, workspace)
        # Only when there are any: a spawner from before volumes takes no such argument.
        volume_args: dict[str, Any] = ({"volumes": [*new_volumes, *reopened]}
                                       if new_volumes or reopened else {})
        with self._heavy_slot(f"spawn {n} sandboxes of {tag!r}"), \
                self._admission(n, snap.meta.mem_mib, tag), \
                volumes.held(self.registry, new_volumes, secrets.token_hex(6)) as holder:
            started = time.time()
            try:
                outcome = spawner.spawn(snap, n, body["memory_limit_mib"], **network_args,
                                        **volume_args)
            except SpawnerError as err:
                self.metrics.spawn_seconds.observe(time.time() - started, outcome="failed")
                raise BadGateway(str(err)) from err
            if outcome.failed:
                for child in outcome.children:
                    spawner.kill(child.vm_id)
                if self.networks is not None:
                    self.networks.destroy_unregistered(
                        [c.network for c in outcome.children if c.network is not None])
                self.metrics.spawn_seconds.observe(outcome.ready_s, outcome="failed")
                reasons = "; ".join(f"{vm}: {why}" for vm, why in outcome.failed[:5])
                raise BadGateway(
                    f"{len(outcome.failed)} of {n} sandboxes of {tag!r} failed to start "
                    f"({reasons}); none were kept. See the daemon log and the snapshot's "
                    "health (GET /v1/snapshots/{tag}/info)",
                    extra={"failed": [{"id": vm, "reason": why} for vm, why in outcome.failed]})
            timeout = body.get("timeout_secs")
            listed = self._volumes_listed(snap, [*new_volumes, *reopened])
            records = [SandboxRecord(id=c.vm_id, snapshot_tag=tag, pid=c.pid,
                                     run_dir=c.run_dir, status=RUNNING, created_at=started,
                                     memory_limit_mib=body["memory_limit_mib"],
                                     timeout_secs=timeout,
                                     end_at=None if timeout is None else started + timeout,
                                     on_timeout=body.get("on_timeout") or "kill",
                                     metadata=dict(body.get("metadata") or {}),
                                     envs=dict(body.get("envs") or {}), volumes=listed)
                       for c in outcome.children]
            if self.networks is not None:
                for child in outcome.children:
                    if child.network is not None:
                        self.networks.register(child.vm_id, child.network)
            self.registry.add_sandboxes(records)
            self.registry.move_volume_holds(
                holder, f"workspace:{workspace}" if workspace else f"sandbox:{records[0].id}")
        self.metrics.spawn_seconds.observe(outcome.ready_s, outcome="ok")
        self.metrics.restore_seconds.observe(outcome.restored_s)
        self.metrics.sandboxes_spawned.inc(len(records))
        # An extension beside forkd's fields: this request's spawn timings.
        timings = {"spawn_ms": round(outcome.spawn_s * 1000, 3),
                   "restored_ms": round(outcome.restored_s * 1000, 3),
                   "ready_ms": round(outcome.ready_s * 1000, 3)}
        return [{**self._with_network(self.sandbox_info(r)), "timings": timings}
                for r in records]

    @staticmethod
    def _volumes_listed(snap: Snapshot, attached: list[PreparedVolume]
                        ) -> list[dict[str, Any]]:
        """A sandbox's volumes as ``SandboxInfo`` lists them: its snapshot's own (read-only,
        every child has them) and those its spawn attached or reopened."""
        own = [{"source": v["source"], "guest_path": v["guest_path"], "mode": "ro",
                "from_snapshot": True} for v in snap.meta.extra.get("volumes", [])]
        given = {v.guest_path: {"source": v.source, "guest_path": v.guest_path,
                                "mode": "ro" if v.read_only else "rw",
                                "from_snapshot": False} for v in attached}
        return [v for v in own if v["guest_path"] not in given] + list(given.values())

    def _spawn_volumes(self, body: dict[str, Any], snap: Snapshot, workspace: str | None
                       ) -> tuple[list[PreparedVolume], list[PreparedVolume]]:
        """The volumes a spawn attaches (parsed, checked against the snapshot's slots,
        their disks made), and the read-write files of the snapshot's own slots that a
        workspace's sandbox reopens. Refuses (before anything starts) what cannot be."""
        where = "volumes"
        specs = volumes.parse_request(body.get("volumes"), where)
        slots = volumes.snapshot_slots(snap)
        rw_slots = [s for s in slots if s.key and not s.read_only]
        reopened: list[PreparedVolume] = []
        if rw_slots:
            mine = ({v.key: v for v in volumes.held_volumes(self.registry,
                                                            f"workspace:{workspace}")}
                    if workspace else {})
            missing = [s for s in rw_slots if s.key not in mine]
            if missing:
                raise Conflict(f"snapshot {snap.tag!r} holds the read-write volume at "
                               f"{missing[0].guest_path} of the workspace it suspends; "
                               "resume that workspace (POST /v1/workspaces/{name}/resume) "
                               "instead of spawning it")
            reopened = [mine[s.key] for s in rw_slots]
        if not specs:
            return [], reopened
        volumes.check_fits(snap, slots, specs, where)
        if body["n"] > 1 and any(not s.read_only for s in specs):
            raise Conflict(f"{where}: a read-write volume belongs to one sandbox, and n is "
                           f"{body['n']}; spawn it with n=1 (read-only volumes are shared "
                           "by any number)")
        prepared = volumes.prepare_all(specs, where)
        rw_keys = [v.key for v in prepared if not v.read_only]
        if len(set(rw_keys)) != len(rw_keys):
            raise BadRequest(f"{where}: the same read-write file is given twice")
        return prepared, reopened

    def _network_args(self, body: dict[str, Any], snap: Snapshot) -> dict[str, Any]:
        """The spawner's network arguments for ``per_child_netns``/``egress``; refuses
        (before anything starts) what cannot get a network."""
        egress = egress_policy(body.get("egress"))
        if not body["per_child_netns"]:
            if egress is not None:
                raise BadRequest("egress applies to a sandbox's own network: add "
                                 "per_child_netns=true, or drop egress")
            return {}
        if self.networks is None:
            raise NotImplementedApi("per_child_netns=true: this daemon runs without host "
                                    "networking (it needs root: CAP_NET_ADMIN, "
                                    "CAP_SYS_ADMIN); omit per_child_netns")
        if not snapshot_has_network(snap):
            raise Conflict(f"snapshot {snap.tag!r} has no network device, so its sandboxes "
                           "cannot be given networks; create a snapshot with network=true "
                           "(`vmfork snapshot --network`) and spawn that one")
        if egress is not None and egress.domains:
            try:
                egress.resolve()  # a name that does not resolve: refused before the spawn
            except NetworkError as err:
                raise Unprocessable(f"egress: {err}") from err
        return {"network": self.networks.host, "egress": egress}

    def list_sandboxes(self, metadata: dict[str, str] | None = None,
                       states: set[str] | None = None) -> list[dict[str, Any]]:
        """Every sandbox, or those whose metadata has every pair of ``metadata`` and
        whose status is one of ``states``."""
        wanted = (metadata or {}).items()
        return [self._with_network(self.sandbox_info(r))
                for r in self.registry.list_sandboxes()
                if (states is None or r.status in states)
                and all(r.metadata.get(k) == v for k, v in wanted)]

    def _record(self, sandbox_id: str) -> SandboxRecord:
        record = self.registry.get_sandbox(sandbox_id)
        if record is None:
            raise NotFound(f"no sandbox {sandbox_id!r}; GET /v1/sandboxes lists them")
        return record

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return self._with_network(self.sandbox_info(self._record(sandbox_id)))

    def sandbox_run_dir(self, sandbox_id: str) -> str:
        """Where the sandbox's VMM keeps its files (its console log among them)."""
        return self._record(sandbox_id).run_dir

    def delete_sandbox(self, sandbox_id: str) -> None:
        with self._lifecycle(sandbox_id):
            record = self._record(sandbox_id)
            if record.status == RUNNING:
                try:
                    self._spawner().kill(sandbox_id)
                except SpawnerError as err:
                    raise BadGateway(str(err)) from err
                if self.registry.mark_ended(sandbox_id, EXITED, "killed",
                                            "deleted through the API"):
                    self.metrics.sandbox_exits.inc(reason="killed")
            self._release_sandbox(sandbox_id)
            self.registry.remove_sandbox(sandbox_id)
            self._drop_pause_snapshots(record)

    def _drop_pause_snapshots(self, record: SandboxRecord) -> None:
        """Delete the snapshots this sandbox's pauses made (``pause-<id>-*``): a diff
        pause of a resumed sandbox builds on the previous one, so dependents go first
        (each round deletes those nothing depends on any more)."""
        prefix = f"{PAUSE_TAG_PREFIX}{record.id}-"
        left = [s.tag for s in self.store.list() if s.tag.startswith(prefix)]
        while left:
            kept = []
            for tag in left:
                try:
                    self.store.delete(tag)
                except SnapshotNotFound:
                    pass
                except HasDependents:
                    kept.append(tag)
                except StoreError as err:
                    log.warning("cannot delete %s, a pause snapshot of %s: %s", tag,
                                record.id, err)
            if len(kept) == len(left):   # what depends on them is not this sandbox's
                log.warning("pause snapshots of %s kept (other snapshots depend on them): "
                            "%s", record.id, ", ".join(kept))
                return
            left = kept

    # -- lifecycle: timeouts, pause/resume, envs, metrics (issue 15) ---------------------

    @contextmanager
    def _lifecycle(self, sandbox_id: str) -> Iterator[None]:
        """One lifecycle change of a sandbox at a time (pause, resume, set_timeout,
        delete, the reaper's action)."""
        with self._lifecycle_locks_lock:
            entry = self._lifecycle_locks.setdefault(sandbox_id, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lifecycle_locks_lock:   # the last user forgets it
                entry[1] -= 1
                if entry[1] == 0:
                    del self._lifecycle_locks[sandbox_id]

    def command_env(self, sandbox_id: str, env: dict[str, Any] | None
                    ) -> dict[str, Any] | None:
        """The environment of one command: the sandbox's ``envs`` (given at spawn), then
        the command's own (which wins; a null value unsets)."""
        record = self.registry.get_sandbox(sandbox_id)
        if record is None or not record.envs:
            return env
        return {**record.envs, **(env or {})}

    def set_timeout(self, sandbox_id: str, timeout_secs: float | None) -> dict[str, Any]:
        """E2B's ``set_timeout``: the sandbox ends ``timeout_secs`` from now (kill or
        pause, as spawned); None: never. Shortening is allowed, as in E2B."""
        with self._lifecycle(sandbox_id):
            record = self._record(sandbox_id)
            if record.status != RUNNING:
                raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); "
                               "only a running sandbox has a timeout (a paused one waits "
                               "for its resume, which takes a timeout)")
            end_at = None if timeout_secs is None else time.time() + timeout_secs
            if not self.registry.set_timeout(sandbox_id, timeout_secs, end_at):
                raise Conflict(f"sandbox {sandbox_id!r} stopped running meanwhile")
            return self.get_sandbox(sandbox_id)

    def _reap_expired_loop(self) -> None:
        while not self._stop.wait(REAPER_INTERVAL_S):
            try:
                self.reap_expired()
            except Exception as err:  # noqa: BLE001 - keep reaping; say why once a cycle
                log.error("the reaper failed a cycle: %s", err)

    def reap_expired(self, now: float | None = None) -> list[str]:
        """End (kill, or pause if spawned with on_timeout=pause) up to
        ``REAP_PER_CYCLE`` running sandboxes whose deadline passed. Each is re-checked
        under its lifecycle lock: one whose timeout was extended since is left alone.
        Returns the ids acted on."""
        done = []
        for record in self.registry.expired(time.time() if now is None else now)[
                :REAP_PER_CYCLE]:
            if self._stop.is_set():
                break
            with self._lifecycle(record.id):
                if not self.registry.claim_expired(record.id, record.end_at or 0.0):
                    continue   # extended, deleted or ended meanwhile
                if record.on_timeout == "pause":
                    try:
                        self._pause_locked(record.id)
                    except Exception as err:  # noqa: BLE001 - it must not outlive its deadline
                        log.error("sandbox %s timed out but could not be paused (%s); it is "
                                  "killed instead", record.id,
                                  err.message if isinstance(err, ApiError) else err)
                        self._kill_expired(record)
                else:
                    self._kill_expired(record)
                done.append(record.id)
                self.metrics.sandbox_exits.inc(reason=f"timeout-{record.on_timeout}")
        return done

    def _kill_expired(self, record: SandboxRecord) -> None:
        # Marked first, so the exit watcher does not record it as merely killed.
        self.registry.mark_ended(record.id, EXITED, "timeout",
                                 f"its timeout of {record.timeout_secs} s passed; the "
                                 "reaper killed it")
        try:
            self._spawner().kill(record.id)
        except SpawnerError as err:
            log.error("cannot kill the expired sandbox %s: %s", record.id, err)
        self._release_sandbox(record.id)
        log.info("sandbox %s timed out and was killed", record.id)

    def pause_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        """Capture the sandbox (a diff snapshot on the one it runs from), stop its VMM,
        and keep its id, network, read-write volumes and metadata for ``resume``."""
        with self._lifecycle(sandbox_id):
            record = self._record(sandbox_id)
            if record.status == PAUSED:
                return self.get_sandbox(sandbox_id)
            self._pause_locked(sandbox_id)
            return self.get_sandbox(sandbox_id)

    def _pause_locked(self, sandbox_id: str) -> None:
        record = self._record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); only "
                           "a running sandbox can be paused")
        tag = f"{PAUSE_TAG_PREFIX}{sandbox_id}-{secrets.token_hex(3)}"
        branch = {"tag": tag, "mode": "diff", "wait": True, "measure_diff": False,
                  "parent_tag": None, "diff": False, "live": False}
        with self._expected_lock:
            self._pausing.add(sandbox_id)
        try:
            try:
                self.branch_sandbox(sandbox_id, branch, suspending=True)
            except Conflict as err:
                # A diff cannot be made (its chain is as deep as allowed, or it has no
                # base): a full capture instead.
                log.info("pause of %s: %s; capturing it whole", sandbox_id, err.message)
                self.branch_sandbox(sandbox_id, {**branch, "mode": "full"}, suspending=True)
            # In the registry first: from here a restarted daemon knows it is paused
            # (and kills a VMM still running under its id as one nobody knows).
            self.registry.mark_paused(sandbox_id, tag)
            with self._expected_lock:
                self._expected_exits.add(sandbox_id)
            try:
                self._spawner().kill(sandbox_id)
            except SpawnerError as err:
                log.error("paused sandbox %s: its VMM could not be stopped: %s", sandbox_id,
                          err)
        finally:
            with self._expected_lock:
                self._pausing.discard(sandbox_id)
        log.info("sandbox %s paused into %s", sandbox_id, tag)

    def resume_sandbox(self, sandbox_id: str, timeout_secs: float | None = None
                       ) -> dict[str, Any]:
        """Restore a paused sandbox from its pause snapshot into the same id (and its
        network, volumes, metadata, envs); its timeout starts again: ``timeout_secs``,
        else the one it had. A running sandbox is returned as it is."""
        with self._lifecycle(sandbox_id):
            record = self._record(sandbox_id)
            if record.status == RUNNING:
                return self.get_sandbox(sandbox_id)
            if record.status != PAUSED or record.paused_tag is None:
                raise Conflict(f"sandbox {sandbox_id!r} is not paused ({record.status}); "
                               "only a paused sandbox can be resumed")
            snap = self._ready_snapshot(record.paused_tag)
            try:
                chains.check_plan(self.store, snap)
            except SnapshotCorrupt as err:
                raise Conflict(str(err)) from err
            spawner = self._spawner()
            kwargs: dict[str, Any] = {"vm_ids": [sandbox_id]}
            network = None if self.networks is None else self.networks.get(sandbox_id)
            if network is not None:
                kwargs["networks"] = [network]
            reopened = [v for v in volumes.held_volumes(self.registry, f"sandbox:{sandbox_id}")
                        if any(s.key == v.key for s in volumes.snapshot_slots(snap))]
            if reopened:
                kwargs["volumes"] = reopened
            with self._heavy_slot(f"resume sandbox {sandbox_id}"), \
                    self._admission(1, snap.meta.mem_mib, snap.tag):
                try:
                    outcome = spawner.spawn(snap, 1, record.memory_limit_mib, **kwargs)
                except SpawnerError as err:
                    raise BadGateway(f"resume of {sandbox_id}: {err}; it stays paused") from err
                if outcome.failed or not outcome.children:
                    for child in outcome.children:
                        with self._expected_lock:
                            self._expected_exits.add(child.vm_id)
                        spawner.kill(child.vm_id)
                    reasons = "; ".join(why for _, why in outcome.failed[:3])
                    raise BadGateway(f"resume of {sandbox_id} failed ({reasons}); it stays "
                                     "paused, see the daemon log")
                child = outcome.children[0]
                timeout = timeout_secs if timeout_secs is not None else record.timeout_secs
                end_at = None if timeout is None else time.time() + timeout
                self.registry.mark_resumed(sandbox_id, child.pid, child.run_dir, timeout,
                                           end_at)
            self.metrics.restore_seconds.observe(outcome.restored_s)
            log.info("sandbox %s resumed from %s", sandbox_id, record.paused_tag)
            info = self.get_sandbox(sandbox_id)
            info["timings"] = {"spawn_ms": round(outcome.spawn_s * 1000, 3),
                               "restored_ms": round(outcome.restored_s * 1000, 3),
                               "ready_ms": round(outcome.ready_s * 1000, 3)}
            return info

    def connect_sandbox(self, sandbox_id: str, timeout_secs: float | None = None
                        ) -> dict[str, Any]:
        """E2B's ``connect``: resume a paused sandbox; for a running one, a
        ``timeout_secs`` only ever extends its deadline (never shortens it)."""
        record = self._record(sandbox_id)
        if record.status == PAUSED:
            return self.resume_sandbox(sandbox_id, timeout_secs)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}: "
                           f"{record.exit_description}); it cannot be connected to")
        if timeout_secs is not None and record.end_at is not None:
            with self._lifecycle(sandbox_id):
                current = self._record(sandbox_id)
                if current.end_at is not None and current.end_at < time.time() + timeout_secs:
                    self.registry.set_timeout(sandbox_id, timeout_secs,
                                              time.time() + timeout_secs)
        return self.get_sandbox(sandbox_id)

    def sandbox_metrics(self, sandbox_id: str, *, disk: bool = True) -> dict[str, Any]:
        """What a sandbox uses, measured from the host (its VMM's process and memory
        cgroup) and, for the disk (unless ``disk`` is false), by the guest's statfs of
        its root."""
        record = self._record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); a "
                           "stopped VMM uses nothing")
        out: dict[str, Any] = {"sandbox_id": sandbox_id, "timestamp_unix": time.time()}
        out.update(_process_usage(record.pid))
        out["memory_cgroup_bytes"] = _cgroup_memory(sandbox_id)
        try:
            out["guest_mem_mib"] = self.store.get(record.snapshot_tag).meta.mem_mib
        except (SnapshotNotFound, SnapshotCorrupt, ValueError):
            out["guest_mem_mib"] = None
        if disk:
            out.update(self._guest_disk(sandbox_id))
        return out

    def _guest_disk(self, sandbox_id: str) -> dict[str, Any]:
        agent = self.agent(sandbox_id)
        with agent_errors(sandbox_id, "metrics"):
            try:
                result = agent.exec(["python3", "-I", "-S", "-c", _STATFS_CODE], timeout=10.0,
                                    max_output=4096)
            except AgentError as err:
                if err.code != "not_found":
                    raise
                return {"disk_total_bytes": None, "disk_used_bytes": None}
        fields = result.stdout.split()
        if result.exit_code != 0 or len(fields) != 4:
            return {"disk_total_bytes": None, "disk_used_bytes": None}
        total, avail, files, ffree = (int(f) for f in fields)
        return {"disk_total_bytes": total, "disk_used_bytes": total - avail,
                "disk_inodes_used": files - ffree}

    # -- networks of sandboxes (per_child_netns) ---------------------------------------

    def _networked(self, sandbox_id: str) -> SandboxNetworks:
        record = self._record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); its "
                           "network is gone")
        if self.networks is None:
            raise Conflict(f"sandbox {sandbox_id} has no network of its own: this daemon "
                           "runs without host networking")
        return self.networks

    def list_ports(self, sandbox_id: str) -> list[dict[str, Any]]:
        return self._networked(sandbox_id).ports(sandbox_id)

    def expose_port(self, sandbox_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._networked(sandbox_id).expose(sandbox_id, body["guest_port"],
                                                  body["host_port"], body["protocol"])

    def unexpose_port(self, sandbox_id: str, host_port: int, protocol: str) -> None:
        self._networked(sandbox_id).unexpose(sandbox_id, host_port, protocol)

    def set_egress(self, sandbox_id: str, body: dict[str, Any]) -> dict[str, Any]:
        policy = egress_policy(body)
        assert policy is not None
        return self._networked(sandbox_id).set_egress(sandbox_id, policy)

    def agent(self, sandbox_id: str) -> AgentClient:
        record = self._record(sandbox_id)
        if record.status == PAUSED or sandbox_id in self._pausing:
            raise Conflict(f"sandbox {sandbox_id!r} is paused (or being paused); resume it "
                           f"first (POST /v1/sandboxes/{sandbox_id}/resume, or .../connect)")
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
                streamed = on_stdout is not None or on_stderr is not None
                # A streamed exec's output went to the client as it came; a bounded
                # head is still kept, for the error of one that times out.
                result = agent.exec(body["args"], env=self.command_env(sandbox_id,
                                                                      body["env"]),
                                    cwd=body["cwd"],
                                    stdin=body["stdin"], timeout=timeout,
                                    on_stdout=on_stdout, on_stderr=on_stderr,
                                    max_output=(STREAMED_KEPT_BYTES if streamed
                                                else self.limits.exec_output_bytes))
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
            listing = self.agent(sandbox_id).list_dir_bounded(path, self.limits.list_entries)
        return {"path": path, "entries": [file_info_json(e) for e in listing.entries],
                "truncated": listing.truncated}

    def remove_file(self, sandbox_id: str, query: dict[str, Any]) -> None:
        with agent_errors(sandbox_id, "remove"):
            self.agent(sandbox_id).remove(query["path"], recursive=query["recursive"],
                                          missing_ok=query["missing_ok"])


    # -- BRANCH -----------------------------------------------------------------------

    @staticmethod
    def branch_mode(body: dict[str, Any]) -> str:
        """forkd's ``mode``, or its legacy ``diff``/``live`` booleans (live implies a
        diff capture); a ``mode`` that contradicts the booleans is refused."""
        legacy = "live" if body["live"] else "diff" if body["diff"] else None
        mode = body["mode"]
        if mode is not None and legacy is not None and mode != legacy:
            raise BadRequest(f"mode {mode!r} contradicts the legacy flags (diff={body['diff']}, "
                             f"live={body['live']}); give mode alone")
        mode = mode or legacy or "full"
        if mode == "full" and body["parent_tag"] is not None:
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

    def branch_sandbox(self, sandbox_id: str, body: dict[str, Any], *,
                       suspending: bool = False) -> tuple[int, dict[str, Any]]:
        """Snapshot a running sandbox as ``tag`` (201 with ``SnapshotInfo`` and
        ``pause_ms``), or with ``wait: false`` start it and answer 202 with status
        ``writing`` (poll GET /v1/snapshots until ``ready`` or ``failed``)."""
        mode = self.branch_mode(body)
        record = self._record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); only a "
                           "running sandbox can be branched")
        if not suspending:
            self._refuse_branch_with_rw_volume(sandbox_id)
        self._spawner()  # 502 now if this daemon has none, before any tag is claimed
        tag = body["tag"] or self._branch_tag(record)
        if body["parent_tag"] is not None:
            self._ready_snapshot(body["parent_tag"])  # 404/409 before anything starts
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
            self._branches_in_flight += 1
        started = time.time()

        def work() -> dict[str, Any]:
            try:
                return self._branch(record, mode, body, pending)
            finally:
                with self._branch_lock:
                    self._branches_in_flight -= 1
                self._branches.release()

        if body["wait"]:
            return 201, work()

        def background() -> None:
            try:
                work()
            except ApiError as err:
                log.warning("BRANCH %s of %s failed: %s", tag, sandbox_id, err.message)
            finally:
                self._branch_threads.remove(threading.current_thread())

        thread = threading.Thread(target=background, name=f"branch-{tag}", daemon=True)
        self._branch_threads.append(thread)
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

    def _branch(self, record: SandboxRecord, mode: str, body: dict[str, Any],
                pending: PendingSnapshot) -> dict[str, Any]:
        """Have the spawner capture the sandbox into ``pending`` and publish it
        (``runtime.branch``: the VMM's control op, a diff resolved into a spawnable
        head, content hashes). Any failure aborts ``pending`` (nothing partial is ever
        listed as ready) and leaves the job ``failed`` with the reason."""
        tag = pending.tag
        spawner = self._spawner()
        try:
            try:
                result = spawner.branch(record.run_dir, self.store, pending, mode,
                                        parent_tag=body["parent_tag"], sandbox_id=record.id)
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
        info = self._snapshot_info(snap)
        info["pause_ms"] = round(result.pause_ms, 3)
        if body["measure_diff"]:
            # What this capture wrote for the memory: the changed pages of a diff, the
            # whole image otherwise (forkd's diff_* fields; measured, not estimated).
            info["diff_ms"] = round(result.total_ms, 3)
            info["diff_physical_bytes"] = result.memory_bytes
            info["diff_logical_bytes"] = (result.dirty_pages * PAGE_SIZE
                                          if result.dirty_pages is not None
                                          else result.memory_bytes)
        return info


    # -- workspaces (forkd's named, long-lived sandboxes) ----------------------------

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
                "sandbox": None if sandbox is None else self.sandbox_info(sandbox),
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
        infos = self.create_sandboxes({
            "snapshot_tag": tag, "n": 1, "per_child_netns": False,
            "memory_limit_mib": memory_limit_mib, "prewarm": False, "live_fork": False,
            "hugepages": False, "volumes": volume_items}, workspace=workspace)
        return str(infos[0]["id"])

    def create_workspace(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["name"]
        if body["per_child_netns"]:
            raise BadRequest("per_child_netns=true is not supported for workspaces yet (a "
                             "suspended workspace would lose its network); omit it, or spawn "
                             "a networked sandbox with POST /v1/sandboxes")
        with self._workspace_lock:
            if self.registry.get_workspace(name) is not None:
                raise Conflict(f"workspace {name!r} already exists; choose another name or "
                               f"delete it (DELETE /v1/workspaces/{name})")
            sandbox_id = self._spawn_one(body["snapshot_tag"], body["memory_limit_mib"], name,
                                         body.get("volumes"))
            now = time.time()
            self.registry.add_workspace(WorkspaceRecord(
                name, body["snapshot_tag"], sandbox_id, None, body["memory_limit_mib"], now,
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
            self.branch_sandbox(w.sandbox_id, {
                "tag": tag, "mode": "diff" if diff else "full", "wait": True,
                "measure_diff": False, "parent_tag": None, "diff": False, "live": False},
                suspending=True)
            self.delete_sandbox(w.sandbox_id)
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
                self.delete_sandbox(w.sandbox_id)
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


def exec_result_json(result: ExecResult) -> dict[str, Any]:
    return {"stdout": result.stdout.decode("utf-8", "replace"),
            "stderr": result.stderr.decode("utf-8", "replace"),
            "exit_code": result.exit_code, "signal": result.signal,
            "duration_secs": round(result.duration, 6), "truncated": result.truncated}


def file_info_json(info: FileInfo) -> dict[str, Any]:
    return {"name": info.name, "path": info.path, "type": info.type, "size": info.size,
            "mode": info.mode, "mtime": info.mtime, "target": info.target}


STREAMED_KEPT_BYTES = 64 << 10


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


def _process_usage(pid: int) -> dict[str, Any]:
    """CPU time (user + system, its threads and reaped children) and memory of a VMM
    process, from /proc: resident and private dirty bytes (what it does not share with
    its snapshot's page cache, i.e. what the sandbox wrote)."""
    out: dict[str, Any] = {"cpu_seconds": None, "memory_rss_bytes": None,
                           "memory_private_dirty_bytes": None}
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ticks = os.sysconf("SC_CLK_TCK")
        # After the ")": state is field 3, utime..cstime are 14..17 (1-based).
        out["cpu_seconds"] = round(sum(int(x) for x in fields[11:15]) / ticks, 3)
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "Rss":
                    out["memory_rss_bytes"] = int(value.split()[0]) * 1024
                elif key == "Private_Dirty":
                    out["memory_private_dirty_bytes"] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass   # the process went meanwhile: what was read stands
    return out


def _cgroup_memory(sandbox_id: str) -> int | None:
    """The VMM's memory cgroup's charge (memory.current, or v1's usage_in_bytes)."""
    hierarchy = cgroups.detect()
    if hierarchy is None:
        return None
    name = "memory.current" if hierarchy.version == 2 else "memory.usage_in_bytes"
    try:
        return int((cgroups.parent_path(hierarchy) / sandbox_id / name).read_text())
    except (OSError, ValueError, cgroups.CgroupError):
        return None
