"""Keeping the registry true: reconciliation with the zygote at start-up, the exit
watcher, a new zygote when one dies, and the reaper of expired sandboxes."""

from __future__ import annotations

import logging
import os
import threading
import time

from vmfork.server.controller.core import Core, Part
from vmfork.server.controller.lifecycle import Lifecycle
from vmfork.server.controller.usage import Usage
from vmfork.server.errors import ApiError
from vmfork.server.registry import EXITED, LOST, PAUSED, RUNNING, SandboxRecord
from vmfork.server.spawner import SpawnerError, SpawnerGone

log = logging.getLogger(__name__)

# The reaper (sandbox timeouts): how often it looks, and how many expired sandboxes it
# ends in one look (each kill or pause is done in turn; the rest wait a cycle).
REAPER_INTERVAL_S = 1.0
REAP_PER_CYCLE = 16


class Reconciler(Part):
    """The daemon's background threads (the exit watcher, the reaper) and what
    ``start`` makes true before the first request."""

    def __init__(self, core: Core, lifecycle: Lifecycle, usage: Usage) -> None:
        super().__init__(core)
        self.lifecycle = lifecycle
        self.usage = usage
        self._watcher: threading.Thread | None = None
        self._reaper: threading.Thread | None = None

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
        spawner = self.core.require_spawner()
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
            self.core.networks = None

    def stop_watching(self) -> None:
        """Stop the exit watcher and the reaper (a pause in progress finishes first)."""
        self.core.stopping.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
        if self._reaper is not None:
            self._reaper.join(60.0)   # a pause in progress finishes its snapshot

    def let_go(self, kill_sandboxes: bool) -> None:
        """Let go of the zygote and the networks; with ``kill_sandboxes``, the sandboxes
        end with them (else they keep running for the next daemon)."""
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
        while not self.core.stopping.wait(0.2):
            try:
                notices = self.spawner.exits()
            except SpawnerGone as err:
                self._zygote_died(str(err))
                continue
            except Exception as err:  # noqa: BLE001 - keep watching; say why once a cycle
                log.error("cannot read sandbox exit events: %s", err)
                continue
            for notice in notices:
                with self.core.expected_lock:
                    if notice.vm_id in self.core.expected_exits:
                        self.core.expected_exits.discard(notice.vm_id)
                        continue   # a pause stopped it
                record = self.registry.get_sandbox(notice.vm_id)
                if record is not None and (record.status == PAUSED or (
                        notice.pid is not None and notice.pid != record.pid)):
                    continue   # paused, or the VMM of before a pause: not its end
                self.core.release_sandbox(notice.vm_id)
                if self.registry.mark_ended(notice.vm_id, EXITED, notice.reason,
                                            notice.description):
                    self.metrics.sandbox_exits.inc(reason=notice.reason)
                    log.info("sandbox %s ended: %s", notice.vm_id, notice.description)

    def _zygote_died(self, why: str) -> None:
        assert self.spawner is not None
        log.error("%s; its sandboxes died with it, starting a new zygote", why)
        for record in self.registry.list_sandboxes(RUNNING):
            self.core.release_sandbox(record.id)
            if self.registry.mark_ended(record.id, LOST, "zygote-died",
                                        f"{why}; the sandbox died with it"):
                self.metrics.sandbox_exits.inc(reason="lost")
        try:
            self.spawner.revive()
        except Exception as err:  # noqa: BLE001 - retried on the next cycle
            log.error("cannot start a new zygote: %s", err)

    def _reap_expired_loop(self) -> None:
        while not self.core.stopping.wait(REAPER_INTERVAL_S):
            try:
                self.reap_expired()
            except Exception as err:  # noqa: BLE001 - keep reaping; say why once a cycle
                log.error("the reaper failed a cycle: %s", err)
            try:
                # The metrics samples ride on this thread: it already wakes every second.
                self.usage.sample_running()
            except Exception as err:  # noqa: BLE001 - a sample missed is not worth more
                log.warning("metrics sampling failed a cycle: %s", err)

    def reap_expired(self, now: float | None = None) -> list[str]:
        """End (kill, or pause if spawned with on_timeout=pause) up to
        ``REAP_PER_CYCLE`` running sandboxes whose deadline passed. Each is re-checked
        under its lifecycle lock: one whose timeout was extended since is left alone.
        Returns the ids acted on."""
        done = []
        for record in self.registry.expired(time.time() if now is None else now)[
                :REAP_PER_CYCLE]:
            if self.core.stopping.is_set():
                break
            with self.core.lifecycle(record.id):
                if not self.registry.claim_expired(record.id, record.end_at or 0.0):
                    continue   # extended, deleted or ended meanwhile
                if record.on_timeout == "pause":
                    try:
                        self.lifecycle.pause_locked(record.id)
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
            self.core.require_spawner().kill(record.id)
        except SpawnerError as err:
            log.error("cannot kill the expired sandbox %s: %s", record.id, err)
        self.core.release_sandbox(record.id)
        log.info("sandbox %s timed out and was killed", record.id)

