"""What a hostile guest can make the VMM hold (issue 16, item 2's VMM half).

Real device objects, driven the way a guest drives them: the vsock device through its
virtio-mmio transport and split virtqueues (the ``test_virtio_harness`` driver), the
port-I/O bus with unmapped accesses, the UART with console lines, the event loop with
failing callbacks. Growth is measured as the process's peak RSS (``VmHWM``, reset by
``/proc/self/clear_refs`` = 5) over the whole run, plus the structures' own sizes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_virtio_harness import loop, memory  # noqa: F401
from test_virtio_vsock import VsockEnv, pkt

from tests.memory_support import grown_bytes, reset_peak
from vmfork import _core
from vmfork.vmm.bounded import BoundedCounter, LogBudget
from vmfork.vmm.bus import Bus
from vmfork.vmm.devices import serial
from vmfork.vmm.devices.virtio import vsock
from vmfork.vmm.devices.virtio.vsock import Op
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.irq import IrqLine

MiB = 1 << 20








@pytest.fixture
def env(loop: EventLoop) -> Iterator[VsockEnv]:  # noqa: F811
    with VsockEnv(loop) as e:
        yield e


def test_a_million_packets_with_guest_chosen_cids_grow_nothing(env: VsockEnv) -> None:
    """Each packet names a different (src, dst) CID pair: the counter keys were those
    CIDs (+6.6 MiB per 50k packets)."""
    total = 1_000_000
    batch = 32   # packets per notify; the TX queue has 64 descriptors, 1 per packet
    before = reset_peak()
    t0 = time.monotonic()
    sent = 0
    while sent < total:
        while len(env.tx.free) < batch:
            env.tx.take_used()
        for _ in range(batch):
            env.tx.post(readable=[pkt(Op.RW, 1, 2, 0, src_cid=1000 + sent,
                                      dst_cid=7 + sent).pack()])
            sent += 1
        env.driver.notify(vsock.TX_QUEUE)
    key = "tx packet with a wrong source or destination CID"
    deadline = time.monotonic() + 120
    while env.errors.get(key) != total and time.monotonic() < deadline:
        env.tx.take_used()
        time.sleep(0.01)
    grown = grown_bytes(before)
    assert env.errors == {key: total}
    assert not env.needs_reset
    assert grown < MiB, f"{total} hostile packets grew the VMM by {grown / MiB:.1f} MiB"
    print(f"vsock: {total} packets in {time.monotonic() - t0:.1f} s, +{grown / 1024:.0f} KiB")


def test_a_million_unmapped_exits_at_distinct_addresses_grow_nothing() -> None:
    """The bus logs the first accesses per address; the per-address dict was the
    guest's to grow (+24 MiB per 300k addresses)."""
    bus = Bus("pio")
    exits: BoundedCounter[tuple[str, int]] = BoundedCounter(64)  # as Vcpu.io_exits
    before = reset_peak()
    for addr in range(1_000_000):
        bus.read(addr * 8, 1)
        bus.write(addr * 8 + 4, b"\0")
        exits.add(("mmio", addr << 12))
    grown = grown_bytes(before)
    assert bus.unmapped_reads == bus.unmapped_writes == 1_000_000
    assert len(bus._logged) <= 256
    assert len(exits) == 64 and exits.total() == 1_000_000 and exits.other == 1_000_000 - 64
    assert grown < MiB, f"10^6 unmapped exits grew the VMM by {grown / MiB:.1f} MiB"


def _console_lines(console: _core.Console, lines: int, text: bytes = b"x" * 60) -> None:
    # Byte by byte, as the vCPU loop hands COM1 the guest's writes.
    for _ in range(lines):
        for byte in text + b"\n":
            console.write(serial.DATA, bytes([byte]))


@contextlib.contextmanager
def _logged_console(log_path: Path, **budget: Any) -> Iterator[_core.Console]:
    """COM1 as the vCPU loop serves it (the native console), logging to ``log_path``
    with the given budget."""
    irq = IrqLine(gsi=4)
    try:
        with open(log_path, "ab", buffering=0) as log:
            yield _core.Console(irq.fd, log.fileno(), **budget)
    finally:
        irq.close()


def test_a_flood_of_console_lines_is_capped(tmp_path: Path) -> None:
    # A rate no loop outruns, so the cap alone decides, however fast this host is.
    log_path = tmp_path / "console.log"
    with _logged_console(log_path, log_burst=100, log_per_second=1e12,
                         log_total_bytes=64 << 10) as console:
        _console_lines(console, 50_000)   # 3 MB of guest output, far past the cap
    text = log_path.read_text()
    assert len(text) <= (64 << 10) + 200
    assert text.rstrip().endswith("later lines are dropped]")   # the cap's final notice
    assert console.log_dropped > 40_000
    assert len(console.tail_text().splitlines()) == 50   # the tail stays its size


def test_console_lines_over_the_rate_are_dropped_and_marked(tmp_path: Path) -> None:
    log_path = tmp_path / "console.log"
    with _logged_console(log_path, log_burst=100, log_per_second=1,
                         log_total_bytes=1 << 20) as console:
        _console_lines(console, 300)      # a burst's worth, then 200 over the rate
        time.sleep(1.05)                  # one token back at 1 line/s
        _console_lines(console, 1, b"after")
    lines = log_path.read_text().splitlines()
    # (Lines 100-299 take far less than the second a token needs to come back.)
    assert console.log_dropped == 200
    assert lines[100].startswith("[vmfork: ") and "console lines dropped" in lines[100]
    assert lines[101] == "after"


def test_log_budget_rate_limits_and_marks() -> None:
    budget = LogBudget("VMM log", burst=3, per_second=10, total_bytes=1000)
    results = [budget.take(10) for _ in range(5)]
    assert [ok for ok, _ in results] == [True, True, True, False, False]
    time.sleep(0.15)
    ok, marker = budget.take(10)
    assert ok and marker is not None and "2 VMM log lines dropped" in marker
    ok, marker = budget.take(2000)
    assert not ok and marker is not None and "truncated" in marker
    assert budget.take(1) == (False, None)
