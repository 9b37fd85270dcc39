"""The root overlay's upper directory as an OCI layer tar (the ``export_upper`` op).

An image build's ``--run CMD`` step runs CMD in a build VM and keeps what it changed
in the file system as the image's next layer. Every write a guest makes lands in the
overlay's upper directory, a tmpfs; after ``switch_root`` that tmpfs is outside the
guest's root, so the boot ``/init`` of a build VM (kernel word ``vmfork.build=1``)
moves it to ``/.vmfork-rw`` first, and this op streams ``/.vmfork-rw/upper`` as a tar
in data frames.

overlayfs records changes its own way, and OCI layers another; this converts:

* a whiteout (a character device 0:0 named NAME) becomes an empty ``.wh.NAME``;
* an opaque directory (xattr ``trusted.overlay.opaque=y``: the directory was removed
  and made again, hiding everything below it) is followed by ``DIR/.wh..wh..opq``;
* modes, owners, times, symlinks and hard links are kept; ``trusted.overlay.*`` is
  overlay bookkeeping and dropped; other ``user.*``/``security.capability`` xattrs kept;
* a redirected directory or a metacopy file (overlay features that keep the data in
  the lower layer) cannot be a layer entry of its own and is refused, as are device
  nodes and sockets (a layer never carries them).

What vmfork itself wrote at boot is left out (``EXCLUDED``): the mount point of the
moved tmpfs, the agent's copy in ``/opt/vmfork/agent`` and the ``/etc/resolv.conf``
the network set-up wrote (container builds leave it out too).

Bounded: at most ``max_bytes`` of file data and ``max_members`` entries (the host's
caps, themselves capped here); an upper directory over them fails the op saying so.
Stdlib only, and runnable on the host (the unit tests convert real overlay upper
directories with it).
"""

from __future__ import annotations

import os
import stat as stat_mod
import tarfile
from collections.abc import Callable
from typing import Any, BinaryIO

UPPER_MOUNT = "/.vmfork-rw"
UPPER_DIR = UPPER_MOUNT + "/upper"
EXCLUDED = frozenset({".vmfork-rw", "opt/vmfork/agent", "etc/resolv.conf"})
OPAQUE_XATTR = "trusted.overlay.opaque"
_REFUSED_XATTRS = ("trusted.overlay.redirect", "trusted.overlay.metacopy")
_KEPT_XATTR_PREFIXES = ("user.",)
_KEPT_XATTRS = ("security.capability",)
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"

MAX_BYTES = 16 << 30
MAX_MEMBERS = 2_000_000
_CHUNK = 1 << 20


