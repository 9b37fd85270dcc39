"""A 16450-style UART (8250 family) at COM1, the guest's console.

Enough of the chip for Linux's 8250 driver: divisor latch, interrupt enable,
interrupt identification (THR-empty and received-data interrupts), line and
modem control with loopback (the driver's probe checks that MSR mirrors MCR in
loopback), line status. There is no FIFO: IIR never reports one, so the driver
treats it as a 16450 and writes one byte per THR-empty interrupt.

Output goes to the per-VM console log (flushed per line; at most
``CONSOLE_LINES_PER_S`` lines a second after a burst, ``CONSOLE_LOG_BYTES`` in all,
with a marker line where lines were dropped: the guest decides what it prints)
and to an optional sink; the last lines are kept in memory so that errors (a kernel panic, a guest
that never became ready) can show the console tail.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from vmfork.vmm.bounded import LogBudget
from vmfork.vmm.irq import Interrupt

DATA = 0          # RBR (read) / THR (write); DLL when DLAB
IER = 1           # DLM when DLAB
IIR = 2           # FCR on write
LCR = 3
MCR = 4
LSR = 5
MSR = 6
SCR = 7

IER_RDA = 0x01
IER_THRE = 0x02
IIR_NONE = 0x01
IIR_THRE = 0x02
IIR_RDA = 0x04
LCR_DLAB = 0x80
MCR_DTR, MCR_RTS, MCR_OUT1, MCR_OUT2, MCR_LOOP = 0x01, 0x02, 0x04, 0x08, 0x10
LSR_DR, LSR_THRE, LSR_TEMT = 0x01, 0x20, 0x40
MSR_CTS, MSR_DSR, MSR_RI, MSR_DCD = 0x10, 0x20, 0x40, 0x80

TAIL_LINES = 50
INPUT_LIMIT = 64 * 1024
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


class Serial:
    def __init__(self, interrupt: Interrupt, log: BinaryIO | None = None,
                 sink: Callable[[bytes], None] | None = None) -> None:
        self.interrupt = interrupt
        self.log = log
        self.sink = sink
        self.state = SerialState()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._line = bytearray()
        self._rx: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()
        self.line_listeners: list[Callable[[str], None]] = []
        self.log_budget = LogBudget("console", burst=CONSOLE_BURST,
                                    per_second=CONSOLE_LINES_PER_S,
                                    total_bytes=CONSOLE_LOG_BYTES)

    # -- host side ---------------------------------------------------------------------
    def queue_input(self, data: bytes) -> None:
        with self._lock:
            room = INPUT_LIMIT - len(self._rx)
            self._rx.extend(data[:max(room, 0)])
            raise_irq = bool(self.state.ier & IER_RDA) and bool(self._rx)
        if raise_irq:
            self.interrupt.trigger()

    def tail_text(self) -> str:
        with self._lock:
            lines = list(self.tail)
            if self._line:
                lines.append(self._line.decode(errors="replace"))
        return "\n".join(lines)

    def _emit(self, byte: int) -> None:
        if self.sink is not None:
            self.sink(bytes([byte]))
        if byte == 0x0A:
            line = self._line.decode(errors="replace").rstrip("\r")
            self._line.clear()
            self.tail.append(line)
            if self.log is not None:
                data = line.encode() + b"\n"
                allowed, marker = self.log_budget.take(len(data))
                if marker is not None:
                    self.log.write(marker.encode() + b"\n")
                if allowed:
                    self.log.write(data)
                if marker is not None or allowed:
                    self.log.flush()
            for listener in self.line_listeners:
                listener(line)
        elif len(self._line) < 4096:
            self._line.append(byte)

    # -- guest side (vCPU threads) -----------------------------------------------------
    def _loopback_msr(self) -> int:
        mcr = self.state.mcr
        return ((MSR_CTS if mcr & MCR_RTS else 0) | (MSR_DSR if mcr & MCR_DTR else 0)
                | (MSR_RI if mcr & MCR_OUT1 else 0) | (MSR_DCD if mcr & MCR_OUT2 else 0))

    def read(self, offset: int, size: int) -> bytes:
        with self._lock:
            value = self._read(offset)
        return bytes([value]) + b"\0" * (size - 1)

    def _read(self, offset: int) -> int:
        st = self.state
        if offset == DATA:
            if st.lcr & LCR_DLAB:
                return st.dll
            return self._rx.popleft() if self._rx else 0
        if offset == IER:
            return st.dlm if st.lcr & LCR_DLAB else st.ier
        if offset == IIR:
            if st.ier & IER_RDA and self._rx:
                return IIR_RDA
            if st.ier & IER_THRE and st.thre_pending:
                st.thre_pending = False  # reading IIR acknowledges THR-empty
                return IIR_THRE
            return IIR_NONE
        if offset == LCR:
            return st.lcr
        if offset == MCR:
            return st.mcr
        if offset == LSR:
            return LSR_THRE | LSR_TEMT | (LSR_DR if self._rx else 0)
        if offset == MSR:
            return self._loopback_msr() if st.mcr & MCR_LOOP else (MSR_DCD | MSR_DSR | MSR_CTS)
        if offset == SCR:
            return st.scr
        return 0xFF

    def write(self, offset: int, data: bytes) -> None:
        raise_irq = False
        with self._lock:
            st = self.state
            value = data[0] if data else 0
            if offset == DATA:
                if st.lcr & LCR_DLAB:
                    st.dll = value
                else:
                    if st.mcr & MCR_LOOP:
                        if len(self._rx) < INPUT_LIMIT:
                            self._rx.append(value)
                    else:
                        self._emit(value)
                    st.thre_pending = True
                    raise_irq = bool(st.ier & IER_THRE) or (
                        bool(st.ier & IER_RDA) and bool(self._rx))
            elif offset == IER:
                if st.lcr & LCR_DLAB:
                    st.dlm = value
                else:
                    newly_thre = bool(value & IER_THRE) and not st.ier & IER_THRE
                    st.ier = value & 0x0F
                    if newly_thre:
                        # Enabling THRE with an empty transmitter raises it at once.
                        st.thre_pending = True
                        raise_irq = True
                    if st.ier & IER_RDA and self._rx:
                        raise_irq = True
            elif offset == LCR:
                st.lcr = value
            elif offset == MCR:
                st.mcr = value & 0x1F
            elif offset == SCR:
                st.scr = value
            # FCR (offset IIR), LSR and MSR writes are ignored: no FIFO, read-only.
        if raise_irq:
            self.interrupt.trigger()

    # -- snapshots ------------------------------------------------------------------------
    def save(self) -> SerialState:
        with self._lock:
            st = self.state
            return SerialState(st.dll, st.dlm, st.ier, st.lcr, st.mcr, st.scr, st.thre_pending,
                               bytes(self._rx))

    def restore(self, state: SerialState) -> None:
        with self._lock:
            self.state = SerialState(state.dll, state.dlm, state.ier, state.lcr, state.mcr,
                                     state.scr, state.thre_pending, b"")
            self._rx = collections.deque(state.rx)
