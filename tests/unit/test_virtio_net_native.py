"""virtio-net under random, mostly hostile rings: its one frame path
(``native/src/net.rs``) kept to its contract, and the device served natively
(``native/src/net_serve.rs``) held to the wake entered from Python (``net.py``), the two
implementations of a wake (which queue first, when to interrupt and re-arm, when to
watch the tap) that remain.

A property: random, mostly hostile rx and tx rings (Linux-shaped chains
and arbitrary ones; buffers in the hole between the RAM regions, across a region's end,
over the rings; write-only descriptors where a frame is read and read-only ones where
one is written; rx chains too short for the vnet header; frames over the size limit or
no longer than the header; descriptor links, flags and lengths overwritten, loops
included; the avail index run ahead; with EVENT_IDX negotiated or not, the driver's
``used_event`` anywhere and moved between calls, the avail ring's flags any value) are
driven through both wakes, each over its own
real guest memory and its own real fd, by the same sequence of device entries
and of frames the host side sends in between, as the loop would deliver them: a tx
notification, an rx notification, a readable tap (only while the device watches it).
The two: the wake entered from Python (``_transmit``, ``_start_reading``, ``_receive``),
and the native server (``_core.NetQueues``, driven through ``serve_ready`` for the fd the
loop would find readable: the queues' ioeventfds, the tap). Both must leave the same
guest memory (used rings, ``num_buffers``, frame bytes), the same frames on the host
side of the fd, the same counters, queue indices, interrupts, re-arms, reader state,
log lines and guest fault, call for call (``avail_event``, which the device writes, is
in the memory). And whatever the input, the device keeps its contract: every tx chain
it completes was sent or counted dropped, every rx chain it completes holds one
counted frame, and it writes guest memory only in device-writable buffers and the used
rings.

The fd is real every time: a real tap in a private network namespace (an AF_PACKET
socket on it plays the host's network; the host kernel validates each vnet header),
an AF_UNIX datagram socket pair (a frame per datagram, as on a tap; with the least
send buffer, EAGAIN after a few), the write end of a pipe (writes go through, reads fail
with EBADF), a socket pair shut down (reads return 0, writes EPIPE), or no tap at all.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_virtio_net import ETHERTYPE, PrivateNet, _bring_up
from test_virtio_queue import HIGH, LOW, BufferLayout, CountingMemory

from vmfork.vmm.devices.virtio import mmio, net
from vmfork.vmm.devices.virtio.device import VIRTIO_F_VERSION_1
from vmfork.vmm.devices.virtio.queue import (
    VIRTQ_DESC_F_INDIRECT,
    VIRTQ_DESC_F_NEXT,
    VIRTQ_DESC_F_WRITE,
    Virtqueue,
)
from vmfork.vmm.errors import GuestError
from vmfork.vmm.eventloop import Callback, EventLoop, NativeEventLoop

try:
    from vmfork import _core
except ImportError:
    pass

QSIZE = 16
TAP = "vmfdiff0"
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


# The host's sends are followed by an rx turn mostly, as a readable tap is. "rx" is the
# tap found readable (served only while the device watches it), "rx_notify" the
# driver's rx notification (which watches it again).
sends = st.tuples(st.just("send"), st.lists(host_frame(), min_size=1, max_size=6))
# The driver moving a queue's used_event (EVENT_IDX: where it wants its next interrupt).
moves = st.tuples(st.just("used_event"), st.sampled_from([net.RX_QUEUE, net.TX_QUEUE]),
                  st.one_of(st.integers(0, 20), st.integers(0, 0xFFFF)))
op = st.one_of(st.just([("tx",)]), st.just([("rx",)]), st.just([("rx_notify",)]),
               sends.map(lambda s: [s]), sends.map(lambda s: [s, ("rx",)]),
               sends.map(lambda s: [s, ("rx",)]), moves.map(lambda m: [m]))


def make_queue(mem: CountingMemory, index: int) -> Virtqueue:
    q = Virtqueue(net.QUEUE_SIZE)
    q.size = QSIZE
    q.desc_table, q.avail_ring, q.used_ring = RINGS[index]
    q.ready = True
    q.validate(mem)
    return q


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


class QueuedWork(EventLoop):
    """A loop that never runs, for the wake entered from Python: it keeps what the
    device hands it (a tx run's re-arm is a ``call_soon``), so a step counts its
    re-arms, and the tap's reader, which a step then serves by hand."""

    def __init__(self) -> None:
        super().__init__("unused")
        self.pending: list[Callback] = []
        self.readers: dict[int, Callback] = {}

    def add_reader(self, fd: int, callback: Callback) -> None:
        self.readers[fd] = callback

    def remove_reader(self, fd: int) -> None:
        self.readers.pop(fd, None)

    def call_soon(self, callback: Callback) -> None:
        self.pending.append(callback)

    def call_later(self, delay: float, callback: Callback) -> None:
        self.pending.append(callback)

    def in_loop_thread(self) -> bool:
        return False

    def stop(self) -> None:
        pass


class Line:
    """The interrupt line as the transport gives it, counting used-buffer signals."""

    failed = False

    def __init__(self) -> None:
        self.triggered = 0

    def trigger(self) -> None:
        self.triggered += 1


class ServedLine(Line):
    """The transport's side for the native server: a running register file, the irqfd,
    the queues' ioeventfds on a native loop (never started: ``serve_ready`` is called for
    the fd it would find readable), and the guest fault ``device_error`` reports."""

    def __init__(self, loop: NativeEventLoop, queues: list[Virtqueue]) -> None:
        super().__init__()
        self.loop = loop
        features = VIRTIO_F_VERSION_1 | net.OFFERED_FEATURES
        self.registers = _core.MmioRegisters(net.DEVICE_ID_NET, features,
                                             [net.QUEUE_SIZE, net.QUEUE_SIZE])
        self.epoch, live = self.registers.restore((
            0x0F, 0, 0, features, False, 0, 0, 0,
            [(net.QUEUE_SIZE, q.size, True, q.desc_table, q.avail_ring, q.used_ring)
             for q in queues]))
        assert live
        self.irq_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.kicks = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in queues]
        self.fault: GuestError | None = None

    def native_queue(self, index: int) -> mmio.NativeQueue:
        fd = self.kicks[index]

        def attach(handler: _core.RngQueue | _core.NetQueues,
                   count_interrupts: bool = True) -> None:
            self.loop.add_native_reader(fd, handler)

        return mmio.NativeQueue(self.registers, self.epoch, self.irq_fd, fd, attach,
                                lambda: self.loop.remove_reader(fd))

    def device_error(self, err: GuestError) -> None:
        self.fault = err

    def kick(self, server: _core.NetQueues, index: int) -> int:
        """The driver notifies queue ``index``, the loop serves it; the tx re-arms."""
        os.eventfd_write(self.kicks[index], 1)
        server.serve_ready(self.kicks[index])
        return self.rearmed()

    def rearmed(self) -> int:
        """Whether the last wake re-armed the tx queue (wrote its ioeventfd)."""
        try:
            return int(os.eventfd_read(self.kicks[net.TX_QUEUE]) > 0)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        for fd in (self.irq_fd, *self.kicks):
            os.close(fd)


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


