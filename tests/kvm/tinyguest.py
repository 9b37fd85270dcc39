"""Purpose-built tiny guests for the KVM tier: no Linux, milliseconds each.

``SCRIPT_GUEST`` (``guests/mmio_script.S``) executes a list of operations the
host writes at ``SCRIPT_ADDR``; ``Script`` composes that list. Values the guest
reads are written to port 0xE9 and collected by ``Recorder``.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

from vmfork.vmm.machine import Machine, MachineConfig, MachineExit

SCRIPT_GUEST = bytes.fromhex(
    "48c7c600002000488b06488b7e08488b5e104883c6184883f80174254883f80274234883f80374234883f8"
    "0474264883f80574274883f8067426b0fee664f4ebfd891febc28b07e7e9ebbc0fb70739d874f9ebb389fa"
    "ece6e9ebac48ff07ebfb4831c948ffc14889fa4989d848890a4881c20010000049ffc875f1ebe6"
)
SCRIPT_ADDR = 0x200000
RECORD_PORT = 0xE9


@dataclass
class Script:
    ops: list[tuple[int, int, int]] = field(default_factory=list)

    def write32(self, addr: int, value: int) -> Script:
        self.ops.append((1, addr, value))
        return self

    def read32(self, addr: int) -> Script:
        self.ops.append((2, addr, 0))
        return self

    def wait16_change(self, addr: int, current: int) -> Script:
        self.ops.append((3, addr, current))
        return self

    def in8(self, port: int) -> Script:
        self.ops.append((4, port, 0))
        return self

    def count_forever(self, addr: int) -> Script:
        self.ops.append((5, addr, 0))
        return self

    def fill_pages_forever(self, addr: int, pages: int) -> Script:
        """Forever: bump a counter, write it at the start of each of ``pages`` pages."""
        self.ops.append((6, addr, pages))
        return self

    def encode(self) -> bytes:
        return b"".join(struct.pack("<QQQ", *op) for op in self.ops) + bytes(24)


class Recorder:
    """A port device collecting what the guest writes to ``RECORD_PORT``."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def read(self, offset: int, size: int) -> bytes:
        return b"\xff" * size

    def write(self, offset: int, data: bytes) -> None:
        self.writes.append(bytes(data))

    def u32s(self) -> list[int]:
        return [int.from_bytes(w, "little") for w in self.writes]


def script_machine(script: Script, **config: object) -> tuple[Machine, Recorder]:
    defaults: dict[str, object] = {"mem_mib": 64, "rng": False, "memfd": False}
    defaults.update(config)
    machine = Machine(MachineConfig(payload=SCRIPT_GUEST, **defaults))  # type: ignore[arg-type]
    recorder = Recorder()
    machine.pio_bus.register(RECORD_PORT, 1, recorder)
    machine.memory.write(SCRIPT_ADDR, script.encode())
    return machine, recorder


def run_script(script: Script, timeout: float = 20.0, **config: object
               ) -> tuple[MachineExit, Recorder, Machine]:
    machine, recorder = script_machine(script, **config)
    machine.start()
    exit_ = machine.wait(timeout)
    if exit_ is None:
        machine.close()
        raise AssertionError(f"tiny guest did not finish within {timeout} s")
    return exit_, recorder, machine


def wait_until(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False
