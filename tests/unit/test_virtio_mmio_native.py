"""The virtio-mmio register file (``_core.MmioRegisters``, native/src/mmio.rs, the one
implementation) under random, mostly hostile sequences of guest register accesses and
device-side calls. Its Python twin, which a differential property once held it to, is
gone: after every step the file must keep the rules ``mmio.py``'s docstring lists,
worked out here from the step and the state before it (identification fixed; the
driver's status bits only a prefix of the bring-up order, reset clearing all of it;
FEATURES_OK only for offered features with VERSION_1; activation only at DRIVER_OK,
notifications only while running, for a queue that exists, in the current epoch;
misaligned or wrong-sized register accesses refused; the queues frozen from DRIVER_OK
on; InterruptACK clearing exactly the bits written; save and restore a round trip).
The clean examples spell the events of a bring-up out."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_virtio_harness import loop, memory  # noqa: F401

from vmfork import _core
from vmfork.vmm.devices.virtio import mmio
from vmfork.vmm.devices.virtio.device import (
    STATUS_DRIVER_OK,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
)

REGISTERS = [mmio.REG_MAGIC, mmio.REG_VERSION, mmio.REG_DEVICE_ID, mmio.REG_VENDOR_ID,
             mmio.REG_DEVICE_FEATURES, mmio.REG_DEVICE_FEATURES_SEL,
             mmio.REG_DRIVER_FEATURES, mmio.REG_DRIVER_FEATURES_SEL, mmio.REG_QUEUE_SEL,
             mmio.REG_QUEUE_NUM_MAX, mmio.REG_QUEUE_NUM, mmio.REG_QUEUE_READY,
             mmio.REG_QUEUE_NOTIFY, mmio.REG_INTERRUPT_STATUS, mmio.REG_INTERRUPT_ACK,
             mmio.REG_STATUS, mmio.REG_QUEUE_DESC_LOW, mmio.REG_QUEUE_DESC_HIGH,
             mmio.REG_QUEUE_DRIVER_LOW, mmio.REG_QUEUE_DRIVER_HIGH,
             mmio.REG_QUEUE_DEVICE_LOW, mmio.REG_QUEUE_DEVICE_HIGH,
             mmio.REG_CONFIG_GENERATION]
# Status values a driver (or a hostile one) writes: the bring-up steps, skips, FAILED,
# the device's own NEEDS_RESET bit, reset.
STATUS_VALUES = [0, 1, 3, 11, 15, 2, 4, 8, 9, 13, 0x80, 0x83, 0x40, 0x43, 0xFF, 7]
VALUES = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 16, 64, 256, 512, 100, 0xFFFF_FFFF]),
                   st.integers(0, 0xFFFF_FFFF))
OFFSETS = st.one_of(st.sampled_from(REGISTERS), st.integers(0, 0xFFF),
                    st.integers(0x100, 0x120), st.sampled_from([0xFF8, 0xFFC, 0xFFE, 0xFFF]))
SIZES = st.one_of(st.just(4), st.sampled_from([1, 2, 3, 4, 8]))


class Recorder:
    """A plain bus device (no register file)."""

    def read(self, offset: int, size: int) -> bytes:
        return bytes(size)

    def write(self, offset: int, data: bytes) -> None:
        pass


def _write(offset: int, value: int, size: int) -> tuple[str, int, bytes]:
    return ("w", offset, (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little"))


OPS = st.one_of(
    st.builds(lambda o, s: ("r", o, s), OFFSETS, SIZES),
    st.builds(_write, OFFSETS, VALUES, SIZES),
    st.builds(lambda v: _write(mmio.REG_STATUS, v, 4), st.sampled_from(STATUS_VALUES)),
    st.builds(lambda sel, v: ("features", sel, v), st.integers(0, 3),
              st.sampled_from([0, 1, 1 << 28, 0xFFFF_FFFF])),
    st.builds(lambda o, v: _write(o, v, 4),
              st.sampled_from([mmio.REG_QUEUE_SEL, mmio.REG_QUEUE_NUM, mmio.REG_QUEUE_READY,
                               mmio.REG_QUEUE_NOTIFY, mmio.REG_INTERRUPT_ACK]),
              st.integers(0, 5)),
    st.builds(lambda b, d: ("raise", b, d), st.sampled_from([1, 2, 3]), st.integers(0, 1)),
    # A device's interrupt, then the driver's acknowledgement of some of its bits.
    st.builds(lambda b: ("raise", b, 0), st.sampled_from([1, 2, 3])),
    st.builds(lambda v: _write(mmio.REG_INTERRUPT_ACK, v, 4), st.integers(0, 3)),
    st.builds(lambda d: ("device_error", d), st.integers(0, 1)),
    st.builds(lambda c: ("config_changed", c), st.one_of(st.none(), st.binary(max_size=12))),
    st.builds(lambda d: ("activation", d), st.integers(0, 1)),
    st.just(("save_restore",)),
    # A driver's usual steps, so that sequences get past each stage of the bring-up.
    st.builds(lambda stage: ("bring_up", stage), st.integers(1, 3)),
    st.builds(lambda o, v: ("twice", o, v),
              st.sampled_from([mmio.REG_QUEUE_DESC_LOW, mmio.REG_QUEUE_DESC_HIGH,
                               mmio.REG_QUEUE_DRIVER_LOW, mmio.REG_QUEUE_DRIVER_HIGH,
                               mmio.REG_QUEUE_DEVICE_LOW, mmio.REG_QUEUE_DEVICE_HIGH,
                               mmio.REG_QUEUE_NUM]), VALUES),
)


def _state(r: Any) -> tuple[object, ...]:
    return (r.save(), r.epoch, r.status, r.interrupt_status, r.device_features_sel,
            r.driver_features_sel, r.driver_features, r.driver_features_bad, r.queue_sel,
            r.config_generation, r.ignored_writes, r.bad_accesses, r.device_errors,
            r.last_device_error, r.queues(), r.running_epoch())


def _step(r: Any, op: tuple[Any, ...]) -> object:
    kind = op[0]
    if kind == "r":
        return r.read(op[1], op[2])
    if kind == "w":
        return r.write(op[1], op[2])
    if kind == "features":  # a driver's two writes, so negotiation gets somewhere
        return [r.write(mmio.REG_DRIVER_FEATURES_SEL, op[1].to_bytes(4, "little")),
                r.write(mmio.REG_DRIVER_FEATURES, op[2].to_bytes(4, "little"))]
    if kind == "raise":
        return r.raise_interrupt(op[1], r.epoch + op[2])
    if kind == "device_error":
        return r.device_error("the guest broke a ring", r.epoch + op[1])
    if kind == "config_changed":
        return r.config_changed(op[1])
    if kind == "activation":
        return (r.activation(r.epoch + op[1]), r.failed_in(r.epoch + op[1]))
    if kind == "save_restore":
        return r.restore(r.save())
    if kind == "bring_up":
        steps = [(mmio.REG_STATUS, 1), (mmio.REG_STATUS, 3)]
        if op[1] >= 2:
            steps += [(mmio.REG_DRIVER_FEATURES_SEL, 1), (mmio.REG_DRIVER_FEATURES, 1),
                      (mmio.REG_STATUS, 11)]
        if op[1] >= 3:
            steps += [(mmio.REG_QUEUE_SEL, 0), (mmio.REG_QUEUE_NUM, 1),
                      (mmio.REG_QUEUE_READY, 1), (mmio.REG_STATUS, 15)]
        return [r.write(o, v.to_bytes(4, "little")) for o, v in steps]
    if kind == "twice":  # a queue register before and after QueueReady
        v = op[2].to_bytes(4, "little")
        return [r.write(op[1], v), r.write(mmio.REG_QUEUE_READY, b"\1\0\0\0"),
                r.write(op[1], v), r.read(mmio.REG_QUEUE_READY, 4)]
    raise AssertionError(op)


IDENTIFICATION = {mmio.REG_MAGIC: mmio.MAGIC, mmio.REG_VERSION: mmio.VERSION,
                  mmio.REG_DEVICE_ID: 19, mmio.REG_VENDOR_ID: mmio.VENDOR_ID}
BRING_UP_PREFIXES = {0, 1, 3, 11, 15}   # ACKNOWLEDGE, DRIVER, FEATURES_OK, DRIVER_OK
EVENT_KINDS = {"reset", "features_ok", "features_refused", "activate", "notify", "needs_reset",
               "config_write"}


def _u32(data: bytes) -> int:
    return int.from_bytes(data, "little")


def _check_step(r: Any, op: tuple[Any, ...], before: tuple[object, ...],
                before_status: int, before_epoch: int, before_isr: int, got: object,
                features: int, max_sizes: list[int]) -> None:
    """The rules a step must keep, from the state before it and what it returned."""
    for offset, value in IDENTIFICATION.items():
        assert r.read(offset, 4) == value.to_bytes(4, "little")
    assert r.status & 0xF in BRING_UP_PREFIXES
    if r.status & STATUS_FEATURES_OK and not r.driver_features_bad:
        assert r.driver_features & ~features == 0
        assert r.driver_features & VIRTIO_F_VERSION_1
    events = [e for e in (got if isinstance(got, list) else []) if isinstance(e, tuple)]
    for kind, number, other, _ in events:
        assert kind in EVENT_KINDS
        if kind == "activate":
            assert r.status & STATUS_DRIVER_OK and not before_status & STATUS_DRIVER_OK
            assert number == r.epoch
        if kind == "notify":
            assert number < len(max_sizes) and other == r.epoch
            assert r.status & STATUS_DRIVER_OK
    kind = op[0]
    if kind in ("r", "w") and op[1] < mmio.CONFIG_SPACE:
        size = op[2] if kind == "r" else len(op[2])
        if size != 4 or op[1] % 4:
            if kind == "r":
                assert got == bytes(size)
            else:
                assert got == [] and r.save() == before[0]
        elif kind == "r" and op[1] == mmio.REG_QUEUE_NUM_MAX:
            sel = r.queue_sel
            assert _u32(got) == (max_sizes[sel] if sel < len(max_sizes) else 0)
        elif kind == "w" and op[1] == mmio.REG_STATUS and _u32(op[2]) == 0:
            assert got == [("reset", 0, 0, "")]
            assert r.epoch == before_epoch + 1 and r.status == 0 and r.interrupt_status == 0
        elif kind == "w" and op[1] == mmio.REG_INTERRUPT_ACK:
            assert r.interrupt_status == before_isr & ~_u32(op[2])
    if before_status & STATUS_DRIVER_OK and r.epoch == before_epoch and kind in (
            "w", "twice", "features", "bring_up"):
        assert r.queues() == before[14], "a queue register changed while running"
    if kind == "raise":
        assert got == (op[2] == 0)   # only a device of the current epoch interrupts
        if got:
            assert r.interrupt_status == before_isr | op[1]
    if kind == "save_restore":
        assert r.save() == before[0]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_sizes=st.lists(st.sampled_from([1, 2, 16, 256]), min_size=0, max_size=3),
       features=st.sampled_from([VIRTIO_F_VERSION_1, VIRTIO_F_VERSION_1 | 1 << 28 | 5, 0]),
       config=st.one_of(st.none(), st.binary(max_size=24)),
       running_first=st.booleans(),
       ops=st.lists(OPS, max_size=60))
def test_hostile_register_sequences_keep_the_rules(max_sizes: list[int], features: int,
                                                   config: bytes | None, running_first: bool,
                                                   ops: list[tuple[Any, ...]]) -> None:
    r = _core.MmioRegisters(19, features, max_sizes, config)
    # Half the sequences start from a driver's whole bring-up, so that the rules of a
    # running device (frozen queues, notifications, interrupts) get as many steps.
    for op in [("bring_up", 3)] * running_first + ops:
        before = _state(r)
        status, epoch, isr = r.status, r.epoch, r.interrupt_status
        got = _step(r, op)
        _check_step(r, op, before, status, epoch, isr, got, features, max_sizes)


def test_bring_up_events() -> None:
    """The events of a whole bring-up, reset and a bad size, spelled out."""
    for r in (_core.MmioRegisters(4, VIRTIO_F_VERSION_1, [256]),):
        def w(offset: int, value: int, r: Any = r) -> object:
            return r.write(offset, value.to_bytes(4, "little"))
        assert w(mmio.REG_STATUS, 1) == [] and w(mmio.REG_STATUS, 3) == []
        w(mmio.REG_DRIVER_FEATURES_SEL, 1)
        w(mmio.REG_DRIVER_FEATURES, 1)
        assert w(mmio.REG_STATUS, 11) == [("features_ok", VIRTIO_F_VERSION_1, 0, "")]
        assert w(mmio.REG_QUEUE_NUM, 3) == [
            ("needs_reset", 0, 0, "queue 0 size 3 is not a power of 2 in 1..256")]
        assert w(mmio.REG_STATUS, 15) == []  # NEEDS_RESET: no activation
        assert w(mmio.REG_STATUS, 0) == [("reset", 0, 0, "")]
        assert r.epoch == 1 and r.status == 0 and r.interrupt_status == 0
        for v in (1, 3):
            w(mmio.REG_STATUS, v)
        w(mmio.REG_DRIVER_FEATURES_SEL, 1)
        w(mmio.REG_DRIVER_FEATURES, 1)
        w(mmio.REG_STATUS, 11)
        w(mmio.REG_QUEUE_NUM, 16)
        w(mmio.REG_QUEUE_READY, 1)
        assert w(mmio.REG_STATUS, 15) == [("activate", 1, 0, "")]
        assert w(mmio.REG_QUEUE_NOTIFY, 0) == [("notify", 0, 1, "")]
        assert w(mmio.REG_QUEUE_NOTIFY, 1) == [] and r.ignored_writes == 1
        assert r.activation(1) == [(256, 16, True, 0, 0, 0)]
        assert r.raise_interrupt(1, 0) is False and r.raise_interrupt(1, 1) is True
        assert r.read(mmio.REG_INTERRUPT_STATUS, 4) == b"\1\0\0\0"
        assert r.read(0x100, 4) is None  # no plain config: the device answers
        assert r.write(0x104, b"\1\2") == [("config_write", 4, 0, b"\1\2")]


def test_config_bytes_served_and_refreshed() -> None:
    for r in (_core.MmioRegisters(2, VIRTIO_F_VERSION_1, [128]),):
        r.set_config(b"\x10\x00\x00\x00\x00\x00\x00\x00")
        assert r.read(0x100, 8) == b"\x10" + bytes(7)
        assert r.read(0x106, 4) == b"\0\0\0\0"  # past the end: zeros
        assert r.write(0x100, b"\xff") == []  # plain config is read-only: dropped
        assert r.config_changed(b"\x20") is False  # driver not running: no interrupt
        assert r.read(0x100, 1) == b"\x20" and r.config_generation == 1
        assert r.read(0xFFE, 4) == b"\0\0\0\0" and r.bad_accesses == 1


@pytest.mark.parametrize("max_sizes, message", [
    ([0], "queue max size 0 is not a power of 2 in 1..256"),
    ([3], "queue max size 3 is not a power of 2 in 1..256"),
    ([512], "queue max size 512 is not a power of 2 in 1..256"),
    ([1] * 65, "65 queues, at most 64")])
def test_bad_queue_max_sizes_refused(max_sizes: list[int], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        _core.MmioRegisters(4, 0, max_sizes)
    assert str(refused.value) == message