def run_path(backend: str, spec: dict[str, Any],
             tap: tuple[int, socket.socket, socket.socket] | None) -> dict[str, Any]:
    mem = CountingMemory()
    mem.budget = 200_000
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    net.log.addHandler(handler)
    level = net.log.level
    net.log.setLevel(logging.DEBUG)
    host = HostSide(spec["fd_kind"], tap)
    loop: EventLoop = NativeEventLoop("unused") if backend == "served" else QueuedWork()
    served: ServedLine | None = None
    try:
        dev = net.VirtioNet(loop, net.parse_mac("52:54:00:12:34:56"), host.device_fd,
                            native_serve=backend == "served")
        queues = [make_queue(mem, net.RX_QUEUE), make_queue(mem, net.TX_QUEUE)]
        for q in queues:   # as activate does from the acked features
            q.event_idx = spec["event_idx"]
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
        line = Line()
        if backend == "served":
            assert isinstance(loop, NativeEventLoop)
            line = served = ServedLine(loop, queues)
        dev.memory, dev.queues, dev.interrupt = mem, queues, line  # type: ignore[assignment]
        if served is not None:
            dev._start_server()   # as activate does
            server = dev._server
            assert server is not None
        elif host.device_fd is not None:   # watched, as after the driver's first rx notify
            loop.add_reader(host.device_fd, lambda: None)
            dev._reading = True
        steps: list[Any] = []
        for step in spec["ops"]:
            if step[0] == "send":
                steps.append([host.send(f) for f in step[1]])
                continue
            if step[0] == "used_event":
                mem.write_u16(RINGS[step[1]][1] + 4 + 2 * QSIZE, step[2])
                continue
            if served is not None:
                before = server.interrupts
                rearmed = 0
                if step[0] == "tx":
                    rearmed = served.kick(server, net.TX_QUEUE)
                elif step[0] == "rx_notify":
                    rearmed = served.kick(server, net.RX_QUEUE)
                elif server.tap_fd is not None and server.watched:
                    server.serve_ready(server.tap_fd)
                    rearmed = served.rearmed()
                if served.fault is not None:
                    steps.append((type(served.fault).__name__, str(served.fault)))
                    break
                steps.append((step[0], server.interrupts - before, rearmed,
                               server.watched and server.tap_fd is not None, host.received()))
                continue
            assert isinstance(loop, QueuedWork)
            before = line.triggered, len(loop.pending)
            try:
                if step[0] == "tx":
                    dev._transmit()
                elif step[0] == "rx_notify":
                    dev._start_reading()
                elif dev._reading:
                    dev._receive()
            except GuestError as err:
                steps.append((type(err).__name__, str(err)))
                break
            steps.append((step[0], line.triggered - before[0], len(loop.pending) - before[1],
                          dev._reading, host.received()))
        dev._stop_server()   # the indices and counts back to the Python device
    finally:
        host.close()
        loop.stop()
        if served is not None:
            served.close()
        net.log.removeHandler(handler)
        net.log.setLevel(level)
    memory = (mem.read(0, LOW.size), mem.read(HIGH.guest_phys, HIGH.size))
    mem.close()
    return {"steps": steps, "counters": asdict(dev.counters), "memory": memory,
            "log": records, "received": host.received() if host.kind == "tap" else [],
            "indices": [(q.next_avail, q.next_used) for q in queues],
            "before": ram_before, "may_write": may_write}


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
       fd_kind=st.sampled_from(FD_KINDS),
       max_frames=st.sampled_from([256, 1, 2, 3]),
       max_tx_bytes=st.sampled_from([net.MAX_TX_BYTES, 100, 2000]),
       event_idx=st.booleans())
