"""Applying image layers to a directory, as container runtimes do, against hostile input.

A layer is a tar stream (gzip, zstd or plain) of changes to the layers below it:
members add or replace entries, ``.wh.NAME`` deletes ``NAME`` from lower layers,
and ``DIR/.wh..wh..opq`` hides everything the lower layers had in ``DIR``. We
apply layers in order into one directory (the image's root) with the semantics of
containerd's and Docker's appliers, and refuse what they refuse or what a guest
image has no use for. Every refusal is ``LayerRefused`` naming the layer and the
member.

The rules, and why:

* **Names.** A leading ``/`` is dropped (``/etc/x`` means ``<root>/etc/x``, as
  both runtimes treat it); ``.`` components are dropped; a ``..`` component is
  refused, since no layer writer emits one and its only use is to climb out.
* **Symlinks are never followed out of the root.** Every parent component is
  walked with ``openat(dirfd, name, O_NOFOLLOW)``; a parent that is a symlink is
  resolved *inside the root*, as if the root were ``/`` (containerd's
  ``fs.RootPath``, Docker's chroot, the kernel's ``RESOLVE_IN_ROOT``): after
  ``a -> /etc``, a member ``a/passwd`` is written to ``<root>/etc/passwd``, never
  the host's. The last component is never followed: an existing entry there is
  replaced, not written through. More than 40 symlinks in one lookup is a loop,
  refused (a loop is harmless otherwise: a symlink is stored as it is).
* **Hard links** must name an entry that exists already (this layer or a lower
  one), resolved by the same walk; a missing target or a directory is refused.
* **Devices.** Character and block devices are refused: a guest gets its /dev
  from the kernel's devtmpfs, and a device node in an image is a way to reach
  host hardware if the tree is ever used outside the VM. FIFOs are allowed
  (harmless inside the root, and some images carry them).
* **Sizes.** ``Limits`` caps each file, the decompressed bytes of all layers
  together (counted as they stream, so a decompression bomb stops at the cap),
  the member count, name lengths and extension-header sizes (``tarstream``).
* **Metadata.** Owners (numeric uid/gid, as runtimes use), then modes (after the
  chown, which clears setuid bits), then xattrs (after the chown, which clears
  ``security.capability``), then mtimes; directories' mtimes are set when the
  layer ends, since adding their children changes them. xattrs are best effort
  and limited to ``user.``, ``trusted.`` and ``security.capability``; a file
  system that does not keep them loses them silently.

The diff_id check: while streaming, the decompressed bytes are hashed; ``apply``
reads to the end of the stream and returns the digest, which the caller compares
with the image config's ``rootfs.diff_ids``.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import shutil
import stat
import subprocess
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Self, cast

from vmfork.image import tarstream
from vmfork.image.errors import ImageBuildError

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Caps on what one image import may make or read. Sizes in bytes."""

    max_total_bytes: int = 16 * GiB  # decompressed bytes of all layers together
    max_file_bytes: int = 8 * GiB  # one regular file
    max_members: int = 2_000_000  # tar members over all layers
    max_name_bytes: int = 4096  # a member's path or link target (PATH_MAX)
    max_header_bytes: int = 1 * MiB  # one pax extended header
    max_document_bytes: int = 8 * MiB  # a manifest, index or image config
    max_layers: int = 256


DEFAULT_LIMITS = Limits()

_MAX_SYMLINKS = 40  # as the kernel's MAXSYMLINKS
_NAME_MAX = 255
_XATTR_PREFIXES = ("user.", "trusted.")
_XATTR_NAMES = ("security.capability",)
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class LayerRefused(ImageBuildError):
    """A layer member we will not apply; ``layer`` and ``member`` name it."""

    def __init__(self, layer: str, member: str | None, why: str) -> None:
        where = f"{layer}, member {member!r}" if member is not None else layer
        super().__init__("oci-layer", f"{where}: {why}; the layer is refused")
        self.layer = layer
        self.member = member


