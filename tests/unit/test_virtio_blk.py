"""virtio-blk, read-only: a simulated guest driver on one side, a real disk image
file on the other, the device's native transport (``_core.NativeDevice``, as every
machine serves it) in a window of the MMIO bus's map in between. Requests are laid
out the way the Linux driver lays them out (header, data, status in their own
descriptors) and, for the hostile cases, every other way the spec allows or forbids.

Every test that serves requests runs both ways a kick reaches the one request path
(``native/src/blk.rs``): the queue's ioeventfd, served on the native loop without the
GIL (a machine's disk), and a QueueNotify write, served on the writing thread (an
empty volume slot has no ioeventfd); ``test_virtio_blk_native.py`` drives hostile
chains through it."""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_restore_prepared import add_device, format_1_file, make_state
from test_virtio_harness import (  # noqa: F401
    MEM_SIZE,
    DriverQueue,
    GuestDriver,
    Window,
    loop,
    wait_until,
)

from vmfork import _core
from vmfork.image import disk_path
from vmfork.ondisk import stateformat
from vmfork.vmm import vmstate
from vmfork.vmm.devices.manager import BLK, DeviceState
from vmfork.vmm.devices.plan import boot_plan, device_plan, plan_state
from vmfork.vmm.devices.virtio import blk, mmio
from vmfork.vmm.devices.virtio.device import (
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
)
from vmfork.vmm.devices.virtio.queue import VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE
from vmfork.vmm.errors import HostError
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop
from vmfork.vmm.machine import MachineConfig, OpenedDisk
from vmfork.vmm.memory import GuestMemory

DISK_SECTORS = 2048 + 7                  # 1 MiB + 7 sectors: not a round number
DISK_BYTES = DISK_SECTORS * blk.SECTOR_SIZE
BIG_BYTES = 16 << 20
KEY = hashlib.sha256(b"a test disk").hexdigest()
ACKED = VIRTIO_F_VERSION_1 | blk.F_RO | blk.F_SEG_MAX | blk.F_SIZE_MAX
ACKED_RW = VIRTIO_F_VERSION_1 | blk.F_FLUSH | blk.F_SEG_MAX | blk.F_SIZE_MAX
QSIZE = 16
BUF = 128 * 1024
CANARY = 0xA5
# Raw chains (built descriptor by descriptor) use their own scratch area, above
# the harness's rings and buffers.
SCRATCH = 16 << 20


def header(kind: int, sector: int = 0) -> bytes:
    return struct.pack("<IIQ", kind, 0, sector)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("disk") / "root.img"
    path.write_bytes(os.urandom(DISK_BYTES))
    return path


@pytest.fixture
def disk_fd(disk: Path) -> Iterator[int]:
    fd, size = blk.open_disk(str(disk))
    assert size == DISK_BYTES
    yield fd
    os.close(fd)


@pytest.fixture
def memory() -> Iterator[GuestMemory]:
    mem = GuestMemory.anonymous(MEM_SIZE)
    yield mem
    mem.close()


@pytest.fixture(params=["ioeventfd", "notify"])
def kick(request: pytest.FixtureRequest) -> str:
    """How the driver's kick reaches the device: the queue's ioeventfd (served on the
    native loop without the GIL), or a QueueNotify write (served on the writing
    thread)."""
    return str(request.param)


def native_disk(io_loop: EventLoop, memory: GuestMemory, plan: object, fd: int | None,
                kick: str) -> tuple[_core.NativeDevice, int, list[int]]:
    """A native disk from ``plan`` on ``fd``: the device, its irqfd, its ioeventfds."""
    assert isinstance(io_loop, NativeEventLoop) and memory.native is not None
    irq = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    kicks = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)] if kick == "ioeventfd" else []
    device = _core.NativeDevice.restore(plan, memory.native,  # type: ignore[arg-type]
                                        io_loop.native_loop, irq, [*kicks] or [None],
                                        disk_file=fd)
    return device, irq, kicks


