"""How the controller starts and stops sandboxes: the ``Spawner`` interface and the
zygote-backed implementation.

The controller talks to this narrow interface, not to the zygote, so that unit
tests can run the whole HTTP API against a fake spawner without KVM.

``ZygoteSpawner`` and daemon restarts. The zygote (and with it every VMM child,
which dies with its zygote through PDEATHSIG) is *not* tied to the daemon: it runs
in a session of its own, on a fixed socket (``<state>/zygote.sock``), so a daemon
that stops or crashes leaves the sandboxes running, and the next daemon on the
same state directory connects to the same zygote and re-adopts them (the
controller reconciles the zygote's ``list`` with the registry). The daemon holds
the zygote's lease on one connection; a zygote whose lease nobody has held for
``lease_s`` seconds kills its children and exits, so a crashed daemon that never
comes back cannot leave VMs running forever. ``close(kill_sandboxes=True)`` stops
the zygote and every sandbox at once.

``ZygoteClient`` holds one connection and is not thread-safe, so each request
thread gets its own client; the lease connection is used only under its lock.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vmfork.agent.client import AgentClient, vsock_uds_connector
from vmfork.agent.protocol import AGENT_PORT
from vmfork.paths import private_dir
from vmfork.runtime.branch import BranchResult, branch_into_pending
from vmfork.runtime.network import ChildNetwork, EgressPolicy, HostNetwork, NetworkError
from vmfork.runtime.spawn import SpawnFailed, fork_children
from vmfork.runtime.volumes import PreparedVolume
from vmfork.runtime.zygote_client import ZygoteClient, ZygoteProcess, start_zygote
from vmfork.runtime.zygote_protocol import ZygoteError, ZygoteUnavailable
from vmfork.store import PendingSnapshot, Snapshot, Store

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 60.0
# Up to 1000 children restoring at once on a busy host; each child also has its own
# ready timeout (runtime.vmmchild), so a hung guest fails sooner than this.
SPAWN_READY_TIMEOUT_S = 900.0
# Its imports (the whole VMM) take seconds; far longer on a loaded or emulated host.
ZYGOTE_START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Spawned:
    vm_id: str
    pid: int
    run_dir: str
    network: ChildNetwork | None = None   # its own network (spawned with ``network``)


@dataclass(frozen=True)
class SpawnOutcome:
    """Children that are ready, children that failed (id, reason), and timings in s."""

    children: list[Spawned]
    failed: list[tuple[str, str]]
    spawn_s: float
    restored_s: float
    ready_s: float


@dataclass(frozen=True)
class ExitNotice:
    vm_id: str
    reason: str        # exited, killed, oom-killed, crashed
    description: str   # in words, e.g. "killed by signal 9 (SIGKILL)"
    # The VMM process that ended: a resumed sandbox runs under its id in a new one, so
    # the old one's exit is told from the sandbox's end by it.
    pid: int | None = None


class SpawnerError(Exception):
    """The spawner (zygote) failed; the message says what and what to do."""


class SpawnerGone(SpawnerError):
    """The zygote died: every sandbox it ran is gone with it."""


class Spawner(Protocol):
    def spawn(self, snapshot: Snapshot, n: int, memory_limit_mib: int | None, *,
              network: HostNetwork | None = None,
              egress: EgressPolicy | None = None,
              volumes: Sequence[PreparedVolume] = (),
              vm_ids: Sequence[str] | None = None,
              networks: Sequence[ChildNetwork] | None = None) -> SpawnOutcome:
        """``network``: give each child a network of its own from it, with ``egress``
        (the caller destroys them once the children are gone; those of failed
        children are destroyed already). ``volumes``: attached in every child
        (``runtime.spawn.fork_children``). ``vm_ids`` and ``networks``: a resume's --
        the paused sandbox's own id and network (kept by the caller on failure)."""

    def kill(self, vm_id: str) -> None:
        """Kill the sandbox and wait until it is reaped; no error if already gone."""

    def exits(self) -> list[ExitNotice]:
        """Sandboxes that ended since the previous call (``SpawnerGone``: all of them)."""

    def revive(self) -> None:
        """After ``SpawnerGone``: start afresh."""

    def agent(self, run_dir: str) -> AgentClient: ...

    def children(self) -> list[Spawned]:
        """The sandboxes running now (after a daemon restart: those to re-adopt)."""

    def exit_descriptions(self) -> dict[str, str]:
        """How each recently ended sandbox ended, in words, by id (as far as kept)."""

    def clean_run_dirs(self, keep: set[str]) -> list[str]:
        """Remove run directories other than ``keep`` (left by a dead zygote)."""

    def branch(self, run_dir: str, store: Store, pending: PendingSnapshot, mode: str, *,
               parent_tag: str | None, sandbox_id: str,
               settle_free_pages: bool = False) -> BranchResult:
        """Capture the sandbox into ``pending`` and publish it (``runtime.branch``;
        ``settle_free_pages``: a diff first waits for the guest to report what it freed);
        raises ``BranchFailed`` (with its stage) or ``StoreError``, leaving ``pending``
        to the caller to abort."""

    def close(self, kill_sandboxes: bool = False) -> None:
        """Stop using the zygote; with ``kill_sandboxes`` also kill every sandbox (else
        they keep running for the next daemon, within the lease)."""


