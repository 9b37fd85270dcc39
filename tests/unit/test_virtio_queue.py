"""The split virtqueue against well-formed and hostile descriptor tables.

Every test runs on both implementations of the walk: the native one
(``native/src/virtq.rs``, through ``GuestMemory.native``) and the Python one
(``VMFORK_NATIVE=0``'s), and a differential property holds them to the same
outcome, chain for chain and message for message.
"""

from __future__ import annotations

import mmap
import struct

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
from vmfork.vmm.errors import GuestError, GuestMemoryError, VirtqueueError
from vmfork.vmm.memory import GuestMemory, MemoryRegion, RegionLayout
from vmfork.vmm.native import NATIVE

# Two RAM regions with a hole between them, so that "outside RAM" includes the
# hole and the end: [0, 64 KiB) and [128 KiB, 192 KiB).
LOW = RegionLayout(0, 0x10000, 0)
HIGH = RegionLayout(0x20000, 0x10000, 0x10000)
DESC, AVAIL, USED = 0x1000, 0x2000, 0x3000


class CountingMemory(GuestMemory):
    """Guest memory that records every access the device makes.

    It stops the test (AssertionError) past ``budget`` accesses, so an
    unbounded walk fails instead of hanging, and it checks independently of
    ``GuestMemory`` that no access it allowed reaches outside the two regions.
    """

    budget = 10_000

    def __init__(self, backend: str = "python") -> None:
        regions = [MemoryRegion(lay, mmap.mmap(-1, lay.size)) for lay in (LOW, HIGH)]
        super().__init__(regions)
        self.accesses = 0
        if backend == "native":
            if self.native is None:
                pytest.skip("the native core is not built (scripts/lib.sh setup_native) "
                            "or VMFORK_NATIVE=0")
        elif self.native is not None:
            # The Python walk, which counts its accesses through view() below.
            self.native.close()
            self.native = None

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


BACKENDS = ["python", "native"]


@pytest.fixture(params=BACKENDS)
def mem(request: pytest.FixtureRequest) -> CountingMemory:
    return CountingMemory(request.param)


def test_pop_exposes_readable_then_writable_segments(mem: CountingMemory) -> None:
    q = make_queue(mem)
    put_desc(mem, 2, 0x8000, 5, VIRTQ_DESC_F_NEXT, 5)
    put_desc(mem, 5, 0x20000, 3, VIRTQ_DESC_F_NEXT, 1)
    put_desc(mem, 1, 0x9000, 4, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 0)
    put_desc(mem, 0, 0x21000, 6, VIRTQ_DESC_F_WRITE)
    mem.write(0x8000, b"hello")
    mem.write(0x20000, b"abc")
    offer(mem, 2)
    chain = q.pop(mem)
    assert chain is not None and chain.head == 2
    assert chain.readable == [(0x8000, 5), (0x20000, 3)]
    assert chain.writable == [(0x9000, 4), (0x21000, 6)]
    assert chain.read_readable(mem, 100) == b"helloabc"
    assert chain.read_readable(mem, 4, offset=3) == b"loab"
    assert chain.write_writable(mem, b"0123456789XYZ") == 10  # bounded by the chain
    assert mem.read(0x9000, 4) == b"0123" and mem.read(0x21000, 6) == b"456789"
    assert chain.write_writable(mem, b"zz", offset=5) == 2
    assert mem.read(0x21000, 6) == b"4zz789"
    assert q.pop(mem) is None
    q.add_used(mem, chain.head, 10)
    assert struct.unpack("<HHII", mem.read(USED, 12)) == (0, 1, 2, 10)


def avail_event(size: int = 8) -> int:
    return USED + 4 + 8 * size


def used_event(size: int = 8) -> int:
    return AVAIL + 4 + 2 * size


