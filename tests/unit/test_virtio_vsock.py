"""virtio-vsock end to end: a simulated guest driver on one side, real Unix
sockets (Firecracker's CONNECT/OK convention) on the other, the device as every machine
serves it (its native transport, ``_core.NativeDevice``, and ``vsock_serve.rs``, the one
implementation) on a real I/O thread in between.

The examples are the spec's answers (RST for an unknown connection or a port nobody
listens on, OP_RESPONSE for a listened one, credit honoured both ways, bytes delivered
in order, the transport reset after a restore); the properties hold the server to the
contract on hostile and on conversational input."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Self

import pytest
import test_virtio_harness as harness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_virtio_harness import MEM_SIZE, GuestDriver, loop, memory, wait_until  # noqa: F401

from vmfork.vmm.devices.plan import boot_plan, device_plan, plan_state
from vmfork.vmm.devices.virtio import mmio, vsock
from vmfork.vmm.devices.virtio.device import STATUS_DEVICE_NEEDS_RESET, run_on_loop
from vmfork.vmm.devices.virtio.vsock import HEADER_SIZE, Op, PacketHeader
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop
from vmfork.vmm.memory import GuestMemory

GUEST = 3
HOST = 2
RX_BUF = 4096


def pkt(op: int, src_port: int, dst_port: int, length: int = 0, *, flags: int = 0,
        buf_alloc: int = 256 * 1024, fwd_cnt: int = 0, src_cid: int = GUEST,
        dst_cid: int = HOST, type_: int = 1) -> PacketHeader:
    return PacketHeader(src_cid, dst_cid, src_port, dst_port, length, type_, op, flags,
                        buf_alloc, fwd_cnt)


class VsockDevice:
    """A vsock device restored from ``plan`` by its native transport, listening at
    ``uds`` (bound by the device), with its own interrupt eventfd."""

    def __init__(self, loop: EventLoop, memory: GuestMemory, plan: object,  # noqa: F811
                 uds: str) -> None:
        self.irq = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self.dev, self.window = harness.native_device(loop, memory, plan, self.irq,
                                                          [None] * 3,
                                                          vsock_listener=(uds, None))
        except BaseException:
            os.close(self.irq)
            raise

    @property
    def errors(self) -> dict[str, int]:
        return dict(self.dev.vsock_errors())

    @property
    def connection_count(self) -> int:
        return self.dev.vsock_connections()[0]

    @property
    def pending_count(self) -> int:
        return self.dev.vsock_connections()[1]

    def close(self) -> None:
        """Serve no more (idempotent): connections and the listener closed."""
        if self.irq < 0:
            return
        self.dev.close()
        os.close(self.irq)
        self.irq = -1


class VsockEnv:
    """A vsock device behind its transport, and the guest half driving it."""

    def __init__(self, loop: EventLoop, rx_buffers: int = 32) -> None:  # noqa: F811
        self.loop = loop
        self.dir = tempfile.mkdtemp(prefix="vsk", dir="/tmp")  # AF_UNIX paths are short
        self.uds = f"{self.dir}/v.sock"
        self.memory = GuestMemory.anonymous(MEM_SIZE)
        self.device = VsockDevice(loop, self.memory, boot_plan("vsock", guest_cid=GUEST),
                                  self.uds)
        self.dev = self.device.dev
        self.driver = GuestDriver(self.device.window, self.memory)
        self.rx, self.tx, self.ev = self.driver.start(
            [(64, RX_BUF), (64, 64 * 1024), (8, 8)])
        self.packets: list[tuple[PacketHeader, bytes]] = []
        self.post_rx(rx_buffers)

    @property
    def errors(self) -> dict[str, int]:
        """Refused packets and connections by reason (fixed keys)."""
        return self.device.errors

    @property
    def connection_count(self) -> int:
        return self.device.connection_count

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        # The driver's reset: the device stops touching guest memory before it goes.
        self.driver.w(mmio.REG_STATUS, 0)
        self.device.close()
        run_on_loop(self.loop, lambda: None)
        self.memory.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def needs_reset(self) -> bool:
        return bool(self.driver.status & STATUS_DEVICE_NEEDS_RESET)

    def post_rx(self, n: int) -> None:
        # Linux 6.1: one descriptor for the header, one for 4 KiB of payload.
        for _ in range(n):
            self.rx.post(writable=[HEADER_SIZE, RX_BUF])
        self.driver.notify(vsock.RX_QUEUE)

    def send(self, hdr: PacketHeader, payload: bytes = b"") -> None:
        while len(self.tx.free) < 2:
            self.tx.take_used()
            time.sleep(0.001)
        self.tx.post(readable=[hdr.pack(), payload] if payload else [hdr.pack()])
        self.driver.notify(vsock.TX_QUEUE)

    def collect(self) -> list[tuple[PacketHeader, bytes]]:
        self.tx.take_used()
        new = []
        for _, written, data in self.rx.take_used():
            assert written >= HEADER_SIZE
            hdr = PacketHeader.unpack(data[:HEADER_SIZE])
            assert HEADER_SIZE + hdr.len == written
            new.append((hdr, data[HEADER_SIZE:written]))
        if new:
            self.post_rx(len(new))
        self.packets += new
        return new

    def wait_for(self, pred: Callable[[PacketHeader], bool], what: str,
                 timeout: float = 5.0) -> tuple[PacketHeader, bytes]:
        deadline = time.monotonic() + timeout
        while True:
            for i, (hdr, payload) in enumerate(self.packets):
                if pred(hdr):
                    del self.packets[: i + 1]
                    return hdr, payload
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} packet in {timeout} s; got {self.packets}")
            if not self.collect():
                time.sleep(0.002)

    def wait_op(self, op: Op, what: str = "", timeout: float = 5.0) -> tuple[PacketHeader, bytes]:
        return self.wait_for(lambda h: h.op == op, what or op.name, timeout)

    def stream(self, nbytes: int, timeout: float = 5.0) -> bytes:
        """Collect RW payload until ``nbytes`` arrived."""
        out = b""
        deadline = time.monotonic() + timeout
        while len(out) < nbytes:
            assert time.monotonic() < deadline, f"got {len(out)} of {nbytes} bytes"
            self.collect()
            keep = []
            for hdr, payload in self.packets:
                if hdr.op == Op.RW:
                    out += payload
                else:
                    keep.append((hdr, payload))
            self.packets = keep
            time.sleep(0.001)
        return out

    # -- connections ------------------------------------------------------------------------------
    def host_connect(self, port: int, extra: bytes = b"",
                     buf_alloc: int = 256 * 1024) -> tuple[socket.socket, int]:
        """Host-initiated connection, accepted by the guest; returns (socket, host port)."""
        host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        host.settimeout(5)
        host.connect(self.uds)
        host.sendall(f"CONNECT {port}\n".encode() + extra)
        req, _ = self.wait_op(Op.REQUEST)
        assert (req.src_cid, req.dst_cid, req.dst_port) == (HOST, GUEST, port)
        assert req.src_port >= 1 << 30
        self.send(pkt(Op.RESPONSE, port, req.src_port, buf_alloc=buf_alloc))
        assert recv_line(host) == f"OK {req.src_port}\n".encode()
        return host, req.src_port


def recv_line(sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        b = sock.recv(1)
        if not b:
            break
        line += b
    return line


def closed_by_peer(sock: socket.socket) -> bool:
    """EOF, or a reset when the peer closed with our bytes still unread."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"EOF after {len(out)} of {n} bytes"
        out += chunk
    return out


