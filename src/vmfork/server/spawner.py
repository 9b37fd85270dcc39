"""How the controller starts and stops sandboxes: the ``Spawner`` interface and the
zygote-backed implementation.

The controller talks to this narrow interface, not to the zygote, so that unit
tests can run the whole HTTP API against a fake spawner without KVM, and so that
re-adoption after a restart (a spawner that reconnects to a surviving zygote) can
be added behind it later.

``ZygoteSpawner`` owns one zygote, started with the daemon: the zygote, and so
every VMM child, dies with the daemon (``die_with_parent`` + PDEATHSIG), which is
what guarantees no orphan VMM processes today. ``ZygoteClient`` holds one
connection and is not thread-safe, so each request thread gets its own client.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from vmfork.agent.client import AgentClient, vsock_uds_connector
from vmfork.agent.protocol import AGENT_PORT
from vmfork.runtime.spawn import SpawnFailed, fork_children
from vmfork.runtime.zygote_client import ZygoteClient, ZygoteProcess, start_zygote
from vmfork.runtime.zygote_protocol import ZygoteError
from vmfork.store import Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Spawned:
    vm_id: str
    pid: int
    run_dir: str


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


class SpawnerError(Exception):
    """The spawner (zygote) failed; the message says what and what to do."""


class Spawner(Protocol):
    def spawn(self, snapshot: Snapshot, n: int,
              memory_limit_mib: int | None) -> SpawnOutcome: ...

    def kill(self, vm_id: str) -> None:
        """Kill the sandbox and wait until it is reaped; no error if already gone."""

    def exits(self) -> list[ExitNotice]:
        """Sandboxes that ended since the previous call."""

    def agent(self, run_dir: str) -> AgentClient: ...

    def close(self) -> None:
        """Kill every sandbox and stop."""


class ZygoteSpawner:
    def __init__(self, state_dir: Path, stderr: IO[bytes] | int | None = None) -> None:
        self.run_root = state_dir / "run"
        self.run_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.socket_path = state_dir / "zygote.sock"
        self._zygote: ZygoteProcess = start_zygote(str(self.socket_path), stderr=stderr)
        self._local = threading.local()
        self._events_lock = threading.Lock()
        self._cursor = 0

    @property
    def pid(self) -> int:
        return self._zygote.pid

    def _client(self) -> ZygoteClient:
        client: ZygoteClient | None = getattr(self._local, "client", None)
        if client is None:
            client = self._zygote.client()
            self._local.client = client
        return client

    def spawn(self, snapshot: Snapshot, n: int, memory_limit_mib: int | None) -> SpawnOutcome:
        client = self._client()
        # Each spawn gets its own directory of run dirs, so that after a failed spawn
        # its children (whose ids fork_children chose) can be told from those of
        # concurrent spawns and killed without touching anyone else's.
        batch = Path(tempfile.mkdtemp(prefix="spawn-", dir=self.run_root))
        try:
            report = fork_children(client, snapshot, n, batch,
                                   memory_limit_mib=memory_limit_mib)
        except SpawnFailed as err:
            self._kill_batch(client, batch)
            raise SpawnerError(f"spawn of {n} sandboxes from {snapshot.tag!r} failed: {err}; "
                               "try a smaller n or check the host's load") from err
        except ZygoteError as err:
            self._kill_batch(client, batch)
            raise SpawnerError(f"the zygote refused the spawn: {err}") from err
        for vm_id, _reason in report.failed:
            self.kill(vm_id)
        self._remove_if_empty(batch)
        return SpawnOutcome([Spawned(c.vm_id, c.pid, str(c.run_dir)) for c in report.children],
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
        with self._events_lock:
            events, self._cursor = self._client().events(self._cursor)
        return [ExitNotice(e.vm_id, e.reason, e.description) for e in events]

    def agent(self, run_dir: str) -> AgentClient:
        return AgentClient(vsock_uds_connector(str(Path(run_dir) / "vsock.sock"), AGENT_PORT,
                                               timeout=5.0))

    def _sweep_batches(self) -> None:
        for batch in self.run_root.glob("spawn-*"):
            self._remove_if_empty(batch)

    def close(self) -> None:
        self._zygote.close()
        self._sweep_batches()
