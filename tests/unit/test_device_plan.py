"""A device restored natively from the plan Python builds from its decoded record.

A native rng serves a driver until a snapshot; its ``DeviceState`` (the record a
state file keeps, through ``stateformat``) becomes a plan (``devices/plan.py``), and
``_core.NativeDevice`` (``native/src/transport.rs``) restores from it on another loop
with its own eventfds: the guest's next request is served from where the snapshot left
the ring, and the device's plan turns back into the same record with the indices moved
on. The balloon's plan keeps the config the driver wrote. A vsock restored natively has no
connections, posts the transport-reset event, and serves host connections on the
listener it is handed. A disk (the root disk, a volume slot) restores natively on the
file it is handed, checked to be the record's size, and an empty volume slot on none.
A net device restores natively on the tap it is handed and moves frames both ways.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_virtio_harness import DriverQueue, GuestDriver, Window, wait_until
from test_virtio_vsock import VsockEnv, pkt, recv_exact, recv_line

from vmfork import _core
from vmfork.ondisk import stateformat
from vmfork.vmm.devices.manager import DeviceState, VolumeSlotState
from vmfork.vmm.devices.plan import boot_plan, device_plan, machine_plan, plan_state
from vmfork.vmm.devices.serial import SerialState
from vmfork.vmm.devices.virtio import blk, net
from vmfork.vmm.devices.virtio.balloon import BalloonState
from vmfork.vmm.devices.virtio.device import VIRTIO_F_VERSION_1
from vmfork.vmm.devices.virtio.mmio import MmioTransportState
from vmfork.vmm.devices.virtio.queue import QueueState
from vmfork.vmm.devices.virtio.rng import RngState
from vmfork.vmm.devices.virtio.vsock import (
    CONNECT_TIMEOUT,
    EVENT_TRANSPORT_RESET,
    HEADER_SIZE,
    RESET_ACK_WAIT_S,
    Op,
    PacketHeader,
    VsockState,
)
from vmfork.vmm.eventloop import NativeEventLoop, new_event_loop
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.vmstate import MachineState

# How long a wait for the native loop may take before the test calls it hung (a guard
# against a hang, not a measurement: a healthy run takes microseconds).
HANG_GUARD_S = 20.0
GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture
def memory() -> Iterator[GuestMemory]:
    mem = GuestMemory.anonymous(32 << 20)   # the golden file's vsock rings are at 20 MiB
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
    parent_irq = _eventfd()
    parent = _core.NativeDevice.restore(boot_plan("rng"), _ram(memory), parent_loop._native,
                                        parent_irq, [None])
    driver = GuestDriver(Window.of(parent), memory)
    [queue] = driver.start([(16, 64)])
    queue.post(writable=[64])
    driver.notify(0)
    wait_until(lambda: queue.used_idx() == 1, what="the parent's rng served")
    [(_, written, _)] = queue.take_used()
    assert written == 64

    saved = plan_state(parent.plan(), 0, 5)
    # Through the state file's encoding and back: the plan is built from a decoded record.
    decoded = stateformat.decode_state(stateformat.encode_state(saved), DeviceState)
    plan = device_plan(decoded)
    kind, features, max_sizes, registers, indices = plan
    assert kind[0] == "rng" and max_sizes == [256] and indices == [(1, 1)]
    assert registers[0] == parent.registers.status

    irq, notify = _eventfd(), _eventfd()
    try:
        native = _core.NativeDevice.restore(plan, _ram(memory), child_loop._native, irq,
                                            [notify])
        assert native.active
        assert native.registers.status == parent.registers.status
        assert native.acked_features == parent.acked_features
        # The driver never acked the parent's interrupt: InterruptStatus was saved set,
        # and the restore raises it again (the irqchip's state may not hold it).
        assert decoded.transport is not None and decoded.transport.interrupt_status == 1
        assert _wait_signalled(irq) == 1
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
        parent.close()
        os.close(parent_irq)


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
    with pytest.raises(ValueError, match="device type 4, not 19"):
        device_plan(DeviceState("vsock", 1, 0, 5, VsockState(guest_cid=3, acked_features=0),
                                rng_regs))
    with pytest.raises(ValueError, match="no native transport for a serial device"):
        device_plan(DeviceState("serial", 1, None, 4, SerialState(), None))


def test_an_old_snapshots_records_make_plans(memory: GuestMemory, tmp_path: Path) -> None:
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

        # Its vsock restores live, binding the socket path it is given; its config is
        # the record's CID.
        [vsock_saved] = [d for d in state.devices if d.kind == "vsock"]
        assert vsock_saved.transport is not None
        for q in vsock_saved.transport.queues:
            memory.write_u16(q.avail_ring + 2, q.next_avail)
            memory.write_u16(q.used_ring + 2, q.next_used)
        uds = tmp_path / "v.sock"
        vsock = _core.NativeDevice.restore(device_plan(vsock_saved), _ram(memory),
                                           loop._native, irq, [None] * 3, (str(uds), None))
        assert vsock.active and uds.exists()
        assert vsock.registers.read(0x100, 8) == struct.pack("<Q", 7)
        assert plan_state(vsock.plan(), vsock_saved.slot, vsock_saved.irq) == vsock_saved
        del vsock
        assert not uds.exists()   # the path it bound goes with it
    finally:
        loop.stop()
        os.close(irq)


def _wait_packet(rx: DriverQueue, op: Op) -> tuple[PacketHeader, bytes]:
    """The next packet of ``op`` the device put in the guest's rx queue (others skipped)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        for _, written, data in rx.take_used():
            hdr = PacketHeader.unpack(data[:HEADER_SIZE])
            if hdr.op == op:
                return hdr, data[HEADER_SIZE:written]
        time.sleep(0.002)
    raise AssertionError(f"no {op.name} packet in the rx queue")


