"""A guest-side virtio driver for the unit tests of the virtio devices.

``GuestDriver`` plays the Linux virtio-mmio driver: it writes the registers of a
native device's window (``Window``, served as the vCPU loop serves it) and lays out
real split virtqueues in a real ``GuestMemory``; the device's server runs on a real
native loop.
The other ``test_virtio_*`` modules import it (pytest puts this directory on
``sys.path``); the tests here check the harness itself against the spec layout.
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from vmfork import _core
from vmfork.vmm.devices.virtio import mmio
from vmfork.vmm.devices.virtio.device import (
    STATUS_ACKNOWLEDGE,
    STATUS_DRIVER,
    STATUS_DRIVER_OK,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
)
from vmfork.vmm.devices.virtio.queue import VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop, new_event_loop
from vmfork.vmm.memory import GuestMemory

MEM_SIZE = 48 << 20
# Where a native device's window sits in a test's MMIO map (``Window.of``).
WINDOW = 0xD000_0000


def wait_until(cond: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `cond` until it holds; generous, since a loaded machine (the suite runs its
    tiers side by side) can hold a device's thread off the CPU for seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


def spin_holding_the_gil(kick: Callable[[], object], done: Callable[[], bool],
                         limit: float = 5.0) -> float:
    """``kick()``, then spin in Python until ``done()`` or ``limit`` seconds, with no
    other Python thread let run meanwhile (a 30 s switch interval): what a native server
    does in that time it did without the GIL. Returns the seconds spent."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        kick()
        t0 = time.monotonic()
        while not done() and time.monotonic() - t0 < limit:
            pass
        return time.monotonic() - t0
    finally:
        sys.setswitchinterval(old)


class DriverQueue:
    """The driver's half of one split virtqueue; descriptor i owns buffer slot i."""

    def __init__(self, memory: GuestMemory, size: int, ring_base: int, buf_base: int,
                 buf_size: int) -> None:
        self.memory = memory
        self.size = size
        self.desc = ring_base
        self.avail = self.desc + 16 * size
        self.used = (self.avail + 6 + 2 * size + 3) & ~3
        self.end = self.used + 6 + 8 * size
        self.buf_base = buf_base
        self.buf_size = buf_size
        self.free = list(range(size))
        self.chains: dict[int, list[tuple[int, int, bool]]] = {}  # head -> (desc, len, writable)
        self.avail_idx = 0
        self.last_used = 0

    def buf_addr(self, index: int) -> int:
        return self.buf_base + index * self.buf_size

    def post(self, readable: Sequence[bytes] = (), writable: Sequence[int] = ()) -> int:
        parts = [(bytes(b), len(b), False) for b in readable] + \
                [(b"", n, True) for n in writable]
        assert parts and len(parts) <= len(self.free), "driver queue has no free descriptors"
        ids = [self.free.pop(0) for _ in parts]
        for k, (index, (data, length, wr)) in enumerate(zip(ids, parts)):
            assert length <= self.buf_size
            last = k == len(ids) - 1
            flags = (0 if last else VIRTQ_DESC_F_NEXT) | (VIRTQ_DESC_F_WRITE if wr else 0)
            self.memory.write(self.desc + 16 * index, struct.pack(
                "<QIHH", self.buf_addr(index), length, flags, 0 if last else ids[k + 1]))
            if data:
                self.memory.write(self.buf_addr(index), data)
        self.chains[ids[0]] = [(i, p[1], p[2]) for i, p in zip(ids, parts)]
        self.memory.write_u16(self.avail + 4 + 2 * (self.avail_idx % self.size), ids[0])
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        self.memory.write_u16(self.avail + 2, self.avail_idx)
        return ids[0]

    def used_idx(self) -> int:
        return self.memory.read_u16(self.used + 2)

    def take_used(self) -> list[tuple[int, int, bytes]]:
        """New used elements as (head, written length, bytes of the writable part)."""
        out = []
        idx = self.used_idx()
        while self.last_used != idx:
            elem = self.used + 4 + 8 * (self.last_used % self.size)
            head, written = struct.unpack("<II", self.memory.read(elem, 8))
            self.last_used = (self.last_used + 1) & 0xFFFF
            data = bytearray()
            for index, length, wr in self.chains.pop(head):
                if wr and len(data) < written:
                    data += self.memory.read(self.buf_addr(index),
                                             min(length, written - len(data)))
                self.free.append(index)
            out.append((head, written, bytes(data)))
        return out


class Window:
    """A native device's register window as its driver sees it: through the MMIO
    bus's map, served as the vCPU loop serves it."""

    def __init__(self, windows: _core.MmioWindows, base: int) -> None:
        self.windows, self.base = windows, base

    @classmethod
    def of(cls, device: _core.NativeDevice) -> Window:
        """``device``'s window, at ``WINDOW`` in a map of its own."""
        windows = _core.MmioWindows()
        windows.add_native(WINDOW, device)
        return cls(windows, WINDOW)

    def read(self, offset: int, size: int) -> bytes:
        data = self.windows.read(self.base + offset, size)
        assert data is not None
        return data

    def write(self, offset: int, data: bytes) -> None:
        assert self.windows.write(self.base + offset, bytes(data))


