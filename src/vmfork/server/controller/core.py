"""What every part of the controller shares: the store, the registry, the spawner,
the sandboxes' networks, the metrics and limits, and the locks that order work on
one sandbox or bound work on the whole host.

The resource parts (``snapshots``, ``sandboxes``, ``branches``, ``lifecycle``,
``sandbox_io``, ``workspaces``, ``reconcile``) each hold this one object rather than
each other's state: a part that needs another's operation (a workspace's suspend is a
BRANCH and a delete) is handed that part when the controller is put together.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vmfork.agent.client import (
    AgentClient,
    AgentError,
    AgentProtocolError,
    AgentTimeout,
    AgentUnavailable,
)
from vmfork.server.errors import (
    BadGateway,
    Busy,
    Conflict,
    GatewayTimeout,
    NotFound,
    QuotaExceeded,
    Unprocessable,
)
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.networking import SandboxNetworks
from vmfork.server.registry import FAILED, PAUSED, RUNNING, WRITING, Registry, SandboxRecord
from vmfork.server.spawner import Spawner
from vmfork.store import Snapshot, SnapshotCorrupt, SnapshotNotFound, Store

PAUSE_TAG_PREFIX = "pause-"   # the snapshots a sandbox's pauses make: pause-<id>-<hex>


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


def sandbox_info(r: SandboxRecord) -> dict[str, Any]:
    """forkd's ``SandboxInfo`` of a record, with vmfork's extensions."""
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


class Core:
    """The controller's shared state and the checks every part makes the same way."""

    def __init__(self, store: Store, registry: Registry, spawner: Spawner | None,
                 metrics: DaemonMetrics, limits: Limits,
                 networks: SandboxNetworks | None) -> None:
        self.store = store
        self.registry = registry
        self.spawner = spawner
        self.metrics = metrics
        self.limits = limits
        # None: this daemon gives sandboxes no networks (or they failed to start).
        self.networks = networks
        self.heavy = threading.BoundedSemaphore(limits.heavy_concurrency)
        # Sandboxes and guest MiB of spawns admitted and still running (not yet in the
        # registry): concurrent spawns must not all pass the caps on the same count.
        self._admission_lock = threading.Lock()
        self._admitted = (0, 0)
        self.max_guest_mib = (limits.max_guest_mib if limits.max_guest_mib is not None
                              else 4 * host_memory_mib())
        self.stopping = threading.Event()
        # Pause, resume, set_timeout and the reaper's kill or pause of one sandbox are
        # done one at a time (so a timeout extended while the reaper looks wins).
        self._lifecycle_locks: dict[str, list[Any]] = {}   # id: [lock, users]
        self._lifecycle_locks_lock = threading.Lock()
        # VMMs stopped by a pause: their exit events are not the sandbox's end.
        self.expected_exits: set[str] = set()
        self.pausing: set[str] = set()   # guest calls are 409 meanwhile, not 502
        self.expected_lock = threading.Lock()

    # -- look-ups that refuse with the reason -------------------------------------------

    def require_spawner(self) -> Spawner:
        if self.spawner is None:
            raise BadGateway("this daemon runs without a spawner (no sandboxes); start it "
                             "with `vmfork serve` on a host with KVM")
        return self.spawner

    def record(self, sandbox_id: str) -> SandboxRecord:
        record = self.registry.get_sandbox(sandbox_id)
        if record is None:
            raise NotFound(f"no sandbox {sandbox_id!r}; GET /v1/sandboxes lists them")
        return record

    def with_network(self, info: dict[str, Any]) -> dict[str, Any]:
        """forkd's ``netns``/``guest_addr`` (the address the host reaches the guest at)
        and vmfork's ``network`` (egress, published ports) for a networked sandbox."""
        described = None if self.networks is None else self.networks.describe(info["id"])
        if described is not None:
            info.update(netns=described["netns"], guest_addr=described["address"],
                        network=described)
        return info

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        """The sandbox's ``SandboxInfo`` (404 if there is none)."""
        return self.with_network(sandbox_info(self.record(sandbox_id)))

    def ready_snapshot(self, tag: str) -> Snapshot:
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

    def agent(self, sandbox_id: str) -> AgentClient:
        record = self.record(sandbox_id)
        if record.status == PAUSED or sandbox_id in self.pausing:
            raise Conflict(f"sandbox {sandbox_id!r} is paused (or being paused); resume it "
                           f"first (POST /v1/sandboxes/{sandbox_id}/resume, or .../connect)")
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}: "
                           f"{record.exit_description}); delete it with DELETE "
                           f"/v1/sandboxes/{sandbox_id} and spawn another")
        return self.require_spawner().agent(record.run_dir)

    def release_sandbox(self, sandbox_id: str) -> None:
        """Let go of what a sandbox that ended held: its network and its read-write
        volumes (a workspace's stay held by the workspace)."""
        if self.networks is not None:
            self.networks.release(sandbox_id)
        self.registry.release_volumes(f"sandbox:{sandbox_id}")

    # -- ordering and bounds ------------------------------------------------------------

    @contextmanager
    def heavy_slot(self, what: str) -> Iterator[None]:
        if not self.heavy.acquire(blocking=False):
            self.metrics.heavy_rejected.inc()
            raise Busy(f"{what}: {self.limits.heavy_concurrency} heavy operations (sandbox or "
                       "snapshot creation) are already running; retry after "
                       f"{self.limits.retry_after_s} s", self.limits.retry_after_s)
        try:
            yield
        finally:
            self.heavy.release()

    @contextmanager
    def admission(self, n: int, mem_mib: int, tag: str) -> Iterator[None]:
        """Admit ``n`` sandboxes of ``mem_mib`` each under the daemon-wide caps, or raise
        ``QuotaExceeded`` (429) saying which cap and how much is in use."""
        with self._admission_lock:
            running = self.registry.running_by_snapshot()
            committed = self._admitted[1]
            for snapshot_tag, children in running.items():
                try:
                    committed += children * self.store.get(snapshot_tag).meta.mem_mib
                except (SnapshotNotFound, SnapshotCorrupt, ValueError):
                    pass   # deleted since: its size unknown
            count = sum(running.values()) + self._admitted[0]
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

    @contextmanager
    def lifecycle(self, sandbox_id: str) -> Iterator[None]:
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


class Part:
    """One resource's part of the controller. It reads the shared state through its
    core (so a network manager that failed to start is gone for every part at once)."""

    def __init__(self, core: Core) -> None:
        self.core = core

    @property
    def store(self) -> Store:
        return self.core.store

    @property
    def registry(self) -> Registry:
        return self.core.registry

    @property
    def metrics(self) -> DaemonMetrics:
        return self.core.metrics

    @property
    def limits(self) -> Limits:
        return self.core.limits

    @property
    def spawner(self) -> Spawner | None:
        return self.core.spawner

    @property
    def networks(self) -> SandboxNetworks | None:
        """The sandboxes' networks; None when this daemon has none (or they failed to
        start)."""
        return self.core.networks