def test_a_vsock_snapshot_restores_natively_without_the_parents_connections(
        loops: tuple[NativeEventLoop, NativeEventLoop]) -> None:
    parent_loop, child_loop = loops
    with VsockEnv(parent_loop) as parent:
        # The parent: a host connection established and an event buffer posted when
        # the snapshot is taken.
        parent.ev.post(writable=[4])
        parent.driver.notify(2)
        old_host, _ = parent.host_connect(1234)
        saved = plan_state(parent.dev.plan(), 0, 6)
        dev_state = saved.state
        # The parent lets go of the rings (the child maps the same guest memory).
        parent.device.close()
        assert old_host.recv(10) == b""
        old_host.close()

        decoded = stateformat.decode_state(stateformat.encode_state(saved), DeviceState)
        plan = device_plan(decoded)
        assert plan[0] == ("vsock", 3, round(CONNECT_TIMEOUT * 1000),
                           round(RESET_ACK_WAIT_S * 1000))
        child_uds = f"{parent.dir}/child.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(child_uds)
        listener.listen(8)
        irq = _eventfd()
        notify = [_eventfd() for _ in range(3)]
        native = None
        try:
            with pytest.raises(ValueError, match="needs its listener"):
                _core.NativeDevice.restore(plan, _ram(parent.memory), child_loop._native, irq,
                                           notify)
            native = _core.NativeDevice.restore(plan, _ram(parent.memory), child_loop._native,
                                                irq, notify, (child_uds, listener.fileno()))
            listener.close()   # the device holds its own duplicate
            assert native.active
            assert native.registers.read(0x100, 8) == struct.pack("<Q", 3)   # config: the CID
            # Connection-less, and the guest told so: the reset event in the buffer the
            # parent left posted.
            wait_until(lambda: parent.ev.used_idx() == 1, HANG_GUARD_S,
                       "the transport reset event")
            [(_, _, data)] = parent.ev.take_used()
            assert data == struct.pack("<I", EVENT_TRANSPORT_RESET)

            # A host connection on the child's listener, held until the guest handled the
            # reset (a new event buffer), then a REQUEST; the guest accepts; data both ways.
            host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            host.settimeout(HANG_GUARD_S)
            host.connect(child_uds)
            host.sendall(b"CONNECT 4321\n")
            parent.ev.post(writable=[4])
            os.eventfd_write(notify[2], 1)
            request, _ = _wait_packet(parent.rx, Op.REQUEST)
            assert (request.src_cid, request.dst_cid, request.dst_port) == (2, 3, 4321)
            parent.tx.post(readable=[pkt(Op.RESPONSE, 4321, request.src_port).pack()])
            os.eventfd_write(notify[1], 1)
            assert recv_line(host) == f"OK {request.src_port}\n".encode()
            host.sendall(b"ping")
            parent.rx.post(writable=[HEADER_SIZE, 4096])
            os.eventfd_write(notify[0], 1)
            rw, payload = _wait_packet(parent.rx, Op.RW)
            assert (rw.dst_port, payload) == (4321, b"ping")
            parent.tx.post(readable=[pkt(Op.RW, 4321, request.src_port, 4).pack(), b"pong"])
            os.eventfd_write(notify[1], 1)
            assert recv_exact(host, 4) == b"pong"
            host.close()
            assert native.record() == (0, 0, 0, None)

            # The device's plan is the saved record again, its ring indices moved on.
            back = plan_state(native.plan(), 0, 6)
            assert back.state == decoded.state == dev_state
            assert back.transport is not None and decoded.transport is not None
            moved = [(q.next_avail, q.next_used) for q in back.transport.queues]
            was = [(q.next_avail, q.next_used) for q in decoded.transport.queues]
            assert moved[2] == (was[2][0] + 1, was[2][1] + 1)   # the reset event
            assert moved[1][0] >= was[1][0] + 2                 # RESPONSE, RW
            back.transport.queues = decoded.transport.queues
            assert back == decoded
        finally:
            del native   # off the loop, its sockets closed
            listener.close()
            os.close(irq)
            for fd in notify:
                os.close(fd)


