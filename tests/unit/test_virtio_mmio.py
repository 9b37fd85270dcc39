"""The virtio-mmio v2 transport, driven register by register as a guest would,
with virtio-rng as the device behind it (real EventLoop thread, real eventfds, the
native register file); every test that builds its transport from the fixture runs
with rng served both ways: by its native server on the loop, and per notification."""

from __future__ import annotations

import gc
import os
import struct
from collections.abc import Iterator

import pytest
from test_virtio_harness import (  # noqa: F401
    DriverQueue,
    GuestDriver,
    loop,
    memory,
    spin_holding_the_gil,
    wait_until,
)

from vmfork.vmm.devices.virtio import mmio
from vmfork.vmm.devices.virtio.device import (
    DEVICE_ID_RNG,
    STATUS_ACKNOWLEDGE,
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_DRIVER,
    STATUS_DRIVER_OK,
    STATUS_FAILED,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
    run_on_loop,
)
from vmfork.vmm.devices.virtio.queue import VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE
from vmfork.vmm.devices.virtio.rng import VirtioRng
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.irq import IrqLine
from vmfork.vmm.memory import GuestMemory

ACK_DRIVER = STATUS_ACKNOWLEDGE | STATUS_DRIVER


@pytest.fixture
def irq() -> Iterator[IrqLine]:
    line = IrqLine(gsi=5)
    yield line
    line.close()


# Whether rng is served natively on the loop without the GIL (else per notification).
RNG_PATHS = [False, True]


def _path_id(serve: bool) -> str:
    return "native-serve" if serve else "per-notification"


@pytest.fixture(params=RNG_PATHS, ids=_path_id)
def rng_transport(request: pytest.FixtureRequest, loop: EventLoop,  # noqa: F811
                  memory: GuestMemory, irq: IrqLine) -> mmio.MmioTransport:  # noqa: F811
    return mmio.MmioTransport(VirtioRng(loop, native_serve=request.param), memory, irq,
                              loop)


@pytest.fixture
def driver(rng_transport: mmio.MmioTransport, memory: GuestMemory) -> GuestDriver:  # noqa: F811
    return GuestDriver(rng_transport, memory)


def needs_reset(d: GuestDriver) -> bool:
    return bool(d.status & STATUS_DEVICE_NEEDS_RESET)


def test_identification_registers(driver: GuestDriver) -> None:
    assert driver.r(mmio.REG_MAGIC) == 0x74726976
    assert driver.r(mmio.REG_VERSION) == 2
    assert driver.r(mmio.REG_DEVICE_ID) == DEVICE_ID_RNG
    assert driver.r(mmio.REG_VENDOR_ID) == mmio.VENDOR_ID
    driver.w(mmio.REG_DEVICE_FEATURES_SEL, 1)
    assert driver.r(mmio.REG_DEVICE_FEATURES) == 1  # bit 32: VERSION_1
    driver.w(mmio.REG_DEVICE_FEATURES_SEL, 0)
    assert driver.r(mmio.REG_DEVICE_FEATURES) == 0
    driver.w(mmio.REG_DEVICE_FEATURES_SEL, 7)
    assert driver.r(mmio.REG_DEVICE_FEATURES) == 0


def test_features_ok_needs_version_1(driver: GuestDriver) -> None:
    assert driver.negotiate(VIRTIO_F_VERSION_1) & STATUS_FEATURES_OK
    assert driver.t.device.acked_features == VIRTIO_F_VERSION_1
    assert not driver.negotiate(0) & STATUS_FEATURES_OK