class BlkEnv:
    """One native device on the shared disk, driven by a ``GuestDriver``."""

    def __init__(self, loop: EventLoop, memory: GuestMemory, fd: int,  # noqa: F811
                 key: str = KEY, start: bool = True, size: int = DISK_BYTES,
                 read_only: bool = True, kick: str = "ioeventfd") -> None:
        self.loop, self.memory, self.fd = loop, memory, fd
        self.acked = ACKED if read_only else ACKED_RW
        record = blk.BlkState(acked_features=0, disk_key=key, capacity_bytes=size,
                              read_only=read_only)
        self.dev, self.irq, self.kicks = native_disk(loop, memory, boot_plan("blk", disk=record),
                                                     fd, kick)
        self.window = Window.of(self.dev)
        self.raw_ids: dict[int, list[int]] = {}
        self.driver = GuestDriver(self.window, memory)  # type: ignore[arg-type]
        self.q: DriverQueue
        if start:
            self.start()

    def start(self, size: int = QSIZE, buf: int = BUF) -> None:
        status = self.driver.negotiate(self.acked)
        assert status & STATUS_FEATURES_OK, f"FEATURES_OK refused ({status:#x})"
        self.q = self.driver.setup_queue(0, size, buf)
        # Fresh rings: a hypothesis example reuses the memory (and ring addresses) of
        # the one before, whose used index would otherwise look like an answer.
        self.memory.write(self.q.desc, bytes(self.q.end - self.q.desc))
        self.raw_ids = {}
        self.driver.driver_ok()
        assert self.dev.active

    def notify(self) -> None:
        """The driver's kick: the ioeventfd KVM would write, or a QueueNotify write."""
        if self.kicks:
            os.eventfd_write(self.kicks[0], 1)
        else:
            self.driver.notify(0)

    @property
    def needs_reset(self) -> bool:
        return bool(self.driver.status & STATUS_DEVICE_NEEDS_RESET)

    @property
    def last_fault(self) -> str:
        return self.dev.record()[3] or ""

    @property
    def counters(self) -> SimpleNamespace:
        """The requests served so far, by every activation."""
        return SimpleNamespace(**dict(self.dev.blk_counters()))

    def request(self, readable: list[bytes], writable: list[int]) -> tuple[int, bytes, int]:
        """Post one chain (Linux's layout: one descriptor per part), notify, wait;
        return (used length, data written before the status byte, status)."""
        before = self.q.used_idx()
        head = self.q.post(readable, writable)
        last_index, last_len, _ = self.q.chains[head][-1]
        status_at = self.q.buf_addr(last_index) + last_len - 1
        self.notify()
        wait_until(lambda: self.q.used_idx() != before or self.needs_reset, what="the request")
        assert not self.needs_reset, self.last_fault
        [(_, written, data)] = self.q.take_used()
        return written, data[:max(0, written - 1)], self.memory.read(status_at, 1)[0]

    def read(self, sector: int, lengths: list[int]) -> tuple[int, bytes, int]:
        return self.request([header(blk.T_IN, sector)], [*lengths, 1])

    def post_raw(self, parts: list[tuple[int, int, bool]]) -> int:
        """A chain of (guest address, length, device-writable) descriptors."""
        q = self.q
        ids = [q.free.pop(0) for _ in parts]
        for k, (index, (addr, length, wr)) in enumerate(zip(ids, parts)):
            last = k == len(ids) - 1
            flags = (0 if last else VIRTQ_DESC_F_NEXT) | (VIRTQ_DESC_F_WRITE if wr else 0)
            self.memory.write(q.desc + 16 * index, struct.pack(
                "<QIHH", addr, length, flags, 0 if last else ids[k + 1]))
        self.raw_ids[ids[0]] = ids
        self.memory.write_u16(q.avail + 4 + 2 * (q.avail_idx % q.size), ids[0])
        q.avail_idx = (q.avail_idx + 1) & 0xFFFF
        self.memory.write_u16(q.avail + 2, q.avail_idx)
        return ids[0]

    def take_raw(self) -> list[tuple[int, int]]:
        """Used (head, length) pairs of raw chains; their descriptors become free."""
        q, out = self.q, []
        while q.last_used != q.used_idx():
            elem = q.used + 4 + 8 * (q.last_used % q.size)
            head, written = struct.unpack("<II", self.memory.read(elem, 8))
            q.last_used = (q.last_used + 1) & 0xFFFF
            q.free.extend(self.raw_ids.pop(head))
            out.append((head, written))
        return out

    def close(self) -> None:
        self.dev.close()
        for fd in (self.irq, *self.kicks):
            os.close(fd)


@pytest.fixture
def big(loop: EventLoop, memory: GuestMemory, kick: str,  # noqa: F811
        tmp_path: Path) -> Iterator[BlkEnv]:
    """A 16 MiB disk (sparse: it reads as zeros), for the size bounds."""
    path = tmp_path / "big.img"
    with open(path, "wb") as f:
        f.truncate(BIG_BYTES)
    fd, size = blk.open_disk(str(path))
    e = BlkEnv(loop, memory, fd, size=size, kick=kick)
    yield e
    e.close()
    os.close(fd)
    assert not loop.errors


@pytest.fixture
def env(loop: EventLoop, memory: GuestMemory, kick: str,  # noqa: F811
        disk_fd: int) -> Iterator[BlkEnv]:
    e = BlkEnv(loop, memory, disk_fd, kick=kick)
    yield e
    e.close()
    assert not loop.errors


def file_bytes(disk: Path, offset: int, length: int) -> bytes:
    with open(disk, "rb") as f:
        f.seek(offset)
        return f.read(length)


