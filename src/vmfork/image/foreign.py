"""Kernels and root file systems from elsewhere: forkd's ``POST /v1/snapshots`` body.

A forkd client names a ``kernel`` (a vmlinux) and a ``rootfs`` (an ext4, squashfs or
erofs image) on the daemon's host. vmfork boots them as it boots its own images: the
rootfs becomes the guest's read-only root disk under a RAM overlay (decision 3: the
host's file is never written, whatever forkd's ``rw`` said), and vmfork's boot
initramfs mounts it and starts the agent on the rootfs's own Python.

Both files are checked before anything boots, so a kernel that could never run the
agent is refused with the reason instead of a guest that hangs until a timeout:

* the kernel must be what the VMM's loader takes (``vmm/x86/elf.py``): an uncompressed
  64-bit x86 ELF ``vmlinux``, not a bzImage;
* it must have what a vmfork guest needs: virtio-mmio devices declared on the
  command line (the VMM declares every device there), virtio vsock (the agent's only
  channel), virtio-blk (the root disk), an initramfs (the boot /init), devtmpfs,
  overlayfs (the RAM overlay), Unix sockets, and the rootfs's file system. Read from
  the embedded configuration (``CONFIG_IKCONFIG``) when there is one, else from the
  ELF symbol table (an unstripped vmlinux, which is what kernel builds produce); a
  kernel with neither is refused, since nothing would tell a hang from a boot;
* the rootfs's type is read from its superblock magic.

Then both are copied into the image cache under the SHA-256 of their bytes (a copy,
not a link: the user may rewrite their file, and a snapshot's disk must never change
under its children) and recorded as an image ``forkd-<hash>``, so that snapshots of it
pack, list and spawn like any other. The same pair always gives the same image.

Whether the rootfs has a Python for the agent can only be seen by mounting it: the
boot /init looks for ``/usr/bin/python3`` (and two other places) when the disk has no
``.vmfork/agent-python``, and stops with a ``vmfork-init:`` line naming what is missing.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import struct
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from vmfork.image import (
    DEFAULT_CMDLINE,
    DISK_FILE,
    KERNEL_FILE,
    GuestImage,
    ImageError,
    disk_path,
    kernel_path,
    read_record,
    record_path,
    write_record,
)
from vmfork.image.cache import cached_entry
from vmfork.image.debian import sha256_file


class ForeignImageRefused(ImageError, ValueError):
    """A kernel or rootfs that vmfork cannot boot; the message says why and what to use."""


KERNEL_HELP = ("vmfork boots an uncompressed x86-64 ELF vmlinux (the file a kernel build "
               "leaves at the top of its tree, as Firecracker does) built with "
               "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES, CONFIG_VIRTIO_VSOCKETS, "
               "CONFIG_VIRTIO_BLK, CONFIG_BLK_DEV_INITRD, CONFIG_DEVTMPFS, "
               "CONFIG_OVERLAY_FS, CONFIG_UNIX and the rootfs's file system; vmfork's own "
               "kernel is one (`vmfork image build` builds it)")

MAX_KERNEL_BYTES = 512 << 20


@dataclass(frozen=True)
class _Need:
    what: str
    config: str
    symbols: tuple[str, ...]     # any one of them shows the option is built in


_KERNEL_NEEDS = (
    _Need("virtio-mmio devices on the command line", "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES",
          ("vm_cmdline_set",)),
    _Need("virtio vsock (the agent's channel)", "CONFIG_VIRTIO_VSOCKETS",
          ("virtio_vsock_probe", "virtio_vsock_init")),
    _Need("virtio-blk (the root disk)", "CONFIG_VIRTIO_BLK", ("virtblk_probe",)),
    _Need("an initramfs (vmfork's boot /init)", "CONFIG_BLK_DEV_INITRD",
          ("unpack_to_rootfs",)),
    _Need("devtmpfs", "CONFIG_DEVTMPFS", ("devtmpfs_init",)),
    _Need("overlayfs (the root's RAM overlay)", "CONFIG_OVERLAY_FS", ("ovl_fill_super",)),
    _Need("Unix sockets", "CONFIG_UNIX", ("unix_stream_connect",)),
)

_FS_NEEDS = {
    "ext4": _Need("ext4 (the rootfs)", "CONFIG_EXT4_FS", ("ext4_fill_super",)),
    "squashfs": _Need("squashfs (the rootfs)", "CONFIG_SQUASHFS", ("squashfs_fill_super",)),
    "erofs": _Need("erofs (the rootfs)", "CONFIG_EROFS_FS",
                   ("erofs_fc_fill_super", "erofs_fill_super")),
}

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_SHT_SYMTAB = 2


def _kernel_symbols(data: bytes) -> set[str] | None:
    """Names in the ELF's ``.symtab`` (None when it has none: a stripped kernel)."""
    (_, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, _) = _EHDR.unpack_from(data, 0)
    if shoff == 0 or shentsize != _SHDR.size or shoff + shnum * shentsize > len(data):
        return None
    sections = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    for (_, sh_type, _, _, offset, size, link, _, _, entsize) in sections:
        if sh_type != _SHT_SYMTAB or entsize != _SYM.size or link >= shnum:
            continue
        str_off, str_size = sections[link][4], sections[link][5]
        if offset + size > len(data) or str_off + str_size > len(data):
            return None
        strtab = data[str_off:str_off + str_size]
        names = set()
        for pos in range(offset, offset + size - _SYM.size + 1, _SYM.size):
            name = _SYM.unpack_from(data, pos)[0]
            end = strtab.find(b"\0", name)
            if 0 < name < str_size and end > name:
                names.add(strtab[name:end].decode("ascii", "replace"))
        return names
    return None


