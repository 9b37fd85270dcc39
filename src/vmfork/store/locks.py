"""Per-tag locks: who is writing or deleting a tag right now, across processes.

A tag is in flight while some process holds an exclusive ``flock`` on
``<root>/locks/<tag>.lock``. ``begin`` takes it before creating its pending
directory and keeps it until ``publish`` has renamed that directory into place
(or ``abort`` has removed it); ``delete`` takes it around rename-and-remove.
Because the kernel drops a ``flock`` when its holder dies, the lock answers the
question stale-cleanup needs answered — "is the process that made this
``.pending-<tag>-*`` directory still alive?" — without the classic pitfalls of
pid files: a recycled pid, a holder in another pid namespace (a container
sharing ``VMFORK_HOME``), or a crash between creating the directory and
recording its owner. The holder still writes its pid and purpose into the lock
file, for the ``TagBusy`` message only.

Lock files are never unlinked: removing one while another process has it open
would let two processes each hold "the" lock on different inodes. They are a
few bytes per tag ever used.

Two locks on the same tag conflict even inside one process (a ``flock`` belongs
to an open file description, and each ``TagLock`` opens its own), so two
threads or two ``PendingSnapshot`` objects cannot claim one tag either.

A forked child inherits the descriptor and with it the lock, which would keep a
tag busy for as long as, say, a spawned VMM lives. The ``register_at_fork`` hook
closes the child's copies: the parent keeps the lock, the child never had it.
"""

from __future__ import annotations

import fcntl
import os
import time
import weakref
from pathlib import Path
from typing import Self

from vmfork.store.errors import StoreError, TagBusy


class TagLock:
    """An exclusive, non-blocking hold on one tag; ``release`` (or process death) drops it."""

    def __init__(self, fd: int, tag: str, path: Path) -> None:
        self._fd: int | None = fd
        self.tag = tag
        self.path = path

    @classmethod
    def try_acquire(cls, locks_dir: Path, tag: str, purpose: str) -> TagLock | None:
        """The lock, or None if another holder has it. ``tag`` must already be validated."""
        path = locks_dir / f"{tag}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise StoreError(f"cannot open the lock file {path}: {err.strerror}; check that the "
                             "store directory is writable", tag=tag, path=path) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as err:
            os.close(fd)
            raise StoreError(f"cannot lock {path}: {err.strerror}; the store must be on a local "
                             "file system that supports flock", tag=tag, path=path) from err
        note = f"pid {os.getpid()} {purpose} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
        except OSError:
            pass  # the note is for error messages only
        lock = cls(fd, tag, path)
        _held.add(lock)
        return lock

    @classmethod
    def acquire(cls, locks_dir: Path, tag: str, purpose: str) -> TagLock:
        """The lock, or ``TagBusy`` naming the current holder."""
        lock = cls.try_acquire(locks_dir, tag, purpose)
        if lock is None:
            raise TagBusy(tag, _read_holder(locks_dir / f"{tag}.lock"))
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            _held.discard(self)
            os.close(fd)  # closing the only descriptor drops the flock

    def __del__(self) -> None:
        self.release()


_held: weakref.WeakSet[TagLock] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    for lock in list(_held):
        if lock._fd is not None:
            try:
                os.close(lock._fd)  # the parent's descriptor still holds the flock
            except OSError:
                pass
            lock._fd = None
    _held.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)

# Tags cannot start with a dot, so this name never collides with a tag's lock file.
CHAINS_LOCK = ".chains.lock"


class ChainsLock:
    """The store-wide lock held while parent/child links change: publishing a snapshot
    that names a parent (the parent must still exist) and deleting one (its
    dependents must not change under the check). Held for metadata work only, never
    while memory is copied, so it is taken blocking. Crash-safe like ``TagLock``: the
    kernel drops the ``flock`` when its holder dies."""

    def __init__(self, locks_dir: Path) -> None:
        self.path = locks_dir / CHAINS_LOCK
        self._fd: int | None = None

    def __enter__(self) -> Self:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise StoreError(f"cannot open the lock file {self.path}: {err.strerror}; check "
                             "that the store directory is writable", path=self.path) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            os.close(fd)
            raise StoreError(f"cannot lock {self.path}: {err.strerror}; the store must be on "
                             "a local file system that supports flock", path=self.path) from err
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _read_holder(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return text[:200] or None