# -- what the device offers ---------------------------------------------------------------
def test_features_and_config_space(env: BlkEnv) -> None:
    t = env.window
    assert env.driver.r(mmio.REG_DEVICE_ID) == blk.DEVICE_ID_BLK == 2
    offered = 0
    for sel in (0, 1):
        env.driver.w(mmio.REG_DEVICE_FEATURES_SEL, sel)
        offered |= env.driver.r(mmio.REG_DEVICE_FEATURES) << (32 * sel)
    assert offered == ACKED, "read-only, VERSION_1, SEG_MAX and SIZE_MAX; no FLUSH, no writes"
    assert t.read(0x100, 8) == struct.pack("<Q", DISK_SECTORS)
    assert t.read(0x108, 4) == struct.pack("<I", blk.SIZE_MAX)
    assert t.read(0x10C, 4) == struct.pack("<I", blk.SEG_MAX)
    assert t.read(0x114, 4) == b"\0\0\0\0", "blk_size is not offered"
    assert blk.SEG_MAX * blk.SIZE_MAX == blk.MAX_BYTES_PER_REQUEST
    assert blk.SEG_MAX + 2 <= blk.QUEUE_SIZE, "a largest request fits the ring"


# -- reads ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sector, lengths", [
    (0, [512]),
    (1, [4096]),
    (3, [512, 1024, 4096]),                       # several data segments
    (100, [BUF]),
    (DISK_SECTORS - 8, [4096]),                   # up to the very last sector
    (DISK_SECTORS - 1, [512]),
    (17, [0]),                                    # no data: nothing to read, OK
])
def test_reads_match_the_file(env: BlkEnv, disk: Path, sector: int, lengths: list[int]) -> None:
    written, data, status = env.read(sector, lengths)
    total = sum(lengths)
    assert status == blk.S_OK
    assert written == total + 1
    assert data == file_bytes(disk, sector * 512, total)
    assert env.counters.bytes_read == total


def test_header_split_and_status_sharing_a_data_descriptor(env: BlkEnv, disk: Path) -> None:
    """The spec forbids assuming a descriptor layout (2.6.4): a header in two pieces,
    data and status in one descriptor, must work."""
    a, b, buf = SCRATCH, SCRATCH + 0x1000, SCRATCH + 0x2000
    hdr = header(blk.T_IN, 9)
    env.memory.write(a, hdr[:5])
    env.memory.write(b, hdr[5:])
    env.post_raw([(a, 5, False), (b, 11, False), (buf, 1024 + 1, True)])
    env.notify()
    wait_until(lambda: env.q.used_idx() == 1, what="the request")
    assert [w for _, w in env.take_raw()] == [1025]
    assert env.memory.read(buf, 1024) == file_bytes(disk, 9 * 512, 1024)
    assert env.memory.read(buf + 1024, 1)[0] == blk.S_OK


@pytest.mark.parametrize("sector, length", [
    (DISK_SECTORS, 512),            # just past the end
    (DISK_SECTORS - 1, 1024),       # starts inside, ends outside
    (2**64 - 1, 512),               # an offset no 64-bit multiply would survive
    (2**55, 512),                   # sector * 512 wraps a u64 to a small number
])
def test_read_past_capacity_is_ioerr_and_writes_nothing(env: BlkEnv, sector: int,
                                                        length: int) -> None:
    slot = env.q.buf_addr(env.q.free[1])   # the data descriptor's buffer
    env.memory.write(slot, bytes([CANARY]) * length)
    written, _, status = env.read(sector, [length])
    assert status == blk.S_IOERR
    assert written == 1, "only the status byte"
    assert env.memory.read(slot, length) == bytes([CANARY]) * length
    assert env.counters.read_errors == 1 and env.counters.bytes_read == 0


@pytest.mark.parametrize("lengths", [[511], [512, 1], [100, 100]])
def test_reads_of_partial_sectors_are_ioerr(env: BlkEnv, lengths: list[int]) -> None:
    _, _, status = env.read(0, lengths)
    assert status == blk.S_IOERR


# -- everything but reads --------------------------------------------------------------------
@pytest.mark.parametrize("kind", [blk.T_OUT, blk.T_DISCARD, blk.T_WRITE_ZEROES,
                                  blk.T_SECURE_ERASE])
def test_writes_are_refused_and_the_disk_is_unchanged(env: BlkEnv, disk: Path,
                                                      kind: int) -> None:
    before = hashlib.sha256(disk.read_bytes()).hexdigest()
    payload = b"\xff" * 512 if kind == blk.T_OUT else struct.pack("<QII", 0, 8, 0)
    written, _, status = env.request([header(kind, 0), payload], [1])
    assert (written, status) == (1, blk.S_IOERR)
    assert env.counters.writes_refused == 1
    assert hashlib.sha256(disk.read_bytes()).hexdigest() == before


def test_the_fd_cannot_write_anyway(disk_fd: int) -> None:
    with pytest.raises(OSError):
        os.pwrite(disk_fd, b"x", 0)


@pytest.mark.parametrize("room, expected", [
    (20, KEY[:20].encode()),
    (8, KEY[:8].encode()),
    (64, KEY[:20].encode()),                 # never more than 20 bytes
])
def test_get_id_is_the_start_of_the_disk_key(env: BlkEnv, room: int, expected: bytes) -> None:
    written, data, status = env.request([header(blk.T_GET_ID)], [room, 1])
    assert status == blk.S_OK
    assert written == len(expected) + 1 and data == expected


