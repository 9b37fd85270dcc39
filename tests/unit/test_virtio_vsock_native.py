"""vsock's packets, native (``native/src/vsock_packet.rs``) against Python: the tx
parse of a guest chain, and an rx packet written into one.

A differential property: random, mostly hostile tx chains (headers from our guest and
from others, to the host and elsewhere; lengths at, around and far beyond the chain's
readable bytes and the 64 KiB limit; unknown types and ops; headers cut short, split
over many buffers, zero-length buffers among them, buffers that run over the rings or
past the end of RAM) are classified by both paths, each over its own guest memory
holding the same bytes. Both must give the same ``TxPacket`` (verdict, counter key,
header, op), or fail with the same error type and message. On the rx side, random
headers and payloads written into hostile rx chains must leave the same guest memory.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_virtio_queue import AVAIL, DESC, HIGH, LOW, USED, CountingMemory

from vmfork.vmm.devices.virtio import vsock
from vmfork.vmm.devices.virtio.queue import DescriptorChain, Virtqueue
from vmfork.vmm.devices.virtio.vsock import (
    HEADER_SIZE,
    MAX_PACKET_PAYLOAD,
    Op,
    PacketHeader,
    TxPacket,
    TxVerdict,
)
from vmfork.vmm.errors import GuestError
from vmfork.vmm.native import NATIVE

pytestmark = pytest.mark.skipif(not NATIVE, reason="the native core is not built "
                                "(scripts/lib.sh setup_native) or VMFORK_NATIVE=0")

GUEST_CIDS = [3, 3, 4, 2**32 - 2]
U32 = st.one_of(st.sampled_from([0, 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))


@st.composite
def packet(draw: st.DrawFn, guest_cid: int) -> tuple[bytes, int]:
    """The bytes a guest put in a chain's readable buffers, and the readable length the
    chain claims beyond them (buffers the header's length may count on). Mostly from
    ``guest_cid`` to the host, so that the later rules are reached."""
    payload = draw(st.binary(max_size=96))
    extra = draw(st.sampled_from([0, 0, 0, 0, 1, 0x10000 - HEADER_SIZE, 0x10000, 0x10001]))
    room = len(payload) + extra
    near = st.sampled_from([room] * 6 + [room - 1, room + 1, 0]).filter(lambda n: n >= 0)
    length = draw(st.one_of(
        near, near, near,
        st.sampled_from([MAX_PACKET_PAYLOAD - 1, MAX_PACKET_PAYLOAD, MAX_PACKET_PAYLOAD + 1,
                         2**32 - 1]),
        st.integers(0, 2**32 - 1)))
    hdr = PacketHeader(
        src_cid=draw(st.sampled_from([guest_cid] * 40 + [3, 4, 2, 0, 2**32 - 2, 2**64 - 1,
                                                         guest_cid + 2**32])),
        dst_cid=draw(st.sampled_from([2] * 40 + [3, 0, 2**64 - 1, 2 + 2**32])),
        src_port=draw(U32), dst_port=draw(U32), len=length,
        type=draw(st.sampled_from([1] * 8 + [0, 2, 0x101, 0xFFFF])),
        op=draw(st.one_of(st.integers(0, 8), st.just(0xFFFF), st.just(0x105))),
        flags=draw(U32), buf_alloc=draw(U32), fwd_cnt=draw(U32))
    raw = hdr.pack() + payload
    if draw(st.integers(0, 5)) == 0:
        raw = raw[:draw(st.integers(0, HEADER_SIZE))]  # a header cut short
    elif draw(st.integers(0, 9)) == 0:
        raw = draw(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE + 8))
    return raw, extra


PLACES = ["low", "high", "empty"] * 10 + ["rings", "cross", "hole", "past"]


def lay_out(mems: list[CountingMemory], raw: bytes, extra: int, cuts: list[int],
            places: list[str]) -> list[tuple[int, int]]:
    """Scatter ``raw`` over buffers cut at ``cuts``, each in its drawn place, into
    every memory alike; then a buffer of ``extra`` bytes the header's length may count."""
    bounds = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    low, high = 0x4000, HIGH.guest_phys
    segments: list[tuple[int, int]] = []
    hostile = {"rings": 0x1000, "cross": LOW.size - 3, "hole": LOW.size + 0x100,
               "past": HIGH.guest_phys + HIGH.size + 0x10}
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        chunk = raw[start:end]
        where = places[k % len(places)]
        if where == "empty":
            segments.append((low, 0))
        if where in hostile:
            # The walk refuses a buffer outside RAM; one over the rings is legal. Either
            # way both paths must read it, or fail on it, alike.
            addr = hostile[where]
        elif where == "high":
            addr, high = high, high + len(chunk)
        else:
            addr, low = low, low + len(chunk)
        if where not in ("cross", "hole", "past"):
            for m in mems:
                m.write(addr, chunk)
        segments.append((addr, len(chunk)))
    if extra:
        segments.append((0, min(extra, LOW.size)))
        if extra > LOW.size:
            segments.append((HIGH.guest_phys, extra - LOW.size))
    return segments


def outcome(mem: CountingMemory, segments: list[tuple[int, int]],
            guest_cid: int) -> TxPacket | tuple[str, str]:
    chain = DescriptorChain(0, list(segments))
    try:
        return vsock.classify_tx(mem, chain, guest_cid)
    except GuestError as err:
        return (type(err).__name__, str(err))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), cuts=st.lists(st.integers(0, 140), max_size=8),
       places=st.lists(st.sampled_from(PLACES), min_size=1, max_size=8),
       guest_cid=st.sampled_from(GUEST_CIDS))
