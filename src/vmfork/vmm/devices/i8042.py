"""The i8042 keyboard controller, reduced to what ends a VM.

Linux reboots with ``reboot=k`` by pulsing the CPU reset line: it waits for the
controller's input buffer to be empty (status bit 1 clear) and writes command
``0xFE`` to port 0x64. That write is how a guest asks to stop, so it calls
``on_reset``. Everything else reads as an idle controller with no data.
"""

from __future__ import annotations

from collections.abc import Callable

CMD_RESET_CPU = 0xFE
STATUS_IDLE = 0x00


class I8042:
    def __init__(self, on_reset: Callable[[], None]) -> None:
        self.on_reset = on_reset
        self.resets = 0

    def read(self, offset: int, size: int) -> bytes:
        # offset 0 = port 0x60 (data: none), offset 4 = port 0x64 (status: idle)
        return bytes([STATUS_IDLE]) * size

    def write(self, offset: int, data: bytes) -> None:
        if offset == 4 and data and data[0] == CMD_RESET_CPU:
            self.resets += 1
            self.on_reset()