def test_both_wakes_move_frames_alike_and_within_the_contract(
        monkeypatch: pytest.MonkeyPatch,
        tap_host: tuple[int, socket.socket, socket.socket], rx: dict[str, Any],
        tx: dict[str, Any], ops: list[Any], fd_kind: str, max_frames: int,
        max_tx_bytes: int, event_idx: bool) -> None:
    monkeypatch.setattr(net, "MAX_FRAMES_PER_RUN", max_frames)
    monkeypatch.setattr(net, "MAX_TX_BYTES", max_tx_bytes)
    spec = {"rx": rx, "tx": tx, "ops": ops, "fd_kind": fd_kind, "event_idx": event_idx}
    tap = tap_host if fd_kind == "tap" else None
    native = run_path("native", spec, tap)
    served = run_path("served", spec, tap)
    for name, n in native["counters"].items():
        if n:
            event(name)
    last = native["steps"][-1] if native["steps"] else None
    event(f"{fd_kind}: ended by {last[0] if isinstance(last, tuple) else 'send'}"[:60])
    for record in native["log"]:
        event(f"logged: {record.rsplit(':', 1)[1].strip()}")
    for field in ("steps", "counters", "indices", "log", "received"):
        assert served[field] == native[field], field
    for name, (n, p) in zip(("low", "high"), zip(served["memory"], native["memory"])):
        if n != p:
            at = next(i for i in range(len(n)) if n[i] != p[i])
            pytest.fail(f"served: guest memory differs in the {name} region from "
                        f"byte {at:#x}")
    # The contract, whichever wake: each completed chain accounted for ...
    counters = native["counters"]
    (_, rx_used), (_, tx_used) = native["indices"]
    assert tx_used == (counters["tx_frames"] + counters["tx_dropped"]) & 0xFFFF
    # (an empty datagram is counted as a frame, and fills no chain: no tap sends one)
    assert rx_used <= counters["rx_frames"]
    if fd_kind == "tap":
        assert rx_used == counters["rx_frames"] & 0xFFFF
    # ... and guest memory written only where the driver let the device write.
    for base, image, now in zip((0, HIGH.guest_phys), native["before"], native["memory"]):
        if now != image:
            stray = [base + k for k in range(len(image)) if now[k] != image[k]
                     and not any(lo <= base + k < lo + n for lo, n in native["may_write"])]
            assert not stray, f"the device wrote {stray[0]:#x}, in no writable buffer"


