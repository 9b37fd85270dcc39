"""The bytes of vmfork's snapshot files do not change when their code moves.

A snapshot outlives the code that wrote it, so ``state.bin``, ``layer.bin`` and
``memory.plan`` are compared here with digests of what the code wrote before it
moved to ``vmfork.ondisk`` (taken from ``vmfork.vmm.stateformat``/``layerfile``/
``memplan`` as they were on main, for the same inputs). A change of format must bump
the format's version and keep reading the old one; it never shows up here silently.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from test_stateformat import make_machine

from vmfork.ondisk import layerfile, memplan, stateformat
from vmfork.vmm.memory import GuestMemory


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def test_state_layer_and_plan_bytes_are_those_of_before(tmp_path: Path) -> None:
    assert _digest(stateformat.encode_state(make_machine(2))) == "be4426c404c2622b"
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
