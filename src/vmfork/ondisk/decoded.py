"""What a snapshot's file decodes to, kept by the file's path and identity.

A snapshot's files are never rewritten in place: a tag published again is a new
directory of new files, with new inodes. So a value decoded from one (the few keys a
jail needs from ``state.bin``, the sources of a ``memory.plan``, a snapshot's volume
slots) holds for as long as the file at that path has the same identity, and the
spawn path, which used to decode them at every spawn (design notes, session 24 and
session 32), decodes each once. The daemon spawns from several threads: a cache is
shared under a lock. Bounded: the oldest entry goes first.

A file changed in the last ``SETTLED_S`` seconds is decoded but not kept: a tag deleted
and published again could reuse the inode, and a timestamp is only as fine as the
kernel's clock tick, so a file that young could still be replaced by one of the same
identity (git's "racily clean" entries; ``store.chains.check_plan`` keeps its passes
the same way).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

FileIdentity = tuple[int, int, int, int, int]

SETTLED_S = 2.0


def file_identity(path: str) -> FileIdentity:
    """``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of ``path``; raises
    ``OSError``."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class DecodedFiles(Generic[T]):
    """``decode(path)`` for at most ``kept`` files, each kept while its identity holds."""

    def __init__(self, decode: Callable[[str], T], kept: int = 16) -> None:
        self._decode = decode
        self._kept = kept
        self._entries: dict[str, tuple[FileIdentity, T]] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> T:
        """What ``decode`` gives for ``path``, decoded again only if the file's identity
        changed (or it is too young to be kept: module docstring). Raises ``OSError`` for a file that cannot be stat'ed and whatever
        ``decode`` raises, keeping nothing then. The value is shared by every caller:
        it must not be changed."""
        identity = file_identity(path)
        with self._lock:
            cached = self._entries.get(path)
        if cached is not None and cached[0] == identity:
            return cached[1]
        value = self._decode(path)
        if time.time_ns() - max(identity[3], identity[4]) < SETTLED_S * 1e9:
            return value
        with self._lock:
            self._entries.pop(path, None)
            self._entries[path] = (identity, value)
            while len(self._entries) > self._kept:
                del self._entries[next(iter(self._entries))]
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
