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
there. A parent therefore boots with volume *slots*: virtio-blk devices whose record
says ``volume_slot``, empty (capacity 0, no fd) unless a snapshot volume fills them
at boot. ``insert_media`` gives an empty slot its disk and ``config_changed`` raises
a configuration-change interrupt, on which Linux's virtio_blk
re-reads the capacity (``virtblk_config_changed_work``); the guest agent then mounts
it. Features are negotiated once, at boot, before anyone knows what a slot will
hold, so a slot offers ``FLUSH`` and never ``RO``: read-only media are refused every
write here (``S_IOERR``, as on an RO device) and mounted read-only by the agent. A
slot's media stay until the machine ends (no eject: a mounted file system would see
its disk vanish).

One implementation, native: ``native/src/blk.rs`` (the chain walk, the header checks,
the ``preadv``/``pwritev`` between the file and guest RAM, the status byte and the used
ring, under every rule above in that order) served on the loop's ioeventfd without the
GIL by ``native/src/blk_serve.rs``, whose server the device's native transport
(``native/src/transport.rs``, ``DeviceKind::Blk``) builds at DRIVER_OK from the
register file and retires at a reset, so no read or write starts on a file after it
closes. Every kind of media takes it: the root image, a volume and a slot's media are
all one plain fd (copy-on-write lives in the guest's RAM overlay, not in this device),
opened by the ``Machine`` (``open_disk``) or a native child's jail and duplicated by
the transport, which owns its copy until the machine closes. A slot's new media go in
with ``NativeDevice.insert_media`` (the queue's ioeventfd with them: an empty slot has
none, ``plan.wants_ioeventfds``) and ``config_changed`` (the register file's config
bytes, a new generation, the interrupt): ``Machine.attach_volume``. This module keeps
what is not the device: the records, the constants both sides serve by, ``open_disk``
and ``validate_disk_key``.

Snapshots. ``BlkState`` holds the acked features, the disk's content key and
its capacity (an empty slot: key ``""``, capacity 0); the queue is the transport's,
the fd a live resource. A restore must be given the same disk: the machine checks the key
(``OpenedDisk.check_restores``) and the transport the size (not the
content: hashes are checked when data enters the cache, and nothing at spawn
time may scale with the disk's size, DESIGN.md decisions 2 and 5).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from vmfork.vmm.errors import HostError
from vmfork.vmm.openfiles import open_ro, open_rw

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
    """A virtio-blk device's record (the queue is the transport's, the fd is live)."""

    acked_features: int
    disk_key: str
    capacity_bytes: int
    read_only: bool = True   # absent in state files from before read-write volumes
    volume_slot: bool = False   # absent in state files from before volume slots
