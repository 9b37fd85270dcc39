"""virtio-net under random, mostly hostile rings: the device as every machine serves
it (its native transport, ``_core.NativeDevice``, with ``native/src/net_serve.rs``'s
wake and ``native/src/net.rs``'s frame paths, the one implementation) kept to its
contract.

A property: random, mostly hostile rx and tx rings (Linux-shaped chains
and arbitrary ones; buffers in the hole between the RAM regions, across a region's end,
over the rings; write-only descriptors where a frame is read and read-only ones where
one is written; rx chains too short for the vnet header; frames over the size limit or
no longer than the header; descriptor links, flags and lengths overwritten, loops
included; the avail index run ahead; with EVENT_IDX negotiated or not, the driver's
``used_event`` anywhere and moved between calls, the avail ring's flags any value) are
restored live into a device on a real fd, which a sequence of the driver's
notifications (QueueNotify writes, served on the writing thread, a wake each: the tx
queue, then the rx queue while the device watches the fd) and of frames the host side
sends in between drives. Whatever the input, the device keeps its contract: every tx
chain it completes was sent or counted dropped, every rx chain it completes holds one
counted frame, a guest fault is recorded and makes the device NEEDS_RESET, and it
writes guest memory only in device-writable buffers and the used rings.

The fd is real every time: a real tap in a private network namespace (an AF_PACKET
socket on it plays the host's network; the host kernel validates each vnet header),
an AF_UNIX datagram socket pair (a frame per datagram, as on a tap; with the least
send buffer, EAGAIN after a few), the write end of a pipe (writes go through, reads fail
with EBADF), a socket pair shut down (reads return 0, writes EPIPE), or no tap at all.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_virtio_harness import native_device
from test_virtio_net import ETHERTYPE, PrivateNet, _bring_up
from test_virtio_queue import HIGH, LOW, BufferLayout, CountingMemory

from vmfork.vmm.devices.virtio import mmio, net
from vmfork.vmm.devices.virtio.device import (
    STATUS_ACKNOWLEDGE,
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_DRIVER,
    STATUS_DRIVER_OK,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
)
from vmfork.vmm.devices.virtio.queue import (
    VIRTQ_DESC_F_INDIRECT,
    VIRTQ_DESC_F_NEXT,
    VIRTQ_DESC_F_WRITE,
)
from vmfork.vmm.eventloop import NativeEventLoop

QSIZE = 16
TAP = "vmfdiff0"
MAC = "52:54:00:12:34:56"
PACKET_OUTGOING = 4
SOL_PACKET, PACKET_QDISC_BYPASS = 263, 20   # <linux/socket.h>, <linux/if_packet.h>: a send
# reaches the tap before it returns
# Each queue's rings (16 entries: a 256-byte table, 38-byte avail, 134-byte used ring).
RINGS = {net.RX_QUEUE: (0x1000, 0x2000, 0x3000), net.TX_QUEUE: (0x1800, 0x2800, 0x3800)}

PLACES = ["low", "high"]
BAD_PLACES = ["hole", "cross", "rings", "past"]
FD_KINDS = ["tap"] * 3 + ["dgram"] * 3 + ["full"] * 2 + ["pipe", "shut", "none"]

part = st.tuples(st.booleans(), st.integers(0, 2600), st.sampled_from(PLACES))


@st.composite
def chain(draw: st.DrawFn, writable: bool) -> list[tuple[bool, int, str]]:
    """(writable, length, place) of each descriptor: Linux-shaped most of the time
    (tx: the vnet header and the frame; rx: the header and room for a frame), else
    arbitrary, sometimes with a buffer where none may be."""
    if draw(st.integers(0, 2)) < 2:
        sizes = st.one_of(st.sampled_from([0, 1, 2, 13, 20, 60, 1500, 1514]),
                          st.integers(0, 2600))
        header = draw(st.sampled_from([12] * 5 + [11, 4, 0, 24]))
        parts = [(writable, header, "low")] + [
            (writable, draw(sizes), draw(st.sampled_from(PLACES)))
            for _ in range(draw(st.integers(0 if writable else 1, 3)))]
    else:
        parts = draw(st.lists(part, min_size=1, max_size=5))
        if not draw(st.booleans()):   # readable first, as the queue demands
            parts.sort(key=lambda p: p[0])
    if draw(st.integers(0, 7)) == 7:
        k = draw(st.integers(0, len(parts) - 1))
        parts[k] = (parts[k][0], parts[k][1], draw(st.sampled_from(BAD_PLACES)))
    return parts


vnet_header = st.one_of(
    st.just(bytes(12)), st.just(bytes(12)), st.just(bytes(12)),
    # NEEDS_CSUM with offsets in or out of the frame; GSO types known and unknown.
    st.builds(lambda flags, gso, hdr_len, gso_size, start, off: struct.pack(
        "<BBHHHHH", flags, gso, hdr_len, gso_size, start, off, 0),
        st.sampled_from([0, 1, 2, 0xFF]), st.sampled_from([0, 1, 3, 4, 0x7F, 0x80]),
        st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.integers(0, 80),
        st.integers(0, 40)))


@st.composite
def host_frame(draw: st.DrawFn) -> bytes:
    """A frame the host side sends: for a datagram fd its bytes are the vnet header and
    the frame, for a tap only the frame (the tap adds the header); a tap needs an
    Ethernet header and at most the MTU, so those are cut to fit there."""
    # Lengths that exactly fill a Linux-shaped rx chain of the sizes ``chain`` draws,
    # with or without the vnet header the tap adds, and one byte either side.
    fits = [n + d for n in (13, 20, 32, 60, 72, 1500, 1512, 1514, 1526) for d in (0, 0, -1, 1)]
    length = draw(st.one_of(st.sampled_from([0, 1, 11, 12, 14] + fits),
                            st.integers(12, 1514), st.integers(0, 2600)))
    fill = draw(st.integers(0, 255))
    return bytes((fill + i) & 0xFF for i in range(length))


# The host's sends are followed by an rx turn mostly, as a readable tap is: "rx" and
# "rx_notify" are both the driver's rx notification here (a wake, which watches the fd
# again), as the loop that would find the fd readable never runs.
sends = st.tuples(st.just("send"), st.lists(host_frame(), min_size=1, max_size=6))
# The driver moving a queue's used_event (EVENT_IDX: where it wants its next interrupt).
moves = st.tuples(st.just("used_event"), st.sampled_from([net.RX_QUEUE, net.TX_QUEUE]),
                  st.one_of(st.integers(0, 20), st.integers(0, 0xFFFF)))
op = st.one_of(st.just([("tx",)]), st.just([("rx",)]), st.just([("rx_notify",)]),
               sends.map(lambda s: [s]), sends.map(lambda s: [s, ("rx",)]),
               sends.map(lambda s: [s, ("rx",)]), moves.map(lambda m: [m]))


def lay_out(mem: CountingMemory, layout: BufferLayout, index: int, spec: dict[str, Any]) -> None:
    """One queue's chains, the frames of tx chains in their readable buffers, the
    corruptions, the avail ring."""
    desc, avail, _ = RINGS[index]
    free, heads = 0, []
    for c, (header, payload) in zip(spec["chains"], spec["frames"]):
        if free + len(c) > QSIZE:
            break
        ids = list(range(free, free + len(c)))
        free += len(c)
        readable = header + payload
        for k, (i, (writable, length, where)) in enumerate(zip(ids, c)):
            addr = layout.place(where, length)
            if not writable and where in PLACES:
                chunk, readable = readable[:length], readable[length:]
                mem.write(addr, chunk)
            last = k == len(ids) - 1
            flags = (0 if last else VIRTQ_DESC_F_NEXT) | (VIRTQ_DESC_F_WRITE if writable else 0)
            mem.write(desc + 16 * i, struct.pack("<QIHH", addr, length, flags,
                                                 0 if last else ids[k + 1]))
        heads.append(ids[0])
    for i, field, value in spec["corruptions"]:
        at = desc + 16 * (i % QSIZE)
        if field == 0:     # next
            mem.write(at + 14, struct.pack("<H", value % (QSIZE + 2)))
        elif field == 1:   # flags, INDIRECT included
            mem.write(at + 12, struct.pack("<H", value & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE
                                                          | VIRTQ_DESC_F_INDIRECT)))
        else:              # length
            mem.write(at + 8, struct.pack("<I", value))
    for k, head in enumerate(heads):
        mem.write_u16(avail + 4 + 2 * k, head)
    mem.write_u16(avail + 2, len(heads) + spec["avail_jump"])
    mem.write_u16(avail, spec["avail_flags"])
    mem.write_u16(avail + 4 + 2 * QSIZE, spec["used_event"])


def _tap_host() -> tuple[int, socket.socket, socket.socket]:
    """In the test's namespace: a tap with nothing of the host kernel's own on it (no
    IPv6, no address), and two AF_PACKET sockets on it, to send frames into the tap and
    to capture what the device writes to it."""
    with open("/proc/sys/net/ipv6/conf/default/disable_ipv6", "w") as f:
        f.write("1")
    fd = net.open_tap(TAP)
    _bring_up(TAP)
    inject = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETHERTYPE))
    inject.bind((TAP, ETHERTYPE))
    inject.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
    capture = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
    capture.bind((TAP, 0))
    capture.setblocking(False)
    return fd, inject, capture


@pytest.fixture(scope="module")
def tap_host() -> Iterator[tuple[int, socket.socket, socket.socket]]:
    ns = PrivateNet()
    try:
        fd, inject, capture = ns.run(_tap_host)
    except OSError as err:
        ns.close()
        pytest.skip(f"no tap in a private network namespace here: {err}")
    yield fd, inject, capture
    inject.close()
    capture.close()
    os.close(fd)
    ns.close()


def _drain(fd: int) -> None:
    while select.select([fd], [], [], 0)[0]:
        try:
            os.read(fd, 1 << 17)
        except OSError:
            return


class HostSide:
    """The device's fd of one kind, and the host's end of it."""

    def __init__(self, kind: str, tap: tuple[int, socket.socket, socket.socket] | None) -> None:
        self.kind = kind
        self.closers: list[Any] = []
        self.device_fd: int | None = None
        self.peer: socket.socket | None = None
        self.pipe_read: int | None = None
        if kind in ("dgram", "full", "shut"):
            dev, self.peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            dev.setblocking(False)
            self.peer.setblocking(False)
            if kind == "full":   # the kernel's least send buffer: a few frames fill it
                dev.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
            if kind == "shut":
                dev.shutdown(socket.SHUT_RDWR)
            self.device_fd = dev.fileno()
            self.closers += [dev, self.peer]
        elif kind == "pipe":
            self.pipe_read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self.device_fd = write
            self.closers += [self.pipe_read, write]
        elif kind == "tap":
            assert tap is not None
            self.device_fd, self.inject, self.capture = tap
            _drain(self.device_fd)
            _drain(self.capture.fileno())

    def send(self, frame: bytes) -> str:
        """The host sends one frame to the device's fd; what became of the send."""
        try:
            if self.kind in ("dgram", "full", "shut"):
                assert self.peer is not None
                self.peer.send(frame)
            elif self.kind == "tap":
                eth = (frame + bytes(14))[:max(14, min(len(frame), 1514))]
                self.inject.send(eth)
            else:
                return "no peer"
        except OSError as err:
            return f"refused: {err.strerror}"
        return "sent"

    def received(self) -> list[bytes]:
        """What the device wrote since the last call, frame by frame (a pipe: the bytes)."""
        out = []
        if self.kind in ("dgram", "full", "shut"):
            assert self.peer is not None
            while True:
                try:
                    out.append(self.peer.recv(1 << 17))
                except BlockingIOError:
                    break
        elif self.kind == "pipe":
            assert self.pipe_read is not None
            while True:
                try:
                    data = os.read(self.pipe_read, 1 << 17)
                except BlockingIOError:
                    break
                out.append(data)
            out = [b"".join(out)] if out else []
        elif self.kind == "tap":
            while True:
                try:
                    data, addr = self.capture.recvfrom(1 << 17)
                except BlockingIOError:
                    break
                if addr[2] != PACKET_OUTGOING:   # the device's frames, not the injected ones
                    out.append(data)
        return out

    def close(self) -> None:
        for c in self.closers:
            if isinstance(c, int):
                os.close(c)
            else:
                c.close()


