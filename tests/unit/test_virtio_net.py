"""virtio-net end to end: a simulated guest driver on one side, a real tap device
in a private network namespace on the other (an AF_PACKET socket on the tap
plays the host's network), the device as every machine serves it (its native
transport, ``_core.NativeDevice``, ``net_serve.rs`` and ``net.rs``, the one
implementation) on a real I/O thread in between.

Every test that moves frames runs both ways a driver's kick reaches the device: the
queues' ioeventfds written as KVM writes them on the guest's QueueNotify write (served
on the loop), and QueueNotify writes served on the writing thread (a transport without
ioeventfds)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from test_virtio_harness import (  # noqa: F401
    MEM_SIZE,
    GuestDriver,
    loop,
    memory,
    native_device,
    wait_until,
)

from vmfork.ondisk import stateformat
from vmfork.vmm.devices.manager import DeviceState
from vmfork.vmm.devices.plan import boot_plan, device_plan, plan_state
from vmfork.vmm.devices.virtio import mmio, net
from vmfork.vmm.devices.virtio.device import (
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
    run_on_loop,
)
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.memory import GuestMemory

GUEST_MAC = "52:54:00:aa:bb:01"
PEER_MAC = bytes.fromhex("0200000000fe")
ETHERTYPE = 0x88B5  # IEEE "local experimental": nothing else on the tap uses it
TAP = "vmftest0"
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
RX_BUF = 2048
ACKED = VIRTIO_F_VERSION_1 | net.F_MAC


def _unshare_netns() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {err}")


class PrivateNet:
    """A network namespace of our own, entered by one worker thread: whatever the
    tests create through ``run`` (taps, sockets) lives there, and dies with it."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, initializer=_unshare_netns)

    def run(self, fn: Any, *args: Any) -> Any:
        return self.pool.submit(fn, *args).result(timeout=10)

    def close(self) -> None:
        self.pool.shutdown()


def _bring_up(name: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", name.encode(), 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", name.encode(), flags | IFF_UP))


def _open_wire(name: str) -> socket.socket:
    wire = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETHERTYPE))
    wire.bind((name, ETHERTYPE))
    wire.settimeout(5)
    return wire


def frame(payload: bytes, dst: bytes = b"\xff" * 6,
          src: bytes = net.parse_mac(GUEST_MAC)) -> bytes:
    return dst + src + struct.pack("!H", ETHERTYPE) + payload


def vnet_header(flags: int = 0, gso_type: int = 0, hdr_len: int = 0, gso_size: int = 0,
                csum_start: int = 0, csum_offset: int = 0) -> bytes:
    return struct.pack("<BBHHHHH", flags, gso_type, hdr_len, gso_size, csum_start,
                       csum_offset, 0)


def _eventfd() -> int:
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


class NetDevice:
    """A net device restored from ``plan`` by its native transport over ``memory``,
    on ``tap_fd`` (duplicated by the device; None: no tap), kicked by ioeventfds or by
    QueueNotify writes (``path``)."""

    def __init__(self, loop: EventLoop, memory: GuestMemory, plan: object,  # noqa: F811
                 tap_fd: int | None, path: str) -> None:
        self.memory = memory
        self.irq = _eventfd()
        self.kick_fds = [_eventfd(), _eventfd()] if path == "ioeventfd" else []
        self.dev, self.window = native_device(loop, memory, plan, self.irq,
                                              [*self.kick_fds] or [None, None], tap_fd=tap_fd)

    @property
    def counters(self) -> net.NetCounters:
        """Frames and bytes moved and dropped over the device's life."""
        return net.NetCounters(**dict(self.dev.net_counters()))

    def kick(self, index: int) -> None:
        """The driver notifies queue ``index``: the ioeventfd KVM would write, or a
        QueueNotify write."""
        if self.kick_fds:
            os.eventfd_write(self.kick_fds[index], 1)
        else:
            GuestDriver(self.window, self.memory).notify(index)

    def close(self) -> None:
        """Serve no more (idempotent): the device's duplicates closed, then ours."""
        if self.irq < 0:
            return
        self.dev.close()
        for fd in (self.irq, *self.kick_fds):
            os.close(fd)
        self.irq = -1