VMM_OVERHEAD_MIB = 512
"""A VMM's own memory beyond its guest's: the interpreter, device buffers, logs."""


def default_memory_limit_mib(guest_mib: int) -> int:
    """The cgroup limit of a sandbox spawned without one: its guest RAM twice (a BRANCH
    stages a whole memory image in the run directory, which on a tmpfs is memory the
    VMM is charged for until the daemon has copied it out) plus the VMM's overhead.
    It bounds a VMM that grows without end, not a guest that uses what it was given."""
    return 2 * guest_mib + VMM_OVERHEAD_MIB


class ZygoteSpawner:
    def __init__(self, state_dir: Path, lease_s: float = DEFAULT_LEASE_S,
                 log_path: Path | None = None, *, jail: bool = True) -> None:
        """``log_path``: where the zygote's stderr goes (appended; default: ours).
        ``jail``: every VMM in a jail of its own (``runtime/jail.py``)."""
        self.jail = jail
        self.run_root = state_dir / "run"
        private_dir(self.run_root, "give the daemon a --state directory of your own")
        self.socket_path = state_dir / "zygote.sock"
        self.lease_s = lease_s
        self._log_path = log_path
        self._proc: ZygoteProcess | None = None
        self._local = threading.local()
        self._lease_lock = threading.Lock()
        self._lease_client = ZygoteClient(self.socket_path, timeout=30.0)
        self.adopted = False
        self.pid = self._connect_or_start()
        # Exits before now belong to the reconciliation (``exit_descriptions``).
        _, self._cursor = self._lease_client.events()

    def _connect_or_start(self) -> int:
        """Join the zygote a previous daemon left running, or start one; hold its lease."""
        try:
            info = self._lease_client.ping()
            self.adopted = True
            log.info("re-attached to the running zygote (pid %s, %s children)",
                     info.get("pid"), info.get("children"))
        except ZygoteUnavailable:
            self._lease_client.close()
            self.adopted = False
            stderr = None if self._log_path is None else open(self._log_path, "ab")  # noqa: SIM115
            try:
                self._proc = start_zygote(str(self.socket_path), stderr=stderr,
                                          die_with_parent=False, lease_s=self.lease_s,
                                          timeout=ZYGOTE_START_TIMEOUT_S)
            except ZygoteUnavailable as err:
                where = f"; see its log {self._log_path}" if self._log_path else ""
                raise ZygoteUnavailable(f"{err}{where}", op="start") from err
            finally:
                if stderr is not None:
                    stderr.close()  # the zygote holds its own descriptor
            info = self._proc.info
        self._lease_client.lease(self.lease_s)
        return int(info["pid"])

    def revive(self) -> None:
        with self._lease_lock:
            self._lease_client.close()
            if self._proc is not None:
                self._proc.proc.poll()  # reap the dead one
            self._local = threading.local()
            self.pid = self._connect_or_start()
            _, self._cursor = self._lease_client.events()

    def _client(self) -> ZygoteClient:
        client: ZygoteClient | None = getattr(self._local, "client", None)
        if client is None:
            client = ZygoteClient(self.socket_path, timeout=30.0)
            self._local.client = client
        return client

    def spawn(self, snapshot: Snapshot, n: int, memory_limit_mib: int | None, *,
              network: HostNetwork | None = None,
              egress: EgressPolicy | None = None,
              volumes: Sequence[PreparedVolume] = (),
              vm_ids: Sequence[str] | None = None,
              networks: Sequence[ChildNetwork] | None = None) -> SpawnOutcome:
        client = self._client()
        # Each spawn gets its own directory of run dirs, so that after a failed spawn
        # its children (whose ids fork_children chose) can be told from those of
        # concurrent spawns and killed without touching anyone else's.
        batch = Path(tempfile.mkdtemp(prefix="spawn-", dir=self.run_root))
        if memory_limit_mib is None:
            memory_limit_mib = default_memory_limit_mib(snapshot.meta.mem_mib)
        try:
            report = fork_children(client, snapshot, n, batch,
                                   memory_limit_mib=memory_limit_mib,
                                   timeout=SPAWN_READY_TIMEOUT_S,
                                   per_child_netns=network is not None or bool(networks),
                                   network=network, egress=egress, jail=self.jail,
                                   volumes=volumes, vm_ids=vm_ids, networks=networks,
                                   runs_in=self.run_root)
        except SpawnFailed as err:
            self._kill_batch(client, batch)
            raise SpawnerError(f"spawn of {n} sandboxes from {snapshot.tag!r} failed: {err}; "
                               "try a smaller n or check the host's load") from err
        except ZygoteError as err:
            self._kill_batch(client, batch)
            raise SpawnerError(f"the zygote refused the spawn: {err}") from err
        except NetworkError as err:
            self._kill_batch(client, batch)
            raise SpawnerError(f"cannot make the sandboxes' networks: {err}") from err
        except ValueError as err:   # refused before any child was forked
            self._remove_if_empty(batch)
            raise SpawnerError(f"spawn of {snapshot.tag!r} refused: {err}") from err
        for vm_id, _reason in report.failed:
            self.kill(vm_id)
        self._remove_if_empty(batch)
        return SpawnOutcome([Spawned(c.vm_id, c.pid, str(c.run_dir), c.network)
                             for c in report.children],
                            list(report.failed), report.spawn_s, report.restored_s,
                            report.ready_s)

    def _kill_batch(self, client: ZygoteClient, batch: Path) -> None:
        try:
            for child in client.list():
                if child.run_dir is not None and Path(child.run_dir).parent == batch:
                    self.kill(child.vm_id)
        except ZygoteError as err:
            log.error("cannot list the zygote's children to clean up %s: %s", batch, err)
        self._remove_if_empty(batch)

    @staticmethod
    def _remove_if_empty(batch: Path) -> None:
        try:
            batch.rmdir()
        except OSError:
            pass  # children still run there; removed when the last one is killed

    def kill(self, vm_id: str) -> None:
        client = self._client()
        try:
            client.kill(vm_id)
        except ZygoteError as err:
            if err.type == "NotFound":
                return  # already reaped
            raise SpawnerError(f"cannot kill sandbox {vm_id}: {err}") from err
        try:
            client.wait(vm_id, timeout=30.0)
        except ZygoteError as err:
            if err.type == "NotFound":
                return
            raise SpawnerError(f"sandbox {vm_id} was signalled but not reaped within 30 s: "
                               f"{err}") from err
        self._sweep_batches()

    def exits(self) -> list[ExitNotice]:
        """Exit events since the last call; as a request on the lease connection it
        also renews the lease. ``SpawnerGone`` if the zygote died."""
        with self._lease_lock:
            try:
                events, self._cursor = self._lease_client.events(self._cursor)
            except ZygoteUnavailable as err:
                if self._proc is not None:
                    self._proc.proc.poll()  # reap our own child
                raise SpawnerGone(f"the zygote (pid {self.pid}) is gone: {err}") from err
        return [ExitNotice(e.vm_id, e.reason, e.description, e.pid) for e in events]

    def children(self) -> list[Spawned]:
        with self._lease_lock:
            listed = self._lease_client.list()
        return [Spawned(c.vm_id, c.pid, c.run_dir or "") for c in listed]

    def exit_descriptions(self) -> dict[str, str]:
        with self._lease_lock:
            events, _ = self._lease_client.events(0)
        return {e.vm_id: e.description for e in events}

    def clean_run_dirs(self, keep: set[str]) -> list[str]:
        removed = []
        for batch in self.run_root.glob("spawn-*"):
            for run_dir in batch.iterdir():
                if str(run_dir) not in keep:
                    shutil.rmtree(run_dir, ignore_errors=True)
                    removed.append(str(run_dir))
            self._remove_if_empty(batch)
        return removed

    def branch(self, run_dir: str, store: Store, pending: PendingSnapshot, mode: str, *,
               parent_tag: str | None, sandbox_id: str,
               settle_free_pages: bool = False) -> BranchResult:
        return branch_into_pending(store, pending, str(Path(run_dir) / "control.sock"), mode,
                                   parent_tag=parent_tag, sandbox_id=sandbox_id,
                                   settle_free_pages=settle_free_pages)

    def agent(self, run_dir: str) -> AgentClient:
        return AgentClient(vsock_uds_connector(str(Path(run_dir) / "vsock.sock"), AGENT_PORT,
                                               timeout=5.0))

    def _sweep_batches(self) -> None:
        for batch in self.run_root.glob("spawn-*"):
            self._remove_if_empty(batch)

    def close(self, kill_sandboxes: bool = False) -> None:
        with self._lease_lock:
            if kill_sandboxes:
                try:
                    self._lease_client.shutdown()
                except ZygoteError as err:
                    log.error("cannot shut the zygote down: %s", err)
                self._wait_for_zygote_exit()
            self._lease_client.close()
        if kill_sandboxes:
            self._sweep_batches()

    def _wait_for_zygote_exit(self, timeout: float = 30.0) -> None:
        if self._proc is not None:
            self._proc.close(timeout)
            return
        deadline = time.monotonic() + timeout
        while os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
            time.sleep(0.05)  # not our child: we cannot wait for it, only watch it go