def test_get_id_of_a_short_key_is_nul_padded(loop: EventLoop, memory: GuestMemory,  # noqa: F811
                                             kick: str, disk_fd: int) -> None:
    e = BlkEnv(loop, memory, disk_fd, key="0123abcd", kick=kick)
    try:
        e.q.post([header(blk.T_GET_ID)], [20, 1])
        e.notify()
        wait_until(lambda: e.q.used_idx() == 1, what="GET_ID")
        [(_, written, data)] = e.q.take_used()
        assert written == 21 and data[:20] == b"0123abcd" + bytes(12)
    finally:
        e.close()


def test_flush_is_ok_and_unknown_types_unsupported(env: BlkEnv) -> None:
    assert env.request([header(blk.T_FLUSH)], [1])[2] == blk.S_OK
    for kind in (blk.T_GET_LIFETIME, 2, 99, 2**32 - 1):
        written, _, status = env.request([header(kind)], [16, 1])
        assert (written, status) == (1, blk.S_UNSUPP)
    c = env.counters
    assert (c.flushes, c.unsupported, c.requests) == (1, 4, 5)


# -- malformed and hostile chains -------------------------------------------------------------
def test_short_header_is_ioerr_and_the_device_serves_on(env: BlkEnv, disk: Path) -> None:
    written, _, status = env.request([header(blk.T_IN, 0)[:15]], [512, 1])
    assert (written, status) == (1, blk.S_IOERR)
    assert env.counters.malformed == 1
    assert env.read(0, [512])[1] == file_bytes(disk, 0, 512)


def test_readable_data_in_a_read_is_ioerr(env: BlkEnv) -> None:
    written, _, status = env.request([header(blk.T_IN, 0), b"\0" * 512], [512, 1])
    assert (written, status) == (1, blk.S_IOERR)
    assert env.counters.malformed == 1 and env.counters.bytes_read == 0


def test_no_writable_status_byte_needs_reset_then_reset_recovers(env: BlkEnv,
                                                                 disk: Path) -> None:
    env.q.post([header(blk.T_IN, 0), b"\0" * 512])
    env.notify()
    wait_until(lambda: env.needs_reset, what="DEVICE_NEEDS_RESET")
    assert "status" in env.last_fault
    # A zero-length writable descriptor holds no status byte either.
    env.start()
    env.q.post([header(blk.T_FLUSH)], [0])
    env.notify()
    wait_until(lambda: env.needs_reset, what="DEVICE_NEEDS_RESET")
    env.start()
    assert env.read(5, [512])[1] == file_bytes(disk, 5 * 512, 512)


def test_a_request_larger_than_the_bound_is_ioerr_without_a_read(big: BlkEnv) -> None:
    hdr, data = SCRATCH, SCRATCH + 0x1000
    big.memory.write(hdr, header(blk.T_IN, 0))
    # 12 MiB of real guest RAM in three descriptors, inside the 16 MiB disk: only
    # MAX_BYTES_PER_REQUEST refuses it.
    seg = 4 << 20
    big.memory.write(data, bytes([CANARY]) * 16)
    big.post_raw([(hdr, 16, False), (data, seg, True), (data + seg, seg, True),
                  (data + 2 * seg, seg + 1, True)])
    big.notify()
    wait_until(lambda: big.q.used_idx() == 1, what="the request")
    assert [w for _, w in big.take_raw()] == [1]
    assert big.memory.read(data + 3 * seg, 1)[0] == blk.S_IOERR
    assert big.memory.read(data, 16) == bytes([CANARY]) * 16
    assert big.counters.read_errors == 1 and big.counters.bytes_read == 0


def test_buffers_outside_ram_need_reset(env: BlkEnv) -> None:
    env.memory.write(SCRATCH, header(blk.T_IN, 0))
    env.post_raw([(SCRATCH, 16, False), (MEM_SIZE - 512, 0xFFFF_FFFF, True)])
    env.notify()
    wait_until(lambda: env.needs_reset, what="DEVICE_NEEDS_RESET")
    assert "outside guest RAM" in env.last_fault


def test_a_chain_as_long_as_the_queue_is_served(env: BlkEnv, disk: Path) -> None:
    env.memory.write(SCRATCH, header(blk.T_IN, 2))
    parts = [(SCRATCH, 16, False)] + [(SCRATCH + 0x1000 * (i + 1), 512, True)
                                      for i in range(QSIZE - 2)]
    status_at = SCRATCH + 0x1000 * QSIZE
    env.post_raw([*parts, (status_at, 1, True)])
    env.notify()
    wait_until(lambda: env.q.used_idx() == 1, what="the request")
    assert [w for _, w in env.take_raw()] == [512 * (QSIZE - 2) + 1]
    got = b"".join(env.memory.read(a, 512) for a, _, _ in parts[1:])
    assert got == file_bytes(disk, 2 * 512, 512 * (QSIZE - 2))
    assert env.memory.read(status_at, 1)[0] == blk.S_OK


