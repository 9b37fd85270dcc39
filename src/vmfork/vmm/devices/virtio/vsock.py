"""virtio-vsock (device id 19) with a user-space back end on host Unix sockets.

Queues: rx (0, device -> guest packets), tx (1, guest -> device packets),
event (2, device -> guest events). Config space: ``guest_cid`` as a u64.

Host side, following Firecracker's convention:

* **Host-initiated.** We listen on ``uds_path``. A host process connects and
  writes ``CONNECT <port>\\n``; we pick a fresh host-side port (from 2**30 up),
  send OP_REQUEST to the guest, and on OP_RESPONSE answer ``OK <hostport>\\n``
  on the Unix socket; from then on its bytes are the stream. A guest RST (no
  listener), a refusal, or no answer within ``CONNECT_TIMEOUT`` closes the Unix
  socket: the host process sees EOF without ``OK``.
* **Guest-initiated.** The guest connects to CID 2 port P; we connect to the
  Unix socket ``<uds_path>_<P>``; if nothing listens there, OP_RST.

Credit (virtio 1.2, 5.10.6.3). Each side advertises ``buf_alloc`` (its receive
buffer) and ``fwd_cnt`` (bytes it has consumed) in every header; a sender may
have at most ``buf_alloc - (tx_cnt - fwd_cnt)`` bytes in flight. Guest -> host:
we advertise ``BUF_ALLOC`` and hold at most that much per connection (bytes not
yet written to the Unix socket), so a guest that honours credit never overruns
us and one that does not is RST. Our ``fwd_cnt`` rises as the Unix socket takes
bytes; we send an explicit CREDIT_UPDATE when the guest's last-known view of
our free space falls below half, so a sender blocked on credit always hears of
it. Host -> guest: we read the Unix socket only when the guest has credit for
us *and* there is an rx buffer to put the bytes in, so nothing is buffered on
our side in that direction: back-pressure reaches the host process through its
socket buffer. Out of credit, we send one CREDIT_REQUEST.

Readiness. The ``EventLoop`` offers readers only, so sockets waiting to become
writable are registered (EPOLLOUT) in a private epoll instance whose own fd is
a reader on the loop: an epoll fd is readable when any fd in it is ready.
Readers are one-shot in spirit: a socket's reader is removed while its data
waits for an rx buffer or credit, so a level-triggered fd never spins the loop.

Bounds on what the guest can drive: ``MAX_CONNECTIONS`` connections,
``BUF_ALLOC`` buffered bytes each, ``MAX_PACKET_PAYLOAD`` per tx packet,
``MAX_PACKETS_PER_RUN`` packets handled per loop turn per queue (the rest on a
later turn), ``MAX_ORPHAN_RSTS`` queued resets to unknown connections (beyond
that they are dropped and counted; the guest's own timeouts cover them).

Malformed tx packets (short header, payload beyond the chain or above 64 KiB,
wrong CIDs, unknown type or op) are dropped and counted in ``errors``; if they
belong to a connection, it is reset. They are the guest's business and never
make the device NEEDS_RESET; only a broken virtqueue does. Those checks are one
function, ``classify_tx`` (the header copied once out of the chain, then the rules in
order); it runs natively wherever guest memory has a native view
(``native/src/vsock_packet.rs``, fuzzed by ``native/fuzz``'s ``vsock_packet``), and
``classify_tx_python`` is its ``VMFORK_NATIVE=0`` twin. What it returns (``TxPacket``)
is all the state machine below sees of the guest's bytes, apart from an RW payload.
On the rx side, a packet the state machine chose (a control packet, an orphan RST, or
data read in Python) is written into its chain by ``deliver_rx``: natively one call
(header encoded, payload, used entry), ``deliver_rx_python`` its twin.

Native byte paths (on wherever the core is built; ``VMFORK_NATIVE_VSOCK=0`` turns
them off alone, see ``NATIVE_BYTES``). Where guest memory has a native view
(``GuestMemory.native``), stream
bytes move between a Unix socket and the guest's buffers without Python objects:
guest -> host with one ``sendmsg`` from the tx chain's buffers (only what the socket
does not take is copied into the connection's buffer), host -> guest with a batch of
``readv`` straight into rx chains, one RW packet each (``native/src/vsock_io.rs``).
The state machine, credit and bounds above are this file's either way.

Snapshots. ``VsockState`` holds the guest CID (the queues are the transport's).
Connections are live host resources and are not saved: ``restore`` arranges a
VIRTIO_VSOCK_EVENT_TRANSPORT_RESET for when the device is re-activated, which
makes the guest drop its stale connections and keep its listeners. ``transport_reset()``
does the same on demand. The guest handles the event some time after it runs again
(Linux: in a work item, which resets every connected socket, then gives the event
buffer back and notifies the queue), and a host connection it accepted before then
would be reset with the stale ones: so a host connection request made after a reset is
held until the guest has made a new event buffer available (it handled the event) and
notified the queue, or for at most ``RESET_ACK_WAIT_S``, and a connection made right
after a restore works the first time.

Served natively (the default; ``VMFORK_NATIVE_VSOCK_SERVE=0`` keeps this file's state
machine, ``NATIVE_SERVE``). Where the
VMM runs the native loop, all of the above -- the connection table, credit, the listener
and its CONNECT lines, the sockets, the timeouts, the reset event and the hold, and the
three queues -- is ``_core.VsockServe``'s (``native/src/vsock_serve.rs``), served on the
loop without the GIL; this class then keeps the construction (the listener's bind),
config space, ``VsockState``'s save and restore (the same contract: no connections, a
transport reset at the next activation), the counters (read-only, ``errors``) and close.
The rules, bounds and counter keys are this file's, word for word.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import re
import select
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from vmfork.vmm.devices.virtio.device import DEVICE_ID_VSOCK, VirtioDevice, VirtioInterrupt
from vmfork.vmm.devices.virtio.queue import DescriptorChain, Virtqueue
from vmfork.vmm.errors import GuestError, HostError, VirtqueueError
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.native import NATIVE

try:
    from vmfork import _core
except ImportError:
    pass

log = logging.getLogger(__name__)

HOST_CID = 2
DEFAULT_GUEST_CID = 3
RX_QUEUE, TX_QUEUE, EVENT_QUEUE = 0, 1, 2
QUEUE_SIZE = 256

HEADER = struct.Struct("<QQIIIHHIII")
HEADER_SIZE = HEADER.size  # 44
TYPE_STREAM = 1


class Op(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    RST = 3
    SHUTDOWN = 4
    RW = 5
    CREDIT_UPDATE = 6
    CREDIT_REQUEST = 7


SHUTDOWN_RCV = 1   # the sender will receive no more
SHUTDOWN_SEND = 2  # the sender will send no more
EVENT_TRANSPORT_RESET = 0

BUF_ALLOC = 256 * 1024
MAX_PACKET_PAYLOAD = 64 * 1024
MAX_CONNECTIONS = 1024
MAX_PACKETS_PER_RUN = 256
MAX_ORPHAN_RSTS = 1024
# Data packets one connection gets per turn on the native path before the next
# connection's turn (the Python path takes one per turn).
NATIVE_RX_BATCH = 32
# The native byte paths are on unless VMFORK_NATIVE_VSOCK=0 (VMFORK_NATIVE=0 turns them
# off with every other native piece). They were opt-in for two sessions after e2e
# test_fork's test_many_concurrent_children_answer timed out a handshake under a load of
# 10-13; re-examined, no difference from the Python paths was found (design notes).
NATIVE_BYTES = os.environ.get("VMFORK_NATIVE_VSOCK", "1") != "0"
# The whole device served on the native loop without the GIL (module docstring);
# VMFORK_NATIVE_VSOCK_SERVE=0 keeps the state machine below.
NATIVE_SERVE = os.environ.get("VMFORK_NATIVE_VSOCK_SERVE", "1") != "0"
CONNECT_LINE_MAX = 64
CONNECT_TIMEOUT = 20.0  # seconds for the CONNECT line, and for the guest's answer (a guest
# starved of CPU -- many VMs on few cores -- can take seconds to answer a request)
HOST_PORT_FIRST = 1 << 30
RESET_ACK_WAIT_S = 10.0
"""Seconds host connection requests wait for the guest to acknowledge a transport reset
(module docstring) before they go out anyway: well inside ``CONNECT_TIMEOUT``, which
runs from the request too."""
_U32 = 0xFFFF_FFFF

_CONNECT_LINE = re.compile(rb"CONNECT\s+(\d{1,10})\s*\n")


class PacketHeader(NamedTuple):
    """``struct virtio_vsock_hdr``. A NamedTuple, not a frozen dataclass: one is built
    for every packet each way, and a frozen dataclass's ``__init__`` costs ~5x a
    tuple's (1.8 against 0.35 us here), more than the native parse it carries."""

    src_cid: int
    dst_cid: int
    src_port: int
    dst_port: int
    len: int
    type: int
    op: int
    flags: int
    buf_alloc: int
    fwd_cnt: int

    def pack(self) -> bytes:
        return HEADER.pack(*self)

    @classmethod
    def unpack(cls, data: bytes) -> PacketHeader:
        return cls._make(HEADER.unpack(data))


# The counter keys of refused tx packets (``VirtioVsock.errors``), fixed strings: never
# a guest number, so the guest cannot grow the dict. native/src/vsock_packet.rs has
# the same words.
SHORT_HEADER = "tx packet shorter than the header"
WRONG_CID = "tx packet with a wrong source or destination CID"
BAD_LENGTH = "tx packet payload beyond the chain or the 64 KiB limit"
BAD_TYPE = "tx packet of an unknown socket type"


class TxVerdict(enum.Enum):
    DROP = "drop"      # counted; not answered (no header, or not from our guest to us)
    REFUSE = "refuse"  # counted; its connection is reset, or an RST answers it
    PACKET = "packet"  # well formed: the op and the connection decide


class TxPacket(NamedTuple):
    """What the tx path makes of one guest chain, before any connection is looked at
    (a NamedTuple, as ``PacketHeader``: one per packet).

    ``error`` is the counter key of a DROP or REFUSE; ``header`` is None only for a
    DROP; ``op`` is set only for a PACKET, None there for an op virtio does not define.
    """

    verdict: TxVerdict
    error: str | None
    header: PacketHeader | None
    op: Op | None


# Lookups by value without the enum machinery's cost (a dict get, per packet).
_VERDICTS = {v.value: v for v in TxVerdict}
_OPS = {int(o): o for o in Op}


def classify_tx(memory: GuestMemory, chain: DescriptorChain, guest_cid: int) -> TxPacket:
    """Parse and check the packet in a tx chain: natively where guest memory has a
    native view (``native/src/vsock_packet.rs``), else ``classify_tx_python``, which
    is the reference both are held to."""
    if memory.native is None:
        return classify_tx_python(memory, chain, guest_cid)
    verdict, error, fields, op = memory.native.vsock_tx_classify(chain.readable, guest_cid)
    return TxPacket(_VERDICTS[verdict], error,
                    None if fields is None else PacketHeader._make(fields),
                    None if op is None else _OPS[op])


def classify_tx_python(memory: GuestMemory, chain: DescriptorChain, guest_cid: int) -> TxPacket:
    """The rules, in order: a header, then the CIDs, then the length, then the type.
    The header is read once; only the copy is looked at (the guest may be writing)."""
    raw = chain.read_readable(memory, HEADER_SIZE)
    if len(raw) < HEADER_SIZE:
        return TxPacket(TxVerdict.DROP, SHORT_HEADER, None, None)
    hdr = PacketHeader.unpack(raw)
    if hdr.src_cid != guest_cid or hdr.dst_cid != HOST_CID:
        # A fixed key, never the CIDs: they are the guest's choice, and a counter
        # per pair was a dict the guest could grow without end.
        return TxPacket(TxVerdict.DROP, WRONG_CID, None, None)
    if hdr.len > MAX_PACKET_PAYLOAD or HEADER_SIZE + hdr.len > chain.readable_len:
        return TxPacket(TxVerdict.REFUSE, BAD_LENGTH, hdr, None)
    if hdr.type != TYPE_STREAM:
        return TxPacket(TxVerdict.REFUSE, BAD_TYPE, hdr, None)
    return TxPacket(TxVerdict.PACKET, None, hdr, _OPS.get(hdr.op))


def deliver_rx(memory: GuestMemory, queue: Virtqueue, chain: DescriptorChain,
               hdr: PacketHeader, payload: bytes) -> None:
    """Write a packet into a popped rx chain that holds a header (the header, then the
    payload from byte 44 on, each cut at the chain's end) and give the chain back to the
    driver: natively where guest memory has a native view (one call: the header encoded
    and written, the payload, the used entry), else ``deliver_rx_python``."""
    if memory.native is None:
        deliver_rx_python(memory, queue, chain, hdr, payload)
        return
    queue.next_used = memory.native.vsock_rx_packet(
        queue.size, queue.used_ring, queue.next_used, chain.head, chain.writable, hdr, payload)


def deliver_rx_python(memory: GuestMemory, queue: Virtqueue, chain: DescriptorChain,
                      hdr: PacketHeader, payload: bytes) -> None:
    written = chain.write_writable(memory, hdr.pack())
    written += chain.write_writable(memory, payload, HEADER_SIZE)
    queue.add_used(memory, chain.head, written)


@dataclass
class VsockState:
    """Plain-data twin of ``VirtioVsock``. Connections are not state: they are reset."""

    guest_cid: int
    acked_features: int


class _ConnState(enum.Enum):
    REQUESTED = "requested"      # host-initiated: OP_REQUEST sent, awaiting the guest
    ESTABLISHED = "established"


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    local_port: int  # the host side's vsock port
    peer_port: int   # the guest side's vsock port
    state: _ConnState
    peer_buf_alloc: int = 0
    peer_fwd_cnt: int = 0
    tx_cnt: int = 0          # payload bytes sent to the guest (mod 2**32)
    rx_cnt: int = 0          # payload bytes received from the guest
    fwd_cnt: int = 0         # of those, bytes written to the Unix socket
    last_told_fwd: int = 0   # fwd_cnt in the last header we sent
    out: bytearray = field(default_factory=bytearray)  # guest -> host, not yet written
    need_request: bool = False
    need_response: bool = False
    need_credit_update: bool = False
    need_credit_request: bool = False
    credit_requested: bool = False
    shutdown_to_send: int = 0
    data_ready: bool = False  # the Unix socket was readable; waiting for an rx buffer
    host_eof: bool = False    # the Unix socket's reader side hit EOF (we sent SHUTDOWN)
    host_wr_shut: bool = False
    peer_shut: int = 0        # SHUTDOWN flags received from the guest
    reset_after_flush: bool = False
    reading: bool = False
    writing: bool = False
    queued: bool = False
    closed: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.local_port, self.peer_port)

    def credit(self) -> int:
        """Bytes we may still send the guest on this connection."""
        in_flight = (self.tx_cnt - self.peer_fwd_cnt) & _U32
        return max(0, self.peer_buf_alloc - in_flight)

    def wants_host_data(self) -> bool:
        return (self.state is _ConnState.ESTABLISHED and not self.host_eof
                and not self.peer_shut & SHUTDOWN_RCV and not self.reset_after_flush
                and not self.closed)


@dataclass(eq=False)
class _PendingHost:
    """An accepted host connection that has not yet sent its CONNECT line."""

    sock: socket.socket
    line: bytearray = field(default_factory=bytearray)
    closed: bool = False


class VirtioVsock(VirtioDevice):
    device_type = DEVICE_ID_VSOCK
    queue_max_sizes = (QUEUE_SIZE, QUEUE_SIZE, QUEUE_SIZE)

    def __init__(self, loop: EventLoop, uds_path: str,
                 guest_cid: int = DEFAULT_GUEST_CID, native_serve: bool | None = None) -> None:
        super().__init__()
        if guest_cid <= HOST_CID or guest_cid >= _U32:
            raise ValueError(f"guest CID {guest_cid} must be in 3..2**32-2")
        self.loop = loop
        self.uds_path = uds_path
        self.guest_cid = guest_cid
        self._conns: dict[tuple[int, int], _Conn] = {}
        self._pending_hosts: set[_PendingHost] = set()
        self._rx_queue: deque[_Conn] = deque()
        self._orphan_rsts: deque[PacketHeader] = deque()
        self._writers: dict[int, _Conn] = {}
        self._next_port = HOST_PORT_FIRST
        self._reset_event_pending = False
        # A reset event the guest has taken but not yet acknowledged (given an event
        # buffer back, then notified the queue), and the host connections held until then.
        self._reset_delivered = False
        self._buffers_at_delivery = 0   # event buffers available right after it
        self._holding = False
        self._held: list[_Conn] = []
        self._hold_generation = 0
        self._hold_timer = -1   # the generation whose hold a timer bounds
        self._errors: dict[str, int] = {}
        self.native_bytes = NATIVE_BYTES  # and guest memory has a native view
        try:
            if os.path.exists(uds_path):
                os.unlink(uds_path)
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(uds_path)
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError as err:
            raise HostError(f"vsock: listen on {uds_path}: {err}", op="listen",
                            errno=err.errno) from err
        self._wpoll = select.epoll()
        listener, wpoll = self._listener, self._wpoll
        if native_serve is None:
            native_serve = NATIVE_SERVE
        self._server: _core.VsockServe | None = None
        self._detach_queues: list[Callable[[], None]] = []
        if native_serve and NATIVE and isinstance(loop, NativeEventLoop):
            server = self._server = _core.VsockServe(
                listener.fileno(), uds_path, guest_cid, CONNECT_TIMEOUT, RESET_ACK_WAIT_S,
                self._native_fault)

            def add_server() -> None:
                loop.add_native_reader(server.epoll_fd, server)

            self._call_on_loop(add_server)
            return

        def add_readers() -> None:
            loop.add_reader(listener.fileno(), self._accept)
            loop.add_reader(wpoll.fileno(), self._writable)

        self._call_on_loop(add_readers)

    @property
    def serving_natively(self) -> bool:
        """Whether ``_core.VsockServe`` serves the device (``NATIVE_SERVE``)."""
        return self._server is not None

    @property
    def errors(self) -> dict[str, int]:
        """Refused packets and connections by reason (a copy; fixed keys)."""
        if self._server is None:
            return dict(self._errors)
        return dict(self._server.errors())

    def _native_fault(self, err: BaseException) -> None:
        """The native server found a guest fault (on the loop thread, with the GIL)."""
        if self.interrupt is not None and isinstance(err, GuestError):
            self.interrupt.device_error(err)
        else:
            log.error("vsock: native server stopped: %s", err)

    def _attach_server(self, server: _core.VsockServe, memory: GuestMemory,
                       queues: list[Virtqueue], interrupt: VirtioInterrupt) -> None:
        """Hand the three queues to the native server (at an activation)."""
        natives = [interrupt.native_queue(i) for i in range(3)]
        if memory.native is None or any(n is None for n in natives) or len(queues) != 3:
            raise HostError("vsock: native serving needs native guest memory, the native "
                            "loop and register file and an irqfd", op="activate")
        rx, tx, ev = (n for n in natives if n is not None)

        def rings(q: Virtqueue) -> tuple[int, int, int, int, int, int]:
            return (q.size, q.desc_table, q.avail_ring, q.used_ring, q.next_avail,
                    q.next_used)

        server.attach(memory.native, rx.registers, rx.epoch, self.guest_cid,
                      rings(queues[RX_QUEUE]), rings(queues[TX_QUEUE]),
                      rings(queues[EVENT_QUEUE]), rx.irq_fd, (rx.notify_fd, tx.notify_fd, ev.notify_fd),
                      CONNECT_TIMEOUT, RESET_ACK_WAIT_S)
        for index, native in enumerate((rx, tx, ev)):
            native.attach(server, count_interrupts=index == RX_QUEUE)
            self._detach_queues.append(native.detach)

    def sync_queues(self) -> None:
        server = self._server
        if server is not None and len(self.queues) == 3 and self._detach_queues:
            for queue, (avail, used) in zip(self.queues, server.sync()):
                queue.next_avail, queue.next_used = avail, used

    # -- device contract ----------------------------------------------------------------
    def config_bytes(self) -> bytes:
        return struct.pack("<Q", self.guest_cid)

    def activate(self, memory: GuestMemory, queues: list[Virtqueue],
                 interrupt: VirtioInterrupt) -> None:
        super().activate(memory, queues, interrupt)
        if self._server is not None:
            self._attach_server(self._server, memory, queues, interrupt)
            return
        if self._reset_event_pending:
            self._guarded(self._post_events)

    def queue_notify(self, index: int) -> None:
        if self._server is not None:
            # A QueueNotify exit or the activation's catch-up (ioeventfds go to the
            # server on the loop); a guest fault comes back through _native_fault.
            if self._detach_queues:
                self._server.notify(index)
            return
        if index == TX_QUEUE:
            self._process_tx()
            self._process_rx()
        elif index == RX_QUEUE:
            self._process_rx()
        elif index == EVENT_QUEUE:
            if self._reset_delivered and self._holding and self._reset_acknowledged():
                self._release_held()
            self._post_events()

    def reset(self) -> None:
        if self._server is not None:
            self._release_server_queues()
            self._server.detach()
        self._drop_all()
        self._reset_event_pending = False
        self._reset_delivered = self._holding = False   # a new driver has no stale sockets
        super().reset()

    def transport_reset(self) -> None:
        """Drop every connection and tell the guest (EVENT_TRANSPORT_RESET). Any thread."""

        def do() -> None:
            if self._server is not None:
                self._server.transport_reset()
                return
            self._drop_all()
            self._arm_reset_event()
            self._guarded(self._post_events)

        self._call_on_loop(do)

    def close(self) -> None:
        """Release the host resources: connections, the listener and its path."""

        def do() -> None:
            server = self._server
            if server is not None:
                self.loop.remove_reader(server.epoll_fd)
                self._release_server_queues()
                server.close()   # after the loop let go of its epoll
            self._drop_all()
            self.loop.remove_reader(self._listener.fileno())
            self.loop.remove_reader(self._wpoll.fileno())
            self._listener.close()
            self._wpoll.close()
            try:
                os.unlink(self.uds_path)
            except FileNotFoundError:
                pass

        self._call_on_loop(do)

    def save(self) -> VsockState:
        return VsockState(guest_cid=self.guest_cid, acked_features=self.acked_features)

    def restore(self, state: VsockState) -> None:
        """Load device state; on (re-)activation the guest gets a transport reset."""
        self.guest_cid = state.guest_cid
        self.acked_features = state.acked_features
        if self._server is not None:
            self._server.arm_reset_event(state.guest_cid)
            return
        self._arm_reset_event()

    @property
    def connection_count(self) -> int:
        if self._server is not None:
            return self._server.connection_count
        return len(self._conns)

    def _release_server_queues(self) -> None:
        """Give the queues' ioeventfds back to the transport (a reset, the close)."""
        detach, self._detach_queues = self._detach_queues, []
        for release in detach:
            release()

    # -- transport resets -------------------------------------------------------------------
    def _arm_reset_event(self) -> None:
        """A transport reset for the guest: sent when it has an event buffer; host
        connection requests wait until it was handled."""
        self._reset_event_pending = True
        self._reset_delivered = False
        self._holding = True
        self._hold_generation += 1

    def _reset_acknowledged(self) -> bool:
        """The guest gave an event buffer back since the reset event was delivered: it
        has handled it (not merely been notified: a transport notifies every queue once
        when it activates the device)."""
        if not self._usable() or self.memory is None:
            return False
        return self.queues[EVENT_QUEUE].pending(self.memory) != self._buffers_at_delivery

    def _hold(self, conn: _Conn) -> None:
        self._held.append(conn)
        if self._hold_timer != self._hold_generation:
            self._hold_timer = generation = self._hold_generation
            self.loop.call_later(RESET_ACK_WAIT_S, lambda: self._hold_expired(generation))

    def _hold_expired(self, generation: int) -> None:
        if self._holding and generation == self._hold_generation:
            self._count("host connections sent before the guest acknowledged a transport reset")
            self._release_held()

    def _release_held(self) -> None:
        self._holding = self._reset_delivered = False
        held, self._held = self._held, []
        for conn in held:
            self._schedule(conn)   # (not if it was closed meanwhile)
        if held:
            self._guarded(self._process_rx)

    # -- helpers ----------------------------------------------------------------------------
    def _call_on_loop(self, fn: Callable[[], None]) -> None:
        if self.loop.in_loop_thread():
            fn()
        else:
            self.loop.call_soon(fn)

    def _count(self, what: str) -> None:
        self._errors[what] = self._errors.get(what, 0) + 1
        log.debug("vsock: %s", what)

    def _on_io(self, work: Callable[[], None]) -> None:
        """Run work triggered by a host socket. A dead device keeps no connections, so
        that a readable socket it can no longer serve cannot spin the loop."""
        if not self._usable():
            self._drop_all()
            return
        self._guarded(work)

    def _header(self, conn: _Conn, op: Op, length: int = 0, flags: int = 0) -> PacketHeader:
        return PacketHeader(HOST_CID, self.guest_cid, conn.local_port, conn.peer_port, length,
                            TYPE_STREAM, op, flags, BUF_ALLOC, conn.fwd_cnt & _U32)

    def _queue_orphan_rst(self, src_port: int, dst_port: int) -> None:
        if len(self._orphan_rsts) >= MAX_ORPHAN_RSTS:
            self._count("orphan RST dropped: queue full")
            return
        self._orphan_rsts.append(PacketHeader(HOST_CID, self.guest_cid, src_port, dst_port,
                                              0, TYPE_STREAM, Op.RST, 0, 0, 0))

    def _schedule(self, conn: _Conn) -> None:
        if not conn.queued and not conn.closed:
            conn.queued = True
            self._rx_queue.append(conn)

    # -- connection lifetime -------------------------------------------------------------------
    def _close(self, conn: _Conn, rst: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.reading:
            self.loop.remove_reader(conn.sock.fileno())
        if conn.writing:
            self._writers.pop(conn.sock.fileno(), None)
            self._wpoll.unregister(conn.sock.fileno())
        self._conns.pop(conn.key, None)
        conn.sock.close()
        if rst:
            self._queue_orphan_rst(conn.local_port, conn.peer_port)

    def _drop_all(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn, rst=False)
        for pending in list(self._pending_hosts):
            self._close_pending(pending)
        self._rx_queue.clear()
        self._orphan_rsts.clear()
        self._held.clear()

    def _close_pending(self, pending: _PendingHost) -> None:
        if not pending.closed:
            pending.closed = True
            self.loop.remove_reader(pending.sock.fileno())
            pending.sock.close()
            self._pending_hosts.discard(pending)

    def _arm_reader(self, conn: _Conn) -> None:
        """Watch the Unix socket if the guest can take its data; else ask for credit."""
        if not conn.wants_host_data() or conn.reading:
            return
        if conn.credit() == 0:
            conn.data_ready = False  # relearnt from the reader once credit returns
            if not conn.credit_requested:
                conn.credit_requested = True
                conn.need_credit_request = True
                self._schedule(conn)
            return
        conn.credit_requested = False
        if conn.data_ready:
            self._schedule(conn)
            return
        conn.reading = True
        self.loop.add_reader(conn.sock.fileno(), lambda: self._on_io(lambda: self._readable(conn)))

    def _readable(self, conn: _Conn) -> None:
        if conn.reading:
            conn.reading = False
            self.loop.remove_reader(conn.sock.fileno())
        if conn.closed:
            return
        conn.data_ready = True
        self._schedule(conn)
        self._process_rx()

    # -- host-initiated connections ---------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(16):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self._count("accept failed")
                log.debug("vsock: accept failed: %s", err)
                return
            sock.setblocking(False)
            if len(self._conns) + len(self._pending_hosts) >= MAX_CONNECTIONS:
                self._count("host connection refused: too many connections")
                sock.close()
                continue
            pending = _PendingHost(sock)
            self._pending_hosts.add(pending)
            self.loop.add_reader(sock.fileno(), partial(self._connect_line, pending))
            self.loop.call_later(CONNECT_TIMEOUT, partial(self._close_pending, pending))

    def _connect_line(self, pending: _PendingHost) -> None:
        try:
            peek = pending.sock.recv(CONNECT_LINE_MAX, socket.MSG_PEEK)
            # Consume only up to the newline: bytes after it are the stream's first bytes.
            # A partial line is consumed too, or a level-triggered reader would spin on it.
            newline = peek.find(b"\n")
            pending.line += pending.sock.recv(newline + 1 if newline >= 0 else len(peek))
        except BlockingIOError:
            return
        except OSError:
            self._close_pending(pending)
            return
        if newline < 0:
            if not peek or len(pending.line) >= CONNECT_LINE_MAX:
                self._count("host connection closed without a CONNECT line")
                self._close_pending(pending)
            return
        match = _CONNECT_LINE.fullmatch(bytes(pending.line))
        port = int(match.group(1)) if match else -1
        if not 0 <= port <= _U32 or not self._usable():
            self._count("bad CONNECT line" if port < 0 or port > _U32
                        else "host connection while the device is not running")
            self._close_pending(pending)
            return
        self.loop.remove_reader(pending.sock.fileno())
        self._pending_hosts.discard(pending)
        pending.closed = True  # the socket now belongs to the connection
        conn = _Conn(pending.sock, self._allocate_port(port), port, _ConnState.REQUESTED,
                     need_request=True)
        self._conns[conn.key] = conn
        self.loop.call_later(CONNECT_TIMEOUT, lambda: self._connect_timeout(conn))
        if self._holding:
            self._hold(conn)   # its request once the guest has handled the reset
            return
        self._schedule(conn)
        self._guarded(self._process_rx)

    def _allocate_port(self, peer_port: int) -> int:
        while True:  # ends: fewer than MAX_CONNECTIONS keys are taken
            port = self._next_port
            self._next_port = port + 1 if port < _U32 - 1 else HOST_PORT_FIRST
            if (port, peer_port) not in self._conns:
                return port

    def _connect_timeout(self, conn: _Conn) -> None:
        if not conn.closed and conn.state is _ConnState.REQUESTED:
            self._count("guest did not answer a host connection request")
            self._close(conn, rst=True)
            self._guarded(self._process_rx)

    # -- guest -> host: the tx queue ----------------------------------------------------------------
    def _process_tx(self) -> None:
        if not self._usable() or self.memory is None:
            return
        memory, queue = self.memory, self.queues[TX_QUEUE]
        handled = 0
        while handled < MAX_PACKETS_PER_RUN:
            chain = queue.pop(memory)
            if chain is None:
                break
            self._handle_packet(memory, chain)
            queue.add_used(memory, chain.head, 0)
            handled += 1
        if handled:
            assert self.interrupt is not None
            self.interrupt.trigger()
        if handled == MAX_PACKETS_PER_RUN:
            self.loop.call_soon(lambda: self._on_io(self._process_tx_then_rx))

    def _process_tx_then_rx(self) -> None:
        self._process_tx()
        self._process_rx()

    def _handle_packet(self, memory: GuestMemory, chain: DescriptorChain) -> None:
        packet = classify_tx(memory, chain, self.guest_cid)
        if packet.verdict is TxVerdict.DROP:
            assert packet.error is not None
            self._count(packet.error)
            return
        hdr = packet.header
        assert hdr is not None
        conn = self._conns.get((hdr.dst_port, hdr.src_port))
        if packet.verdict is TxVerdict.REFUSE:
            assert packet.error is not None
            self._count(packet.error)
            self._refuse(hdr, conn)
            return
        op = packet.op
        if conn is None:
            if op is Op.REQUEST:
                self._guest_connect(hdr)
            elif op is not Op.RST:
                self._queue_orphan_rst(hdr.dst_port, hdr.src_port)
            return
        conn.peer_buf_alloc = hdr.buf_alloc
        conn.peer_fwd_cnt = hdr.fwd_cnt
        if op is Op.RST:
            self._close(conn, rst=False)
        elif op is Op.RESPONSE:
            self._established(conn)
        elif op is Op.REQUEST:
            self._count("REQUEST on a connection that already exists")
            self._close(conn, rst=True)
        elif conn.state is not _ConnState.ESTABLISHED:
            self._count("op on a connection that is not established")
            self._close(conn, rst=True)
        elif op is Op.RW:
            self._guest_data(conn, memory, chain, hdr.len)
        elif op is Op.SHUTDOWN:
            self._guest_shutdown(conn, hdr.flags)
        elif op is Op.CREDIT_REQUEST:
            conn.need_credit_update = True
            self._schedule(conn)
        elif op is Op.CREDIT_UPDATE:
            pass  # the credit fields were taken above
        else:
            self._count("tx packet with an unknown op")
            self._close(conn, rst=True)
        if not conn.closed:
            self._arm_reader(conn)

    def _refuse(self, hdr: PacketHeader, conn: _Conn | None) -> None:
        if conn is not None:
            self._close(conn, rst=True)
        elif hdr.op != Op.RST:
            self._queue_orphan_rst(hdr.dst_port, hdr.src_port)

    def _guest_connect(self, hdr: PacketHeader) -> None:
        if len(self._conns) + len(self._pending_hosts) >= MAX_CONNECTIONS:
            self._count("guest connection refused: too many connections")
            self._queue_orphan_rst(hdr.dst_port, hdr.src_port)
            return
        path = f"{self.uds_path}_{hdr.dst_port}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except OSError as err:
            # ENOENT/ECONNREFUSED: nobody listens; EAGAIN: its backlog is full.
            sock.close()
            log.debug("vsock: guest connection to %s refused: %s", path, err)
            self._queue_orphan_rst(hdr.dst_port, hdr.src_port)
            return
        conn = _Conn(sock, hdr.dst_port, hdr.src_port, _ConnState.ESTABLISHED,
                     peer_buf_alloc=hdr.buf_alloc, peer_fwd_cnt=hdr.fwd_cnt,
                     need_response=True)
        self._conns[conn.key] = conn
        self._schedule(conn)
        self._arm_reader(conn)

    def _established(self, conn: _Conn) -> None:
        if conn.state is not _ConnState.REQUESTED:
            self._count("RESPONSE on a connection that did not request one")
            self._close(conn, rst=True)
            return
        conn.state = _ConnState.ESTABLISHED
        try:
            # A fresh socket's send buffer is empty: a 20-byte send cannot block.
            line = f"OK {conn.local_port}\n".encode()
            if conn.sock.send(line, socket.MSG_NOSIGNAL) != len(line):
                raise OSError(errno.EAGAIN, "short send of the OK line")
        except OSError as err:
            log.debug("vsock: host side of port %d went away: %s", conn.local_port, err)
            self._close(conn, rst=True)

    def _guest_data(self, conn: _Conn, memory: GuestMemory, chain: DescriptorChain,
                    length: int) -> None:
        if conn.peer_shut & SHUTDOWN_SEND:
            self._count("data after the guest shut down sending")
            self._close(conn, rst=True)
            return
        if len(conn.out) + length > BUF_ALLOC:
            self._count("guest overran the credit we advertised")
            self._close(conn, rst=True)
            return
        conn.rx_cnt = (conn.rx_cnt + length) & _U32
        if memory.native is not None and self.native_bytes and not conn.out:
            # Natively: one sendmsg straight from the guest's buffers; only what the
            # socket does not take now is copied into ``out``.
            try:
                sent = memory.native.vsock_send(chain.readable, HEADER_SIZE, length,
                                                conn.sock.fileno())
            except OSError as err:
                log.debug("vsock: host side of port %d failed: %s", conn.local_port, err)
                self._close(conn, rst=True)
                return
            conn.fwd_cnt = (conn.fwd_cnt + sent) & _U32
            if sent < length:
                conn.out += chain.read_readable(memory, length - sent, HEADER_SIZE + sent)
        else:
            conn.out += chain.read_readable(memory, length, HEADER_SIZE)
        self._flush(conn)

    def _guest_shutdown(self, conn: _Conn, flags: int) -> None:
        conn.peer_shut |= flags & (SHUTDOWN_RCV | SHUTDOWN_SEND)
        if conn.peer_shut & SHUTDOWN_RCV:
            conn.data_ready = False
            if conn.reading:
                conn.reading = False
                self.loop.remove_reader(conn.sock.fileno())
        if conn.peer_shut == SHUTDOWN_RCV | SHUTDOWN_SEND:
            # Linux waits for our RST once both directions are shut.
            conn.reset_after_flush = True
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Write buffered guest bytes to the Unix socket; settle shutdown and credit."""
        while conn.out:
            try:
                sent = conn.sock.send(conn.out[:MAX_PACKET_PAYLOAD], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                break
            except OSError as err:
                log.debug("vsock: host side of port %d failed: %s", conn.local_port, err)
                self._close(conn, rst=True)
                return
            del conn.out[:sent]
            conn.fwd_cnt = (conn.fwd_cnt + sent) & _U32
        fd = conn.sock.fileno()
        if conn.out and not conn.writing:
            conn.writing = True
            self._writers[fd] = conn
            self._wpoll.register(fd, select.EPOLLOUT)
        elif not conn.out and conn.writing:
            conn.writing = False
            self._writers.pop(fd, None)
            self._wpoll.unregister(fd)
        if conn.out:
            return
        if conn.peer_shut & SHUTDOWN_SEND and not conn.host_wr_shut:
            conn.host_wr_shut = True
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if conn.reset_after_flush or (conn.host_eof and conn.peer_shut & SHUTDOWN_SEND):
            self._close(conn, rst=True)
            return
        told_free = BUF_ALLOC - ((conn.rx_cnt - conn.last_told_fwd) & _U32)
        if conn.fwd_cnt != conn.last_told_fwd and told_free < BUF_ALLOC // 2:
            conn.need_credit_update = True
            self._schedule(conn)

    def _writable(self) -> None:
        for fd, _ in self._wpoll.poll(0):
            conn = self._writers.get(fd)
            if conn is None:
                continue
            self._on_io(partial(self._flush_then_rx, conn))

    def _flush_then_rx(self, conn: _Conn) -> None:
        self._flush(conn)
        self._process_rx()

    # -- host -> guest: the rx queue --------------------------------------------------------------
    def _process_rx(self) -> None:
        if not self._usable() or self.memory is None:
            return
        memory, queue = self.memory, self.queues[RX_QUEUE]
        delivered = 0
        while delivered < MAX_PACKETS_PER_RUN and (self._orphan_rsts or self._rx_queue):
            if (memory.native is not None and self.native_bytes and not self._orphan_rsts
                    and self._data_only(self._rx_queue[0])):
                served, buffers_left = self._native_data(memory, queue, self._rx_queue.popleft(),
                                                         MAX_PACKETS_PER_RUN - delivered)
                delivered += served
                if not buffers_left:
                    break  # the guest's next rx notification brings us back
                continue
            chain = queue.pop(memory)
            if chain is None:
                break  # the guest's next rx notification brings us back
            room = chain.writable_len - HEADER_SIZE
            if room < 0:
                raise VirtqueueError(f"rx buffer of {chain.writable_len} bytes cannot hold "
                                     f"a {HEADER_SIZE}-byte packet header")
            if self._orphan_rsts:
                packet: tuple[PacketHeader, bytes] | None = (self._orphan_rsts.popleft(), b"")
            else:
                conn = self._rx_queue.popleft()
                conn.queued = False
                packet = self._next_packet(conn, room)
                if not conn.closed and self._has_work(conn):
                    self._schedule(conn)
            if packet is None:
                queue.undo_pop()
                continue
            hdr, payload = packet
            deliver_rx(memory, queue, chain, hdr, payload)
            delivered += 1
        if delivered:
            assert self.interrupt is not None
            self.interrupt.trigger()
        if delivered == MAX_PACKETS_PER_RUN:
            self.loop.call_soon(lambda: self._on_io(self._process_rx))

    @staticmethod
    def _data_only(conn: _Conn) -> bool:
        """The connection owes the guest data and no control packet (those go first)."""
        return (conn.data_ready and not conn.closed and not conn.need_request
                and not conn.need_response and not conn.shutdown_to_send
                and not conn.need_credit_update and not conn.need_credit_request
                and conn.wants_host_data() and conn.credit() > 0)

    def _native_data(self, memory: GuestMemory, queue: Virtqueue, conn: _Conn,
                     budget: int) -> tuple[int, bool]:
        """Deliver a data-only connection's bytes natively (``GuestRam.vsock_rx_data``:
        readv from the Unix socket straight into rx buffers), at most
        ``NATIVE_RX_BATCH`` packets before the next connection's turn. Returns
        (packets delivered, whether rx buffers may be left)."""
        assert memory.native is not None
        conn.queued = False
        next_avail, next_used, packets, sent, stop = memory.native.vsock_rx_data(
            queue.size, queue.desc_table, queue.avail_ring, queue.used_ring,
            queue.next_avail, queue.next_used, conn.sock.fileno(),
            (HOST_CID, self.guest_cid, conn.local_port, conn.peer_port, BUF_ALLOC,
             conn.fwd_cnt & _U32),
            conn.credit(), min(budget, NATIVE_RX_BATCH))
        queue.next_avail, queue.next_used = next_avail, next_used
        if packets:
            conn.tx_cnt = (conn.tx_cnt + sent) & _U32
            conn.last_told_fwd = conn.fwd_cnt
        if stop == "drained":
            conn.data_ready = False
        elif stop == "eof":
            # The host will send no more. Tell the guest; keep receiving from it.
            conn.data_ready = False
            conn.host_eof = True
            if conn.peer_shut & SHUTDOWN_SEND and not conn.out:
                self._close(conn, rst=True)
            else:
                conn.shutdown_to_send |= SHUTDOWN_SEND
        elif isinstance(stop, int):
            log.debug("vsock: host side of port %d failed: %s", conn.local_port,
                      os.strerror(stop))
            self._close(conn, rst=True)
        if not conn.closed:
            self._arm_reader(conn)  # out of credit now? ask for more; drained: watch it
            if self._has_work(conn):
                self._schedule(conn)
        return packets, stop != "no_buffers"

    @staticmethod
    def _has_work(conn: _Conn) -> bool:
        return (conn.need_request or conn.need_response or bool(conn.shutdown_to_send)
                or conn.need_credit_update or conn.need_credit_request
                or (conn.data_ready and conn.credit() > 0))

    def _next_packet(self, conn: _Conn, room: int) -> tuple[PacketHeader, bytes] | None:
        """The next packet this connection owes the guest, if any."""
        if conn.closed:
            return None
        packet = self._control_packet(conn)
        if packet is None and conn.data_ready:
            packet = self._data_packet(conn, room)
            if packet is None and not conn.closed:
                self._arm_reader(conn)
                packet = self._control_packet(conn)
        if packet is not None:
            conn.last_told_fwd = conn.fwd_cnt
            conn.need_credit_update = False
            if not conn.closed:
                self._arm_reader(conn)  # out of credit now? ask for more
        return packet

    def _control_packet(self, conn: _Conn) -> tuple[PacketHeader, bytes] | None:
        if conn.need_request:
            conn.need_request = False
            return self._header(conn, Op.REQUEST), b""
        if conn.need_response:
            conn.need_response = False
            return self._header(conn, Op.RESPONSE), b""
        if conn.shutdown_to_send:
            flags, conn.shutdown_to_send = conn.shutdown_to_send, 0
            return self._header(conn, Op.SHUTDOWN, flags=flags), b""
        if conn.need_credit_update:
            return self._header(conn, Op.CREDIT_UPDATE), b""
        if conn.need_credit_request:
            conn.need_credit_request = False
            return self._header(conn, Op.CREDIT_REQUEST), b""
        return None

    def _data_packet(self, conn: _Conn, room: int) -> tuple[PacketHeader, bytes] | None:
        want = min(room, conn.credit(), MAX_PACKET_PAYLOAD)
        if want <= 0 or not conn.wants_host_data():
            conn.data_ready = False
            return None
        try:
            data = conn.sock.recv(want)
        except BlockingIOError:
            conn.data_ready = False
            return None
        except OSError as err:
            log.debug("vsock: host side of port %d failed: %s", conn.local_port, err)
            self._close(conn, rst=True)
            return None
        if not data:
            # EOF: the host will send no more. Tell the guest; keep receiving from it.
            conn.data_ready = False
            conn.host_eof = True
            if conn.peer_shut & SHUTDOWN_SEND and not conn.out:
                self._close(conn, rst=True)
                return None
            conn.shutdown_to_send |= SHUTDOWN_SEND
            return None
        conn.tx_cnt = (conn.tx_cnt + len(data)) & _U32
        return self._header(conn, Op.RW, len(data)), data

    # -- events -------------------------------------------------------------------------------------
    def _post_events(self) -> None:
        if not self._reset_event_pending or not self._usable() or self.memory is None:
            return
        memory, queue = self.memory, self.queues[EVENT_QUEUE]
        chain = queue.pop(memory)
        if chain is None:
            return  # delivered when the guest posts an event buffer
        written = chain.write_writable(memory, struct.pack("<I", EVENT_TRANSPORT_RESET))
        if written < 4:
            raise VirtqueueError(f"event buffer of {chain.writable_len} bytes cannot hold "
                                 f"a 4-byte event")
        queue.add_used(memory, chain.head, written)
        self._reset_event_pending = False
        self._reset_delivered = True
        self._buffers_at_delivery = queue.pending(memory)
        assert self.interrupt is not None
        self.interrupt.trigger()