def _kernel_config(data: bytes) -> set[str] | None:
    """The ``CONFIG_…=y`` options of a kernel built with ``CONFIG_IKCONFIG`` (the
    gzipped .config between ``IKCFG_ST`` and ``IKCFG_ED``), else None."""
    start = data.find(b"IKCFG_ST")
    if start < 0:
        return None
    end = data.find(b"IKCFG_ED", start)
    if end < 0:
        return None
    try:
        text = gzip.decompress(data[start + 8:end]).decode("utf-8", "replace")
    except (OSError, EOFError, zlib.error):
        return None
    return {line.split("=", 1)[0] for line in text.splitlines() if line.endswith("=y")}


def check_kernel(path: Path, rootfs_type: str) -> None:
    """Refuse (``ForeignImageRefused``) a kernel vmfork cannot boot with a root of
    ``rootfs_type``, naming what it lacks."""
    try:
        size = path.stat().st_size
        if size > MAX_KERNEL_BYTES:
            raise ForeignImageRefused(f"kernel {path}: {size >> 20} MiB is too large for a "
                                      f"vmlinux; {KERNEL_HELP}")
        data = path.read_bytes()
    except OSError as err:
        raise ForeignImageRefused(f"kernel {path}: {err.strerror or err}") from err
    if data[:4] != b"\x7fELF":
        kind = "a bzImage (compressed)" if data[0x202:0x206] == b"HdrS" else "not an ELF file"
        raise ForeignImageRefused(f"kernel {path} is {kind}; {KERNEL_HELP}")
    ident, e_type, machine = data[:16], *struct.unpack_from("<HH", data, 16)
    if ident[4] != 2 or ident[5] != 1 or machine != 62 or e_type != 2:
        raise ForeignImageRefused(f"kernel {path} is not a 64-bit x86-64 executable ELF; "
                                  f"{KERNEL_HELP}")
    needs = (*_KERNEL_NEEDS, _FS_NEEDS[rootfs_type])
    config = _kernel_config(data)
    if config is not None:
        missing = [n for n in needs if n.config not in config]
    else:
        symbols = _kernel_symbols(data)
        if symbols is None:
            raise ForeignImageRefused(
                f"kernel {path} has no symbol table and no embedded configuration, so "
                "vmfork cannot tell whether it can boot its agent (a kernel without them "
                "would hang instead of failing): use the unstripped vmlinux, or build it "
                f"with CONFIG_IKCONFIG; {KERNEL_HELP}")
        missing = [n for n in needs if not symbols.intersection(n.symbols)]
    if missing:
        lacks = "; ".join(f"{n.what} ({n.config})" for n in missing)
        raise ForeignImageRefused(f"kernel {path} lacks what a vmfork guest needs: {lacks}. "
                                  f"{KERNEL_HELP}")


