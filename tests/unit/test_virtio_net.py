"""virtio-net end to end: a simulated guest driver on one side, a real tap device
in a private network namespace on the other (an AF_PACKET socket on the tap
plays the host's network), a real I/O thread in between.

Every test that moves frames runs both ways into the device's one frame path
(``native/src/net.rs``): served natively on the loop without the GIL
(``native/src/net_serve.rs``, the default: the queues' ioeventfds are written as KVM
writes them, and the device's Python wake is made unreachable), and the wake entered
from Python on the loop (``native_serve=False``, where a transport cannot hand the
queues over). ``test_virtio_net_native.py`` holds the two wakes to each other."""

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
from test_virtio_harness import MEM_SIZE, GuestDriver, loop, memory, wait_until  # noqa: F401

from vmfork.ondisk import stateformat
from vmfork.vmm.devices.manager import DeviceState
from vmfork.vmm.devices.virtio import mmio, net
from vmfork.vmm.devices.virtio.device import (
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
    run_on_loop,
)
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.irq import IrqLine
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


class NetEnv:
    """A virtio-net device on a tap in ``netns``, the guest half, and the wire."""

    def __init__(self, loop: EventLoop, netns: PrivateNet, *,  # noqa: F811
                 tap: bool = True, features: int = ACKED, path: str = "native",
                 ioeventfds: bool | None = None) -> None:
        self.loop = loop
        self.netns = netns
        self.path = path
        self.memory = GuestMemory.anonymous(MEM_SIZE)
        self.irq = IrqLine(gsi=7)
        tap_fd = netns.run(net.open_tap, TAP) if tap else None
        self.wire: socket.socket | None = None
        if tap:
            netns.run(_bring_up, TAP)
            self.wire = netns.run(_open_wire, TAP)
        self.dev = net.VirtioNet(loop, net.parse_mac(GUEST_MAC), tap_fd,
                                 native_serve=path == "served")
        if path == "served":   # nothing of the device's runs in Python
            for name in ("_transmit", "_receive", "_start_reading"):
                setattr(self.dev, name, python_path_taken)
        # The queues' ioeventfds (served: always), which the test writes as KVM does on
        # the guest's QueueNotify write (so the native loop, not Python, gets it).
        self.kick_fds: list[int] = []
        if ioeventfds is None:
            ioeventfds = path == "served"
        self.transport = mmio.MmioTransport(
            self.dev, self.memory, self.irq, loop,
            register_ioeventfd=((lambda off, dm, fd: self.kick_fds.append(fd))
                                if ioeventfds else None))
        self.driver = GuestDriver(self.transport, self.memory)
        status = self.driver.negotiate(features)
        assert status & STATUS_FEATURES_OK
        self.rx = self.driver.setup_queue(0, 64, RX_BUF)
        self.tx = self.driver.setup_queue(1, 64, RX_BUF)
        self.driver.driver_ok()
        run_on_loop(loop, lambda: None)  # activation has run
        assert self.dev.serving_natively == (path == "served")

    def kick(self, index: int) -> None:
        """The driver notifies queue ``index``."""
        if self.kick_fds:
            os.eventfd_write(self.kick_fds[index], 1)
        else:
            self.driver.notify(index)

    def close(self) -> None:
        self.transport.reset()
        self.transport.close()
        self.dev.close()
        run_on_loop(self.loop, lambda: None)
        if self.wire is not None:
            self.wire.close()
        self.irq.close()
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


def python_path_taken(*_: object) -> int:
    raise AssertionError("the device served natively woke in Python")


@pytest.fixture(params=["native", "served"])
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


def test_offloads_follow_the_features_the_guest_accepted() -> None:
    assert net.tap_offloads(0) == 0
    assert net.tap_offloads(net.F_GUEST_TSO4) == 0, "TSO without checksum offload is invalid"
    everything = net.F_GUEST_CSUM | net.F_GUEST_TSO4 | net.F_GUEST_TSO6 | net.F_GUEST_ECN
    assert net.tap_offloads(everything) == (net.TUN_F_CSUM | net.TUN_F_TSO4 | net.TUN_F_TSO6
                                            | net.TUN_F_TSO_ECN)


def test_config_space_holds_the_mac_and_link_up(env: NetEnv) -> None:
    assert env.transport.read(0x100, 4) + env.transport.read(0x104, 2) == \
        net.parse_mac(GUEST_MAC)
    assert env.transport.read(0x106, 2) == b"\1\0"
    env.driver.w(mmio.REG_DEVICE_FEATURES_SEL, 0)
    assert env.driver.r(mmio.REG_DEVICE_FEATURES) & net.F_MAC


