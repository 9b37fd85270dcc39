"""Split virtqueues (virtio 1.x), the device side: the queue's registers and record.

A ``Virtqueue`` is one queue's registers as a driver set them (size, ready, the three
ring addresses), its ring indices (``next_avail``, ``next_used``) and whether EVENT_IDX
was negotiated: what the unit tests, the fuzz targets and ``bench/blk.py`` hand the
native walk (the native transport keeps its own, ``mmio.rs``). ``QueueState`` is a
queue's record in a snapshot.

Everything that reads the rings is native (``native/src/virtq.rs``, through
``GuestMemory.native``): the check of the rings at activation (``validate``), the chain
walk, the used ring, the copies, and notification suppression (``needs_interrupt``).
Its module comment gives the rules that keep the VMM safe from what a hostile guest
writes there: every guest address bounds-checked before it is touched, no loop
bounded by the guest, any violation a ``VirtqueueError`` that the transport turns into
DEVICE_NEEDS_RESET. The Python walk that was its twin is deleted (design notes, "The
last Python twins"); the hostile-descriptor properties in
``tests/unit/test_virtio_queue.py`` drive the native one through ``_core.GuestRam``.

Features deliberately *not* offered: VIRTIO_F_INDIRECT_DESC (a descriptor with the
INDIRECT flag is therefore an error), packed virtqueues.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmfork.vmm.errors import HostError, VirtqueueError
from vmfork.vmm.memory import GuestMemory

MAX_QUEUE_SIZE = 256

VIRTQ_DESC_F_NEXT = 1
VIRTQ_DESC_F_WRITE = 2
VIRTQ_DESC_F_INDIRECT = 4

# The ring feature that makes ``used_event`` and ``avail_event`` live (virtio 1.x, 6).
VIRTIO_RING_F_EVENT_IDX = 1 << 29
VRING_AVAIL_F_NO_INTERRUPT = 1
# avail: flags u16, idx u16, ring[size] u16, (used_event u16: only with EVENT_IDX,
# but the layout reserves it and Linux allocates it, so it is checked too)
# used: flags u16, idx u16, ring[size] {id u32, len u32}, (avail_event u16)


def avail_ring_bytes(size: int) -> int:
    return 6 + 2 * size


@dataclass
class QueueState:
    """Plain-data twin of ``Virtqueue`` for snapshots."""

    max_size: int
    size: int
    ready: bool
    desc_table: int
    avail_ring: int
    used_ring: int
    next_avail: int
    next_used: int


def _no_native_view() -> HostError:
    return HostError("virtqueues are served only natively, and this guest memory has no "
                     "native view (is the native core built?)", op="virtqueue")


class Virtqueue:
    """The device's view of one split virtqueue, configured through transport registers."""

    def __init__(self, max_size: int) -> None:
        if not 0 < max_size <= MAX_QUEUE_SIZE or max_size & (max_size - 1):
            raise ValueError(f"queue max size {max_size} is not a power of 2 in 1..{MAX_QUEUE_SIZE}")
        self.max_size = max_size
        self.reset()

    def reset(self) -> None:
        self.size = self.max_size
        self.ready = False
        self.desc_table = 0
        self.avail_ring = 0
        self.used_ring = 0
        self.next_avail = 0  # free-running u16, like the ring indices
        self.next_used = 0
        # Whether the driver acked VIRTIO_RING_F_EVENT_IDX (the device sets it at
        # activation from its acked features; not saved: the features are).
        self.event_idx = False

    # -- configuration checks ---------------------------------------------------------
    @staticmethod
    def size_is_valid(size: int, max_size: int) -> bool:
        return 0 < size <= max_size and size & (size - 1) == 0

    def validate(self, memory: GuestMemory) -> None:
        """Check the rings' alignment and that they lie in guest RAM (at activation)."""
        if not self.size_is_valid(self.size, self.max_size):
            raise VirtqueueError(f"queue size {self.size} is not a power of 2 "
                                 f"in 1..{self.max_size}")
        native = memory.native
        if native is None:
            raise _no_native_view()
        native.validate(self.size, self.desc_table, self.avail_ring, self.used_ring,
                        self.max_size)

    def needs_interrupt(self, memory: GuestMemory, old_used: int) -> bool:
        """Whether the driver wants an interrupt for the batch that moved the used
        index from ``old_used`` to ``next_used`` (nothing moved: no)."""
        if old_used == self.next_used:
            return False
        native = memory.native
        if native is None:
            raise _no_native_view()
        return native.needs_interrupt(self.size, self.avail_ring, old_used, self.next_used,
                                      self.event_idx)

    # -- snapshots ----------------------------------------------------------------------------
    def save(self) -> QueueState:
        return QueueState(self.max_size, self.size, self.ready, self.desc_table,
                          self.avail_ring, self.used_ring, self.next_avail, self.next_used)

    def restore(self, state: QueueState) -> None:
        if state.max_size != self.max_size:
            raise ValueError(f"queue state has max size {state.max_size}, "
                             f"this queue {self.max_size}")
        self.size = state.size
        self.ready = state.ready
        self.desc_table = state.desc_table
        self.avail_ring = state.avail_ring
        self.used_ring = state.used_ring
        self.next_avail = state.next_avail & 0xFFFF
        self.next_used = state.next_used & 0xFFFF
