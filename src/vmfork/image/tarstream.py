"""A small streaming tar reader whose memory use is bounded by its caller.

Why not ``tarfile``: it trusts the archive. A pax extended header declares its
own size and ``tarfile`` reads all of it into memory before looking at it, so a
layer whose first header claims 1 GiB costs 1 GiB of RAM; GNU long names are the
same. Image layers come from registries we do not control, so every extension
header here is size-checked against ``max_header_bytes`` before a byte of it is
read, and names are checked against ``max_name_bytes``.

What it reads: ustar (with the ``prefix`` field), the GNU extensions that
container layers use (``L`` long name, ``K`` long link name, base-256 numbers)
and pax (``x`` per-member records: path, linkpath, size, uid, gid, mtime,
``SCHILY.xattr.*`` and ``LIBARCHIVE.xattr.*``). Global pax headers (``g``) are
read, bounded, and ignored, as container runtimes ignore them. GNU sparse files
(type ``S`` or ``GNU.sparse.*`` records) are refused: no layer writer emits them
and supporting them would mean trusting a sparse map.

The reader only parses; it never touches the file system. ``layers.py`` decides
what a member may do.
"""

from __future__ import annotations

import base64
import urllib.parse
from dataclasses import dataclass
from typing import Protocol

BLOCK = 512

# Member kinds, as ``Member.kind``.
FILE = "file"
HARDLINK = "hardlink"
SYMLINK = "symlink"
CHARDEV = "chardev"
BLOCKDEV = "blockdev"
DIRECTORY = "directory"
FIFO = "fifo"

_KINDS = {
    b"0": FILE, b"\0": FILE, b"7": FILE,  # '7' (contiguous) is a regular file everywhere
    b"1": HARDLINK, b"2": SYMLINK, b"3": CHARDEV, b"4": BLOCKDEV, b"5": DIRECTORY, b"6": FIFO,
}


class Readable(Protocol):
    """What the reader needs of a stream (files, pipes, GzipFile and wrappers all fit)."""

    def read(self, n: int = ..., /) -> bytes: ...

    def seekable(self) -> bool: ...

    def seek(self, offset: int, whence: int = ..., /) -> int: ...


class TarFormatError(Exception):
    """The stream is not a tar archive we accept; the message says why.

    ``name`` is the member being read when it broke (None before the first one).
    """

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Member:
    """One archive member. Names are decoded as file names are (UTF-8, surrogateescape),
    so ``os.fsencode`` gives back the archive's bytes."""

    name: str
    kind: str
    size: int  # bytes of data that follow (0 for everything but FILE)
    mode: int  # permission bits incl. setuid/setgid/sticky (& 0o7777)
    uid: int
    gid: int
    mtime_ns: int
    linkname: str
    xattrs: tuple[tuple[str, bytes], ...]
    devmajor: int
    devminor: int


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _cstring(field: bytes) -> bytes:
    end = field.find(b"\0")
    return field if end < 0 else field[:end]


def _number(field: bytes, what: str) -> int:
    """An octal field (NUL/space padded) or a GNU base-256 one (high bit set)."""
    if field and field[0] & 0x80:
        value = int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
        if field[0] == 0xFF:  # two's complement negative
            value -= 1 << (8 * len(field) - 1)
        return value
    text = field.replace(b"\0", b" ").strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarFormatError(f"the {what} field {field!r} is not a number") from None


def _checksum_ok(header: bytes) -> bool:
    stored = _number(header[148:156], "checksum")
    blanked = header[:148] + b" " * 8 + header[156:]
    unsigned = sum(blanked)
    # Some old writers summed signed chars; accept either, as tar itself does.
    signed = sum(b - 256 if b > 127 else b for b in blanked)
    return stored in (unsigned, signed)


def _pax_records(data: bytes) -> dict[str, bytes]:
    """Parse ``"<len> <key>=<value>\\n"`` records; the length counts the whole record."""
    records: dict[str, bytes] = {}
    pos = 0
    while pos < len(data):
        if data[pos:].strip(b"\0") == b"":
            break  # NUL padding after the last record
        space = data.find(b" ", pos, pos + 21)
        if space < 0 or not data[pos:space].isdigit():
            raise TarFormatError("malformed pax header (a record has no length)")
        length = int(data[pos:space])
        record = data[pos:pos + length]
        if length <= space - pos + 1 or len(record) != length or not record.endswith(b"\n"):
            raise TarFormatError("malformed pax header (a record's length is wrong)")
        key, eq, value = record[space - pos + 1:-1].partition(b"=")
        if not eq:
            raise TarFormatError("malformed pax header (a record has no '=')")
        records[_decode(key)] = value
        pos += length
    return records