def test_features_ok_refused_for_bits_never_offered(driver: GuestDriver) -> None:
    assert not driver.negotiate(VIRTIO_F_VERSION_1 | 1 << 28) & STATUS_FEATURES_OK  # INDIRECT
    assert not driver.negotiate(VIRTIO_F_VERSION_1 | 1 << 29) & STATUS_FEATURES_OK  # EVENT_IDX
    # A third feature word holds no offered bits.
    driver.w(mmio.REG_STATUS, 0)
    driver.w(mmio.REG_STATUS, STATUS_ACKNOWLEDGE)
    driver.w(mmio.REG_STATUS, ACK_DRIVER)
    driver.w(mmio.REG_DRIVER_FEATURES_SEL, 1)
    driver.w(mmio.REG_DRIVER_FEATURES, 1)
    driver.w(mmio.REG_DRIVER_FEATURES_SEL, 2)
    driver.w(mmio.REG_DRIVER_FEATURES, 1)
    driver.w(mmio.REG_STATUS, ACK_DRIVER | STATUS_FEATURES_OK)
    assert not driver.status & STATUS_FEATURES_OK


def test_status_must_advance_in_order_and_never_clear(driver: GuestDriver) -> None:
    driver.w(mmio.REG_STATUS, STATUS_DRIVER)  # skips ACKNOWLEDGE
    assert driver.status == 0
    driver.w(mmio.REG_STATUS, STATUS_ACKNOWLEDGE)
    driver.w(mmio.REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER_OK)  # skips two steps
    assert driver.status == STATUS_ACKNOWLEDGE
    driver.w(mmio.REG_STATUS, ACK_DRIVER)
    driver.w(mmio.REG_STATUS, STATUS_DRIVER)  # clears ACKNOWLEDGE
    assert driver.status == ACK_DRIVER
    driver.w(mmio.REG_STATUS, ACK_DRIVER | STATUS_DEVICE_NEEDS_RESET)  # the device's bit
    assert driver.status == ACK_DRIVER
    driver.w(mmio.REG_STATUS, ACK_DRIVER | STATUS_FAILED)
    assert driver.status == ACK_DRIVER | STATUS_FAILED
    assert driver.t.ignored_writes >= 3


def test_driver_features_ignored_outside_negotiation(driver: GuestDriver) -> None:
    driver.w(mmio.REG_DRIVER_FEATURES_SEL, 1)
    driver.w(mmio.REG_DRIVER_FEATURES, 1)  # before DRIVER
    assert driver.t.driver_features == 0
    driver.start([(16, 4096)])
    driver.w(mmio.REG_DRIVER_FEATURES, 0)  # after FEATURES_OK
    assert driver.t.driver_features == VIRTIO_F_VERSION_1


def test_misaligned_and_odd_size_register_accesses(driver: GuestDriver) -> None:
    t = driver.t
    assert t.read(mmio.REG_MAGIC, 2) == b"\0\0"
    assert t.read(mmio.REG_MAGIC + 1, 4) == b"\0\0\0\0"
    t.write(mmio.REG_STATUS, b"\x01")
    t.write(mmio.REG_STATUS + 2, b"\x01\0\0\0")
    assert driver.status == 0 and t.bad_accesses == 4
    assert driver.r(0x0F0) == 0  # unknown register reads zero
    driver.w(mmio.REG_MAGIC, 5)  # read-only register
    assert driver.r(mmio.REG_MAGIC) == 0x74726976


def test_queue_registers(driver: GuestDriver) -> None:
    driver.negotiate()
    driver.w(mmio.REG_QUEUE_SEL, 1)  # rng has one queue
    assert driver.r(mmio.REG_QUEUE_NUM_MAX) == 0 and driver.r(mmio.REG_QUEUE_READY) == 0
    driver.w(mmio.REG_QUEUE_READY, 1)
    assert driver.r(mmio.REG_QUEUE_READY) == 0
    driver.w(mmio.REG_QUEUE_SEL, 0)
    assert driver.r(mmio.REG_QUEUE_NUM_MAX) == 256
    driver.w(mmio.REG_QUEUE_DESC_LOW, 0x1234_5000)
    driver.w(mmio.REG_QUEUE_DESC_HIGH, 0x1)
    driver.w(mmio.REG_QUEUE_READY, 1)
    driver.w(mmio.REG_QUEUE_DESC_LOW, 0x9999_0000)  # ignored while ready
    q = driver.t.queues[0]
    assert q.ready and q.desc_table == 0x1_1234_5000
    driver.w(mmio.REG_QUEUE_READY, 7)  # not 0 or 1: ignored
    assert driver.r(mmio.REG_QUEUE_READY) == 1


