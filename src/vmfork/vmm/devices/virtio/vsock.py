"""virtio-vsock (device id 19) with a user-space back end on host Unix sockets.

One implementation: ``_core.VsockServe`` (``native/src/vsock_serve.rs``, with
``vsock_packet.rs``, ``vsock_io.rs`` and ``vsock_connect_line.rs``) serves the device on
the native loop without the GIL: the connection table and its state machine, credit,
the listener and its CONNECT lines, the per-connection sockets, the timeouts, the
transport-reset event and the hold, and the three queues. This class owns it: the
listener's bind, config space (the guest CID), features, activation (the queues handed
to the server) and reset, ``VsockState``'s save and restore, the counters and close.
There is no Python twin (guest memory without its native view, or a loop that is not
the native one, is a host error here, as at rng, the balloon, blk and net).

Queues: rx (0, device -> guest packets), tx (1, guest -> device packets),
event (2, device -> guest events). Config space: ``guest_cid`` as a u64.

The contract the server keeps (its tests hold it to these words, ``tests/unit/
test_virtio_vsock*.py``). Host side, following Firecracker's convention:

* **Host-initiated.** We listen on ``uds_path``. A host process connects and
  writes ``CONNECT <port>\\n``; we pick a fresh host-side port (from 2**30 up,
  numbered on from a random start per device: a restored guest may still hold sockets
  of its source's last ports, and answers a REQUEST from one with RST), send
  OP_REQUEST to the guest, and on OP_RESPONSE answer ``OK <hostport>\\n``
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

Bounds on what the guest can drive: ``MAX_CONNECTIONS`` connections,
``BUF_ALLOC`` buffered bytes each, ``MAX_PACKET_PAYLOAD`` per tx packet,
``MAX_PACKETS_PER_RUN`` packets handled per loop turn per queue (the rest on a
later turn), ``MAX_ORPHAN_RSTS`` queued resets to unknown connections (beyond
that they are dropped and counted; the guest's own timeouts cover them).

Malformed tx packets (short header, payload beyond the chain or above 64 KiB,
wrong CIDs, unknown type or op) are dropped and counted in ``errors`` under the fixed
keys below; if they belong to a connection, it is reset. They are the guest's business
and never make the device NEEDS_RESET; only a broken virtqueue does.

Snapshots. ``VsockState`` holds the guest CID and the acked features (the queues are
the transport's). Connections are live host resources and are not saved: ``restore``
arms a VIRTIO_VSOCK_EVENT_TRANSPORT_RESET for when the device is re-activated, which
makes the guest drop its stale connections and keep its listeners;
``transport_reset()`` does the same on demand. The guest handles the event some time
after it runs again (Linux: in a work item, which resets every connected socket, then
gives the event buffer back and notifies the queue), and a host connection it accepted
before then would be reset with the stale ones: so a host connection request made after
a reset is held until the guest has made a new event buffer available (it handled the
event) and notified the queue, or for at most ``RESET_ACK_WAIT_S``, and a connection
made right after a restore works the first time.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from vmfork.vmm.devices.virtio.device import DEVICE_ID_VSOCK, VirtioDevice, VirtioInterrupt
from vmfork.vmm.devices.virtio.queue import Virtqueue
from vmfork.vmm.errors import GuestError, HostError
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.native import CORE_BUILT

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

# The bounds of the module docstring; native/src/vsock_serve.rs has the same numbers.
BUF_ALLOC = 256 * 1024
MAX_PACKET_PAYLOAD = 64 * 1024
MAX_CONNECTIONS = 1024
MAX_PACKETS_PER_RUN = 256
MAX_ORPHAN_RSTS = 1024
CONNECT_TIMEOUT = 20.0  # seconds for the CONNECT line, and for the guest's answer (a guest
# starved of CPU -- many VMs on few cores -- can take seconds to answer a request)
HOST_PORT_FIRST = 1 << 30
RESET_ACK_WAIT_S = 10.0
"""Seconds host connection requests wait for the guest to acknowledge a transport reset
(module docstring) before they go out anyway: well inside ``CONNECT_TIMEOUT``, which
runs from the request too."""
_U32 = 0xFFFF_FFFF


class PacketHeader(NamedTuple):
    """``struct virtio_vsock_hdr``, for the tests' and the fuzz harness's guest side."""

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


# Counter keys of refused tx packets (``VirtioVsock.errors``), fixed strings: never a
# guest number, so the guest cannot grow the dict. native/src/vsock_packet.rs has the
# same words.
SHORT_HEADER = "tx packet shorter than the header"
WRONG_CID = "tx packet with a wrong source or destination CID"
BAD_LENGTH = "tx packet payload beyond the chain or the 64 KiB limit"
BAD_TYPE = "tx packet of an unknown socket type"


@dataclass
class VsockState:
    """Plain-data twin of ``VirtioVsock``. Connections are not state: they are reset."""

    guest_cid: int
    acked_features: int


class VirtioVsock(VirtioDevice):
    device_type = DEVICE_ID_VSOCK
    queue_max_sizes = (QUEUE_SIZE, QUEUE_SIZE, QUEUE_SIZE)

    def __init__(self, loop: EventLoop, uds_path: str,
                 guest_cid: int = DEFAULT_GUEST_CID) -> None:
        super().__init__()
        if guest_cid <= HOST_CID or guest_cid >= _U32:
            raise ValueError(f"guest CID {guest_cid} must be in 3..2**32-2")
        if not (CORE_BUILT and isinstance(loop, NativeEventLoop)):
            raise HostError("vsock is served only natively: it needs the native core and "
                            "the native loop", op="vsock")
        self.loop = loop
        self.uds_path = uds_path
        self.guest_cid = guest_cid
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
        self._detach_queues: list[Callable[[], None]] = []
        server = self._server = _core.VsockServe(
            self._listener.fileno(), uds_path, guest_cid, CONNECT_TIMEOUT, RESET_ACK_WAIT_S,
            self._native_fault)

        def add_server() -> None:
            loop.add_native_reader(server.epoll_fd, server)

        self._call_on_loop(add_server)

    @property
    def errors(self) -> dict[str, int]:
        """Refused packets and connections by reason (a copy; fixed keys)."""
        return dict(self._server.errors())

    @property
    def connection_count(self) -> int:
        return self._server.connection_count

    def _native_fault(self, err: BaseException) -> None:
        """The native server found a guest fault (on the loop thread, with the GIL)."""
        if self.interrupt is not None and isinstance(err, GuestError):
            self.interrupt.device_error(err)
        else:
            log.error("vsock: native server stopped: %s", err)

    def sync_queues(self) -> None:
        """Copy the server's ring indices into the transport's queues (a capture reads
        them there)."""
        if len(self.queues) == 3 and self._detach_queues:
            for queue, (avail, used) in zip(self.queues, self._server.sync()):
                queue.next_avail, queue.next_used = avail, used

    # -- device contract ----------------------------------------------------------------
    def config_bytes(self) -> bytes:
        return struct.pack("<Q", self.guest_cid)

    def activate(self, memory: GuestMemory, queues: list[Virtqueue],
                 interrupt: VirtioInterrupt) -> None:
        """Hand the three queues to the server. A transport that cannot (no native view
        of guest memory, a loop that is not the native one, no irqfd) fails the
        activation as a host error: there is no other way to serve them."""
        super().activate(memory, queues, interrupt)
        natives = [interrupt.native_queue(i) for i in range(3)]
        if memory.native is None or any(n is None for n in natives) or len(queues) != 3:
            raise HostError("vsock is served only natively: it needs native guest memory, "
                            "the native loop and register file and an irqfd", op="activate")
        rx, tx, ev = (n for n in natives if n is not None)

        def rings(q: Virtqueue) -> tuple[int, int, int, int, int, int]:
            return (q.size, q.desc_table, q.avail_ring, q.used_ring, q.next_avail,
                    q.next_used)

        self._server.attach(memory.native, rx.registers, rx.epoch, self.guest_cid,
                            rings(queues[RX_QUEUE]), rings(queues[TX_QUEUE]),
                            rings(queues[EVENT_QUEUE]), rx.irq_fd,
                            (rx.notify_fd, tx.notify_fd, ev.notify_fd),
                            CONNECT_TIMEOUT, RESET_ACK_WAIT_S)
        for index, native in enumerate((rx, tx, ev)):
            native.attach(self._server, count_interrupts=index == RX_QUEUE)
            self._detach_queues.append(native.detach)

    def queue_notify(self, index: int) -> None:
        # A QueueNotify exit or the activation's catch-up (ioeventfds go to the server on
        # the loop); a guest fault comes back through _native_fault.
        if self._detach_queues:
            self._server.notify(index)

    def reset(self) -> None:
        """The driver reset the device: the server lets go of the queues and drops every
        connection (a new driver has no stale sockets)."""
        self._release_server_queues()
        self._server.detach()
        super().reset()

    def transport_reset(self) -> None:
        """Drop every connection and tell the guest (EVENT_TRANSPORT_RESET). Any thread."""
        self._call_on_loop(self._server.transport_reset)

    def close(self) -> None:
        """Release the host resources: connections, the listener and its path."""

        def do() -> None:
            self.loop.remove_reader(self._server.epoll_fd)
            self._release_server_queues()
            self._server.close()   # after the loop let go of its epoll
            self._listener.close()
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
        self._server.arm_reset_event(state.guest_cid)

    def _release_server_queues(self) -> None:
        """Give the queues' ioeventfds back to the transport (a reset, the close)."""
        detach, self._detach_queues = self._detach_queues, []
        for release in detach:
            release()

    def _call_on_loop(self, fn: Callable[[], None]) -> None:
        if self.loop.in_loop_thread():
            fn()
        else:
            self.loop.call_soon(fn)
