"""``ZygoteSpawner`` with a real zygote process (no VMs): a second daemon re-attaches
to the zygote the first one left running, a dead zygote is noticed and replaced,
and ``close(kill_sandboxes=True)`` stops it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from vmfork.server.spawner import SpawnerGone, ZygoteSpawner


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_reattach_revive_and_stop(tmp_path: Path) -> None:
    first = ZygoteSpawner(tmp_path, lease_s=30, log_path=tmp_path / "zygote.log")
    assert not first.adopted and first.children() == []
    first.close()   # keep it running, as `vmfork serve` does by default
    second = ZygoteSpawner(tmp_path, lease_s=30, log_path=tmp_path / "zygote.log")
    assert second.adopted and second.pid == first.pid
    assert os.getsid(second.pid) == second.pid   # its own session, not the daemon's

    os.kill(second.pid, signal.SIGKILL)
    assert _gone(second.pid)
    with pytest.raises(SpawnerGone):
        second.exits()
    old = second.pid
    second.revive()
    assert second.pid != old and not second.adopted and second.exits() == []

    pid = second.pid
    second.close(kill_sandboxes=True)
    assert _gone(pid) and not (tmp_path / "zygote.sock").exists()