class _Counting:
    """Reads a decompressed stream, hashing it and charging it to the total cap."""

    def __init__(self, raw: tarstream.Readable, applier: LayerApplier, label: str) -> None:
        self._raw = raw
        self._applier = applier
        self._label = label
        self.sha256 = hashlib.sha256()

    def read(self, n: int = -1, /) -> bytes:
        try:
            data = self._raw.read(n if n >= 0 else 1 << 20)
        except (OSError, EOFError, zlib.error) as err:
            raise ImageBuildError("oci-layer", f"{self._label}: its compressed stream is "
                                  f"damaged or truncated ({err})") from err
        self._applier.stream_bytes += len(data)
        if self._applier.stream_bytes > self._applier.limits.max_total_bytes:
            raise LayerRefused(self._label, None, "the layers decompress to more than the cap of "
                               f"{self._applier.limits.max_total_bytes} bytes (Limits."
                               "max_total_bytes): a decompression bomb, or an image too large")
        self.sha256.update(data)
        return data

    def seekable(self) -> bool:
        return False

    def seek(self, offset: int, whence: int = 0, /) -> int:
        raise io.UnsupportedOperation("a layer stream is read once, in order")


def _split(name: str) -> list[str] | None:
    """Path components of a member name, or None if it has a '..' component."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return None if ".." in parts else parts


class LayerApplier:
    """Applies layers, in order, into the directory ``root`` (which it opens once)."""

    def __init__(self, root: str | os.PathLike[str], limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.stream_bytes = 0  # decompressed bytes read, over all layers
        self.unpacked_bytes = 0  # regular-file bytes written, over all layers
        self.members = 0
        self._root = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._label = ""
        self._member: str | None = None

    def close(self) -> None:
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refuse(self, why: str) -> LayerRefused:
        return LayerRefused(self._label, self._member, why)

    # The walk --------------------------------------------------------------

    def _reopen(self, resolved: list[str]) -> int:
        """Open a path already resolved (no symlinks in it) from the root."""
        fd = os.dup(self._root)
        try:
            for comp in resolved:
                nxt = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _walk(self, comps: list[str], create: bool) -> tuple[int, list[str]] | None:
        """Open the directory ``comps`` names, resolving symlinks inside the root.

        Returns ``(fd, resolved components)``, or None when a component is missing
        and ``create`` is false. Missing directories are made (mode 0755, as
        runtimes make a member's missing parents) when ``create`` is true.
        """
        todo = list(reversed(comps))  # a stack: the next component is last
        resolved: list[str] = []
        links = 0
        fd = os.dup(self._root)
        try:
            while todo:
                comp = todo.pop()
                if comp in ("", "."):
                    continue
                if comp == "..":  # only from a symlink's target; the root is its own parent
                    if resolved:
                        resolved.pop()
                        os.close(fd)
                        fd = -1
                        fd = self._reopen(resolved)
                    continue
                try:
                    st = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    if not create:
                        return None
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    st = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > _MAX_SYMLINKS:
                        raise self._refuse(f"resolving its parent directory follows more than "
                                           f"{_MAX_SYMLINKS} symlinks (a symlink loop)")
                    target = os.readlink(comp, dir_fd=fd)
                    if target.startswith("/"):
                        resolved.clear()
                        os.close(fd)
                        fd = -1
                        fd = os.dup(self._root)
                    todo.extend(reversed(target.split("/")))
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    where = "/".join([*resolved, comp])
                    raise self._refuse(f"its parent {where!r} is not a directory")
                nxt = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
                os.close(fd)
                fd = nxt
                resolved.append(comp)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return fd, resolved

    @contextmanager
    def _parent(self, comps: list[str], create: bool = True
                ) -> Iterator[tuple[int, list[str]] | None]:
        found = self._walk(comps[:-1], create)
        try:
            yield found
        finally:
            if found is not None:
                os.close(found[0])

    # Applying --------------------------------------------------------------

    def apply(self, stream: tarstream.Readable, label: str,
              progress: Callable[[int], None] | None = None) -> str:
        """Apply one decompressed layer stream; return its diff_id ("sha256:<hex>").

        ``label`` names the layer in errors. ``progress(unpacked_bytes)`` is called
        as file data is written.
        """
        self._label = label
        self._member = None
        counting = _Counting(stream, self, label)
        tar = tarstream.TarStream(counting, max_header_bytes=self.limits.max_header_bytes,
                                  max_name_bytes=self.limits.max_name_bytes)
        written: set[str] = set()  # resolved paths this layer made (kept by an opaque dir)
        dir_times: list[tuple[list[str], int]] = []
        try:
            while True:
                member = tar.next()
                if member is None:
                    break
                self._member = member.name
                self.members += 1
                if self.members > self.limits.max_members:
                    raise self._refuse(f"the image has more than {self.limits.max_members} "
                                       "members (Limits.max_members)")
                self._apply_member(tar, member, written, dir_times, progress)
            self._member = None
            # Read to the end so the diff_id covers the whole stream (and the total
            # cap covers whatever follows the end-of-archive marker).
            while counting.read(1 << 20):
                pass
        except tarstream.TarFormatError as err:
            raise LayerRefused(label, err.name, str(err)) from None
        except OSError as err:
            raise self._os_error(err) from err
        for resolved, mtime_ns in dir_times:
            self._set_dir_time(resolved, mtime_ns)
        return "sha256:" + counting.sha256.hexdigest()

    def _os_error(self, err: OSError) -> ImageBuildError:
        hint = ""
        if err.errno == errno.EPERM:
            hint = " (applying owners and modes needs root: import images as root)"
        elif err.errno == errno.ENOSPC:
            hint = " (the file system holding the image root is full)"
        where = f"{self._label}, member {self._member!r}" if self._member else self._label
        return ImageBuildError("oci-layer", f"{where}: {err.strerror or err}{hint}")

    def _apply_member(self, tar: tarstream.TarStream, m: tarstream.Member, written: set[str],
                      dir_times: list[tuple[list[str], int]],
                      progress: Callable[[int], None] | None) -> None:
        comps = _split(m.name)
        if comps is None:
            raise self._refuse("its name has a '..' component, which would leave the root")
        if any(len(os.fsencode(c)) > _NAME_MAX for c in comps):
            raise self._refuse(f"a component of its name is longer than {_NAME_MAX} bytes")
        if m.kind in (tarstream.CHARDEV, tarstream.BLOCKDEV):
            raise self._refuse(f"it is a {'character' if m.kind == tarstream.CHARDEV else 'block'}"
                               f" device ({m.devmajor}:{m.devminor}); images may not carry "
                               "device nodes (the guest kernel provides /dev)")
        if m.kind == tarstream.FILE and m.size > self.limits.max_file_bytes:
            raise self._refuse(f"it is {m.size} bytes, over the per-file cap of "
                               f"{self.limits.max_file_bytes} (Limits.max_file_bytes)")
        if not comps:  # the root itself ("./"): only its metadata applies
            if m.kind != tarstream.DIRECTORY:
                raise self._refuse("the root of the image must be a directory")
            self._set_meta(self._root, m)
            dir_times.append(([], m.mtime_ns))
            return
        base = comps[-1]
        if base.startswith(WHITEOUT):
            self._whiteout(comps, written)
            return
        with self._parent(comps) as found:
            assert found is not None  # create=True always finds or makes it
            pfd, presolved = found
            path = "/".join([*presolved, base])
            if m.kind == tarstream.HARDLINK:
                self._hardlink(pfd, base, m)
            else:
                self._clear(pfd, base, keep_dir=m.kind == tarstream.DIRECTORY)
                if m.kind == tarstream.FILE:
                    self._file(tar, pfd, base, m, progress)
                elif m.kind == tarstream.DIRECTORY:
                    self._directory(pfd, base, m)
                    dir_times.append(([*presolved, base], m.mtime_ns))
                elif m.kind == tarstream.SYMLINK:
                    self._symlink(pfd, base, m)
                else:
                    self._fifo(pfd, base, m)
            while path and path not in written:  # ancestors too: an opaque dir keeps them
                written.add(path)
                path = path.rpartition("/")[0]

    def _whiteout(self, comps: list[str], written: set[str]) -> None:
        base = comps[-1]
        if base != OPAQUE and base.startswith(WHITEOUT + WHITEOUT):
            return  # aufs bookkeeping (.wh..wh.plnk and friends): Docker skips these too
        target = base[len(WHITEOUT):]
        if base != OPAQUE and not target:
            raise self._refuse("a whiteout must name what it deletes ('.wh.' alone)")
        with self._parent(comps, create=False) as found:
            if found is None:
                return  # the directory is not there, so there is nothing to hide
            pfd, presolved = found
            if base == OPAQUE:
                self._make_opaque(pfd, "/".join(presolved), written)
            else:
                self._remove(pfd, target)

    def _make_opaque(self, dfd: int, path: str, written: set[str]) -> None:
        """Delete what lower layers put in a directory, keeping what this layer wrote."""
        for name in [e.name for e in os.scandir(dfd)]:
            child = f"{path}/{name}" if path else name
            if child not in written:
                self._remove(dfd, name)
                continue
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=dfd)
                try:
                    self._make_opaque(sub, child, written)
                finally:
                    os.close(sub)

    @staticmethod
    def _remove(pfd: int, name: str) -> None:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=pfd)  # the fd-based rmtree: it never follows symlinks
        else:
            os.unlink(name, dir_fd=pfd)

    @staticmethod
    def _clear(pfd: int, base: str, keep_dir: bool) -> None:
        """Make room for a new entry: an existing directory stays for a directory
        (layers merge into it), anything else is removed (never followed)."""
        try:
            st = os.stat(base, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if not keep_dir:
                shutil.rmtree(base, dir_fd=pfd)
        else:
            os.unlink(base, dir_fd=pfd)

    def _file(self, tar: tarstream.TarStream, pfd: int, base: str, m: tarstream.Member,
              progress: Callable[[int], None] | None) -> None:
        fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=pfd)
        try:
            while data := tar.read(1 << 20):
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                self.unpacked_bytes += len(data)
                if progress is not None:
                    progress(self.unpacked_bytes)
            self._set_meta(fd, m)
            os.utime(fd, ns=(m.mtime_ns, m.mtime_ns))
        finally:
            os.close(fd)

    def _directory(self, pfd: int, base: str, m: tarstream.Member) -> None:
        try:
            os.mkdir(base, 0o700, dir_fd=pfd)
        except FileExistsError:
            pass  # a lower layer's directory (kept by _clear): its contents merge
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=pfd)
        try:
            self._set_meta(fd, m)
        finally:
            os.close(fd)

    def _symlink(self, pfd: int, base: str, m: tarstream.Member) -> None:
        if not m.linkname:
            raise self._refuse("a symlink with an empty target")
        os.symlink(m.linkname, base, dir_fd=pfd)
        os.chown(base, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
        os.utime(base, ns=(m.mtime_ns, m.mtime_ns), dir_fd=pfd, follow_symlinks=False)
        # No xattrs: Linux keeps no user.* xattrs on symlinks, and we have no
        # fd-relative lsetxattr to set others without following a path.

    def _fifo(self, pfd: int, base: str, m: tarstream.Member) -> None:
        os.mkfifo(base, 0o600, dir_fd=pfd)
        os.chown(base, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
        # The entry was just made as a fifo in a directory only we write, so these
        # path-based calls reach it and nothing else (opening a fifo would block).
        os.chmod(base, m.mode, dir_fd=pfd)
        os.utime(base, ns=(m.mtime_ns, m.mtime_ns), dir_fd=pfd, follow_symlinks=False)

    def _hardlink(self, pfd: int, base: str, m: tarstream.Member) -> None:
        tcomps = _split(m.linkname)
        if tcomps is None:
            raise self._refuse(f"it hard-links to {m.linkname!r}, which leaves the root")
        if not tcomps:
            raise self._refuse("it hard-links to the root directory")
        with self._parent(tcomps, create=False) as found:
            tbase = tcomps[-1]
            try:
                if found is None:
                    raise FileNotFoundError
                tst = os.stat(tbase, dir_fd=found[0], follow_symlinks=False)
            except FileNotFoundError:
                raise self._refuse(f"it hard-links to {m.linkname!r}, which no earlier member "
                                   "made") from None
            if stat.S_ISDIR(tst.st_mode):
                raise self._refuse(f"it hard-links to {m.linkname!r}, a directory")
            try:
                if os.stat(base, dir_fd=pfd, follow_symlinks=False).st_ino == tst.st_ino:
                    return  # already that very file
            except FileNotFoundError:
                pass
            self._clear(pfd, base, keep_dir=False)
            # follow_symlinks=False: a link to a symlink links the symlink itself.
            os.link(tbase, base, src_dir_fd=found[0], dst_dir_fd=pfd, follow_symlinks=False)

    def _set_meta(self, fd: int, m: tarstream.Member) -> None:
        os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, m.mode)
        for name, value in m.xattrs:
            if name.startswith(_XATTR_PREFIXES) or name in _XATTR_NAMES:
                try:
                    os.setxattr(fd, name, value)
                except OSError as err:
                    if err.errno not in (errno.ENOTSUP, errno.EPERM, errno.EINVAL,
                                         errno.ERANGE, errno.ENOSPC, errno.E2BIG):
                        raise

    def _set_dir_time(self, resolved: list[str], mtime_ns: int) -> None:
        try:
            fd = self._reopen(resolved)
        except (FileNotFoundError, NotADirectoryError, OSError):
            return  # a later member replaced the directory; its own time stands
        try:
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)


# Decompression ---------------------------------------------------------------

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@contextmanager
def decompressed(raw: BinaryIO, label: str) -> Iterator[tarstream.Readable]:
    """The decompressed stream of a layer blob, chosen by its magic bytes.

    By magic rather than media type, as Docker does: blobs labelled with the wrong
    compression exist in the wild, and the digest check already proved the bytes.
    zstd goes through the ``zstd`` program (a Debian package vmfork already needs
    for packs) fed by a thread, not a Python binding: no new dependency, and the
    same tool decompresses packs. Damaged gzip surfaces as ``ImageBuildError``
    from ``LayerApplier``'s reads.
    """
    head = raw.read(4)
    raw.seek(0)
    if head.startswith(GZIP_MAGIC):
        with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            yield gz
    elif head == ZSTD_MAGIC:
        with _zstd(raw, label) as stream:
            yield stream
    else:
        yield raw


@contextmanager
def _zstd(raw: BinaryIO, label: str) -> Iterator[tarstream.Readable]:
    try:
        proc = subprocess.Popen(["zstd", "-q", "-d", "-c"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise ImageBuildError("oci-layer", f"{label} is zstd-compressed and the zstd program "
                              "is missing: apt-get install zstd") from None
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stdin = proc.stdin

    def feed() -> None:
        try:
            while block := raw.read(1 << 20):
                stdin.write(block)
        except (BrokenPipeError, ValueError):
            pass  # the reader stopped early (a refused layer): nothing more to feed
        finally:
            try:
                stdin.close()
            except BrokenPipeError:
                pass

    feeder = threading.Thread(target=feed, name="zstd-feed", daemon=True)
    feeder.start()
    finished = False
    try:
        yield cast(BinaryIO, proc.stdout)
        finished = True
    finally:
        if not finished:
            proc.kill()
        proc.stdout.close()
        status = proc.wait()
        feeder.join()
        detail = proc.stderr.read(2000).decode(errors="replace").strip()
        proc.stderr.close()
    if status != 0:
        raise ImageBuildError("oci-layer", f"{label}: the zstd stream is damaged or truncated "
                              f"(zstd: {detail or f'exit status {status}'})")