def test_an_empty_pop_asks_for_the_next_kick_only_with_event_idx(mem: CountingMemory) -> None:
    q = make_queue(mem)
    put_desc(mem, 0, 0x8000, 1)
    mem.write_u16(avail_event(), 0xBEEF)
    offer(mem, 0, 0)
    assert q.pop(mem) is not None and q.pop(mem) is not None
    assert q.pop(mem) is None
    assert mem.read_u16(avail_event()) == 0xBEEF   # not negotiated: the word is the guest's
    q.event_idx = True
    assert q.pop(mem) is None
    assert mem.read_u16(avail_event()) == 2
    # While chains are there, pops leave it alone: no kicks for chains being popped.
    offer(mem, 0, 0, start=2)
    mem.write_u16(avail_event(), 7)
    assert q.pop(mem) is not None
    assert mem.read_u16(avail_event()) == 7
    assert q.pop(mem) is not None and q.pop(mem) is None
    assert mem.read_u16(avail_event()) == 4


class RacingMemory(CountingMemory):
    """A guest that offers a chain just as the device publishes ``avail_event``, before
    it could see the request: it will not kick for that chain."""

    raced = False

    def write_u16(self, gpa: int, value: int) -> None:
        super().write_u16(gpa, value)
        if gpa == avail_event() and not self.raced:
            self.raced = True
            offer(self, 0, start=value)


def test_an_empty_pop_looks_again_after_asking_for_a_kick() -> None:
    mem = RacingMemory("python")
    q = make_queue(mem)
    q.event_idx = True
    put_desc(mem, 0, 0x8000, 1)
    chain = q.pop(mem)
    assert mem.raced and chain is not None and chain.head == 0 and q.next_avail == 1


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
    q.next_avail = q.next_used = 0xFFFF
    put_desc(mem, 0, 0x8000, 1)
    offer(mem, 0, start=0xFFFF)
    chain = q.pop(mem)
    assert chain is not None and q.next_avail == 0
    q.add_used(mem, chain.head, 0)
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
    (lambda m: (put_desc(m, 0, 0xFFF0, 0x20), offer(m, 0)), "outside guest RAM"),
    (lambda m: (put_desc(m, 0, 0x2F000, 0x2000), offer(m, 0)), "outside guest RAM"),
    (lambda m: (put_desc(m, 0, (1 << 64) - 8, 16), offer(m, 0)), "outside guest RAM"),
    (lambda m: m.write_u16(AVAIL + 2, 9), "ahead of the device"),
])
def test_hostile_chains_raise_virtqueue_error(mem: CountingMemory, setup: object,
                                             message: str) -> None:
    q = make_queue(mem)
    setup(mem)  # type: ignore[operator]
    with pytest.raises(VirtqueueError, match=message):
        q.pop(mem)


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


def test_pop_from_unready_queue_is_an_error(mem: CountingMemory) -> None:
    q = make_queue(mem)
    q.ready = False
    with pytest.raises(VirtqueueError, match="not ready"):
        q.pop(mem)


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


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.sampled_from([1, 2, 4, 8, 16]),
       table=st.lists(descriptor, min_size=16, max_size=16),
       ring=st.lists(st.one_of(st.integers(0, 17), st.integers(0, 0xFFFF)),
                     min_size=16, max_size=16),
       avail_ahead=st.one_of(st.integers(0, 17), st.integers(0, 0xFFFF)),
       next_avail=st.integers(0, 0xFFFF),
       data=st.binary(max_size=300))
@pytest.mark.parametrize("backend", BACKENDS)
def test_hostile_descriptor_tables_fail_only_as_guest_errors(
        backend: str, size: int, table: list[tuple[int, int, int, int]], ring: list[int],
        avail_ahead: int, next_avail: int, data: bytes) -> None:
    mem = CountingMemory(backend)
    q = Virtqueue(16)
    q.size, q.desc_table, q.avail_ring, q.used_ring, q.ready = size, DESC, AVAIL, USED, True
    q.next_avail = next_avail
    for i, (addr, length, flags, nxt) in enumerate(table):
        put_desc(mem, i, addr, length, flags, nxt)
    for i, head in enumerate(ring[:size]):
        mem.write_u16(AVAIL + 4 + 2 * i, head)
    mem.write_u16(AVAIL + 2, (next_avail + avail_ahead) & 0xFFFF)
    for _ in range(size + 2):  # more pops than the ring can legally hold
        mem.accesses = 0
        try:
            chain = q.pop(mem)
        except GuestError as err:
            assert isinstance(err, (VirtqueueError, GuestMemoryError))
            return
        # A chain walk reads 4 fields per descriptor, at most `size` descriptors.
        assert mem.accesses <= 4 * size + 4
        if chain is None:
            return
        assert len(chain.readable) + len(chain.writable) <= size
        for gpa, length in chain.readable + chain.writable:
            mem.check_range(gpa, length)
        # Copies are bounded by the caller's limit / the chain, whatever the lengths claim.
        assert len(chain.read_readable(mem, 4096)) <= 4096
        assert chain.write_writable(mem, data) <= len(data)
        q.add_used(mem, chain.head, 0)


