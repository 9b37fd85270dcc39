"""Read-only files opened for this process before it lost the right to open them.

A jailed VMM (``runtime/jail.py``) runs as a uid of its own, and the files it maps
(a snapshot's ``memory.bin`` is 0600, owned by the daemon's user) are not readable by
that uid. The jail opens them first, as the daemon's user, and leaves the descriptors
here (``adopt``); code reading its inputs -- the state file, the memory plan and the files it
maps (this package), a kernel or a disk (``vmfork.vmm``) -- opens them through
``open_ro``, which hands out a duplicate of a pre-opened descriptor for that path and
otherwise opens the path as usual (an unjailed VMM pre-opens nothing).
``vmfork.vmm.openfiles`` keeps the VMM's other pre-opened descriptors (read-write
volumes, taps, ``/proc/self`` files).
"""

from __future__ import annotations

import fcntl
import os

_preopened: dict[str, int] = {}


def adopt(path: str, fd: int) -> None:
    """Keep ``fd``, opened read-only for ``path`` by a jail before its drop."""
    _preopened[os.path.abspath(path)] = fd


def open_ro(path: str) -> int:
    """A new read-only descriptor of ``path`` (the caller closes it)."""
    fd = _preopened.get(os.path.abspath(path))
    if fd is not None:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