@pytest.mark.parametrize("num", [0, 3, 100, 512])
def test_bad_queue_size_needs_reset(driver: GuestDriver, irq: IrqLine, num: int) -> None:
    driver.negotiate()
    driver.w(mmio.REG_QUEUE_SEL, 0)
    driver.w(mmio.REG_QUEUE_NUM, num)
    assert needs_reset(driver)
    assert driver.r(mmio.REG_INTERRUPT_STATUS) & mmio.INT_CONFIG_CHANGE and irq.count == 1
    assert driver.t.last_device_error is not None and str(num) in driver.t.last_device_error
    driver.start([(16, 4096)])  # a reset (inside start) recovers
    assert not needs_reset(driver) and driver.status & STATUS_DRIVER_OK


def test_queue_writes_after_driver_ok_are_ignored(driver: GuestDriver) -> None:
    driver.start([(16, 4096)])
    driver.w(mmio.REG_QUEUE_SEL, 0)
    driver.w(mmio.REG_QUEUE_READY, 0)
    driver.w(mmio.REG_QUEUE_NUM, 3)
    assert driver.t.queues[0].ready and driver.t.queues[0].size == 16
    assert not needs_reset(driver)


def test_rng_fills_buffers_and_interrupts(driver: GuestDriver, irq: IrqLine) -> None:
    (q,) = driver.start([(16, 4096)])
    head = q.post(writable=[100, 200])
    driver.notify(0)
    wait_until(lambda: q.used_idx() == 1, what="the rng request")
    [(used_head, written, data)] = q.take_used()
    assert (used_head, written, len(data)) == (head, 300, 300)
    assert len(set(data)) > 10  # random, not zeros
    # On the native-serve path the server writes the eventfd itself, and IrqLine.count
    # adds its count in: both the eventfd and the count show the interrupt.
    wait_until(lambda: irq.count >= 1, what="the used-buffer interrupt")
    assert os.eventfd_read(irq.fd) >= 1
    assert driver.ack_interrupts() == mmio.INT_USED_BUFFER
    assert driver.r(mmio.REG_INTERRUPT_STATUS) == 0


def test_rng_caps_each_request(driver: GuestDriver) -> None:
    (q,) = driver.start([(4, 1 << 20)])
    q.post(writable=[1 << 20])
    q.post(readable=[b"nothing to fill"])
    driver.notify(0)
    wait_until(lambda: q.used_idx() == 2, what="the rng requests")
    assert [w for _, w, _ in q.take_used()] == [64 * 1024, 0]


def test_rng_budget_without_ioeventfd_serves_every_request(driver: GuestDriver) -> None:
    """One QueueNotify exit for more requests than one turn's budget (64): the rest is
    served on later loop turns on every path, the native server's too, which has no
    ioeventfd here to re-arm itself with (it used to leave them for a kick that a
    driver which has already kicked never sends)."""
    (q,) = driver.start([(256, 64)])
    for _ in range(200):
        q.post(writable=[32])
    driver.notify(0)
    wait_until(lambda: q.used_idx() == 200, what="every request after one notify")
    assert all(w == 32 for _, w, _ in q.take_used())


def test_notify_before_driver_ok_or_for_missing_queue_is_ignored(driver: GuestDriver) -> None:
    driver.negotiate()
    q = driver.setup_queue(0, 16, 4096)
    q.post(writable=[16])
    driver.notify(0)
    driver.notify(5)
    run_on_loop(driver.t.loop, lambda: None)  # anything queued has run
    assert q.used_idx() == 0 and driver.t.ignored_writes == 2


