"""The split virtqueue's device side (``native/src/virtq.rs``, the one implementation,
reached through ``_core.GuestRam``) against well-formed and hostile descriptor tables.

No device walks its rings in Python, so these tests drive the walk, the used ring and
the copies through ``GuestRam``'s ``pop``/``add_used``/``read``/``write``, which exist
for them and the fuzz target alone. The clean examples spell the spec's answers out;
the property on hostile tables (links out of the table, loops, writable-then-readable,
INDIRECT, buffers in the hole between the RAM regions, across a region's end, on the
rings and past RAM, the avail index run ahead, indices at the wrap, EVENT_IDX on and
off) holds the walk to the contract worked out from the guest's bytes alone: the chain
the spec makes of the descriptors, or the error for the first rule broken, in the
rules' order; copies that are exactly the chain's bytes, cut at the caller's limit and
the chain's end; used entries where the spec puts them; the interrupt the driver asked
for; and no guest byte written outside the chain's writable buffers, the used ring and
``avail_event``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmfork.vmm.devices.virtio.queue import (
    VIRTQ_DESC_F_INDIRECT,
    VIRTQ_DESC_F_NEXT,
    VIRTQ_DESC_F_WRITE,
    VRING_AVAIL_F_NO_INTERRUPT,
    QueueState,
    Virtqueue,
)
from vmfork.vmm.errors import GuestError, VirtqueueError
from vmfork.vmm.memory import GuestMemory, MemoryRegion, RegionLayout

# Two RAM regions with a hole between them, so that "outside RAM" includes the
# hole and the end: [0, 64 KiB) and [128 KiB, 192 KiB).
LOW = RegionLayout(0, 0x10000, 0)
HIGH = RegionLayout(0x20000, 0x10000, 0x10000)
DESC, AVAIL, USED = 0x1000, 0x2000, 0x3000


class CountingMemory(GuestMemory):
    """Guest memory over the two regions, with its native view, that counts the
    accesses made through Python (``view``) and checks, independently of
    ``GuestMemory``, that none it allowed reaches outside the two regions."""

    budget = 10_000

    def __init__(self) -> None:
        regions = [MemoryRegion(lay, mmap.mmap(-1, lay.size)) for lay in (LOW, HIGH)]
        super().__init__(regions)
        self.accesses = 0
        assert self.native is not None, "the native core is not built (scripts/lib.sh " \
                                        "setup_native)"

    def view(self, gpa: int, length: int) -> memoryview:
        self.accesses += 1
        assert self.accesses <= self.budget, "unbounded number of guest memory accesses"
        v = super().view(gpa, length)
        assert any(lay.guest_phys <= gpa and gpa + length <= lay.guest_phys + lay.size
                   for lay in (LOW, HIGH)), f"access {gpa:#x}+{length} outside RAM was allowed"
        return v


def make_queue(mem: GuestMemory, size: int = 8) -> Virtqueue:
    q = Virtqueue(16)
    q.size = size
    q.desc_table, q.avail_ring, q.used_ring = DESC, AVAIL, USED
    q.ready = True
    q.validate(mem)
    return q


def put_desc(mem: GuestMemory, index: int, addr: int, length: int, flags: int = 0,
             nxt: int = 0) -> None:
    mem.write(DESC + 16 * index, struct.pack("<QIHH", addr, length, flags, nxt))


def offer(mem: GuestMemory, *heads: int, start: int = 0, size: int = 8) -> None:
    for k, head in enumerate(heads):
        mem.write_u16(AVAIL + 4 + 2 * ((start + k) % size), head)
    mem.write_u16(AVAIL + 2, (start + len(heads)) & 0xFFFF)


@dataclass
class Chain:
    head: int
    readable: list[tuple[int, int]] = field(default_factory=list)
    writable: list[tuple[int, int]] = field(default_factory=list)


class Device:
    """What a device's native server does with one queue, one ``GuestRam`` call at a
    time: pop a chain, copy out of and into it, return it, ask about an interrupt.
    The ring indices stay in the ``Virtqueue``, as the servers hand them back."""

    def __init__(self, mem: CountingMemory, q: Virtqueue) -> None:
        assert mem.native is not None
        self.ram, self.q = mem.native, q

    def pop(self) -> Chain | None:
        q = self.q
        got = self.ram.pop(q.size, q.desc_table, q.avail_ring, q.next_avail, q.used_ring,
                           q.event_idx)
        if got is None:
            return None
        q.next_avail = (q.next_avail + 1) & 0xFFFF
        return Chain(*got)

    def read(self, chain: Chain, limit: int, offset: int = 0) -> bytes:
        return self.ram.read(chain.readable, limit, offset)

    def write(self, chain: Chain, data: bytes, offset: int = 0) -> int:
        return self.ram.write(chain.writable, data, offset)

    def add_used(self, head: int, written: int) -> None:
        q = self.q
        q.next_used = self.ram.add_used(q.size, q.used_ring, q.next_used, head, written)


@pytest.fixture
def mem() -> CountingMemory:
    return CountingMemory()


def test_pop_exposes_readable_then_writable_segments(mem: CountingMemory) -> None:
    q = make_queue(mem)
    dev = Device(mem, q)
    put_desc(mem, 2, 0x8000, 5, VIRTQ_DESC_F_NEXT, 5)
    put_desc(mem, 5, 0x20000, 3, VIRTQ_DESC_F_NEXT, 1)
    put_desc(mem, 1, 0x9000, 4, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 0)
    put_desc(mem, 0, 0x21000, 6, VIRTQ_DESC_F_WRITE)
    mem.write(0x8000, b"hello")
    mem.write(0x20000, b"abc")
    offer(mem, 2)
    chain = dev.pop()
    assert chain is not None and chain.head == 2
    assert chain.readable == [(0x8000, 5), (0x20000, 3)]
    assert chain.writable == [(0x9000, 4), (0x21000, 6)]
    assert dev.read(chain, 100) == b"helloabc"
    assert dev.read(chain, 4, offset=3) == b"loab"
    assert dev.write(chain, b"0123456789XYZ") == 10  # bounded by the chain
    assert mem.read(0x9000, 4) == b"0123" and mem.read(0x21000, 6) == b"456789"
    assert dev.write(chain, b"zz", offset=5) == 2
    assert mem.read(0x21000, 6) == b"4zz789"
    # From inside the first buffer across into the second, and not a byte beyond either.
    assert dev.write(chain, b"ABCD", offset=2) == 4
    assert mem.read(0x9000, 5) == b"01AB\0" and mem.read(0x21000, 7) == b"CDz789\0"
    assert dev.pop() is None
    dev.add_used(chain.head, 10)
    assert struct.unpack("<HHII", mem.read(USED, 12)) == (0, 1, 2, 10)


def avail_event(size: int = 8) -> int:
    return USED + 4 + 8 * size


def used_event(size: int = 8) -> int:
    return AVAIL + 4 + 2 * size


def test_an_empty_pop_asks_for_the_next_kick_only_with_event_idx(mem: CountingMemory) -> None:
    q = make_queue(mem)
    dev = Device(mem, q)
    put_desc(mem, 0, 0x8000, 1)
    mem.write_u16(avail_event(), 0xBEEF)
    offer(mem, 0, 0)
    assert dev.pop() is not None and dev.pop() is not None
    assert dev.pop() is None
    assert mem.read_u16(avail_event()) == 0xBEEF   # not negotiated: the word is the guest's
    q.event_idx = True
    assert dev.pop() is None
    assert mem.read_u16(avail_event()) == 2
    # While chains are there, pops leave it alone: no kicks for chains being popped.
    offer(mem, 0, 0, start=2)
    mem.write_u16(avail_event(), 7)
    assert dev.pop() is not None
    assert mem.read_u16(avail_event()) == 7
    assert dev.pop() is not None and dev.pop() is None
    assert mem.read_u16(avail_event()) == 4


def test_interrupts_follow_used_event_or_the_no_interrupt_flag(mem: CountingMemory) -> None:
    q = make_queue(mem)
    q.next_used = 5
    assert not q.needs_interrupt(mem, 5)   # nothing used: nothing to signal
    q.next_used = 7
    assert q.needs_interrupt(mem, 5)
    mem.write_u16(AVAIL, VRING_AVAIL_F_NO_INTERRUPT)
    assert not q.needs_interrupt(mem, 5)
    mem.write_u16(used_event(), 9)
    q.event_idx = True   # the flag means nothing now; used_event decides
    assert not q.needs_interrupt(mem, 5)   # 5 -> 7 does not cross 9
    q.next_used = 10
    assert q.needs_interrupt(mem, 7)       # 7 -> 10 does
    assert not q.needs_interrupt(mem, 10)
    mem.write_u16(used_event(), 0xFFFF)
    q.next_used = 1
    assert q.needs_interrupt(mem, 0xFFFE)  # across the wrap
    assert not q.needs_interrupt(mem, 0)


def test_indices_wrap_at_16_bits(mem: CountingMemory) -> None:
    q = make_queue(mem)
    dev = Device(mem, q)
    q.next_avail = q.next_used = 0xFFFF
    put_desc(mem, 0, 0x8000, 1)
    offer(mem, 0, start=0xFFFF)
    chain = dev.pop()
    assert chain is not None and q.next_avail == 0
    dev.add_used(chain.head, 0)
    assert mem.read_u16(USED + 2) == 0


@pytest.mark.parametrize("setup, message", [
    (lambda m: offer(m, 8), "beyond the queue size"),
    (lambda m: (put_desc(m, 0, 0x8000, 1, VIRTQ_DESC_F_NEXT, 9), offer(m, 0)),
     "links to 9"),
    (lambda m: (put_desc(m, 0, 0x8000, 1, VIRTQ_DESC_F_NEXT, 1),
                put_desc(m, 1, 0x8000, 1, VIRTQ_DESC_F_NEXT, 0), offer(m, 0)),
     "descriptor loop"),
    (lambda m: (put_desc(m, 0, 0x8000, 1, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 1),
                put_desc(m, 1, 0x8000, 1), offer(m, 0)),
     "follows a device-writable"),
    (lambda m: (put_desc(m, 0, 0x8000, 16, VIRTQ_DESC_F_INDIRECT), offer(m, 0)),
     "indirect"),
    (lambda m: (put_desc(m, 0, 0x18000, 1), offer(m, 0)), "outside guest RAM"),
    # A zero-length buffer touches no byte, but its address still has to be RAM: one
    # just past a region's end is not (found by the property test below).
    (lambda m: (put_desc(m, 0, 0x10000, 0), offer(m, 0)), "outside guest RAM"),
    (lambda m: (put_desc(m, 0, 0xFFF0, 0x20), offer(m, 0)), "outside guest RAM"),
    (lambda m: (put_desc(m, 0, 0x2F000, 0x2000), offer(m, 0)), "outside guest RAM"),
    (lambda m: (put_desc(m, 0, (1 << 64) - 8, 16), offer(m, 0)), "outside guest RAM"),
    (lambda m: m.write_u16(AVAIL + 2, 9), "ahead of the device"),
])
def test_hostile_chains_raise_virtqueue_error(mem: CountingMemory, setup: object,
                                             message: str) -> None:
    dev = Device(mem, make_queue(mem))
    setup(mem)  # type: ignore[operator]
    with pytest.raises(VirtqueueError, match=message):
        dev.pop()


@pytest.mark.parametrize("field, value, message", [
    ("desc_table", 0x1008, "not 16-byte aligned"),
    ("avail_ring", 0x2001, "not 2-byte aligned"),
    ("used_ring", 0x3002, "not 4-byte aligned"),
    ("used_ring", 0xFFF0, "outside guest RAM"),
    ("desc_table", 0x18000, "outside guest RAM"),
    ("size", 6, "not a power of 2"),
    ("size", 32, "not a power of 2"),
])
def test_validate_rejects_bad_rings(mem: CountingMemory, field: str, value: int,
                                    message: str) -> None:
    q = make_queue(mem)
    setattr(q, field, value)
    with pytest.raises(VirtqueueError, match=message):
        q.validate(mem)


def test_state_round_trip() -> None:
    q = Virtqueue(64)
    q.size, q.ready, q.desc_table, q.avail_ring, q.used_ring = 32, True, 0x1000, 0x2000, 0x3000
    q.next_avail, q.next_used = 7, 5
    state = q.save()
    again = Virtqueue(64)
    again.restore(QueueState(**vars(state)))
    assert again.save() == state
    with pytest.raises(ValueError, match="max size"):
        Virtqueue(128).restore(state)


# -- property: hostile tables -----------------------------------------------------------------
# Addresses near every boundary of the two regions, and anywhere in 64 bits.
interesting_addr = st.one_of(
    st.sampled_from([0, 0x8000, 0xFFFF, 0x10000, 0x1FFFF, 0x20000, 0x2FFFF, 0x30000,
                     (1 << 64) - 1, (1 << 32) - 1]),
    st.integers(0, 0x30000), st.integers(0, (1 << 64) - 1))
interesting_len = st.one_of(st.sampled_from([0, 1, 16, 0x1000, 0x10000, 0xFFFF_FFFF]),
                            st.integers(0, 0x20000))
# Mostly plausible descriptors (in RAM, sane flags, links inside the table), so that
# long chains and cycles are common; some entirely arbitrary ones.
plausible_descriptor = st.tuples(
    st.sampled_from([0x8000, 0x9000, 0x20000, 0x2F000]), st.integers(0, 0x1000),
    st.sampled_from([VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE,
                     0, VIRTQ_DESC_F_WRITE]),
    st.integers(0, 17))
arbitrary_descriptor = st.tuples(interesting_addr, interesting_len, st.integers(0, 0xFFFF),
                                 st.one_of(st.integers(0, 20), st.integers(0, 0xFFFF)))
descriptor = st.one_of(plausible_descriptor, plausible_descriptor, plausible_descriptor,
                       arbitrary_descriptor)


@st.composite
def descriptor_table(draw: st.DrawFn) -> list[tuple[int, int, int, int]]:
    """Half the time a driver's table (chains of readable then writable buffers, each
    descriptor linking to the next, some overwritten with hostile ones), so that
    walks get far and end well as often as they fail; else 16 random descriptors."""
    if draw(st.booleans()):
        return draw(st.lists(descriptor, min_size=16, max_size=16))
    table: list[tuple[int, int, int, int]] = []
    while len(table) < 16:
        n = min(draw(st.integers(1, 4)), 16 - len(table))
        writable = draw(st.integers(0, n))
        for k in range(n):
            last = k == n - 1
            flags = ((0 if last else VIRTQ_DESC_F_NEXT)
                     | (VIRTQ_DESC_F_WRITE if k >= n - writable else 0))
            # Short buffers as often as long ones, so that copies cross buffers.
            length = draw(st.one_of(st.integers(0, 24), st.integers(0, 0x1000)))
            table.append((draw(st.sampled_from([0x8000, 0x9000, 0x20000, 0x2F000])),
                          length, flags, 0 if last else len(table) + 1))
    for _ in range(draw(st.integers(0, 2))):
        table[draw(st.integers(0, 15))] = draw(descriptor)
    return table


def in_ram(addr: int, length: int) -> bool:
    """``guest_ram.rs``'s rule: the buffer's first address lies in a region, even a
    zero-length buffer's, and the buffer ends inside that region."""
    return any(lay.guest_phys <= addr < lay.guest_phys + lay.size
               and addr + length <= lay.guest_phys + lay.size
               for lay in (LOW, HIGH))