def test_a_machine_plan_is_every_virtio_device_at_its_slot_and_pin() -> None:
    """The format-1 golden file's machine: each device (its root disk, volume slots and
    net too) is at the slot and pin the device manager gave it, COM1 left to the
    console, and each plan turns back into its record."""
    state = stateformat.read_state_file(GOLDEN / "state-v1.bin", MachineState)
    virtio = [d for d in state.devices if d.slot is not None]
    devices = machine_plan(state)
    assert [(slot, irq, plan[0][0]) for slot, irq, plan in devices] == [
        (d.slot, d.irq, kind) for d, kind in
        zip(virtio, ("vsock", "rng", "net", "blk", "balloon", "volume", "volume"))]
    for (slot, irq, plan), saved in zip(devices, virtio):
        assert plan == device_plan(saved)
        assert plan_state(plan, slot, irq) == saved


def _post(memory: GuestMemory, q: QueueState, buf: int, length: int, flags: int) -> None:
    """A driver's chain of one descriptor (at the queue's next free head) published on
    ``q``'s avail ring after the entries the snapshot's device already served."""
    head = q.next_avail % q.size
    memory.write(q.desc_table + 16 * head, struct.pack("<QIHH", buf, length, flags, 0))
    memory.write_u16(q.avail_ring + 4 + 2 * head, head)
    memory.write_u16(q.avail_ring + 2, q.next_avail + 1)


def _wait_used(memory: GuestMemory, q: QueueState, index: int) -> tuple[int, int]:
    """The used ring's entry ``index`` (id, length), waiting until the device wrote it."""
    deadline = time.monotonic() + HANG_GUARD_S
    while memory.read_u16(q.used_ring + 2) <= index % 65536:
        assert time.monotonic() < deadline, "the used entry never came"
        time.sleep(0.002)
    at = q.used_ring + 4 + 8 * (index % q.size)
    return memory.read_u32(at), memory.read_u32(at + 4)