def test_a_descriptor_loop_needs_reset(env: BlkEnv) -> None:
    head = env.q.post([header(blk.T_IN, 0)], [512, 1])
    # The status descriptor links back to the data descriptor: a writable cycle.
    (_, _, _), (data, _, _), (last, _, _) = env.q.chains[head]
    env.memory.write_u16(env.q.desc + 16 * last + 12, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE)
    env.memory.write_u16(env.q.desc + 16 * last + 14, data)
    env.notify()
    wait_until(lambda: env.needs_reset, what="DEVICE_NEEDS_RESET")
    assert "loop" in env.last_fault


def test_a_kick_serves_more_than_a_budget_over_later_wakes(
        loop: EventLoop, memory: GuestMemory, kick: str, disk_fd: int) -> None:  # noqa: F811
    """A wake serves at most ``MAX_REQUESTS_PER_NOTIFY`` requests (the bound itself is
    ``test_virtio_blk_native.py``'s, per call); one kick still serves every request
    posted before it: the loop's server re-arms its ioeventfd, a QueueNotify write is
    served in as many rounds as the ring can hold."""
    e = BlkEnv(loop, memory, disk_fd, start=False, kick=kick)
    try:
        e.start(size=256, buf=4096)
        for _ in range(100):
            e.q.post([header(blk.T_FLUSH)], [1])
        e.notify()
        wait_until(lambda: e.q.used_idx() == 100, what="every request, over later wakes")
        assert all(w == 1 for _, w, _ in e.q.take_used())
        assert e.counters.flushes == 100 > blk.MAX_REQUESTS_PER_NOTIFY
    finally:
        e.close()


def test_a_kick_serves_more_than_a_wakes_bytes(big: BlkEnv) -> None:
    size = blk.MAX_BYTES_PER_REQUEST
    hdr, data = SCRATCH, SCRATCH + 0x1000
    big.memory.write(hdr, header(blk.T_IN, 0))
    for _ in range(5):   # all five share one guest buffer; the device does not care
        big.post_raw([(hdr, 16, False), (data, size, True), (data + size, 1, True)])
    # Four 8 MiB reads reach MAX_BYTES_PER_NOTIFY; the fifth is a later wake's.
    assert blk.MAX_BYTES_PER_NOTIFY // size == 4
    big.notify()
    wait_until(lambda: big.q.used_idx() == 5, what="the fifth request")
    assert [w for _, w in big.take_raw()] == [size + 1] * 5


# -- property: random descriptor layouts ------------------------------------------------------
# Buffers are placed in a 64 KiB area of RAM; lengths and places near its edges and
# past the end of RAM are common.
AREA = SCRATCH
AREA_SIZE = 0x10000
place = st.one_of(st.integers(0, AREA_SIZE - 1), st.sampled_from([0, 0x1000, AREA_SIZE - 1]))
length = st.one_of(st.sampled_from([0, 1, 15, 16, 17, 511, 512, 513, 1024, 4096]),
                   st.integers(0, 0x2000))
descriptor = st.one_of(
    st.tuples(place, length, st.booleans()),                       # inside guest RAM
    st.tuples(st.sampled_from([MEM_SIZE - 512, MEM_SIZE - 1, MEM_SIZE, 1 << 40]),
              st.sampled_from([1, 512, 0xFFFF_FFFF]), st.booleans()))   # at or past its end
# Linux's layout (a 16-byte header, whole sectors, a one-byte status) at random
# places; the same shape with lengths often off by one; and arbitrary chains.
in_area = st.integers(0, AREA_SIZE - 1)
one_header = st.tuples(in_area, st.just(16), st.just(False)).map(lambda d: [d])
status_byte = st.tuples(in_area, st.just(1), st.just(True)).map(lambda d: [d])
sector_data = st.lists(st.tuples(in_area, st.sampled_from([512, 1024, 4096]), st.just(True)),
                       max_size=5)
linux_layout = st.tuples(one_header, sector_data, status_byte).map(lambda p: p[0] + p[1] + p[2])
plausible_layout = st.tuples(
    st.lists(st.tuples(in_area, st.sampled_from([16, 8, 15, 17, 0, 1, 528]), st.just(False)),
             max_size=3),
    st.lists(st.tuples(in_area, st.sampled_from([512, 1024, 4096, 1, 513, 0, 20, 511, 0x2000]),
                       st.just(True)), max_size=6),
).map(lambda rw: rw[0] + rw[1]).filter(bool)
layouts = st.one_of(linux_layout, linux_layout, plausible_layout,
                    st.lists(descriptor, min_size=1, max_size=QSIZE))
kinds = st.sampled_from([blk.T_IN] * 8 + [blk.T_OUT, blk.T_FLUSH, blk.T_GET_ID,
                         blk.T_DISCARD, blk.T_WRITE_ZEROES, blk.T_GET_LIFETIME, 99,
                         2**32 - 1])
sectors = st.one_of(st.integers(0, DISK_SECTORS - 64), st.integers(0, DISK_SECTORS + 2),
                    st.sampled_from([DISK_SECTORS - 1, 2**32, 2**55, 2**64 - 1]))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(layout=layouts, kind=kinds, sector=sectors)