def test_rings_outside_ram_need_reset_at_driver_ok(driver: GuestDriver) -> None:
    driver.negotiate()
    driver.w(mmio.REG_QUEUE_SEL, 0)
    driver.w(mmio.REG_QUEUE_NUM, 16)
    driver.w(mmio.REG_QUEUE_DESC_HIGH, 0x10)  # 64 GiB: not RAM
    driver.w(mmio.REG_QUEUE_READY, 1)
    driver.driver_ok()
    wait_until(lambda: needs_reset(driver), what="DEVICE_NEEDS_RESET")
    assert "descriptor table" in (driver.t.last_device_error or "")
    assert not driver.t.device.active


def test_broken_chain_needs_reset_then_reset_recovers(driver: GuestDriver, irq: IrqLine,
                                                      memory: GuestMemory) -> None:  # noqa: F811
    (q,) = driver.start([(16, 4096)])
    head = q.post(writable=[16, 16])
    # Make the chain loop back on itself.
    memory.write_u16(q.desc + 16 * q.chains[head][1][0] + 12,
                     VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE)
    memory.write_u16(q.desc + 16 * q.chains[head][1][0] + 14, head)
    driver.notify(0)
    wait_until(lambda: needs_reset(driver), what="DEVICE_NEEDS_RESET")
    assert "loop" in (driver.t.last_device_error or "")
    assert driver.r(mmio.REG_INTERRUPT_STATUS) & mmio.INT_CONFIG_CHANGE
    # Further notifications are ignored; the device is left alone.
    driver.notify(0)
    assert driver.t.device_errors == 1
    (q,) = driver.start([(16, 4096)])
    assert not needs_reset(driver) and driver.r(mmio.REG_INTERRUPT_STATUS) == 0
    q.post(writable=[8])
    driver.notify(0)
    wait_until(lambda: q.used_idx() == 1, what="the rng request after reset")


def test_reset_clears_registers_and_queues(driver: GuestDriver) -> None:
    driver.start([(16, 4096)])
    driver.w(mmio.REG_STATUS, 0)
    assert driver.status == 0 and driver.r(mmio.REG_QUEUE_READY) == 0
    assert driver.t.queues[0].desc_table == 0 and not driver.t.device.active


@pytest.mark.parametrize("serve", RNG_PATHS, ids=_path_id)
def test_ioeventfd_notifications(loop: EventLoop, memory: GuestMemory,  # noqa: F811
                                 irq: IrqLine, serve: bool) -> None:
    registered: list[tuple[int, int, int]] = []
    t = mmio.MmioTransport(VirtioRng(loop, native_serve=serve), memory, irq, loop,
                           register_ioeventfd=lambda off, dm, fd: registered.append((off, dm, fd)))
    try:
        assert [(off, dm) for off, dm, _ in registered] == [(0x50, 0)]
        d = GuestDriver(t, memory)
        (q,) = d.start([(16, 4096)])
        q.post(writable=[32])
        os.eventfd_write(registered[0][2], 1)  # what KVM does on the guest's write to 0x50
        wait_until(lambda: q.used_idx() == 1, what="the rng request via ioeventfd")
    finally:
        t.close()
        run_on_loop(loop, lambda: None)


def test_config_space_forwarding(driver: GuestDriver) -> None:
    assert driver.t.read(0x100, 4) == b"\0\0\0\0"  # rng has no config: zeros
    assert driver.t.read(0x100, 3) == b"\0\0\0"  # odd size: zeros, counted
    assert driver.t.bad_accesses == 1
    driver.t.write(0x100, b"\1\2\3\4")  # dropped, no crash


def test_transport_state_round_trip_continues_the_queue(loop: EventLoop,  # noqa: F811
                                                        memory: GuestMemory,  # noqa: F811
                                                        irq: IrqLine, driver: GuestDriver) -> None:
    (q,) = driver.start([(16, 4096)])
    q.post(writable=[8])
    driver.notify(0)
    wait_until(lambda: q.used_idx() == 1, what="the first request")
    q.take_used()
    state = run_on_loop(loop, driver.t.save)
    assert state.queues[0].next_avail == 1 and state.status & STATUS_DRIVER_OK
    # A new device and transport (as in a spawned child) pick up where the parent was.
    parent = driver.t.device
    assert isinstance(parent, VirtioRng)
    rng = VirtioRng(loop, native_serve=parent.native_serve)
    rng.restore(parent.save())
    child = mmio.MmioTransport(rng, memory, irq, loop)
    child.restore(mmio.MmioTransportState(**vars(state)))
    assert run_on_loop(loop, child.save) == state
    wait_until(lambda: rng.active, what="re-activation after restore")
    q.post(writable=[8])
    child.write(mmio.REG_QUEUE_NOTIFY, struct.pack("<I", 0))
    wait_until(lambda: q.used_idx() == 2, what="a request served by the restored device")
    with pytest.raises(ValueError, match="device type"):
        mmio.MmioTransport(VirtioRng(loop), memory, irq, loop).restore(
            mmio.MmioTransportState(**{**vars(state), "device_type": 19}))


