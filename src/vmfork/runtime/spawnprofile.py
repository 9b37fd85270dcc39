"""Where a VMM child's time goes between ``fork()`` and ready: by phase, and by function.

Off by default and free then: every call here returns at once after one ``if``. When
the zygote was started with ``VMFORK_SPAWN_PROFILE`` set (read once, at import, in the
zygote: a jailed child's environment is emptied before most of its phases), each child
records at each phase of its life (``mark``) the monotonic clock, its main thread's CPU
time and the whole process's CPU time (``time.thread_time_ns``, ``process_time_ns``:
both count from the ``fork()``, since a child starts with fresh CPU clocks), and writes
them as one JSON document to ``<run_dir>/spawn-profile.json`` once ready (``finish``).
With ``VMFORK_SPAWN_PROFILE=cprofile`` the child's main thread also runs under
``cProfile`` from its first instruction after ``fork()`` to ready, whose statistics go to
``<run_dir>/spawn-profile.pstats`` (``pstats.Stats`` reads it). ``bench/spawn_profile.py``
spawns children with it on and sums what they recorded.

The main thread's CPU time is the VMM's own work; the process's includes the vCPU
thread once the guest runs (the guest's own instructions count there), and the I/O
and control threads.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

ENV = "VMFORK_SPAWN_PROFILE"
PROFILE_FILE = "spawn-profile.json"
STATS_FILE = "spawn-profile.pstats"


def _mode(value: str | None) -> str | None:
    if not value or value == "0":
        return None
    if value not in ("1", "cprofile"):
        raise SystemExit(f"{ENV} must be 1 (phase times) or cprofile (and per-function "
                         f"times), got {value!r}")
    return value


MODE = _mode(os.environ.get(ENV))
"""None: nothing is recorded; ``"1"``: phase times; ``"cprofile"``: and cProfile."""

if MODE == "cprofile":
    import cProfile  # here, in the zygote: a child imports nothing for it
_profiler: Any = None   # a cProfile.Profile while one runs

_marks: list[tuple[str, int, int, int]] = []


def _now(phase: str) -> tuple[str, int, int, int]:
    return (phase, time.monotonic_ns(), time.thread_time_ns(), time.process_time_ns())


def start(forked_ns: int) -> None:
    """In the child, first thing after ``fork()``: ``forked_ns`` is the zygote's clock
    right before it (its CPU time there is the zygote's, not counted)."""
    global _profiler
    if MODE is None:
        return
    _marks[:] = [("fork", forked_ns, 0, 0), _now("forked")]
    if MODE == "cprofile":
        _profiler = cProfile.Profile()
        _profiler.enable()


def mark(phase: str) -> None:
    """The end of ``phase``: the clocks now."""
    if MODE is None:
        return
    _marks.append(_now(phase))


def finish(run_dir: str | None) -> None:
    """Stop profiling and write what was recorded into ``run_dir``. A failure is a line
    on stderr: a probe never fails the sandbox it measures."""
    global _profiler
    if MODE is None or run_dir is None:
        return
    _marks.append(_now("finished"))
    try:
        if MODE == "cprofile" and _profiler is not None:
            _profiler.disable()
            _profiler.dump_stats(os.path.join(run_dir, STATS_FILE))
            _profiler = None
        # Renamed into place, last: once it is there, both files are whole.
        tmp = os.path.join(run_dir, f".{PROFILE_FILE}.tmp")
        with open(tmp, "w") as f:
            json.dump({"marks": [{"phase": p, "mono_ns": m, "thread_cpu_ns": t,
                                  "process_cpu_ns": c} for p, m, t, c in _marks]}, f)
        os.replace(tmp, os.path.join(run_dir, PROFILE_FILE))
    except OSError as err:
        print(f"vmfork spawnprofile: not written: {err}", file=sys.stderr)


def phases(marks: list[dict[str, int | str]]) -> list[dict[str, float | str]]:
    """Each phase of a child's ``marks`` (as ``finish`` wrote them): its name, and its
    wall, main-thread CPU and process CPU seconds (from the previous mark to its own)."""
    out: list[dict[str, float | str]] = []
    for before, after in zip(marks, marks[1:]):
        out.append({"phase": str(after["phase"]),
                    "wall_s": (int(after["mono_ns"]) - int(before["mono_ns"])) / 1e9,
                    "thread_cpu_s": (int(after["thread_cpu_ns"])
                                     - int(before["thread_cpu_ns"])) / 1e9,
                    "process_cpu_s": (int(after["process_cpu_ns"])
                                      - int(before["process_cpu_ns"])) / 1e9})
    return out