def test_guest_frames_reach_the_tap(env: NetEnv) -> None:
    assert env.wire is not None
    for i in range(3):
        env.send(b"hello %d" % i)
        data = env.wire.recv(4096)
        assert data == frame(b"hello %d" % i)
    wait_until(lambda: env.dev.counters.tx_frames == 3, what="tx counters")
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
    assert env.dev.counters.rx_dropped == 0


def test_frame_larger_than_the_chain_is_dropped_not_truncated(env: NetEnv) -> None:
    assert env.wire is not None
    env.wire.send(frame(b"x" * 1400, src=PEER_MAC))
    env.wire.send(frame(b"small", src=PEER_MAC))
    env.rx.post(writable=[net.VNET_HDR_SIZE, 200])
    env.rx.post(writable=[net.VNET_HDR_SIZE, 200])
    env.kick(0)
    assert env.received(1) == [frame(b"small", src=PEER_MAC)]
    # The served wake adds its counters after its pass wrote the used entries.
    wait_until(lambda: env.dev.counters.rx_dropped == 1, what="drop counted")
    assert not env.needs_reset


@pytest.mark.parametrize("length", [0, net.VNET_HDR_SIZE, net.MAX_TX_BYTES + 1])
def test_malformed_tx_sizes_are_dropped(env: NetEnv, length: int) -> None:
    parts = [b"\0" * min(length, RX_BUF) for _ in range((length + RX_BUF - 1) // RX_BUF)]
    env.tx.post(parts or [b""])
    env.kick(1)
    wait_until(lambda: env.dev.counters.tx_dropped == 1, what="drop counted")
    assert not env.needs_reset and len(env.tx.take_used()) == 1


def test_a_header_the_host_kernel_refuses_drops_the_frame(env: NetEnv) -> None:
    # gso_type 0x7f is no GSO type the kernel knows: the tap write fails (EINVAL).
    env.send(b"bad gso", header=vnet_header(gso_type=0x7F, gso_size=100))
    wait_until(lambda: env.dev.counters.tx_dropped == 1, what="drop counted")
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
        wait_until(lambda: env.dev.counters.tx_dropped == 1, what="drop counted")
        assert env.rx.take_used() == [] and not env.needs_reset
    finally:
        env.close()


def test_state_round_trip_restores_a_working_device(env: NetEnv, loop: EventLoop,  # noqa: F811
                                                    netns: PrivateNet) -> None:
    assert env.wire is not None
    env.post_rx(4)
    env.send(b"before the snapshot")
    assert env.wire.recv(4096) == frame(b"before the snapshot")
    wait_until(lambda: env.tx.used_idx() == 1, what="the tx chain used")
    saved = run_on_loop(loop, lambda: DeviceState("net", 1, 2, 7, env.dev.save(),
                                                  env.transport.save()))
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
    env.transport.reset()
    env.dev.close()
    run_on_loop(loop, lambda: None)
    tap_fd = netns.run(net.open_tap, TAP)  # the test's tap was transient: a new one
    netns.run(_bring_up, TAP)
    env.wire.close()
    env.wire = netns.run(_open_wire, TAP)
    served = env.path == "served"
    clone = net.VirtioNet(loop, net.parse_mac("52:54:00:00:00:99"), tap_fd, native_serve=served)
    clone.restore(state.state)
    kicks: list[int] = []
    transport = mmio.MmioTransport(clone, env.memory, env.irq, loop, register_ioeventfd=(
        (lambda off, dm, fd: kicks.append(fd)) if served else None))
    transport.restore(state.transport)
    run_on_loop(loop, lambda: None)
    try:
        assert clone.mac == net.parse_mac(GUEST_MAC), "the MAC comes from the snapshot"
        assert clone.serving_natively == served
        assert not any(q.event_idx for q in clone.queues), "not acked, not used"
        sent = frame(b"after restore", src=PEER_MAC)
        env.wire.send(sent)
        assert env.received(1) == [sent], "rx buffers posted before the snapshot are used"
        env.tx.post([vnet_header(), frame(b"from the clone")])
        if served:
            os.eventfd_write(kicks[1], 1)
        else:
            GuestDriver(transport, env.memory).notify(1)
        assert env.wire.recv(4096) == frame(b"from the clone")
        wait_until(lambda: clone.counters.tx_frames == 1 and clone.counters.rx_frames >= 1,
                   what="the clone's counters")
    finally:
        transport.reset()
        transport.close()
        clone.close()
        run_on_loop(loop, lambda: None)


def _no_ipv6() -> None:
    """The namespace's new interfaces without IPv6: the host kernel then sends the tap
    no frames of its own (router solicitations), which would take rx buffers and raise
    interrupts at moments of its choosing."""
    with open("/proc/sys/net/ipv6/conf/default/disable_ipv6", "w") as f:
        f.write("1")


def test_a_budget_spent_continues_on_later_turns(loop: EventLoop,  # noqa: F811
                                                  netns: PrivateNet, frame_path: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """More frames than a turn's budget, each way, after one notification: tx re-arms
    itself, rx comes back while the tap is still readable; every frame arrives."""
    monkeypatch.setattr(net, "MAX_FRAMES_PER_RUN", 4)   # before the server is made
    netns.run(_no_ipv6)
    env = NetEnv(loop, netns, path=frame_path)
    try:
        assert env.wire is not None
        for i in range(20):
            env.tx.post([vnet_header(), frame(b"out %d" % i)])
        env.kick(1)
        assert [env.wire.recv(4096) for _ in range(20)] == [frame(b"out %d" % i)
                                                             for i in range(20)]
        wait_until(lambda: env.tx.used_idx() == 20, what="every tx chain used")
        sent = [frame(b"in %d" % i, src=PEER_MAC) for i in range(20)]
        for f in sent:
            env.wire.send(f)
        for _ in range(20):
            env.rx.post(writable=[net.VNET_HDR_SIZE, RX_BUF])
        env.kick(0)
        assert env.received(20) == sent
        c = env.dev.counters
        assert (c.tx_frames, c.rx_frames, c.tx_dropped, c.rx_dropped) == (20, 20, 0, 0)
        state = run_on_loop(loop, env.transport.save)   # a BRANCH sees the indices
        assert [(q.next_avail, q.next_used) for q in state.queues] == [(20, 20), (20, 20)]
    finally:
        env.close()


def test_every_interrupt_is_counted(loop: EventLoop, netns: PrivateNet,  # noqa: F811
                                    frame_path: str) -> None:
    """The interrupt line's count (exit_profile's "irqs") is what was written to the
    irqfd, whether Python or the native server wrote it."""
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
        written = os.eventfd_read(env.irq.fd)
        assert written >= 2 and env.irq.count == written
    finally:
        env.close()


def test_event_idx_moderates_interrupts_and_kicks_and_is_restored(
        loop: EventLoop, netns: PrivateNet, frame_path: str) -> None:  # noqa: F811
    """With VIRTIO_RING_F_EVENT_IDX acked, a batch interrupts only when it moves the used
    index across the driver's ``used_event``, a ring found empty asks for the next kick
    (``avail_event``), and a snapshot restores the device with the feature in use."""
    netns.run(_no_ipv6)
    env = NetEnv(loop, netns, features=ACKED | net.F_EVENT_IDX, path=frame_path)
    served = frame_path == "served"
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
            counts.append(env.irq.count)
            assert env.memory.read_u16(tx_avail_event) == i + 1, "the next kick asked for"
        assert counts == [0, 0, 1, 1]

        saved = run_on_loop(loop, lambda: (env.dev.save(), env.transport.save()))
        assert saved[1].driver_features & net.F_EVENT_IDX
        env.transport.reset()
        run_on_loop(loop, lambda: None)
        env.memory.write_u16(tx_avail_event, 0)
        clone = net.VirtioNet(loop, net.parse_mac(GUEST_MAC), None, native_serve=served)
        clone.restore(saved[0])
        kicks: list[int] = []
        transport = mmio.MmioTransport(clone, env.memory, env.irq, loop, register_ioeventfd=(
            (lambda off, dm, fd: kicks.append(fd)) if served else None))
        transport.restore(saved[1])
        run_on_loop(loop, lambda: None)
        try:
            assert clone.serving_natively == served
            assert all(q.event_idx for q in clone.queues)
            # The activation's catch-up found the tx ring empty and asked for a kick.
            assert env.memory.read_u16(tx_avail_event) == 4
        finally:
            transport.reset()
            transport.close()
            clone.close()
            run_on_loop(loop, lambda: None)
    finally:
        env.close()


def test_a_reset_after_a_guest_fault_serves_again(env: NetEnv) -> None:
    assert env.wire is not None
    early = frame(b"x", src=PEER_MAC)
    env.rx.post(writable=[4])   # shorter than the vnet header: the driver's bug
    env.kick(0)
    env.wire.send(early)
    wait_until(lambda: env.needs_reset, what="DEVICE_NEEDS_RESET")
    assert "writable bytes" in (env.transport.last_device_error or "")
    # The driver resets the device and starts it again.
    status = env.driver.negotiate(ACKED)
    assert status & STATUS_FEATURES_OK and not env.needs_reset
    env.rx = env.driver.setup_queue(0, 64, RX_BUF)
    env.tx = env.driver.setup_queue(1, 64, RX_BUF)
    env.driver.driver_ok()
    run_on_loop(env.loop, lambda: None)
    assert env.dev.serving_natively == (env.path == "served")
    env.post_rx(8)
    sent = frame(b"after the reset", src=PEER_MAC)
    env.wire.send(sent)
    assert env.received(2) == [early, sent], "the frame waited in the tap"
    env.send(b"out after the reset")
    assert env.wire.recv(4096) == frame(b"out after the reset")


@pytest.mark.parametrize("path", ["served", "native"])
def test_native_net_serving_needs_no_gil(loop: EventLoop, netns: PrivateNet,  # noqa: F811
                                         path: str) -> None:
    """The main thread keeps the GIL (a 30 s switch interval, spinning in Python, and the
    host's frame and the guest's kick made through ``ctypes.PyDLL``, which keeps it
    across the call) while the guest transmits and a frame comes in from the host: served
    natively, both are moved and the irqfd written; the device in Python (the control,
    which shows that the GIL is really held throughout) moves nothing meanwhile."""
    import sys
    netns.run(_no_ipv6)
    env = NetEnv(loop, netns, path=path, ioeventfds=True)
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
            kicked = libc.write(env.kick_fds[1], ctypes.byref(one), 8)
            t0 = time.monotonic()
            limit = 5.0 if path == "served" else 1.0
            while ((env.tx.used_idx(), env.rx.used_idx()) != (1, 1)
                   and time.monotonic() - t0 < limit):
                pass
            served_in = time.monotonic() - t0
            moved = (env.tx.used_idx(), env.rx.used_idx())
        finally:
            sys.setswitchinterval(old)
        assert (sent, kicked) == (len(incoming), 8), ctypes.get_errno()
        if path == "served":
            assert moved == (1, 1) and served_in < 5, (moved, served_in)
            assert os.eventfd_read(env.irq.fd) >= 1
        else:
            assert moved == (0, 0), "the Python device ran while the GIL was held"
        assert env.wire.recv(4096) == frame(b"out while the GIL is held")
        assert env.received(1) == [incoming]
    finally:
        env.close()


def test_net_closed_after_its_transport_holds_no_fds(loop: EventLoop,  # noqa: F811
                                                    netns: PrivateNet) -> None:
    """A machine's close runs the transport's close, then the device's: after both, no
    fd of the device is open, with the device itself still referenced (the native server
    duplicates the tap, the irqfd and the tx ioeventfd, and holds the device through its
    report callback: a cycle only the device's close breaks at once)."""
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))
    netns.run(_no_ipv6)
    for path in ("served", "native"):
        env = NetEnv(loop, netns, path=path)
        assert env.wire is not None
        env.post_rx(2)
        env.send(b"out")
        assert env.wire.recv(4096) == frame(b"out")
        sent = frame(b"in", src=PEER_MAC)
        env.wire.send(sent)
        assert env.received(1) == [sent]
        env.wire.close()
        env.wire = None
        before_close = fds()
        dev = env.dev
        env.transport.close()
        dev.close()
        run_on_loop(loop, lambda: None)   # the device's close runs on the loop thread
        closed = before_close - fds()
        # The tap, its duplicate, the two ioeventfds (served only) and the server's
        # duplicates of the irqfd and the tx ioeventfd.
        assert len(closed) == (6 if path == "served" else 1), (path, closed)
        assert dev.tap_fd is None and not dev.serving_natively
        env.irq.close()
        env.memory.close()


def test_serving_changes_hands_with_the_indices(loop: EventLoop,  # noqa: F811
                                                netns: PrivateNet) -> None:
    """``set_native_serve`` on a running device (the benchmark's switch): from the
    native server to the Python device and back, frames keep flowing each way from the
    ring indices the other side left, and the counters add up."""
    netns.run(_no_ipv6)
    env = NetEnv(loop, netns, path="served")
    for name in ("_transmit", "_receive", "_start_reading"):   # allowed here
        delattr(env.dev, name)
    try:
        assert env.wire is not None
        env.post_rx(6)
        for k, served in enumerate([True, False, True]):
            run_on_loop(loop, lambda served=served: env.dev.set_native_serve(served))
            assert env.dev.serving_natively == served
            env.send(b"out %d" % k)
            assert env.wire.recv(4096) == frame(b"out %d" % k)
            sent = frame(b"in %d" % k, src=PEER_MAC)
            env.wire.send(sent)
            assert env.received(1) == [sent]
            wait_until(lambda k=k: env.tx.used_idx() == k + 1, what="the tx chain used")
        c = env.dev.counters
        assert (c.tx_frames, c.rx_frames) == (3, 3)
        state = run_on_loop(loop, env.transport.save)
        assert [(q.next_avail, q.next_used) for q in state.queues] == [(3, 3), (3, 3)]
    finally:
        env.close()
