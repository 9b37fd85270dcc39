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
if the driver wants one (``Virtqueue.needs_interrupt``). We offer
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

One implementation, native. The frame paths are ``native/src/net.rs``: the chain walk,
the size checks, the ``writev``/``readv`` between guest RAM and the tap,
``num_buffers`` and the used ring, under every rule above in that order. By default,
where the transport can (the native loop and register file, an irqfd, both queues
ready), activation hands the device's whole hot path to a ``_core.NetQueues``
(``native/src/net_serve.rs``) that the native loop serves without ever taking the GIL:
the tx queue's ioeventfd, the rx queue's ioeventfd (watch the tap again) and the tap
each wake it, with the same wake (both queues, one interrupt), the same budget and
re-arm, the same reader rule (the tap is not watched while the guest has no rx
buffers) and the used-buffer interrupt raised through the register file and the irqfd.
It owns both queues' ring indices until reset (``sync_queues`` copies them back for a
snapshot) and counts the frames (``counters`` adds its counts in). What needs Python
comes back through ``_native_report``: a guest fault (DEVICE_NEEDS_RESET), a failed tap
read (logged), and the tx frames the tap refused, logged only if this module's logger
was at DEBUG when the device was activated (else they are only counted, and a guest
sending bad frames never makes the VMM take the GIL). Where the transport cannot hand
the queues over (or ``native_serve`` is False, bench/net.py's other peer), the wake
below runs on the loop and enters the same frame paths once per queue
(``GuestRam.net_tx``/``net_rx``); the counters' increments, the refused writes to log,
why the rx loop stopped and the guest fault come back to it, and the interrupt, the
re-arm and the tap's reader stay here. ``test_virtio_net_native.py`` holds that wake to
``net_serve.rs``'s. The Python frame paths this module had are gone (one
implementation per device, issue 19).

Without a tap (``tap_fd=None``) the device is a NIC with its cable pulled:
the guest sees a working device, tx frames are dropped (counted), nothing is
received. A snapshot taken with networking can so be restored without it.

Snapshots. ``NetState`` holds the MAC and the acked features; the queues are
the transport's, the tap is a live resource. On restore the MAC comes from the
state, not the config: the guest driver read it at boot and keeps using it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

from vmfork.vmm import openfiles
from vmfork.vmm.devices.virtio.device import VirtioDevice, VirtioInterrupt
from vmfork.vmm.devices.virtio.queue import VIRTIO_RING_F_EVENT_IDX, Virtqueue
from vmfork.vmm.errors import GuestError, HostError, VirtqueueError
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop
from vmfork.vmm.memory import GuestMemory

try:
    from vmfork import _core
except ImportError:
    pass

log = logging.getLogger(__name__)

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
# device offers it, as only its paths (net.rs, net_serve.rs, this file) ask
# ``needs_interrupt`` before they interrupt.
F_EVENT_IDX = VIRTIO_RING_F_EVENT_IDX
OFFERED_FEATURES = (F_CSUM | F_GUEST_CSUM | F_MAC | F_GUEST_TSO4 | F_GUEST_TSO6
                    | F_GUEST_ECN | F_HOST_TSO4 | F_HOST_TSO6 | F_HOST_ECN | F_EVENT_IDX)

VNET_HDR_SIZE = 12       # struct virtio_net_hdr_mrg_rxbuf, what VERSION_1 always uses
NUM_BUFFERS_OFFSET = 10
LINK_UP = 1
MAX_FRAMES_PER_RUN = 256
# A GSO frame is at most 64 KiB of IP packet plus the Ethernet (and a VLAN) header.
MAX_TX_BYTES = VNET_HDR_SIZE + 65536 + 64

# <linux/if_tun.h> (the attach itself, TUNSETIFF and TUNSETVNETHDRSZ, is native/src/child.rs's)
TUNSETOFFLOAD = 0x400454D0       # _IOW('T', 208, unsigned int)
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04
TUN_F_TSO_ECN = 0x08
IFNAMSIZ = 16

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


def tap_offloads(acked_features: int) -> int:
    """The ``TUN_F_*`` flags matching what the guest driver accepted to receive."""
    flags = 0
    if acked_features & F_GUEST_CSUM:
        flags |= TUN_F_CSUM
        if acked_features & F_GUEST_TSO4:
            flags |= TUN_F_TSO4
        if acked_features & F_GUEST_TSO6:
            flags |= TUN_F_TSO6
        if acked_features & (F_GUEST_TSO4 | F_GUEST_TSO6) and acked_features & F_GUEST_ECN:
            flags |= TUN_F_TSO_ECN
    return flags


