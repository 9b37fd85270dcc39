"""The bytes of vmfork's snapshot files do not change when their code moves.

A snapshot outlives the code that wrote it, so ``state.bin``, ``layer.bin`` and
``memory.plan`` are compared here with digests of what the code wrote before it
moved to ``vmfork.ondisk`` (taken from ``vmfork.vmm.stateformat``/``layerfile``/
``memplan`` as they were on main, for the same inputs). A change of format must bump
the format's version and keep reading the old one; it never shows up here silently.

``golden/state-v1.bin`` is a machine's ``state.bin`` as the format-1 writer wrote it
(commit ef9118e's ``vmstate.MachineState`` with a field per device: serial, vsock,
rng, net, root disk, balloon and two volume slots, one empty); format 2 must read it
into today's device list (tests/unit/test_device_manager.py checks what it reads).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from test_stateformat import make_machine

from vmfork.ondisk import layerfile, memplan, stateformat
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.vmstate import MachineState

GOLDEN = Path(__file__).parent / "golden"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def test_state_layer_and_plan_bytes_are_those_of_before(tmp_path: Path) -> None:
    # Format 1's bytes for the same tree are still written as they were; format 2
    # changed only the version word (for a class whose payload kept its shape).
    assert _digest(stateformat.encode_state(make_machine(2), version=1)) == "be4426c404c2622b"
    assert _digest(stateformat.encode_state(make_machine(2))) == "88fabd8cd48fd24a"
    memory = GuestMemory.anonymous(1 << 20)
    memory.write(8192, b"x" * 5000)
    path = tmp_path / "layer.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        layerfile.write_layer(fd, memory, [(8192, 8192), (65536, 4096)])
        index = layerfile.read_layer_index(fd)
    finally:
        os.close(fd)
    assert _digest(path.read_bytes()) == "aeb63d712fd12d14"
    plan = memplan.MemoryPlan(
        1 << 20, (memplan.PlanSource("a/memory.bin", 1 << 20, "h", "f"),
                  memplan.PlanSource("b/layer.bin", path.stat().st_size)),
        tuple(memplan.resolve_runs([(1, index)])))
    assert _digest(memplan.encode_plan(plan)) == "1d8e00063c9eef59"
    assert memplan.decode_plan(memplan.encode_plan(plan)) == plan


def test_a_format_1_machine_state_reads_and_writes_as_format_2() -> None:
    data = (GOLDEN / "state-v1.bin").read_bytes()
    assert hashlib.sha256(data).hexdigest()[:16] == "56bae2d1884a5457"
    assert data[8] == 1   # the header's version word
    state = stateformat.decode_state(data, MachineState)
    again = stateformat.encode_state(state)
    assert again[8] == 2 and _digest(again) == "f42fb3ce9003b779"
    assert stateformat.decode_state(again, MachineState) == state