# -- rng on the loop's ioeventfd: by its native server (no GIL) or per notification, one contract
class _IoeventfdRng:
    """A transport with ioeventfds (the eventfd is written as KVM would on QueueNotify)."""

    def __init__(self, loop: EventLoop, memory: GuestMemory, irq: IrqLine,  # noqa: F811
                 serve: bool) -> None:
        fds: list[int] = []
        self.t = mmio.MmioTransport(VirtioRng(loop, native_serve=serve), memory, irq, loop,
                                    register_ioeventfd=lambda off, dm, fd: fds.append(fd))
        self.kick_fd = fds[0]
        self.serve = serve
        self.driver = GuestDriver(self.t, memory)

    def start(self, size: int, buf: int) -> DriverQueue:
        (q,) = self.driver.start([(size, buf)])
        rng = self.t.device
        assert isinstance(rng, VirtioRng)
        wait_until(lambda: rng.active, what="activation")
        assert rng.serving_natively == self.serve
        return q

    def kick(self) -> None:
        os.eventfd_write(self.kick_fd, 1)

    def close(self) -> None:
        self.t.close()
        run_on_loop(self.t.loop, lambda: None)


@pytest.fixture(params=RNG_PATHS, ids=_path_id)
def kicked(request: pytest.FixtureRequest, loop: EventLoop, memory: GuestMemory,  # noqa: F811
           irq: IrqLine) -> Iterator[_IoeventfdRng]:
    env = _IoeventfdRng(loop, memory, irq, request.param)
    yield env
    env.close()


def test_rng_budget_rearms_until_every_request_is_served(kicked: _IoeventfdRng) -> None:
    q = kicked.start(256, 64)
    for _ in range(200):   # more than MAX_REQUESTS_PER_NOTIFY (64): one kick, four turns
        q.post(writable=[64])
    kicked.kick()
    wait_until(lambda: q.used_idx() == 200, what="every request after one kick")
    assert all(w == 64 for _, w, _ in q.take_used())
    state = run_on_loop(kicked.t.loop, kicked.t.save)   # a BRANCH sees the indices
    assert (state.queues[0].next_avail, state.queues[0].next_used) == (200, 200)
    assert kicked.t.device.bytes_served == 200 * 64  # type: ignore[attr-defined]


@pytest.mark.parametrize("addr, length, message", [
    (1 << 40, 16, "outside guest RAM"),                 # far beyond RAM
    ((48 << 20) - 8, 16, "outside guest RAM"),           # crosses the end of RAM
    (0x1000, 0xFFFF_FFFF, "outside guest RAM"),          # a 4 GiB buffer
])
def test_rng_hostile_descriptor_needs_reset(kicked: _IoeventfdRng, memory: GuestMemory,  # noqa: F811
                                            addr: int, length: int, message: str) -> None:
    q = kicked.start(16, 4096)
    head = q.post(writable=[16])
    desc = q.desc + 16 * q.chains[head][0][0]
    memory.write_u64(desc, addr)
    memory.write_u32(desc + 8, length)
    kicked.kick()
    wait_until(lambda: kicked.t.status & STATUS_DEVICE_NEEDS_RESET, what="DEVICE_NEEDS_RESET")
    assert message in (kicked.t.last_device_error or "")
    assert kicked.t.device_errors == 1 and q.used_idx() == 0
    kicked.kick()   # a failed device serves no more
    run_on_loop(kicked.t.loop, lambda: None)
    assert kicked.t.device_errors == 1 and q.used_idx() == 0


