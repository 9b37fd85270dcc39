"""File ops: read, write, list, stat, remove, mkdir, rename (stdlib only).

Data moves in ``CHUNK_SIZE`` frames both ways and is never held whole in memory, so
files of any size work. ``write`` is atomic: the data goes to a temporary file in the
target's directory (same file system, so ``rename`` is atomic), which is fsynced,
given its mode, and renamed over the target; the directory is then fsynced so the
rename itself is durable. Until the rename the target is untouched, and a failure
or a dropped connection removes the temporary file.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import stat as stat_mod
from typing import Any

from vmfork.agent import defaults, system
from vmfork.agent.conn import Conn
from vmfork.agent.protocol import CHUNK_SIZE, LIST_BATCH, ConnectionClosed
from vmfork.agent.request import OpError, get_bool, get_int, get_mode, get_path, os_error

WRITE_IDLE_TIMEOUT = 300.0
"""Seconds a ``write`` waits for the host's next data frame before giving up."""

_TYPES = {
    stat_mod.S_IFREG: "file", stat_mod.S_IFDIR: "dir", stat_mod.S_IFLNK: "symlink",
    stat_mod.S_IFIFO: "fifo", stat_mod.S_IFSOCK: "socket", stat_mod.S_IFCHR: "char",
    stat_mod.S_IFBLK: "block",
}


def file_type(st: os.stat_result) -> str:
    return _TYPES.get(stat_mod.S_IFMT(st.st_mode), "other")


def _describe(path: str, st: os.stat_result) -> dict[str, Any]:
    info: dict[str, Any] = {
        "name": os.path.basename(path.rstrip("/")) or "/",
        "type": file_type(st),
        "size": st.st_size,
        "mode": stat_mod.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }
    if stat_mod.S_ISLNK(st.st_mode):
        try:
            info["target"] = os.readlink(path)
        except OSError:
            info["target"] = None
    return info


def read(conn: Conn, req: dict[str, Any]) -> None:
    path = get_path(req)
    offset = get_int(req, "offset", 0)
    length = get_int(req, "length", None)
    assert offset is not None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise os_error(err, "read: open", path) from err
    try:
        if stat_mod.S_ISDIR(os.fstat(fd).st_mode):
            raise OpError("is_a_directory", f"read: {path!r} is a directory; use list",
                          path=path)
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        sent = 0
        # Read to EOF rather than to st_size: /proc and /sys files report size 0.
        while length is None or sent < length:
            want = CHUNK_SIZE if length is None else min(CHUNK_SIZE, length - sent)
            try:
                chunk = os.read(fd, want)
            except OSError as err:
                raise os_error(err, f"read: read at offset {offset + sent}", path) from err
            if not chunk:
                break
            conn.send({"type": "data"}, chunk)
            sent += len(chunk)
    finally:
        os.close(fd)
    conn.result(size=sent)


