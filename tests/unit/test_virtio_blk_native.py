"""virtio-blk's request path (``native/src/blk.rs``, its one implementation) under
random, mostly hostile input.

Request chains and descriptor tables (headers of every type and of no type, sectors
past the disk and past 2**64 / 512, partial sectors, buffers in the hole between the
RAM regions, across a region's end, over the rings themselves, descriptor links and
flags overwritten, the avail index run ahead) are served over real guest memory and a
real disk file, with host failures in the mix (no disk file, as a retired server has,
a read-write device on a read-only fd, a file shortened after it was sized), through
``GuestRam.serve_blk``: one call into the request path, the very code the native
transport's server (``blk_serve.rs``) runs per wake, with the budget given per call. Whatever the input, the device
must stay inside its contract: it writes guest memory only in device-writable buffers
and the used ring, completes each chain it takes exactly once with at least its status
byte, keeps to its per-call budget, counts every request, changes the file only by a
counted write, and ends a call only by a guest fault. Where the chains are the ones
Linux lays out and nothing hostile is in the example, each answer (status byte, used
length, the bytes read or written) must be what the spec (virtio 1.x, 5.2.6) and
``blk.py``'s rules say, worked out here from the request alone.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_virtio_queue import AVAIL, DESC, HIGH, LOW, USED, BufferLayout, CountingMemory, make_queue

from vmfork.vmm.devices.virtio import blk
from vmfork.vmm.devices.virtio.queue import (
    VIRTQ_DESC_F_INDIRECT,
    VIRTQ_DESC_F_NEXT,
    VIRTQ_DESC_F_WRITE,
    Virtqueue,
)
from vmfork.vmm.errors import GuestError
from vmfork.vmm.memory import GuestMemory

QSIZE = 16
SECTORS = 8
KEY = "0123456789abcdef" * 4
CALLS = 6   # serving calls per example (a small budget leaves work for the next)

# Where a buffer may be placed: inside RAM, or (one part of a hostile chain) where it
# must not be, or over the rings.
PLACES = ["low", "high"]
BAD_PLACES = ["hole", "cross", "rings", "past"]
KINDS = [blk.T_IN] * 4 + [blk.T_OUT] * 3 + [
    blk.T_FLUSH, blk.T_GET_ID, blk.T_GET_LIFETIME, blk.T_DISCARD, blk.T_WRITE_ZEROES,
    blk.T_SECURE_ERASE, 3, 0xFFFF_FFFF]
SECTOR = st.one_of(st.integers(0, SECTORS + 2), st.integers(0, SECTORS + 2),
                   st.integers(0, SECTORS + 2),
                   st.sampled_from([(1 << 64) - 1, 1 << 55, (1 << 64) // 512]))
LENGTH = st.one_of(st.sampled_from([0, 1, 2, 15, 16, 17, 511, 512, 513, 1024, 1025, 1536]),
                   st.integers(0, 2600))

part = st.tuples(st.booleans(), LENGTH, st.sampled_from(PLACES))   # (writable, len, place)


@st.composite
def chain(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    # (Hypothesis favours small draws: the common, well-formed case is the small one.)
    linux = draw(st.integers(0, 2)) < 2
    if linux:
        # Linux's layout: a header, whole sectors of data, a status byte (sometimes
        # sharing the last data descriptor, or with a byte to spare).
        sizes = (st.sampled_from([20, 8, 1, 19, 21, 512]) if kind == blk.T_GET_ID
                 else st.integers(1, 3).map(lambda n: 512 * n))
        data = draw(st.lists(sizes, min_size=1, max_size=3))
        out = kind == blk.T_OUT
        parts = [(False, 16, "low")] + [(not out, n, draw(st.sampled_from(PLACES)))
                                        for n in data]
        if data and not out and draw(st.booleans()):
            parts[-1] = (True, parts[-1][1] + draw(st.sampled_from([1, 1, 2])), parts[-1][2])
        else:
            parts.append((True, draw(st.sampled_from([1, 1, 1, 2, 0])), "low"))
    else:
        parts = draw(st.lists(part, min_size=1, max_size=6))
        if not draw(st.booleans()):   # readable first, as the queue demands
            parts.sort(key=lambda p: p[0])
    if draw(st.integers(0, 7)) == 7:
        k = draw(st.integers(0, len(parts) - 1))
        parts[k] = (parts[k][0], parts[k][1], draw(st.sampled_from(BAD_PLACES)))
    return {"kind": kind, "sector": draw(SECTOR), "reserved": draw(st.integers(0, 3)),
            "parts": parts, "payload": draw(st.binary(min_size=0, max_size=64)),
            # Only the layout Linux makes is held to the spec's answers: a random chain
            # may start like it and still put a readable part after a writable one,
            # which the queue refuses.
            "linux": linux}


def lay_out(mem: CountingMemory, chains: list[dict[str, Any]],
            corruptions: list[tuple[int, int, int]],
            avail_jump: int) -> dict[int, tuple[dict[str, Any], list[tuple[int, int, bool]]]]:
    """Put ``chains`` on the queue; {head: (chain, its (address, length, writable) parts)}."""
    layout = BufferLayout(DESC)
    free = 0
    heads = []
    laid: dict[int, tuple[dict[str, Any], list[tuple[int, int, bool]]]] = {}
    for c in chains:
        parts = c["parts"]
        if free + len(parts) > QSIZE:
            break
        ids = list(range(free, free + len(parts)))
        free += len(parts)
        readable = struct.pack("<IIQ", c["kind"], c["reserved"], c["sector"] % (1 << 64))
        readable += c["payload"] * 40
        placed = []
        for k, (index, (writable, length, where)) in enumerate(zip(ids, parts)):
            addr = layout.place(where, length)
            placed.append((addr, length, writable))
            if not writable and where in ("low", "high"):
                chunk, readable = readable[:length], readable[length:]
                mem.write(addr, chunk)
            last = k == len(ids) - 1
            flags = (0 if last else VIRTQ_DESC_F_NEXT) | (VIRTQ_DESC_F_WRITE if writable else 0)
            mem.write(DESC + 16 * index, struct.pack("<QIHH", addr, length, flags,
                                                     0 if last else ids[k + 1]))
        heads.append(ids[0])
        laid[ids[0]] = (c, placed)
    for index, field, value in corruptions:
        at = DESC + 16 * (index % QSIZE)
        if field == 0:     # next
            mem.write(at + 14, struct.pack("<H", value % (QSIZE + 2)))
        elif field == 1:   # flags, INDIRECT included
            mem.write(at + 12, struct.pack("<H", value & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE
                                                          | VIRTQ_DESC_F_INDIRECT)))
        else:              # length
            mem.write(at + 8, struct.pack("<I", value))
    for k, head in enumerate(heads):
        mem.write_u16(AVAIL + 4 + 2 * k, head)
    mem.write_u16(AVAIL + 2, len(heads) + avail_jump)
    return laid


def writable_ranges(mem: CountingMemory) -> list[tuple[int, int]]:
    """Every device-writable buffer the descriptor table names (as laid out, corruptions
    included): the only guest memory besides the used ring the device may write."""
    out = []
    for index in range(QSIZE):
        addr, length, flags, _ = struct.unpack("<QIHH", mem.read(DESC + 16 * index, 16))
        if flags & VIRTQ_DESC_F_WRITE:
            out.append((addr, length))
    return out


def spec_answer(c: dict[str, Any], placed: list[tuple[int, int, bool]], disk: bytearray,
                read_only: bool, fd_read_only: bool, key: str,
                mem: CountingMemory) -> tuple[int, int, bytes | None]:
    """(status, used length, bytes the guest's data buffers must hold or None) for one
    well-formed-enough chain, from the spec and blk.py's rules alone; a write it
    allows goes into ``disk``, the model of the file."""
    readable = sum(n for _, n, w in placed if not w)
    writable = sum(n for _, n, w in placed if w)
    data_room = writable - 1          # the status is the chain's very last byte
    kind, offset = c["kind"], c["sector"] * blk.SECTOR_SIZE
    if kind == blk.T_OUT and not read_only:
        length = readable - 16
        if (data_room or length % 512 or length > blk.MAX_BYTES_PER_REQUEST
                or offset + length > len(disk) or (length and fd_read_only)):
            return blk.S_IOERR, 1, None
        payload = b"".join(mem.read(a, n) for a, n, w in placed if not w)[16:]
        disk[offset:offset + length] = payload
        return blk.S_OK, 1, None
    if kind in blk.WRITE_TYPES:
        return blk.S_IOERR, 1, None
    if kind == blk.T_FLUSH:
        return blk.S_OK, 1, None
    if kind not in (blk.T_IN, blk.T_GET_ID):
        return blk.S_UNSUPP, 1, None
    if readable != 16:
        return blk.S_IOERR, 1, None
    if kind == blk.T_GET_ID:
        n = min(blk.ID_BYTES, data_room)
        return blk.S_OK, n + 1, key.encode()[:blk.ID_BYTES].ljust(blk.ID_BYTES, b"\0")[:n]
    if (data_room % 512 or data_room > blk.MAX_BYTES_PER_REQUEST
            or offset + data_room > len(disk)):
        return blk.S_IOERR, 1, None
    return blk.S_OK, data_room + 1, disk[offset:offset + data_room]


def data_written(mem: CountingMemory, placed: list[tuple[int, int, bool]], n: int) -> bytes:
    out = bytearray()
    for addr, length, writable in placed:
        if writable and len(out) < n:
            out += mem.read(addr, min(length, n - len(out)))
    return bytes(out)


class Disk:
    """The media a call serves: the file (-1: none), its size, its mode and the id
    GET_ID answers (the key's first 20 bytes, NUL-padded, as ``blk.py`` names it)."""

    def __init__(self, fd: int, capacity: int, read_only: bool, key: str) -> None:
        self.fd, self.capacity, self.read_only = fd, capacity, read_only
        self.id = key[:blk.ID_BYTES].encode().ljust(blk.ID_BYTES, b"\0")
        self.counters: Counter[str] = Counter()
        self.warnings: list[str] = []

    def serve(self, mem: GuestMemory, queue: Virtqueue, max_requests: int,
              max_bytes: int) -> tuple[int, bool]:
        """One call into blk.rs: (requests served, whether the budget ran out first);
        the counters and the host failures it reports are kept, a guest fault raised."""
        assert mem.native is not None
        (queue.next_avail, queue.next_used, served, _moved, more, counters, warnings,
         error) = mem.native.serve_blk(
            queue.size, queue.desc_table, queue.avail_ring, queue.used_ring,
            queue.next_avail, queue.next_used, self.fd, self.capacity, self.read_only,
            self.id, max_requests, max_bytes)
        self.counters.update(dict(counters))
        self.warnings.extend(kind for kind, *_ in warnings)
        if error is not None:
            raise error
        return served, more


def overlap(placed: list[tuple[int, int, bool]]) -> bool:
    spans = sorted((a, a + n) for a, n, _ in placed if n)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


@settings(max_examples=600, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(chains=st.lists(chain(), min_size=2, max_size=8),
       corruptions=st.one_of(st.just([]), st.just([]), st.just([]), st.lists(
           st.tuples(st.integers(0, QSIZE - 1), st.integers(0, 2),
                     st.integers(0, 0xFFFF_FFFF)), max_size=3)),
       avail_jump=st.sampled_from([0] * 8 + [QSIZE + 1, -1]),
       read_only=st.booleans(), fd_read_only=st.sampled_from([False] * 3 + [True]),
       detached=st.sampled_from([False] * 6 + [True]),
       shortened=st.sampled_from([None] * 4 + [512, 1536, 2560]),
       key_len=st.sampled_from([64, 8, 12]),
       max_requests=st.sampled_from([64, 1, 2, 3]),
       max_bytes=st.sampled_from([blk.MAX_BYTES_PER_NOTIFY, 1, 600, 2000]),
       seed=st.binary(min_size=8, max_size=8))
def test_hostile_requests_keep_the_device_within_its_contract(
        chains: list[dict[str, Any]],
        corruptions: list[tuple[int, int, int]], avail_jump: int, read_only: bool,
        fd_read_only: bool, detached: bool, shortened: int | None, key_len: int,
        max_requests: int, max_bytes: int, seed: bytes) -> None:
    disk = (seed * (SECTORS * 512 // 8))
    disk = bytes((b + i) & 0xFF for i, b in enumerate(disk))
    mem = CountingMemory()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "disk.img")
        with open(path, "wb") as f:
            f.write(disk)
        fd = os.open(path, os.O_RDONLY if fd_read_only else os.O_RDWR)
        try:
            if shortened is not None:   # after open_disk sized it
                os.truncate(path, shortened)
            key = KEY[:key_len]
            dev = Disk(-1 if detached else fd, len(disk), read_only, key)
            queue: Virtqueue = make_queue(mem, QSIZE)
            laid = lay_out(mem, chains, corruptions, avail_jump)
            may_write = writable_ranges(mem) + [(USED, 4 + 8 * QSIZE + 2)]
            before = (mem.read(0, LOW.size), mem.read(HIGH.guest_phys, HIGH.size))
            served_total, fault = 0, None
            for _ in range(CALLS):
                try:
                    served, more = dev.serve(mem, queue, max_requests, max_bytes)
                except GuestError as err:
                    fault = str(err)
                    break
                assert 0 <= served <= max_requests
                served_total += served
                if not more:
                    break
                assert served, "a call that served nothing says there is more"
            with open(path, "rb") as f:
                after_file = f.read()
        finally:
            os.close(fd)
    event(f"ended by {'a guest fault' if fault else 'an empty ring or the calls'}")
    counters = dev.counters
    # Every chain taken is completed once, and counted once. A fault ends its call
    # without a count of what that call completed before it, and may leave the chain
    # it could not complete taken.
    completed = mem.read_u16(USED + 2)
    assert queue.next_used == completed and counters["requests"] == completed
    assert served_total == completed if fault is None else served_total <= completed
    assert (queue.next_avail - queue.next_used) & 0xFFFF in ((0, 1) if fault else (0,))
    served_total = completed
    outcomes = sum(counters[name] for name in (
        "reads", "writes", "flushes", "get_ids", "write_errors", "writes_refused",
        "read_errors", "malformed", "unsupported"))
    assert outcomes <= counters["requests"]   # a request of no data is OK and counted only there
    for name, n in counters.items():
        if n and name != "requests":
            event(name)
    # The file changes only by a counted write, and never on a read-only device.
    if read_only or detached:
        assert counters["writes"] == counters["bytes_written"] == 0
    if counters["bytes_written"] == 0:
        assert after_file == disk[:len(after_file)]
    # Guest memory outside the writable buffers and the used ring is as it was. A chain
    # may place a writable buffer over the descriptor table (the generator's "rings"),
    # so a status byte the device wrote there can retarget a later descriptor: the
    # device reads each chain's descriptors when it serves it, as the spec has it. So a
    # descriptor whose entry lay in a buffer writable before the calls counts with what
    # it names after them too.
    before_ranges = list(may_write)
    for index in range(QSIZE):
        entry = DESC + 16 * index
        if any(lo < entry + 16 and entry < lo + n for lo, n in before_ranges):
            addr, length, flags, _ = struct.unpack("<QIHH", mem.read(entry, 16))
            if flags & VIRTQ_DESC_F_WRITE:
                may_write.append((addr, length))
    for base, image in ((0, before[0]), (HIGH.guest_phys, before[1])):
        now = mem.read(base, len(image))
        if now != image:
            changed = [base + k for k in range(len(image)) if now[k] != image[k]]
            stray = [a for a in changed
                     if not any(lo <= a < lo + n for lo, n in may_write)]
            assert not stray, f"the device wrote {stray[0]:#x}, in no writable buffer"
    # The used elements: heads that were offered, each with at least its status byte.
    used = [struct.unpack("<II", mem.read(USED + 4 + 8 * k, 8))
            for k in range(min(served_total, QSIZE))]
    for head, length in used:
        assert head < QSIZE and length >= 1
    for warning in dev.warnings:
        event(warning)
    # Where nothing hostile is in the example, every answer is the spec's.
    clean = (not corruptions and avail_jump == 0 and not detached and shortened is None
             and all(c["linux"] and all(w in PLACES for _, _, w in c["parts"])
                     for c, _ in laid.values())
             and not overlap([p for _, placed in laid.values() for p in placed]))
    if not clean:
        mem.close()
        return
    event("checked against the spec")
    assert fault is None or "no device-writable byte" in fault, fault
    model = bytearray(disk)
    for head, length in used:
        c, placed = laid[head]
        status, used_len, data = spec_answer(c, placed, model, read_only, fd_read_only,
                                             key, mem)
        last = [(a, n) for a, n, w in placed if w and n][-1]
        assert (mem.read(last[0] + last[1] - 1, 1)[0], length) == (status, used_len), c
        if data is not None:
            assert data_written(mem, placed, len(data)) == data
    assert after_file == model
    mem.close()


def test_the_native_path_syscalls_are_allowed_in_the_jail() -> None:
    """blk.rs calls preadv, pwritev and fdatasync; a jailed VMM dies on any syscall
    its seccomp filter does not list."""
    from vmfork.runtime import seccomp
    assert {"preadv", "pwritev", "fdatasync"} <= set(seccomp.VMM_ALLOWED)