class UpperError(Exception):
    """The upper directory cannot be a layer (or is over a cap); says which entry."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _FrameSink:
    """A write-only file object that hands its bytes on in chunks of ``_CHUNK``."""

    def __init__(self, emit: Callable[[bytes], None]) -> None:
        self._emit = emit
        self._buf = bytearray()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._buf += data
        self.size += len(data)
        while len(self._buf) >= _CHUNK:
            self._emit(bytes(self._buf[:_CHUNK]))
            del self._buf[:_CHUNK]
        return len(data)

    def flush(self) -> None:
        if self._buf:
            self._emit(bytes(self._buf))
            self._buf.clear()


def _xattrs(path: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out: dict[str, bytes] = {}
    for name in names:
        try:
            out[name] = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
    return out


class _Writer:
    def __init__(self, tar: tarfile.TarFile, max_bytes: int, max_members: int) -> None:
        self.tar = tar
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.members = 0
        self.file_bytes = 0
        self.whiteouts = 0
        self.opaque_dirs = 0
        self._links: dict[tuple[int, int], str] = {}

    def _count(self, rel: str) -> None:
        self.members += 1
        if self.members > self.max_members:
            raise UpperError("too_large", f"the changes have more than {self.max_members} "
                                          f"entries (at {rel!r})")

    def _info(self, rel: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
        info = tarfile.TarInfo(rel)
        info.type = kind
        info.mode = stat_mod.S_IMODE(st.st_mode)
        info.uid, info.gid = st.st_uid, st.st_gid
        info.uname = info.gname = ""
        info.mtime = int(st.st_mtime)
        return info

    def _with_xattrs(self, info: tarfile.TarInfo, rel: str, xattrs: dict[str, bytes]) -> None:
        for name in _REFUSED_XATTRS:
            if name in xattrs:
                raise UpperError("unsupported", f"{rel!r} carries {name} (an overlay "
                                 "redirect or metacopy keeps its data in the lower layer); "
                                 "it cannot be a layer entry")
        kept = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                for k, v in xattrs.items()
                if k.startswith(_KEPT_XATTR_PREFIXES) or k in _KEPT_XATTRS}
        if kept:
            info.pax_headers = kept

    def add(self, path: str, rel: str) -> bool:
        """Add one entry; True when it is a directory to descend into."""
        st = os.lstat(path)
        mode = st.st_mode
        parent, _, name = rel.rpartition("/")
        if stat_mod.S_ISCHR(mode) and st.st_rdev == 0:
            self._count(rel)
            info = self._info((parent + "/" if parent else "") + WHITEOUT + name, st,
                              tarfile.REGTYPE)
            info.mode = 0o600
            self.tar.addfile(info)
            self.whiteouts += 1
            return False
        xattrs = _xattrs(path)
        if stat_mod.S_ISDIR(mode):
            self._count(rel)
            info = self._info(rel, st, tarfile.DIRTYPE)
            self._with_xattrs(info, rel, xattrs)
            self.tar.addfile(info)
            if xattrs.get(OPAQUE_XATTR) == b"y":
                self._count(rel)
                marker = self._info(rel + "/" + OPAQUE, st, tarfile.REGTYPE)
                marker.mode = 0o600
                self.tar.addfile(marker)
                self.opaque_dirs += 1
            return True
        if stat_mod.S_ISLNK(mode):
            self._count(rel)
            info = self._info(rel, st, tarfile.SYMTYPE)
            info.linkname = os.readlink(path)
            self.tar.addfile(info)
            return False
        if stat_mod.S_ISREG(mode):
            self._count(rel)
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in self._links:
                info = self._info(rel, st, tarfile.LNKTYPE)
                info.linkname = self._links[key]
                self.tar.addfile(info)
                return False
            info = self._info(rel, st, tarfile.REGTYPE)
            self._with_xattrs(info, rel, xattrs)
            info.size = st.st_size
            self.file_bytes += st.st_size
            if self.file_bytes > self.max_bytes:
                raise UpperError("too_large", f"the changes hold more than {self.max_bytes} "
                                              f"bytes of files (at {rel!r})")
            with open(path, "rb") as f:
                # A file that changed size while being read would break the tar: the
                # command is over and nothing else writes, so it is a plain error.
                if os.fstat(f.fileno()).st_size != st.st_size:
                    raise UpperError("changed", f"{rel!r} changed while being read")
                self.tar.addfile(info, f)
            if st.st_nlink > 1:
                self._links[key] = rel
            return False
        if stat_mod.S_ISFIFO(mode):
            self._count(rel)
            self.tar.addfile(self._info(rel, st, tarfile.FIFOTYPE))
            return False
        raise UpperError("unsupported", f"{rel!r} is a device node or socket; a layer does "
                                        "not carry those")


def write_layer(upper: str, out: BinaryIO, *, max_bytes: int = MAX_BYTES,
                max_members: int = MAX_MEMBERS,
                excluded: frozenset[str] = EXCLUDED) -> dict[str, Any]:
    """Write the overlay upper directory ``upper`` to ``out`` as an OCI layer tar
    (uncompressed, PAX); returns counts. Parents come before their entries, and
    entries of a directory in name order, so the same changes give the same bytes."""
    writer: _Writer | None = None
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        writer = _Writer(tar, min(max_bytes, MAX_BYTES), min(max_members, MAX_MEMBERS))
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            directory = os.path.join(upper, rel_dir) if rel_dir else upper
            try:
                names = sorted(os.listdir(directory))
            except OSError as err:
                raise UpperError("os_error", f"cannot list {rel_dir or '/'!r}: "
                                             f"{err.strerror}") from err
            subdirs: list[str] = []
            for name in names:
                rel = f"{rel_dir}/{name}" if rel_dir else name
                if rel in excluded:
                    continue
                if writer.add(os.path.join(directory, name), rel):
                    subdirs.append(rel)
            stack.extend(reversed(subdirs))
    return {"members": writer.members, "file_bytes": writer.file_bytes,
            "whiteouts": writer.whiteouts, "opaque_dirs": writer.opaque_dirs}


def export_upper(conn: Any, req: dict[str, Any]) -> None:
    """The ``export_upper`` op: ``{max_bytes, max_members}`` -> data frames of the
    layer tar, then ``result {size, members, file_bytes, whiteouts, opaque_dirs}``."""
    from vmfork.agent.request import OpError, get_int

    if not os.path.isdir(UPPER_DIR):
        raise OpError("unsupported", f"{UPPER_DIR} does not exist: this guest was not "
                                     "booted as a build VM (kernel word vmfork.build=1)")
    max_bytes = get_int(req, "max_bytes", MAX_BYTES)
    max_members = get_int(req, "max_members", MAX_MEMBERS)
    assert max_bytes is not None and max_members is not None
    sink = _FrameSink(lambda chunk: conn.send({"type": "data"}, chunk))
    try:
        counts = write_layer(UPPER_DIR, sink,  # type: ignore[arg-type]
                             max_bytes=max_bytes, max_members=max_members)
    except UpperError as err:
        raise OpError(err.code, f"export_upper: {err.message}") from err
    sink.flush()
    conn.result(size=sink.size, **counts)
