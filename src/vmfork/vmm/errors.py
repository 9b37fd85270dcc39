"""The VMM's error hierarchy, by who caused the failure.

``VmmError`` carries the VM id and the failed operation. ``GuestError`` is the
guest's fault (a bad address, a malformed descriptor): the VMM survives it and
the device that saw it reports a device error to the guest. ``HostError`` is
ours or the host's (an ioctl failed, a file is missing).
"""

from __future__ import annotations


class VmmError(Exception):
    def __init__(self, message: str, *, vm_id: str | None = None, op: str | None = None,
                 errno: int | None = None) -> None:
        super().__init__(message)
        self.vm_id = vm_id
        self.op = op
        self.errno = errno


class HostError(VmmError):
    """The host failed us: an ioctl, a missing file, a resource limit."""


class GuestError(VmmError):
    """The guest did something invalid. Never fatal to the VMM."""


class GuestMemoryError(GuestError):
    """A guest physical address range that is not (entirely) backed by guest RAM."""


class VirtqueueError(GuestError):
    """A malformed virtqueue: bad index, descriptor loop, chain too long, bad address."""


class BootError(HostError):
    """The guest could not be loaded: bad kernel ELF, initrd does not fit, bad config."""


class StateError(VmmError):
    """The operation is not allowed in the VM's current state (e.g. resume a stopped VM)."""