def rootfs_type(path: Path) -> str:
    """``ext4``, ``squashfs`` or ``erofs``, from the superblock's magic."""
    try:
        with open(path, "rb") as f:
            head = f.read(2048)
            size = os.fstat(f.fileno()).st_size
    except OSError as err:
        raise ForeignImageRefused(f"rootfs {path}: {err.strerror or err}") from err
    if not os.path.isfile(path):
        raise ForeignImageRefused(f"rootfs {path} is not a regular file")
    if size % 512:
        raise ForeignImageRefused(f"rootfs {path}: {size} bytes is not a whole number of "
                                  "512-byte sectors, so it is not a disk image")
    if head[:4] == b"hsqs":
        return "squashfs"
    if len(head) >= 1028 and struct.unpack_from("<I", head, 1024)[0] == 0xE0F5E1E2:
        return "erofs"
    if len(head) >= 1082 and struct.unpack_from("<H", head, 1080)[0] == 0xEF53:
        return "ext4"   # ext2/3 images mount as ext4 too
    raise ForeignImageRefused(f"rootfs {path} is not an ext4, squashfs or erofs image "
                              "(no superblock magic of any of them)")


def _copy_in(kind: str, key: str, source: Path, name: str) -> Path:
    """``source`` copied to ``<cache>/<kind>/<key>/<name>``, read-only, and checked
    against ``key`` after the copy (the source may change while it is read)."""
    def put(out: Path) -> None:
        shutil.copyfile(source, out / name)
        if sha256_file(out / name) != key:
            raise ForeignImageRefused(f"{source} changed while it was copied; try again")
        os.chmod(out / name, 0o444)

    entry, _ = cached_entry(kind, key, put)
    return entry / name


def import_kernel_rootfs(kernel: str, rootfs: str) -> GuestImage:
    """The image that boots ``kernel`` with ``rootfs`` as its read-only root: checked,
    copied into the cache by content, recorded as ``forkd-<hash>`` (reused when the
    same pair was imported before)."""
    kernel_file, rootfs_file = Path(kernel), Path(rootfs)
    if not kernel_file.is_absolute() or not rootfs_file.is_absolute():
        raise ForeignImageRefused("kernel and rootfs must be absolute paths on the "
                                  "daemon's host")
    fstype = rootfs_type(rootfs_file)
    check_kernel(kernel_file, fstype)
    kernel_key, disk_key = sha256_file(kernel_file), sha256_file(rootfs_file)
    name = "forkd-" + hashlib.sha256(f"{kernel_key} {disk_key}".encode()).hexdigest()[:16]
    if record_path(name).is_file():
        existing = read_record(name)
        if existing.files_present():
            return existing
    from vmfork.image.initramfs import build_boot_initramfs

    boot = build_boot_initramfs()
    _copy_in("kernel", kernel_key, kernel_file, KERNEL_FILE)
    _copy_in("disks", disk_key, rootfs_file, DISK_FILE)
    image = GuestImage(
        name=name, kernel=kernel_path(kernel_key), initrd=boot.path, kernel_key=kernel_key,
        initramfs_key=boot.key, cmdline=f"{DEFAULT_CMDLINE} vmfork.rootfs={fstype}",
        created=datetime.now(UTC).replace(microsecond=0),
        kernel_size=kernel_file.stat().st_size, initrd_size=boot.size,
        disk_key=disk_key, disk_size=disk_path(disk_key).stat().st_size, disk_format=fstype,
        built_from=f"rootfs:{rootfs}",
        definition={"kernel": kernel, "rootfs": rootfs, "kernel_sha256": kernel_key,
                    "rootfs_sha256": disk_key})
    write_record(image)
    return image
