"""The virtio-mmio v2 transport, driven register by register as a guest would, with
virtio-rng behind it: the native transport (``NativeDevice``, native/src/transport.rs,
its register file native/src/mmio.rs) in a window of its own, on a real native loop
with real eventfds. Every test that takes ``rng`` runs it both ways a machine serves
a queue: with an ioeventfd (kicked as KVM would on the guest's QueueNotify write),
served on the loop without the GIL, and without one, served on the writing thread."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
from test_virtio_harness import (  # noqa: F401
    GuestDriver,
    loop,
    memory,
    native_device,
    spin_holding_the_gil,
    wait_until,
)

from vmfork import _core
from vmfork.vmm.devices.plan import boot_plan, device_plan, plan_state
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
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.irq import IrqLine
from vmfork.vmm.memory import GuestMemory

ACK_DRIVER = STATUS_ACKNOWLEDGE | STATUS_DRIVER

# Whether the queue has an ioeventfd (served on the loop) or not (on the writing thread).
RNG_PATHS = [True, False]


def _path_id(ioeventfd: bool) -> str:
    return "ioeventfd" if ioeventfd else "inline"


class Rng:
    """A native virtio-rng as a machine restores it (``boot_plan`` or a plan given), in
    a window of its own; ``irq`` is its interrupt's eventfd."""

    def __init__(self, loop: EventLoop, memory: GuestMemory,  # noqa: F811
                 ioeventfd: bool, plan: _core.DevicePlanTuple | None = None) -> None:
        self.irq = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.kicks = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)] if ioeventfd else []
        self.device, self.window = native_device(
            loop, memory, plan or boot_plan("rng"), self.irq, [*self.kicks] or [None])
        self.driver = GuestDriver(self.window, memory)

    @property
    def regs(self) -> _core.MmioRegisters:
        return self.device.registers

    def kick(self) -> None:
        """The guest's QueueNotify for queue 0, as KVM or the vCPU delivers it."""
        if self.kicks:
            os.eventfd_write(self.kicks[0], 1)
        else:
            self.driver.notify(0)

    def interrupts(self) -> int:
        """The irqfd's count since the last call."""
        try:
            return os.eventfd_read(self.irq)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        self.device.close()
        for fd in (self.irq, *self.kicks):
            os.close(fd)


@pytest.fixture(params=RNG_PATHS, ids=_path_id)
def rng(request: pytest.FixtureRequest, loop: EventLoop,  # noqa: F811
        memory: GuestMemory) -> Iterator[Rng]:  # noqa: F811
    made = Rng(loop, memory, request.param)
    yield made
    made.close()


@pytest.fixture
def driver(rng: Rng) -> GuestDriver:
    return rng.driver


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


def test_features_ok_needs_version_1(rng: Rng, driver: GuestDriver) -> None:
    assert driver.negotiate(VIRTIO_F_VERSION_1) & STATUS_FEATURES_OK
    assert rng.regs.driver_features == VIRTIO_F_VERSION_1
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


def test_status_must_advance_in_order_and_never_clear(rng: Rng, driver: GuestDriver) -> None:
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
    assert rng.regs.ignored_writes >= 3


def test_driver_features_ignored_outside_negotiation(rng: Rng, driver: GuestDriver) -> None:
    driver.w(mmio.REG_DRIVER_FEATURES_SEL, 1)
    driver.w(mmio.REG_DRIVER_FEATURES, 1)  # before DRIVER
    assert rng.regs.driver_features == 0
    driver.start([(16, 4096)])
    driver.w(mmio.REG_DRIVER_FEATURES, 0)  # after FEATURES_OK
    assert rng.regs.driver_features == VIRTIO_F_VERSION_1


def test_misaligned_and_odd_size_register_accesses(rng: Rng, driver: GuestDriver) -> None:
    window = rng.window
    assert window.read(mmio.REG_MAGIC, 2) == b"\0\0"
    assert window.read(mmio.REG_MAGIC + 1, 4) == b"\0\0\0\0"
    window.write(mmio.REG_STATUS, b"\x01")
    window.write(mmio.REG_STATUS + 2, b"\x01\0\0\0")
    assert driver.status == 0 and rng.regs.bad_accesses == 4
    assert driver.r(0x0F0) == 0  # unknown register reads zero
    driver.w(mmio.REG_MAGIC, 5)  # read-only register
    assert driver.r(mmio.REG_MAGIC) == 0x74726976


def test_queue_registers(rng: Rng, driver: GuestDriver) -> None:
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
    _, _, ready, desc, _, _ = rng.regs.queues()[0]
    assert ready and desc == 0x1_1234_5000
    driver.w(mmio.REG_QUEUE_READY, 7)  # not 0 or 1: ignored
    assert driver.r(mmio.REG_QUEUE_READY) == 1


