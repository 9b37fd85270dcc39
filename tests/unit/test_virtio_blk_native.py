"""virtio-blk's request path, native (``native/src/blk.rs``) against Python.

A differential property: random, mostly hostile request chains and descriptor tables
(headers of every type and of no type, sectors past the disk and past 2**64 / 512,
partial sectors, buffers in the hole between the RAM regions, across a region's end,
over the rings themselves, descriptor links and flags overwritten, the avail index run
ahead) are served by both paths, each over its own real guest memory and its own copy
of a real disk file, and must leave the same guest memory (used ring, status bytes and
data buffers included), the same file, the same counters, the same queue indices, the
same log and the same guest fault, call for call. Host failures are in the mix too: a
detached disk, a read-write device on a read-only fd, a file shortened after it was
sized.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
from dataclasses import asdict
from typing import Any

import pytest
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
from vmfork.vmm.eventloop import EventLoop

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
    if draw(st.integers(0, 2)) < 2:
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
            "parts": parts, "payload": draw(st.binary(min_size=0, max_size=64))}


def lay_out(mem: CountingMemory, chains: list[dict[str, Any]],
            corruptions: list[tuple[int, int, int]], avail_jump: int) -> None:
    layout = BufferLayout(DESC)
    free = 0
    heads = []
    for c in chains:
        parts = c["parts"]
        if free + len(parts) > QSIZE:
            break
        ids = list(range(free, free + len(parts)))
        free += len(parts)
        readable = struct.pack("<IIQ", c["kind"], c["reserved"], c["sector"] % (1 << 64))
        readable += c["payload"] * 40
        for k, (index, (writable, length, where)) in enumerate(zip(ids, parts)):
            addr = layout.place(where, length)
            if not writable and where in ("low", "high"):
                chunk, readable = readable[:length], readable[length:]
                mem.write(addr, chunk)
            last = k == len(ids) - 1
            flags = (0 if last else VIRTQ_DESC_F_NEXT) | (VIRTQ_DESC_F_WRITE if writable else 0)
            mem.write(DESC + 16 * index, struct.pack("<QIHH", addr, length, flags,
                                                     0 if last else ids[k + 1]))
        heads.append(ids[0])
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


def run_path(backend: str, disk_bytes: bytes, spec: dict[str, Any]) -> dict[str, Any]:
    mem = CountingMemory(backend)
    mem.budget = 100_000
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    blk.log.addHandler(handler)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "disk.img")
        with open(path, "wb") as f:
            f.write(disk_bytes)
        fd = os.open(path, os.O_RDONLY if spec["fd_read_only"] else os.O_RDWR)
        try:
            if spec["shortened"] is not None:   # after open_disk sized it
                os.truncate(path, spec["shortened"])
            dev = blk.VirtioBlk(EventLoop("unused"), fd, len(disk_bytes), KEY[:spec["key_len"]],
                                read_only=spec["read_only"])
            if spec["detached"]:
                dev.detach()
            queue: Virtqueue = make_queue(mem, QSIZE)
            lay_out(mem, spec["chains"], spec["corruptions"], spec["avail_jump"])
            calls = []
            serve = dev._serve_native if backend == "native" else dev._serve_python
            for _ in range(CALLS):
                try:
                    served, more = serve(mem, queue)
                except GuestError as err:
                    calls.append((type(err).__name__, str(err)))
                    break
                calls.append((served, more))
                if not more:
                    break
            with open(path, "rb") as f:
                after = f.read()
        finally:
            os.close(fd)
            blk.log.removeHandler(handler)
    memory = (mem.read(0, LOW.size), mem.read(HIGH.guest_phys, HIGH.size))
    mem.close()
    return {"calls": calls, "counters": asdict(dev.counters), "file": after,
            "memory": memory, "log": [r.replace(dev.path, "") for r in records],
            "indices": (queue.next_avail, queue.next_used)}


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
def test_native_and_python_serve_alike(
        monkeypatch: pytest.MonkeyPatch, chains: list[dict[str, Any]],
        corruptions: list[tuple[int, int, int]], avail_jump: int, read_only: bool,
        fd_read_only: bool, detached: bool, shortened: int | None, key_len: int,
        max_requests: int, max_bytes: int, seed: bytes) -> None:
    monkeypatch.setattr(blk, "MAX_REQUESTS_PER_NOTIFY", max_requests)
    monkeypatch.setattr(blk, "MAX_BYTES_PER_NOTIFY", max_bytes)
    disk_bytes = (seed * (SECTORS * 512 // 8))
    disk_bytes = bytes((b + i) & 0xFF for i, b in enumerate(disk_bytes))
    spec = {"chains": chains, "corruptions": corruptions, "avail_jump": avail_jump,
            "read_only": read_only, "fd_read_only": fd_read_only, "detached": detached,
            "shortened": shortened, "key_len": key_len}
    python = run_path("python", disk_bytes, spec)
    native = run_path("native", disk_bytes, spec)
    for name, n in python["counters"].items():
        if n and name != "requests":
            event(name)
    event(f"ended by {python['calls'][-1] if python['calls'] else 'nothing'}"[:60])
    for record in python["log"]:
        event(record.split(":")[1].split()[0])
    for field in ("calls", "counters", "indices", "log", "file"):
        assert native[field] == python[field], field
    for name, (n, p) in zip(("low", "high"), zip(native["memory"], python["memory"])):
        if n != p:
            at = next(i for i in range(len(n)) if n[i] != p[i])
            pytest.fail(f"guest memory differs in the {name} region from byte {at:#x}")


def test_the_native_path_is_the_one_a_native_build_takes() -> None:
    """A request served with the Python path made unreachable still completes."""
    mem = CountingMemory("native")
    dev = blk.VirtioBlk(EventLoop("unused"), None, 0, "", volume_slot=True)

    def python_path(*_: object) -> tuple[int, bool]:
        raise AssertionError("the Python path was taken")

    dev._serve_python = python_path  # type: ignore[method-assign]
    dev.memory = mem
    queue = make_queue(mem, QSIZE)
    dev.queues = [queue]

    class Line:
        failed = False
        triggered = 0

        def trigger(self) -> None:
            self.triggered += 1

    line = Line()
    dev.interrupt = line  # type: ignore[assignment]
    lay_out(mem, [{"kind": blk.T_GET_ID, "sector": 0, "reserved": 0, "payload": b"",
                   "parts": [(False, 16, "low"), (True, 21, "low")]}], [], 0)
    dev.queue_notify(0)
    assert line.triggered == 1 and dev.counters.get_ids == 1
    assert struct.unpack("<HHII", mem.read(USED, 12)) == (0, 1, 0, 21)
    mem.close()


def test_the_native_path_syscalls_are_allowed_in_the_jail() -> None:
    """blk.rs calls preadv, pwritev and fdatasync; a jailed VMM dies on any syscall
    its seccomp filter does not list."""
    from vmfork.runtime import seccomp
    assert {"preadv", "pwritev", "fdatasync"} <= set(seccomp.VMM_ALLOWED)