def needs_native_loop(loop: EventLoop) -> None:  # noqa: F811
    if not isinstance(loop, NativeEventLoop):
        pytest.skip("vsock is served only natively: it needs the native loop")


@pytest.fixture
def env(loop: EventLoop) -> Iterator[VsockEnv]:  # noqa: F811
    needs_native_loop(loop)
    with VsockEnv(loop) as e:
        yield e
    assert not e.needs_reset


@pytest.fixture
def guest_listener(env: VsockEnv) -> Iterator[socket.socket]:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(f"{env.uds}_5000")
    srv.listen(4)
    srv.settimeout(5)
    yield srv
    srv.close()


def test_config_space_holds_the_guest_cid(env: VsockEnv) -> None:
    assert env.device.window.read(0x100, 8) == struct.pack("<Q", 3)
    assert env.device.window.read(0x100, 4) == b"\3\0\0\0"
    assert env.device.window.read(0x104, 4) == b"\0\0\0\0"


def test_host_initiated_connection_carries_data_both_ways(env: VsockEnv) -> None:
    host, hport = env.host_connect(1234, extra=b"early")
    assert env.stream(5) == b"early"  # bytes behind the CONNECT line are the stream's
    host.sendall(b"hello")
    assert env.stream(5) == b"hello"
    env.send(pkt(Op.RW, 1234, hport, 5), b"world")
    assert recv_exact(host, 5) == b"world"
    big = bytes(range(256)) * 200  # 51200 bytes: many rx buffers
    host.sendall(big)
    assert env.stream(len(big)) == big
    host.close()


def test_a_second_host_connection_gets_its_own_port(env: VsockEnv) -> None:
    a, pa = env.host_connect(1234)
    b, pb = env.host_connect(1234)
    assert pa != pb and env.connection_count == 2
    a.close()
    b.close()


def test_never_sends_more_than_the_guest_credit(env: VsockEnv) -> None:
    host, hport = env.host_connect(77, buf_alloc=10)
    host.sendall(b"x" * 100)
    assert env.stream(10) == b"x" * 10
    env.wait_op(Op.CREDIT_REQUEST)
    time.sleep(0.1)
    env.collect()
    assert not [h for h, _ in env.packets if h.op == Op.RW], "sent beyond the guest's credit"
    env.send(pkt(Op.CREDIT_UPDATE, 77, hport, buf_alloc=10, fwd_cnt=10))
    assert env.stream(10) == b"x" * 10
    env.send(pkt(Op.CREDIT_UPDATE, 77, hport, buf_alloc=1000, fwd_cnt=20))
    assert env.stream(80) == b"x" * 80
    host.close()


def test_guest_honouring_credit_streams_far_more_than_the_buffer(env: VsockEnv) -> None:
    host, hport = env.host_connect(88)
    total = 4 * vsock.BUF_ALLOC + 12345
    received = bytearray()

    def drain() -> None:
        while len(received) < total:
            chunk = host.recv(65536)
            if not chunk:
                return
            received.extend(chunk)
            time.sleep(0.001)  # a slow reader: our buffer and credit must do the pacing

    reader = threading.Thread(target=drain)
    reader.start()
    sent = peer_fwd = 0
    deadline = time.monotonic() + 20
    while sent < total:
        assert time.monotonic() < deadline, f"stalled at {sent} bytes, fwd_cnt {peer_fwd}"
        env.collect()
        for hdr, _ in env.packets:
            assert hdr.op == Op.CREDIT_UPDATE
            peer_fwd = max(peer_fwd, hdr.fwd_cnt)
        env.packets.clear()
        n = min(vsock.BUF_ALLOC - (sent - peer_fwd), 65536, total - sent)
        if n <= 0:
            time.sleep(0.002)
            continue
        env.send(pkt(Op.RW, 88, hport, n, fwd_cnt=0), bytes([sent % 251]) * n)
        sent += n
    reader.join(10)
    assert len(received) == total and env.errors == {}
    host.close()