def test_native_and_python_tx_parses_agree(data: st.DataObject, cuts: list[int],
                                           places: list[str], guest_cid: int) -> None:
    raw, extra = data.draw(packet(guest_cid))
    native, python = CountingMemory("native"), CountingMemory("python")
    segments = lay_out([native, python], raw, extra, cuts, places)
    got = outcome(native, segments, guest_cid)
    want = outcome(python, segments, guest_cid)
    event(got.verdict.value + (f" {got.error}" if got.error else "")
          if isinstance(got, TxPacket) else got[0])
    assert got == want
    # The Python twin read the header and nothing more (one view per buffer it spans).
    assert python.accesses <= HEADER_SIZE


def test_the_rules_and_their_order() -> None:
    """The contract, spelt out (both paths): each rule's verdict and key, and which
    rule wins when several apply."""
    mems = [CountingMemory("native"), CountingMemory("python")]
    good = PacketHeader(3, 2, 40000, 5000, 3, 1, Op.RW, 0, 4096, 0)

    def classify(hdr: PacketHeader, readable: int | None = None) -> set[TxPacket]:
        raw = hdr.pack()
        results = set()
        for m in mems:
            m.write(0x8000, raw + b"abc")
            segments = [(0x8000, len(raw) + 3 if readable is None else readable)]
            results.add(vsock.classify_tx(m, DescriptorChain(0, segments), 3))
        assert len(results) == 1, results
        return results

    assert classify(good) == {TxPacket(TxVerdict.PACKET, None, good, Op.RW)}
    assert classify(good, HEADER_SIZE - 1) == {TxPacket(TxVerdict.DROP, vsock.SHORT_HEADER,
                                                         None, None)}
    # A wrong CID wins over a bad length and type; the length over the type.
    bad_all = PacketHeader(4, 2, 1, 2, 2**32 - 1, 7, 0xFFFF, 0, 0, 0)
    assert classify(bad_all) == {TxPacket(TxVerdict.DROP, vsock.WRONG_CID, None, None)}
    bad_len_type = PacketHeader(3, 2, 1, 2, 4, 7, Op.RW, 0, 0, 0)
    assert classify(bad_len_type) == {TxPacket(TxVerdict.REFUSE, vsock.BAD_LENGTH,
                                               bad_len_type, None)}
    bad_type = PacketHeader(3, 2, 1, 2, 0, 7, Op.RW, 0, 0, 0)
    assert classify(bad_type) == {TxPacket(TxVerdict.REFUSE, vsock.BAD_TYPE, bad_type, None)}
    unknown_op = PacketHeader(3, 2, 1, 2, 0, 1, 8, 0, 0, 0)
    assert classify(unknown_op) == {TxPacket(TxVerdict.PACKET, None, unknown_op, None)}
    # The payload must lie in the chain: exactly is fine, a byte more is refused.
    assert classify(good, HEADER_SIZE + 3) == {TxPacket(TxVerdict.PACKET, None, good, Op.RW)}
    assert classify(good, HEADER_SIZE + 2) == {TxPacket(TxVerdict.REFUSE, vsock.BAD_LENGTH,
                                                        good, None)}


# -- the rx side: a packet written into a popped rx chain ---------------------------------
RX_PLACES = ["low", "high", "empty"] * 6 + ["rings", "cross", "hole"]
rx_header = st.builds(
    PacketHeader, src_cid=st.sampled_from([2, 2**64 - 1]), dst_cid=st.sampled_from([3, 2**32 - 2]),
    src_port=U32, dst_port=U32, len=st.integers(0, MAX_PACKET_PAYLOAD),
    type=st.sampled_from([1, 0xFFFF]), op=st.sampled_from(list(Op) + [0xFFFF]), flags=U32,
    buf_alloc=U32, fwd_cnt=U32)


def rx_outcome(mem: CountingMemory, head: int, writable: list[tuple[int, int]],
               hdr: PacketHeader, payload: bytes, next_used: int) -> list[object]:
    q = Virtqueue(16)
    q.size, q.desc_table, q.avail_ring, q.used_ring, q.ready = 16, DESC, AVAIL, USED, True
    q.next_used = next_used
    seen: list[object] = []
    try:
        vsock.deliver_rx(mem, q, DescriptorChain(head, [], list(writable)), hdr, payload)
    except GuestError as err:
        seen.append((type(err).__name__, str(err)))
    seen += [q.next_used, mem.read(0, LOW.size), mem.read(HIGH.guest_phys, HIGH.size)]
    return seen


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.tuples(st.sampled_from(RX_PLACES), st.integers(0, 100)),
                      min_size=1, max_size=6),
       hdr=rx_header, payload=st.binary(max_size=300), head=st.integers(0, 15),
       next_used=st.one_of(st.integers(0, 20), st.integers(0, 0xFFFF)))
def test_native_and_python_rx_deliveries_agree(parts: list[tuple[str, int]], hdr: PacketHeader,
                                               payload: bytes, head: int,
                                               next_used: int) -> None:
    """Whatever the chain's buffers (split anywhere, empty ones, over the used ring,
    across RAM's end or in the hole) and the packet (longer than the chain or not), both
    paths leave the same guest memory, used ring and index, or fail alike."""
    low, high = 0x4000, HIGH.guest_phys
    writable = []
    for where, length in parts:
        if where == "rings":
            addr = USED  # the used element may land in the packet, or the packet on it
        elif where == "cross":
            addr = LOW.size - 10
        elif where == "hole":
            addr = LOW.size + 0x100
        elif where == "high":
            addr, high = high, high + length
        else:
            addr, low = low, low + length
        writable.append((addr, 0 if where == "empty" else length))
    native = rx_outcome(CountingMemory("native"), head, writable, hdr, payload, next_used)
    python = rx_outcome(CountingMemory("python"), head, writable, hdr, payload, next_used)
    event("delivered" if len(native) == 3 else "failed")
    assert native == python
