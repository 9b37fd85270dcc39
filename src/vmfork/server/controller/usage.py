"""What a sandbox uses, measured from the host: its VMM's CPU time and memory, its
memory cgroup's charge, and (by the guest's statfs) its disk."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from vmfork.agent.client import AgentError
from vmfork.runtime import cgroups
from vmfork.server.controller.core import Part, agent_errors
from vmfork.server.errors import Conflict
from vmfork.server.registry import RUNNING
from vmfork.store import SnapshotCorrupt, SnapshotNotFound

log = logging.getLogger(__name__)

# What the guest reports about its root (the overlay it writes to), for metrics: run
# by the guest's own Python, which every image has (the agent is Python).
_STATFS_CODE = ("import os;s=os.statvfs('/');"
                "print(s.f_frsize*s.f_blocks,s.f_frsize*s.f_bavail,s.f_files,s.f_ffree)")


class Usage(Part):
    """Per-sandbox metrics (``GET /v1/sandboxes/{id}/metrics``)."""

    def sandbox_metrics(self, sandbox_id: str, *, disk: bool = True) -> dict[str, Any]:
        """What a sandbox uses, measured from the host (its VMM's process and memory
        cgroup) and, for the disk (unless ``disk`` is false), by the guest's statfs of
        its root."""
        record = self.core.record(sandbox_id)
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