def spec_chain(mem: GuestMemory, size: int, head: int) -> Chain | str:
    """The chain the spec makes of the descriptors at ``head``, read from guest memory
    as it is now, or (part of) the error for the first rule it breaks, in virtq.rs's
    order: the head in the table; per descriptor, INDIRECT (not offered), its buffer in
    RAM, no readable buffer after a writable one; the link in the table; at most
    ``size`` descriptors (a longer chain must loop)."""
    if head >= size:
        return f"chain head {head} is beyond the queue size"
    chain = Chain(head)
    index = head
    for _ in range(size):
        addr, length, flags, nxt = struct.unpack("<QIHH", mem.read(DESC + 16 * index, 16))
        if flags & VIRTQ_DESC_F_INDIRECT:
            return f"descriptor {index} is indirect"
        if not in_ram(addr, length):
            return f"descriptor {index} buffer {addr:#x}+{length:#x} is outside guest RAM"
        if flags & VIRTQ_DESC_F_WRITE:
            chain.writable.append((addr, length))
        elif chain.writable:
            return f"descriptor {index} is device-readable but follows a device-writable"
        else:
            chain.readable.append((addr, length))
        if not flags & VIRTQ_DESC_F_NEXT:
            return chain
        if nxt >= size:
            return f"descriptor {index} links to {nxt}, beyond the queue size"
        index = nxt
    return f"chain {head} is longer than the queue size {size} (a descriptor loop)"


