"""virtio-balloon with free page reporting (devices/virtio/balloon.py), served by its
native transport (``_core.NativeDevice``, as every machine serves it) in a window of
the MMIO bus's map, against real guest memory of each kind and the real pagemap
(vmm.dirty)."""

from __future__ import annotations

import gc
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from test_restore_prepared import add_device, format_1_file, make_state
from test_virtio_harness import (
    DriverQueue,
    GuestDriver,
    native_device,
    spin_holding_the_gil,
    wait_until,
)

from vmfork import _core
from vmfork.ondisk import stateformat
from vmfork.vmm import dirty
from vmfork.vmm.devices.manager import BALLOON, DeviceState
from vmfork.vmm.devices.plan import balloon_advice, boot_plan, device_plan, plan_state
from vmfork.vmm.devices.virtio import balloon, mmio
from vmfork.vmm.devices.virtio.device import (
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
    run_on_loop,
)
from vmfork.vmm.devices.virtio.queue import VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE
from vmfork.vmm.eventloop import NativeEventLoop, new_event_loop
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory
from vmfork.vmm.vmstate import MachineState

MEM = 32 << 20
FEATURES = VIRTIO_F_VERSION_1 | balloon.VIRTIO_BALLOON_F_REPORTING
# Guest pages the tests "free"; the driver's rings and buffers sit below 8 MiB.
FREE_AT = 16 << 20

# How the server is kicked: by QueueNotify writes, served on the writing thread; on
# the queues' ioeventfds, on the loop (as in a VMM).
PATHS = ["native", "native-ioeventfd"]


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
def loop(memory: GuestMemory) -> Iterator[NativeEventLoop]:
    ev = new_event_loop("test-balloon-io")
    assert isinstance(ev, NativeEventLoop)
    ev.start()
    # The loop thread takes the GIL once, to make its thread state: before a test spins
    # holding it (test_native_balloon_serving_needs_no_gil).
    run_on_loop(ev, lambda: None)
    yield ev
    ev.stop()
    assert not ev.errors, f"exceptions escaped device callbacks: {ev.errors!r}"


class Stats(NamedTuple):
    reports: int
    bytes_discarded: int
    discard_errors: int
    ignored_buffers: int
    last_report_age_s: float | None


def stats_of(device: _core.NativeDevice) -> Stats:
    reports, discarded, errors, ignored, _, age = device.balloon_stats()
    return Stats(reports, discarded, errors, ignored, age)


def held(device: _core.NativeDevice) -> int:
    return device.balloon_stats()[4]


class Env:
    def __init__(self, loop: NativeEventLoop, memory: GuestMemory, path: str = "native"
                 ) -> None:
        self.memory = memory
        self.irq = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.kick_fds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                         for _ in range(3)] if path == "native-ioeventfd" else []
        plan = boot_plan("balloon", balloon_advice(memory))
        self.dev, self.window = native_device(loop, memory, plan, self.irq,
                                              [*self.kick_fds] or [None] * 3)
        self.driver = GuestDriver(self.window, memory)
        status = self.driver.negotiate(FEATURES)
        assert status & STATUS_FEATURES_OK, f"FEATURES_OK refused ({status:#x})"
        self.queues = [self.driver.setup_queue(i, balloon.QUEUE_SIZE, 64) for i in range(3)]
        self.driver.driver_ok()
        assert self.dev.active

    @property
    def registers(self) -> _core.MmioRegisters:
        return self.dev.registers

    def notify(self, queue: int) -> None:
        """The driver's kick: the ioeventfd KVM would write, or a QueueNotify write."""
        if self.kick_fds:
            os.eventfd_write(self.kick_fds[queue], 1)
        else:
            self.driver.notify(queue)

    def post(self, ranges: list[tuple[int, int]], queue: int = balloon.REPORTING_QUEUE,
             writable: bool = True) -> None:
        """Put one chain naming ``ranges`` on ``queue`` (as Linux's driver does:
        device-writable buffers, one per free block), without a kick."""
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

    def report(self, ranges: list[tuple[int, int]], queue: int = balloon.REPORTING_QUEUE,
               writable: bool = True) -> int:
        """Post one chain naming ``ranges``, kick, and wait for it to come back."""
        q: DriverQueue = self.queues[queue]
        before = q.used_idx()
        self.post(ranges, queue, writable)
        self.notify(queue)
        wait_until(lambda: q.used_idx() != before
                   or self.registers.status & STATUS_DEVICE_NEEDS_RESET,
                   what="the report back")
        used = q.take_used()
        return len(used)

    def close(self) -> None:
        self.dev.close()
        for fd in (self.irq, *self.kick_fds):
            os.close(fd)


