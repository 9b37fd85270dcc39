"""A device's restore as plain values, for its native transport (``native/src/transport.rs``).

The state format has one reader (``vmstate``, ``stateformat``, the device manager's
typed records): this module only turns an already decoded ``DeviceState`` into the
tuple ``_core.NativeDevice.restore`` takes, and that device's ``plan()`` back into a
``DeviceState`` (what a snapshot of a natively served device saves). A plan is:

    (kind, features, max_sizes, registers, indices)

* ``kind``: ``("rng", max_requests, max_bytes, 0)`` or ``("balloon", max_chains,
  madvise advice, actual)``: the device's record reduced to what its native server
  takes, with the budgets ``rng.py`` and ``balloon.py`` serve with;
* ``features`` and ``max_sizes``: what the device offers, as its Python class does;
* ``registers``: the transport's register image, as ``MmioRegisters.save`` gives it;
* ``indices``: each queue's ``(next_avail, next_used)``.

A machine serves every kind in ``NATIVE_KINDS`` through ``_core.NativeDevice``
(``Machine._native_device``): a booted one from ``boot_plan``, a restored one from
``device_plan`` of its snapshot's record; ``NativeVirtio`` is the handle the device
manager keeps. Switching a kind on is adding it to ``NATIVE_KINDS`` with its plan in
``_kind`` and ``_offer``. Only rng and the balloon are native so far (docs/native.md
says what vsock, blk and net still need).
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

from vmfork.vmm.devices.manager import BALLOON, RNG, DeviceState
from vmfork.vmm.devices.virtio import balloon, rng
from vmfork.vmm.devices.virtio.device import STATUS_FEATURES_OK, VIRTIO_F_VERSION_1
from vmfork.vmm.devices.virtio.mmio import MmioTransportState
from vmfork.vmm.devices.virtio.queue import QueueState
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.native import CORE_BUILT

if CORE_BUILT or TYPE_CHECKING:
    from vmfork import _core

# The kinds a machine serves through their native transport.
NATIVE_KINDS = frozenset((RNG.name, BALLOON.name))

Kind = tuple[str, int, int, int]
Registers = tuple[int, int, int, int, bool, int, int, int,
                  list[tuple[int, int, bool, int, int, int]]]
Plan = tuple[Kind, int, list[int], Registers, list[tuple[int, int]]]


def _offer(kind: str) -> tuple[int, tuple[int, ...], int]:
    """(features, queue max sizes, device type) of a device of ``kind``, as its class."""
    if kind == "rng":
        return VIRTIO_F_VERSION_1, rng.VirtioRng.queue_max_sizes, rng.VirtioRng.device_type
    return (VIRTIO_F_VERSION_1 | balloon.VIRTIO_BALLOON_F_REPORTING,
            (balloon.QUEUE_SIZE,) * 3, balloon.DEVICE_ID_BALLOON)


def balloon_advice(memory: GuestMemory) -> int:
    """How a balloon drops a reported page from ``memory``: a memfd mapped shared keeps
    the data past ``MADV_DONTNEED``; only a hole (``MADV_REMOVE``) frees it."""
    shared = memory.backing_fd is not None and not memory.private_file
    return mmap.MADV_REMOVE if shared else mmap.MADV_DONTNEED


def _kind(name: str, balloon_advice: int, actual: int = 0) -> Kind:
    """A ``name`` device's record reduced to what its native server takes."""
    if name == RNG.name:
        return ("rng", rng.MAX_REQUESTS_PER_NOTIFY, rng.MAX_BYTES_PER_REQUEST, 0)
    return ("balloon", balloon.MAX_CHAINS_PER_NOTIFY, balloon_advice, actual & 0xFFFF_FFFF)


