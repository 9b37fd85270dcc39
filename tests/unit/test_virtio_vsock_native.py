"""vsock's packets (``native/src/vsock_packet.rs``, the one implementation, reached
through ``GuestRam.vsock_tx_classify``/``vsock_rx_packet``): the tx parse of a guest
chain, and an rx packet written into one.

Contract properties on hostile input (the Python twin they were once compared with is
gone): random, mostly hostile tx chains (headers from our guest and from others, to the
host and elsewhere; lengths at, around and far beyond the chain's readable bytes and the
64 KiB limit; unknown types and ops; headers cut short, split over many buffers,
zero-length buffers among them, buffers that run over the rings or past the end of RAM)
get the verdict vsock.py's rules give the bytes the guest wrote -- the rules restated
here from the module docstring, in their order -- or, where a buffer lies outside RAM,
a guest error; the parse reads the header and nothing more. On the rx side, a packet
written into a hostile rx chain changes no guest byte outside the chain's writable
buffers and its used entry, and in a chain inside RAM leaves exactly the header, then
the payload, cut at the chain's end, with a used entry that says so. The clean examples
spell the rules' answers out.
"""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_virtio_queue import HIGH, LOW, USED, CountingMemory

from vmfork.vmm.devices.virtio import vsock
from vmfork.vmm.devices.virtio.vsock import (
    HEADER_SIZE,
    HOST_CID,
    MAX_PACKET_PAYLOAD,
    TYPE_STREAM,
    Op,
    PacketHeader,
)
from vmfork.vmm.errors import GuestError

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


# What the parse answers: (verdict, counter key, header, op), or a guest error's type.
Verdict = tuple[str, str | None, PacketHeader | None, int | None]


def classify(mem: CountingMemory, segments: list[tuple[int, int]],
             guest_cid: int) -> Verdict | str:
    assert mem.native is not None
    try:
        verdict, key, fields, op = mem.native.vsock_tx_classify(list(segments), guest_cid)
    except GuestError:
        return "GuestError"  # (its subclass names which check refused: not the contract)
    return verdict, key, None if fields is None else PacketHeader._make(fields), op


def by_the_rules(raw: bytes, readable: int, guest_cid: int) -> Verdict:
    """vsock.py's rules in their order, on the bytes the guest wrote and the chain's
    readable length."""
    if len(raw) < HEADER_SIZE:
        return "drop", vsock.SHORT_HEADER, None, None
    hdr = PacketHeader.unpack(raw[:HEADER_SIZE])
    if hdr.src_cid != guest_cid or hdr.dst_cid != HOST_CID:
        return "drop", vsock.WRONG_CID, None, None
    if hdr.len > MAX_PACKET_PAYLOAD or HEADER_SIZE + hdr.len > readable:
        return "refuse", vsock.BAD_LENGTH, hdr, None
    if hdr.type != TYPE_STREAM:
        return "refuse", vsock.BAD_TYPE, hdr, None
    return "packet", None, hdr, hdr.op if hdr.op in set(Op) else None


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), cuts=st.lists(st.integers(0, 140), max_size=8),
       places=st.lists(st.sampled_from(PLACES), min_size=1, max_size=8),
       guest_cid=st.sampled_from(GUEST_CIDS))
def test_the_tx_parse_follows_the_rules_on_hostile_chains(
        data: st.DataObject, cuts: list[int], places: list[str], guest_cid: int) -> None:
    raw, extra = data.draw(packet(guest_cid))
    mem = CountingMemory()
    segments = lay_out([mem], raw, extra, cuts, places)
    got = classify(mem, segments, guest_cid)
    event(got if isinstance(got, str) else got[0] + (f" {got[1]}" if got[1] else ""))
    # A header byte outside RAM makes the parse refuse the chain (only the header's
    # bytes are read: the rest of the buffer holding its last byte is the chain walk's
    # to check, which this call does not run); else the rules decide on the bytes the
    # header's buffers hold (the extra buffer at 0 too, where the guest's bytes stop
    # short) and the readable length.
    header_reads, spanned = [], 0
    for addr, length in segments:
        if spanned >= HEADER_SIZE:
            break
        header_reads.append((addr, min(length, HEADER_SIZE - spanned)))
        spanned += length
    if not all(in_ram(addr, length) for addr, length in header_reads):
        assert got == "GuestError", got
        return
    seen = b"".join(mem.read(addr, length) for addr, length in header_reads if length)
    want = by_the_rules(seen[:HEADER_SIZE], sum(length for _, length in segments), guest_cid)
    if all(in_ram(addr, length) for addr, length in segments):
        assert got == want
    else:
        assert got in (want, "GuestError")


def in_ram(addr: int, length: int) -> bool:
    return length == 0 or (addr + length <= LOW.size
                           or HIGH.guest_phys <= addr
                           and addr + length <= HIGH.guest_phys + HIGH.size)