def test_an_old_snapshots_net_restores_natively_and_moves_frames_on_its_tap(
        memory: GuestMemory) -> None:
    """The format-1 golden file's net record makes a plan (its MAC; what ``net.py``
    offers), restores natively and live on the tap it is handed (a datagram
    socketpair: one write a frame, as a tap with IFF_VNET_HDR), serves the config
    space ``net.py`` states (the MAC, then the link up), sends a guest frame to the tap and puts the host's in the guest's
    buffer, and gives the record back with both rings moved on by one."""
    state = stateformat.read_state_file(GOLDEN / "state-v1.bin", MachineState)
    [saved] = [d for d in state.devices if d.kind == "net"]
    assert isinstance(saved.state, net.NetState) and saved.transport is not None
    kind, features, *_ = device_plan(saved)
    assert kind == ("net", saved.state.mac)
    assert features == VIRTIO_F_VERSION_1 | net.OFFERED_FEATURES
    rxq, txq = saved.transport.queues
    for q in (rxq, txq):
        memory.write_u16(q.avail_ring + 2, q.next_avail)
        memory.write_u16(q.used_ring + 2, q.next_used)
    loop = new_event_loop("plan-net")
    assert isinstance(loop, NativeEventLoop)
    loop.start()
    irq, notify = _eventfd(), [_eventfd(), _eventfd()]
    tap, host = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    tap.setblocking(False)
    host.settimeout(HANG_GUARD_S)
    try:
        device = _core.NativeDevice.restore(device_plan(saved), _ram(memory), loop._native,
                                            irq, notify, tap_fd=tap.fileno())
        tap.close()   # the device holds its own duplicate
        assert device.active
        config = net.parse_mac(saved.state.mac) + struct.pack("<H", net.LINK_UP)
        assert b"".join(device.registers.read(0x100 + at, 2) for at in range(0, 8, 2)) == config
        # Guest to host: the frame, its virtio-net header first, one write on the tap.
        frame = bytes(net.VNET_HDR_SIZE) + b"\xab" * 60
        memory.write(0x300000, frame)
        _post(memory, txq, 0x300000, len(frame), 0)
        os.eventfd_write(notify[net.TX_QUEUE], 1)
        assert host.recv(4096) == frame
        assert _wait_used(memory, txq, txq.next_used) == (txq.next_avail % txq.size, 0)
        # Host to guest: into the buffer the driver posts, num_buffers 1.
        _post(memory, rxq, 0x310000, 2048, 2)   # VIRTQ_DESC_F_WRITE
        os.eventfd_write(notify[net.RX_QUEUE], 1)
        arriving = bytes(net.VNET_HDR_SIZE) + b"\xcd" * 90
        host.send(arriving)
        assert _wait_used(memory, rxq, rxq.next_used) == (rxq.next_avail % rxq.size,
                                                          len(arriving))
        assert memory.read(0x310000, len(arriving)) == (
            arriving[:net.NUM_BUFFERS_OFFSET] + struct.pack("<H", 1)
            + arriving[net.VNET_HDR_SIZE:])
        counters = dict(device.net_counters())
        assert (counters["tx_frames"], counters["rx_frames"], counters["rx_bytes"]) == (1, 1, 90)
        back = plan_state(device.plan(), saved.slot, saved.irq)
        assert back.transport is not None
        assert [(q.next_avail, q.next_used) for q in back.transport.queues] == [
            (q.next_avail + 1, q.next_used + 1) for q in (rxq, txq)]
        back.transport.queues = saved.transport.queues
        assert back == saved
        device.close()
    finally:
        loop.stop()
        host.close()
        for fd in (irq, *notify):
            os.close(fd)


