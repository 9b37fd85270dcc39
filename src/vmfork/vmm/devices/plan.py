"""A device's restore as plain values, for its native transport (``native/src/transport.rs``).

The state format has one reader (``vmstate``, ``stateformat``, the device manager's
typed records): this module only turns an already decoded ``DeviceState`` into the
tuple ``_core.NativeDevice.restore`` takes, and that device's ``plan()`` back into a
``DeviceState`` (what a snapshot of a natively served device saves). A plan is:

    (kind, features, max_sizes, registers, indices)

* ``kind``: ``("rng", max_requests, max_bytes, 0)``, ``("balloon", max_chains,
  madvise advice, actual)`` or ``("vsock", guest_cid, connect timeout ms, reset
  acknowledgement wait ms)``: the device's record reduced to what its native server
  takes, with the budgets and timeouts ``rng.py``, ``balloon.py`` and ``vsock.py``
  serve with (a vsock's host listener is not in the record: ``NativeDevice.restore``
  takes it beside the plan, ``vsock_listener``); or a disk's, ``("blk" | "volume",
  disk key, capacity bytes, read-only, guest path)``: ``BlkState`` (and a volume
  slot's ``VolumeSlotState.guest_path``, "" for the root disk), whose budget is
  ``blk.py``'s in the native transport; an empty slot's key is "" and its capacity 0.
  The disk's file is not in the record either: ``NativeDevice.restore`` takes it
  beside the plan (``disk_file``), ``NativeMachine`` by slot (``disk_files``); or
  net's, ``("net", MAC)``: ``NetState.mac`` as it is written, whose budgets are
  ``net.py``'s in the native transport; the tap, a live host resource, is not in the
  record: ``NativeDevice.restore`` takes it beside the plan (``tap_fd``),
  ``NativeMachine`` by slot (``tap_fds``), a native child from its jail;
* ``features`` and ``max_sizes``: what the device offers, as its Python class does;
* ``registers``: the transport's register image, as ``MmioRegisters.save`` gives it;
* ``indices``: each queue's ``(next_avail, next_used)``.

A machine serves every kind in ``NATIVE_KINDS`` through ``_core.NativeDevice``
(``Machine._native_device``): a booted one from ``boot_plan``, a restored one from
``device_plan`` of its snapshot's record; ``NativeVirtio`` is the handle the device
manager keeps. Switching a kind on is adding it to ``NATIVE_KINDS`` with its plan in
``_kind`` and ``_offer``; a forked child's ``Machine`` is handed its snapshot's plans
(``restore_plans``, by slot), built once per snapshot in the zygote's prefork. Every
virtio kind has a plan and is switched on (``NATIVE_KINDS``: rng, the balloon, vsock,
blk, volume slots, net) in the Python ``Machine`` as in ``NativeMachine``; a vsock's listener, a net
device's tap and a disk's file are the machine's to give (``Machine._native_device``).
``machine_plan`` is a whole snapshot's virtio devices as ``_core.NativeMachine``
takes them, built once per snapshot.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any

from vmfork.vmm.devices.manager import (
    BALLOON,
    BLK,
    NET,
    RNG,
    VOLUME,
    VSOCK,
    DeviceKind,
    DeviceState,
    VolumeSlotState,
)
from vmfork.vmm.devices.virtio import balloon, blk, net, rng, vsock
from vmfork.vmm.devices.virtio.device import (
    DEVICE_ID_VSOCK,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
)
from vmfork.vmm.devices.virtio.mmio import MmioTransportState
from vmfork.vmm.devices.virtio.queue import QueueState
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.native import CORE_BUILT

if CORE_BUILT or TYPE_CHECKING:
    from vmfork import _core
if TYPE_CHECKING:
    from vmfork.vmm.vmstate import MachineState

# The kinds with a plan, which every machine serves through their native transport
# (``Machine`` and ``_core.NativeMachine`` alike): every virtio kind.
NATIVE_KINDS = frozenset((RNG.name, BALLOON.name, VSOCK.name, BLK.name, VOLUME.name, NET.name))
DISK_KINDS = frozenset((BLK.name, VOLUME.name))

# (name, numbers...) of rng, the balloon and vsock; (name, key, capacity, read-only,
# guest path) of a disk; (name, MAC) of net.
NumbersKind = tuple[str, int, int, int]
DiskKind = tuple[str, str, int, bool, str]
NetKind = tuple[str, str]
Kind = NumbersKind | DiskKind | NetKind
Registers = tuple[int, int, int, int, bool, int, int, int,
                  list[tuple[int, int, bool, int, int, int]]]
Plan = tuple[Kind, int, list[int], Registers, list[tuple[int, int]]]


def _offer(kind: str, disk: blk.BlkState | None = None) -> tuple[int, tuple[int, ...], int]:
    """(features, queue max sizes, device type) of a device of ``kind``, as its class
    (a disk's features, as ``blk.py`` offers them, follow from its record ``disk``)."""
    if kind in DISK_KINDS:
        if disk is None:
            raise ValueError(f"a {kind} device's features follow from its record")
        features = (blk.OFFERED_FEATURES_SLOT if disk.volume_slot else
                    blk.OFFERED_FEATURES if disk.read_only else blk.OFFERED_FEATURES_RW)
        return VIRTIO_F_VERSION_1 | features, (blk.QUEUE_SIZE,), blk.DEVICE_ID_BLK
    if kind == "rng":
        return VIRTIO_F_VERSION_1, rng.QUEUE_MAX_SIZES, rng.DEVICE_TYPE
    if kind == NET.name:
        return (VIRTIO_F_VERSION_1 | net.OFFERED_FEATURES, (net.QUEUE_SIZE,) * 2,
                net.DEVICE_ID_NET)
    if kind == "vsock":
        return VIRTIO_F_VERSION_1, (vsock.QUEUE_SIZE,) * 3, DEVICE_ID_VSOCK
    return (VIRTIO_F_VERSION_1 | balloon.VIRTIO_BALLOON_F_REPORTING,
            (balloon.QUEUE_SIZE,) * 3, balloon.DEVICE_ID_BALLOON)


def balloon_advice(memory: GuestMemory) -> int:
    """How a balloon drops a reported page from ``memory``: a memfd mapped shared keeps
    the data past ``MADV_DONTNEED``; only a hole (``MADV_REMOVE``) frees it."""
    shared = memory.backing_fd is not None and not memory.private_file
    return mmap.MADV_REMOVE if shared else mmap.MADV_DONTNEED


def _kind(name: str, balloon_advice: int, actual: int = 0, guest_cid: int = 0) -> NumbersKind:
    """A ``name`` device's record reduced to what its native server takes (the
    balloon's ``actual``, vsock's ``guest_cid``)."""
    if name == RNG.name:
        return ("rng", rng.MAX_REQUESTS_PER_NOTIFY, rng.MAX_BYTES_PER_REQUEST, 0)
    if name == VSOCK.name:
        return ("vsock", guest_cid, round(vsock.CONNECT_TIMEOUT * 1000),
                round(vsock.RESET_ACK_WAIT_S * 1000))
    return ("balloon", balloon.MAX_CHAINS_PER_NOTIFY, balloon_advice, actual & 0xFFFF_FFFF)


def boot_plan(name: str, balloon_advice: int = mmap.MADV_DONTNEED,
              disk: blk.BlkState | None = None, guest_path: str = "", *,
              guest_cid: int = vsock.DEFAULT_GUEST_CID, mac: str | None = None) -> Plan:
    """The plan of a ``name`` device no driver has touched yet (a booted machine's):
    a disk's from its record ``disk`` (an empty slot's: key "", capacity 0) and a
    volume slot's ``guest_path``, a vsock's for ``guest_cid``, a net device's for
    ``mac`` (``ValueError`` if it is not a unicast MAC, as ``net.parse_mac`` says)."""
    if name not in NATIVE_KINDS:
        raise ValueError(f"no native transport for a {name} device")
    features, max_sizes, _ = _offer(name, disk)
    kind: Kind
    if disk is not None:
        kind = (name, disk.disk_key, disk.capacity_bytes, disk.read_only, guest_path)
    elif name == NET.name:
        if mac is None:
            raise ValueError("a net device's plan needs its MAC")
        kind = (name, net.format_mac(net.parse_mac(mac)))
    else:
        kind = _kind(name, balloon_advice, guest_cid=guest_cid)
    plan: Plan = _core.NativeDevice.fresh_plan(kind, features, list(max_sizes))
    return plan


def empty_slot() -> blk.BlkState:
    """The record of a volume slot without a disk (``blk.py``: no key, no bytes)."""
    return blk.BlkState(acked_features=0, disk_key="", capacity_bytes=0, volume_slot=True)


def wants_ioeventfds(plan: Plan) -> bool:
    """Whether the machine gives the device's queues ioeventfds: not an empty volume
    slot, which most never get a disk (the eventfd and ``KVM_IOEVENTFD`` would be a
    spawn's system calls for nothing; a guest's rare notify to it is served on the
    writing vCPU's thread). ``DevicePlan::wants_ioeventfds``'s rule."""
    kind = plan[0]
    return not (len(kind) == 5 and kind[2] == 0)


def _disk(state: DeviceState) -> tuple[blk.BlkState, str] | None:
    """A disk's ``BlkState`` and guest path ("" for the root disk); None if not a disk."""
    if isinstance(state.state, VolumeSlotState):
        return state.state.disk, state.state.guest_path
    if isinstance(state.state, blk.BlkState):
        return state.state, ""
    return None


def device_plan(state: DeviceState, balloon_advice: int = mmap.MADV_DONTNEED) -> Plan:
    """The plan of a decoded rng, balloon, vsock, blk or volume slot record
    (``ValueError`` for another kind, or a record that does not fit the device).
    ``balloon_advice`` is how this machine drops a reported page (``MADV_REMOVE`` for
    guest RAM on a shared memfd)."""
    if state.kind not in NATIVE_KINDS:
        raise ValueError(f"no native transport for a {state.kind} device")
    t = state.transport
    if t is None:
        raise ValueError(f"the {state.kind} record has no transport state")
    disk = _disk(state)
    features, max_sizes, device_type = _offer(state.kind, disk[0] if disk else None)
    if t.device_type != device_type:
        raise ValueError(f"the {state.kind} record's transport is for device type "
                         f"{t.device_type}, not {device_type}")
    if len(t.queues) != len(max_sizes):
        raise ValueError(f"the {state.kind} record has {len(t.queues)} queues, the "
                         f"device {len(max_sizes)}")
    record = state.state
    kind: Kind
    if disk is not None:
        d, guest_path = disk
        kind = (state.kind, d.disk_key, d.capacity_bytes, d.read_only, guest_path)
    elif isinstance(record, net.NetState):
        net.parse_mac(record.mac)   # a record's MAC is checked where net.py checks it
        kind = (state.kind, record.mac)
    elif isinstance(record, vsock.VsockState):
        kind = _kind(state.kind, balloon_advice, guest_cid=record.guest_cid)
    else:
        actual = record.actual if isinstance(record, balloon.BalloonState) else 0
        kind = _kind(state.kind, balloon_advice, actual)
    registers: Registers = (
        t.status, t.device_features_sel, t.driver_features_sel, t.driver_features,
        t.driver_features_bad, t.queue_sel, t.interrupt_status, t.config_generation,
        [(q.max_size, q.size, q.ready, q.desc_table, q.avail_ring, q.used_ring)
         for q in t.queues])
    indices = [(q.next_avail, q.next_used) for q in t.queues]
    return kind, features, list(max_sizes), registers, indices


def restore_plans(state: MachineState,
                  balloon_advice: int = mmap.MADV_DONTNEED) -> dict[int, Plan]:
    """The plan of each device of the decoded snapshot ``state`` that the Python
    ``Machine`` serves natively (``NATIVE_KINDS``), by slot: what its restore takes
    (``MachineConfig.restore_plans``), built once per snapshot in the zygote."""
    return {device.slot: device_plan(device, balloon_advice)
            for device in state.devices
            if device.kind in NATIVE_KINDS and device.slot is not None}


def machine_plan(state: MachineState,
                 balloon_advice: int = mmap.MADV_DONTNEED) -> list[tuple[int, int, Plan]]:
    """Every virtio device of the decoded snapshot ``state`` as ``(slot, IOAPIC pin,
    plan)``, at the slot and pin the device manager gave it (``DeviceState``), for
    ``_core.NativeMachine``'s ``devices``; COM1, a legacy device, is its ``serial``.
    ``ValueError`` for a record that does not fit its device (``device_plan``). A
    disk's file and a net device's tap are the caller's to open (``disk_files``,
    ``tap_fds``)."""
    return [(device.slot, device.irq, device_plan(device, balloon_advice))
            for device in state.devices if device.slot is not None]


def plan_state(plan: Plan, slot: int | None, irq: int) -> DeviceState:
    """The ``DeviceState`` a natively served device saves: ``plan`` is its ``plan()``;
    ``slot`` and ``irq`` where it is on the machine."""
    kind, _, _, registers, indices = plan
    status, dfs, drfs, df, bad, qsel, isr, cg, queues = registers
    # As the Python transport: the acked features are the driver's from FEATURES_OK on.
    acked = df if status & STATUS_FEATURES_OK else 0
    saved: object      # the kind's record
    record_kind: DeviceKind[Any]
    disk: blk.BlkState | None = None
    if len(kind) == 2:
        name, mac = kind
        saved, record_kind = net.NetState(mac=mac, acked_features=acked), NET
    elif len(kind) == 5:
        name, disk_key, capacity, read_only, guest_path = kind
        disk = blk.BlkState(acked_features=acked, disk_key=disk_key,
                            capacity_bytes=capacity, read_only=read_only,
                            volume_slot=name == VOLUME.name)
        record_kind = VOLUME if disk.volume_slot else BLK
        saved = VolumeSlotState(disk, guest_path) if disk.volume_slot else disk
    else:
        name, first, _, last = kind
        if name == RNG.name:
            saved, record_kind = rng.RngState(acked_features=acked), RNG
        elif name == BALLOON.name:
            saved, record_kind = balloon.BalloonState(acked_features=acked, actual=last), BALLOON
        elif name == VSOCK.name:
            saved, record_kind = vsock.VsockState(guest_cid=first, acked_features=acked), VSOCK
        else:
            raise ValueError(f"no native transport for a {name} device")
    _, _, device_type = _offer(name, disk)
    transport = MmioTransportState(
        device_type=device_type, status=status, device_features_sel=dfs,
        driver_features_sel=drfs, driver_features=df, driver_features_bad=bad,
        queue_sel=qsel, interrupt_status=isr, config_generation=cg,
        queues=[QueueState(m, size, ready, desc, avail, used, next_avail, next_used)
                for (m, size, ready, desc, avail, used), (next_avail, next_used)
                in zip(queues, indices)])
    return DeviceState(record_kind.name, record_kind.version, slot, irq, saved, transport)


class NativeVirtio:
    """A machine's handle on a device its native transport serves: what the device
    manager saves and closes, and what the machine's stats read (``device``); a disk's
    record as it is now (``disk``)."""

    def __init__(self, device: _core.NativeDevice, restored_from: DeviceState | None) -> None:
        self.device = device
        # The record it was restored from when it was attached (the manager's restore
        # checks it is the one it is asked to restore).
        self.restored_from = restored_from

    def save_state(self, slot: int, irq: int) -> DeviceState:
        """Its ``DeviceState`` (the vCPUs paused)."""
        return plan_state(self.device.plan(), slot, irq)

    @property
    def disk(self) -> blk.BlkState:
        """A disk's record now (a volume slot's media, once inserted); ``ValueError``
        for a device that is not a disk."""
        record = plan_state(self.device.plan(), 0, 0).state   # (its place is not asked)
        disk = record.disk if isinstance(record, VolumeSlotState) else record
        if not isinstance(disk, blk.BlkState):
            raise ValueError(f"a {type(record).__name__} device has no disk")
        return disk

    def close(self) -> None:
        self.device.close()
