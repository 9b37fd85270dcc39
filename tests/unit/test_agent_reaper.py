"""PID-1 reaping: orphans are collected, statuses owned by others are not stolen.

The test runs in a child Python that makes itself a *child subreaper*
(PR_SET_CHILD_SUBREAPER), so orphans are re-parented to it exactly as they are to
PID 1 in the guest, without touching the test runner's own children."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")

SCRIPT = textwrap.dedent("""
    import ctypes, os, subprocess, time
    from vmfork.agent.reaper import OwnedPids, ZombieReaper, zombie_children

    PR_SET_CHILD_SUBREAPER = 36
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, ctypes.get_errno()
    me = os.getpid()

    owned = OwnedPids()
    reaper = ZombieReaper(owned, interval=0.2)

    # An orphan: its parent (sh) exits at once, the background sleep is re-parented here.
    orphan = int(subprocess.run(["sh", "-c", "sleep 0.1 >/dev/null 2>&1 & echo $!"],
                                capture_output=True, check=True).stdout)
    # What eval code does: keep a Popen and wait for it much later.
    kept = subprocess.Popen(["sh", "-c", "exit 7"])
    # What the exec op does: its own child, registered in OwnedPids.
    exec_child = subprocess.Popen(["sh", "-c", "exit 5"])
    owned.add(exec_child.pid)
    exec_pid = exec_child.pid
    exec_child.returncode = -999  # the exec op never lets Popen wait; hide it from gc
    del exec_child

    time.sleep(0.5)  # all three are zombies now
    zombies = zombie_children(me)
    assert {orphan, kept.pid, exec_pid} <= zombies, (orphan, kept.pid, exec_pid, zombies)

    assert reaper.reap_once() == []  # first sighting: nothing has lingered yet
    time.sleep(0.3)
    assert reaper.reap_once() == [orphan], "only the orphan may be reaped"
    assert orphan not in zombie_children(me)

    assert kept.wait(timeout=5) == 7, "the Popen's status was stolen"
    pid, status = os.waitpid(exec_pid, 0)
    assert os.waitstatus_to_exitcode(status) == 5, "the exec's status was stolen"
    owned.discard(exec_pid)
    assert reaper.reap_once() == [] and zombie_children(me) == set()
    print("ok")
""")


def test_reaper_collects_orphans_only() -> None:
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