class NetEnv:
    """A virtio-net device on a tap in ``netns``, the guest half, and the wire."""

    def __init__(self, loop: EventLoop, netns: PrivateNet, *,  # noqa: F811
                 tap: bool = True, features: int = ACKED, path: str = "ioeventfd",
                 queue_size: int = 64) -> None:
        self.loop = loop
        self.netns = netns
        self.path = path
        self.memory = GuestMemory.anonymous(MEM_SIZE)
        self.wire: socket.socket | None = None
        tap_fd = netns.run(net.open_tap, TAP) if tap else None
        try:
            if tap:
                netns.run(_bring_up, TAP)
                self.wire = netns.run(_open_wire, TAP)
            self.device = NetDevice(loop, self.memory, boot_plan("net", mac=GUEST_MAC),
                                    tap_fd, path)
        finally:
            if tap_fd is not None:
                os.close(tap_fd)
        self.dev = self.device.dev
        self.driver = GuestDriver(self.device.window, self.memory)
        status = self.driver.negotiate(features)
        assert status & STATUS_FEATURES_OK
        self.rx = self.driver.setup_queue(0, queue_size, RX_BUF)
        self.tx = self.driver.setup_queue(1, queue_size, RX_BUF)
        self.driver.driver_ok()
        assert self.dev.active

    @property
    def counters(self) -> net.NetCounters:
        return self.device.counters

    def kick(self, index: int) -> None:
        self.device.kick(index)

    def restored(self, plan: object, tap_fd: int | None) -> NetDevice:
        """A device restored from ``plan`` over this guest memory (a snapshot's clone),
        kicked as this one is."""
        return NetDevice(self.loop, self.memory, plan, tap_fd, self.path)

    def close(self) -> None:
        self.driver.w(mmio.REG_STATUS, 0)   # the device stops touching guest memory
        self.device.close()
        run_on_loop(self.loop, lambda: None)
        if self.wire is not None:
            self.wire.close()
        self.memory.close()

    @property
    def needs_reset(self) -> bool:
        return bool(self.driver.status & STATUS_DEVICE_NEEDS_RESET)

    def send(self, payload: bytes, header: bytes = vnet_header()) -> None:
        """The guest transmits one frame (header and frame in separate buffers, as Linux)."""
        self.tx.post([header, frame(payload)])
        self.kick(1)

    def post_rx(self, n: int) -> None:
        for _ in range(n):
            self.rx.post(writable=[net.VNET_HDR_SIZE, RX_BUF])
        self.kick(0)

    def received(self, want: int, timeout: float = 5.0) -> list[bytes]:
        """``want`` frames of our ethertype that reached the guest, header checked."""
        out: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(out) < want:
            assert time.monotonic() < deadline, f"guest received {len(out)} of {want} frames"
            for _, written, data in self.rx.take_used():
                assert written == len(data) >= net.VNET_HDR_SIZE
                header, body = data[:net.VNET_HDR_SIZE], data[net.VNET_HDR_SIZE:]
                assert struct.unpack_from("<H", header, net.NUM_BUFFERS_OFFSET)[0] == 1
                if struct.unpack_from("!H", body, 12)[0] == ETHERTYPE:
                    out.append(body)
            time.sleep(0.002)
        return out


@pytest.fixture(params=["ioeventfd", "notify"])
def frame_path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def netns() -> Iterator[PrivateNet]:
    ns = PrivateNet()
    yield ns
    ns.close()


@pytest.fixture
def env(loop: EventLoop, netns: PrivateNet, frame_path: str) -> Iterator[NetEnv]:  # noqa: F811
    e = NetEnv(loop, netns, path=frame_path)
    yield e
    e.close()


def test_mac_text_is_validated() -> None:
    assert net.parse_mac("52:54:00:AA:bb:01") == bytes.fromhex("525400aabb01")
    assert net.format_mac(bytes.fromhex("525400aabb01")) == "52:54:00:aa:bb:01"
    for bad in ("52:54:00:aa:bb", "01:00:5e:00:00:01", "00:00:00:00:00:00", "zz:54:00:aa:bb:01"):
        with pytest.raises(ValueError):
            net.parse_mac(bad)


