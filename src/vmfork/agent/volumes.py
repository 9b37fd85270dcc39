"""Mounting volumes in the guest (stdlib only).

The host gives a volume its disk in a virtio-blk *volume slot* (vmm/devices/virtio/
blk.py), at boot for a snapshot's volumes or after a restore for a spawn's, and then
sends ``mount_volume`` with the slot's device number, the mount point, the mode and
the disk's size in sectors. The device number is the slot's place among the
``virtio_mmio.device=`` entries of the kernel command line, and Linux names the
platform device of the N-th entry ``virtio-mmio.N``, so the block device is the one
under ``/sys/bus/platform/devices/virtio-mmio.N``; the guest's ``vdX`` letters follow
probe order and are not relied on.

A disk put into a slot after boot reaches the guest as a configuration-change
interrupt on which virtio_blk re-reads the capacity from a work queue, so the mount
waits (bounded: ``CAPACITY_WAIT_S``) until the block device shows the size the host
announced. The file system is recognised by its superblock magic (erofs, squashfs,
ext4), not guessed by trying mounts, and a read-only volume is mounted ``MS_RDONLY``
whatever it is (the device refuses writes to it as well).
"""

from __future__ import annotations

import os
import struct
import time
from typing import Any

from vmfork.agent import system
from vmfork.agent.request import OpError, get_bool, get_int, get_path, os_error

CAPACITY_WAIT_S = 10.0
MS_RDONLY = 0x1
MAX_DEVICE = 63

_EROFS_MAGIC = 0xE0F5E1E2        # le32 at byte 1024
_EXT_MAGIC = 0xEF53              # le16 at byte 1024 + 56
_SQUASHFS_MAGIC = b"hsqs"        # at byte 0


def slot_block_device(device: int, sys_root: str = "/sys") -> str | None:
    """The block device name (``vdb``) of platform device ``virtio-mmio.<device>``,
    None if it has none."""
    platform = os.path.join(sys_root, "bus", "platform", "devices", f"virtio-mmio.{device}")
    try:
        virtio = sorted(n for n in os.listdir(platform) if n.startswith("virtio"))
    except OSError:
        return None
    for name in virtio:
        try:
            blocks = os.listdir(os.path.join(platform, name, "block"))
        except OSError:
            continue
        if blocks:
            return min(blocks)
    return None


def file_system_type(head: bytes) -> str | None:
    """erofs, squashfs or ext4 from a disk's first 2 KiB; None for anything else."""
    if head[:4] == _SQUASHFS_MAGIC:
        return "squashfs"
    if len(head) >= 1028 and struct.unpack_from("<I", head, 1024)[0] == _EROFS_MAGIC:
        return "erofs"
    if len(head) >= 1082 and struct.unpack_from("<H", head, 1080)[0] == _EXT_MAGIC:
        return "ext4"
    return None


def _sectors(block: str) -> int:
    with open(f"/sys/block/{block}/size") as f:
        return int(f.read().strip() or 0)


def _mounted_at(path: str) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(len(p := line.split()) > 1 and p[1] == path for line in f)
    except OSError:
        return False


def mount_volume(req: dict[str, Any]) -> dict[str, Any]:
    """The ``mount_volume`` op: ``device``, ``guest_path``, ``read_only``, ``sectors``."""
    slot = get_int(req, "device", None)
    sectors = get_int(req, "sectors", None, minimum=1)
    if slot is None or slot > MAX_DEVICE or sectors is None:
        raise OpError("bad_request", f"mount_volume: 'device' (the N of virtio-mmio.N, "
                                     f"0..{MAX_DEVICE}) and 'sectors' (the disk's size, "
                                     ">= 1) are required")
    target = os.path.normpath(get_path(req, "guest_path"))
    read_only = get_bool(req, "read_only", True)
    if target == "/":
        raise OpError("bad_request", "mount_volume: a volume cannot be mounted on /")
    if _mounted_at(target):
        raise OpError("exists", f"mount_volume: something is mounted on {target} already")
    deadline = time.monotonic() + CAPACITY_WAIT_S
    block, seen = None, 0
    while True:
        block = block or slot_block_device(slot)
        if block is not None:
            try:
                seen = _sectors(block)
            except (OSError, ValueError):
                seen = 0
            if seen == sectors:
                break
        if time.monotonic() > deadline:
            where = f"/dev/{block} shows {seen} sectors" if block else "no block device"
            raise OpError("not_ready", f"mount_volume: virtio-mmio.{slot}: {where} after "
                                       f"{CAPACITY_WAIT_S:.0f} s, the host gave {sectors}")
        time.sleep(0.02)
    device = f"/dev/{block}"
    try:
        with open(device, "rb") as f:
            head = f.read(2048)
    except OSError as err:
        raise os_error(err, "mount_volume: read the superblock", device) from err
    fstype = file_system_type(head)
    if fstype is None:
        raise OpError("bad_request", f"mount_volume: {device} holds no erofs, "
                                     "squashfs or ext4 file system")
    try:
        os.makedirs(target, 0o755, exist_ok=True)
        system.mount(device, target, fstype, MS_RDONLY if read_only else 0)
    except OSError as err:
        raise os_error(err, f"mount_volume: mount -t {fstype} {device}", target) from err
    return {"device": device, "fstype": fstype, "guest_path": target,
            "read_only": read_only, "sectors": seen}
