"""A device restored natively from the plan Python builds from its decoded record.

The Python transport serves an rng until a snapshot; its ``DeviceState`` (the record a
state file keeps, through ``stateformat``) becomes a plan (``devices/plan.py``), and
``_core.NativeDevice`` (``native/src/transport.rs``) restores from it on another loop
with its own eventfds: the guest's next request is served from where the snapshot left
the ring, and the device's plan turns back into the same record with the indices moved
on. The balloon's plan keeps the config the driver wrote.
"""

from __future__ import annotations

import mmap
import os
import select
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_virtio_harness import GuestDriver, wait_until

from vmfork import _core
from vmfork.ondisk import stateformat
from vmfork.vmm.devices.manager import DeviceState
from vmfork.vmm.devices.plan import device_plan, plan_state
from vmfork.vmm.devices.virtio import mmio
from vmfork.vmm.devices.virtio.balloon import BalloonState
from vmfork.vmm.devices.virtio.device import run_on_loop
from vmfork.vmm.devices.virtio.mmio import MmioTransportState
from vmfork.vmm.devices.virtio.queue import QueueState
from vmfork.vmm.devices.virtio.rng import RngState, VirtioRng
from vmfork.vmm.devices.virtio.vsock import VsockState
from vmfork.vmm.eventloop import NativeEventLoop, new_event_loop
from vmfork.vmm.irq import IrqLine
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.vmstate import MachineState

# How long a wait for the native loop may take before the test calls it hung (a guard
# against a hang, not a measurement: a healthy run takes microseconds).
HANG_GUARD_S = 20.0
GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture
def memory() -> Iterator[GuestMemory]:
    mem = GuestMemory.anonymous(16 << 20)
    yield mem
    mem.close()


@pytest.fixture
def loops(memory: GuestMemory) -> Iterator[tuple[NativeEventLoop, NativeEventLoop]]:
    """The snapshot's loop and the restored device's (both stop before RAM is unmapped)."""
    made = []
    for name in ("plan-parent", "plan-child"):
        loop = new_event_loop(name)
        assert isinstance(loop, NativeEventLoop)
        loop.start()
        made.append(loop)
    yield made[0], made[1]
    for loop in made:
        loop.stop()
        assert not loop.errors


def _ram(memory: GuestMemory) -> _core.GuestRam:
    assert memory.native is not None
    return memory.native


def _eventfd() -> int:
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def _wait_signalled(fd: int) -> int:
    ready, _, _ = select.select([fd], [], [], HANG_GUARD_S)
    assert ready, "the irqfd was never signalled"
    return os.eventfd_read(fd)


def test_an_rng_snapshot_restores_natively_and_goes_on_where_it_left_off(
        memory: GuestMemory, loops: tuple[NativeEventLoop, NativeEventLoop]) -> None:
    parent_loop, child_loop = loops
    line = IrqLine(5)
    device = VirtioRng(parent_loop)
    transport = mmio.MmioTransport(device, memory, line, parent_loop)
    driver = GuestDriver(transport, memory)
    [queue] = driver.start([(16, 64)])
    queue.post(writable=[64])
    driver.notify(0)
    wait_until(lambda: queue.used_idx() == 1, what="the Python transport's rng served")
    [(_, written, _)] = queue.take_used()
    assert written == 64

    saved = DeviceState("rng", 1, 0, 5, device.save(), run_on_loop(parent_loop, transport.save))
    # Through the state file's encoding and back: the plan is built from a decoded record.
    decoded = stateformat.decode_state(stateformat.encode_state(saved), DeviceState)
    plan = device_plan(decoded)
    kind, features, max_sizes, registers, indices = plan
    assert kind[0] == "rng" and max_sizes == [256] and indices == [(1, 1)]
    assert registers[0] == transport.status

    irq, notify = _eventfd(), _eventfd()
    try:
        native = _core.NativeDevice.restore(plan, _ram(memory), child_loop._native, irq,
                                            [notify])
        assert native.active
        assert native.registers.status == transport.status
        assert native.acked_features == device.acked_features
        windows = _core.MmioWindows()
        windows.add_native(0xD000_0000, native)
        assert len(windows) == 1
        with pytest.raises(ValueError, match="overlaps"):
            windows.add_native(0xD000_0800, native)

        # The guest's next request, its kick as KVM's ioeventfd delivers it.
        queue.post(writable=[32])
        os.eventfd_write(notify, 1)
        assert _wait_signalled(irq) == 1
        [(_, written, data)] = queue.take_used()
        assert written == 32 and len(data) == 32
        assert queue.used_idx() == 2
        assert native.record() == (0, 0, 0, None)

        # The device's plan is the saved record again, its ring indices moved on.
        back = plan_state(native.plan(), 0, 5)
        assert back.state == decoded.state
        assert back.transport is not None and decoded.transport is not None
        assert back.transport.queues[0].next_avail == 2
        assert back.transport.queues[0].next_used == 2
        back.transport.queues[0].next_avail = back.transport.queues[0].next_used = 1
        assert back == decoded
    finally:
        os.close(irq)
        os.close(notify)
        run_on_loop(parent_loop, transport.close)
        device.close()   # its native server's cycle, broken now rather than by the collector
        line.close()


