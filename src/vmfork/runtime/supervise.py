"""Why a child ended, and what a spawner holds (for leak checks).

``classify_exit`` turns a ``waitid`` result plus the child's cgroup OOM counters
into a reason with a fixed vocabulary:

* ``exited``     -- the process called exit; ``exit_code`` says how. 70 means the
  entry raised (traceback in its log), 71 that the child could not be set up
  before its entry ran (cgroup join, log file).
* ``oom-killed`` -- killed while its cgroup counted an OOM kill (v2
  ``memory.events`` / v1 ``memory.oom_control``; on v1 kernels without the counter,
  a SIGKILL after the limit was hit). Checked first: the OOM killer sends SIGKILL,
  indistinguishable from any other SIGKILL by the wait status alone.
* ``killed``     -- ended by a signal that is not a crash signal, or by any signal
  the spawner was asked to send.
* ``crashed``    -- a crash signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT,
  SIGSYS) or a core dump, not requested by anyone.

``leak_snapshot`` counts what a spawner process holds from the outside
(``/proc``), so a test can compare before/after many spawn/kill cycles.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from vmfork.runtime import cgroups

CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                           signal.SIGABRT, signal.SIGSYS})


@dataclass(frozen=True)
class ExitClass:
    reason: str
    description: str
    exit_code: int | None
    signal: int | None
    core_dumped: bool


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"


def classify_exit(si_code: int, si_status: int, *, kill_requested: bool,
                  oom: cgroups.OomInfo | None) -> ExitClass:
    """Reason for a child's end from ``os.waitid``'s ``si_code``/``si_status``."""
    if si_code == os.CLD_EXITED:
        code = si_status
        if code == 0:
            words = "exited with status 0"
        elif code == 70:
            words = "exited with status 70 (the entry raised; see its log)"
        elif code == 71:
            words = "exited with status 71 (child setup failed before the entry ran; see its log)"
        else:
            words = f"exited with status {code}"
        return ExitClass("exited", words, code, None, False)
    sig = si_status
    dumped = si_code == os.CLD_DUMPED
    name = signal_name(sig)
    core = ", core dumped" if dumped else ""
    if sig == signal.SIGKILL and oom is not None and oom.oom_killed:
        how = (f"{oom.oom_kills} OOM kill(s) in its cgroup" if oom.oom_kills is not None
               else f"memory limit hit {oom.limit_hits} time(s)")
        return ExitClass("oom-killed", f"oom-killed: killed by signal {sig} ({name}), {how}",
                         None, sig, dumped)
    if not kill_requested and (dumped or sig in CRASH_SIGNALS):
        return ExitClass("crashed", f"crashed: killed by signal {sig} ({name}{core})",
                         None, sig, dumped)
    by = " at the spawner's request" if kill_requested else ""
    return ExitClass("killed", f"killed by signal {sig} ({name}{core}){by}", None, sig, dumped)


def log_tail(path: str | None, lines: int = 20, max_bytes: int = 8192) -> list[str]:
    """The last ``lines`` lines of a log file (at most ``max_bytes`` read), [] if none."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace").splitlines()
    if size > max_bytes and text:
        text = text[1:]  # first line is probably cut
    return text[-lines:]


@dataclass(frozen=True)
class LeakSnapshot:
    """What a spawner holds at one instant."""

    fds: int
    children: tuple[int, ...]
    cgroup_dirs: tuple[str, ...]
    run_files: tuple[str, ...]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def child_pids(pid: int) -> tuple[int, ...]:
    """Live (or zombie) processes whose parent is ``pid``."""
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Field 4 (ppid) follows the ')' that closes the command name.
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return tuple(sorted(out))


def leak_snapshot(pid: int, *, cgroup_parent: str = cgroups.DEFAULT_PARENT,
                  run_root: str | os.PathLike[str] | None = None) -> LeakSnapshot:
    """Count the spawner's open fds and children, its cgroup dirs and files under ``run_root``."""
    h = cgroups.detect()
    groups = tuple(cgroups.list_groups(h, cgroup_parent)) if h is not None else ()
    files: list[str] = []
    if run_root is not None:
        for dirpath, dirnames, filenames in os.walk(run_root):
            files.extend(os.path.join(dirpath, n) for n in [*dirnames, *filenames])
    return LeakSnapshot(open_fds(pid), child_pids(pid), groups, tuple(sorted(files)))


def run_module_in_own_group(module: str, args: list[str], *, output: IO[bytes],
                            env: Mapping[str, str], timeout: float
                            ) -> subprocess.Popen[bytes]:
    """``python -m module args…`` in a session of its own, its stdout and stderr to
    ``output``, waited for at most ``timeout`` seconds; the ended process is returned.
    If the wait ends any other way (``subprocess.TimeoutExpired``, an interrupt) the
    whole group is killed and reaped first, so nothing it started outlives it, and
    the exception goes on to the caller."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL,
                            stdout=output, stderr=output, env=dict(env),
                            start_new_session=True)
    try:
        proc.wait(timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc
