"""How much a test's own process grew: the peak resident size since a reset.

Writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM`` (the peak) to the current
``VmRSS`` (Documentation/filesystems/proc.rst), so a test can measure the peak of
exactly what it drives.
"""

from __future__ import annotations

from pathlib import Path


def status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Reset the peak to the current resident size; return that size in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")


def grown_bytes(before_kib: int) -> int:
    """How far the peak rose above ``before_kib`` (from ``reset_peak``), in bytes."""
    return (status_kib("VmHWM") - before_kib) * 1024