def test_guest_overrunning_our_credit_is_reset(env: VsockEnv) -> None:
    host, hport = env.host_connect(89)  # the host never reads
    chunk = b"z" * 65536
    for _ in range(64):
        env.send(pkt(Op.RW, 89, hport, len(chunk)), chunk)
        env.collect()
        if any(h.op == Op.RST for h, _ in env.packets):
            break
    env.wait_op(Op.RST)
    assert env.errors.get("guest overran the credit we advertised") == 1
    assert env.connection_count == 0
    host.close()


def test_guest_refusal_closes_the_host_socket_without_ok(env: VsockEnv) -> None:
    host = socket.socket(socket.AF_UNIX)
    host.settimeout(5)
    host.connect(env.uds)
    host.sendall(b"CONNECT 99\n")
    req, _ = env.wait_op(Op.REQUEST)
    env.send(pkt(Op.RST, 99, req.src_port))
    assert host.recv(100) == b""
    assert env.connection_count == 0


@pytest.fixture
def fast_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before ``env`` (an earlier argument): the native server takes its timeouts when
    the device is activated."""
    monkeypatch.setattr(vsock, "CONNECT_TIMEOUT", 0.2)


@pytest.fixture
def fast_reset_ack_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vsock, "RESET_ACK_WAIT_S", 0.2)


def test_unanswered_request_times_out(fast_connect_timeout: None, env: VsockEnv) -> None:
    host = socket.socket(socket.AF_UNIX)
    host.settimeout(5)
    host.connect(env.uds)
    host.sendall(b"CONNECT 99\n")
    req, _ = env.wait_op(Op.REQUEST)
    assert host.recv(100) == b""
    rst, _ = env.wait_op(Op.RST)
    assert (rst.src_port, rst.dst_port) == (req.src_port, 99)


@pytest.mark.parametrize("line", [b"HELLO\n", b"CONNECT\n", b"CONNECT -1\n",
                                  b"CONNECT 99999999999\n", b"CONNECT 4294967296\n",
                                  b"CONNECT 12 x\n", b"x" * 70, b"CONNECT " + b" " * 60])
def test_bad_connect_lines_are_closed(env: VsockEnv, line: bytes) -> None:
    host = socket.socket(socket.AF_UNIX)
    host.settimeout(5)
    host.connect(env.uds)
    host.sendall(line)
    assert closed_by_peer(host)
    env.collect()
    assert not env.packets
    key = "bad CONNECT line" if b"\n" in line else \
        "host connection closed without a CONNECT line"
    wait_until(lambda: env.errors.get(key) == 1, what=key)


def test_a_connect_line_may_come_in_pieces(env: VsockEnv) -> None:
    host = socket.socket(socket.AF_UNIX)
    host.settimeout(5)
    host.connect(env.uds)
    host.sendall(b"CONN")
    time.sleep(0.05)  # the first piece is taken alone (or not: either way one line)
    host.sendall(b"ECT\t4294967295 \nfirst")
    req, _ = env.wait_op(Op.REQUEST)
    assert req.dst_port == 2**32 - 1
    env.send(pkt(Op.RESPONSE, 2**32 - 1, req.src_port))
    assert recv_line(host) == f"OK {req.src_port}\n".encode()
    assert env.stream(5) == b"first"
    host.close()


def test_a_host_connection_without_its_line_is_closed_after_the_timeout(
        fast_connect_timeout: None, env: VsockEnv) -> None:
    host = socket.socket(socket.AF_UNIX)
    host.settimeout(5)
    host.connect(env.uds)
    host.sendall(b"CONNECT 12")   # no newline, ever
    assert closed_by_peer(host)
    host.close()
    env.collect()
    assert not env.packets and not env.errors


def test_closing_the_device_leaves_no_fds_or_threads(loop: EventLoop) -> None:  # noqa: F811
    """Connections both ways, a host socket owing its line, then close: the process has
    the fds and threads it had before."""
    needs_native_loop(loop)

    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before, threads = fds(), threading.active_count()
    with VsockEnv(loop) as e:
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(f"{e.uds}_5000")
        srv.listen(4)
        e.send(pkt(Op.REQUEST, 40000, 5000))
        e.wait_op(Op.RESPONSE)
        accepted, _ = srv.accept()
        host, hport = e.host_connect(1234)
        e.send(pkt(Op.RW, 1234, hport, 3), b"abc")
        assert recv_exact(host, 3) == b"abc"
        idle = socket.socket(socket.AF_UNIX)
        idle.connect(e.uds)
        wait_until(lambda: e.device.pending_count == 1,
                   what="the idle host socket accepted")
        assert e.connection_count == 2
    assert closed_by_peer(host) and closed_by_peer(idle) and closed_by_peer(accepted)
    for sock in (host, idle, accepted, srv):
        sock.close()
    assert fds() == before and threading.active_count() == threads


def test_guest_initiated_connection(env: VsockEnv, guest_listener: socket.socket) -> None:
    env.send(pkt(Op.REQUEST, 40000, 5000, buf_alloc=4096))
    resp, _ = env.wait_op(Op.RESPONSE)
    assert (resp.src_cid, resp.src_port, resp.dst_cid, resp.dst_port) == (HOST, 5000, GUEST,
                                                                          40000)
    assert resp.buf_alloc == vsock.BUF_ALLOC
    peer, _ = guest_listener.accept()
    peer.settimeout(5)
    env.send(pkt(Op.RW, 40000, 5000, 4), b"ping")
    assert recv_exact(peer, 4) == b"ping"
    peer.sendall(b"pong")
    assert env.stream(4) == b"pong"
    # Half-close: the guest stops sending, the host sees EOF but can still send.
    env.send(pkt(Op.SHUTDOWN, 40000, 5000, flags=vsock.SHUTDOWN_SEND))
    assert peer.recv(10) == b""
    peer.sendall(b"late")
    assert env.stream(4) == b"late"
    peer.close()  # both directions done: the connection ends with RST
    env.wait_op(Op.RST)
    wait_until(lambda: env.connection_count == 0, what="the connection to go")


def test_host_close_sends_shutdown(env: VsockEnv, guest_listener: socket.socket) -> None:
    env.send(pkt(Op.REQUEST, 40001, 5000))
    env.wait_op(Op.RESPONSE)
    peer, _ = guest_listener.accept()
    peer.shutdown(socket.SHUT_WR)
    shut, _ = env.wait_op(Op.SHUTDOWN)
    assert shut.flags == vsock.SHUTDOWN_SEND
    env.send(pkt(Op.RW, 40001, 5000, 3), b"abc")  # the other direction still works
    assert recv_exact(peer, 3) == b"abc"
    env.send(pkt(Op.SHUTDOWN, 40001, 5000, flags=vsock.SHUTDOWN_SEND | vsock.SHUTDOWN_RCV))
    env.wait_op(Op.RST)
    assert peer.recv(10) == b""
    peer.close()


def test_guest_full_shutdown_is_answered_with_rst(env: VsockEnv,
                                                 guest_listener: socket.socket) -> None:
    env.send(pkt(Op.REQUEST, 40002, 5000))
    env.wait_op(Op.RESPONSE)
    peer, _ = guest_listener.accept()
    env.send(pkt(Op.RW, 40002, 5000, 3), b"end")
    env.send(pkt(Op.SHUTDOWN, 40002, 5000, flags=3))
    rst, _ = env.wait_op(Op.RST)
    assert (rst.src_port, rst.dst_port) == (5000, 40002)
    assert recv_exact(peer, 3) == b"end" and peer.recv(10) == b""
    peer.close()


def test_guest_connection_without_listener_is_reset(env: VsockEnv) -> None:
    env.send(pkt(Op.REQUEST, 40003, 6000))
    rst, _ = env.wait_op(Op.RST)
    assert (rst.src_port, rst.dst_port, rst.dst_cid) == (6000, 40003, GUEST)
    assert env.connection_count == 0


def test_guest_credit_request_is_answered(env: VsockEnv, guest_listener: socket.socket) -> None:
    env.send(pkt(Op.REQUEST, 40004, 5000))
    env.wait_op(Op.RESPONSE)
    env.send(pkt(Op.CREDIT_REQUEST, 40004, 5000))
    upd, _ = env.wait_op(Op.CREDIT_UPDATE)
    assert upd.buf_alloc == vsock.BUF_ALLOC and upd.fwd_cnt == 0


@pytest.mark.parametrize("hdr, payload, error", [
    (pkt(Op.RW, 1, 2, 3, src_cid=7), b"abc", "tx packet with a wrong source or destination CID"),
    (pkt(Op.RW, 1, 2, 3, dst_cid=9), b"abc", "tx packet with a wrong source or destination CID"),
    (pkt(Op.RW, 1, 2, 100), b"short", "tx packet payload beyond the chain or the 64 KiB limit"),
    (pkt(Op.RW, 1, 2, 70000), b"", "tx packet payload beyond the chain or the 64 KiB limit"),
])
def test_malformed_packets_are_dropped_and_counted(env: VsockEnv, hdr: PacketHeader,
                                                   payload: bytes, error: str) -> None:
    env.send(hdr, payload)
    wait_until(lambda: env.errors.get(error) == 1, what=error)


def test_short_header_is_dropped(env: VsockEnv) -> None:
    env.tx.post(readable=[b"\0" * 20])
    env.driver.notify(vsock.TX_QUEUE)
    wait_until(lambda: env.errors.get("tx packet shorter than the header") == 1,
               what="the short header to be counted")


@pytest.mark.parametrize("hdr", [pkt(Op.RW, 40010, 5000, 0, type_=2), pkt(42, 40010, 5000)])
def test_bad_type_or_op_on_a_connection_resets_it(env: VsockEnv, guest_listener: socket.socket,
                                                  hdr: PacketHeader) -> None:
    env.send(pkt(Op.REQUEST, 40010, 5000))
    env.wait_op(Op.RESPONSE)
    peer, _ = guest_listener.accept()
    env.send(hdr)
    env.wait_op(Op.RST)
    assert peer.recv(10) == b""
    peer.close()


def test_packet_for_unknown_connection_is_reset(env: VsockEnv) -> None:
    env.send(pkt(Op.RW, 123, 456, 2), b"hi")
    rst, _ = env.wait_op(Op.RST)
    assert (rst.src_port, rst.dst_port) == (456, 123)
    env.send(pkt(Op.RST, 123, 456))  # an RST is never answered
    time.sleep(0.05)
    env.collect()
    assert not env.packets


def test_transport_reset_drops_connections_and_posts_event(
        env: VsockEnv, guest_listener: socket.socket) -> None:
    env.ev.post(writable=[4])
    env.driver.notify(vsock.EVENT_QUEUE)
    env.send(pkt(Op.REQUEST, 40020, 5000))
    env.wait_op(Op.RESPONSE)
    peer, _ = guest_listener.accept()
    host, _ = env.host_connect(1234)
    env.dev.transport_reset()
    wait_until(lambda: env.ev.used_idx() == 1, what="the transport reset event")
    [(_, written, data)] = env.ev.take_used()
    assert (written, data) == (4, struct.pack("<I", vsock.EVENT_TRANSPORT_RESET))
    assert peer.recv(10) == b"" and host.recv(10) == b""
    assert env.connection_count == 0
    acknowledge_reset(env)
    env.host_connect(1234)[0].close()  # new connections work once the guest handled it
    peer.close()
    host.close()


def test_a_restored_device_connects_from_ports_its_sources_guest_may_still_hold(
        loop: EventLoop) -> None:  # noqa: F811
    """A snapshot taken while the guest closes its last connections (its agent closed
    them; the guest kernel keeps each socket in its connected table until the host's
    RST, or for 8 s) restores into a guest that still holds those sockets, transport
    reset or not, and answers a REQUEST from any of their ports with RST, as Linux's
    ``virtio_transport_recv_pkt`` does (a stale socket: ``SOCK_DONE`` or not
    ``TCP_ESTABLISHED``). The restored device is a new one: its host connections must
    come from other ports, or the client's CONNECT is closed without ``OK`` (the flake
    of test_branch.py's branch of a branch, its child's second ``eval``)."""
    needs_native_loop(loop)
    with VsockEnv(loop) as source:
        held_by_the_guest = set()
        for _ in range(3):
            host, port = source.host_connect(1024)
            held_by_the_guest.add(port)
            host.close()
    with VsockEnv(loop) as child:
        for _ in range(3):
            host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            host.settimeout(5)
            host.connect(child.uds)
            host.sendall(b"CONNECT 1024\n")
            req, _ = child.wait_op(Op.REQUEST)
            answer = Op.RST if req.src_port in held_by_the_guest else Op.RESPONSE
            child.send(pkt(answer, 1024, req.src_port))
            assert recv_line(host) == f"OK {req.src_port}\n".encode(), \
                f"port {req.src_port} reused: the guest still holds a socket of it"
            host.close()


def acknowledge_reset(env: VsockEnv) -> None:
    """What Linux does once it has handled a transport reset: refill the event buffer
    and notify the event queue."""
    env.ev.post(writable=[4])
    env.driver.notify(vsock.EVENT_QUEUE)


def requests_sent(env: VsockEnv) -> int:
    env.collect()
    return sum(1 for hdr, _ in env.packets if hdr.op == Op.REQUEST)


def _host_connects_after_a_transport_reset(env: VsockEnv, event_buffers: int) -> socket.socket:
    """A transport reset the guest has not acknowledged yet, then a host connection
    to port 1234 (its CONNECT line sent)."""
    for _ in range(event_buffers):
        env.ev.post(writable=[4])
    env.driver.notify(vsock.EVENT_QUEUE)
    env.dev.transport_reset()
    wait_until(lambda: env.ev.used_idx() == 1, what="the transport reset event")
    env.ev.take_used()
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.settimeout(5)
    host.connect(env.uds)
    host.sendall(b"CONNECT 1234\n")
    return host


def test_host_connections_wait_until_the_guest_handled_a_transport_reset(
        env: VsockEnv) -> None:
    host = _host_connects_after_a_transport_reset(env, event_buffers=1)
    wait_until(lambda: env.connection_count == 1, what="the host connection")
    # Its request is held: a guest that has not yet handled the reset would reset the
    # new connection with the stale ones.
    run_on_loop(env.loop, lambda: None)
    assert requests_sent(env) == 0
    acknowledge_reset(env)
    req, _ = env.wait_op(Op.REQUEST)
    assert req.dst_port == 1234
    env.send(pkt(Op.RESPONSE, 1234, req.src_port))
    assert recv_line(host) == f"OK {req.src_port}\n".encode()
    assert "host connections sent before the guest acknowledged a transport reset" \
        not in env.errors
    host.close()


def test_a_notification_without_a_new_event_buffer_is_no_acknowledgement(
        env: VsockEnv) -> None:
    """As a transport's own notification of every queue when it activates the device
    (a restore) is not."""
    host = _host_connects_after_a_transport_reset(env, event_buffers=2)
    wait_until(lambda: env.connection_count == 1, what="the host connection")
    env.driver.notify(vsock.EVENT_QUEUE)   # one buffer still available, none given back
    run_on_loop(env.loop, lambda: None)
    assert requests_sent(env) == 0
    acknowledge_reset(env)
    req, _ = env.wait_op(Op.REQUEST)
    env.send(pkt(Op.RST, 1234, req.src_port))
    assert closed_by_peer(host)
    host.close()


def test_held_host_connections_go_out_if_the_guest_never_acknowledges(
        fast_reset_ack_wait: None, env: VsockEnv) -> None:
    host = _host_connects_after_a_transport_reset(env, event_buffers=1)
    req, _ = env.wait_op(Op.REQUEST)   # after RESET_ACK_WAIT_S, without the notification
    assert env.errors["host connections sent before the guest acknowledged a "
                          "transport reset"] == 1
    env.send(pkt(Op.RESPONSE, 1234, req.src_port))
    assert recv_line(host) == f"OK {req.src_port}\n".encode()
    host.close()


def test_a_notification_before_the_reset_event_is_not_its_acknowledgement(
        env: VsockEnv) -> None:
    env.dev.transport_reset()   # no event buffer yet: the event waits for one
    run_on_loop(env.loop, lambda: None)
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.settimeout(5)
    host.connect(env.uds)
    host.sendall(b"CONNECT 1234\n")
    wait_until(lambda: env.connection_count == 1, what="the host connection")
    env.ev.post(writable=[4])
    env.driver.notify(vsock.EVENT_QUEUE)   # takes the event, acknowledges nothing yet
    wait_until(lambda: env.ev.used_idx() == 1, what="the deferred transport reset event")
    run_on_loop(env.loop, lambda: None)
    assert requests_sent(env) == 0
    env.ev.take_used()
    acknowledge_reset(env)
    req, _ = env.wait_op(Op.REQUEST)
    env.send(pkt(Op.RST, 1234, req.src_port))
    assert closed_by_peer(host)
    host.close()


def test_reset_event_waits_for_an_event_buffer(env: VsockEnv) -> None:
    env.dev.transport_reset()
    run_on_loop(env.loop, lambda: None)
    assert env.ev.used_idx() == 0
    env.ev.post(writable=[4])
    env.driver.notify(vsock.EVENT_QUEUE)
    wait_until(lambda: env.ev.used_idx() == 1, what="the deferred transport reset event")


def test_snapshot_restore_resets_the_guest_transport(loop: EventLoop) -> None:  # noqa: F811
    needs_native_loop(loop)
    with VsockEnv(loop) as parent:
        parent.ev.post(writable=[4])
        parent.driver.notify(vsock.EVENT_QUEUE)
        host, _ = parent.host_connect(1234)
        saved = plan_state(parent.dev.plan(), 0, 5)
        assert saved.state == vsock.VsockState(guest_cid=3, acked_features=1 << 32)
        # The child: same guest memory (as if mapped from the snapshot), new host
        # resources; the source lets go of the rings first (one server per ring).
        parent.device.close()
        assert host.recv(10) == b""
        child_uds = f"{parent.dir}/child.sock"
        parent.device = VsockDevice(loop, parent.memory, device_plan(saved), child_uds)
        parent.dev, parent.driver.t = parent.device.dev, parent.device.window
        assert parent.device.window.read(0x100, 8) == struct.pack("<Q", 3)
        wait_until(lambda: parent.ev.used_idx() == 1, what="the event after restore")
        [(_, _, data)] = parent.ev.take_used()
        assert data == struct.pack("<I", vsock.EVENT_TRANSPORT_RESET)
        # The child serves new connections on its own socket, continuing the rings.
        parent.uds = child_uds
        acknowledge_reset(parent)
        parent.host_connect(4321)[0].close()
        host.close()


def test_reset_by_the_driver_closes_connections(env: VsockEnv) -> None:
    host, _ = env.host_connect(1234)
    env.driver.w(mmio.REG_STATUS, 0)
    assert env.connection_count == 0 and not env.dev.active
    assert host.recv(10) == b""
    host.close()
    # Host connections while the driver is down are refused after their CONNECT line.
    late = socket.socket(socket.AF_UNIX)
    late.settimeout(5)
    late.connect(env.uds)
    late.sendall(b"CONNECT 1\n")
    assert late.recv(10) == b""
    late.close()
    env.rx, env.tx, env.ev = env.driver.start([(64, RX_BUF), (64, 64 * 1024), (8, 8)])
    env.post_rx(8)
    env.host_connect(1234)[0].close()


def test_too_small_rx_buffer_needs_reset(loop: EventLoop) -> None:  # noqa: F811
    needs_native_loop(loop)
    with VsockEnv(loop, rx_buffers=0) as e:
        e.rx.post(writable=[16])
        e.driver.notify(vsock.RX_QUEUE)
        e.send(pkt(Op.REQUEST, 1, 6000))  # answered with RST: needs an rx buffer
        wait_until(lambda: e.needs_reset, what="DEVICE_NEEDS_RESET")
        assert "cannot hold" in (e.dev.record()[3] or "")


# -- property: whatever the guest sends, the device survives and stays usable ---------------
header_fields = st.builds(
    PacketHeader,
    src_cid=st.sampled_from([GUEST, GUEST, HOST, 0, 2**64 - 1]),
    dst_cid=st.sampled_from([HOST, HOST, GUEST, 2**64 - 1]),
    src_port=st.sampled_from([1, 40000, 2**32 - 1]),
    dst_port=st.sampled_from([5000, 6000, 1 << 30, 0]),
    len=st.one_of(st.integers(0, 64), st.sampled_from([65536, 65537, 2**32 - 1])),
    type=st.sampled_from([1, 1, 2, 0, 0xFFFF]),
    op=st.integers(0, 9),
    flags=st.integers(0, 2**32 - 1),
    buf_alloc=st.one_of(st.integers(0, 100), st.sampled_from([2**32 - 1, 256 * 1024])),
    fwd_cnt=st.one_of(st.integers(0, 100), st.just(2**32 - 1)),
)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(packets=st.lists(st.tuples(header_fields, st.binary(max_size=80)), max_size=20))
def test_random_packets_never_break_the_device(loop: EventLoop,  # noqa: F811
                                               packets: list[tuple[PacketHeader, bytes]]) -> None:
    needs_native_loop(loop)
    with VsockEnv(loop, rx_buffers=16) as e:
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(f"{e.uds}_5000")
        srv.listen(64)
        for hdr, payload in packets:
            e.send(hdr, payload)
            e.collect()
        # Still serving: a well-formed request is answered.
        e.send(pkt(Op.REQUEST, 41000, 6000))
        e.wait_for(lambda h: h.op == Op.RST and h.dst_port == 41000, "RST for port 6000")
        assert not e.needs_reset and not loop.errors
        srv.close()


def test_a_streaming_connection_does_not_hold_up_a_new_ones_request(
        loop: EventLoop) -> None:  # noqa: F811
    """Few rx buffers and one connection with plenty to send (the server serves it up
    to a batch of packets a turn): a new host connection's REQUEST still goes out
    within a turn or two, not after the stream (e2e's many children answering)."""
    needs_native_loop(loop)
    with VsockEnv(loop, rx_buffers=4) as e:
        a, _ = e.host_connect(1000)
        total = 100_000  # within the Unix socket's buffer: sendall cannot block
        a.sendall(b"a" * total)
        wait_until(lambda: e.rx.used_idx() != e.rx.last_used, what="the stream's first packets")
        b = socket.socket(socket.AF_UNIX)
        b.settimeout(5)
        b.connect(e.uds)
        b.sendall(b"CONNECT 2000\n")
        time.sleep(0.2)  # the device has taken B's line and waits for rx buffers
        streamed = 0
        deadline = time.monotonic() + 5
        while True:
            assert time.monotonic() < deadline, f"no REQUEST after {streamed} stream bytes"
            e.collect()
            request = [h for h, _ in e.packets if h.op == Op.REQUEST and h.dst_port == 2000]
            streamed = sum(len(p) for h, p in e.packets if h.op == Op.RW)
            if request:
                break
            time.sleep(0.002)
        # A few turns of 4 buffers at most went to the stream before the REQUEST.
        assert streamed <= 3 * 4 * RX_BUF < total, streamed
        e.send(pkt(Op.RESPONSE, 2000, request[0].src_port))
        assert recv_line(b) == f"OK {request[0].src_port}\n".encode()
        assert e.stream(total) == b"a" * total  # the counted packets are still in e.packets
        a.close()
        b.close()


# -- contract: what a conforming device answers, on hostile and conversational input --------
# The counter keys a guest's packets can raise (fixed strings: the guest cannot grow the
# dict), each packet at most once.
PACKET_KEYS = {vsock.SHORT_HEADER, vsock.WRONG_CID, vsock.BAD_LENGTH, vsock.BAD_TYPE,
               "REQUEST on a connection that already exists",
               "op on a connection that is not established", "tx packet with an unknown op",
               "RESPONSE on a connection that did not request one",
               "data after the guest shut down sending",
               "guest overran the credit we advertised"}
Replay = tuple[list[tuple[PacketHeader, bytes]], dict[str, int], bool, list[bytes]]


def _replay(loop: EventLoop, packets: list[tuple[PacketHeader, bytes]]) -> Replay:  # noqa: F811
    """Send the packets one by one, each handled before the next, with a listener at
    port 5000; what the guest got back, the counters, whether the device needs a reset,
    and what each connection the device made to the listener carried (read after the
    device closed them)."""
    with VsockEnv(loop, rx_buffers=24) as e:
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(f"{e.uds}_5000")
        srv.listen(64)
        for hdr, payload in packets:
            e.send(hdr, payload)
            posted = e.tx.avail_idx
            wait_until(lambda posted=posted: e.tx.used_idx() == posted or e.needs_reset,
                       what="the packet handled")
            e.collect()
        out, errors, broken = list(e.packets), e.errors, e.needs_reset
    carried = []
    srv.setblocking(False)
    while True:
        try:
            conn, _ = srv.accept()
        except BlockingIOError:
            break
        conn.settimeout(5)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        conn.close()
        carried.append(data)
    srv.close()
    return out, errors, broken, carried


def well_formed(hdr: PacketHeader, payload: bytes) -> bool:
    return hdr.len <= min(len(payload), vsock.MAX_PACKET_PAYLOAD) and hdr.type == vsock.TYPE_STREAM


def from_our_guest(hdr: PacketHeader) -> bool:
    return hdr.src_cid == GUEST and hdr.dst_cid == HOST


def check_contract(packets: list[tuple[PacketHeader, bytes]], replay: Replay) -> None:
    out, errors, broken, carried = replay
    # Hostile packets are the guest's business: never NEEDS_RESET.
    assert not broken
    # Every packet back is a well-formed stream packet from the host to our guest.
    for hdr, payload in out:
        assert (hdr.src_cid, hdr.dst_cid, hdr.type) == (HOST, GUEST, vsock.TYPE_STREAM), hdr
        assert Op.REQUEST <= hdr.op <= Op.CREDIT_REQUEST and hdr.len == len(payload), hdr
        assert hdr.op != Op.RW, "the host side sent nothing"
    # Counters: fixed keys, each packet counted at most once; the tx checks exactly.
    assert set(errors) <= PACKET_KEYS, errors
    assert sum(errors.values()) <= len(packets)
    wrong_cid = [h for h, _ in packets if not from_our_guest(h)]
    ours = [(h, p) for h, p in packets if from_our_guest(h)]
    bad_len = [h for h, p in ours if h.len > min(len(p), vsock.MAX_PACKET_PAYLOAD)]
    # By packet, not by header: two packets may share a header, one with too short a
    # payload (a bad length) and one without (then a bad type).
    bad_type = [h for h, p in ours
                if h.len <= min(len(p), vsock.MAX_PACKET_PAYLOAD) and h.type != vsock.TYPE_STREAM]
    assert errors.get(vsock.WRONG_CID, 0) == len(wrong_cid)
    assert errors.get(vsock.BAD_LENGTH, 0) == len(bad_len)
    assert errors.get(vsock.BAD_TYPE, 0) == len(bad_type)
    # Nobody listens but at 5000, so no connection exists on any other port: each of our
    # guest's packets there but an RST is answered by exactly one RST (an unknown
    # connection, a refused packet, or a refused REQUEST), a wrong-CID one by nothing.
    want_rsts: dict[tuple[int, int], int] = {}
    for hdr, _ in ours:
        if hdr.dst_port != 5000 and hdr.op != Op.RST:
            key = (hdr.dst_port, hdr.src_port)
            want_rsts[key] = want_rsts.get(key, 0) + 1
    got_rsts: dict[tuple[int, int], int] = {}
    for hdr, _ in out:
        if hdr.src_port != 5000:
            assert hdr.op == Op.RST, hdr
            key = (hdr.src_port, hdr.dst_port)
            got_rsts[key] = got_rsts.get(key, 0) + 1
    assert got_rsts == want_rsts
    # OP_RESPONSE only for the listened port, to a guest port that asked for it.
    asked = {h.src_port for h, p in ours
             if h.op == Op.REQUEST and h.dst_port == 5000 and well_formed(h, p)}
    for hdr, _ in out:
        if hdr.op == Op.RESPONSE:
            assert hdr.src_port == 5000 and hdr.dst_port in asked, hdr
    assert sum(1 for h, _ in out if h.op == Op.RESPONSE) == len(carried)
    # Bytes delivered in order: each connection carried a contiguous run of one guest
    # port's data to 5000, nothing invented, nothing reordered or repeated.
    runs = {}
    for port in {h.src_port for h, _ in ours}:
        runs[port] = [p[:h.len] for h, p in ours
                      if h.src_port == port and h.dst_port == 5000 and h.op == Op.RW
                      and well_formed(h, p) and h.len]
    for data in carried:
        if data:
            assert any(data == b"".join(rw[i:j]) for rw in runs.values()
                       for i in range(len(rw)) for j in range(i + 1, len(rw) + 1)), data


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(packets=st.lists(st.tuples(header_fields, st.binary(max_size=80)), max_size=16))
def test_hostile_packets_get_the_contracts_answers(
        loop: EventLoop, packets: list[tuple[PacketHeader, bytes]]) -> None:  # noqa: F811
    """Hostile and well-formed packets alike."""
    needs_native_loop(loop)
    check_contract(packets, _replay(loop, packets))


@st.composite
def conversation_packet(draw: st.DrawFn) -> tuple[PacketHeader, bytes]:
    """A packet of a guest talking to a listener at 5000 (and to nobody at 6000): mostly
    well formed, so that connections open, carry data, run out of credit, shut down."""
    op = draw(st.sampled_from([Op.REQUEST, Op.RW, Op.RW, Op.RW, Op.SHUTDOWN, Op.RST,
                               Op.CREDIT_UPDATE, Op.CREDIT_REQUEST, Op.RESPONSE, 9]))
    payload = draw(st.binary(min_size=1, max_size=64)) if op == Op.RW else b""
    return pkt(op, draw(st.sampled_from([40000, 40001])), draw(st.sampled_from([5000, 6000])),
               len(payload), flags=draw(st.integers(0, 3)),
               buf_alloc=draw(st.sampled_from([0, 16, 256 * 1024])),
               fwd_cnt=draw(st.integers(0, 64))), payload


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(packets=st.lists(conversation_packet(), max_size=24))
def test_a_conversation_gets_the_contracts_answers(
        loop: EventLoop, packets: list[tuple[PacketHeader, bytes]]) -> None:  # noqa: F811
    needs_native_loop(loop)
    check_contract(packets, _replay(loop, packets))


def test_a_clean_conversation_is_answered_by_the_spec(loop: EventLoop) -> None:  # noqa: F811
    """The spec's answers, spelt out: a REQUEST to a listened port gets OP_RESPONSE with
    our credit; its data reaches the listener in order; one to a port nobody listens on
    gets RST; the connection's RST ends it."""
    needs_native_loop(loop)
    packets = [(pkt(Op.REQUEST, 40000, 5000), b""),
               (pkt(Op.RW, 40000, 5000, 3), b"one"),
               (pkt(Op.REQUEST, 40001, 6000), b""),
               (pkt(Op.RW, 40000, 5000, 3), b"two"),
               (pkt(Op.RST, 40000, 5000), b"")]
    out, errors, broken, carried = _replay(loop, packets)
    assert [(h.op, h.src_port, h.dst_port) for h, _ in out] == [
        (Op.RESPONSE, 5000, 40000), (Op.RST, 6000, 40001)]
    assert out[0][0].buf_alloc == vsock.BUF_ALLOC
    assert carried == [b"onetwo"] and errors == {} and not broken