@dataclass
class NetState:
    """Plain-data twin of ``VirtioNet`` (the queues are the transport's, the tap is live)."""

    mac: str
    acked_features: int


@dataclass
class NetCounters:
    rx_frames: int = 0
    rx_bytes: int = 0
    rx_dropped: int = 0   # frames the tap refused to give us whole
    tx_frames: int = 0
    tx_bytes: int = 0
    tx_dropped: int = 0   # malformed, oversized, refused by the tap, or no tap


class VirtioNet(VirtioDevice):
    device_type = DEVICE_ID_NET
    queue_max_sizes = (QUEUE_SIZE, QUEUE_SIZE)

    def __init__(self, loop: EventLoop, mac: bytes, tap_fd: int | None,
                 native_serve: bool = True) -> None:
        """``tap_fd`` (from ``open_tap``) is owned by the device from here on.
        ``native_serve``: hand the device to the native loop at activation where the
        transport can (False keeps the wake below, for the tests and the benchmark)."""
        super().__init__()
        if len(mac) != 6:
            raise ValueError(f"a MAC is 6 bytes, not {len(mac)}")
        self.features |= OFFERED_FEATURES
        self.loop = loop
        self.mac = mac
        self.tap_fd = tap_fd
        self._counters = NetCounters()
        self._reading = False
        self.native_serve = native_serve
        self._server: _core.NetQueues | None = None
        self._stop_server_fds: Callable[[], None] | None = None

    @property
    def counters(self) -> NetCounters:
        """Frames and bytes moved and dropped so far: a copy, with the native server's
        counts added in while it serves."""
        total = replace(self._counters)
        server = self._server
        if server is not None:
            for name, n in server.counters():
                setattr(total, name, getattr(total, name) + n)
        return total

    @property
    def serving_natively(self) -> bool:
        """Whether the native loop serves the device without the GIL (this activation)."""
        return self._server is not None

    # -- config space -----------------------------------------------------------------
    def config_bytes(self) -> bytes:
        return self.mac + struct.pack("<H", LINK_UP)

    # -- device contract (I/O thread) -----------------------------------------------
    def activate(self, memory: GuestMemory, queues: list[Virtqueue],
                 interrupt: VirtioInterrupt) -> None:
        super().activate(memory, queues, interrupt)
        for queue in queues:
            queue.event_idx = bool(self.acked_features & F_EVENT_IDX)
        if self.tap_fd is not None:
            offloads = tap_offloads(self.acked_features)
            try:
                fcntl.ioctl(self.tap_fd, TUNSETOFFLOAD, offloads)
            except OSError as err:
                # The tap then keeps offloads off and sends only plain frames, which
                # every driver takes: slower, not wrong.
                log.warning("virtio-net: tap refused offloads %#x (%s)", offloads, err)
        if self.native_serve:
            self._start_server()

    def queue_notify(self, index: int) -> None:
        server = self._server
        if server is not None:
            # A QueueNotify exit or the activation's catch-up (ioeventfds go to the
            # server on the loop); a guest fault comes back through _native_report.
            if index in (RX_QUEUE, TX_QUEUE) and server.notify(index):
                self.loop.call_soon(lambda: self._guarded(lambda: self.queue_notify(TX_QUEUE)))
            return
        if index == RX_QUEUE:
            self._start_reading()
        elif index == TX_QUEUE:
            self._transmit()

    def reset(self) -> None:
        self._stop_server()
        self._stop_reading()
        super().reset()

    def close(self) -> None:
        """Release the tap (call once the machine's vCPUs are stopped, after the
        transport's close): the native server first, which holds duplicates of the tap
        and the eventfds, and this device through ``_native_report``."""

        def do() -> None:
            self._stop_server()
            self._stop_reading()
            if self.tap_fd is not None:
                os.close(self.tap_fd)
                self.tap_fd = None

        if self.loop.in_loop_thread():
            do()
        else:
            self.loop.call_soon(do)

    # -- served natively --------------------------------------------------------------
    def _start_server(self) -> None:
        """Hand both queues and the tap to a ``_core.NetQueues`` on the native loop, if
        the transport can serve them there (else the wake below enters net.rs)."""
        memory, interrupt = self.memory, self.interrupt
        loop = self.loop
        if (self._server is not None or memory is None or memory.native is None
                or interrupt is None or not isinstance(loop, NativeEventLoop)
                or len(self.queues) != 2 or not all(q.ready for q in self.queues)):
            return
        rx, tx = interrupt.native_queue(RX_QUEUE), interrupt.native_queue(TX_QUEUE)
        if rx is None or tx is None:
            return
        rxq, txq = self.queues
        self._stop_reading()   # the Python reader, if this device was in Python until now
        server = _core.NetQueues(
            memory.native, tx.registers, tx.epoch,
            (rxq.size, rxq.desc_table, rxq.avail_ring, rxq.used_ring, rxq.next_avail,
             rxq.next_used),
            (txq.size, txq.desc_table, txq.avail_ring, txq.used_ring, txq.next_avail,
             txq.next_used),
            tx.irq_fd, self.tap_fd, rx.notify_fd, tx.notify_fd, MAX_FRAMES_PER_RUN,
            MAX_TX_BYTES, log.isEnabledFor(logging.DEBUG), self._native_report,
            event_idx=txq.event_idx)
        tap = server.tap_fd
        if tap is not None:
            loop.add_native_reader(tap, server)
        rx.attach(server, count_interrupts=False)
        tx.attach(server)

        def release() -> None:
            tx.detach()
            rx.detach()
            if tap is not None:
                loop.remove_reader(tap)
            server.close()   # after the loop let go of the tap's duplicate

        self._server, self._stop_server_fds = server, release

    def _stop_server(self) -> None:
        """Take the device back from the native server (on the loop thread): its ring
        indices into the ``Virtqueue``s, its counts into ours, the ioeventfds to the
        transport's readers; its duplicated fds are closed."""
        server, release = self._server, self._stop_server_fds
        if server is None or release is None:
            return
        self.sync_queues()
        for name, n in server.counters():
            setattr(self._counters, name, getattr(self._counters, name) + n)
        self._server, self._stop_server_fds = None, None
        release()

    def _native_report(self, fault: BaseException | None, refused: list[tuple[int, int]],
                       read_error: int | None) -> None:
        """What the native server leaves for Python (on the loop thread, with the GIL):
        the same log lines and the same fault as the wake below."""
        for length, err in refused:
            log.debug("virtio-net: tx frame of %d bytes dropped: %s", length,
                      OSError(err, os.strerror(err)))
        if read_error is not None:
            log.error("virtio-net: tap read failed, receive paused: %s",
                      OSError(read_error, os.strerror(read_error)))
        if fault is None:
            return
        if isinstance(fault, GuestError) and self.interrupt is not None:
            self.interrupt.device_error(fault)
        else:
            log.error("virtio-net: native server stopped: %s", fault)

    def sync_queues(self) -> None:
        server = self._server
        if server is not None and len(self.queues) == 2:
            rx, tx = self.queues
            rx.next_avail, rx.next_used, tx.next_avail, tx.next_used = server.sync()

    def set_native_serve(self, on: bool) -> None:
        """Serve the running device on the native loop, or by the wake below, from now
        on (on the loop thread): the queues and the tap change hands with their
        indices. The benchmark compares the two in one guest this way."""
        self.native_serve = on
        if not self._usable():
            return
        if on and self._server is None:
            self._start_server()
            for index in (RX_QUEUE, TX_QUEUE):   # whatever the guest offered meanwhile
                self.queue_notify(index)
        elif not on and self._server is not None:
            self._stop_server()
            self._start_reading()   # a wake: both queues

    # -- a wake -----------------------------------------------------------------------
    def _wake(self) -> None:
        """Whatever woke the device (a tx or rx notification, a readable tap, a tx run's
        re-arm): the tx queue, then the rx queue while the tap is read, then at most one
        interrupt for both (the device has one line), if the driver wants one
        (``Virtqueue.needs_interrupt``). Serving both queues per wake is what moderates a
        fast device: the answer to a tx frame (a TCP ACK the host wrote during the
        ``writev``) is often in the tap already and goes in under the frame's
        interrupt. ``net_serve.rs`` serves a wake the same way."""
        if not self._usable() or self.memory is None:
            return
        memory, txq, rxq = self.memory, self.queues[TX_QUEUE], self.queues[RX_QUEUE]
        if memory.native is None:
            raise HostError("virtio-net is served only natively, and this guest memory has "
                            "no native view (is the native core built?)", op="net wake")
        tx_old, rx_old = txq.next_used, rxq.next_used
        sent = self._transmit_native(memory, txq)
        if self._reading and self.tap_fd is not None:
            self._receive_native(memory, rxq, self.tap_fd)
        if txq.needs_interrupt(memory, tx_old) or rxq.needs_interrupt(memory, rx_old):
            assert self.interrupt is not None
            self.interrupt.trigger()
        if sent == MAX_FRAMES_PER_RUN:
            self.loop.call_soon(lambda: self._guarded(self._wake))

    # -- guest -> host -----------------------------------------------------------------
    def _transmit(self) -> None:
        """A tx notification: a wake."""
        self._wake()

    def _transmit_native(self, memory: GuestMemory, queue: Virtqueue) -> int:
        """Up to ``MAX_FRAMES_PER_RUN`` tx chains, in native/src/net.rs: the walk, the
        checks and one writev per frame straight from guest RAM; the counters, the log
        and the queue indices come back here. The number put on the used ring."""
        assert memory.native is not None
        if not queue.ready:  # the driver never enabled it: no rings to walk
            raise VirtqueueError("pop from a queue that is not ready")
        queue.next_avail, queue.next_used, sent, counters, refused, error = memory.native.net_tx(
            queue.size, queue.desc_table, queue.avail_ring, queue.used_ring,
            queue.next_avail, queue.next_used, -1 if self.tap_fd is None else self.tap_fd,
            MAX_FRAMES_PER_RUN, MAX_TX_BYTES, queue.event_idx)
        self._count(counters)
        for length, err in refused:
            log.debug("virtio-net: tx frame of %d bytes dropped: %s", length,
                      OSError(err, os.strerror(err)))
        if error is not None:
            raise error
        return sent

    def _count(self, increments: list[tuple[str, int]]) -> None:
        for name, n in increments:
            setattr(self._counters, name, getattr(self._counters, name) + n)

    # -- host -> guest -----------------------------------------------------------------
    def _start_reading(self) -> None:
        """An rx notification: read the tap again, and a wake."""
        if not self._usable():
            return
        if self.tap_fd is not None and not self._reading:
            self.loop.add_reader(self.tap_fd, self._tap_readable)
            self._reading = True
        self._wake()

    def _stop_reading(self) -> None:
        if self._reading and self.tap_fd is not None:
            self.loop.remove_reader(self.tap_fd)
        self._reading = False

    def _tap_readable(self) -> None:
        if not self._usable():
            self._stop_reading()  # a failed device must not leave a readable fd spinning
            return
        self._guarded(self._receive)

    def _receive(self) -> None:
        """The tap is readable: a wake, which moves its frames into posted rx chains,
        one frame per chain."""
        self._wake()

    def _receive_native(self, memory: GuestMemory, queue: Virtqueue, tap_fd: int) -> int:
        """Up to ``MAX_FRAMES_PER_RUN`` frames from the tap, in native/src/net.rs: the
        walk, one readv per frame straight into the chain (a frame that does not fit
        whole is dropped), num_buffers, the used ring; the counters, why it stopped and
        the queue indices come back here. The number of frames delivered."""
        assert memory.native is not None
        if not queue.ready:  # the driver never enabled it: no rings to walk
            raise VirtqueueError("pop from a queue that is not ready")
        queue.next_avail, queue.next_used, delivered, counters, stop, error = \
            memory.native.net_rx(queue.size, queue.desc_table, queue.avail_ring,
                                 queue.used_ring, queue.next_avail, queue.next_used, tap_fd,
                                 MAX_FRAMES_PER_RUN, queue.event_idx)
        self._count(counters)
        if error is not None:
            raise error
        if stop == "no_buffers":
            self._stop_reading()  # until the driver posts buffers (queue_notify)
        elif isinstance(stop, int):
            log.error("virtio-net: tap read failed, receive paused: %s",
                      OSError(stop, os.strerror(stop)))
            self._stop_reading()
        return delivered

    # -- snapshots ----------------------------------------------------------------------
    def save(self) -> NetState:
        return NetState(mac=format_mac(self.mac), acked_features=self.acked_features)

    def restore(self, state: NetState) -> None:
        self.mac = parse_mac(state.mac)
        self.acked_features = state.acked_features