def test_random_descriptor_layouts_never_break_the_vmm(
        loop: EventLoop, memory: GuestMemory, kick: str,  # noqa: F811
        disk: Path, disk_fd: int, layout: list[tuple[int, int, bool]], kind: int,
        sector: int) -> None:
    memory.write(AREA, bytes([CANARY]) * (2 * AREA_SIZE))
    # Readable descriptors first (the queue refuses other orders, which is fine: a
    # guest error), the header written across the readable bytes in order.
    parts = [(AREA + off if off < AREA_SIZE else off, n, wr) for off, n, wr in layout]
    hdr = header(kind, sector)
    done = 0
    for addr, n, wr in parts:
        if wr or done >= len(hdr) or addr + n > MEM_SIZE:
            continue
        take = min(n, len(hdr) - done)
        memory.write(addr, hdr[done:done + take])
        done += take
    snapshot_outside = memory.read(AREA, 2 * AREA_SIZE)
    e = BlkEnv(loop, memory, disk_fd, kick=kick)
    try:
        e.post_raw(parts)
        e.notify()
        wait_until(lambda: e.q.used_idx() == 1 or e.needs_reset, what="an answer")
        assert not loop.errors
        if e.needs_reset:
            event("device needs reset")
            return
        [(_, written)] = e.take_raw()
        writable = [(a, n) for a, n, wr in parts if wr and n]
        assert 1 <= written <= sum(n for _, n in writable)
        status_addr = writable[-1][0] + writable[-1][1] - 1
        status = memory.read(status_addr, 1)[0]
        assert status in (blk.S_OK, blk.S_IOERR, blk.S_UNSUPP)
        event(f"status {status}" + (" (a read with data)" if kind == blk.T_IN and status == 0
                                    and written > 1 else ""))
        # Readable descriptors may overlap, so what the device read as the request's
        # type is what the readable bytes say after all of them were written.
        seen = b"".join(memory.read(a, n) for a, n, wr in parts
                        if not wr and a + n <= MEM_SIZE)
        if len(seen) >= 16 and int.from_bytes(seen[:4], "little") in blk.WRITE_TYPES:
            assert status == blk.S_IOERR
        # Nothing is ever written outside the chain's writable buffers.
        after = memory.read(AREA, 2 * AREA_SIZE)
        inside = bytearray(2 * AREA_SIZE)
        for a, n in writable:
            lo, hi = max(a, AREA), min(a + n, AREA + 2 * AREA_SIZE)
            inside[lo - AREA:hi - AREA] = b"\1" * max(0, hi - lo)
        assert all(after[i] == snapshot_outside[i] for i in range(len(after)) if not inside[i])
        if status == blk.S_OK and kind == blk.T_IN and written > 1:
            got = bytearray()
            for a, n in writable:
                got += memory.read(a, n)
            # Overlapping buffers may hold the later segment's bytes; only a layout
            # without overlaps can be compared byte for byte.
            spans = sorted(writable)
            if all(x[0] + x[1] <= y[0] for x, y in itertools.pairwise(spans)):
                assert bytes(got[:written - 1]) == file_bytes(disk, sector * 512, written - 1)
        # And the device still serves a well-formed read.
        e.memory.write(AREA + 2 * AREA_SIZE, header(blk.T_IN, 1))
        e.post_raw([(AREA + 2 * AREA_SIZE, 16, False), (AREA + 2 * AREA_SIZE + 16, 513, True)])
        e.notify()
        wait_until(lambda: e.q.used_idx() == 2, what="a good request after a bad one")
        assert e.memory.read(AREA + 2 * AREA_SIZE + 16, 512) == file_bytes(disk, 512, 512)
    finally:
        e.close()


# -- the disk file ------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 511, 513, 4096 + 100])
def test_disks_that_are_not_whole_sectors_are_refused(tmp_path: Path, size: int) -> None:
    path = tmp_path / "odd.img"
    path.write_bytes(b"x" * size)
    with pytest.raises(HostError, match=f"{path} is {size} bytes.*multiple of 512"):
        blk.open_disk(str(path))


def test_a_missing_disk_names_its_path(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="nope.img: open"):
        blk.open_disk(str(tmp_path / "nope.img"))


@pytest.mark.parametrize("key", ["", "ABCDEF0123", "abc", "g" * 16, "a" * 65, "../etc/passwd"])
def test_disk_keys_are_lowercase_hex(key: str) -> None:
    with pytest.raises(ValueError, match="content key"):
        blk.validate_disk_key(key)


def test_disk_path_is_under_the_cache(tmp_path: Path) -> None:
    assert disk_path(KEY, tmp_path) == tmp_path / "disks" / KEY / "root.img"
    with pytest.raises(ValueError):
        disk_path("../x", tmp_path)


