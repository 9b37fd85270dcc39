"""virtio-vsock (device id 19) with a user-space back end on host Unix sockets.

One implementation, native: the device's transport is ``native/src/transport.rs``'s
(``DeviceKind::Vsock``, ``_core.NativeDevice`` from Python, ``Machine._native_device``),
which binds the listener, serves config space (the guest CID) and features, and hands
the queues to ``native/src/vsock_serve.rs`` (with ``vsock_packet.rs``, ``vsock_io.rs``
and ``vsock_connect_line.rs``) at each activation; that server runs on the native loop
without the GIL: the connection table and its state machine, credit, the listener and
its CONNECT lines, the per-connection sockets, the timeouts, the transport-reset event
and the hold, and the three queues. This module keeps the contract below, its
constants and counter keys, ``VsockState`` (the record both sides read, through
``devices/plan.py``) and the packet header the tests' guest side writes.

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
the transport's). Connections are live host resources and are not saved: a restore
arms a VIRTIO_VSOCK_EVENT_TRANSPORT_RESET for when the device is re-activated, which
makes the guest drop its stale connections and keep its listeners;
``NativeDevice.transport_reset()`` does the same on demand. The guest handles the event some time
after it runs again (Linux: in a work item, which resets every connected socket, then
gives the event buffer back and notifies the queue), and a host connection it accepted
before then would be reset with the stale ones: so a host connection request made after
a reset is held until the guest has made a new event buffer available (it handled the
event) and notified the queue, or for at most ``RESET_ACK_WAIT_S``, and a connection
made right after a restore works the first time.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import NamedTuple

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
CONNECT_TIMEOUT = 60.0
"""Seconds for the CONNECT line, and for the guest's answer. A guest starved of CPU
(many VMs on few cores) can take tens of seconds to answer a request, and abandoning
it does not get it answered sooner: the new request queues behind the same starved
guest, which then serves both (a 100-guest batch on one emulated CPU answered after
8-25 s; at 20 s, most of such a batch's first connections were abandoned, design notes
session 30). Half of a restored child's ready deadline (``vmmchild.READY_TIMEOUT``),
so a request that did go missing is still retried in time."""
HOST_PORT_FIRST = 1 << 30
RESET_ACK_WAIT_S = 10.0
"""Seconds host connection requests wait for the guest to acknowledge a transport reset
(module docstring) before they go out anyway: well inside ``CONNECT_TIMEOUT``, which
runs from the request too."""


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


# Counter keys of refused tx packets (``NativeDevice.vsock_errors``), fixed strings: never a
# guest number, so the guest cannot grow the dict. native/src/vsock_packet.rs has the
# same words.
SHORT_HEADER = "tx packet shorter than the header"
WRONG_CID = "tx packet with a wrong source or destination CID"
BAD_LENGTH = "tx packet payload beyond the chain or the 64 KiB limit"
BAD_TYPE = "tx packet of an unknown socket type"


@dataclass
class VsockState:
    """A vsock device's record. Connections are not state: they are reset."""

    guest_cid: int
    acked_features: int