def test_tap_names_are_validated() -> None:
    for bad in ("", "a" * 16, "../tun", "tap 0"):
        with pytest.raises(ValueError):
            net.open_tap(bad)


def test_config_space_holds_the_mac_and_link_up(env: NetEnv) -> None:
    window = env.device.window
    assert window.read(0x100, 4) + window.read(0x104, 2) == net.parse_mac(GUEST_MAC)
    assert window.read(0x106, 2) == b"\1\0"
    env.driver.w(mmio.REG_DEVICE_FEATURES_SEL, 0)
    assert env.driver.r(mmio.REG_DEVICE_FEATURES) & net.F_MAC


def test_guest_frames_reach_the_tap(env: NetEnv) -> None:
    assert env.wire is not None
    for i in range(3):
        env.send(b"hello %d" % i)
        data = env.wire.recv(4096)
        assert data == frame(b"hello %d" % i)
    wait_until(lambda: env.counters.tx_frames == 3, what="tx counters")
    assert len(env.tx.take_used()) == 3


def test_tap_frames_reach_the_guest(env: NetEnv) -> None:
    assert env.wire is not None
    env.post_rx(8)
    sent = [frame(bytes([i]) * (100 + i), dst=net.parse_mac(GUEST_MAC), src=PEER_MAC)
            for i in range(5)]
    for f in sent:
        env.wire.send(f)
    assert env.received(5) == sent


def test_frames_wait_for_rx_buffers(env: NetEnv) -> None:
    assert env.wire is not None
    sent = [frame(b"early %d" % i, src=PEER_MAC) for i in range(4)]
    for f in sent:
        env.wire.send(f)
    time.sleep(0.2)  # the tap is readable, there is no rx buffer: nothing may spin or drop
    assert env.rx.take_used() == []
    env.post_rx(2)
    env.post_rx(6)  # spare buffers: the host kernel sends the tap frames of its own (IPv6)
    assert env.received(4) == sent
    assert env.counters.rx_dropped == 0


def test_frame_larger_than_the_chain_is_dropped_not_truncated(env: NetEnv) -> None:
    assert env.wire is not None
    env.wire.send(frame(b"x" * 1400, src=PEER_MAC))
    env.wire.send(frame(b"small", src=PEER_MAC))
    env.rx.post(writable=[net.VNET_HDR_SIZE, 200])
    env.rx.post(writable=[net.VNET_HDR_SIZE, 200])
    env.kick(0)
    assert env.received(1) == [frame(b"small", src=PEER_MAC)]
    # The wake adds its counters after its pass wrote the used entries.
    wait_until(lambda: env.counters.rx_dropped == 1, what="drop counted")
    assert not env.needs_reset


