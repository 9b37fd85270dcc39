"""COM1, the guest's console: the native core's 16550A (``vmfork._core.Console``,
``native/src/console.rs``, on vm-superio), served on the vCPU thread without Python,
and this module's host side of it.

The vCPU loop serves COM1's ports (and the i8042's CPU reset line, which ends the
VM); ``Serial`` is what the rest of the VMM holds: snapshots (``SerialState``, the
record ``state.bin`` keeps), the console tail errors quote, line listeners (called on
a vCPU thread, once per line, only while any are registered) and input.

Output goes to the per-VM console log (a line at a time; at most
``CONSOLE_LINES_PER_S`` lines a second after a burst of ``CONSOLE_BURST``,
``CONSOLE_LOG_BYTES`` in all, with a marker line where lines were dropped: the guest
decides what it prints); the last ``TAIL_LINES`` lines are kept so that errors (a
kernel panic, a guest that never became ready) can show the console tail.

There is no Python UART any more (issue 19: one implementation of each piece).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from vmfork.vmm.irq import IrqLine
from vmfork.vmm.native import CORE_BUILT

if CORE_BUILT:   # else no machine is made (Machine calls native.require_core first)
    from vmfork import _core

# COM1's registers (offsets from its base port), as the tests drive them.
DATA = 0          # RBR (read) / THR (write); DLL when DLAB
IER = 1           # DLM when DLAB
IIR = 2           # FCR on write
LCR = 3
MCR = 4
LSR = 5
MSR = 6
SCR = 7

MCR_OUT2 = 0x08

TAIL_LINES = 50
CONSOLE_LOG_BYTES = 8 << 20
CONSOLE_LINES_PER_S = 100.0
CONSOLE_BURST = 2000


@dataclass
class SerialState:
    dll: int = 0x0C
    dlm: int = 0
    ier: int = 0
    lcr: int = 0x03
    mcr: int = MCR_OUT2
    scr: int = 0
    thre_pending: bool = False
    rx: bytes = b""


class _Listeners(list[Callable[[str], None]]):
    """``Serial.line_listeners``: appending registers with the native console."""

    def __init__(self, console: _core.Console) -> None:
        super().__init__()
        self._console = console

    def append(self, listener: Callable[[str], None]) -> None:
        super().append(listener)
        self._console.add_line_listener(listener)


class Serial:
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
