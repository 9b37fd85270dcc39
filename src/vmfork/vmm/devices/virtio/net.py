"""virtio-net (device id 1) with a user-space back end on a Linux tap device.

Queues: rx (0, host -> guest frames) and tx (1, guest -> host frames); no
control queue, no multiqueue. Config space: the MAC (``VIRTIO_NET_F_MAC``)
followed by a link status word that always says "up" (``VIRTIO_NET_F_STATUS``
is not offered, so the driver does not read it).

The tap is opened ``IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`` with a 12-byte vnet
header (``TUNSETVNETHDRSZ``). That header is byte for byte the
``virtio_net_hdr`` of a VERSION_1 device (flags, gso_type, hdr_len, gso_size,
csum_start, csum_offset, num_buffers), so frames pass between the rings and
the tap without being parsed or copied: a tx chain's readable buffers are
``writev``-ed to the tap straight out of guest memory, and a tap frame is
``readv``-ed straight into an rx chain's writable buffers. The one field we
write ourselves is ``num_buffers`` (always 1: we do not offer MRG_RXBUF, so
every frame goes into one chain; the tap leaves those two bytes alone).

Offloads. We offer checksum offload and TSO both ways. The tap is told which
offloads the *guest* accepted (``TUNSETOFFLOAD`` at activation, from the acked
features), so the host kernel only hands us partial checksums and 64 KiB GSO
frames when the guest driver can take them; in the other direction the host
kernel validates whatever header the guest wrote (a bad one fails the write,
which we count as a dropped frame). Without MRG_RXBUF and with GUEST_TSO, the
Linux driver posts "big" rx chains of ~68 KiB, so one frame always fits.

Bounds on what the guest can drive: ``MAX_FRAMES_PER_RUN`` frames per queue
per loop turn (a tx backlog continues on a later turn; rx is a level-triggered
reader that the loop calls again); a tx frame over ``MAX_TX_BYTES`` or under
the header size is dropped; a chain is at most the queue size long (the queue
checks that), so ``readv``/``writev`` never get more than 256 buffers. An rx
chain too short for the header is a driver bug: DEVICE_NEEDS_RESET.

The tap is read only while the guest has rx chains posted: with none, the
reader is removed (a readable tap would otherwise spin the loop) and put back
when the driver notifies the rx queue. Frames then wait in the tap's queue,
and the host kernel drops them when it is full, as a NIC would.

Interrupts and kicks are moderated. Whatever wakes the device (a tx or rx
notification, a readable tap, a tx re-arm), the wake serves the tx queue, then the
rx queue while the tap is read, and raises at most one interrupt for both, and only
if the driver wants one (``virtq::needs_interrupt``). We offer
VIRTIO_RING_F_EVENT_IDX, which Linux takes: the driver then says in ``used_event``
which used index it wants an interrupt at, and the device, finding a ring empty, says
in ``avail_event`` that it wants a kick at the next chain and not before (virtq.rs,
"Notification suppression"). Without it the avail ring's NO_INTERRUPT flag is
honoured. The device is the only one offering the feature: only its paths ask before
they interrupt. Serving both queues per wake matters as much: a fast device
completing each tx chain at once interrupts once per frame whatever EVENT_IDX says,
because the guest re-enables interrupts before each; the host's answer to a tx
frame (a TCP ACK, written during our ``writev``) is often in the tap by then and
goes in under the same interrupt (bench/net.py, docs/design-notes.md).

One implementation, native. The device's transport is ``native/src/transport.rs``'s
(``DeviceKind::Net``, ``_core.NativeDevice`` from Python, ``Machine._native_device``):
it serves config space and features, sets the tap's offloads from the acked features
at each activation, and hands both queues and the tap to ``native/src/net_serve.rs``,
which the native loop serves without ever taking the GIL: the tx queue's ioeventfd,
the rx queue's ioeventfd (watch the tap again) and the tap each wake it, with the
wake, budget, re-arm and reader rule above, and the used-buffer interrupt raised
through the register file and the irqfd. The frame paths are ``native/src/net.rs``:
the chain walk, the size checks, the ``writev``/``readv`` between guest RAM and the
tap, ``num_buffers`` and the used ring, under every rule above in that order. A guest
fault makes the device NEEDS_RESET; the frames the tap refuses are only counted
(``NativeDevice.net_counters``, ``NetCounters``' names). This module keeps the
contract, its constants, ``NetState`` (the record both sides read, through
``devices/plan.py``), the MAC's text form and the tap's attach (``open_tap``).

Without a tap (``NativeDevice.restore``'s ``tap_fd=None``) the device is a NIC with its
cable pulled:
the guest sees a working device, tx frames are dropped (counted), nothing is
received. A snapshot taken with networking can so be restored without it.

Snapshots. ``NetState`` holds the MAC and the acked features; the queues are
the transport's, the tap is a live resource. On restore the MAC comes from the
state, not the config: the guest driver read it at boot and keeps using it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from vmfork.vmm import openfiles
from vmfork.vmm.devices.virtio.queue import VIRTIO_RING_F_EVENT_IDX
from vmfork.vmm.errors import HostError

DEVICE_ID_NET = 1
RX_QUEUE, TX_QUEUE = 0, 1
QUEUE_SIZE = 256

# Feature bits (virtio 1.x, 5.1.3).
F_CSUM = 1 << 0         # the guest may send frames with a partial checksum
F_GUEST_CSUM = 1 << 1   # we may send the guest frames with a partial checksum
F_MAC = 1 << 5
F_GUEST_TSO4 = 1 << 7
F_GUEST_TSO6 = 1 << 8
F_GUEST_ECN = 1 << 9
F_HOST_TSO4 = 1 << 11
F_HOST_TSO6 = 1 << 12
F_HOST_ECN = 1 << 13
# Interrupt and kick moderation (virtq.rs, "Notification suppression"); only this
# device offers it, as only its paths (net.rs, net_serve.rs) ask ``needs_interrupt``
# before they interrupt.
F_EVENT_IDX = VIRTIO_RING_F_EVENT_IDX
OFFERED_FEATURES = (F_CSUM | F_GUEST_CSUM | F_MAC | F_GUEST_TSO4 | F_GUEST_TSO6
                    | F_GUEST_ECN | F_HOST_TSO4 | F_HOST_TSO6 | F_HOST_ECN | F_EVENT_IDX)

VNET_HDR_SIZE = 12       # struct virtio_net_hdr_mrg_rxbuf, what VERSION_1 always uses
NUM_BUFFERS_OFFSET = 10
LINK_UP = 1
MAX_FRAMES_PER_RUN = 256
# A GSO frame is at most 64 KiB of IP packet plus the Ethernet (and a VLAN) header.
MAX_TX_BYTES = VNET_HDR_SIZE + 65536 + 64


_MAC_TEXT = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")


def parse_mac(text: str) -> bytes:
    """``"52:54:00:12:34:56"`` -> 6 bytes; refuses multicast and all-zero addresses."""
    if not _MAC_TEXT.match(text):
        raise ValueError(f"MAC {text!r} is not six colon-separated hex bytes")
    mac = bytes(int(part, 16) for part in text.split(":"))
    if mac[0] & 1:
        raise ValueError(f"MAC {text} is a multicast address (lowest bit of the first byte)")
    if mac == bytes(6):
        raise ValueError("MAC 00:00:00:00:00:00 is not a usable address")
    return mac


def format_mac(mac: bytes) -> str:
    return ":".join(f"{b:02x}" for b in mac)


def open_tap(name: str) -> int:
    """Attach to tap ``name`` in this thread's network namespace; returns the fd.

    The tap normally exists already (``runtime.network`` creates it persistent,
    addressed and up); if it does not, the kernel creates a transient one that
    disappears with the fd. Non-blocking, close-on-exec, vnet header on. A jailed VMM
    gets the descriptor its jail attached before the privileges went
    (``vmm/openfiles.take_tap``): it can neither open ``/dev/net/tun`` nor attach.
    """
    preopened = openfiles.take_tap(name)
    if preopened is not None:
        return preopened
    if not valid_tap_name(name):
        raise ValueError(f"tap name {name!r} is not a Linux interface name "
                         f"(1-15 of letters, digits, '_', '.', '-')")
    from vmfork import _core  # the jail's implementation (native/src/child.rs)
    try:
        fd: int = _core.open_tap(name)
    except OSError as err:
        where = "" if err.strerror == "open /dev/net/tun" else f"tap {name}: "
        raise HostError(f"{where}{err.strerror}: {os.strerror(err.errno or 0)}",
                        op="open_tap", errno=err.errno) from err
    return fd


def valid_tap_name(name: str) -> bool:
    """Whether ``name`` is a Linux interface name (1-15 of letters, digits, '_', '.', '-')."""
    return bool(_IFNAME.match(name))


@dataclass
class NetState:
    """A net device's record (the queues are the transport's, the tap is live)."""

    mac: str
    acked_features: int


@dataclass
class NetCounters:
    """A net device's frames over its life (``NativeDevice.net_counters``' names)."""

    rx_frames: int = 0
    rx_bytes: int = 0
    rx_dropped: int = 0   # frames the tap refused to give us whole
    tx_frames: int = 0
    tx_bytes: int = 0
    tx_dropped: int = 0   # malformed, oversized, refused by the tap, or no tap
