"""A sandbox's lifetime (issue 15): its timeout, pause into a snapshot keeping its
id, resume and E2B's connect."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from vmfork.server import volumes
from vmfork.server.controller.branches import Branches
from vmfork.server.controller.core import PAUSE_TAG_PREFIX, Core, Part
from vmfork.server.errors import BadGateway, Conflict
from vmfork.server.registry import PAUSED, RUNNING
from vmfork.server.requests import Branch
from vmfork.server.spawner import SpawnerError
from vmfork.store import SnapshotCorrupt, chains

log = logging.getLogger(__name__)


class Lifecycle(Part):
    """Each change is made under the sandbox's lifecycle lock, so a timeout
    extended while the reaper looks wins, and a pause and a resume never cross."""

    def __init__(self, core: Core, branches: Branches) -> None:
        super().__init__(core)
        self.branches = branches

    def set_timeout(self, sandbox_id: str, timeout_secs: float | None) -> dict[str, Any]:
        """E2B's ``set_timeout``: the sandbox ends ``timeout_secs`` from now (kill or
        pause, as spawned); None: never. Shortening is allowed, as in E2B."""
        with self.core.lifecycle(sandbox_id):
            record = self.core.record(sandbox_id)
            if record.status != RUNNING:
                raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); "
                               "only a running sandbox has a timeout (a paused one waits "
                               "for its resume, which takes a timeout)")
            end_at = None if timeout_secs is None else time.time() + timeout_secs
            if not self.registry.set_timeout(sandbox_id, timeout_secs, end_at):
                raise Conflict(f"sandbox {sandbox_id!r} stopped running meanwhile")
            return self.core.sandbox(sandbox_id)

    def pause_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        """Capture the sandbox (a diff snapshot on the one it runs from), stop its VMM,
        and keep its id, network, read-write volumes and metadata for ``resume``."""
        with self.core.lifecycle(sandbox_id):
            record = self.core.record(sandbox_id)
            if record.status == PAUSED:
                return self.core.sandbox(sandbox_id)
            self.pause_locked(sandbox_id)
            return self.core.sandbox(sandbox_id)

    def pause_locked(self, sandbox_id: str) -> None:
        record = self.core.record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); only "
                           "a running sandbox can be paused")
        tag = f"{PAUSE_TAG_PREFIX}{sandbox_id}-{secrets.token_hex(3)}"
        branch = Branch(tag=tag, mode="diff")
        with self.core.expected_lock:
            self.core.pausing.add(sandbox_id)
        try:
            try:
                self.branches.branch_sandbox(sandbox_id, branch, suspending=True)
            except Conflict as err:
                # A diff cannot be made (its chain is as deep as allowed, or it has no
                # base): a full capture instead.
                log.info("pause of %s: %s; capturing it whole", sandbox_id, err.message)
                self.branches.branch_sandbox(sandbox_id, branch.replace(mode="full"),
                                             suspending=True)
            # In the registry first: from here a restarted daemon knows it is paused
            # (and kills a VMM still running under its id as one nobody knows).
            self.registry.mark_paused(sandbox_id, tag)
            with self.core.expected_lock:
                self.core.expected_exits.add(sandbox_id)
            try:
                self.core.require_spawner().kill(sandbox_id)
            except SpawnerError as err:
                log.error("paused sandbox %s: its VMM could not be stopped: %s", sandbox_id,
                          err)
        finally:
            with self.core.expected_lock:
                self.core.pausing.discard(sandbox_id)
        log.info("sandbox %s paused into %s", sandbox_id, tag)

    def resume_sandbox(self, sandbox_id: str, timeout_secs: float | None = None
                       ) -> dict[str, Any]:
        """Restore a paused sandbox from its pause snapshot into the same id (and its
        network, volumes, metadata, envs); its timeout starts again: ``timeout_secs``,
        else the one it had. A running sandbox is returned as it is."""
        with self.core.lifecycle(sandbox_id):
            record = self.core.record(sandbox_id)
            if record.status == RUNNING:
                return self.core.sandbox(sandbox_id)
            if record.status != PAUSED or record.paused_tag is None:
                raise Conflict(f"sandbox {sandbox_id!r} is not paused ({record.status}); "
                               "only a paused sandbox can be resumed")
            snap = self.core.ready_snapshot(record.paused_tag)
            try:
                chains.check_plan(self.store, snap)
            except SnapshotCorrupt as err:
                raise Conflict(str(err)) from err
            spawner = self.core.require_spawner()
            kwargs: dict[str, Any] = {"vm_ids": [sandbox_id]}
            network = None if self.networks is None else self.networks.get(sandbox_id)
            if network is not None:
                kwargs["networks"] = [network]
            reopened = [v for v in volumes.held_volumes(self.registry, f"sandbox:{sandbox_id}")
                        if any(s.key == v.key for s in volumes.snapshot_slots(snap))]
            if reopened:
                kwargs["volumes"] = reopened
            with self.core.heavy_slot(f"resume sandbox {sandbox_id}"), \
                    self.core.admission(1, snap.meta.mem_mib, snap.tag):
                try:
                    outcome = spawner.spawn(snap, 1, record.memory_limit_mib, **kwargs)
                except SpawnerError as err:
                    raise BadGateway(f"resume of {sandbox_id}: {err}; it stays paused") from err
                if outcome.failed or not outcome.children:
                    for child in outcome.children:
                        with self.core.expected_lock:
                            self.core.expected_exits.add(child.vm_id)
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
            info = self.core.sandbox(sandbox_id)
            info["timings"] = {"spawn_ms": round(outcome.spawn_s * 1000, 3),
                               "restored_ms": round(outcome.restored_s * 1000, 3),
                               "ready_ms": round(outcome.ready_s * 1000, 3)}
            return info

    def connect_sandbox(self, sandbox_id: str, timeout_secs: float | None = None
                        ) -> dict[str, Any]:
        """E2B's ``connect``: resume a paused sandbox; for a running one, a
        ``timeout_secs`` only ever extends its deadline (never shortens it)."""
        record = self.core.record(sandbox_id)
        if record.status == PAUSED:
            return self.resume_sandbox(sandbox_id, timeout_secs)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}: "
                           f"{record.exit_description}); it cannot be connected to")
        if timeout_secs is not None and record.end_at is not None:
            with self.core.lifecycle(sandbox_id):
                current = self.core.record(sandbox_id)
                if current.end_at is not None and current.end_at < time.time() + timeout_secs:
                    self.registry.set_timeout(sandbox_id, timeout_secs,
                                              time.time() + timeout_secs)
        return self.core.sandbox(sandbox_id)

