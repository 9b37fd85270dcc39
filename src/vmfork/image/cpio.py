"""A deterministic writer (and reader) for the cpio "newc" format the kernel unpacks.

Why our own writer rather than ``cpio -o``: the initramfs needs device nodes
(``/dev/console`` must exist before the guest mounts devtmpfs, or PID 1 starts
without stdin/stdout/stderr), and an unprivileged build cannot ``mknod`` them in a
staging directory. Writing the archive ourselves lets a node be a plain entry.
It also makes the archive reproducible: entries are sorted by path (a directory
always precedes what it holds, which the kernel's unpacker requires since it
does not create missing parents), owners are 0, mtimes are 0, and inode numbers
are assigned in order.

The archive is left uncompressed on purpose. The guest kernel copies an
uncompressed archive straight into its page cache; decompressing gzip or zstd
in the guest costs boot time on every cold boot, while the bytes saved only
matter on the host's disk, where the file is cached anyway.

Format (``Documentation/driver-api/early-userspace/buffer-format.rst``): each
entry is the 6-byte magic ``070701``, thirteen 8-digit hex fields, the NUL
terminated name padded so header+name is a multiple of 4, then the data padded
to a multiple of 4. The archive ends with an entry named ``TRAILER!!!``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

MAGIC = b"070701"
TRAILER = "TRAILER!!!"
_HEADER_LEN = 110  # 6 magic + 13 fields * 8 hex digits
_MAX_FIELD = 0xFFFF_FFFF
_COPY_CHUNK = 1 << 20


class CpioError(ValueError):
    """An entry that cannot be written, or an archive that cannot be parsed."""


@dataclass(frozen=True)
class CpioEntry:
    """One archive member.

    ``path`` is relative with ``/`` separators and no leading slash (``bin/sh``).
    ``mode`` is a full ``st_mode`` (type and permission bits). A regular file's
    content is ``data`` or, for large files, read from ``source`` at write time;
    a symlink's target is ``data``; a character or block device carries ``rdev``
    as ``(major, minor)``.
    """

    path: str
    mode: int
    data: bytes = b""
    source: Path | None = None
    rdev: tuple[int, int] = (0, 0)
    owner: tuple[int, int] = (0, 0)
    """``(uid, gid)``: root's, but for what a recipe gives to a user (its home)."""

    def size(self) -> int:
        if self.source is not None:
            return self.source.stat().st_size
        return len(self.data)


def directory(path: str, perm: int = 0o755, owner: tuple[int, int] = (0, 0)) -> CpioEntry:
    return CpioEntry(path, stat.S_IFDIR | perm, owner=owner)


def regular_file(path: str, data: bytes, perm: int = 0o644) -> CpioEntry:
    return CpioEntry(path, stat.S_IFREG | perm, data=data)


def symlink(path: str, target: str) -> CpioEntry:
    return CpioEntry(path, stat.S_IFLNK | 0o777, data=target.encode())


def char_device(path: str, major: int, minor: int, perm: int = 0o600) -> CpioEntry:
    return CpioEntry(path, stat.S_IFCHR | perm, rdev=(major, minor))


def _check_path(path: str) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CpioError(f"entry path {path!r} must be relative, without '.' or '..'")
    if "\0" in path:
        raise CpioError(f"entry path {path!r} contains a NUL byte")


def _sort_key(entry: CpioEntry) -> tuple[str, ...]:
    # Component-wise order puts "a" before "a/b" before "a-b", so every directory
    # precedes its contents; plain string order would not guarantee that in general.
    return PurePosixPath(entry.path).parts


def _pad(length: int) -> bytes:
    return b"\0" * (-length % 4)


def _header(ino: int, entry: CpioEntry, size: int, name: bytes) -> bytes:
    major, minor = entry.rdev
    fields = (
        ino, entry.mode, *entry.owner,  # ino, mode, uid, gid
        2 if stat.S_ISDIR(entry.mode) else 1,  # nlink
        0, size,                        # mtime, filesize
        0, 0, major, minor,             # devmajor, devminor, rdevmajor, rdevminor
        len(name) + 1, 0,               # namesize (with NUL), check
    )
    for value in fields:
        if not 0 <= value <= _MAX_FIELD:
            raise CpioError(f"{entry.path}: field value {value} does not fit newc's 32 bits")
    return MAGIC + b"".join(b"%08X" % v for v in fields)