@pytest.mark.parametrize("length", [0, net.VNET_HDR_SIZE, net.MAX_TX_BYTES + 1])
def test_malformed_tx_sizes_are_dropped(env: NetEnv, length: int) -> None:
    parts = [b"\0" * min(length, RX_BUF) for _ in range((length + RX_BUF - 1) // RX_BUF)]
    env.tx.post(parts or [b""])
    env.kick(1)
    wait_until(lambda: env.counters.tx_dropped == 1, what="drop counted")
    assert not env.needs_reset and len(env.tx.take_used()) == 1


def test_a_header_the_host_kernel_refuses_drops_the_frame(env: NetEnv) -> None:
    # gso_type 0x7f is no GSO type the kernel knows: the tap write fails (EINVAL).
    env.send(b"bad gso", header=vnet_header(gso_type=0x7F, gso_size=100))
    wait_until(lambda: env.counters.tx_dropped == 1, what="drop counted")
    env.send(b"good")
    assert env.wire is not None and env.wire.recv(4096) == frame(b"good")
    assert not env.needs_reset


def test_rx_chain_shorter_than_the_header_needs_reset(env: NetEnv) -> None:
    assert env.wire is not None
    env.wire.send(frame(b"x", src=PEER_MAC))
    env.rx.post(writable=[4])
    env.kick(0)
    wait_until(lambda: env.needs_reset, what="DEVICE_NEEDS_RESET")


def test_descriptor_loop_in_tx_needs_reset(env: NetEnv) -> None:
    head = env.tx.post([b"a", b"b"])
    second = env.tx.chains[head][1][0]
    env.memory.write_u16(env.tx.desc + 16 * second + 12, 1)       # NEXT
    env.memory.write_u16(env.tx.desc + 16 * second + 14, head)    # ... back to the head
    env.kick(1)
    wait_until(lambda: env.needs_reset, what="DEVICE_NEEDS_RESET")


def test_without_a_tap_tx_is_dropped_and_nothing_arrives(loop: EventLoop,  # noqa: F811
                                                         netns: PrivateNet,
                                                         frame_path: str) -> None:
    env = NetEnv(loop, netns, tap=False, path=frame_path)
    try:
        env.post_rx(2)
        env.send(b"into the void")
        wait_until(lambda: env.counters.tx_dropped == 1, what="drop counted")
        assert env.rx.take_used() == [] and not env.needs_reset
    finally:
        env.close()


def test_state_round_trip_restores_a_working_device(env: NetEnv, netns: PrivateNet) -> None:
    assert env.wire is not None
    env.post_rx(4)
    env.send(b"before the snapshot")
    assert env.wire.recv(4096) == frame(b"before the snapshot")
    wait_until(lambda: env.tx.used_idx() == 1, what="the tx chain used")
    saved = plan_state(env.dev.plan(), 2, 7)
    state = stateformat.decode_state(stateformat.encode_state(saved), DeviceState)
    assert state == saved and isinstance(state.state, net.NetState)
    assert state.transport is not None
    assert state.state.mac == GUEST_MAC and state.state.acked_features == ACKED
    # The indices the device advanced (the native server's own, while it serves; the
    # host kernel may have sent the tap frames of its own, IPv6's, into rx buffers).
    rx, tx = state.transport.queues
    assert (tx.next_avail, tx.next_used) == (1, 1)
    assert rx.next_avail == rx.next_used == env.rx.used_idx()

    # The parent goes; a clone on the same tap is restored from the state.
    env.device.close()
    tap_fd = netns.run(net.open_tap, TAP)  # the test's tap was transient: a new one
    netns.run(_bring_up, TAP)
    env.wire.close()
    env.wire = netns.run(_open_wire, TAP)
    try:
        clone = env.restored(device_plan(state), tap_fd)
    finally:
        os.close(tap_fd)
    try:
        assert clone.window.read(0x100, 4) + clone.window.read(0x104, 2) == \
            net.parse_mac(GUEST_MAC), "the MAC comes from the snapshot"
        assert clone.dev.active and not clone.dev.acked_features & net.F_EVENT_IDX
        sent = frame(b"after restore", src=PEER_MAC)
        env.wire.send(sent)
        assert env.received(1) == [sent], "rx buffers posted before the snapshot are used"
        env.tx.post([vnet_header(), frame(b"from the clone")])
        clone.kick(1)
        assert env.wire.recv(4096) == frame(b"from the clone")
        wait_until(lambda: clone.counters.tx_frames == 1 and clone.counters.rx_frames >= 1,
                   what="the clone's counters")
    finally:
        clone.close()


def _no_ipv6() -> None:
    """The namespace's new interfaces without IPv6: the host kernel then sends the tap
    no frames of its own (router solicitations), which would take rx buffers and raise
    interrupts at moments of its choosing."""
    with open("/proc/sys/net/ipv6/conf/default/disable_ipv6", "w") as f:
        f.write("1")


def test_a_full_ring_spends_the_budget_and_every_frame_moves(
        loop: EventLoop, netns: PrivateNet, frame_path: str) -> None:  # noqa: F811
    """A whole ring each way after one notification: the tx run spends a wake's budget
    (``MAX_FRAMES_PER_RUN``, the ring's size) and re-arms, rx fills every buffer while
    the tap is readable; every frame arrives, counted, and the indices a BRANCH reads
    have moved on by the ring."""
    n = net.MAX_FRAMES_PER_RUN
    netns.run(_no_ipv6)
    env = NetEnv(loop, netns, path=frame_path, queue_size=n)
    try:
        assert env.wire is not None
        for i in range(n):   # one descriptor a chain: the ring holds n of them
            env.tx.post([vnet_header() + frame(b"out %d" % i)])
        env.kick(1)
        assert [env.wire.recv(4096) for _ in range(n)] == [frame(b"out %d" % i)
                                                           for i in range(n)]
        wait_until(lambda: env.tx.used_idx() == n, what="every tx chain used")
        sent = [frame(b"in %d" % i, src=PEER_MAC) for i in range(n)]
        for f in sent:
            env.wire.send(f)
        for _ in range(n):
            env.rx.post(writable=[RX_BUF])
        env.kick(0)
        assert env.received(n, timeout=20) == sent
        c = env.counters
        assert (c.tx_frames, c.rx_frames, c.tx_dropped, c.rx_dropped) == (n, n, 0, 0)
        state = plan_state(env.dev.plan(), 2, 7).transport   # a BRANCH sees the indices
        assert state is not None
        assert [(q.next_avail, q.next_used) for q in state.queues] == [(n, n), (n, n)]
    finally:
        env.close()


def test_every_interrupt_is_counted(loop: EventLoop, netns: PrivateNet,  # noqa: F811
                                    frame_path: str) -> None:
    """The device's interrupt count (exit_profile's "irqs", through the machine's line)
    is what was written to the irqfd."""
    netns.run(_no_ipv6)
    env = NetEnv(loop, netns, path=frame_path)
    try:
        assert env.wire is not None
        env.post_rx(3)
        for i in range(3):
            env.send(b"out %d" % i)
            assert env.wire.recv(4096) == frame(b"out %d" % i)
            env.wire.send(frame(b"in %d" % i, src=PEER_MAC))
            assert len(env.received(1)) == 1
        wait_until(lambda: env.tx.used_idx() == 3, what="every tx chain used")
        run_on_loop(loop, lambda: None)
        written = os.eventfd_read(env.device.irq)
        assert written >= 2 and env.dev.interrupts == written
    finally:
        env.close()


def test_event_idx_moderates_interrupts_and_kicks_and_is_restored(
        loop: EventLoop, netns: PrivateNet, frame_path: str) -> None:  # noqa: F811
    """With VIRTIO_RING_F_EVENT_IDX acked, a batch interrupts only when it moves the used
    index across the driver's ``used_event``, a ring found empty asks for the next kick
    (``avail_event``), and a snapshot restores the device with the feature in use."""
    netns.run(_no_ipv6)
    env = NetEnv(loop, netns, features=ACKED | net.F_EVENT_IDX, path=frame_path)
    tx_avail_event = env.tx.used + 4 + 8 * env.tx.size
    try:
        assert env.wire is not None
        env.memory.write_u16(env.tx.avail + 4 + 2 * env.tx.size, 2)   # after the third
        env.memory.write_u16(env.rx.avail + 4 + 2 * env.rx.size, 0x8000)   # rx: none
        counts = []
        for i in range(4):
            env.send(b"out %d" % i)
            assert env.wire.recv(4096) == frame(b"out %d" % i)
            wait_until(lambda i=i: env.tx.used_idx() == i + 1, what="the tx chain used")
            run_on_loop(loop, lambda: None)   # the wake's interrupt decision is made
            counts.append(env.dev.interrupts)
            assert env.memory.read_u16(tx_avail_event) == i + 1, "the next kick asked for"
        assert counts == [0, 0, 1, 1]

        saved = plan_state(env.dev.plan(), 2, 7)
        assert saved.transport is not None
        assert saved.transport.driver_features & net.F_EVENT_IDX
        env.device.close()
        env.memory.write_u16(tx_avail_event, 0)
        clone = env.restored(device_plan(saved), None)
        try:
            assert clone.dev.active and clone.dev.acked_features & net.F_EVENT_IDX
            # The activation's catch-up found the tx ring empty and asked for a kick.
            wait_until(lambda: env.memory.read_u16(tx_avail_event) == 4,
                       what="the kick asked for again")
        finally:
            clone.close()
    finally:
        env.close()


def test_a_reset_after_a_guest_fault_serves_again(env: NetEnv) -> None:
    assert env.wire is not None
    early = frame(b"x", src=PEER_MAC)
    env.rx.post(writable=[4])   # shorter than the vnet header: the driver's bug
    env.kick(0)
    env.wire.send(early)
    wait_until(lambda: env.needs_reset, what="DEVICE_NEEDS_RESET")
    assert "writable bytes" in (env.dev.record()[3] or "")
    # The driver resets the device and starts it again.
    status = env.driver.negotiate(ACKED)
    assert status & STATUS_FEATURES_OK and not env.needs_reset
    env.rx = env.driver.setup_queue(0, 64, RX_BUF)
    env.tx = env.driver.setup_queue(1, 64, RX_BUF)
    env.driver.driver_ok()
    assert env.dev.active
    env.post_rx(8)
    sent = frame(b"after the reset", src=PEER_MAC)
    env.wire.send(sent)
    assert env.received(2) == [early, sent], "the frame waited in the tap"
    env.send(b"out after the reset")
    assert env.wire.recv(4096) == frame(b"out after the reset")


def test_native_net_serving_needs_no_gil(loop: EventLoop, netns: PrivateNet  # noqa: F811
                                         ) -> None:
    """The main thread keeps the GIL (a 30 s switch interval, spinning in Python, and the
    host's frame and the guest's kick made through ``ctypes.PyDLL``, which keeps it
    across the call) while the guest transmits and a frame comes in from the host: both
    are moved and the irqfd written."""
    import sys
    netns.run(_no_ipv6)
    env = NetEnv(loop, netns, path="ioeventfd")
    libc = ctypes.PyDLL(None, use_errno=True)
    try:
        assert env.wire is not None
        env.post_rx(2)
        run_on_loop(loop, lambda: None)   # the rx notification was served
        env.tx.post([vnet_header(), frame(b"out while the GIL is held")])
        incoming = frame(b"in while the GIL is held", src=PEER_MAC)
        one = ctypes.c_uint64(1)
        old = sys.getswitchinterval()
        sys.setswitchinterval(30.0)   # no other Python thread runs for 30 s
        try:
            sent = libc.send(env.wire.fileno(), incoming, len(incoming), 0)
            kicked = libc.write(env.device.kick_fds[1], ctypes.byref(one), 8)
            t0 = time.monotonic()
            while ((env.tx.used_idx(), env.rx.used_idx()) != (1, 1)
                   and time.monotonic() - t0 < 5.0):
                pass
            served_in = time.monotonic() - t0
            moved = (env.tx.used_idx(), env.rx.used_idx())
        finally:
            sys.setswitchinterval(old)
        assert (sent, kicked) == (len(incoming), 8), ctypes.get_errno()
        assert moved == (1, 1) and served_in < 5, (moved, served_in)
        assert os.eventfd_read(env.device.irq) >= 1
        assert env.wire.recv(4096) == frame(b"out while the GIL is held")
        assert env.received(1) == [incoming]
    finally:
        env.close()


def test_a_closed_net_device_holds_no_fds(loop: EventLoop, netns: PrivateNet,  # noqa: F811
                                          frame_path: str) -> None:
    """A machine's close runs the device's close: after it, with the device itself still
    referenced, no fd it made is open (its transport's and its server's duplicates of
    the tap, the irqfd and the ioeventfds)."""
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))
    netns.run(_no_ipv6)
    before = fds()
    env = NetEnv(loop, netns, path=frame_path)
    assert env.wire is not None
    env.post_rx(2)
    env.send(b"out")
    assert env.wire.recv(4096) == frame(b"out")
    sent = frame(b"in", src=PEER_MAC)
    env.wire.send(sent)
    assert env.received(1) == [sent]
    dev = env.dev
    env.close()
    assert not dev.active
    assert fds() == before