def net_plan(event_idx: bool) -> object:
    """A net device the driver runs: both queues ready at ``RINGS``, the features
    acked (EVENT_IDX or not), DRIVER_OK: restored, it serves at once."""
    offered = VIRTIO_F_VERSION_1 | net.OFFERED_FEATURES
    acked = offered if event_idx else offered & ~net.F_EVENT_IDX
    status = (STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK)
    registers = (status, 0, 0, acked, False, 0, 0, 0,
                 [(net.QUEUE_SIZE, QSIZE, True, *RINGS[index])
                  for index in (net.RX_QUEUE, net.TX_QUEUE)])
    return (("net", MAC), offered, [net.QUEUE_SIZE] * 2, registers, [(0, 0), (0, 0)])


def run_device(spec: dict[str, Any],
               tap: tuple[int, socket.socket, socket.socket] | None) -> dict[str, Any]:
    mem = CountingMemory()
    host = HostSide(spec["fd_kind"], tap)
    # Never started: every wake is a QueueNotify write, served on this thread.
    loop = NativeEventLoop("unused")
    irq = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        layout = BufferLayout(RINGS[net.TX_QUEUE][0])
        lay_out(mem, layout, net.RX_QUEUE, spec["rx"])
        lay_out(mem, layout, net.TX_QUEUE, spec["tx"])
        # The used rings (avail_event included), and used_event, which the test writes.
        may_write = [(used, 6 + 8 * QSIZE) for _, _, used in RINGS.values()]
        may_write += [(avail + 4 + 2 * QSIZE, 2) for _, avail, _ in RINGS.values()]
        for desc, _, _ in RINGS.values():
            for i in range(QSIZE):
                addr, length, flags, _ = struct.unpack("<QIHH", mem.read(desc + 16 * i, 16))
                if flags & VIRTQ_DESC_F_WRITE:
                    may_write.append((addr, length))
        ram_before = (mem.read(0, LOW.size), mem.read(HIGH.guest_phys, HIGH.size))
        dev, window = native_device(loop, mem, net_plan(spec["event_idx"]), irq,
                                    [None, None], tap_fd=host.device_fd)
        notify = {"tx": net.TX_QUEUE, "rx": net.RX_QUEUE, "rx_notify": net.RX_QUEUE}
        for step in spec["ops"]:
            if step[0] == "send":
                for sent in step[1]:
                    host.send(sent)
            elif step[0] == "used_event":
                mem.write_u16(RINGS[step[1]][1] + 4 + 2 * QSIZE, step[2])
            else:
                window.write(mmio.REG_QUEUE_NOTIFY, struct.pack("<I", notify[step[0]]))
        status = struct.unpack("<I", window.read(mmio.REG_STATUS, 4))[0]
        indices = dev.plan()[4]
        counters = dict(dev.net_counters())
        faults, _, _, last_fault = dev.record()
        dev.close()
    finally:
        host.close()
        loop.stop()
        os.close(irq)
    memory = (mem.read(0, LOW.size), mem.read(HIGH.guest_phys, HIGH.size))
    mem.close()
    return {"counters": counters, "memory": memory, "indices": indices,
            "needs_reset": bool(status & STATUS_DEVICE_NEEDS_RESET), "faults": faults,
            "last_fault": last_fault, "before": ram_before, "may_write": may_write}


