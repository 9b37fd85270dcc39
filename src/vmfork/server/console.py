"""The tail of a sandbox's guest console log (``GET /v1/sandboxes/:id/console``).

The log lives in the sandbox's run directory, which its jailed VMM can write: the
VMM (and so a guest that broke out of it) could put a symlink, a FIFO or a hard link
there in place of the log. The file is opened without following links and without
blocking, and read only if it is a regular file with one link; at most ``MAX_TAIL``
bytes are read, whatever its size.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_TAIL = 256 << 10
CONSOLE_LOG = "console.log"


class ConsoleUnavailable(OSError):
    """No readable console log (not written yet, or not a plain file); says which."""


def console_tail(run_dir: str | Path, nbytes: int) -> bytes:
    """The last ``nbytes`` (≤ ``MAX_TAIL``) of the console log, from a line start when
    the cut fell mid-line."""
    nbytes = max(0, min(nbytes, MAX_TAIL))
    path = Path(run_dir) / CONSOLE_LOG
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConsoleUnavailable(f"{path} does not exist (yet)") from None
    except OSError as err:
        raise ConsoleUnavailable(f"{path} cannot be opened: {err.strerror}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ConsoleUnavailable(f"{path} is not a plain file; not read")
        start = max(0, st.st_size - nbytes)
        # One byte more, before the cut: it says whether the cut fell on a line start.
        before = 1 if start > 0 else 0
        data = os.pread(fd, min(nbytes, st.st_size) + before, start - before)
    finally:
        os.close(fd)
    if before:
        cut_mid_line = data[:1] != b"\n"
        data = data[1:]
        newline = data.find(b"\n")
        if cut_mid_line and 0 <= newline < len(data) - 1:
            data = data[newline + 1:]
    return data