class TarStream:
    """Iterate members with ``next()``; read the current member's data with ``read()``.

    Unread data of a member is skipped when ``next()`` is called. The caller must
    cap ``Member.size`` itself before reading (the reader cannot know the budget).
    """

    def __init__(self, stream: Readable, *, max_header_bytes: int, max_name_bytes: int) -> None:
        self._stream = stream
        self._max_header = max_header_bytes
        self._max_name = max_name_bytes
        self._remaining = 0  # data bytes of the current member not yet read
        self._padding = 0  # zero bytes after them, up to the next block
        self._name: str | None = None
        self.offset = 0  # bytes consumed from the stream so far
        self.data_offset = 0  # stream offset of the current member's data
        self.ended = False

    def _read_exact(self, n: int) -> bytes:
        chunks = []
        want = n
        while want:
            chunk = self._stream.read(min(want, 1 << 20))
            if not chunk:
                raise TarFormatError(f"the archive is truncated (at byte {self.offset})", self._name)
            chunks.append(chunk)
            want -= len(chunk)
            self.offset += len(chunk)
        return b"".join(chunks)

    def _skip(self, n: int) -> None:
        if n and self._stream.seekable():
            self._stream.seek(n, 1)
            self.offset += n
            return
        while n:
            n -= len(self._read_exact(min(n, 1 << 20)))

    def read(self, n: int = 1 << 20) -> bytes:
        """Up to ``n`` bytes of the current member's data; b"" at its end."""
        n = min(n, self._remaining)
        if n <= 0:
            return b""
        data = self._read_exact(n)
        self._remaining -= len(data)
        return data

    def _extension(self, size: int, what: str, cap: int) -> bytes:
        if size > cap:
            raise TarFormatError(f"a {what} of {size} bytes is over the cap of {cap} bytes",
                                 self._name)
        data = self._read_exact(size)
        self._read_exact(-size % BLOCK)
        return data

    def next(self) -> Member | None:
        """The next member, or None at the end of the archive."""
        if self.ended:
            return None
        self._skip(self._remaining + self._padding)
        self._remaining = self._padding = 0
        pax: dict[str, bytes] = {}
        long_name: bytes | None = None
        long_link: bytes | None = None
        while True:
            header = self._stream.read(BLOCK)
            self.offset += len(header)
            if len(header) < BLOCK:
                if not header:
                    # EOF on a block boundary without the end marker: accepted, as
                    # Go's archive/tar (which wrote most layers) accepts it.
                    if pax or long_name is not None or long_link is not None:
                        raise TarFormatError("the archive ends after an extension header",
                                             self._name)
                    self.ended = True
                    return None
                while len(header) < BLOCK:
                    more = self._stream.read(BLOCK - len(header))
                    if not more:
                        raise TarFormatError(f"the archive is truncated (at byte {self.offset})")
                    header += more
                    self.offset += len(more)
            if header == bytes(BLOCK):
                self.ended = True
                return None
            if not _checksum_ok(header):
                raise TarFormatError(f"damaged tar header at byte {self.offset - BLOCK} "
                                     "(bad checksum): not a tar archive, or a corrupt one")
            typeflag = header[156:157]
            size = _number(header[124:136], "size")
            if size < 0:
                raise TarFormatError(f"negative member size {size}", self._name)
            if typeflag == b"x":
                pax = _pax_records(self._extension(size, "pax extended header",
                                                   self._max_header))
                continue
            if typeflag == b"g":
                self._extension(size, "global pax header", self._max_header)
                continue
            if typeflag == b"L":
                long_name = _cstring(self._extension(size, "GNU long name", self._max_name + 1))
                continue
            if typeflag == b"K":
                long_link = _cstring(self._extension(size, "GNU long link name",
                                                     self._max_name + 1))
                continue
            return self._member(header, typeflag, size, pax, long_name, long_link)

    def _member(self, header: bytes, typeflag: bytes, size: int, pax: dict[str, bytes],
                long_name: bytes | None, long_link: bytes | None) -> Member:
        name_raw = _cstring(header[0:100])
        if header[257:265] == b"ustar\x0000":  # POSIX ustar: name may be split at a '/'
            prefix = _cstring(header[345:500])
            if prefix:
                name_raw = prefix + b"/" + name_raw
        if long_name is not None:
            name_raw = long_name
        if "path" in pax:
            name_raw = pax["path"]
        link_raw = long_link if long_link is not None else _cstring(header[157:257])
        if "linkpath" in pax:
            link_raw = pax["linkpath"]
        name = _decode(name_raw)
        self._name = name
        for raw, what in ((name_raw, "name"), (link_raw, "link target")):
            if b"\0" in raw:
                raise TarFormatError(f"the member's {what} contains a NUL byte", name)
            if len(raw) > self._max_name:
                raise TarFormatError(f"the member's {what} is {len(raw)} bytes, over the cap "
                                     f"of {self._max_name}", name)
        if typeflag == b"S" or any(k.startswith("GNU.sparse.") for k in pax):
            raise TarFormatError("GNU sparse files are not supported in layers", name)
        kind = _KINDS.get(typeflag)
        if kind is None:
            raise TarFormatError(f"tar member type {typeflag!r} is not one a container "
                                 "layer uses (file, link, symlink, directory, device, fifo)",
                                 name)
        if kind == FILE and name_raw.endswith(b"/"):
            kind = DIRECTORY  # pre-POSIX archives marked directories only by the slash
        mtime_ns = _number(header[136:148], "mtime") * 10**9
        uid = _number(header[108:116], "uid")
        gid = _number(header[116:124], "gid")
        try:
            if "size" in pax:
                size = int(pax["size"])
            if "uid" in pax:
                uid = int(pax["uid"])
            if "gid" in pax:
                gid = int(pax["gid"])
            if "mtime" in pax:
                mtime_ns = _pax_time_ns(pax["mtime"])
        except ValueError:
            raise TarFormatError("a pax size, uid, gid or mtime record is not a number",
                                 name) from None
        if size < 0 or not 0 <= uid < 1 << 32 or not 0 <= gid < 1 << 32:
            raise TarFormatError(f"size {size}, uid {uid} or gid {gid} is out of range", name)
        if not -(1 << 63) <= mtime_ns < 1 << 63:
            raise TarFormatError(f"mtime {mtime_ns // 10**9} is out of range", name)
        xattrs: list[tuple[str, bytes]] = []
        for key, value in pax.items():
            if key.startswith("SCHILY.xattr."):
                xattrs.append((key[len("SCHILY.xattr."):], value))
            elif key.startswith("LIBARCHIVE.xattr."):
                try:
                    xattrs.append((urllib.parse.unquote(key[len("LIBARCHIVE.xattr."):]),
                                   base64.b64decode(value + b"=" * (-len(value) % 4))))
                except ValueError:
                    raise TarFormatError(f"pax record {key!r} is not base64", name) from None
        if kind != FILE:
            # Only regular files carry data: a header-only type's declared size is
            # ignored, as Go's archive/tar and tarfile both ignore it.
            size = 0
        self._remaining, self._padding = size, -size % BLOCK
        self.data_offset = self.offset
        return Member(name=name, kind=kind, size=size,
                      mode=_number(header[100:108], "mode") & 0o7777, uid=uid, gid=gid,
                      mtime_ns=mtime_ns, linkname=_decode(link_raw), xattrs=tuple(xattrs),
                      devmajor=_number(header[329:337], "devmajor"),
                      devminor=_number(header[337:345], "devminor"))


def _pax_time_ns(raw: bytes) -> int:
    """A pax time ("1700000000.5", possibly negative) in nanoseconds."""
    whole, _, frac = raw.decode("ascii").partition(".")
    if frac and not frac.isdigit():
        raise ValueError(frac)
    frac_ns = int(frac[:9].ljust(9, "0")) if frac else 0
    return int(whole) * 10**9 + (-frac_ns if whole.startswith("-") else frac_ns)
