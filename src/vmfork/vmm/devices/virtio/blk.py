"""virtio-blk (device id 2), read-only, on a host file: a user image's root disk.

Why read-only. DESIGN.md decision 3: a disk image is named by its content hash
and shared by every sandbox forked from a snapshot of a guest that booted on it;
if any of them could write it, all the others (and the hash) would be wrong. The
guest keeps its writes in RAM (an overlay whose upper layer is tmpfs), which is
snapshotted and forked with the rest of guest memory. So the device offers
``VIRTIO_BLK_F_RO`` and refuses every request that would change the disk.

What is offered. ``VERSION_1``, ``RO``, ``SEG_MAX`` and ``SIZE_MAX``; config
space is ``capacity`` (512-byte sectors), ``size_max``, ``seg_max``. Not
offered: ``BLK_SIZE`` (the logical block size then is 512, the unit the
capacity is checked in; a larger one would also demand a capacity that is a
multiple of it), ``FLUSH`` (nothing is ever written, so there is no volatile
cache to flush; a ``T_FLUSH`` that arrives anyway is answered OK, which is true),
``DISCARD``/``WRITE_ZEROES`` (writes), ``MQ``, ``TOPOLOGY``, ``GEOMETRY``,
``CONFIG_WCE``. Without ``SEG_MAX`` Linux would use one data segment per
request; ``SEG_MAX`` x ``SIZE_MAX`` is the largest request a conforming driver
sends (the block layer splits bios to both limits), and it is our
``MAX_BYTES_PER_REQUEST``.

Requests (virtio 1.x, 5.2.6): a 16-byte device-readable header ``{le32 type,
le32 reserved, le64 sector}``, the data, and a device-writable status byte as
the very last byte of the chain. Descriptor layout is not assumed (2.6.4): the
header may span descriptors, and the status byte may share its descriptor with
data. ``T_IN`` reads straight from the file into the chain's writable buffers
with one ``preadv`` (no host copy, no allocation that grows with the request);
``T_GET_ID`` writes the disk id (the first 20 characters of its content key,
NUL-padded); ``T_FLUSH`` succeeds; ``T_OUT``, ``T_DISCARD``,
``T_WRITE_ZEROES`` and ``T_SECURE_ERASE`` get ``S_IOERR`` without a byte
touched (the spec's answer to a write on an RO device); any other type gets
``S_UNSUPP``.

What we do with a malformed request, by case. The rule: if the chain has a
status byte, the request can be completed and the guest told it failed, so it
gets ``S_IOERR`` (counted in ``malformed``) and the device keeps serving; only
a chain we cannot complete at all is a ``GuestError`` (DEVICE_NEEDS_RESET, as
every device here treats a broken driver).

* No device-writable byte (nowhere to put the status): ``GuestError``.
* Header shorter than 16 bytes: ``S_IOERR``; the request type is unknowable.
* Device-readable data after the header of an IN or GET_ID request (the data
  of those is device-writable by definition): ``S_IOERR``.
* An IN whose data is not a whole number of sectors, or more than
  ``MAX_BYTES_PER_REQUEST``, or that reaches past ``capacity``: ``S_IOERR``
  before anything is read; the guest's buffers are untouched. (Sector numbers
  are u64 and lengths sums of u32s; the bounds are checked without overflow.)
* A read the host cannot complete (an I/O error, or the file was shortened
  under us): ``S_IOERR``.

Bounds on what the guest can drive: a chain is at most the queue size long
(the queue checks that), so ``preadv`` gets at most 256 buffers (IOV_MAX is
1024); a request reads at most ``MAX_BYTES_PER_REQUEST``; a notification serves
at most ``MAX_REQUESTS_PER_NOTIFY`` requests and ``MAX_BYTES_PER_NOTIFY``
bytes, the rest on a later loop turn, so a busy disk does not starve the vsock
and network devices on the same I/O thread. Reads block that thread; the
image is usually in the host's page cache (every sandbox of an image reads the
same file), where they cost a memcpy.

Read-write disks (issue 14's volumes). A volume opened read-write is one sandbox's
own file, never a disk image named by content (DESIGN decision 3: "read-write
volumes belong to one sandbox at a time"), so the device may write it. Such a
device (``read_only=False``) offers ``FLUSH`` instead of ``RO``; ``T_OUT`` writes
the chain's device-readable data (after the header) with one ``pwritev``, checked
exactly as a read is (whole sectors, at most ``MAX_BYTES_PER_REQUEST``, inside the
capacity; device-writable data besides the status byte is malformed); ``T_FLUSH``
is ``fdatasync`` of the file, so what the guest flushed survives a host crash.
Discard and write-zeroes stay unoffered (``S_IOERR``). A read-only device refuses
every write whatever the fd allows, and ``open_disk`` opens a read-only disk
``O_RDONLY``, so a bug here still cannot change a shared image.

Volume slots (issue 14's volumes). A guest finds virtio-mmio devices only at boot
(``virtio_mmio.device=`` on its command line), so a child restored from a snapshot
cannot be given a new device; it can be given new media in a device that is already
there. A parent therefore boots with volume *slots*: virtio-blk devices made with
``volume_slot=True``, empty (capacity 0, no fd) unless a snapshot volume fills them
at boot. ``insert_media`` (on the I/O thread) gives an empty slot its disk and the
transport raises a configuration-change interrupt, on which Linux's virtio_blk
re-reads the capacity (``virtblk_config_changed_work``); the guest agent then mounts
it. Features are negotiated once, at boot, before anyone knows what a slot will
hold, so a slot offers ``FLUSH`` and never ``RO``: read-only media are refused every
write here (``S_IOERR``, as on an RO device) and mounted read-only by the agent. A
slot's media stay until the machine ends (no eject: a mounted file system would see
its disk vanish).

One implementation, native (``native/src/blk.rs``): the chain walk, the header
checks, the ``preadv``/``pwritev`` between the file and guest RAM, the status byte and
the used ring, under every rule above in that order. Where the transport can (the
native loop and register file, an irqfd), the queue is handed at activation to a
``_core.BlkQueue`` (``native/src/blk_serve.rs``) that the native loop serves on the
queue's ioeventfd without the GIL; it owns the ring indices until reset (or the fd's
``detach``), and its counters are added to this device's. Otherwise (a transport
without an ioeventfd and irqfd to hand over, or ``native_serve`` False, as
bench/blk.py's per-notification peer) a notification is served by one call into the
same code (``GuestRam.serve_blk``): the counters, the warnings to log, the queue
indices and the guest fault (if one ended the call) come back here, and the interrupt
and the re-arm stay here, so the call works from whatever loop calls ``queue_notify``.
Every kind of media takes it: the root image, a volume and a slot's media are all one
plain fd (copy-on-write lives in the guest's RAM overlay, not in this device). This
class owns the server: config space, features, media, activation and reset, state,
the counters of earlier activations, the log.

The backing fd is opened by the ``Machine`` (``open_disk``) and owned by it;
the device only reads it, and ``detach`` (on the I/O thread) makes sure no
read starts after the machine closes it.

Snapshots. ``BlkState`` holds the acked features, the disk's content key and
its capacity (an empty slot: key ``""``, capacity 0); the queue is the transport's,
the fd a live resource. A restore must be given the same disk: ``restore`` checks the key and the size (not the
content: hashes are checked when data enters the cache, and nothing at spawn
time may scale with the disk's size, DESIGN.md decisions 2 and 5).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

from vmfork.vmm.devices.virtio.device import VirtioDevice, VirtioInterrupt
from vmfork.vmm.devices.virtio.queue import Virtqueue
from vmfork.vmm.errors import GuestError, HostError, VirtqueueError
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.openfiles import open_ro, open_rw

try:
    from vmfork import _core
except ImportError:
    pass

log = logging.getLogger(__name__)

DEVICE_ID_BLK = 2
QUEUE_SIZE = 256
SECTOR_SIZE = 512

# Feature bits (virtio 1.x, 5.2.3).
F_SIZE_MAX = 1 << 1
F_SEG_MAX = 1 << 2
F_RO = 1 << 5
F_FLUSH = 1 << 9
OFFERED_FEATURES = F_SIZE_MAX | F_SEG_MAX | F_RO
OFFERED_FEATURES_RW = F_SIZE_MAX | F_SEG_MAX | F_FLUSH
OFFERED_FEATURES_SLOT = OFFERED_FEATURES_RW   # either kind of media may come later

# Request types and status values (virtio 1.x, 5.2.6).
T_IN = 0
T_OUT = 1
T_FLUSH = 4
T_GET_ID = 8
T_GET_LIFETIME = 10
T_DISCARD = 11
T_WRITE_ZEROES = 13
T_SECURE_ERASE = 14
# Everything that would change the disk: IOERR on an RO device, never UNSUPP, so
# the guest learns the disk refused the write rather than that we cannot parse it.
WRITE_TYPES = frozenset({T_OUT, T_DISCARD, T_WRITE_ZEROES, T_SECURE_ERASE})
S_OK = 0
S_IOERR = 1
S_UNSUPP = 2

ID_BYTES = 20

# 128 segments: with a 256-entry queue and no indirect descriptors, two requests
# of the largest size (plus header and status) fit at once. 64 KiB per segment:
# page-cache pages are 4 KiB and rarely contiguous, so this seldom splits anything.
SEG_MAX = 128
SIZE_MAX = 64 * 1024
MAX_BYTES_PER_REQUEST = SEG_MAX * SIZE_MAX       # 8 MiB
MAX_REQUESTS_PER_NOTIFY = 64
MAX_BYTES_PER_NOTIFY = 4 * MAX_BYTES_PER_REQUEST

_DISK_KEY = re.compile(r"[0-9a-f]{8,64}")


def validate_disk_key(key: str) -> str:
    """Return ``key`` if it is a content key (lowercase hex, 8 to 64 digits)."""
    if not isinstance(key, str) or not _DISK_KEY.fullmatch(key):
        raise ValueError(f"disk key {key!r} is not a content key (8 to 64 lowercase hex "
                         "digits)")
    return key


def open_disk(path: str, writable: bool = False, what: str = "root disk") -> tuple[int, int]:
    """Open a disk image (read-only unless ``writable``); return the fd and its size
    in bytes.

    The size must be a positive multiple of 512: the guest addresses the disk in
    sectors, and a partial last sector could be neither read whole nor refused
    consistently.
    """
    try:
        # Disks may be pre-opened for a jailed VMM (vmm/openfiles.py): read-only ones
        # shared by many, a read-write volume (its sandbox's own file) for writing.
        fd = open_rw(path) if writable else open_ro(path)
    except OSError as err:
        raise HostError(f"{what} {path}: open: {err.strerror}", op="open_disk",
                        errno=err.errno) from err
    try:
        size = os.lseek(fd, 0, os.SEEK_END)   # also right for a block device (st_size 0)
    except OSError as err:
        os.close(fd)
        raise HostError(f"{what} {path}: size: {err.strerror}", op="open_disk",
                        errno=err.errno) from err
    if size <= 0 or size % SECTOR_SIZE:
        os.close(fd)
        raise HostError(f"{what} {path} is {size} bytes; a disk image must be a positive "
                        f"multiple of {SECTOR_SIZE} bytes (pad it, e.g. mksquashfs pads to "
                        "4 KiB by default)", op="open_disk")
    return fd, size


@dataclass
class BlkState:
    """Plain-data twin of ``VirtioBlk`` (the queue is the transport's, the fd is live)."""

    acked_features: int
    disk_key: str
    capacity_bytes: int
    read_only: bool = True   # absent in state files from before read-write volumes
    volume_slot: bool = False   # absent in state files from before volume slots


@dataclass
class BlkCounters:
    requests: int = 0
    reads: int = 0
    bytes_read: int = 0
    flushes: int = 0
    get_ids: int = 0
    writes: int = 0
    bytes_written: int = 0
    write_errors: int = 0     # writes refused (bounds, size) or failed on the host
    writes_refused: int = 0   # OUT on a read-only disk, DISCARD, WRITE_ZEROES, SECURE_ERASE
    read_errors: int = 0      # reads refused (bounds, size) or failed on the host
    malformed: int = 0        # requests answered IOERR for their layout
    unsupported: int = 0


class VirtioBlk(VirtioDevice):
    device_type = DEVICE_ID_BLK
    queue_max_sizes = (QUEUE_SIZE,)
    # False keeps ``serve_blk`` entered per notification even where the loop could
    # serve the queue itself (the tests and bench/blk.py compare the two entries).
    native_serve = True

    def __init__(self, loop: EventLoop, fd: int | None, size: int, disk_key: str,
                 path: str = "<disk>", read_only: bool = True,
                 volume_slot: bool = False) -> None:
        """``fd``/``size`` from ``open_disk`` (``writable=True`` for a device with
        ``read_only=False``); the caller keeps owning the fd. A ``volume_slot`` may
        be made empty (``fd`` None, ``size`` 0, ``disk_key`` "") and given its disk
        later (``insert_media``)."""
        super().__init__()
        self.volume_slot = volume_slot
        self.loop = loop
        self._counters = BlkCounters()
        if volume_slot:
            self.features |= OFFERED_FEATURES_SLOT
        else:
            self.features |= OFFERED_FEATURES if read_only else OFFERED_FEATURES_RW
        self.fd: int | None = None
        self.capacity_bytes = 0
        self.disk_key = ""
        self.read_only = True
        self.path = path
        self._id = b"\0" * ID_BYTES
        self._server: _core.BlkQueue | None = None
        self._detach_server: Callable[[], None] | None = None
        if fd is None:
            if not volume_slot or size or disk_key:
                raise ValueError("only a volume slot is made without a disk, and then with "
                                 "size 0 and no key")
            return
        self._set_media(fd, size, disk_key, read_only, path)

    def _set_media(self, fd: int, size: int, disk_key: str, read_only: bool,
                   path: str) -> None:
        if size <= 0 or size % SECTOR_SIZE:
            raise ValueError(f"disk size {size} is not a positive multiple of {SECTOR_SIZE}")
        self.disk_key = validate_disk_key(disk_key)
        self.read_only = read_only
        self.path = path
        self._id = disk_key[:ID_BYTES].encode().ljust(ID_BYTES, b"\0")
        # The capacity last: a request served meanwhile is bounded by the old one (0).
        self.fd = fd
        self.capacity_bytes = size
        if self._server is not None:
            self._server.set_media(fd, size, read_only, self._id)

    @property
    def empty(self) -> bool:
        return self.capacity_bytes == 0

    @property
    def wants_ioeventfds(self) -> bool:
        # An empty slot has nothing to serve: most never get a disk, and the eventfd,
        # KVM_IOEVENTFD and loop reader each would cost are a spawn's system calls.
        return not (self.volume_slot and self.empty)

    def rewake(self) -> None:
        """A disk went into this slot, and its transport gave the queue an ioeventfd:
        serve it natively from now on, woken by that fd (on the I/O thread)."""
        self._let_go_of_server()
        self._serve_natively()

    def insert_media(self, fd: int, size: int, disk_key: str, read_only: bool,
                     path: str) -> None:
        """Give an empty volume slot its disk (call on the I/O thread; the caller
        keeps owning ``fd`` and then raises the configuration-change interrupt)."""
        if not self.volume_slot:
            raise HostError(f"virtio-blk {self.path} is not a volume slot; its disk is fixed",
                            op="insert_media")
        if not self.empty:
            raise HostError(f"volume slot already holds {self.disk_key} ({self.path})",
                            op="insert_media")
        self._set_media(fd, size, disk_key, read_only, path)

    # -- config space (changes only by insert_media, on the I/O thread) ---------------
    def config_bytes(self) -> bytes:
        return struct.pack("<QII", self.capacity_bytes // SECTOR_SIZE, SIZE_MAX, SEG_MAX)

    # -- device contract (I/O thread) -----------------------------------------------
    def queue_notify(self, index: int) -> None:
        if index == 0:
            self._serve()

    def detach(self) -> None:
        """Stop using the fd (call on the I/O thread before the owner closes it). The
        device's life ends with its fd (there is no eject), so the native server, if
        one serves, goes too."""
        self.fd = None
        if self._server is not None:
            self._server.detach()   # returns once no read or write uses the fd
        self._let_go_of_server()

    # -- served natively, on the loop, without the GIL ---------------------------------
    def activate(self, memory: GuestMemory, queues: list[Virtqueue],
                 interrupt: VirtioInterrupt) -> None:
        super().activate(memory, queues, interrupt)
        self._serve_natively()

    def _serve_natively(self) -> None:
        """Hand the queue to a ``_core.BlkQueue`` where the transport can (the native
        loop and register file, an irqfd); otherwise ``_serve`` enters it per notification."""
        memory, interrupt = self.memory, self.interrupt
        # An empty slot has no server until its disk comes (``rewake``): the server
        # would take its line's eventfd, which an empty slot need never make
        # (``IrqLine``), and the ``IOERR``s it owes meanwhile come from ``_serve``.
        if (not self.native_serve or memory is None or (self.volume_slot and self.empty)
                or memory.native is None or interrupt is None or self._server is not None
                or not self.queues[0].ready):
            return
        native = interrupt.native_queue(0)
        if native is None:
            return
        queue = self.queues[0]
        self._server = _core.BlkQueue(
            memory.native, native.registers, native.epoch,
            (queue.size, queue.desc_table, queue.avail_ring, queue.used_ring,
             queue.next_avail, queue.next_used),
            native.irq_fd, native.notify_fd, -1 if self.fd is None else self.fd,
            self.capacity_bytes, self.read_only, self._id, MAX_REQUESTS_PER_NOTIFY,
            MAX_BYTES_PER_NOTIFY, self._native_report)
        native.attach(self._server)
        self._detach_server = native.detach

    def _let_go_of_server(self) -> None:
        """Take the indices and counters back from the native server and close it."""
        server, self._server = self._server, None
        if server is None:
            return
        if self.queues:
            self.queues[0].next_avail, self.queues[0].next_used = server.sync()
        for name, n in server.counters():
            setattr(self._counters, name, getattr(self._counters, name) + n)
        assert self._detach_server is not None
        self._detach_server()
        self._detach_server = None
        server.close()

    def _native_report(self, fault: BaseException | None,
                       warnings: list[tuple[str, int, int, int]]) -> None:
        """What the native server leaves for Python (on the loop thread, with the GIL)."""
        for kind, a, b, c in warnings:
            self._log_native_warning(kind, a, b, c)
        if fault is not None and self.interrupt is not None and isinstance(fault, GuestError):
            self.interrupt.device_error(fault)

    @property
    def serving_natively(self) -> bool:
        """Whether the native loop serves the queue without the GIL (this activation)."""
        return self._server is not None

    def set_native_serve(self, on: bool) -> None:
        """Make the native server, or let it go and serve per notification (the
        benchmark's two peers, in one guest); on the I/O thread, as activation does."""
        self.native_serve = on
        if on:
            self._serve_natively()
        else:
            self._let_go_of_server()

    @property
    def counters(self) -> BlkCounters:
        """The requests served so far, by every path (a copy)."""
        total = dataclasses.replace(self._counters)
        if self._server is not None:
            for name, n in self._server.counters():
                setattr(total, name, getattr(total, name) + n)
        return total

    def sync_queues(self) -> None:
        if self._server is not None and self.queues:
            self.queues[0].next_avail, self.queues[0].next_used = self._server.sync()

    def reset(self) -> None:
        self._let_go_of_server()
        super().reset()

    def _serve(self) -> None:
        if not self._usable() or self.memory is None:
            return
        if self._server is not None:
            # A guest fault raises (as below); a spent budget without an ioeventfd to
            # re-arm with is served again on a later loop turn (as below).
            if self._server.notify():
                self.loop.call_soon(lambda: self._guarded(self._serve))
            return
        served, more = self._serve_native(self.memory, self.queues[0])
        if served:
            assert self.interrupt is not None
            self.interrupt.trigger()
        if more:
            self.loop.call_soon(lambda: self._guarded(self._serve))

    def _serve_native(self, memory: GuestMemory, queue: Virtqueue) -> tuple[int, bool]:
        """One call into native/src/blk.rs: the chain walk, the checks and the
        preadv/pwritev between the file and guest RAM happen there; the counters, the
        log and the queue indices come back here; (requests served, whether any are
        left)."""
        if memory.native is None:
            raise HostError("virtio-blk is served only natively, and this guest memory has "
                            "no native view (is the native core built?)", op="blk serve")
        if not queue.ready:  # the driver never enabled it: no rings to walk
            raise VirtqueueError("pop from a queue that is not ready")
        (queue.next_avail, queue.next_used, served, _moved, more, counters, warnings,
         error) = memory.native.serve_blk(
            queue.size, queue.desc_table, queue.avail_ring, queue.used_ring,
            queue.next_avail, queue.next_used, -1 if self.fd is None else self.fd,
            self.capacity_bytes, self.read_only, self._id, MAX_REQUESTS_PER_NOTIFY,
            MAX_BYTES_PER_NOTIFY)
        for name, n in counters:
            setattr(self._counters, name, getattr(self._counters, name) + n)
        for kind, a, b, c in warnings:
            self._log_native_warning(kind, a, b, c)
        if error is not None:
            raise error
        return served, more

    def _log_native_warning(self, kind: str, a: int, b: int, c: int) -> None:
        """A warning the native request path left for the log: a host read, write or
        fdatasync that failed or came up short."""
        if kind == "read_failed":
            log.warning("virtio-blk %s: read of %d bytes at %d failed: %s", self.path, a, b,
                        OSError(c, os.strerror(c)))
        elif kind == "read_short":
            log.warning("virtio-blk %s: read %d of %d bytes at %d (file shortened?)",
                        self.path, a, b, c)
        elif kind == "write_failed":
            log.warning("virtio-blk %s: write of %d bytes at %d failed: %s", self.path, a, b,
                        OSError(c, os.strerror(c)))
        elif kind == "write_short":
            log.warning("virtio-blk %s: wrote %d of %d bytes at %d", self.path, a, b, c)
        else:
            log.warning("virtio-blk %s: fdatasync failed: %s", self.path,
                        OSError(c, os.strerror(c)))

    # -- snapshots ----------------------------------------------------------------------
    def save(self) -> BlkState:
        return BlkState(acked_features=self.acked_features, disk_key=self.disk_key,
                        capacity_bytes=self.capacity_bytes, read_only=self.read_only,
                        volume_slot=self.volume_slot)

    def restore(self, state: BlkState) -> None:
        """Take the state of a snapshot; it must be of this very disk (key and size)."""
        if state.volume_slot != self.volume_slot:
            raise HostError(f"the snapshot's disk {state.disk_key or '(empty)'} was "
                            f"{'a' if state.volume_slot else 'not a'} volume slot, and "
                            f"{self.path} is {'' if self.volume_slot else 'not '}one",
                            op="restore")
        if state.disk_key != self.disk_key:
            raise HostError(f"the snapshot's root disk is {state.disk_key}, but this machine "
                            f"was given {self.disk_key} ({self.path})", op="restore")
        if state.capacity_bytes != self.capacity_bytes:
            raise HostError(f"the snapshot's root disk {state.disk_key} had "
                            f"{state.capacity_bytes} bytes, but {self.path} has "
                            f"{self.capacity_bytes}: not the same disk", op="restore")
        if state.read_only != self.read_only:
            want = "read-only" if state.read_only else "read-write"
            raise HostError(f"the snapshot's disk {state.disk_key} was {want}, and "
                            f"{self.path} is not given {want}", op="restore")
        self.acked_features = state.acked_features