def need_event(event: int, new: int, old: int) -> bool:
    """``vring_need_event`` (virtio 1.x, 2.7.10): ``event`` lies in ``[old, new)``, mod 2**16."""
    return (new - event - 1) & 0xFFFF < (new - old) & 0xFFFF


def wants_interrupt(mem: GuestMemory, q: Virtqueue, old_used: int) -> bool:
    """The interrupt the driver asked for, from its words as they are now."""
    if old_used == q.next_used:
        return False
    if q.event_idx:
        return need_event(mem.read_u16(used_event(q.size)), q.next_used, old_used)
    return not mem.read_u16(AVAIL) & VRING_AVAIL_F_NO_INTERRUPT


def disjoint(segments: list[tuple[int, int]]) -> bool:
    spans = sorted((a, a + n) for a, n in segments if n)
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


class Image:
    """Guest RAM's bytes before a step, to check afterwards that the step wrote only
    where it may (the chain's writable buffers, the used ring, ``avail_event``)."""

    def __init__(self, mem: GuestMemory) -> None:
        self.mem = mem
        self.before = [bytearray(mem.read(lay.guest_phys, lay.size)) for lay in (LOW, HIGH)]

    def assert_written_only_in(self, allowed: list[tuple[int, int]]) -> None:
        for lay, image in zip((LOW, HIGH), self.before):
            for addr, length in allowed:
                lo, hi = max(addr, lay.guest_phys), min(addr + length, lay.guest_phys + lay.size)
                if lo < hi:
                    image[lo - lay.guest_phys:hi - lay.guest_phys] = self.mem.read(lo, hi - lo)
            assert self.mem.read(lay.guest_phys, lay.size) == image, \
                "the device wrote guest memory outside the chain, the used ring and avail_event"