# -- snapshots ------------------------------------------------------------------------------------
def test_state_round_trip_restores_a_working_device(env: BlkEnv, loop: EventLoop,  # noqa: F811
                                                    kick: str, disk: Path) -> None:
    env.read(0, [512])
    saved = plan_state(env.dev.plan(), 0, 5)
    state = stateformat.decode_state(stateformat.encode_state(saved), DeviceState)
    assert state == saved and state.transport is not None
    assert state.state == blk.BlkState(acked_features=ACKED, disk_key=KEY,
                                       capacity_bytes=DISK_BYTES)
    # The parent goes; a clone (as in a forked child) on its own fd of the same file
    # picks up the queue where the parent left it.
    env.dev.close()
    fd, size = blk.open_disk(str(disk))
    clone, irq, kicks = native_disk(loop, env.memory, device_plan(state), fd, kick)
    os.close(fd)   # the device holds its own duplicate
    try:
        assert clone.active and clone.acked_features == ACKED
        env.q.post([header(blk.T_IN, 33)], [1024, 1])
        if kicks:
            os.eventfd_write(kicks[0], 1)
        else:
            GuestDriver(Window.of(clone), env.memory).notify(0)  # type: ignore[arg-type]
        wait_until(lambda: env.q.used_idx() == 2, what="a read served by the clone")
        [(_, written, data)] = env.q.take_used()
        assert written == 1025 and data[:1024] == file_bytes(disk, 33 * 512, 1024)
        assert dict(clone.blk_counters())["reads"] == 1
    finally:
        clone.close()
        for fd in (irq, *kicks):
            os.close(fd)


def test_restore_onto_another_disk_is_refused(loop: EventLoop, memory: GuestMemory,  # noqa: F811
                                              disk_fd: int) -> None:
    """A machine restores a disk only onto the snapshot's: its key, size and mode
    (``OpenedDisk.check_restores``); the native device checks the size again on the
    file it is given."""
    recorded = blk.BlkState(acked_features=ACKED, disk_key=KEY, capacity_bytes=DISK_BYTES)
    saved = DeviceState("blk", 1, 0, 5, recorded, mmio.MmioTransportState(
        device_type=blk.DEVICE_ID_BLK, status=0, device_features_sel=0,
        driver_features_sel=0, driver_features=0, driver_features_bad=False, queue_sel=0,
        interrupt_status=0, config_generation=0))
    given = replace(recorded, acked_features=0)
    OpenedDisk(given, "", "root.img", disk_fd).check_restores(saved, "vm")
    other_key = OpenedDisk(replace(given, disk_key="ab" * 32), "", "other.img", disk_fd)
    with pytest.raises(HostError, match=f"snapshot's disk is {KEY}.*{'ab' * 32}"):
        other_key.check_restores(saved, "vm")
    smaller = OpenedDisk(replace(given, capacity_bytes=DISK_BYTES - 512), "", "small.img",
                         disk_fd)
    with pytest.raises(HostError, match=f"{DISK_BYTES} bytes.*small.img has {DISK_BYTES - 512}"):
        smaller.check_restores(saved, "vm")
    writable = OpenedDisk(replace(given, read_only=False), "", "rw.img", disk_fd)
    with pytest.raises(HostError, match="was read-only, and rw.img is not given read-only"):
        writable.check_restores(saved, "vm")
    larger = boot_plan("blk", disk=replace(given, capacity_bytes=DISK_BYTES + 512))
    with pytest.raises(ValueError, match=f"had {DISK_BYTES + 512} bytes, but its file has "
                                         f"{DISK_BYTES}"):
        native_disk(loop, memory, larger, disk_fd, "notify")


def _with_root_disk(state: vmstate.MachineState) -> vmstate.MachineState:
    transport = mmio.MmioTransportState(
        device_type=blk.DEVICE_ID_BLK, status=0xF, device_features_sel=0,
        driver_features_sel=1, driver_features=ACKED, driver_features_bad=False, queue_sel=0,
        interrupt_status=0, config_generation=0)
    add_device(state, BLK, blk.BlkState(ACKED, KEY, DISK_BYTES), transport)
    return state


def test_machine_state_with_a_root_disk_round_trips() -> None:
    state = _with_root_disk(make_state())
    again = stateformat.decode_state(stateformat.encode_state(state), vmstate.MachineState)
    root = again.device(BLK)
    assert again == state and root is not None and root.disk_key == KEY


def test_machine_state_written_before_root_disks_decodes() -> None:
    """A format-1 state.bin from before the field existed has no "blk" key at all."""
    state = stateformat.decode_state(format_1_file(make_state()), vmstate.MachineState)
    assert state.device(BLK) is None and state == make_state()


# -- machine configuration -------------------------------------------------------------------
def test_machine_config_root_disk_rules(disk: Path) -> None:
    boot = MachineConfig(kernel="/vmlinux", root_disk=str(disk), root_disk_key=KEY)
    boot.validate()
    with pytest.raises(ValueError, match="go together"):
        MachineConfig(kernel="/vmlinux", root_disk_key=KEY).validate()
    with pytest.raises(ValueError, match="go together"):
        MachineConfig(kernel="/vmlinux", root_disk=str(disk)).validate()
    with pytest.raises(ValueError, match="content key"):
        MachineConfig(kernel="/vmlinux", root_disk=str(disk), root_disk_key="XYZ").validate()
    with_disk = _with_root_disk(make_state())
    restore = MachineConfig(restore_state=with_disk, memory_file="/m", mem_mib=64)
    with pytest.raises(ValueError, match=f"root disk {KEY}: give root_disk"):
        restore.validate()
    replace(restore, root_disk=str(disk), root_disk_key=KEY).validate()
    with pytest.raises(ValueError, match="no root disk"):
        MachineConfig(restore_state=make_state(), memory_file="/m", mem_mib=64,
                      root_disk=str(disk), root_disk_key=KEY).validate()


