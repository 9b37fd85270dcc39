"""Sandbox lifecycle with real guests, through ``vmfork serve`` and the SDK (issue 15):

* pause → resume into the same id: a file in /tmp and a running background process
  survive, the VMM is a new process, the pause snapshots go with the sandbox;
* timeouts: one sandbox killed by the reaper, one paused by it, one whose timeout was
  extended left running;
* sandbox-wide envs in exec and a background process;
* metrics: CPU time that grows with guest work, memory in use, disk use that grows
  with a file written to the guest's root.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.e2e import test_daemon
from tests.e2e.test_daemon import GUEST_MEM_MIB, Home, _alive, _until_gone
from vmfork.client import Sandbox

pytestmark = pytest.mark.e2e

# test_daemon's daemon home and warm snapshot, made again for this module.
home = test_daemon.home
snapshot = test_daemon.snapshot


def _wait_status(sb: Sandbox, status: str, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        info = sb.get_info()
        if info["status"] == status:
            return info
        assert time.monotonic() < deadline, f"still {info['status']}: {info}"
        time.sleep(0.5)


def test_pause_resume_keeps_id_files_processes_envs_and_metrics(home: Home,
                                                                snapshot: str) -> None:
    d = home.start("life", "--kill-sandboxes-on-exit")
    try:
        ctl = d.ctl
        sb = Sandbox.create(snapshot, controller=ctl, envs={"LIFE": "yes"},
                            metadata={"suite": "e2e"})
        # Sandbox-wide envs: in exec and in a background process; a command's own wins.
        assert sb.commands.run("echo $LIFE").stdout == "yes\n"
        assert sb.commands.run("echo $LIFE", envs={"LIFE": "own"}).stdout == "own\n"
        assert sb.commands.start("echo bg:$LIFE").wait().stdout == "bg:yes\n"

        # Metrics: plausible, and moving with what the guest does.
        first = sb.get_metrics()
        print("metrics before:", first)
        assert first["cpu_seconds"] > 0 and first["memory_rss_bytes"] > 1 << 20
        assert first["memory_private_dirty_bytes"] > 0
        assert first["disk_total_bytes"] > first["disk_used_bytes"] >= 0
        assert first["guest_mem_mib"] == GUEST_MEM_MIB
        sb.commands.run("i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done", timeout=300)
        sb.commands.run("dd if=/dev/urandom of=/root/fill bs=1M count=4 && sync",
                        timeout=300, check=True)
        second = sb.get_metrics()
        print("metrics after:", second)
        assert second["cpu_seconds"] > first["cpu_seconds"] + 0.1
        assert second["disk_used_bytes"] >= first["disk_used_bytes"] + (3 << 20)
        if first["memory_cgroup_bytes"] is not None:
            assert second["memory_cgroup_bytes"] > 1 << 20
        sb.commands.run("rm /root/fill", check=True)

        # State that must survive a pause: a file and a process that keeps counting.
        sb.files.write("/tmp/kept", b"state before the pause")
        counter = sb.commands.start(
            # Renamed into place, so a read never meets the file truncated and not yet
            # written again.
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; "
            "mv /tmp/count.new /tmp/count; sleep 0.2; done",
            tag="counter")
        time.sleep(1.5)
        before = int(sb.files.read("/tmp/count"))
        old_pid = int(sb.info["pid"])
        started = time.monotonic()
        sb.pause()
        pause_s = time.monotonic() - started
        assert sb.info["status"] == "paused" and sb.info["paused_snapshot"]
        _until_gone([old_pid], 60)
        assert [s["id"] for s in ctl.list_sandboxes(state="paused")] == [sb.id]
        assert [s["id"] for s in ctl.list_sandboxes(metadata={"suite": "e2e"})] == [sb.id]

        started = time.monotonic()
        again = Sandbox.connect(sb.id, controller=ctl)   # connect resumes
        resume_s = time.monotonic() - started
        print(f"pause {pause_s:.2f} s, resume {resume_s:.2f} s")
        assert again.id == sb.id and again.info["status"] == "running"
        assert int(again.info["pid"]) != old_pid and _alive(int(again.info["pid"]))
        assert again.info["metadata"] == {"suite": "e2e"}
        assert again.files.read("/tmp/kept") == b"state before the pause"
        resumed_count = int(again.files.read("/tmp/count"))
        assert resumed_count >= before
        time.sleep(1.5)
        assert int(again.files.read("/tmp/count")) > resumed_count, "the process runs on"
        [listed] = [p for p in again.commands.list() if p["pid"] == counter.pid]
        assert listed["running"] is True and listed["tag"] == "counter"
        assert again.commands.run("echo $LIFE").stdout == "yes\n"   # envs kept

        # A second pause and resume, then delete: the pause snapshots go with it.
        again.pause()
        again.resume()
        assert again.files.read("/tmp/kept") == b"state before the pause"
        again.kill()
        assert not [s for s in ctl.list_snapshots() if s["tag"].startswith("pause-")]
        assert ctl.list_sandboxes() == []
    finally:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(120)


def test_timeouts_kill_pause_and_extend(home: Home, snapshot: str) -> None:
    d = home.start("timeouts", "--kill-sandboxes-on-exit")
    try:
        ctl = d.ctl
        # Spawned with room for the set-up (spawns take seconds here), then shortened.
        killed = Sandbox.create(snapshot, controller=ctl, timeout=600)
        paused = Sandbox.create(snapshot, controller=ctl, timeout=600, on_timeout="pause")
        kept = Sandbox.create(snapshot, controller=ctl, timeout=600)
        paused.files.write("/tmp/mark", b"before the timeout")
        kept.set_timeout(3)
        kept.set_timeout(600)   # extended again before the reaper looks
        assert kept.info["end_at_unix"] > time.time() + 500
        killed.set_timeout(3)
        paused.set_timeout(3)
        info = _wait_status(killed, "exited", 180)
        assert info["exit_reason"] == "timeout"
        _until_gone([int(killed.info["pid"])], 60)
        _wait_status(paused, "paused", 300)
        assert kept.get_info()["status"] == "running"
        assert kept.commands.run("echo alive").stdout == "alive\n"
        paused.resume(timeout=600)
        assert paused.files.read("/tmp/mark") == b"before the timeout"
        for sb in (killed, paused, kept):
            sb.kill()
        assert ctl.list_sandboxes() == []
        assert not [s for s in ctl.list_snapshots() if s["tag"].startswith("pause-")]
    finally:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(120)
