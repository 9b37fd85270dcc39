"""What a sandbox uses, measured from the host: its VMM's CPU time and memory, its
memory cgroup's charge, and (by the guest's statfs) its disk; and a short series of
host-side samples per running sandbox (E2B's ``get_metrics`` answers a series)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any

from vmfork.agent.client import AgentError
from vmfork.runtime import cgroups
from vmfork.server.controller.core import Core, Part, agent_errors
from vmfork.server.errors import Conflict
from vmfork.server.registry import RUNNING
from vmfork.store import SnapshotCorrupt, SnapshotNotFound

log = logging.getLogger(__name__)

# What the guest reports about its root (the overlay it writes to), for metrics: run
# by the guest's own Python, which every image has (the agent is Python).
_STATFS_CODE = ("import os;s=os.statvfs('/');"
                "print(s.f_frsize*s.f_blocks,s.f_frsize*s.f_bavail,s.f_files,s.f_ffree)")


SAMPLE_INTERVAL_S = 5.0
"""How often the host samples each running sandbox (CPU time, memory cgroup)."""
MAX_SAMPLES = 120
"""Samples kept per sandbox: the last ten minutes, a ring."""


class Usage(Part):
    """Per-sandbox metrics (``GET /v1/sandboxes/{id}/metrics``), and the samples the
    reaper's thread takes every ``SAMPLE_INTERVAL_S`` (``sample_running``): only what
    the host reads cheaply (``/proc/PID/stat``, the cgroup's charge), nothing asked
    of the guest. A sandbox's ring goes when it stops running (a pause starts anew)."""

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._lock = threading.Lock()
        self._samples: dict[str, deque[dict[str, Any]]] = {}
        self._last_sample = 0.0

    def sample_running(self, now: float | None = None) -> None:
        """Take one sample of every running sandbox, if ``SAMPLE_INTERVAL_S`` passed
        since the last round."""
        now = time.time() if now is None else now
        if now - self._last_sample < SAMPLE_INTERVAL_S:
            return
        self._last_sample = now
        running = {r.id: r for r in self.registry.list_sandboxes(RUNNING)}
        taken = {}
        for sandbox_id, record in running.items():
            cpu = _process_usage(record.pid, memory=False)["cpu_seconds"]
            taken[sandbox_id] = {"timestamp_unix": now, "cpu_seconds": cpu,
                                 "memory_cgroup_bytes": _cgroup_memory(sandbox_id)}
        with self._lock:
            for gone in set(self._samples) - set(running):
                del self._samples[gone]
            for sandbox_id, sample in taken.items():
                self._samples.setdefault(sandbox_id, deque(maxlen=MAX_SAMPLES)).append(sample)

    def samples(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The kept samples of a running sandbox, oldest first, each with
        ``cpu_used_pct``: its VMM's CPU time over the interval since the one before, as
        a percentage of its vCPUs (None for the first, or when a read failed)."""
        record = self.core.record(sandbox_id)
        try:
            vcpus = max(1, int(self.store.get(record.snapshot_tag).meta.vcpus or 1))
        except (SnapshotNotFound, SnapshotCorrupt, ValueError):
            vcpus = 1
        with self._lock:
            kept = [dict(s) for s in self._samples.get(sandbox_id, ())]
        before: dict[str, Any] | None = None
        for sample in kept:
            sample["vcpus"] = vcpus
            sample["cpu_used_pct"] = cpu_used_pct(before, sample, vcpus)
            before = sample
        return kept

    def sandbox_metrics(self, sandbox_id: str, *, disk: bool = True) -> dict[str, Any]:
        """What a sandbox uses, measured from the host (its VMM's process and memory
        cgroup) and, for the disk (unless ``disk`` is false), by the guest's statfs of
        its root."""
        record = self.core.record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); a "
                           "stopped VMM uses nothing")
        out: dict[str, Any] = {"sandbox_id": sandbox_id, "timestamp_unix": time.time()}
        out.update(_process_usage(record.pid, memory=True))
        out["memory_cgroup_bytes"] = _cgroup_memory(sandbox_id)
        try:
            out["guest_mem_mib"] = self.store.get(record.snapshot_tag).meta.mem_mib
        except (SnapshotNotFound, SnapshotCorrupt, ValueError):
            out["guest_mem_mib"] = None
        if disk:
            out.update(self._guest_disk(sandbox_id))
        return out

    def _guest_disk(self, sandbox_id: str) -> dict[str, Any]:
        agent = self.core.agent(sandbox_id)
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




def cpu_used_pct(before: dict[str, Any] | None, after: dict[str, Any], vcpus: int
                 ) -> float | None:
    """``after``'s CPU use since ``before`` (samples or metrics with ``cpu_seconds``
    and ``timestamp_unix``), as a percentage of ``vcpus``; None if it cannot be told."""
    if before is None or before["cpu_seconds"] is None or after["cpu_seconds"] is None:
        return None
    wall = float(after["timestamp_unix"]) - float(before["timestamp_unix"])
    if wall <= 0:
        return None
    used = max(0.0, float(after["cpu_seconds"]) - float(before["cpu_seconds"]))
    return round(min(100.0, 100.0 * used / wall / vcpus), 2)


def _process_usage(pid: int, *, memory: bool) -> dict[str, Any]:
    """CPU time (user + system, its threads and reaped children) and, with ``memory``,
    memory of a VMM process, from /proc: resident and private dirty bytes (what it does
    not share with its snapshot's page cache, i.e. what the sandbox wrote)."""
    out: dict[str, Any] = {"cpu_seconds": None, "memory_rss_bytes": None,
                           "memory_private_dirty_bytes": None}
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ticks = os.sysconf("SC_CLK_TCK")
        # After the ")": state is field 3, utime..cstime are 14..17 (1-based).
        out["cpu_seconds"] = round(sum(int(x) for x in fields[11:15]) / ticks, 3)
        if not memory:
            return out     # smaps_rollup walks the page tables: not for every sample
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
