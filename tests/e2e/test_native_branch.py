"""BRANCH of a child that runs no Python (``VMFORK_NATIVE_CHILD=1``): its control server
hands ``snapshot`` over to Python, which takes it of the running ``NativeMachine``
through the machine's Python view (``vmm/native_view.py``), as of a Python ``Machine``.

A native child of the default parent (jailed, as spawns are by default) writes a file
in the guest before each of a full, a diff (against that full capture: soft-dirty
since it, ``base_kind`` "previous", which the native ``status`` offers once the first
capture told it) and a live BRANCH, and answers ``exec`` after each. Then children of
the branches, native and Python, see the files written before their branch and not
those written after. A native child of the diff branch (RAM adopted from the zygote's
premap of a chain) is branched again (diff against its restore base), and a Python
child of that sees every file. Before this piece each BRANCH failed: the hand-over
refused ``snapshot`` ("a native child does not serve Snapshot yet")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_native_chain import _zygote
from vmfork.image import find_image
from vmfork.runtime import control
from vmfork.runtime.branch import branch_sandbox
from vmfork.runtime.parent import snapshot_parent
from vmfork.runtime.spawn import Child, fork_children
from vmfork.runtime.zygote_client import ZygoteProcess
from vmfork.store import Store

FILES = "ls /tmp | grep '^branch-' | sort | tr '\\n' ' '"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    store = Store.open(tmp_path_factory.mktemp("home"))
    snapshot_parent(store, "base", find_image(), mem_mib=256, warm_code="answer = 41")
    return store


@pytest.fixture(scope="module")
def zygotes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ZygoteProcess]]:
    made = {"native": _zygote(tmp_path_factory.mktemp("native") / "z.sock", native=True),
            "python": _zygote(tmp_path_factory.mktemp("python") / "z.sock", native=False)}
    yield made
    for zygote in made.values():
        zygote.close()


def _spawn(zygote: ZygoteProcess, store: Store, tag: str, run_root: Path) -> Child:
    report = fork_children(zygote.client(), store.get(tag), 1, run_root)
    assert not report.failed, report.failed
    return report.children[0]


def _files(child: Child) -> str:
    done = child.agent.exec(["/bin/sh", "-c", FILES])
    assert done.exit_code == 0, done
    return done.stdout.decode().strip()


def _write(child: Child, name: str) -> None:
    done = child.agent.exec(["/bin/sh", "-c", f"echo {name} > /tmp/branch-{name}"])
    assert done.exit_code == 0, done


def _bases(child: Child) -> list[tuple[str | None, str]]:
    with control.ControlClient.connect(child.run_dir / "control.sock") as ctl:
        return [(b.tag, b.kind) for b in ctl.call(control.Status()).snapshot_bases]


def test_a_native_child_branches_full_diff_and_live(
        store: Store, zygotes: dict[str, ZygoteProcess],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    native, python = zygotes["native"], zygotes["python"]
    source = _spawn(native, store, "base", tmp_path_factory.mktemp("source"))
    socket = str(source.run_dir / "control.sock")
    # Before any capture, as a Python child's: the restore base, tracked soft-dirty.
    assert _bases(source) == [("base", "restore")]
    results = {}
    written: list[str] = []
    for mode, base in (("full", None), ("diff", "full"), ("live", None)):
        _write(source, mode)
        written.append(f"branch-{mode}")
        results[mode] = branch_sandbox(store, socket, mode, mode).result()
        assert results[mode].base_tag == base, results[mode]
        # The source runs on and answers, and status offers this capture as a base.
        assert _files(source) == " ".join(sorted(written))
        assert _bases(source) == [(mode, "previous"), ("base", "restore")]
    # The diff's pages were listed in the pause and written by a forked writer.
    assert results["diff"].vmm_timings.get("fork_s") is not None
    assert results["diff"].snapshot.meta.parent_tag == "full"
    _write(source, "after")
    assert _files(source) == "branch-after branch-diff branch-full branch-live"

    seen = {"full": "branch-full", "diff": "branch-diff branch-full",
            "live": "branch-diff branch-full branch-live"}
    run_root = tmp_path_factory.mktemp("children")
    for tag, files in seen.items():
        for zygote in (native, python):
            child = _spawn(zygote, store, tag, run_root)
            assert _files(child) == files, (tag, zygote is native)
            assert child.agent.eval("answer").value == "41"
            zygote.client().kill_and_wait(child.vm_id)

    # A native child of the diff branch adopts the zygote's premap of its chain; its
    # own diff is against that restore base (the chain's layers read as its base).
    again = _spawn(native, store, "diff", run_root)
    assert _bases(again) == [("diff", "restore")]
    _write(again, "again")
    result = branch_sandbox(store, str(again.run_dir / "control.sock"), "again",
                            "diff").result()
    assert result.base_tag == "diff" and result.dirty_pages
    assert _files(again) == "branch-again branch-diff branch-full"
    last = _spawn(python, store, "again", run_root)
    assert _files(last) == "branch-again branch-diff branch-full"
    for zygote, child in ((native, source), (native, again), (python, last)):
        zygote.client().kill_and_wait(child.vm_id)
