"""virtio-balloon with free page reporting (devices/virtio/balloon.py), against a real
transport, real guest memory of each kind and the real pagemap (vmm.dirty)."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_restore_prepared import add_device, format_1_file, make_state
from test_virtio_harness import DriverQueue, GuestDriver, wait_until

from vmfork.ondisk import stateformat
from vmfork.vmm import dirty
from vmfork.vmm.devices.manager import BALLOON
from vmfork.vmm.devices.virtio import balloon, mmio
from vmfork.vmm.devices.virtio.device import (
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
)
from vmfork.vmm.devices.virtio.queue import VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE
from vmfork.vmm.eventloop import EventLoop, new_event_loop
from vmfork.vmm.irq import IrqLine
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory
from vmfork.vmm.vmstate import MachineState

MEM = 32 << 20
FEATURES = VIRTIO_F_VERSION_1 | balloon.VIRTIO_BALLOON_F_REPORTING
# Guest pages the tests "free"; the driver's rings and buffers sit below 8 MiB.
FREE_AT = 16 << 20


def _file_memory(tmp: Path) -> GuestMemory:
    path = tmp / "memory.bin"
    with open(path, "wb") as f:
        for page in range(MEM // PAGE_SIZE):
            f.write(struct.pack("<Q", page) * (PAGE_SIZE // 8))
    return GuestMemory.from_file_private(str(path), MEM)


@pytest.fixture(params=["private-file", "anonymous", "memfd"])
def memory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GuestMemory]:
    mem = {"private-file": lambda: _file_memory(tmp_path),
           "anonymous": lambda: GuestMemory.anonymous(MEM),
           "memfd": lambda: GuestMemory.memfd(MEM)}[request.param]()
    yield mem
    mem.close()


@pytest.fixture
def loop(memory: GuestMemory) -> Iterator[EventLoop]:
    ev = new_event_loop("test-balloon-io")
    ev.start()
    yield ev
    ev.stop()
    assert not ev.errors, f"exceptions escaped device callbacks: {ev.errors!r}"


class Env:
    def __init__(self, loop: EventLoop, memory: GuestMemory) -> None:
        self.memory = memory
        self.irq = IrqLine(gsi=9)
        self.dev = balloon.VirtioBalloon(loop)
        self.transport = mmio.MmioTransport(self.dev, memory, self.irq, loop)
        self.driver = GuestDriver(self.transport, memory)
        status = self.driver.negotiate(FEATURES)
        assert status & STATUS_FEATURES_OK, f"FEATURES_OK refused ({status:#x})"
        self.queues = [self.driver.setup_queue(i, balloon.QUEUE_SIZE, 64) for i in range(3)]
        self.driver.driver_ok()
        wait_until(lambda: self.dev.active, what="activation")

    def report(self, ranges: list[tuple[int, int]], queue: int = balloon.REPORTING_QUEUE,
               writable: bool = True) -> int:
        """Post one chain naming ``ranges`` (as Linux's driver does: device-writable
        buffers, one per free block) and wait for it to come back."""
        q: DriverQueue = self.queues[queue]
        ids = [q.free.pop(0) for _ in ranges]
        for k, (index, (gpa, length)) in enumerate(zip(ids, ranges)):
            last = k == len(ids) - 1
            flags = (0 if last else VIRTQ_DESC_F_NEXT) | (VIRTQ_DESC_F_WRITE if writable else 0)
            self.memory.write(q.desc + 16 * index, struct.pack(
                "<QIHH", gpa, length, flags, 0 if last else ids[k + 1]))
        q.chains[ids[0]] = [(i, n, writable) for i, (_, n) in zip(ids, ranges)]
        self.memory.write_u16(q.avail + 4 + 2 * (q.avail_idx % q.size), ids[0])
        q.avail_idx = (q.avail_idx + 1) & 0xFFFF
        self.memory.write_u16(q.avail + 2, q.avail_idx)
        before = q.used_idx()
        self.driver.notify(queue)
        wait_until(lambda: q.used_idx() != before
                   or self.transport.status & STATUS_DEVICE_NEEDS_RESET, what="the report back")
        used = q.take_used()
        return len(used)

    def close(self) -> None:
        self.irq.close()


@pytest.fixture
def env(loop: EventLoop, memory: GuestMemory) -> Iterator[Env]:
    e = Env(loop, memory)
    yield e
    e.close()


def _expected(memory: GuestMemory, page: int) -> bytes:
    """What a dropped page reads back as: the snapshot file's page, or zeros."""
    if memory.private_file:
        return struct.pack("<Q", page) * (PAGE_SIZE // 8)
    return bytes(PAGE_SIZE)


def test_offers_reporting_only_and_never_asks_to_inflate(env: Env) -> None:
    d = env.driver
    d.w(mmio.REG_DEVICE_FEATURES_SEL, 0)
    low = d.r(mmio.REG_DEVICE_FEATURES)
    d.w(mmio.REG_DEVICE_FEATURES_SEL, 1)
    high = d.r(mmio.REG_DEVICE_FEATURES)
    assert (high << 32 | low) == FEATURES
    assert d.r(mmio.REG_DEVICE_ID) == balloon.DEVICE_ID_BALLOON
    assert env.transport.read(mmio.CONFIG_SPACE, 4) == bytes(4)     # num_pages: 0
    env.transport.write(mmio.CONFIG_SPACE + 4, (7).to_bytes(4, "little"))   # actual
    assert env.transport.read(mmio.CONFIG_SPACE + 4, 4) == (7).to_bytes(4, "little")
    env.transport.write(mmio.CONFIG_SPACE, (99).to_bytes(4, "little"))      # read-only
    assert env.transport.read(mmio.CONFIG_SPACE, 4) == bytes(4)


def test_reported_pages_are_dropped_and_no_longer_changed(env: Env) -> None:
    mem = env.memory
    pages = range(FREE_AT // PAGE_SIZE, FREE_AT // PAGE_SIZE + 64)
    for page in pages:
        mem.write(page * PAGE_SIZE, b"\xee" * PAGE_SIZE)
    kept = FREE_AT + 64 * PAGE_SIZE
    mem.write(kept, b"\xab" * PAGE_SIZE)
    if mem.private_file:
        changed = {off for off, n in dirty.changed_private_pages(mem)
                   for off in range(off, off + n, PAGE_SIZE)}
        assert {p * PAGE_SIZE for p in pages} <= changed
    # Two blocks in one report, as the driver sends them (32 and 32 pages).
    assert env.report([(FREE_AT, 32 * PAGE_SIZE), (FREE_AT + 32 * PAGE_SIZE, 32 * PAGE_SIZE)]) == 1
    for page in pages:
        assert mem.read(page * PAGE_SIZE, PAGE_SIZE) == _expected(mem, page)
    assert mem.read(kept, PAGE_SIZE) == b"\xab" * PAGE_SIZE     # not reported: kept
    if mem.private_file:
        changed = {off for off, n in dirty.changed_private_pages(mem)
                   for off in range(off, off + n, PAGE_SIZE)}
        assert not {p * PAGE_SIZE for p in pages} & changed
        assert kept in changed
    stats = env.dev.stats()
    assert stats.reports == 1 and stats.bytes_discarded == 64 * PAGE_SIZE
    assert stats.last_report_age_s is not None and stats.discard_errors == 0
    assert env.transport.read(mmio.REG_INTERRUPT_STATUS, 4)[0] & mmio.INT_USED_BUFFER


def test_reports_during_a_capture_are_acknowledged_and_kept(env: Env) -> None:
    """A capture in flight (vmm/capture.py holds discards from the pause until its
    writer is done) must see the page tables as they were at the pause."""
    mem = env.memory
    mem.write(FREE_AT, b"\xcd" * PAGE_SIZE)
    env.dev.hold_discards()
    env.dev.hold_discards()     # two captures: both must end before a page goes
    assert env.report([(FREE_AT, PAGE_SIZE)]) == 1
    env.dev.release_discards()
    assert env.report([(FREE_AT, PAGE_SIZE)]) == 1
    assert mem.read(FREE_AT, PAGE_SIZE) == b"\xcd" * PAGE_SIZE
    assert env.dev.stats().bytes_discarded == 0 and env.dev.discards_held == 2
    env.dev.release_discards()
    assert env.report([(FREE_AT, PAGE_SIZE)]) == 1
    assert mem.read(FREE_AT, PAGE_SIZE) == _expected(mem, FREE_AT // PAGE_SIZE)
    assert env.dev.stats().bytes_discarded == PAGE_SIZE


def test_a_ragged_range_drops_only_the_whole_pages_inside_it(env: Env) -> None:
    mem = env.memory
    for k in range(4):
        mem.write(FREE_AT + k * PAGE_SIZE, bytes([0x10 + k]) * PAGE_SIZE)
    # From the middle of page 0 to the middle of page 3: only pages 1 and 2 go.
    env.report([(FREE_AT + 100, 3 * PAGE_SIZE)])
    base = FREE_AT // PAGE_SIZE
    assert mem.read(FREE_AT, PAGE_SIZE) == b"\x10" * PAGE_SIZE
    assert mem.read(FREE_AT + 1 * PAGE_SIZE, PAGE_SIZE) == _expected(mem, base + 1)
    assert mem.read(FREE_AT + 2 * PAGE_SIZE, PAGE_SIZE) == _expected(mem, base + 2)
    assert mem.read(FREE_AT + 3 * PAGE_SIZE, PAGE_SIZE) == b"\x13" * PAGE_SIZE
    # A sliver inside one page, and an empty buffer, drop nothing.
    env.report([(FREE_AT + 8, 100), (FREE_AT + 3 * PAGE_SIZE, 0)])
    assert mem.read(FREE_AT, PAGE_SIZE) == b"\x10" * PAGE_SIZE
    assert mem.read(FREE_AT + 3 * PAGE_SIZE, PAGE_SIZE) == b"\x13" * PAGE_SIZE
    assert env.dev.stats().bytes_discarded == 2 * PAGE_SIZE


def test_a_range_outside_guest_ram_resets_the_device_and_drops_nothing(env: Env) -> None:
    mem = env.memory
    mem.write(MEM - PAGE_SIZE, b"\x77" * PAGE_SIZE)
    env.report([(MEM - PAGE_SIZE, 2 * PAGE_SIZE)])
    assert env.transport.status & STATUS_DEVICE_NEEDS_RESET
    assert mem.read(MEM - PAGE_SIZE, PAGE_SIZE) == b"\x77" * PAGE_SIZE
    assert env.dev.stats().bytes_discarded == 0


def test_inflate_buffers_and_readable_reports_are_returned_untouched(env: Env) -> None:
    mem = env.memory
    mem.write(FREE_AT, b"\x55" * PAGE_SIZE)
    assert env.report([(FREE_AT, PAGE_SIZE)], queue=balloon.INFLATE_QUEUE) == 1
    assert env.report([(FREE_AT, PAGE_SIZE)], queue=balloon.DEFLATE_QUEUE) == 1
    assert env.report([(FREE_AT, PAGE_SIZE)], writable=False) == 1
    assert mem.read(FREE_AT, PAGE_SIZE) == b"\x55" * PAGE_SIZE
    assert env.dev.stats().bytes_discarded == 0
    assert env.dev.stats().ignored_buffers == 3


def test_discard_refuses_a_range_that_leaves_its_region(loop: EventLoop,
                                                        memory: GuestMemory) -> None:
    dev = balloon.VirtioBalloon(loop)
    with pytest.raises(Exception, match="crosses the end"):
        dev._discard(memory, MEM - PAGE_SIZE, 2 * PAGE_SIZE)
    with pytest.raises(Exception, match="not in guest RAM"):
        dev._discard(memory, MEM + PAGE_SIZE, PAGE_SIZE)


def test_state_survives_the_state_file_and_old_files_have_no_balloon(env: Env,
                                                                     tmp_path: Path) -> None:
    env.transport.write(mmio.CONFIG_SPACE + 4, (3).to_bytes(4, "little"))
    state = make_state()
    add_device(state, BALLOON, env.dev.save(), env.transport.save())
    path = tmp_path / "state.bin"
    stateformat.write_state_file(path, state)
    back = stateformat.read_state_file(path, MachineState)
    assert back == state
    saved = back.device(BALLOON)
    assert saved is not None and saved.actual == 3 and saved.acked_features == FEATURES
    # A format-1 file written before the balloon existed.
    (tmp_path / "old.bin").write_bytes(format_1_file(make_state()))
    assert stateformat.read_state_file(tmp_path / "old.bin", MachineState).device(BALLOON) \
        is None


def test_a_restored_device_serves_a_report_left_on_its_ring(loop: EventLoop,
                                                           memory: GuestMemory) -> None:
    """A report the guest posted just before the snapshot is served after restore."""
    env = Env(loop, memory)
    try:
        q = env.queues[balloon.REPORTING_QUEUE]
        memory.write(FREE_AT, b"\x66" * PAGE_SIZE)
        index = q.free.pop(0)
        memory.write(q.desc + 16 * index, struct.pack("<QIHH", FREE_AT, PAGE_SIZE,
                                                      VIRTQ_DESC_F_WRITE, 0))
        q.chains[index] = [(index, PAGE_SIZE, True)]
        memory.write_u16(q.avail + 4 + 2 * (q.avail_idx % q.size), index)
        q.avail_idx += 1
        memory.write_u16(q.avail + 2, q.avail_idx)     # posted, not notified
        saved_transport, saved_dev = env.transport.save(), env.dev.save()
        irq = IrqLine(gsi=10)
        try:
            dev = balloon.VirtioBalloon(loop)
            transport = mmio.MmioTransport(dev, memory, irq, loop)
            dev.restore(saved_dev)
            transport.restore(saved_transport)
            wait_until(lambda: q.used_idx() == 1, what="the report served after restore")
            assert memory.read(FREE_AT, PAGE_SIZE) == _expected(memory, FREE_AT // PAGE_SIZE)
            assert dev.stats().reports == 1
        finally:
            irq.close()
    finally:
        env.close()

