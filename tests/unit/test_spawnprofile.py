"""The spawn profile probe (runtime/spawnprofile.py): off by default, and what it writes."""

from __future__ import annotations

import json
import pstats
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


@pytest.mark.parametrize("mode", ["1", "cprofile"])
def test_phases_are_written_in_order_with_their_clocks(tmp_path: Path, mode: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spawnprofile, "MODE", mode)
    monkeypatch.setattr(spawnprofile, "_marks", [])
    if mode == "cprofile":
        import cProfile
        monkeypatch.setattr(spawnprofile, "cProfile", cProfile, raising=False)
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
    stats_file = tmp_path / spawnprofile.STATS_FILE
    if mode == "cprofile":
        stats = pstats.Stats(str(stats_file))
        assert any(func[2] == "_busy" for func in stats.stats)  # type: ignore[attr-defined]
    else:
        assert not stats_file.exists()
    assert not list(tmp_path.glob(".*"))   # the temporary file was renamed
