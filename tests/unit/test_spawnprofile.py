"""The spawn profile probe (runtime/spawnprofile.py): off by default, and what it writes."""

from __future__ import annotations

import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmfork.runtime import spawnprofile


def test_off_by_default_records_and_writes_nothing(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spawnprofile, "MODE", None)
    monkeypatch.setattr(spawnprofile, "_marks", [])
    spawnprofile.start(time.monotonic_ns())
    spawnprofile.mark("set_up")
    spawnprofile.finish(str(tmp_path))
    assert spawnprofile._marks == []
    assert list(tmp_path.iterdir()) == []


def test_the_mode_is_checked() -> None:
    assert spawnprofile._mode(None) is None and spawnprofile._mode("0") is None
    assert spawnprofile._mode("1") == "1" and spawnprofile._mode("cprofile") == "cprofile"
    with pytest.raises(SystemExit, match=spawnprofile.ENV):
        spawnprofile._mode("yes")


def _busy(seconds: float) -> None:
    """``seconds`` of this thread's CPU time, or give up after 60 s of wall time (the
    test then fails on the CPU time, instead of hanging)."""
    end, give_up = time.thread_time() + seconds, time.monotonic() + 60
    while time.thread_time() < end and time.monotonic() < give_up:
        pass


def test_phases_are_written_in_order_with_their_clocks(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spawnprofile, "MODE", "1")
    monkeypatch.setattr(spawnprofile, "_marks", [])
    forked = time.monotonic_ns()
    spawnprofile.start(forked)
    _busy(0.02)
    spawnprofile.mark("work")
    time.sleep(0.02)
    spawnprofile.mark("wait")
    spawnprofile.finish(str(tmp_path))
    marks = json.loads((tmp_path / spawnprofile.PROFILE_FILE).read_text())["marks"]
    assert [m["phase"] for m in marks] == ["fork", "forked", "work", "wait", "finished"]
    assert marks[0]["mono_ns"] == forked
    phases = {p["phase"]: p for p in spawnprofile.phases(marks)}
    assert list(phases) == ["forked", "work", "wait", "finished"]
    # CPU spent busy is counted as CPU; a sleep is wall time only.
    assert phases["work"]["thread_cpu_s"] >= 0.02
    assert phases["wait"]["wall_s"] >= 0.02
    assert phases["wait"]["thread_cpu_s"] < phases["wait"]["wall_s"]
    assert not (tmp_path / spawnprofile.STATS_FILE).exists()
    assert not list(tmp_path.glob(".*"))   # the temporary file was renamed


PROFILED_CHILD = """
import sys, time
from vmfork.runtime import spawnprofile
def restore_step():
    return sum(range(1000))
spawnprofile.start(time.monotonic_ns())
restore_step()
spawnprofile.mark("machine")
spawnprofile.finish(sys.argv[1])
"""


def test_cprofile_mode_from_the_environment(tmp_path: Path) -> None:
    """As the zygote's children see it: the mode read at import (a fresh interpreter,
    so that no profiler or hook of this test run is around)."""
    env = {**os.environ, spawnprofile.ENV: "cprofile",
           "PYTHONPATH": str(Path(spawnprofile.__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", PROFILED_CHILD, str(tmp_path)], env=env,
                   check=True, timeout=120)
    marks = json.loads((tmp_path / spawnprofile.PROFILE_FILE).read_text())["marks"]
    assert [m["phase"] for m in marks] == ["fork", "forked", "machine", "finished"]
    stats = pstats.Stats(str(tmp_path / spawnprofile.STATS_FILE))
    assert any(func[2] == "restore_step" for func in stats.stats)  # type: ignore[attr-defined]