@pytest.fixture(params=PATHS)
def env(request: pytest.FixtureRequest, loop: NativeEventLoop, memory: GuestMemory
        ) -> Iterator[Env]:
    e = Env(loop, memory, request.param)
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
    assert env.window.read(mmio.CONFIG_SPACE, 4) == bytes(4)     # num_pages: 0
    env.window.write(mmio.CONFIG_SPACE + 4, (7).to_bytes(4, "little"))   # actual
    assert env.window.read(mmio.CONFIG_SPACE + 4, 4) == (7).to_bytes(4, "little")
    env.window.write(mmio.CONFIG_SPACE, (99).to_bytes(4, "little"))      # read-only
    assert env.window.read(mmio.CONFIG_SPACE, 4) == bytes(4)


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
    stats = stats_of(env.dev)
    assert stats.reports == 1 and stats.bytes_discarded == 64 * PAGE_SIZE
    assert stats.last_report_age_s is not None and stats.discard_errors == 0
    assert env.window.read(mmio.REG_INTERRUPT_STATUS, 4)[0] & mmio.INT_USED_BUFFER


def test_reports_during_a_capture_are_acknowledged_and_kept(env: Env) -> None:
    """A capture in flight (vmm/capture.py holds discards from the pause until its
    writer is done) must see the page tables as they were at the pause."""
    mem = env.memory
    mem.write(FREE_AT, b"\xcd" * PAGE_SIZE)
    env.dev.hold()
    env.dev.hold()     # two captures: both must end before a page goes
    assert env.report([(FREE_AT, PAGE_SIZE)]) == 1
    env.dev.release()
    assert env.report([(FREE_AT, PAGE_SIZE)]) == 1
    assert mem.read(FREE_AT, PAGE_SIZE) == b"\xcd" * PAGE_SIZE
    assert stats_of(env.dev).bytes_discarded == 0 and held(env.dev) == 2
    env.dev.release()
    assert env.report([(FREE_AT, PAGE_SIZE)]) == 1
    assert mem.read(FREE_AT, PAGE_SIZE) == _expected(mem, FREE_AT // PAGE_SIZE)
    assert stats_of(env.dev).bytes_discarded == PAGE_SIZE


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
    assert stats_of(env.dev).bytes_discarded == 2 * PAGE_SIZE


def test_a_range_outside_guest_ram_resets_the_device_and_drops_nothing(env: Env) -> None:
    mem = env.memory
    mem.write(MEM - PAGE_SIZE, b"\x77" * PAGE_SIZE)
    env.report([(MEM - PAGE_SIZE, 2 * PAGE_SIZE)])
    assert env.registers.status & STATUS_DEVICE_NEEDS_RESET
    assert mem.read(MEM - PAGE_SIZE, PAGE_SIZE) == b"\x77" * PAGE_SIZE
    assert stats_of(env.dev).bytes_discarded == 0


def test_inflate_buffers_and_readable_reports_are_returned_untouched(env: Env) -> None:
    mem = env.memory
    mem.write(FREE_AT, b"\x55" * PAGE_SIZE)
    assert env.report([(FREE_AT, PAGE_SIZE)], queue=balloon.INFLATE_QUEUE) == 1
    assert env.report([(FREE_AT, PAGE_SIZE)], queue=balloon.DEFLATE_QUEUE) == 1
    assert env.report([(FREE_AT, PAGE_SIZE)], writable=False) == 1
    assert mem.read(FREE_AT, PAGE_SIZE) == b"\x55" * PAGE_SIZE
    assert stats_of(env.dev).bytes_discarded == 0
    assert stats_of(env.dev).ignored_buffers == 3


@pytest.mark.parametrize("gpa, length", [
    (MEM - PAGE_SIZE, 2 * PAGE_SIZE),            # crosses the end of RAM
    (MEM + PAGE_SIZE, PAGE_SIZE),                # past it
    ((1 << 64) - PAGE_SIZE, 2 * PAGE_SIZE),      # wraps past 2**64
])
def test_a_hostile_report_is_a_guest_fault_with_the_same_words(
        env: Env, gpa: int, length: int) -> None:
    """The server refuses each range with these words (the chain walk checks
    each buffer against guest RAM before the balloon sees it), drops nothing of the
    chain, and keeps the guest's memory as it was."""
    env.memory.write(MEM - PAGE_SIZE, b"\x42" * PAGE_SIZE)
    env.memory.write(FREE_AT, b"\x43" * PAGE_SIZE)
    env.report([(FREE_AT, PAGE_SIZE), (gpa, length)])
    assert env.registers.status & STATUS_DEVICE_NEEDS_RESET
    assert env.registers.last_device_error == (
        f"descriptor 1 buffer {gpa:#x}+{length:#x} is outside guest RAM")
    assert env.memory.read(MEM - PAGE_SIZE, PAGE_SIZE) == b"\x42" * PAGE_SIZE
    assert env.memory.read(FREE_AT, PAGE_SIZE) == b"\x43" * PAGE_SIZE
    assert stats_of(env.dev).bytes_discarded == 0


def test_more_reports_than_one_turn_serves_are_all_served_after_one_kick(env: Env) -> None:
    """One kick for more chains than a turn's budget (16): the rest are served on later
    turns (the native server re-arms its ioeventfd, or tells the Python caller)."""
    mem = env.memory
    count = 3 * balloon.MAX_CHAINS_PER_NOTIFY + 5
    for k in range(count):
        mem.write(FREE_AT + k * PAGE_SIZE, b"\x99" * PAGE_SIZE)
        env.post([(FREE_AT + k * PAGE_SIZE, PAGE_SIZE)])
    q = env.queues[balloon.REPORTING_QUEUE]
    env.notify(balloon.REPORTING_QUEUE)
    wait_until(lambda: q.used_idx() == count, what="every report after one kick")
    stats = stats_of(env.dev)
    assert stats.reports == count and stats.bytes_discarded == count * PAGE_SIZE
    for k in range(count):
        page = FREE_AT // PAGE_SIZE + k
        assert mem.read(page * PAGE_SIZE, PAGE_SIZE) == _expected(mem, page)
    # A BRANCH's save sees the indices the native server advanced.
    state = plan_state(env.dev.plan(), 0, 5).transport
    assert state is not None
    assert (state.queues[balloon.REPORTING_QUEUE].next_avail,
            state.queues[balloon.REPORTING_QUEUE].next_used) == (count, count)


def test_a_reset_keeps_the_counts_and_the_next_activation_serves(env: Env) -> None:
    env.report([(FREE_AT, PAGE_SIZE)])
    env.dev.hold()
    env.report([(FREE_AT, PAGE_SIZE)])
    env.driver.w(mmio.REG_STATUS, 0)          # the driver resets the device
    assert not env.dev.active
    assert stats_of(env.dev).reports == 2 and held(env.dev) == 1
    status = env.driver.negotiate(FEATURES)
    assert status & STATUS_FEATURES_OK
    env.queues = [env.driver.setup_queue(i, balloon.QUEUE_SIZE, 64) for i in range(3)]
    env.driver.driver_ok()
    assert env.dev.active
    env.memory.write(FREE_AT, b"\x31" * PAGE_SIZE)
    env.report([(FREE_AT, PAGE_SIZE)])   # still held: the hold outlived the reset
    assert env.memory.read(FREE_AT, PAGE_SIZE) == b"\x31" * PAGE_SIZE
    env.dev.release()
    env.report([(FREE_AT, PAGE_SIZE)])
    assert env.memory.read(FREE_AT, PAGE_SIZE) == _expected(env.memory, FREE_AT // PAGE_SIZE)
    assert stats_of(env.dev).reports == 4 and held(env.dev) == 2


def test_native_balloon_serving_needs_no_gil(loop: NativeEventLoop, memory: GuestMemory
                                            ) -> None:
    """The main thread keeps the GIL (a long switch interval, spinning in Python) while
    the guest reports: the native server still drops the pages and gives the chain back."""
    env = Env(loop, memory, "native-ioeventfd")
    try:
        memory.write(FREE_AT, b"\x24" * PAGE_SIZE)
        q = env.queues[balloon.REPORTING_QUEUE]
        env.post([(FREE_AT, PAGE_SIZE)])
        served_in = spin_holding_the_gil(lambda: env.notify(balloon.REPORTING_QUEUE),
                                         lambda: q.used_idx() == 1)
        assert q.used_idx() == 1 and served_in < 5, served_in
        assert memory.read(FREE_AT, PAGE_SIZE) == _expected(memory, FREE_AT // PAGE_SIZE)
    finally:
        env.close()


def test_a_closed_balloon_holds_no_fds(loop: NativeEventLoop) -> None:
    """The device's close: no duplicated eventfd of the transport or its server is left
    open, even with the device still referenced."""
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))
    for path in PATHS:
        fresh = GuestMemory.anonymous(MEM)   # a ring of its own (no used index left over)
        gc.collect()   # earlier tests' devices, whose fds would close during this one
        before = fds()
        env = Env(loop, fresh, path)
        env.report([(FREE_AT, PAGE_SIZE)])
        env.close()
        assert not env.dev.active
        assert fds() == before, path
        fresh.close()


def test_state_survives_the_state_file_and_old_files_have_no_balloon(env: Env,
                                                                     tmp_path: Path) -> None:
    env.window.write(mmio.CONFIG_SPACE + 4, (3).to_bytes(4, "little"))
    state = make_state()
    saved = plan_state(env.dev.plan(), 0, 5)
    assert saved.transport is not None
    add_device(state, BALLOON, saved.state, saved.transport)
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


@pytest.mark.parametrize("path", PATHS)
def test_a_restored_device_serves_a_report_left_on_its_ring(loop: NativeEventLoop,
                                                           memory: GuestMemory,
                                                           path: str) -> None:
    """A report the guest posted just before the snapshot is served after restore."""
    env = Env(loop, memory, path)
    try:
        q = env.queues[balloon.REPORTING_QUEUE]
        # The device's record is taken and the device closed before the report is
        # posted: a device still running could serve it (a look its activation's kick
        # asked for, late under load), and the restored one would find nothing to do.
        saved = stateformat.decode_state(stateformat.encode_state(
            plan_state(env.dev.plan(), 0, 5)), DeviceState)
        env.dev.close()
        memory.write(FREE_AT, b"\x66" * PAGE_SIZE)
        index = q.free.pop(0)
        memory.write(q.desc + 16 * index, struct.pack("<QIHH", FREE_AT, PAGE_SIZE,
                                                      VIRTQ_DESC_F_WRITE, 0))
        q.chains[index] = [(index, PAGE_SIZE, True)]
        memory.write_u16(q.avail + 4 + 2 * (q.avail_idx % q.size), index)
        q.avail_idx += 1
        memory.write_u16(q.avail + 2, q.avail_idx)     # posted, not notified
        irq = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        kicks = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(3)] \
            if path == "native-ioeventfd" else []
        try:
            dev, _ = native_device(loop, memory, device_plan(saved, balloon_advice(memory)),
                                   irq, [*kicks] or [None] * 3)
            wait_until(lambda: q.used_idx() == 1, what="the report served after restore")
            assert memory.read(FREE_AT, PAGE_SIZE) == _expected(memory, FREE_AT // PAGE_SIZE)
            # The wake counts its report after it wrote the used entry: wait for the count.
            wait_until(lambda: stats_of(dev).reports == 1, what="the report counted")
            dev.close()
        finally:
            for fd in (irq, *kicks):
                os.close(fd)
    finally:
        env.close()