def _disk_file(path: Path, size: int) -> int:
    """A read-only fd on a fresh file of ``size`` bytes, sector i filled with byte i."""
    path.write_bytes(b"".join(bytes([i % 256]) * blk.SECTOR_SIZE
                              for i in range(size // blk.SECTOR_SIZE)))
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def test_an_old_snapshots_disks_restore_natively_on_their_files(
        memory: GuestMemory, tmp_path: Path) -> None:
    """The format-1 golden file's root disk, filled volume slot and empty slot: each
    record makes a plan (its kind the record's values), restores natively and live on
    a file of its size (the empty slot on none), serves config bytes as ``blk.py``
    packs them, and gives the same record back; a file of another size, or none, is
    refused."""
    state = stateformat.read_state_file(GOLDEN / "state-v1.bin", MachineState)
    [root, filled, empty] = [d for d in state.devices if d.kind in ("blk", "volume")]
    assert isinstance(filled.state, VolumeSlotState) and isinstance(empty.state, VolumeSlotState)
    assert device_plan(root)[0] == ("blk", "a" * 64, 1 << 20, True, "")
    assert device_plan(filled)[0] == ("volume", "b" * 64, 65536, True, "/data")
    assert device_plan(empty)[0] == ("volume", "", 0, True, "")
    # What each offers is blk.py's.
    assert device_plan(root)[1] == VIRTIO_F_VERSION_1 | blk.OFFERED_FEATURES
    assert device_plan(filled)[1] == VIRTIO_F_VERSION_1 | blk.OFFERED_FEATURES_SLOT
    loop = new_event_loop("plan-disks")
    assert isinstance(loop, NativeEventLoop)
    loop.start()
    irq = _eventfd()
    files = {"root": _disk_file(tmp_path / "root.img", 1 << 20),
             "filled": _disk_file(tmp_path / "data.img", 65536),
             "short": _disk_file(tmp_path / "short.img", 4096)}
    try:
        for saved, fd, capacity in ((root, files["root"], 1 << 20),
                                    (filled, files["filled"], 65536), (empty, None, 0)):
            config = struct.pack("<QII", capacity // blk.SECTOR_SIZE, blk.SIZE_MAX,
                                 blk.SEG_MAX)
            assert saved.transport is not None
            [q] = saved.transport.queues
            memory.write_u16(q.avail_ring + 2, q.next_avail)
            memory.write_u16(q.used_ring + 2, q.next_used)
            device = _core.NativeDevice.restore(device_plan(saved), _ram(memory),
                                                loop._native, irq, [None], disk_file=fd)
            assert device.active, saved.where
            assert b"".join(device.registers.read(0x100 + at, 4)
                            for at in range(0, 16, 4)) == config
            assert plan_state(device.plan(), saved.slot, saved.irq) == saved
            device.close()
        with pytest.raises(ValueError, match="no file given"):
            _core.NativeDevice.restore(device_plan(root), _ram(memory), loop._native, irq,
                                       [None])
        with pytest.raises(ValueError, match="had 1048576 bytes, but its file has 4096"):
            _core.NativeDevice.restore(device_plan(root), _ram(memory), loop._native, irq,
                                       [None], disk_file=files["short"])
        with pytest.raises(ValueError, match="an empty volume slot has no disk file"):
            _core.NativeDevice.restore(device_plan(empty), _ram(memory), loop._native, irq,
                                       [None], disk_file=files["short"])
    finally:
        loop.stop()
        os.close(irq)
        for fd in files.values():
            os.close(fd)


def test_a_disk_snapshot_restores_natively_and_reads_on_from_where_it_left_off(
        memory: GuestMemory, loops: tuple[NativeEventLoop, NativeEventLoop],
        tmp_path: Path) -> None:
    """A booted root disk served until a snapshot; its decoded record's plan restores
    on the same file, on another loop: the guest's next read is served from the file
    where the ring left off, GET_ID answers the key's first 20 bytes, a write is
    refused, and the plan is the record again."""
    parent_loop, child_loop = loops
    key = "0123456789abcdef" * 4
    fd = _disk_file(tmp_path / "disk.img", 8 * blk.SECTOR_SIZE)
    parent_irq = _eventfd()
    device = _core.NativeDevice.restore(
        boot_plan("blk", disk=blk.BlkState(0, key, 8 * blk.SECTOR_SIZE)), _ram(memory),
        parent_loop._native, parent_irq, [None], disk_file=fd)
    driver = GuestDriver(Window.of(device), memory)  # type: ignore[arg-type]
    [queue] = driver.start([(16, 4096)])
    queue.post(readable=[struct.pack("<IIQ", blk.T_IN, 0, 1)],
               writable=[blk.SECTOR_SIZE, 1])
    driver.notify(0)
    wait_until(lambda: queue.used_idx() == 1, what="the parent's read")
    [(_, written, data)] = queue.take_used()
    assert (written, data) == (blk.SECTOR_SIZE + 1, b"\1" * blk.SECTOR_SIZE + b"\0")

    saved = plan_state(device.plan(), 3, 8)
    device.close()   # the parent lets go of the rings
    os.close(parent_irq)
    decoded = stateformat.decode_state(stateformat.encode_state(saved), DeviceState)
    plan = device_plan(decoded)
    assert plan[0] == ("blk", key, 8 * blk.SECTOR_SIZE, True, "")
    assert plan[4] == [(1, 1)]
    irq, notify = _eventfd(), _eventfd()
    native = None
    try:
        native = _core.NativeDevice.restore(plan, _ram(memory), child_loop._native, irq,
                                            [notify], disk_file=fd)
        assert native.active
        queue.post(readable=[struct.pack("<IIQ", blk.T_IN, 0, 6)],
                   writable=[blk.SECTOR_SIZE, 1])
        queue.post(readable=[struct.pack("<IIQ", blk.T_GET_ID, 0, 0)], writable=[20, 1])
        queue.post(readable=[struct.pack("<IIQ", blk.T_OUT, 0, 0), b"x" * blk.SECTOR_SIZE],
                   writable=[1])
        os.eventfd_write(notify, 1)
        assert _wait_signalled(irq) >= 1
        wait_until(lambda: queue.used_idx() == 4, HANG_GUARD_S, "the native disk's answers")
        answers = [data for _, _, data in queue.take_used()]
        assert answers == [b"\6" * blk.SECTOR_SIZE + b"\0", key[:20].encode() + b"\0",
                           bytes([blk.S_IOERR])]
        counters = dict(native.blk_counters())
        assert (counters["requests"], counters["reads"], counters["get_ids"],
                counters["writes_refused"]) == (3, 1, 1, 1)
        assert native.record() == (0, 0, 0, None)

        back = plan_state(native.plan(), 3, 8)
        assert back.state == decoded.state == saved.state
        assert back.transport is not None and decoded.transport is not None
        assert [(q.next_avail, q.next_used) for q in back.transport.queues] == [(4, 4)]
        back.transport.queues = decoded.transport.queues
        assert back == decoded
    finally:
        del native
        os.close(irq)
        os.close(notify)
        os.close(fd)