def test_the_wake_entered_from_python_moves_a_frame_each_way() -> None:
    """A frame each way through the wake a transport without ioeventfds and an irqfd
    gets, with exactly the bytes, used lengths, num_buffers and interrupts due."""
    mem = CountingMemory()
    loop = QueuedWork()
    dev_sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    dev_sock.setblocking(False)
    try:
        dev = net.VirtioNet(loop, net.parse_mac("52:54:00:12:34:56"), dev_sock.fileno())
        queues = [make_queue(mem, net.RX_QUEUE), make_queue(mem, net.TX_QUEUE)]
        line = Line()
        dev.memory, dev.queues, dev.interrupt = mem, queues, line  # type: ignore[assignment]
        layout = BufferLayout(RINGS[net.TX_QUEUE][0])
        frame = bytes(12) + b"to the host"
        lay_out(mem, layout, net.TX_QUEUE, {"chains": [[(False, len(frame), "low")]],
                                            "frames": [(frame[:12], frame[12:])],
                                            "corruptions": [], "avail_jump": 0,
                                            "avail_flags": 0, "used_event": 0})
        lay_out(mem, layout, net.RX_QUEUE, {"chains": [[(True, 100, "high")]],
                                            "frames": [(b"", b"")], "corruptions": [],
                                            "avail_jump": 0, "avail_flags": 0,
                                            "used_event": 0})
        dev._transmit()
        assert peer.recv(4096) == frame
        peer.send(bytes(12) + b"to the guest")
        dev._start_reading()   # the rx notification
        assert line.triggered == 2
        assert (dev.counters.tx_frames, dev.counters.rx_frames) == (1, 1)
        assert struct.unpack("<HHII", mem.read(RINGS[net.RX_QUEUE][2], 12)) == (0, 1, 0, 24)
        got = mem.read(HIGH.guest_phys, 24)
        assert got[10:12] == b"\1\0" and got[12:] == b"to the guest"
    finally:
        dev_sock.close()
        peer.close()
        loop.stop()
        mem.close()


def test_the_native_path_syscalls_are_allowed_in_the_jail() -> None:
    """net.rs calls writev and readv; net_serve.rs also reads and writes eventfds,
    takes the tap in and out of the loop's epoll set and duplicates fds (fcntl
    F_DUPFD_CLOEXEC); a jailed VMM dies on any syscall its seccomp filter does not list."""
    from vmfork.runtime import seccomp
    assert {"writev", "readv", "read", "write", "epoll_ctl", "fcntl"} <= set(seccomp.VMM_ALLOWED)