@pytest.mark.parametrize("num", [0, 3, 100, 512])
def test_bad_queue_size_needs_reset(rng: Rng, driver: GuestDriver, num: int) -> None:
    driver.negotiate()
    driver.w(mmio.REG_QUEUE_SEL, 0)
    driver.w(mmio.REG_QUEUE_NUM, num)
    assert needs_reset(driver)
    assert driver.r(mmio.REG_INTERRUPT_STATUS) & mmio.INT_CONFIG_CHANGE
    assert rng.interrupts() == 1
    assert rng.regs.last_device_error is not None and str(num) in rng.regs.last_device_error
    driver.start([(16, 4096)])  # a reset (inside start) recovers
    assert not needs_reset(driver) and driver.status & STATUS_DRIVER_OK


def test_queue_writes_after_driver_ok_are_ignored(rng: Rng, driver: GuestDriver) -> None:
    driver.start([(16, 4096)])
    driver.w(mmio.REG_QUEUE_SEL, 0)
    driver.w(mmio.REG_QUEUE_READY, 0)
    driver.w(mmio.REG_QUEUE_NUM, 3)
    _, size, ready, _, _, _ = rng.regs.queues()[0]
    assert ready and size == 16
    assert not needs_reset(driver)


def test_rng_fills_buffers_and_interrupts(rng: Rng, driver: GuestDriver) -> None:
    (q,) = driver.start([(16, 4096)])
    head = q.post(writable=[100, 200])
    rng.kick()
    wait_until(lambda: q.used_idx() == 1, what="the rng request")
    [(used_head, written, data)] = q.take_used()
    assert (used_head, written, len(data)) == (head, 300, 300)
    assert len(set(data)) > 10  # random, not zeros
    wait_until(lambda: rng.device.interrupts >= 1, what="the used-buffer interrupt")
    assert rng.interrupts() >= 1
    assert driver.ack_interrupts() == mmio.INT_USED_BUFFER
    assert driver.r(mmio.REG_INTERRUPT_STATUS) == 0


def test_rng_caps_each_request(rng: Rng, driver: GuestDriver) -> None:
    (q,) = driver.start([(4, 1 << 20)])
    q.post(writable=[1 << 20])
    q.post(readable=[b"nothing to fill"])
    rng.kick()
    wait_until(lambda: q.used_idx() == 2, what="the rng requests")
    assert [w for _, w, _ in q.take_used()] == [64 * 1024, 0]


def test_rng_budget_serves_every_request_after_one_notify(rng: Rng, driver: GuestDriver) -> None:
    """One QueueNotify for more requests than one turn's budget (64): the rest is served
    on later turns, the server re-arming its ioeventfd (or, without one, serving on),
    and a snapshot's plan sees the indices the server advanced."""
    (q,) = driver.start([(256, 64)])
    for _ in range(200):
        q.post(writable=[32])
    rng.kick()
    wait_until(lambda: q.used_idx() == 200, what="every request after one notify")
    assert all(w == 32 for _, w, _ in q.take_used())
    assert rng.device.plan()[4][0] == (200, 200)
    assert rng.device.rng_served() == (200, 200 * 32)


def test_notify_before_driver_ok_or_for_missing_queue_is_ignored(
        rng: Rng, driver: GuestDriver, loop: EventLoop) -> None:  # noqa: F811
    driver.negotiate()
    q = driver.setup_queue(0, 16, 4096)
    q.post(writable=[16])
    driver.notify(0)
    driver.notify(5)
    run_on_loop(loop, lambda: None)  # anything queued has run
    assert q.used_idx() == 0 and rng.regs.ignored_writes == 2


def test_rings_outside_ram_need_reset_at_driver_ok(rng: Rng, driver: GuestDriver) -> None:
    driver.negotiate()
    driver.w(mmio.REG_QUEUE_SEL, 0)
    driver.w(mmio.REG_QUEUE_NUM, 16)
    driver.w(mmio.REG_QUEUE_DESC_HIGH, 0x10)  # 64 GiB: not RAM
    driver.w(mmio.REG_QUEUE_READY, 1)
    driver.driver_ok()
    wait_until(lambda: needs_reset(driver), what="DEVICE_NEEDS_RESET")
    assert "descriptor table" in (rng.regs.last_device_error or "")
    assert not rng.device.active


def test_broken_chain_needs_reset_then_reset_recovers(rng: Rng, driver: GuestDriver,
                                                      memory: GuestMemory) -> None:  # noqa: F811
    (q,) = driver.start([(16, 4096)])
    head = q.post(writable=[16, 16])
    # Make the chain loop back on itself.
    memory.write_u16(q.desc + 16 * q.chains[head][1][0] + 12,
                     VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE)
    memory.write_u16(q.desc + 16 * q.chains[head][1][0] + 14, head)
    rng.kick()
    wait_until(lambda: needs_reset(driver), what="DEVICE_NEEDS_RESET")
    assert "loop" in (rng.regs.last_device_error or "")
    assert driver.r(mmio.REG_INTERRUPT_STATUS) & mmio.INT_CONFIG_CHANGE
    # Further notifications are ignored; the device is left alone.
    rng.kick()
    assert rng.regs.device_errors == 1
    (q,) = driver.start([(16, 4096)])
    assert not needs_reset(driver) and driver.r(mmio.REG_INTERRUPT_STATUS) == 0
    q.post(writable=[8])
    rng.kick()
    wait_until(lambda: q.used_idx() == 1, what="the rng request after reset")