def write(conn: Conn, req: dict[str, Any]) -> None:
    path = get_path(req)
    mode = get_mode(req, "mode", 0o644)
    make_parents = get_bool(req, "make_parents", False)
    user = defaults.run_as(req.get("user"), "write")
    directory, name = os.path.split(path)
    if not name:
        raise OpError("bad_request", f"write: {path!r} names a directory, not a file")
    if make_parents:
        try:
            _makedirs(directory, 0o755, user)
        except OSError as err:
            raise os_error(err, "write: create parent directories", directory) from err
    if os.path.isdir(path):
        raise OpError("is_a_directory", f"write: {path!r} is a directory", path=path)
    tmp = os.path.join(directory, f".{name}.vmfork-{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as err:
        hint = "" if make_parents else " (pass make_parents to create missing directories)"
        raise os_error(err, f"write: create temporary file{hint}", tmp) from err
    done = False
    try:
        conn.send({"type": "ready"})
        size = 0
        while True:
            try:
                frame = conn.recv(WRITE_IDLE_TIMEOUT)
            except ConnectionClosed as err:
                raise OpError("bad_request", f"write {path!r}: the host hung up after "
                                             f"{size} bytes without 'eof'; file not written",
                              path=path) from err
            except TimeoutError as err:
                raise OpError("bad_request", f"write {path!r}: no data for "
                                             f"{WRITE_IDLE_TIMEOUT:g} s after {size} bytes; "
                                             "file not written", path=path) from err
            if frame.type == "eof":
                break
            if frame.type != "data":
                raise OpError("bad_request", f"write {path!r}: expected a 'data' or 'eof' "
                                             f"frame, got {frame.header!r:.200}")
            view = memoryview(frame.payload)
            while view:
                try:
                    n = os.write(fd, view)
                except OSError as err:
                    raise os_error(err, f"write: write at offset {size}", tmp) from err
                view = view[n:]
                size += n
        try:
            os.fsync(fd)
        except OSError as err:
            raise os_error(err, "write: fsync", tmp) from err
        try:
            if user is not None:
                os.fchown(fd, user.uid, user.gid)
            os.fchmod(fd, mode)
        except OSError as err:
            raise os_error(err, "write: chown/chmod", tmp) from err
        os.close(fd)
        fd = -1
        try:
            os.replace(tmp, path)
        except OSError as err:
            raise os_error(err, "write: rename into place", path) from err
        done = True
        _fsync_dir(directory)
    finally:
        if fd >= 0:
            os.close(fd)
        if not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    conn.result(size=size, uid=os.getuid() if user is None else user.uid)


def _fsync_dir(directory: str) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise os_error(err, "write: open directory for fsync", directory) from err
    try:
        os.fsync(dfd)
    except OSError as err:
        raise os_error(err, "write: fsync directory", directory) from err
    finally:
        os.close(dfd)


def list_dir(conn: Conn, req: dict[str, Any]) -> None:
    path = get_path(req)
    try:
        with os.scandir(path) as it:
            names = sorted(entry.name for entry in it)
    except OSError as err:
        raise os_error(err, "list", path) from err
    batch: list[dict[str, Any]] = []
    count = 0
    for name in names:
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue  # removed while we listed
        except OSError as err:
            raise os_error(err, "list: lstat", full) from err
        batch.append(_describe(full, st))
        count += 1
        if len(batch) == LIST_BATCH:
            conn.send({"type": "entries", "entries": batch})
            batch = []
    if batch:
        conn.send({"type": "entries", "entries": batch})
    conn.result(count=count)


def stat(conn: Conn, req: dict[str, Any]) -> None:
    path = get_path(req)
    follow = get_bool(req, "follow_symlinks", True)
    try:
        st = os.stat(path, follow_symlinks=follow)
    except OSError as err:
        raise os_error(err, "stat", path) from err
    info = _describe(path, st)
    info.update(path=path, uid=st.st_uid, gid=st.st_gid, nlink=st.st_nlink)
    conn.result(stat=info)


def remove(conn: Conn, req: dict[str, Any]) -> None:
    path = get_path(req)
    recursive = get_bool(req, "recursive", False)
    missing_ok = get_bool(req, "missing_ok", False)
    if os.path.normpath(path) == "/":
        raise OpError("bad_request", "remove: refusing to remove '/'")
    try:
        st = os.lstat(path)
        if not stat_mod.S_ISDIR(st.st_mode):
            os.unlink(path)
        elif recursive:
            shutil.rmtree(path)
        else:
            try:
                os.rmdir(path)
            except OSError as err:
                if err.errno == errno.ENOTEMPTY:
                    raise OpError("not_empty", f"remove: directory {path!r} is not empty "
                                               "(pass recursive=true to remove it and its "
                                               "contents)", path=path, errno=err.errno) from err
                raise
    except FileNotFoundError as err:
        if not missing_ok:
            raise os_error(err, "remove", err.filename or path) from err
    except OSError as err:
        raise os_error(err, "remove", err.filename or path) from err
    conn.result()


def mkdir(conn: Conn, req: dict[str, Any]) -> None:
    path = get_path(req)
    parents = get_bool(req, "parents", False)
    mode = get_mode(req, "mode", 0o755)
    user = defaults.run_as(req.get("user"), "mkdir")
    try:
        if parents:
            _makedirs(path, mode, user)
        else:
            os.mkdir(path, mode)
            if user is not None:
                os.chown(path, user.uid, user.gid)
    except FileExistsError as err:
        kind = "a directory" if os.path.isdir(path) else "a file"
        raise OpError("exists", f"mkdir: {path!r} already exists ({kind})"
                                + ("" if parents else "; pass parents=true to accept an "
                                                      "existing directory"),
                      path=path, errno=err.errno) from err
    except OSError as err:
        raise os_error(err, "mkdir", err.filename or path) from err
    conn.result(uid=os.getuid() if user is None else user.uid)


def _makedirs(path: str, mode: int, user: defaults.RunAs | None) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it creates owned by
    ``user`` (if given), as envd makes a user's missing parents; existing ones are
    left as they are."""
    if user is None:
        os.makedirs(path, mode, exist_ok=True)
        return
    missing: list[str] = []
    at = os.path.normpath(path)
    while not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue
        os.chown(directory, user.uid, user.gid)


RENAME_NOREPLACE = 1
AT_FDCWD = -100


def _rename_noreplace(src: str, dst: str) -> None:
    """rename(2) that fails with EEXIST instead of replacing ``dst``, atomically
    (renameat2's RENAME_NOREPLACE; a check-then-rename would race a guest program).
    File systems without the flag (EINVAL) fall back to the check."""
    libc = system.libc()
    call = libc.renameat2
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                     ctypes.c_uint]
    if call(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        os.rename(src, dst)
        return
    raise OSError(err, os.strerror(err), src)


def rename(conn: Conn, req: dict[str, Any]) -> None:
    """Move ``path`` to ``new_path`` (same file system; a directory with its contents).
    An existing ``new_path`` is an ``exists`` error unless ``overwrite``."""
    src = get_path(req)
    dst = get_path(req, "new_path")
    overwrite = get_bool(req, "overwrite", False)
    try:
        if overwrite:
            os.rename(src, dst)
        else:
            _rename_noreplace(src, dst)
    except FileExistsError as err:
        raise OpError("exists", f"rename: {dst!r} already exists; pass overwrite=true to "
                                "replace it", path=dst, errno=err.errno) from err
    except OSError as err:
        if err.errno == errno.EXDEV:
            raise OpError("os_error", f"rename {src!r} -> {dst!r}: the two paths are on "
                                      "different file systems", errno=err.errno,
                          path=dst) from err
        raise os_error(err, "rename", src) from err
    conn.result(path=src, new_path=dst)
