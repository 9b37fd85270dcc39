"""Reaping orphans as PID 1 without stealing anyone's exit status (stdlib only).

Every process whose parent dies is re-parented to PID 1, and its zombie stays in the
process table until PID 1 waits for it; a guest that runs ``cmd &`` a few thousand
times would run out of pids. But the agent is also the *parent* of processes whose
status it needs: the ``exec`` op's children, and whatever ``eval`` code starts with
``subprocess``. The textbook init loop, ``wait(-1)`` on SIGCHLD, would reap those too,
and their waiters would see ECHILD (``subprocess`` then reports exit code 0: a silent
lie). Nothing in the kernel marks a zombie as "an orphan" once it is our child.

The rule here: **everyone waits for their own pids, and the reaper only collects
zombies nobody else is waiting for.** Concretely, every ``interval`` seconds:

1. ``waitid(P_ALL, WEXITED|WNOHANG|WNOWAIT)`` asks, without reaping, whether any child
   is a zombie at all (the common case is no, and then nothing else runs). It cannot be
   the whole answer: with WNOWAIT it reports the same first zombie every time, so one
   zombie whose owner is busy would hide all the others.
2. ``/proc/<pid>/stat`` lists every zombie whose parent is us.
3. A zombie is reaped (``waitpid(pid, WNOHANG)``) only if it was already a zombie at the
   previous pass (it has lingered ≥ ``interval``: an exec or a ``subprocess.run`` reaps
   its child within microseconds of its death), is not in ``OwnedPids`` (the exec op's
   children, registered from spawn to reap), and no live ``subprocess.Popen`` (or
   ``multiprocessing`` Popen) object still expects to wait for it (code that keeps a
   ``Popen`` and calls ``wait()`` much later).

What remains possible: eval code that forks with bare ``os.fork()`` and waits for the
child more than ``interval`` after it died gets ECHILD. Pid reuse cannot mislead the
reaper: a pid is only reused after it has been reaped, and the reaper reaps a pid only
while it is still a zombie of ours.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class OwnedPids:
    """Pids whose exit status belongs to an agent op (exec), not to the reaper."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pids: set[int] = set()

    def add(self, pid: int) -> None:
        with self._lock:
            self._pids.add(pid)

    def discard(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def __contains__(self, pid: object) -> bool:
        with self._lock:
            return pid in self._pids

    @contextmanager
    def owning(self, pid: int) -> Iterator[None]:
        self.add(pid)
        try:
            yield
        finally:
            self.discard(pid)


def zombie_children(parent: int) -> set[int]:
    """Pids of the zombies whose parent is ``parent``, from /proc."""
    zombies: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited (or reaped) while we looked
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses, so split
        # after the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) >= 2 and fields[0] == b"Z" and int(fields[1]) == parent:
            zombies.add(int(name))
    return zombies


def waited_by_popen() -> set[int]:
    """Pids that a live ``Popen`` object (subprocess or multiprocessing) has not yet
    collected: their owner may still call ``wait()``."""
    classes: list[type] = [subprocess.Popen]
    mp_popen = sys.modules.get("multiprocessing.popen_fork")
    if mp_popen is not None:
        classes.append(mp_popen.Popen)
    kinds = tuple(classes)
    pids: set[int] = set()
    for obj in gc.get_objects():
        if isinstance(obj, kinds) and getattr(obj, "returncode", 0) is None:
            pid = getattr(obj, "pid", None)
            if isinstance(pid, int):
                pids.add(pid)
    return pids


class ZombieReaper:
    """Collects orphaned zombies (see the module docstring). Run ``run_forever`` on a
    thread in PID 1 (or in any child subreaper); ``reap_once`` is one pass."""

    def __init__(self, owned: OwnedPids, *, interval: float = 1.0,
                 log: Callable[[str], None] | None = None) -> None:
        self.owned = owned
        self.interval = interval
        self.log = log
        self.reaped = 0
        self._lingering: set[int] = set()

    def reap_once(self) -> list[int]:
        """One pass: returns the pids reaped."""
        try:
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                self._lingering.clear()
                return []
        except ChildProcessError:
            self._lingering.clear()
            return []
        zombies = zombie_children(os.getpid())
        candidates = {pid for pid in zombies & self._lingering if pid not in self.owned}
        self._lingering = zombies
        if not candidates:
            return []
        candidates -= waited_by_popen()
        reaped: list[int] = []
        for pid in sorted(candidates):
            try:
                got, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # its owner reaped it after all
            if got == pid:
                reaped.append(pid)
        self._lingering -= set(reaped)
        self.reaped += len(reaped)
        return reaped

    def run_forever(self) -> None:
        while True:
            try:
                self.reap_once()
            except Exception as err:  # noqa: BLE001 - the reaper must outlive any bug
                if self.log is not None:
                    self.log(f"reaper: {type(err).__name__}: {err}")
            time.sleep(self.interval)