# -- read-write volumes -----------------------------------------------------------------------
@pytest.fixture
def rw_disk(tmp_path: Path) -> Path:
    path = tmp_path / "volume.img"
    path.write_bytes(os.urandom(DISK_BYTES))
    return path


@pytest.fixture
def rw(loop: EventLoop, memory: GuestMemory, kick: str,  # noqa: F811
       rw_disk: Path) -> Iterator[BlkEnv]:
    fd, size = blk.open_disk(str(rw_disk), writable=True)
    e = BlkEnv(loop, memory, fd, size=size, read_only=False, kick=kick)
    yield e
    e.close()
    os.close(fd)
    assert not loop.errors


def test_a_rw_disk_offers_flush_and_not_ro(rw: BlkEnv) -> None:
    offered = 0
    for sel in (0, 1):
        rw.driver.w(mmio.REG_DEVICE_FEATURES_SEL, sel)
        offered |= rw.driver.r(mmio.REG_DEVICE_FEATURES) << (32 * sel)
    assert offered == ACKED_RW


@pytest.mark.parametrize("sector, parts", [
    (0, [512]), (5, [4096, 512]), (DISK_SECTORS - 1, [512]), (9, [512] * 8)])
def test_writes_land_in_the_file_and_read_back(rw: BlkEnv, rw_disk: Path, sector: int,
                                               parts: list[int]) -> None:
    payloads = [os.urandom(n) for n in parts]
    # The header and the first data part share a descriptor, as a driver may send them.
    readable = [header(blk.T_OUT, sector) + payloads[0], *payloads[1:]]
    written, _, status = rw.request(readable, [1])
    assert (written, status) == (1, blk.S_OK)
    data = b"".join(payloads)
    assert file_bytes(rw_disk, sector * 512, len(data)) == data
    _, back, status = rw.read(sector, [len(data)])
    assert status == blk.S_OK and back == data
    assert rw.counters.writes == 1 and rw.counters.bytes_written == len(data)


@pytest.mark.parametrize("sector, length", [
    (DISK_SECTORS, 512),              # past the end
    (DISK_SECTORS - 1, 1024),         # reaches past the end
    (0, 100),                         # not a whole sector
    (2**63, 512),                     # absurd sector
])
def test_bad_writes_are_ioerr_and_change_nothing(rw: BlkEnv, rw_disk: Path, sector: int,
                                                 length: int) -> None:
    before = hashlib.sha256(rw_disk.read_bytes()).hexdigest()
    written, _, status = rw.request([header(blk.T_OUT, sector), b"\xee" * length], [1])
    assert (written, status) == (1, blk.S_IOERR)
    assert rw.counters.write_errors == 1
    assert hashlib.sha256(rw_disk.read_bytes()).hexdigest() == before


def test_a_write_with_writable_data_is_malformed(rw: BlkEnv, rw_disk: Path) -> None:
    before = rw_disk.read_bytes()
    _, _, status = rw.request([header(blk.T_OUT, 0), b"\x11" * 512], [512, 1])
    assert status == blk.S_IOERR and rw.counters.malformed == 1
    assert rw_disk.read_bytes() == before


def test_flush_syncs_a_rw_disk_and_other_writes_stay_refused(rw: BlkEnv) -> None:
    assert rw.request([header(blk.T_FLUSH)], [1])[2] == blk.S_OK
    assert rw.counters.flushes == 1
    for kind in (blk.T_DISCARD, blk.T_WRITE_ZEROES, blk.T_SECURE_ERASE):
        assert rw.request([header(kind), struct.pack("<QII", 0, 8, 0)], [1])[2] == blk.S_IOERR


def test_a_read_only_device_refuses_writes_even_on_a_writable_fd(
        loop: EventLoop, memory: GuestMemory, kick: str, rw_disk: Path) -> None:  # noqa: F811
    fd, size = blk.open_disk(str(rw_disk), writable=True)
    e = BlkEnv(loop, memory, fd, size=size, kick=kick)
    try:
        before = rw_disk.read_bytes()
        assert e.request([header(blk.T_OUT, 0), b"\x22" * 512], [1])[2] == blk.S_IOERR
        assert rw_disk.read_bytes() == before
    finally:
        e.close()
        os.close(fd)


def test_rw_state_round_trips(rw: BlkEnv) -> None:
    saved = plan_state(rw.dev.plan(), 0, 5)
    again = stateformat.decode_state(stateformat.encode_state(saved), DeviceState)
    assert again == saved and isinstance(saved.state, blk.BlkState)
    assert saved.state.read_only is False and saved.state.acked_features == ACKED_RW