def write_cpio(out: BinaryIO, entries: Iterable[CpioEntry]) -> int:
    """Write ``entries`` sorted by path as a newc archive; return the bytes written.

    Duplicate paths are an error (the kernel would silently keep the last one).
    """
    ordered = sorted(entries, key=_sort_key)
    written = 0
    seen: set[str] = set()
    for ino, entry in enumerate(ordered, start=1):
        _check_path(entry.path)
        if entry.path in seen:
            raise CpioError(f"duplicate entry {entry.path!r}")
        seen.add(entry.path)
        kind = stat.S_IFMT(entry.mode)
        if kind not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFCHR, stat.S_IFBLK):
            raise CpioError(f"{entry.path}: unsupported file type {kind:o}")
        if kind == stat.S_IFDIR and (entry.data or entry.source):
            raise CpioError(f"{entry.path}: a directory carries no data")
        size = entry.size() if kind in (stat.S_IFREG, stat.S_IFLNK) else 0
        name = entry.path.encode()
        head = _header(ino, entry, size, name) + name + b"\0"
        out.write(head + _pad(len(head)))
        written += len(head) + len(_pad(len(head)))
        written += _write_data(out, entry, size)
    trailer = _header(len(ordered) + 1, CpioEntry(TRAILER, 0), 0, TRAILER.encode())
    trailer += TRAILER.encode() + b"\0"
    trailer += _pad(len(trailer))
    out.write(trailer)
    return written + len(trailer)


def _write_data(out: BinaryIO, entry: CpioEntry, size: int) -> int:
    if size == 0:
        return 0
    if entry.source is None:
        out.write(entry.data)
    else:
        copied = 0
        with open(entry.source, "rb") as src:
            while chunk := src.read(_COPY_CHUNK):
                out.write(chunk)
                copied += len(chunk)
        if copied != size:
            raise CpioError(f"{entry.path}: {entry.source} changed size while being archived")
    out.write(_pad(size))
    return size + len(_pad(size))


def entries_from_tree(root: Path, owners: dict[str, tuple[int, int]] | None = None
                      ) -> Iterator[CpioEntry]:
    """The entries for everything under ``root`` (not ``root`` itself).

    Ownership and times are dropped (the archive is owned by root, mtime 0), except
    the directories ``owners`` gives to a ``(uid, gid)`` (by relative path);
    permission bits, including set-id bits, are kept. Anything but regular files,
    directories and symlinks is refused: device nodes cannot be created without
    privilege, so they are added as explicit entries instead.
    """
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            full = base / name
            rel = full.relative_to(root).as_posix()
            st = full.lstat()
            perm = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                yield symlink(rel, os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                yield directory(rel, perm, (owners or {}).get(rel, (0, 0)))
            elif stat.S_ISREG(st.st_mode):
                yield CpioEntry(rel, stat.S_IFREG | perm, source=full)
            else:
                raise CpioError(f"{full}: not a file, directory or symlink; add it as an entry")


def read_cpio(data: bytes) -> list[CpioEntry]:
    """Parse a newc archive (up to its trailer) into entries with inline data."""
    entries: list[CpioEntry] = []
    pos = 0
    while True:
        if data[pos : pos + 6] != MAGIC:
            raise CpioError(f"offset {pos}: bad magic {data[pos:pos + 6]!r}")
        try:
            fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        except ValueError as err:
            raise CpioError(f"offset {pos}: malformed header") from err
        mode, size = fields[1], fields[6]
        rdev = (fields[9], fields[10])
        namesize = fields[11]
        name_end = pos + _HEADER_LEN + namesize
        name = data[pos + _HEADER_LEN : name_end - 1].decode()
        pos = name_end + (-name_end % 4)
        if name == TRAILER:
            return entries
        body = data[pos : pos + size]
        if len(body) != size:
            raise CpioError(f"{name}: archive truncated")
        pos += size + (-size % 4)
        entries.append(CpioEntry(name, mode, data=body, rdev=rdev, owner=(fields[2], fields[3])))
