"""COM1 and the i8042 of the native core (``vmfork._core.Console``,
``native/src/console.rs``: vm-superio's 16550A and the CPU reset line), behind the
interface of ``serial.Serial`` that the rest of the VMM uses.

The vCPU loop serves their ports without Python; this class is the host side:
snapshots (the same ``SerialState`` record the Python device saves, so state
files of either restore on both), the console tail errors quote, line listeners
(called on a vCPU thread, once per line, only while any are registered), input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO

from vmfork import _core
from vmfork.vmm.devices.serial import (
    CONSOLE_BURST,
    CONSOLE_LINES_PER_S,
    CONSOLE_LOG_BYTES,
    SerialState,
)
from vmfork.vmm.irq import IrqLine


class _Listeners(list[Callable[[str], None]]):
    """``Serial.line_listeners``: appending registers with the native console."""

    def __init__(self, console: _core.Console) -> None:
        super().__init__()
        self._console = console

    def append(self, listener: Callable[[str], None]) -> None:
        super().append(listener)
        self._console.add_line_listener(listener)


class NativeSerial:
    def __init__(self, line: IrqLine, log: BinaryIO | None = None) -> None:
        self.console = _core.Console(line.fd, log.fileno() if log is not None else None,
                                     log_burst=CONSOLE_BURST,
                                     log_per_second=CONSOLE_LINES_PER_S,
                                     log_total_bytes=CONSOLE_LOG_BYTES)
        self.line_listeners = _Listeners(self.console)

    def tail_text(self) -> str:
        return self.console.tail_text()

    def queue_input(self, data: bytes) -> None:
        self.console.queue_input(data)

    def save(self) -> SerialState:
        dll, dlm, ier, lcr, mcr, scr, thre_pending, rx = self.console.save()
        return SerialState(dll, dlm, ier, lcr, mcr, scr, thre_pending, bytes(rx))

    def restore(self, state: SerialState) -> None:
        self.console.restore(state.dll, state.dlm, state.ier, state.lcr, state.mcr, state.scr,
                             state.thre_pending, state.rx)
