"""BRANCH a running sandbox (the real Linux guest) in every mode, repeatedly and nested.

The warm parent starts a thread that keeps bumping a counter and writing it into
``SLOTS`` slots of a buffer in order, so the buffer of any one instant holds
``c, ..., c, c-1, ..., c-1``. A sandbox forked from it is branched while that
thread runs; children of every branch must see such a buffer, a counter at
least as high as before the branch, the warm state, and must run on; the source
must run on too, its agent answering and its clock right.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_native_chain import _zygote
from vmfork.image import find_image
from vmfork.runtime.branch import BranchFailed, branch_sandbox
from vmfork.runtime.parent import snapshot_parent
from vmfork.runtime.spawn import Child, fork_children
from vmfork.runtime.zygote_client import ZygoteProcess
from vmfork.store import Snapshot, Store

SLOTS = 256
WARM = f"""
import threading, time
pattern = bytes(range(256)) * 4096
slots = [0] * {SLOTS}
buf = bytearray({SLOTS} * 4096)
counter = 0
def _writer():
    global counter
    while True:
        counter += 1
        value = counter.to_bytes(8, 'little')
        for i in range({SLOTS}):
            buf[i * 4096:i * 4096 + 8] = value
        time.sleep(0.002)
threading.Thread(target=_writer, daemon=True).start()
time.sleep(0.2)
"""
# One C-level copy under the GIL, so the guest's writer thread cannot run in the middle.
READ_BUF = "memoryview(bytes(buf)).cast('Q')[::512].tolist()"


@pytest.fixture(scope="module", params=["python", "native"])
def child_kind(request: pytest.FixtureRequest) -> str:
    """Every test runs on a Python child and on a native one (``VMFORK_NATIVE_CHILD=1``:
    its BRANCH taken of the machine's Python view, ``vmm/native_view.py``)."""
    return str(request.param)


@pytest.fixture(scope="module")
def store(child_kind: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    # Its snapshots are whole memory images (hundreds of MiB each); in the emulated
    # test host /tmp is RAM, so they go when the kind's tests are done.
    home = tmp_path_factory.mktemp(f"home-{child_kind}")
    yield Store.open(home)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def warm(store: Store) -> Snapshot:
    return snapshot_parent(store, "warm", find_image(), mem_mib=256, warm_code=WARM).snapshot


@pytest.fixture(scope="module")
def zygote(child_kind: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ZygoteProcess]:
    # Generous: the zygote imports over 9p, slow in a busy emulated test host.
    proc = _zygote(tmp_path_factory.mktemp("zygote") / "z.sock", child_kind == "native")
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vms")


def _spawn(zygote: ZygoteProcess, snapshot: Snapshot, run_root: Path) -> Child:
    report = fork_children(zygote.client(), snapshot, 1, run_root, timeout=300)
    assert not report.failed, report.failed
    return report.children[0]


@pytest.fixture(scope="module")
def source(zygote: ZygoteProcess, warm: Snapshot, run_root: Path) -> Iterator[Child]:
    child = _spawn(zygote, warm, run_root)
    yield child
    zygote.client().kill_and_wait(child.vm_id)


def _counter(child: Child) -> int:
    return int(child.agent.eval("counter").value)


def _consistent_buffer(child: Child) -> int:
    values = [int(v) for v in child.agent.eval(READ_BUF).value.strip("[]").split(",")]
    top = values[0]
    split = next((i for i, v in enumerate(values) if v != top), SLOTS)
    assert all(v == top - 1 for v in values[split:]), values
    return int(top)


def _check_child(zygote: ZygoteProcess, snapshot: Snapshot, run_root: Path,
                 at_least: int) -> int:
    child = _spawn(zygote, snapshot, run_root)
    try:
        captured = _consistent_buffer(child)
        assert captured >= at_least
        assert child.agent.eval("len(pattern)").value == str(1 << 20)
        first = _counter(child)
        time.sleep(0.3)
        assert _counter(child) > first           # its writer thread runs on
    finally:
        zygote.client().kill_and_wait(child.vm_id)
    return captured


def _source_runs_on(source: Child) -> None:
    first = _counter(source)
    time.sleep(0.3)
    assert _counter(source) > first
    before = time.time()
    guest = float(source.agent.eval("__import__('time').time()").value)
    assert before - 1.0 < guest < time.time() + 1.0


@pytest.mark.parametrize("mode", ["full", "diff", "live"])
def test_repeated_branches_of_a_running_sandbox(mode: str, store: Store, source: Child,
                                                zygote: ZygoteProcess, run_root: Path) -> None:
    control = str(source.run_dir / "control.sock")
    pauses = []
    for n in range(3):
        before = _counter(source)
        result = branch_sandbox(store, control, f"{mode}-{n}", mode,
                                sandbox_id=source.vm_id).result()
        pauses.append(result.pause_ms)
        _source_runs_on(source)
        if n in (0, 2):
            _check_child(zygote, result.snapshot, run_root, at_least=before)
    print(f"{mode}: pauses {[round(p, 1) for p in pauses]} ms")


def test_a_branch_of_a_branch_child(store: Store, source: Child, zygote: ZygoteProcess,
                                    run_root: Path) -> None:
    first = branch_sandbox(store, str(source.run_dir / "control.sock"), "nest-1",
                           "diff").result().snapshot
    middle = _spawn(zygote, first, run_root)
    try:
        middle.agent.eval("nested = 'in the middle'")
        before = _counter(middle)
        second = branch_sandbox(store, str(middle.run_dir / "control.sock"), "nest-2",
                                "diff").result().snapshot
    finally:
        zygote.client().kill_and_wait(middle.vm_id)
    assert second.meta.parent_tag == "nest-1"
    assert [layer.tag for layer in second.meta.memory_layers][-2:] == ["nest-1", "nest-2"]
    child = _spawn(zygote, second, run_root)
    try:
        assert child.agent.eval("nested").value == repr("in the middle")
        assert _consistent_buffer(child) >= before
    finally:
        zygote.client().kill_and_wait(child.vm_id)


def test_a_failed_branch_leaves_nothing_and_the_source_runs_on(
        store: Store, source: Child) -> None:
    control = str(source.run_dir / "control.sock")
    with pytest.raises(BranchFailed):
        branch_sandbox(store, control, "orphan", "diff", parent_tag="no-such-parent")
    assert not store.exists("orphan")
    _source_runs_on(source)