def test_a_balloon_plan_keeps_actual_and_a_reset_device_stays_inactive(
        memory: GuestMemory, loops: tuple[NativeEventLoop, NativeEventLoop]) -> None:
    _, child_loop = loops
    # A balloon the driver had not started (no DRIVER_OK) when the snapshot was taken:
    # not live; its queues' indices kept for the DRIVER_OK to come, as the Python
    # transport keeps them.
    queues = [QueueState(64, 64, False, 0, 0, 0, 3 + i, 3 + i) for i in range(3)]
    transport = MmioTransportState(device_type=5, status=0, device_features_sel=0,
                                   driver_features_sel=0, driver_features=0,
                                   driver_features_bad=False, queue_sel=0,
                                   interrupt_status=0, config_generation=0, queues=queues)
    saved = DeviceState("balloon", 1, 3, 8, BalloonState(acked_features=0, actual=7),
                        transport)
    plan = device_plan(saved, balloon_advice=mmap.MADV_REMOVE)
    assert plan[0] == ("balloon", 16, mmap.MADV_REMOVE, 7)
    irq = _eventfd()
    try:
        native = _core.NativeDevice.restore(plan, _ram(memory), child_loop._native, irq,
                                            [None, None, None])
        assert not native.active
        assert plan_state(native.plan(), 3, 8) == saved
    finally:
        os.close(irq)


def test_a_plan_refuses_a_record_that_does_not_fit_its_device() -> None:
    rng_regs = MmioTransportState(device_type=4, status=0, device_features_sel=0,
                                  driver_features_sel=0, driver_features=0,
                                  driver_features_bad=False, queue_sel=0, interrupt_status=0,
                                  config_generation=0, queues=[])
    with pytest.raises(ValueError, match="has 0 queues, the device 1"):
        device_plan(DeviceState("rng", 1, 0, 5, RngState(0), rng_regs))
    with pytest.raises(ValueError, match="device type 4, not 5"):
        device_plan(DeviceState("balloon", 1, 0, 5, BalloonState(0), rng_regs))
    with pytest.raises(ValueError, match="no native transport for a vsock device"):
        device_plan(DeviceState("vsock", 1, 0, 5, VsockState(guest_cid=3, acked_features=0),
                                rng_regs))


def test_an_old_snapshots_records_make_plans(memory: GuestMemory) -> None:
    """The format-1 golden file (written before the device list): its rng record decodes
    as it always did and restores natively, live, from its plan; its balloon's queues
    are 256 long where today's balloon offers 64, which the native register file refuses
    as the Python transport's (the same ``MmioRegisters.restore``) does."""
    state = stateformat.read_state_file(GOLDEN / "state-v1.bin", MachineState)
    [rng_saved] = [d for d in state.devices if d.kind == "rng"]
    [balloon_saved] = [d for d in state.devices if d.kind == "balloon"]
    loop = new_event_loop("plan-golden")
    assert isinstance(loop, NativeEventLoop)
    loop.start()
    irq = _eventfd()
    try:
        assert rng_saved.transport is not None
        # The snapshot's rings as its guest left them: every request it made was served.
        [q] = rng_saved.transport.queues
        memory.write_u16(q.avail_ring + 2, q.next_avail)
        memory.write_u16(q.used_ring + 2, q.next_used)
        device = _core.NativeDevice.restore(device_plan(rng_saved), _ram(memory),
                                            loop._native, irq, [None])
        assert device.active
        assert device.registers.status == rng_saved.transport.status
        assert plan_state(device.plan(), rng_saved.slot, rng_saved.irq) == rng_saved
        with pytest.raises(ValueError, match="max size 256, this queue 64"):
            _core.NativeDevice.restore(device_plan(balloon_saved), _ram(memory),
                                       loop._native, irq, [None] * 3)
    finally:
        loop.stop()
        os.close(irq)
