"""Where vmfork keeps things on the host.

Everything built or downloaded is cached under the user's cache directory
(``$XDG_CACHE_HOME/vmfork``, default ``~/.cache/vmfork``), content-addressed so
that a changed input builds a new entry and an unchanged one is reused.
``VMFORK_CACHE_DIR`` overrides the location (tests and CI use it to share one
cache between runs).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def cache_dir() -> Path:
    override = os.environ.get("VMFORK_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vmfork"


def run_dir() -> Path:
    """Per-VM runtime files (sockets, console logs): a tmpfs where one exists.
    Created 0700 if missing; refused if another user could have put it there or can
    write into it (see ``private_dir``)."""
    override = os.environ.get("VMFORK_RUN_DIR")
    if override:
        return private_dir(Path(override))
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return private_dir(Path(xdg) / "vmfork")
    if os.geteuid() == 0:
        return private_dir(Path("/run/vmfork"))
    return private_dir(Path("/tmp") / f"vmfork-{os.geteuid()}")


class UnsafeDirectory(PermissionError):
    """A directory vmfork would keep sockets or state in belongs to someone else."""


def private_dir(path: Path, fix: str = "set VMFORK_RUN_DIR to a directory of your own"
                ) -> Path:
    """``path`` as a directory of this user's alone: made (0700) if missing; else it
    must be a real directory (not a symlink), owned by this user, and writable by no
    one else. ``/tmp/vmfork-<uid>`` is a name any local user can take first: their
    directory would receive our control sockets and our VMs' consoles."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a symlink?); remove it, or {fix}")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to this user "
                              f"({os.geteuid()}); remove it, or {fix}")
    if st.st_mode & 0o022:
        raise UnsafeDirectory(f"{path} is writable by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); chmod go-w it, or {fix}")
    return path