@pytest.mark.parametrize("addr, length, message", [
    (1 << 40, 16, "outside guest RAM"),                 # far beyond RAM
    ((48 << 20) - 8, 16, "outside guest RAM"),           # crosses the end of RAM
    (0x1000, 0xFFFF_FFFF, "outside guest RAM"),          # a 4 GiB buffer
])
def test_rng_hostile_descriptor_needs_reset(rng: Rng, driver: GuestDriver,
                                            memory: GuestMemory,  # noqa: F811
                                            loop: EventLoop,  # noqa: F811
                                            addr: int, length: int, message: str) -> None:
    (q,) = driver.start([(16, 4096)])
    head = q.post(writable=[16])
    desc = q.desc + 16 * q.chains[head][0][0]
    memory.write_u64(desc, addr)
    memory.write_u32(desc + 8, length)
    rng.kick()
    wait_until(lambda: needs_reset(driver), what="DEVICE_NEEDS_RESET")
    assert message in (rng.regs.last_device_error or "")
    assert rng.regs.device_errors == 1 and q.used_idx() == 0
    rng.kick()   # a failed device serves no more
    run_on_loop(loop, lambda: None)
    assert rng.regs.device_errors == 1 and q.used_idx() == 0


def test_reset_clears_registers_and_queues(rng: Rng, driver: GuestDriver) -> None:
    driver.start([(16, 4096)])
    driver.w(mmio.REG_STATUS, 0)
    assert driver.status == 0 and driver.r(mmio.REG_QUEUE_READY) == 0
    assert rng.regs.queues()[0][3] == 0 and not rng.device.active


def test_config_space_of_a_device_without_one(rng: Rng) -> None:
    assert rng.window.read(0x100, 4) == b"\0\0\0\0"  # rng has no config: zeros
    rng.window.write(0x100, b"\1\2\3\4")  # dropped, no crash
    assert rng.window.read(0x100, 4) == b"\0\0\0\0"


def test_a_restored_plan_continues_the_queue(rng: Rng, driver: GuestDriver,
                                             loop: EventLoop,  # noqa: F811
                                             memory: GuestMemory) -> None:  # noqa: F811
    """The device's plan, saved as its record and planned again (a snapshot and a
    spawned child's restore), re-activates the device where the parent was."""
    (q,) = driver.start([(16, 4096)])
    q.post(writable=[8])
    rng.kick()
    wait_until(lambda: q.used_idx() == 1, what="the first request")
    q.take_used()
    record = plan_state(rng.device.plan(), 1, 6)
    assert record.transport is not None
    assert record.transport.queues[0].next_avail == 1
    assert record.transport.status & STATUS_DRIVER_OK
    child = Rng(loop, memory, bool(rng.kicks), plan=device_plan(record))
    try:
        assert child.device.active and child.device.plan() == rng.device.plan()
        q.post(writable=[8])
        child.kick()
        wait_until(lambda: q.used_idx() == 2, what="a request served by the restored device")
    finally:
        child.close()


def test_native_rng_serving_needs_no_gil(loop: EventLoop, memory: GuestMemory) -> None:  # noqa: F811
    """The main thread keeps the GIL (a long switch interval, spinning in Python) while
    the guest kicks: the native server still fills the request and raises the irqfd."""
    env = Rng(loop, memory, ioeventfd=True)
    try:
        (q,) = env.driver.start([(16, 64)])
        assert env.device.active
        q.post(writable=[64])
        env.kick()
        wait_until(lambda: q.used_idx() == 1, what="the first request")
        q.post(writable=[64])
        served_in = spin_holding_the_gil(env.kick, lambda: q.used_idx() == 2)
        assert q.used_idx() == 2 and served_in < 5, served_in
        assert env.interrupts() >= 1
    finally:
        env.close()


def test_rng_closed_holds_no_fds(loop: EventLoop, memory: GuestMemory) -> None:  # noqa: F811
    """After the device's close (and the test's own eventfds), no descriptor of it is
    open: the server's duplicates of the irqfd and the ioeventfd are gone with it."""
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))
    gc.collect()
    for ioeventfd in RNG_PATHS:
        before = fds()
        env = Rng(loop, memory, ioeventfd)
        (q,) = env.driver.start([(16, 64)])
        q.post(writable=[64])
        env.kick()
        wait_until(lambda q=q: q.used_idx() == 1, what="a request")
        env.close()
        run_on_loop(loop, lambda: None)   # the loop's reader went on the loop thread
        assert fds() == before, ioeventfd


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
