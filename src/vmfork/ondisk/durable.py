"""Durable writes: a vmfork file or name appears whole after a crash, or not at all.

Every writer of a snapshot's files goes through these (DESIGN.md decision 8,
"partial results are never registered as ready"): a file is written under a
temporary name in its final directory (a rename is atomic only within one file
system), fsynced, renamed over its final name, and the directory is fsynced so the
rename itself survives a crash. ``fsync_tree`` makes a whole pending directory
durable before the one rename that publishes it (``vmfork.store.store``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from vmfork.ondisk.errors import OnDiskError


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, making the names created or renamed in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a regular file's data and metadata."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every regular file and directory below ``root`` (``root`` included)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(p).st_mode):
                fsync_file(p)
        fsync_dir(dirpath)


def temp_name(path: str | os.PathLike[str]) -> Path:
    """A fresh hidden name next to ``path`` for writing it before the rename."""
    target = Path(path)
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def write_new_file(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> None:
    """Create ``path`` (it must not exist) holding ``data``, fsynced; the caller renames
    or publishes it. ``OSError`` as the system raised it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_into_place(temp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Rename the complete, fsynced ``temp`` over ``path`` and make the rename durable.
    ``temp`` is removed if the rename fails; ``OSError`` as the system raised it."""
    try:
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_dir(Path(path).parent)


def write_file_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` so that readers see the old file or the new, never a part.

    Raises ``OnDiskError`` naming the stage that failed; the temporary file is removed
    on failure.
    """
    target = Path(path)
    tmp = temp_name(target)
    stage = "open"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            stage = "write"
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            stage = "fsync"
            os.fsync(fd)
        finally:
            os.close(fd)
        stage = "rename"
        os.replace(tmp, target)
        stage = "fsync directory"
        fsync_dir(target.parent)
    except OSError as err:
        if stage != "fsync directory":
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise OnDiskError(f"cannot write {target}: {stage} failed: {err.strerror or err}; check "
                          "free space and permissions of the directory", op=f"write_file_atomic "
                          f"({stage})", errno=err.errno) from err