def boot_plan(name: str, balloon_advice: int = mmap.MADV_DONTNEED) -> Plan:
    """The plan of a ``name`` device no driver has touched yet (a booted machine's)."""
    if name not in NATIVE_KINDS:
        raise ValueError(f"no native transport for a {name} device")
    features, max_sizes, _ = _offer(name)
    plan: Plan = _core.NativeDevice.fresh_plan(_kind(name, balloon_advice), features,
                                               list(max_sizes))
    return plan


def device_plan(state: DeviceState, balloon_advice: int = mmap.MADV_DONTNEED) -> Plan:
    """The plan of a decoded rng or balloon record (``ValueError`` for another kind, or
    a record that does not fit the device). ``balloon_advice`` is how this machine
    drops a reported page (``MADV_REMOVE`` for guest RAM on a shared memfd)."""
    if state.kind not in NATIVE_KINDS:
        raise ValueError(f"no native transport for a {state.kind} device")
    t = state.transport
    if t is None:
        raise ValueError(f"the {state.kind} record has no transport state")
    features, max_sizes, device_type = _offer(state.kind)
    if t.device_type != device_type:
        raise ValueError(f"the {state.kind} record's transport is for device type "
                         f"{t.device_type}, not {device_type}")
    if len(t.queues) != len(max_sizes):
        raise ValueError(f"the {state.kind} record has {len(t.queues)} queues, the "
                         f"device {len(max_sizes)}")
    record = state.state
    actual = record.actual if isinstance(record, balloon.BalloonState) else 0
    kind = _kind(state.kind, balloon_advice, actual)
    registers: Registers = (
        t.status, t.device_features_sel, t.driver_features_sel, t.driver_features,
        t.driver_features_bad, t.queue_sel, t.interrupt_status, t.config_generation,
        [(q.max_size, q.size, q.ready, q.desc_table, q.avail_ring, q.used_ring)
         for q in t.queues])
    indices = [(q.next_avail, q.next_used) for q in t.queues]
    return kind, features, list(max_sizes), registers, indices


def plan_state(plan: Plan, slot: int | None, irq: int) -> DeviceState:
    """The ``DeviceState`` a natively served device saves: ``plan`` is its ``plan()``;
    ``slot`` and ``irq`` where it is on the machine."""
    (name, _, second, actual), _, _, registers, indices = plan
    status, dfs, drfs, df, bad, qsel, isr, cg, queues = registers
    # As the Python transport: the acked features are the driver's from FEATURES_OK on.
    acked = df if status & STATUS_FEATURES_OK else 0
    record: rng.RngState | balloon.BalloonState
    if name == "rng":
        record = rng.RngState(acked_features=acked)
    elif name == "balloon":
        record = balloon.BalloonState(acked_features=acked, actual=actual)
    else:
        raise ValueError(f"no native transport for a {name} device")
    _, _, device_type = _offer(name)
    transport = MmioTransportState(
        device_type=device_type, status=status, device_features_sel=dfs,
        driver_features_sel=drfs, driver_features=df, driver_features_bad=bad,
        queue_sel=qsel, interrupt_status=isr, config_generation=cg,
        queues=[QueueState(m, size, ready, desc, avail, used, next_avail, next_used)
                for (m, size, ready, desc, avail, used), (next_avail, next_used)
                in zip(queues, indices)])
    version = RNG.version if name == RNG.name else BALLOON.version
    return DeviceState(name, version, slot, irq, record, transport)


class NativeVirtio:
    """A machine's handle on a device its native transport serves: what the device
    manager saves and closes, and what the machine's stats read (``device``)."""

    def __init__(self, device: _core.NativeDevice, restored_from: DeviceState | None) -> None:
        self.device = device
        # The record it was restored from when it was attached (the manager's restore
        # checks it is the one it is asked to restore).
        self.restored_from = restored_from

    def save_state(self, slot: int, irq: int) -> DeviceState:
        """Its ``DeviceState`` (the vCPUs paused)."""
        return plan_state(self.device.plan(), slot, irq)

    def close(self) -> None:
        self.device.close()
