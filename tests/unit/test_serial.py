"""COM1 of the native core (``_core.Console`` behind ``serial.Serial``), driven as a
bus device: no /dev/kvm needed. The vCPU loop reaches the same code for a port
exit (tests/kvm covers that path with real guests)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.vmm.devices.serial import Serial, SerialState
from vmfork.vmm.native import CORE_BUILT

pytestmark = pytest.mark.skipif(not CORE_BUILT, reason="the native core is not built "
                                "(scripts/lib.sh setup_native)")

DATA, IER, IIR, LCR, MCR, LSR, MSR, SCR = range(8)


class Line:
    """An IrqLine stand-in: a real eventfd, as the machine's are."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def raised(self) -> int:
        try:
            return os.eventfd_read(self.fd)
        except BlockingIOError:
            return 0


@pytest.fixture
def line() -> Iterator[Line]:
    irq = Line()
    yield irq
    os.close(irq.fd)


def serial(line: Line, log: Path | None = None):  # type: ignore[no-untyped-def]
    if log is None:
        return Serial(line)  # type: ignore[arg-type]
    with open(log, "ab", buffering=0) as f:
        return Serial(line, f)  # type: ignore[arg-type]


def put(s, text: bytes) -> None:  # type: ignore[no-untyped-def]
    for byte in text:
        s.console.write(DATA, bytes([byte]))


def test_output_reaches_the_log_the_tail_and_the_listeners(line: Line, tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    s = serial(line, log)
    lines: list[str] = []
    s.line_listeners.append(lines.append)
    put(s, b"Hello\r\nworld\npartial")
    assert lines == ["Hello", "world"]
    assert log.read_bytes() == b"Hello\nworld\n"       # the log outlives the Python file
    assert s.tail_text() == "Hello\nworld\npartial"


def test_the_tail_keeps_50_lines_and_cuts_long_ones(line: Line) -> None:
    s = serial(line)
    put(s, b"x" * 5000 + b"\n")
    for i in range(60):
        put(s, f"line {i}\n".encode())
    tail = s.tail_text().split("\n")
    assert len(tail) == 50 and tail[0] == "line 10" and tail[-1] == "line 59"
    s2 = serial(line)
    put(s2, b"y" * 5000 + b"\n")
    assert s2.tail_text() == "y" * 4096


def test_registers_interrupts_and_loopback(line: Line) -> None:
    s = serial(line)
    c = s.console
    assert c.read(LSR, 1)[0] & 0x60 == 0x60          # transmitter empty and idle
    assert c.read(LSR, 2) == bytes([c.read(LSR, 1)[0], 0])   # zero-extended
    c.write(IER, b"\x02")                             # enable THR-empty: raised at once
    assert line.raised() == 1
    assert c.read(IIR, 1)[0] & 0x0F == 0x02
    c.write(LCR, b"\x80")                             # DLAB: the divisor latch
    c.write(DATA, b"\x01")
    assert c.read(DATA, 1) == b"\x01"
    c.write(LCR, b"\x03")
    c.write(MCR, b"\x1f")                             # loopback, all outputs
    assert c.read(MSR, 1)[0] & 0xF0 == 0xF0
    c.write(DATA, b"Z")
    assert c.read(LSR, 1)[0] & 0x01 and c.read(DATA, 1) == b"Z"
    assert s.tail_text() == ""                        # looped back, never output
    assert c.read(99, 1) == b"\xff"                   # outside the 8 registers


def test_state_round_trips_through_the_python_record(line: Line) -> None:
    s = serial(line)
    state = SerialState(dll=1, dlm=2, ier=0x05, lcr=0x1B, mcr=0x0B, scr=0x42,
                        thre_pending=True, rx=b"abc")
    s.restore(state)
    assert s.save() == state
    assert s.console.read(DATA, 1) == b"a"
    # vm-superio's receive FIFO is 64 bytes: longer pending input is cut, never grown.
    s.restore(SerialState(rx=bytes(range(100))))
    assert s.save().rx == bytes(range(64))
    assert s.save() == SerialState(rx=bytes(range(64)))


def test_a_restore_raises_the_interrupt_the_state_has_pending(line: Line) -> None:
    """The irqchip is saved apart from COM1's record and KVM injects an irqfd's pin
    asynchronously, so a snapshot can hold a pending interrupt the irqchip lost: the
    restore raises it again, if the guest enabled it (vm-superio's ``from_state`` does;
    the virtio transports do it in ``NativeTransport::restore``)."""
    s = serial(line)
    s.restore(SerialState(ier=0x02, thre_pending=True))   # THR empty, enabled
    assert line.raised() == 1
    s.restore(SerialState(ier=0x01, rx=b"x"))              # data ready, enabled
    assert line.raised() == 1
    s.restore(SerialState(ier=0x01, thre_pending=True))    # THR empty, not enabled
    s.restore(SerialState(ier=0x02, rx=b"x"))              # data ready, not enabled
    s.restore(SerialState(ier=0x03))                       # nothing pending
    assert line.raised() == 0
