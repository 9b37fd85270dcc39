"""Where vmfork keeps things on the host.

Everything built or downloaded is cached under the user's cache directory
(``$XDG_CACHE_HOME/vmfork``, default ``~/.cache/vmfork``), content-addressed so
that a changed input builds a new entry and an unchanged one is reused.
``VMFORK_CACHE_DIR`` overrides the location (tests and CI use it to share one
cache between runs).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    override = os.environ.get("VMFORK_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vmfork"


def run_dir() -> Path:
    """Per-VM runtime files (sockets, console logs): a tmpfs where one exists."""
    override = os.environ.get("VMFORK_RUN_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "vmfork"
    if os.geteuid() == 0:
        return Path("/run/vmfork")
    return Path("/tmp") / f"vmfork-{os.geteuid()}"
