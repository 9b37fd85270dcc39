"""Snapshot a running tiny guest and restore it into a fresh machine."""

from __future__ import annotations

import os
from pathlib import Path

from tests.kvm.tinyguest import Script, script_machine, wait_until
from vmfork.vmm.devices.plan import device_plan
from vmfork.vmm.machine import Machine, MachineConfig

COUNTER = 0x300000
PATTERN_AT = 0x380000


def test_restored_guest_continues_where_it_stopped(tmp_path: Path) -> None:
    mem = str(tmp_path / "memory.bin")
    pattern = os.urandom(64 << 10)
    parent, _ = script_machine(Script().count_forever(COUNTER), memfd=True)
    with parent:
        parent.memory.write(PATTERN_AT, pattern)
        parent.start()
        assert wait_until(lambda: parent.memory.read_u64(COUNTER) > 10_000)
        state, timings = parent.snapshot(mem, resume=False)
        at_snapshot = parent.memory.read_u64(COUNTER)
        assert timings["memory_bytes"] < 8 << 20     # sparse: only touched memory
        parent.stop()
    assert os.stat(mem).st_size == 64 << 20
    assert int.from_bytes(open(mem, "rb").read()[COUNTER:COUNTER + 8], "little") == at_snapshot

    children = [Machine(MachineConfig(restore_state=state, memory_file=mem, mem_mib=64,
                                      rng=False, memfd=False)) for _ in range(2)]
    try:
        for child in children:
            assert child.memory.read_u64(COUNTER) == at_snapshot
            assert child.memory.read(PATTERN_AT, len(pattern)) == pattern
            child.start()
        for child in children:
            assert wait_until(lambda c=child: c.memory.read_u64(COUNTER) > at_snapshot + 1000)
        # Children write privately: the snapshot file and each other are untouched.
        children[0].pause()
        children[0].memory.write(PATTERN_AT, b"\0" * 16)
        assert children[1].memory.read(PATTERN_AT, 16) == pattern[:16]
        with open(mem, "rb") as f:
            f.seek(PATTERN_AT)
            assert f.read(16) == pattern[:16]
            f.seek(COUNTER)
            assert int.from_bytes(f.read(8), "little") == at_snapshot
    finally:
        for child in children:
            child.close()


def test_a_restore_serves_its_native_devices_from_the_plans_it_is_handed(
        tmp_path: Path) -> None:
    """A forked child is handed its snapshot's device plans, built once in the zygote
    (``MachineConfig.restore_plans``), and builds none itself: a plan that differs from
    the one the record makes (rng's per-notify budget) is the one the device serves
    with. Without plans, the record's."""
    mem = str(tmp_path / "memory.bin")
    parent, _ = script_machine(Script().count_forever(COUNTER), rng=True, memfd=True)
    with parent:
        parent.start(paused=True)
        state, _ = parent.snapshot(mem, resume=False)
        parent.stop()
    (record,) = (d for d in state.devices if d.kind == "rng")
    plan = device_plan(record)
    (name, requests, request_bytes, last), *rest = plan
    assert record.slot is not None
    handed = {record.slot: ((name, requests + 7, request_bytes, last), *rest)}
    for plans, served in ((handed, requests + 7), (None, requests)):
        child = Machine(MachineConfig(restore_state=state, restore_plans=plans,  # type: ignore[arg-type]
                                      memory_file=mem, mem_mib=64, memfd=False))
        with child:
            assert child.rng is not None
            assert child.rng.device.plan()[0] == (name, served, request_bytes, last)
