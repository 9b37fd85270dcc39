"""Read-only files opened for this process before it lost the right to open them.

A jailed VMM (``runtime/jail.py``) runs as a uid of its own, and the files it maps
(a snapshot's ``memory.bin`` is 0600, owned by the daemon's user) are not readable by
that uid. The jail opens them first, as the daemon's user (``native/src/child.rs``),
and leaves the descriptors here (``adopt``); the VMM's code opens its read-only inputs
through ``open_ro``, which hands out a duplicate of a pre-opened descriptor for that
path and otherwise opens the path as usual (an unjailed VMM pre-opens nothing).
``open_ro`` is defined in ``vmfork.ondisk.readonly`` (the state file and memory plans
are read through it).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable

# The read-only half lives with the formats it reads (the state file, memory plans):
# one registry, filled by the jail, for both packages.
from vmfork.ondisk import readonly
from vmfork.ondisk.readonly import open_ro

__all__ = ["adopt", "open_device", "open_ro", "open_proc_self", "open_rw", "preopen_tap",
           "take_tap"]

_preopened_rw: dict[str, int] = {}
_taps: dict[str, int] = {}
_proc_self: dict[str, tuple[int, int]] = {}   # name -> (fd, open flags)
_devices: dict[str, int] = {}


def adopt(*, ro: Iterable[tuple[str, int]], rw: Iterable[tuple[str, int]],
          proc_self: dict[str, tuple[int, int]], devices: Iterable[tuple[str, int]],
          tap: tuple[str, int] | None) -> None:
    """Keep the descriptors a jail opened before its drop (``native/src/child.rs``:
    read-only and read-write files, -1 for one that was missing; ``/proc/self`` files
    as (fd, flags); devices, each checked to be a character device; the tap) for the
    ``open_*`` calls and ``take_tap``."""
    for path, fd in ro:
        if fd >= 0:
            readonly.adopt(path, fd)
    for path, fd in rw:
        if fd >= 0:
            _preopened_rw[os.path.abspath(path)] = fd
    _proc_self.update(proc_self)
    for path, fd in devices:
        _devices[path] = fd
    if tap is not None:
        preopen_tap(*tap)


def open_device(path: str) -> int | None:
    """A new descriptor of the pre-opened device ``path`` (the caller closes it), or
    None when none was: the caller then opens the path itself."""
    fd = _devices.get(path)
    return None if fd is None else fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)


def open_rw(path: str) -> int:
    """A new read-write descriptor of ``path`` (the caller closes it)."""
    fd = _preopened_rw.get(os.path.abspath(path))
    if fd is not None:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
    return os.open(path, os.O_RDWR | os.O_CLOEXEC)


def preopen_tap(name: str, fd: int) -> None:
    """Keep ``fd``, a descriptor attached to tap ``name``, for ``take_tap``: a jailed VMM
    can neither open ``/dev/net/tun`` nor attach to a tap it does not own."""
    old = _taps.pop(name, None)
    if old is not None:
        os.close(old)
    _taps[name] = fd


def take_tap(name: str) -> int | None:
    """The pre-opened descriptor of tap ``name`` (now the caller's), or None."""
    return _taps.pop(name, None)


def open_proc_self(name: str, flags: int) -> int:
    """A new descriptor of ``/proc/self/<name>`` (the caller closes it): a duplicate of
    the pre-opened one when it was opened with ``flags``, else a fresh open."""
    held = _proc_self.get(name)
    if held is not None and held[1] == flags:
        return fcntl.fcntl(held[0], fcntl.F_DUPFD_CLOEXEC, 0)
    return os.open(f"/proc/self/{name}", flags | os.O_CLOEXEC)
