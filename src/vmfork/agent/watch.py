"""The ``watch`` op: stream a directory's changes with inotify (stdlib only: inotify's
three calls through ``ctypes``, as ``system.py`` reaches other libc calls).

One connection per watch: the agent answers ``watching`` once its watches are in place
(changes from then on are reported), then ``events`` frames as changes happen, until
the host sends a frame (any: ``eof`` by convention) or hangs up. Events are batched
(``BATCH_EVENTS`` per frame, at most ``BATCH_DELAY`` seconds late).

Bounds. The kernel keeps each inotify instance's queue bounded
(``/proc/sys/fs/inotify/max_queued_events``) and says when it overflowed; that, and
directories past ``MAX_WATCHES`` in a recursive watch, reach the host as
``overflow``/``unwatched`` counts, never as unbounded memory here. Names are relative
to the watched directory.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import time
from typing import Any

from vmfork.agent import system
from vmfork.agent.conn import Conn, PeerGone
from vmfork.agent.protocol import ConnectionClosed, ProtocolError
from vmfork.agent.request import OpError, get_bool, get_path, os_error

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

WATCH_MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
              | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR)
EVENT_HEADER = struct.Struct("iIII")
"""struct inotify_event: wd, mask, cookie, len (then ``len`` bytes of NUL-padded name)."""

KINDS = ((IN_CREATE, "create"), (IN_MODIFY, "write"), (IN_DELETE, "remove"),
         (IN_MOVED_FROM, "rename_from"), (IN_MOVED_TO, "rename_to"), (IN_ATTRIB, "chmod"))

MAX_WATCHES = 1024
"""Directories one recursive watch follows."""
BATCH_EVENTS = 256
BATCH_DELAY = 0.05
READ_SIZE = 64 << 10


class Inotify:
    """One inotify instance and the directories it watches (relative names)."""

    def __init__(self) -> None:
        libc = system.libc()
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OpError("os_error", f"watch: inotify_init1: {os.strerror(err)}", errno=err)
        self.fd: int = fd
        self.dirs: dict[int, str] = {}
        """Watch descriptor → directory relative to the watched root ('' for the root)."""
        self.unwatched = 0
        """Directories left out because of ``MAX_WATCHES``."""

    def add(self, root: str, rel: str) -> bool:
        if len(self.dirs) >= MAX_WATCHES:
            self.unwatched += 1
            return False
        path = os.path.join(root, rel) if rel else root
        wd = self._add(self.fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if not rel:  # the root itself: the caller's error
                raise os_error(OSError(err, os.strerror(err)), "watch", root)
            return False  # a subdirectory that went away meanwhile
        self.dirs[wd] = rel
        return True

    def add_tree(self, root: str, rel: str) -> None:
        """Watch ``rel`` and every directory below it, breadth first, up to the cap."""
        pending = [rel]
        while pending:
            current = pending.pop(0)
            if not self.add(root, current):
                continue
            try:
                with os.scandir(os.path.join(root, current) if current else root) as it:
                    for entry in it:
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(os.path.join(current, entry.name))
            except OSError:
                continue

    def read(self) -> list[tuple[int, int, str]]:
        """Pending events as (wd, mask, name)."""
        try:
            data = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return []
        out: list[tuple[int, int, str]] = []
        at = 0
        while at + EVENT_HEADER.size <= len(data):
            wd, mask, _cookie, length = EVENT_HEADER.unpack_from(data, at)
            at += EVENT_HEADER.size
            raw = data[at:at + length]
            at += length
            out.append((wd, mask, os.fsdecode(raw.rstrip(b"\0"))))
        return out

    def close(self) -> None:
        os.close(self.fd)


def _read_stop(conn: Conn) -> None:
    """Consume what the host sent on a watch connection: whatever it is (a frame, a
    close, garbage), it means stop."""
    try:
        conn.recv(5.0)
    except (ConnectionClosed, ProtocolError, OSError):
        pass


def watch(conn: Conn, req: dict[str, Any]) -> None:
    root = get_path(req)
    recursive = get_bool(req, "recursive", False)
    if not os.path.isdir(root):
        if not os.path.lexists(root):
            raise OpError("not_found", f"watch {root!r}: no such directory", path=root)
        raise OpError("not_a_directory", f"watch {root!r}: not a directory", path=root)
    notify = Inotify()
    try:
        if recursive:
            notify.add_tree(root, "")
        else:
            notify.add(root, "")
        conn.send({"type": "watching", "path": root, "recursive": recursive,
                   "directories": len(notify.dirs), "unwatched": notify.unwatched})
        _stream(conn, notify, root, recursive)
    finally:
        notify.close()


def _stream(conn: Conn, notify: Inotify, root: str, recursive: bool) -> None:
    batch: list[dict[str, Any]] = []
    first_at: float | None = None
    total = overflows = 0
    root_gone = False
    while True:
        wait = None if first_at is None else max(0.0, first_at + BATCH_DELAY - time.monotonic())
        readable, _, _ = select.select([notify.fd, conn.sock.fileno()], [], [], wait)
        if conn.sock.fileno() in readable:
            _read_stop(conn)
            break
        if notify.fd in readable:
            for wd, mask, name in notify.read():
                if mask & IN_Q_OVERFLOW:
                    overflows += 1
                    continue
                if mask & IN_IGNORED:
                    notify.dirs.pop(wd, None)
                    continue
                rel_dir = notify.dirs.get(wd)
                if rel_dir is None:
                    continue
                if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                    root_gone = root_gone or rel_dir == ""
                    continue
                rel = os.path.join(rel_dir, name) if rel_dir else name
                is_dir = bool(mask & IN_ISDIR)
                if recursive and is_dir and mask & (IN_CREATE | IN_MOVED_TO):
                    notify.add_tree(root, rel)
                for bit, kind in KINDS:
                    if mask & bit:
                        batch.append({"name": rel, "type": kind, "is_dir": is_dir})
                if first_at is None and batch:
                    first_at = time.monotonic()
        due = first_at is not None and time.monotonic() >= first_at + BATCH_DELAY
        if batch and (due or len(batch) >= BATCH_EVENTS or root_gone):
            for start in range(0, len(batch), BATCH_EVENTS):
                conn.send({"type": "events", "events": batch[start:start + BATCH_EVENTS],
                           "overflow": overflows, "unwatched": notify.unwatched})
            total += len(batch)
            batch = []
            first_at = None
        if root_gone:
            break
    # The host may already be gone (it hung up to stop): then there is nobody to tell.
    try:
        conn.result(events=total, overflow=overflows, unwatched=notify.unwatched,
                    root_gone=root_gone)
    except PeerGone:  # a hang-up is how a watch ends
        conn.finished = True