def test_rng_descriptor_loop_on_the_ioeventfd_path(kicked: _IoeventfdRng,
                                                   memory: GuestMemory) -> None:  # noqa: F811
    q = kicked.start(16, 4096)
    head = q.post(writable=[16])
    desc = q.desc + 16 * q.chains[head][0][0]
    memory.write_u16(desc + 12, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE)
    memory.write_u16(desc + 14, head)
    kicked.kick()
    wait_until(lambda: kicked.t.status & STATUS_DEVICE_NEEDS_RESET, what="DEVICE_NEEDS_RESET")
    assert "loop" in (kicked.t.last_device_error or "")
    # The driver resets and starts again: served again (the native server re-made).
    (q,) = kicked.driver.start([(16, 4096)])
    q.post(writable=[8])
    kicked.kick()
    wait_until(lambda: q.used_idx() == 1, what="the request after reset")


def test_native_rng_serving_needs_no_gil(loop: EventLoop, memory: GuestMemory,  # noqa: F811
                                         irq: IrqLine) -> None:
    """The main thread keeps the GIL (a long switch interval, spinning in Python) while
    the guest kicks: the native server still fills the request and raises the irqfd."""
    env = _IoeventfdRng(loop, memory, irq, serve=True)
    try:
        q = env.start(16, 64)
        q.post(writable=[64])
        served_in = spin_holding_the_gil(env.kick, lambda: q.used_idx() == 1)
        assert q.used_idx() == 1 and served_in < 5, served_in
        assert os.eventfd_read(irq.fd) >= 1
    finally:
        env.close()


def test_rng_closed_after_its_transport_holds_no_fds(loop: EventLoop,  # noqa: F811
                                                    memory: GuestMemory,  # noqa: F811
                                                    irq: IrqLine) -> None:
    """A machine's close runs the transport's close, then the device's: after both, no
    eventfd of the device is open, even with the device itself still referenced (the
    native server duplicates the irqfd and the ioeventfd, and holds the device through
    its fault callback: a cycle only the device's close breaks at once)."""
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))
    # Earlier tests' cyclic garbage (devices never closed) holds eventfds too: collected
    # now, not by a collection that happens to run between the two counts below.
    gc.collect()
    for serve in RNG_PATHS:
        before = fds()
        env = _IoeventfdRng(loop, memory, irq, serve)
        q = env.start(16, 64)
        q.post(writable=[64])
        env.kick()
        wait_until(lambda q=q: q.used_idx() == 1, what="a request")
        rng = env.t.device
        assert isinstance(rng, VirtioRng)
        env.close()
        rng.close()
        run_on_loop(loop, lambda: None)   # the loop's reader went on the loop thread
        assert fds() == before, serve


def test_a_lazily_connected_line_makes_its_eventfd_at_first_use() -> None:
    # (Machine connects each line this way: KVM_IRQFD on the eventfd, made when a
    # device first needs it, so an empty volume slot's pin costs a spawn nothing.)
    connected: list[int] = []
    line = IrqLine(gsi=11, connect=connected.append)
    assert not line.in_use and connected == []
    line.trigger()
    assert line.in_use and connected == [line.fd] and line.count == 1
    assert os.eventfd_read(line.fd) == 1
    line.trigger()
    assert connected == [line.fd]   # connected once
    line.close()
    assert line.fd == -1
    line.trigger()                  # a closed line raises nothing, and makes no fd
    assert line.count == 2


def test_a_line_that_cannot_connect_keeps_no_eventfd() -> None:
    def refuse(fd: int) -> None:
        raise OSError(22, "KVM_IRQFD refused")
    line = IrqLine(gsi=12, connect=refuse)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="refused"):
        line.trigger()
    assert not line.in_use and len(os.listdir("/proc/self/fd")) == before
    line.close()
    assert line.fd == -1
