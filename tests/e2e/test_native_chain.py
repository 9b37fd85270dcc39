"""Children that run no Python (``VMFORK_NATIVE_CHILD=1``) spawned from diff snapshots:
each adopts the RAM its zygote mapped ahead (``vmmchild.premap_memory``), the base and
every run of the memory plan, as its own (``machine::InheritedRam``, made writable,
copy-on-write), and unmaps the premaps of the batch's other snapshots it inherited
with the fork; no child maps a run of the plan itself.

The chain (base, then two diff links, each writing a file in the guest) is built by a
zygote whose children run Python; a second
zygote, whose children run no Python, forks one child of each link in one jailed batch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.image import find_image
from vmfork.ondisk.memplan import PLAN_FILE
from vmfork.runtime import control
from vmfork.runtime.branch import branch_sandbox
from vmfork.runtime.parent import snapshot_parent
from vmfork.runtime.spawn import VMM_ENTRY, Child, _jail_request, fork_children, new_vm_id
from vmfork.runtime.zygote_child import NATIVE_CHILD_ENV
from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote
from vmfork.runtime.zygote_protocol import SpawnItem
from vmfork.store import Snapshot, Store

MEM_MIB = 256
LINKS = (("d1", "one"), ("d2", "two"))   # tag, the file each link writes in the guest
READY_TIMEOUT = 300.0


def _zygote(path: Path, native: bool) -> ZygoteProcess:
    env = {**os.environ, NATIVE_CHILD_ENV: "1" if native else "0"}
    # As test_fork's: the imports over the test host's 9p take long.
    return start_zygote(str(path), timeout=300.0, env=env)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Snapshot]:
    """base -> d1 -> d2, each link a diff BRANCH of a Python child of its parent that
    wrote /tmp/chain-<word>. No empty volume slot: blk has no native transport."""
    store = Store.open(tmp_path_factory.mktemp("home"))
    snapshots = {"base": snapshot_parent(store, "base", find_image(), mem_mib=MEM_MIB,
                                         warm_code="answer = 41",
                                         free_volume_slots=0).snapshot}
    zygote = _zygote(tmp_path_factory.mktemp("python-zygote") / "z.sock", native=False)
    try:
        client = zygote.client()
        parent = "base"
        for tag, word in LINKS:
            report = fork_children(client, snapshots[parent], 1,
                                   tmp_path_factory.mktemp(f"build-{tag}"))
            assert not report.failed, report.failed
            source = report.children[0]
            done = source.agent.exec(["/bin/sh", "-c", f"echo {word} > /tmp/chain-{word}"])
            assert done.exit_code == 0, done
            branch_sandbox(store, str(source.run_dir / "control.sock"), tag, "diff",
                           parent_tag=parent).result()
            client.kill_and_wait(source.vm_id)
            snapshots[tag] = store.get(tag)
            assert (snapshots[tag].path / PLAN_FILE).exists()
            parent = tag
    finally:
        zygote.close()
    return snapshots


@pytest.fixture(scope="module")
def children(chain: dict[str, Snapshot],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Child]]:
    """One native child of d1 and one of d2, forked in one batch (so each inherits the
    other's premap too), jailed as spawns are by default."""
    zygote = _zygote(tmp_path_factory.mktemp("native-zygote") / "z.sock", native=True)
    run_root = tmp_path_factory.mktemp("vms")
    try:
        client = zygote.client()
        items, by_tag = [], {}
        for tag, _ in LINKS:
            vm_id = new_vm_id()
            run_dir = run_root / vm_id
            items.append(SpawnItem(vm_id, {
                "snapshot_dir": str(chain[tag].path), "run_dir": str(run_dir),
                "vm_id": vm_id, "log_path": str(run_dir / "vmm.log"),
                "ready_timeout": READY_TIMEOUT}, None, jail=_jail_request(chain[tag], [])))
            by_tag[tag] = vm_id
        result = client.spawn_many(VMM_ENTRY, items, timeout=READY_TIMEOUT)
        assert not result.failed, result.failed
        pids = {c.vm_id: c.pid for c in result.children}
        spawned = {tag: Child(vm_id, pids[vm_id], run_root / vm_id)
                   for tag, vm_id in by_tag.items()}
        deadline = time.monotonic() + READY_TIMEOUT
        while any(c.read_status().get("state") != "ready" for c in spawned.values()):
            states = {tag: c.status for tag, c in spawned.items()}
            assert not any(s.get("state") == "failed" for s in states.values()), states
            assert time.monotonic() < deadline, states
            time.sleep(0.2)
        yield spawned
        for child in spawned.values():
            client.kill_and_wait(child.vm_id)
    finally:
        zygote.close()


def _chain_mappings(pid: int, chain: dict[str, Snapshot]) -> list[tuple[int, str]]:
    """(bytes, file) of each mapping in ``pid`` of a file of the chain's memory. The
    files are known by inode and name: under an overlay (the test host's root) ``maps``
    names the upper layer's file and device, which keeps the inode."""
    files = [chain["base"].path / "memory.bin", *(chain[t].path / "layer.bin" for t, _ in LINKS)]
    by_inode = {(f.stat().st_ino, f.name): str(f) for f in files}
    out = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            file = by_inode.get((int(fields[4]), os.path.basename(fields[5].strip())))
            if file is not None:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((hi - lo, file))
    return out


def test_native_children_of_diff_snapshots_see_their_chain(
        children: dict[str, Child]) -> None:
    expected = {"d1": "one", "d2": "one two"}
    for tag, child in children.items():
        agent = child.agent
        assert agent.eval("answer").value == "41"
        done = agent.exec(["/bin/sh", "-c", "cat /tmp/chain-* | sort | tr '\\n' ' '"])
        assert done.stdout.decode().strip() == expected[tag], tag
        # What a diff BRANCH of it is offered before any capture: its own link
        # (test_native_branch.py branches such a child).
        with control.ControlClient.connect(child.run_dir / "control.sock") as ctl:
            assert [(b.tag, b.kind) for b in ctl.call(control.Status()).snapshot_bases] \
                == [(tag, "restore")]


def test_a_native_child_maps_only_its_own_snapshots_ram(
        chain: dict[str, Snapshot], children: dict[str, Child]) -> None:
    """Its own premap is adopted (its link's layer mapped over the base) and the
    batch's other snapshot's premap is gone: the chain's files cover exactly one
    guest's RAM, and d2's layer is not in d1's child."""
    for tag, child in children.items():
        mapped = _chain_mappings(child.pid, chain)
        assert sum(size for size, _ in mapped) == MEM_MIB << 20, (tag, mapped)
        layers = {path for _, path in mapped if path.endswith("layer.bin")}
        assert str(chain[tag].path / "layer.bin") in layers, (tag, layers)
    d2_layer = str(chain["d2"].path / "layer.bin")
    assert d2_layer not in {path for _, path in _chain_mappings(children["d1"].pid, chain)}