def test_the_rules_and_their_order() -> None:
    """The contract, spelt out: each rule's verdict and key, and which rule wins when
    several apply."""
    mem = CountingMemory()
    good = PacketHeader(3, 2, 40000, 5000, 3, 1, Op.RW, 0, 4096, 0)

    def parse(hdr: PacketHeader, readable: int | None = None) -> Verdict | str:
        raw = hdr.pack()
        mem.write(0x8000, raw + b"abc")
        return classify(mem, [(0x8000, len(raw) + 3 if readable is None else readable)], 3)

    assert parse(good) == ("packet", None, good, Op.RW)
    assert parse(good, HEADER_SIZE - 1) == ("drop", vsock.SHORT_HEADER, None, None)
    # A wrong CID wins over a bad length and type; the length over the type.
    bad_all = PacketHeader(4, 2, 1, 2, 2**32 - 1, 7, 0xFFFF, 0, 0, 0)
    assert parse(bad_all) == ("drop", vsock.WRONG_CID, None, None)
    bad_len_type = PacketHeader(3, 2, 1, 2, 4, 7, Op.RW, 0, 0, 0)
    assert parse(bad_len_type) == ("refuse", vsock.BAD_LENGTH, bad_len_type, None)
    bad_type = PacketHeader(3, 2, 1, 2, 0, 7, Op.RW, 0, 0, 0)
    assert parse(bad_type) == ("refuse", vsock.BAD_TYPE, bad_type, None)
    unknown_op = PacketHeader(3, 2, 1, 2, 0, 1, 8, 0, 0, 0)
    assert parse(unknown_op) == ("packet", None, unknown_op, None)
    # The payload must lie in the chain: exactly is fine, a byte more is refused.
    assert parse(good, HEADER_SIZE + 3) == ("packet", None, good, Op.RW)
    assert parse(good, HEADER_SIZE + 2) == ("refuse", vsock.BAD_LENGTH, good, None)


# -- the rx side: a packet written into a popped rx chain ---------------------------------
RX_PLACES = ["low", "high", "empty"] * 6 + ["rings", "cross", "hole"]
rx_header = st.builds(
    PacketHeader, src_cid=st.sampled_from([2, 2**64 - 1]), dst_cid=st.sampled_from([3, 2**32 - 2]),
    src_port=U32, dst_port=U32, len=st.integers(0, MAX_PACKET_PAYLOAD),
    type=st.sampled_from([1, 0xFFFF]), op=st.sampled_from(list(Op) + [0xFFFF]), flags=U32,
    buf_alloc=U32, fwd_cnt=U32)


def deliver(mem: CountingMemory, head: int, writable: list[tuple[int, int]],
            hdr: PacketHeader, payload: bytes, next_used: int) -> int | str:
    """The new next_used, or a guest error's type."""
    assert mem.native is not None
    try:
        return mem.native.vsock_rx_packet(16, USED, next_used, head, list(writable),
                                          tuple(hdr), payload)
    except GuestError:
        return "GuestError"  # (its subclass names which check refused: not the contract)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.tuples(st.sampled_from(RX_PLACES), st.integers(0, 100)),
                      min_size=1, max_size=6),
       hdr=rx_header, payload=st.binary(max_size=300), head=st.integers(0, 15),
       next_used=st.one_of(st.integers(0, 20), st.integers(0, 0xFFFF)))
def test_an_rx_packet_lands_in_its_chain_and_nowhere_else(
        parts: list[tuple[str, int]], hdr: PacketHeader, payload: bytes, head: int,
        next_used: int) -> None:
    """Whatever the chain's buffers (split anywhere, empty ones, over the used ring,
    across RAM's end or in the hole) and the packet (longer than the chain or not)."""
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
    mem = CountingMemory()
    fill = bytes(range(256)) * (LOW.size // 256)
    mem.write(0, fill)
    mem.write(HIGH.guest_phys, fill)
    got = deliver(mem, head, writable, hdr, payload, next_used)
    event("delivered" if isinstance(got, int) else got)
    slot = USED + 4 + (next_used % 16) * 8
    allowed = [(addr, length) for addr, length in writable]
    allowed += [(USED + 2, 2), (slot, 8)]   # the used ring's idx and the entry
    after = {0: mem.read(0, LOW.size), HIGH.guest_phys: mem.read(HIGH.guest_phys, HIGH.size)}
    for base, now in after.items():
        for i in range(len(now)):
            if now[i] != fill[i]:
                gpa = base + i
                assert any(a <= gpa < a + n for a, n in allowed), hex(gpa)
    inside = all(in_ram(addr, length) for addr, length in writable)
    def overlap(a: int, n: int, b: int, m: int) -> bool:
        return a < b + m and b < a + n

    spans = [(addr, length) for addr, length in writable if length]
    if not inside or any(overlap(addr, length, slot, 8) or overlap(addr, length, USED + 2, 2)
                         for addr, length in spans) or any(
            overlap(*x, *y) for k, x in enumerate(spans) for y in spans[k + 1:]):
        return   # refused, or bytes written twice (buffers overlapping each other or the
        # used ring's entry and index): the bound above only
    assert got == (next_used + 1) & 0xFFFF
    packet = (hdr.pack() + payload)
    room = sum(length for _, length in writable)
    written = packet[:HEADER_SIZE] + payload[:max(0, room - HEADER_SIZE)]
    written = written[:room]
    landed = b"".join(mem.read(addr, length) for addr, length in spans)
    assert landed[:len(written)] == written
    assert mem.read(slot, 8) == struct.pack("<II", head, len(written))