@st.composite
def queue_input(draw: st.DrawFn) -> tuple[int, list[int], int]:
    """A queue size, its avail ring's heads and how far the avail index runs ahead:
    in range half the time (so that walks start and go on), else anywhere in 16 bits."""
    size = draw(st.sampled_from([1, 2, 4, 8, 16, 16, 16]))
    hostile = st.one_of(st.integers(0, 17), st.integers(0, 0xFFFF))
    head = hostile if draw(st.booleans()) else st.integers(0, size - 1)
    ahead = hostile if draw(st.booleans()) else st.integers(0, size)
    return size, draw(st.lists(head, min_size=16, max_size=16)), draw(ahead)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(queue=queue_input(),
       table=descriptor_table(),
       next_avail=st.integers(0, 0xFFFF),
       data=st.one_of(st.binary(min_size=1, max_size=64), st.binary(max_size=300)),
       offset=st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 0x2000)),
       event_idx=st.booleans(),
       flags=st.one_of(st.sampled_from([0, VRING_AVAIL_F_NO_INTERRUPT]),
                       st.integers(0, 0xFFFF)),
       # used_event, from the first used index: just before it, in the run, or anywhere.
       event=st.one_of(st.integers(-2, 20), st.integers(0, 0xFFFF)))
def test_hostile_descriptor_tables_get_the_contracts_answers(
        queue: tuple[int, list[int], int], table: list[tuple[int, int, int, int]],
        next_avail: int, data: bytes, offset: int, event_idx: bool, flags: int,
        event: int) -> None:
    """Popped dry, the queue gives the chains, errors, copies, used entries, interrupt
    decisions and ``avail_event`` that the guest's bytes call for, and writes nothing
    else."""
    size, ring, avail_ahead = queue
    mem = CountingMemory()
    q = Virtqueue(16)
    q.size, q.desc_table, q.avail_ring, q.used_ring, q.ready = size, DESC, AVAIL, USED, True
    q.next_avail = q.next_used = next_avail
    q.event_idx = event_idx
    dev = Device(mem, q)
    mem.write_u16(AVAIL, flags)
    mem.write_u16(used_event(size), (next_avail + event) & 0xFFFF)
    for i, (addr, length, dflags, nxt) in enumerate(table):
        put_desc(mem, i, addr, length, dflags, nxt)
    for i, head in enumerate(ring[:size]):
        mem.write_u16(AVAIL + 4 + 2 * i, head)
    mem.write_u16(AVAIL + 2, (next_avail + avail_ahead) & 0xFFFF)
    used_ring = (USED, 6 + 8 * size)
    for _ in range(size + 2):  # more pops than the ring can legally hold
        ahead = (mem.read_u16(AVAIL + 2) - q.next_avail) & 0xFFFF
        image = Image(mem)
        want: Chain | str | None
        if ahead > size:
            want = f"available index ran {ahead} entries ahead of the device"
        elif ahead == 0:
            want = None
        else:
            want = spec_chain(mem, size, mem.read_u16(AVAIL + 4 + 2 * (q.next_avail % size)))
        popped_at = q.next_avail
        try:
            chain = dev.pop()
        except GuestError as err:
            hypothesis.event("a VirtqueueError")
            assert isinstance(want, str) and type(err) is VirtqueueError, (want, err)
            assert str(err).startswith(want)
            assert q.next_avail == popped_at
            image.assert_written_only_in([])
            break
        assert chain == want
        hypothesis.event("a chain" if chain is not None else "an empty ring")
        if chain is None:
            # An empty ring: with EVENT_IDX the device asks for a kick at the next chain.
            assert q.next_avail == popped_at
            image.assert_written_only_in([(avail_event(size), 2)] if event_idx else [])
            if event_idx:
                assert mem.read_u16(avail_event(size)) == popped_at
            break
        assert q.next_avail == (popped_at + 1) & 0xFFFF
        image.assert_written_only_in([])
        readable = b"".join(mem.read(a, n) for a, n in chain.readable)
        writable_len = sum(n for _, n in chain.writable)
        assert dev.read(chain, 4096, offset) == readable[offset:offset + 4096]
        image = Image(mem)
        written = dev.write(chain, data, offset)
        assert written == max(0, min(len(data), writable_len - offset))
        image.assert_written_only_in(chain.writable)
        if disjoint(chain.writable):
            landed = b"".join(mem.read(a, n) for a, n in chain.writable)
            assert landed[offset:offset + written] == data[:written]
        old_used = q.next_used
        image = Image(mem)
        dev.add_used(chain.head, len(data))
        image.assert_written_only_in([used_ring])
        slot = USED + 4 + 8 * (old_used % size)
        assert struct.unpack("<II", mem.read(slot, 8)) == (chain.head, len(data))
        assert q.next_used == (old_used + 1) & 0xFFFF == mem.read_u16(USED + 2)
        assert q.needs_interrupt(mem, old_used) == wants_interrupt(mem, q, old_used)
    # The whole run as one batch.
    assert q.needs_interrupt(mem, next_avail) == wants_interrupt(mem, q, next_avail)


class BufferLayout:
    """Lays a differential test's buffers out in one memory (both paths' memories get
    the same bytes): in low or high RAM, or hostile places (the hole between them, across
    the end of low RAM, on the rings at ``rings``, past the end of RAM)."""

    def __init__(self, rings: int) -> None:
        self.rings = rings
        self.low, self.high = 0x4000, HIGH.guest_phys

    def place(self, where: str, length: int) -> int:
        if where == "hole":
            return LOW.size + 0x100
        if where == "cross":
            return LOW.size - max(1, length // 2)
        if where == "rings":
            return self.rings + 0x40
        if where == "past":
            return HIGH.guest_phys + HIGH.size + 0x10
        if where == "high" and self.high + length <= HIGH.guest_phys + HIGH.size:
            addr, self.high = self.high, self.high + length
            return addr
        if self.low + length > LOW.size:
            self.low = 0x4000   # wrap: buffers may alias each other, as a guest may make them
        addr, self.low = self.low, self.low + length
        return addr
