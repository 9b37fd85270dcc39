"""A writer for the cpio "newc" format, the one format the kernel unpacks as an initramfs.

Why our own writer rather than ``cpio -o``: the initramfs needs a ``/dev/console``
character device (without it the kernel starts ``/init`` with no stdin/stdout and the
first ``echo`` goes nowhere), and only root may ``mknod`` one on disk. Writing the
archive ourselves lets an unprivileged build describe the node directly, sets every
owner to root and every mtime to 0 (so identical inputs give byte-identical archives),
and needs no extra package.

Format (see the kernel's Documentation/driver-api/early-userspace/buffer-format.rst):
each entry is the ASCII magic ``070701``, thirteen 8-digit hexadecimal fields, the
NUL-terminated name padded with NULs to a multiple of 4 bytes (counting the 110-byte
header), then the data padded the same way. The archive ends with an entry named
``TRAILER!!!``. The kernel's unpacker wants a directory entry before anything inside it.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = b"070701"
HEADER_SIZE = 110
TRAILER = "TRAILER!!!"


def _pad4(length: int) -> bytes:
    return b"\0" * (-length % 4)


@dataclass(frozen=True)
class CpioEntry:
    """One archive member. ``name`` is relative (no leading ``/``)."""

    name: str
    mode: int  # file type bits and permissions, as in ``st_mode``
    data: bytes = b""
    rdev_major: int = 0
    rdev_minor: int = 0


class CpioWriter:
    """Appends newc entries to a binary stream; call ``close()`` to write the trailer.

    Inode numbers are assigned sequentially, links are 1 (2 for directories): the
    kernel's unpacker uses (ino, nlink) only to recreate hard links, which we never make.
    """

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._next_ino = 1
        self._names: set[str] = set()
        self._closed = False

    def add(self, entry: CpioEntry) -> None:
        if self._closed:
            raise ValueError("cpio archive already closed")
        name = entry.name.strip("/")
        if not name or name == TRAILER:
            raise ValueError(f"invalid cpio member name {entry.name!r}")
        if name in self._names:
            raise ValueError(f"duplicate cpio member {name!r}")
        if stat.S_IFMT(entry.mode) == 0:
            raise ValueError(f"cpio member {name!r} has no file type bits in mode {entry.mode:o}")
        self._names.add(name)
        nlink = 2 if stat.S_ISDIR(entry.mode) else 1
        self._write(name, entry.mode, entry.data, nlink, entry.rdev_major, entry.rdev_minor)

    def directory(self, name: str, perm: int = 0o755) -> None:
        self.add(CpioEntry(name, stat.S_IFDIR | perm))

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self.add(CpioEntry(name, stat.S_IFREG | perm, data))

    def symlink(self, name: str, target: str) -> None:
        self.add(CpioEntry(name, stat.S_IFLNK | 0o777, target.encode()))

    def char_device(self, name: str, major: int, minor: int, perm: int = 0o600) -> None:
        self.add(CpioEntry(name, stat.S_IFCHR | perm, rdev_major=major, rdev_minor=minor))

    def close(self) -> None:
        if not self._closed:
            self._write(TRAILER, 0, b"", 1, 0, 0, ino=0)
            self._closed = True

    def _write(self, name: str, mode: int, data: bytes, nlink: int, rdev_major: int,
               rdev_minor: int, ino: int | None = None) -> None:
        if ino is None:
            ino = self._next_ino
            self._next_ino += 1
        encoded = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev_major, rdev_minor,
                  len(encoded), 0)
        header = MAGIC + b"".join(b"%08X" % value for value in fields)
        assert len(header) == HEADER_SIZE
        self._out.write(header + encoded + _pad4(HEADER_SIZE + len(encoded)))
        self._out.write(data + _pad4(len(data)))


@dataclass(frozen=True)
class ParsedEntry:
    """What ``parse`` reads back: enough to check an archive in tests and diagnostics."""

    name: str
    mode: int
    data: bytes
    rdev_major: int
    rdev_minor: int


def parse(blob: bytes) -> list[ParsedEntry]:
    """Read a newc archive (without the trailer entry); raises ``ValueError`` if malformed."""
    entries: list[ParsedEntry] = []
    pos = 0
    while True:
        header = blob[pos:pos + HEADER_SIZE]
        if len(header) < HEADER_SIZE or header[:6] != MAGIC:
            raise ValueError(f"bad cpio header at offset {pos}")
        fields = [int(header[6 + 8 * i:14 + 8 * i], 16) for i in range(13)]
        mode, filesize, rmaj, rmin, namesize = fields[1], fields[6], fields[9], fields[10], fields[11]
        name_start = pos + HEADER_SIZE
        name = blob[name_start:name_start + namesize - 1].decode()
        data_start = name_start + namesize + (-(HEADER_SIZE + namesize) % 4)
        data = blob[data_start:data_start + filesize]
        if len(data) != filesize:
            raise ValueError(f"cpio member {name!r} truncated")
        pos = data_start + filesize + (-filesize % 4)
        if name == TRAILER:
            return entries
        entries.append(ParsedEntry(name, mode, data, rmaj, rmin))