def _outcomes(mem: CountingMemory, size: int, table: list[tuple[int, int, int, int]],
              ring: list[int], avail_ahead: int, next_avail: int, data: bytes,
              offset: int, event_idx: bool = False, flags: int = 0,
              event: int = 0) -> list[object]:
    """Everything a device could learn from popping this queue dry, in order, and
    whether it would interrupt after each chain it used."""
    q = Virtqueue(16)
    q.size, q.desc_table, q.avail_ring, q.used_ring, q.ready = size, DESC, AVAIL, USED, True
    q.next_avail = q.next_used = next_avail
    q.event_idx = event_idx
    mem.write_u16(AVAIL, flags)
    mem.write_u16(used_event(size), event)
    for i, (addr, length, flags, nxt) in enumerate(table):
        put_desc(mem, i, addr, length, flags, nxt)
    for i, head in enumerate(ring[:size]):
        mem.write_u16(AVAIL + 4 + 2 * i, head)
    mem.write_u16(AVAIL + 2, (next_avail + avail_ahead) & 0xFFFF)
    seen: list[object] = []
    for _ in range(size + 2):
        try:
            chain = q.pop(mem)
        except GuestError as err:
            seen.append((type(err).__name__, str(err)))
            break
        if chain is None:
            seen.append(None)
            break
        seen.append((chain.head, chain.readable, chain.writable,
                     chain.read_readable(mem, 4096, offset),
                     chain.write_writable(mem, data, offset)))
        old_used = q.next_used
        q.add_used(mem, chain.head, len(data))
        seen.append(q.needs_interrupt(mem, old_used))
    seen.append(q.needs_interrupt(mem, next_avail))   # the whole run as one batch
    seen.append((q.next_avail, q.next_used, mem.read(USED, 6 + 8 * size)))
    # What the device wrote into the guest's buffers, wherever the chains put them.
    seen.append((mem.read(0x8000, 0x2000), mem.read(0x20000, 0x10000)))
    return seen


@pytest.mark.skipif(not NATIVE, reason="the native core is not built (scripts/lib.sh "
                    "setup_native) or VMFORK_NATIVE=0")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.sampled_from([1, 2, 4, 8, 16]),
       table=st.lists(descriptor, min_size=16, max_size=16),
       ring=st.lists(st.one_of(st.integers(0, 17), st.integers(0, 0xFFFF)),
                     min_size=16, max_size=16),
       avail_ahead=st.one_of(st.integers(0, 17), st.integers(0, 0xFFFF)),
       next_avail=st.integers(0, 0xFFFF),
       data=st.binary(max_size=300),
       offset=st.one_of(st.integers(0, 8), st.integers(0, 0x2000)),
       event_idx=st.booleans(),
       flags=st.one_of(st.sampled_from([0, VRING_AVAIL_F_NO_INTERRUPT]),
                       st.integers(0, 0xFFFF)),
       event=st.one_of(st.integers(0, 20), st.integers(0, 0xFFFF)))
def test_native_and_python_walks_agree(size: int, table: list[tuple[int, int, int, int]],
                                       ring: list[int], avail_ahead: int, next_avail: int,
                                       data: bytes, offset: int, event_idx: bool, flags: int,
                                       event: int) -> None:
    """Same chains, errors, used ring, interrupt decisions and ``avail_event``."""
    args = (size, table, ring, avail_ahead, next_avail, data, offset, event_idx, flags,
            event)
    assert (_outcomes(CountingMemory("native"), *args)
            == _outcomes(CountingMemory("python"), *args))


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
