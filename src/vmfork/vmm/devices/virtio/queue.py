"""Split virtqueues (virtio 1.x), the device side.

Every number read from a virtqueue is written by the guest, possibly while we
read it, possibly hostile. The rules that keep the VMM safe:

* **No guest address is dereferenced without a bounds check.** All access goes
  through ``GuestMemory``, which raises ``GuestMemoryError`` for anything not
  wholly inside guest RAM. The rings themselves are checked once when the queue
  is activated (``validate``); every descriptor buffer is checked as the chain
  is walked, before any byte of it is touched.
* **No loop is bounded by the guest.** A chain is walked at most ``size``
  descriptors (a longer chain must contain a cycle: the descriptor table has
  only ``size`` entries); a ``next`` index >= ``size`` is an error; an avail
  index that runs ahead of ours by more than ``size`` is an error (the driver
  can never have more than ``size`` heads outstanding). Byte copies are capped
  by the caller (``read_readable(limit)``) so a chain of 256 x 4 GiB buffers
  cannot make us allocate 1 TiB.
* **Any violation raises ``VirtqueueError``** (or ``GuestMemoryError``; both are
  ``GuestError``). The transport turns that into DEVICE_NEEDS_RESET and stops
  using the device; nothing here tries to "repair" a broken ring.

Features deliberately *not* offered (so this file needs no code for them):
VIRTIO_F_INDIRECT_DESC (a descriptor with the INDIRECT flag is therefore an
error). Packed virtqueues are not offered.

Notification suppression. Every device interrupts at most once per batch of used
buffers; virtio-net, the one device that asks (``needs_interrupt``), only if the
driver wants it: without VIRTIO_RING_F_EVENT_IDX, unless the avail ring's NO_INTERRUPT
flag is set (the others ignore the flag, which the spec allows); with it (``event_idx``,
set by the device that offered and got it), only when the batch moved the used index
across the driver's ``used_event`` (the avail ring's trailing word,
``vring_need_event``). With EVENT_IDX the device also moderates the
driver's kicks: ``pop`` finding the ring empty publishes ``avail_event`` (the used
ring's trailing word) as its ``next_avail``, so the driver kicks for the next chain
and not for those it adds while the device is still popping, and looks again. Both
words are the guest's: each is read once per decision, and a guest that never lets
an interrupt through only starves itself. Suppression is a classic source of lost
wake-ups; the two places where one hides are the barriers below.

Memory ordering. The driver writes a ring entry, then (after a write barrier)
the avail index; we read the index first, then the entries. The device writes
a used element, then the used index. On x86 (TSO) loads are not reordered with
older loads and stores are not reordered with older stores, and CPython issues
our loads and stores in program order, one bytecode at a time; so program order
*is* the required order and no explicit fence is needed. A port to a weakly
ordered architecture would need fences where the comments say "barrier".
Suppression is the exception: it needs a store ordered before a later load, which
TSO does not give (the store buffer). The used index must be visible before we read
``used_event`` (else a driver re-enabling interrupts in between reads our old index
and we its old event: neither acts, a lost interrupt), and ``avail_event`` before we
read the avail index again (else a lost kick). ``_full_barrier`` is a locked
instruction there, as Linux's ``virtio_mb`` is.

Native path. Where the native core is built (``GuestMemory.native``), the walk, the
used ring and the copies run in Rust (``native/src/virtq.rs``) under the same rules
and with the same error messages; the registers and ``QueueState`` stay here, so a
snapshot's record is one and the same. The Python code below is the
``VMFORK_NATIVE=0`` path and the reference the unit tests hold the native one to.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from vmfork.vmm.errors import GuestMemoryError, VirtqueueError
from vmfork.vmm.memory import GuestMemory

MAX_QUEUE_SIZE = 256

VIRTQ_DESC_F_NEXT = 1
VIRTQ_DESC_F_WRITE = 2
VIRTQ_DESC_F_INDIRECT = 4

DESC_SIZE = 16

# The ring feature that makes ``used_event`` and ``avail_event`` live (virtio 1.x, 6).
VIRTIO_RING_F_EVENT_IDX = 1 << 29
VRING_AVAIL_F_NO_INTERRUPT = 1
# avail: flags u16, idx u16, ring[size] u16, (used_event u16: only with EVENT_IDX,
# but the layout reserves it and Linux allocates it, so we check it too)
# used: flags u16, idx u16, ring[size] {id u32, len u32}, (avail_event u16)


_BARRIER = threading.Lock()


def _full_barrier() -> None:
    """A full memory barrier: an uncontended lock's acquire is a locked
    read-modify-write, which x86 orders against every earlier store and later load."""
    with _BARRIER:
        pass


def need_event(event: int, new: int, old: int) -> bool:
    """``vring_need_event``: whether ``event`` lies in ``[old, new)``, modulo 2**16."""
    return (new - event - 1) & 0xFFFF < (new - old) & 0xFFFF


def avail_ring_bytes(size: int) -> int:
    return 6 + 2 * size


def used_ring_bytes(size: int) -> int:
    return 6 + 8 * size


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


@dataclass
class DescriptorChain:
    """One available chain: its head index and its buffers, readable ones first.

    Segments are ``(guest physical address, length)`` pairs already checked to
    lie inside guest RAM (at the time of the walk; RAM does not shrink).
    """

    head: int
    readable: list[tuple[int, int]] = field(default_factory=list)
    writable: list[tuple[int, int]] = field(default_factory=list)

    @property
    def readable_len(self) -> int:
        return sum(n for _, n in self.readable)

    @property
    def writable_len(self) -> int:
        return sum(n for _, n in self.writable)

    def read_readable(self, memory: GuestMemory, limit: int, offset: int = 0) -> bytes:
        """Up to ``limit`` bytes of the readable part, starting ``offset`` bytes in."""
        if memory.native is not None:
            return memory.native.read(self.readable, limit, offset)
        out = bytearray()
        for gpa, length in self.readable:
            if len(out) >= limit:
                break
            if offset >= length:
                offset -= length
                continue
            take = min(length - offset, limit - len(out))
            out += memory.view(gpa + offset, take)
            offset = 0
        return bytes(out)

    def write_writable(self, memory: GuestMemory, data: bytes | bytearray | memoryview,
                       offset: int = 0) -> int:
        """Scatter ``data`` into the writable part from ``offset``; return bytes written.

        Writes stop at the end of the writable buffers: a short chain truncates,
        it never overflows.
        """
        if memory.native is not None:
            return memory.native.write(self.writable, data if isinstance(data, bytes)
                                       else bytes(data), offset)
        src = memoryview(data)
        written = 0
        for gpa, length in self.writable:
            if written >= len(src):
                break
            if offset >= length:
                offset -= length
                continue
            take = min(length - offset, len(src) - written)
            memory.view(gpa + offset, take)[:] = src[written:written + take]
            written += take
            offset = 0
        return written


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
        if memory.native is not None:
            memory.native.validate(self.size, self.desc_table, self.avail_ring,
                                   self.used_ring, self.max_size)
            return
        for name, addr, align, length in (
                ("descriptor table", self.desc_table, 16, DESC_SIZE * self.size),
                ("available ring", self.avail_ring, 2, avail_ring_bytes(self.size)),
                ("used ring", self.used_ring, 4, used_ring_bytes(self.size))):
            if addr % align:
                raise VirtqueueError(f"{name} at {addr:#x} is not {align}-byte aligned")
            try:
                memory.check_range(addr, length)
            except GuestMemoryError as err:
                raise VirtqueueError(f"{name} at {addr:#x}+{length:#x} is outside "
                                     f"guest RAM: {err}") from err

    # -- device side of the rings -------------------------------------------------------
    def _avail_idx(self, memory: GuestMemory) -> int:
        return memory.read_u16(self.avail_ring + 2)

    def pending(self, memory: GuestMemory) -> int:
        """How many chains the driver has made available that we have not popped."""
        if memory.native is not None:
            return memory.native.pending(self.size, self.avail_ring, self.next_avail)
        ahead = (self._avail_idx(memory) - self.next_avail) & 0xFFFF
        if ahead > self.size:
            raise VirtqueueError(f"available index ran {ahead} entries ahead of the device, "
                                 f"more than the queue size {self.size}")
        return ahead

    def pop(self, memory: GuestMemory) -> DescriptorChain | None:
        """The next available chain, or ``None`` if the driver has offered none (with
        EVENT_IDX, having asked for a kick at the next one and looked again)."""
        if not self.ready:
            raise VirtqueueError("pop from a queue that is not ready")
        if memory.native is not None:
            got = memory.native.pop(self.size, self.desc_table, self.avail_ring,
                                    self.next_avail, self.used_ring, self.event_idx)
            if got is None:
                return None
            self.next_avail = (self.next_avail + 1) & 0xFFFF
            return DescriptorChain(*got)
        if self.pending(memory) == 0:
            if not self.event_idx:
                return None
            memory.write_u16(self.used_ring + 4 + 8 * self.size, self.next_avail)
            _full_barrier()  # avail_event above before the avail index below
            if self.pending(memory) == 0:
                return None
        # barrier: the avail idx load above precedes the ring-entry load below (TSO).
        slot = self.next_avail % self.size
        head = memory.read_u16(self.avail_ring + 4 + 2 * slot)
        chain = self._walk(memory, head)
        self.next_avail = (self.next_avail + 1) & 0xFFFF
        return chain

    def undo_pop(self) -> None:
        """Give back the last popped chain (the device found nothing to put in it)."""
        self.next_avail = (self.next_avail - 1) & 0xFFFF

    def _walk(self, memory: GuestMemory, head: int) -> DescriptorChain:
        if head >= self.size:
            raise VirtqueueError(f"chain head {head} is beyond the queue size {self.size}")
        chain = DescriptorChain(head)
        index = head
        for _ in range(self.size):  # hard bound: a longer chain must loop
            base = self.desc_table + DESC_SIZE * index
            addr = memory.read_u64(base)
            length = memory.read_u32(base + 8)
            flags = memory.read_u16(base + 12)
            nxt = memory.read_u16(base + 14)
            if flags & VIRTQ_DESC_F_INDIRECT:
                raise VirtqueueError(f"descriptor {index} is indirect, which was not offered")
            try:
                memory.check_range(addr, length)
            except GuestMemoryError as err:
                raise VirtqueueError(f"descriptor {index} buffer {addr:#x}+{length:#x} is "
                                     f"outside guest RAM") from err
            if flags & VIRTQ_DESC_F_WRITE:
                chain.writable.append((addr, length))
            elif chain.writable:
                raise VirtqueueError(f"descriptor {index} is device-readable but follows a "
                                     f"device-writable one in chain {head}")
            else:
                chain.readable.append((addr, length))
            if not flags & VIRTQ_DESC_F_NEXT:
                return chain
            if nxt >= self.size:
                raise VirtqueueError(f"descriptor {index} links to {nxt}, beyond the "
                                     f"queue size {self.size}")
            index = nxt
        raise VirtqueueError(f"chain {head} is longer than the queue size {self.size} "
                             f"(a descriptor loop)")

    def add_used(self, memory: GuestMemory, head: int, written: int) -> None:
        """Return chain ``head`` to the driver with ``written`` bytes filled in."""
        if memory.native is not None:
            self.next_used = memory.native.add_used(self.size, self.used_ring, self.next_used,
                                                    head, written)
            return
        slot = self.next_used % self.size
        elem = self.used_ring + 4 + 8 * slot
        memory.write_u32(elem, head)
        memory.write_u32(elem + 4, written)
        # barrier: the element stores above become visible before the index store (TSO).
        self.next_used = (self.next_used + 1) & 0xFFFF
        memory.write_u16(self.used_ring + 2, self.next_used)

    def needs_interrupt(self, memory: GuestMemory, old_used: int) -> bool:
        """Whether the driver wants an interrupt for the batch that moved the used
        index from ``old_used`` to ``next_used`` (nothing moved: no)."""
        if old_used == self.next_used:
            return False
        if memory.native is not None:
            return memory.native.needs_interrupt(self.size, self.avail_ring, old_used,
                                                 self.next_used, self.event_idx)
        _full_barrier()  # the used index add_used stored before the word below
        if self.event_idx:
            used_event = memory.read_u16(self.avail_ring + 4 + 2 * self.size)
            return need_event(used_event, self.next_used, old_used)
        return not memory.read_u16(self.avail_ring) & VRING_AVAIL_F_NO_INTERRUPT

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