def queue_spec(writable: bool) -> st.SearchStrategy[dict[str, Any]]:
    chains = st.lists(chain(writable), min_size=1, max_size=8)
    return chains.flatmap(lambda cs: st.fixed_dictionaries({
        "chains": st.just(cs),
        "frames": st.lists(st.tuples(vnet_header, host_frame()), min_size=len(cs),
                           max_size=len(cs)),
        "corruptions": st.one_of(st.just([]), st.just([]), st.just([]), st.lists(
            st.tuples(st.integers(0, QSIZE - 1), st.integers(0, 2),
                      st.integers(0, 0xFFFF_FFFF)), max_size=3)),
        "avail_jump": st.sampled_from([0] * 8 + [QSIZE + 1, -1]),
        "avail_flags": st.sampled_from([0, 0, 0, 1, 0xFFFF]),   # NO_INTERRUPT is bit 0
        "used_event": st.one_of(st.integers(0, 20), st.integers(0, 0xFFFF)),
    }))


@settings(max_examples=500, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(rx=queue_spec(True), tx=queue_spec(False),
       ops=st.lists(op, min_size=1, max_size=5).map(lambda ops: sum(ops, [])),
       fd_kind=st.sampled_from(FD_KINDS), event_idx=st.booleans())
def test_the_device_moves_frames_within_the_contract(
        tap_host: tuple[int, socket.socket, socket.socket], rx: dict[str, Any],
        tx: dict[str, Any], ops: list[Any], fd_kind: str, event_idx: bool) -> None:
    spec = {"rx": rx, "tx": tx, "ops": ops, "fd_kind": fd_kind, "event_idx": event_idx}
    got = run_device(spec, tap_host if fd_kind == "tap" else None)
    counters = got["counters"]
    for name, n in counters.items():
        if n:
            event(name)
    event(f"{fd_kind}: {'guest fault' if got['faults'] else 'no fault'}")
    # A guest fault is recorded, with its words, and the driver told.
    assert got["needs_reset"] == (got["faults"] > 0), got["last_fault"]
    # Each completed chain accounted for ...
    (_, rx_used), (_, tx_used) = got["indices"]
    assert tx_used == (counters["tx_frames"] + counters["tx_dropped"]) & 0xFFFF
    # (an empty datagram is counted as a frame, and fills no chain: no tap sends one)
    assert rx_used <= counters["rx_frames"]
    if fd_kind == "tap":
        assert rx_used == counters["rx_frames"] & 0xFFFF
    # ... and guest memory written only where the driver let the device write.
    for base, image, now in zip((0, HIGH.guest_phys), got["before"], got["memory"]):
        if now != image:
            stray = [base + k for k in range(len(image)) if now[k] != image[k]
                     and not any(lo <= base + k < lo + n for lo, n in got["may_write"])]
            assert not stray, f"the device wrote {stray[0]:#x}, in no writable buffer"


def test_the_native_path_syscalls_are_allowed_in_the_jail() -> None:
    """net.rs calls writev and readv; net_serve.rs also reads and writes eventfds,
    takes the tap in and out of the loop's epoll set and duplicates fds (fcntl
    F_DUPFD_CLOEXEC); a jailed VMM dies on any syscall its seccomp filter does not list."""
    from vmfork.runtime import seccomp
    assert {"writev", "readv", "read", "write", "epoll_ctl", "fcntl"} <= set(seccomp.VMM_ALLOWED)
