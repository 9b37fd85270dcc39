"""A snapshot's write set (``native/src/write_set.rs``): which child learns it, and how
the zygote takes a learner's file into the snapshot's plan (``vmmchild._is_learner``,
``run_dir_ending``, ``_learn_write_set``).

This process plays the zygote: a real ``SnapshotMachinePlan`` of the format-1 golden
state (64 MiB of RAM) and real learner files. Saving a set from a child's pagemap and
copying it at a restore are the native core's tests (``cargo test``) and a real spawn's
(``tests/e2e/test_native_spawn.py``)."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vmfork.ondisk import stateformat
from vmfork.runtime import vmmchild
from vmfork.vmm.vmstate import MachineState

GOLDEN_STATE = Path(__file__).parent / "golden" / "state-v1.bin"
PAGE = 4096


@pytest.fixture(autouse=True)
def fresh_learners() -> Iterator[None]:
    vmmchild._learners.clear()
    vmmchild._batch_learners.clear()
    yield
    vmmchild._learners.clear()
    vmmchild._batch_learners.clear()


def _snapshot(at: Path) -> tuple[str, Any]:
    """A snapshot directory of the golden state and an empty memory file, and its
    plan as the zygote builds it."""
    at.mkdir()
    shutil.copy(GOLDEN_STATE, at / "state.bin")
    state = stateformat.read_state_file(str(at / "state.bin"), MachineState)
    with open(at / "memory.bin", "wb") as f:
        f.truncate(state.mem_size)
    machine, _, _ = vmmchild._snapshot_machine(str(at))
    return str(at), machine


def _learner(tmp_path: Path, name: str, runs: list[list[int]] | None) -> str:
    """A learner's run directory, with the set it saved (none: it died before ready)."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    if runs is not None:
        (run_dir / vmmchild.WRITE_SET_FILE).write_text(
            json.dumps({"version": 1, "runs": runs}))
    return str(run_dir)


def test_one_child_of_a_batch_learns_until_the_plan_has_a_set(tmp_path: Path) -> None:
    snapshot_dir, machine = _snapshot(tmp_path / "snap")
    first, second = _learner(tmp_path, "a", None), _learner(tmp_path, "b", None)
    assert vmmchild._is_learner(machine, snapshot_dir, first)
    assert not vmmchild._is_learner(machine, snapshot_dir, second)
    # The learner died before ready: nothing to take; the next batch names another.
    vmmchild.run_dir_ending(first)
    assert machine.write_set_pages is None and first not in vmmchild._learners
    vmmchild._batch_learners.clear()
    assert vmmchild._is_learner(machine, snapshot_dir, second)


def test_a_learners_set_is_taken_at_its_reap_and_ends_the_learning(tmp_path: Path) -> None:
    snapshot_dir, machine = _snapshot(tmp_path / "snap")
    run_dir = _learner(tmp_path, "a", [[0, 2 * PAGE], [0x10_0000, PAGE]])
    key = vmmchild.forker_image_key()
    assert vmmchild._is_learner(machine, snapshot_dir, run_dir)
    vmmchild.run_dir_ending(run_dir)
    assert machine.write_set_pages == 3
    # A forker cloned before holds the plan without its set.
    assert vmmchild.forker_image_key() != key
    vmmchild._batch_learners.clear()
    assert not vmmchild._is_learner(machine, snapshot_dir, _learner(tmp_path, "b", None))


def test_the_prefork_takes_the_newest_learners_set(tmp_path: Path) -> None:
    """A learner still running at the next batch (its set saved at ready) gives it."""
    snapshot_dir, machine = _snapshot(tmp_path / "snap")
    for name, runs in (("old", [[0, PAGE]]), ("new", [[0, 4 * PAGE]])):
        vmmchild._batch_learners.clear()
        assert vmmchild._is_learner(machine, snapshot_dir, _learner(tmp_path, name, runs))
    vmmchild._learn_write_set(machine, snapshot_dir)
    assert machine.write_set_pages == 4
    assert not vmmchild._learners


def test_a_hostile_set_is_refused_and_its_learner_forgotten(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    snapshot_dir, machine = _snapshot(tmp_path / "snap")
    beyond_ram = [[64 << 20, PAGE]]
    run_dir = _learner(tmp_path, "a", beyond_ram)
    assert vmmchild._is_learner(machine, snapshot_dir, run_dir)
    with caplog.at_level(logging.WARNING, logger=vmmchild.log.name):
        vmmchild.run_dir_ending(run_dir)
    assert machine.write_set_pages is None and not vmmchild._learners
    assert "not inside guest RAM" in caplog.text
    # A link the learner left in place of its file is not followed.
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"version": 1, "runs": [[0, PAGE]]}))
    run_dir = _learner(tmp_path, "b", None)
    (Path(run_dir) / vmmchild.WRITE_SET_FILE).symlink_to(target)
    vmmchild._batch_learners.clear()
    assert vmmchild._is_learner(machine, snapshot_dir, run_dir)
    vmmchild.run_dir_ending(run_dir)
    assert machine.write_set_pages is None


def test_a_set_larger_than_a_quarter_of_the_ram_is_cut(tmp_path: Path) -> None:
    snapshot_dir, machine = _snapshot(tmp_path / "snap")
    mib = 1 << 20
    run_dir = _learner(tmp_path, "a", [[at * mib, mib] for at in range(32)])
    assert vmmchild._is_learner(machine, snapshot_dir, run_dir)
    vmmchild.run_dir_ending(run_dir)
    assert machine.write_set_pages == (64 << 20) // 4 // PAGE


def test_no_learner_with_write_sets_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    monkeypatch.setenv(vmmchild.WRITE_SET_ENV, "0")
    snapshot_dir, machine = _snapshot(tmp_path / "snap")
    assert not vmmchild._is_learner(machine, snapshot_dir, _learner(tmp_path, "a", None))