def native_device(loop: EventLoop, memory: GuestMemory, plan: object, irq: int,
                  notify: list[int | None], **host: object
                  ) -> tuple[_core.NativeDevice, Window]:
    """A device restored from ``plan`` by its native transport (as ``Machine`` serves
    it), in the window of a map of its own; ``host``: ``NativeDevice.restore``'s
    host resources (a vsock's listener, a disk's file, a net device's tap)."""
    assert isinstance(loop, NativeEventLoop) and memory.native is not None
    device = _core.NativeDevice.restore(plan, memory.native,  # type: ignore[arg-type]
                                        loop.native_loop, irq, notify, **host)
    return device, Window.of(device)


class GuestDriver:
    def __init__(self, transport: Window, memory: GuestMemory) -> None:
        self.t = transport
        self.memory = memory
        self.next_free = 0x10000
        self.queues: dict[int, DriverQueue] = {}

    def r(self, offset: int) -> int:
        return int.from_bytes(self.t.read(offset, 4), "little")

    def w(self, offset: int, value: int) -> None:
        self.t.write(offset, value.to_bytes(4, "little"))

    @property
    def status(self) -> int:
        return self.r(mmio.REG_STATUS)

    def alloc(self, length: int, align: int = 4096) -> int:
        addr = (self.next_free + align - 1) & ~(align - 1)
        self.next_free = addr + length
        assert self.next_free <= self.memory.size, "test guest memory exhausted"
        return addr

    def negotiate(self, features: int = VIRTIO_F_VERSION_1) -> int:
        """Reset, ACKNOWLEDGE, DRIVER, write features, try FEATURES_OK; return status."""
        self.w(mmio.REG_STATUS, 0)
        self.w(mmio.REG_STATUS, STATUS_ACKNOWLEDGE)
        self.w(mmio.REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER)
        for sel in (0, 1):
            self.w(mmio.REG_DRIVER_FEATURES_SEL, sel)
            self.w(mmio.REG_DRIVER_FEATURES, (features >> (32 * sel)) & 0xFFFF_FFFF)
        self.w(mmio.REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK)
        return self.status

    def setup_queue(self, index: int, size: int, buf_size: int) -> DriverQueue:
        self.w(mmio.REG_QUEUE_SEL, index)
        assert self.r(mmio.REG_QUEUE_READY) == 0
        assert self.r(mmio.REG_QUEUE_NUM_MAX) >= size
        ring = self.alloc(16 * size + 6 + 2 * size + 8 + 6 + 8 * size)
        bufs = self.alloc(size * buf_size)
        q = DriverQueue(self.memory, size, ring, bufs, buf_size)
        self.w(mmio.REG_QUEUE_NUM, size)
        for reg, addr in ((mmio.REG_QUEUE_DESC_LOW, q.desc), (mmio.REG_QUEUE_DRIVER_LOW, q.avail),
                          (mmio.REG_QUEUE_DEVICE_LOW, q.used)):
            self.w(reg, addr & 0xFFFF_FFFF)
            self.w(reg + 4, addr >> 32)
        self.w(mmio.REG_QUEUE_READY, 1)
        self.queues[index] = q
        return q

    def driver_ok(self) -> None:
        self.w(mmio.REG_STATUS, self.status | STATUS_DRIVER_OK)

    def start(self, queues: Sequence[tuple[int, int]]) -> list[DriverQueue]:
        """The whole init sequence; ``queues`` is (size, buffer slot size) per queue."""
        status = self.negotiate()
        assert status & STATUS_FEATURES_OK, f"FEATURES_OK refused (status {status:#x})"
        qs = [self.setup_queue(i, size, buf) for i, (size, buf) in enumerate(queues)]
        self.driver_ok()
        return qs

    def notify(self, index: int) -> None:
        self.w(mmio.REG_QUEUE_NOTIFY, index)

    def ack_interrupts(self) -> int:
        bits = self.r(mmio.REG_INTERRUPT_STATUS)
        self.w(mmio.REG_INTERRUPT_ACK, bits)
        return bits


@pytest.fixture
def memory() -> Iterator[GuestMemory]:
    mem = GuestMemory.anonymous(MEM_SIZE)
    yield mem
    mem.close()


@pytest.fixture
def loop(memory: GuestMemory) -> Iterator[EventLoop]:
    """The I/O thread. It depends on ``memory`` so that it stops before guest memory
    is unmapped, as in the VMM: no device callback may run on a closed mapping. The
    VMM's loop, the native one (``eventloop.new_event_loop``)."""
    ev = new_event_loop("test-vmm-io")
    ev.start()
    yield ev
    ev.stop()
    assert not ev.errors, f"exceptions escaped device callbacks: {ev.errors!r}"


# -- the harness against the spec's ring layout ---------------------------------------------
def test_driver_queue_layout_follows_the_split_ring_spec(memory: GuestMemory) -> None:
    q = DriverQueue(memory, 8, 0x1000, 0x8000, 64)
    head = q.post([b"abc"], [16])
    desc = struct.unpack("<QIHH", memory.read(q.desc + 16 * head, 16))
    assert desc == (q.buf_addr(head), 3, VIRTQ_DESC_F_NEXT, 1)
    assert memory.read_u16(q.avail + 2) == 1 and memory.read_u16(q.avail + 4) == head
    assert q.used % 4 == 0 and q.take_used() == []
