"""The root of the errors vmfork's on-disk formats and durable writes raise.

It lives here, not in ``vmfork.vmm.errors``, because this package imports only the
standard library. It carries the fields ``vmm.errors.VmmError`` does (``op``,
``errno``, ``vm_id``), so code reporting either reads them alike; callers that turn
the VMM's host failures into their own (a failed capture, a refused spawn) catch
``OnDiskError`` next to ``VmmError``.
"""

from __future__ import annotations


class OnDiskError(Exception):
    """A vmfork file that cannot be read, written or trusted (bad format, torn write,
    failed fsync). ``op`` names the operation, ``errno`` the OS error if one caused it."""

    def __init__(self, message: str, *, op: str | None = None, errno: int | None = None,
                 vm_id: str | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.errno = errno
        self.vm_id = vm_id
