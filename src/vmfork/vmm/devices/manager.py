"""The machine's devices: their kinds, their slots, and their saved state as one list.

The contract every device keeps (``Persist``): a plain-data ``*State`` record and one
``save() -> State`` / ``restore(State)`` pair; live resources (fds, sockets, threads)
are constructor arguments, never state. A ``DeviceKind`` names a record in state
files: the kind's name, its record's version (bumped only when the record changes
incompatibly; adding a defaulted field is not that), the record class, and whether
the device sits on virtio-mmio.

The ``DeviceManager`` owns the slots. The machine attaches its devices in one fixed
order (``Machine._add_devices``): COM1 on its legacy pin, then each virtio device in
the next virtio-mmio window (``virtio-mmio.<slot>``, ``VIRTIO_MMIO_BASE + slot * 4
KiB``) on pin ``FIRST_DEVICE_IRQ + slot``; the devices that share pins (volume slots)
come last and take the pins left round-robin. The guest's kernel was told where every
device is, so a restored machine must have the very same list: ``save`` records each
device's kind, slot and pin (``DeviceState``), ``restore`` refuses a machine whose
list differs before touching any device. ``close`` releases the devices, last
attached first.

Every virtio device is served by its native transport (``attach_native``; every kind
is in ``devices/plan.py``'s ``NATIVE_KINDS``): one ``NativeVirtio`` handle, restored
from its snapshot's record when the machine attaches it (its plan is the restore, one
call), saved as ``plan_state`` of its plan, closed with the others. COM1, the one
legacy device, is restored from its record by ``restore``.

``MachineState.devices`` is that list. State files of format version 1 had a field
per device; ``upgrade_format_1`` turns such a payload into the list, with the slots
and pins the machine of that time gave its devices (the same rule, ``slot_irq``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast, runtime_checkable

from vmfork.vmm.devices.serial import SerialState
from vmfork.vmm.devices.virtio.balloon import BalloonState
from vmfork.vmm.devices.virtio.blk import BlkState
from vmfork.vmm.devices.virtio.mmio import MmioTransportState
from vmfork.vmm.devices.virtio.net import NetState
from vmfork.vmm.devices.virtio.rng import RngState
from vmfork.vmm.devices.virtio.vsock import VsockState
from vmfork.vmm.errors import HostError
from vmfork.vmm.x86 import layout as L

R = TypeVar("R")


class Persist(Protocol[R]):
    """What a device gives the manager: its state as a plain record, and back."""

    def save(self) -> R: ...

    def restore(self, state: R) -> None: ...


@dataclass(frozen=True)
class DeviceKind(Generic[R]):
    name: str                 # in state files
    version: int              # of the record's shape
    record: type[R]
    virtio: bool = True       # on virtio-mmio (a window, a transport); else legacy
    many: bool = False        # a machine may have several; else at most one
    shares_pin: bool = False  # takes a pin shared with its kind, after every other device
    required: bool = False    # every machine has exactly one


@dataclass
class VolumeSlotState:
    """A volume slot: its virtio-blk device, and where the guest mounted its disk
    ("" for an empty slot)."""

    disk: BlkState
    guest_path: str = ""


# Every kind, in the order a machine attaches them (format 1's fields had that order).
SERIAL = DeviceKind("serial", 1, SerialState, virtio=False, required=True)
VSOCK = DeviceKind("vsock", 1, VsockState)
RNG = DeviceKind("rng", 1, RngState)
NET = DeviceKind("net", 1, NetState)
BLK = DeviceKind("blk", 1, BlkState)            # the read-only root disk
BALLOON = DeviceKind("balloon", 1, BalloonState)
VOLUME = DeviceKind("volume", 1, VolumeSlotState, many=True, shares_pin=True)
KINDS: dict[str, DeviceKind[Any]] = {k.name: k for k in (SERIAL, VSOCK, RNG, NET, BLK,
                                                         BALLOON, VOLUME)}


def kind_named(name: object) -> DeviceKind[Any]:
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"unknown device kind {str(name)[:40]!r} (this vmfork knows "
                         f"{', '.join(KINDS)}): the snapshot was written by a newer vmfork; "
                         "upgrade vmfork to restore it")
    return kind


def _check_version(kind: DeviceKind[Any], version: object) -> None:
    if version == kind.version:
        return
    newer = isinstance(version, int) and version > kind.version
    raise ValueError(f"the {kind.name} device's record is version {str(version)[:20]}, this "
                     f"vmfork reads version {kind.version}: "
                     + ("written by a newer vmfork; upgrade vmfork to restore it" if newer
                        else "take the snapshot again"))


@dataclass
class DeviceState:
    """One device of a saved machine: its kind and the kind's record version, where it
    was (``virtio-mmio.<slot>``, None for a legacy device; its IOAPIC pin), its record,
    and its transport's registers and queues (virtio devices only)."""

    kind: str
    version: int
    slot: int | None
    irq: int
    state: object    # the kind's record, typed by ``kind`` (``state_field_types``)
    transport: MmioTransportState | None = None

    @classmethod
    def state_field_types(cls, tree: Mapping[str, Any]) -> dict[str, object]:
        """For ``stateformat``: the record's type follows from the entry's kind."""
        kind = kind_named(tree.get("kind"))
        _check_version(kind, tree.get("version"))
        return {"state": kind.record}

    def __post_init__(self) -> None:
        kind = kind_named(self.kind)
        _check_version(kind, self.version)
        if not isinstance(self.state, kind.record):
            raise ValueError(f"a {kind.name} device's record is a {kind.record.__name__}, "
                             f"not a {type(self.state).__name__}")
        if kind.virtio != (self.transport is not None):
            raise ValueError(f"a {kind.name} device " + ("needs its transport's state"
                                                         if kind.virtio else
                                                         "has no virtio transport"))
        if kind.virtio != (self.slot is not None):
            raise ValueError(f"a {kind.name} device " + ("has a virtio-mmio slot"
                                                         if kind.virtio else "has no slot"))
        if not 0 <= self.irq < L.IOAPIC_PINS:
            raise ValueError(f"{kind.name} device: IRQ {self.irq} is not an IOAPIC pin "
                             f"(0..{L.IOAPIC_PINS - 1})")

    @property
    def where(self) -> str:
        at = f"virtio-mmio.{self.slot}" if self.slot is not None else "legacy"
        return f"{self.kind} ({at}, irq {self.irq})"


def check_devices(devices: Sequence[DeviceState]) -> None:
    """A machine's device list is whole: each required kind once, no other single
    kind twice, the virtio devices in slot order from 0. ``ValueError`` says what."""
    seen: dict[str, int] = {}
    next_slot = 0
    for index, device in enumerate(devices):
        kind = kind_named(device.kind)
        if not kind.many and kind.name in seen:
            raise ValueError(f"two {kind.name} devices (devices[{seen[kind.name]}] and "
                             f"devices[{index}]); a machine has at most one")
        seen.setdefault(kind.name, index)
        if device.slot is not None:
            if device.slot != next_slot:
                raise ValueError(f"devices[{index}] ({device.kind}) is at virtio-mmio."
                                 f"{device.slot}, expected virtio-mmio.{next_slot}: the list "
                                 "is in slot order")
            next_slot += 1
    missing = [k.name for k in KINDS.values() if k.required and k.name not in seen]
    if missing:
        raise ValueError(f"the machine has no {', '.join(missing)} device")


def device_record(devices: Sequence[DeviceState], kind: DeviceKind[R]) -> R | None:
    """The record of the machine's one device of ``kind``, None if it has none."""
    if kind.many:
        raise TypeError(f"a machine may have several {kind.name} devices: use device_records")
    for device in devices:
        if device.kind == kind.name:
            return cast(R, device.state)
    return None


def device_records(devices: Sequence[DeviceState], kind: DeviceKind[R]) -> list[R]:
    """The records of the machine's devices of ``kind``, in slot order."""
    return [cast(R, d.state) for d in devices if d.kind == kind.name]


def slot_irq(slot: int, first_shared_slot: int | None) -> int:
    """The IOAPIC pin of ``virtio-mmio.<slot>``: its own (``FIRST_DEVICE_IRQ + slot``)
    before the first pin-sharing device (at ``first_shared_slot``), else one of the pins
    left after those, round-robin. Pins run out before volume slots do (24 pins, five
    legacy), and virtio-mmio's interrupt may be shared: Linux's handler reads each
    device's InterruptStatus, so a shared pin costs a few status reads, never a lost
    wake-up. ``ValueError`` when no pin is left."""
    if first_shared_slot is None or slot < first_shared_slot:
        irq = L.FIRST_DEVICE_IRQ + slot
        if irq >= L.IOAPIC_PINS:
            raise ValueError("no IOAPIC pins left for another virtio device")
        return irq
    first_pin = L.FIRST_DEVICE_IRQ + first_shared_slot
    pins = L.IOAPIC_PINS - first_pin
    if pins <= 0:
        raise ValueError("no IOAPIC pins left for volume slots")
    return first_pin + (slot - first_shared_slot) % pins


# Format 1's device fields, each {"transport", "device"}, in the order of their slots;
# its "volumes" ({"transport", "device", "guest_path"} each) came after all of them.
_FORMAT_1_FIELDS = ("vsock", "rng", "net", "blk", "balloon")


def upgrade_format_1(tree: Any) -> Any:
    """A format-1 machine state payload in today's shape: its per-device fields as the
    ``devices`` list (the slots and pins follow from the order, as they did then), and
    without ``guest_cid`` (the vsock device's record holds it). ``ValueError`` for a
    payload whose device fields are not of format 1's shape."""
    if not isinstance(tree, dict):
        raise ValueError("the payload is not an object")
    tree = dict(tree)
    if "serial" not in tree:
        raise ValueError("field 'serial' is missing")
    devices: list[dict[str, Any]] = [{"kind": SERIAL.name, "version": 1, "slot": None,
                                      "irq": L.COM1_IRQ, "state": tree.pop("serial")}]
    virtio: list[tuple[DeviceKind[Any], Any, Any]] = []
    for name in _FORMAT_1_FIELDS:
        entry = tree.pop(name, None)
        if entry is None:
            continue
        if not isinstance(entry, dict) or not {"transport", "device"} <= entry.keys():
            raise ValueError(f"field {name!r}: expected an object with transport and device")
        virtio.append((KINDS[name], entry["device"], entry["transport"]))
    volumes = tree.pop("volumes", [])
    if not isinstance(volumes, list):
        raise ValueError("field 'volumes': expected an array")
    for index, volume in enumerate(volumes):
        if not isinstance(volume, dict) or not {"transport", "device"} <= volume.keys():
            raise ValueError(f"field 'volumes[{index}]': expected an object with transport "
                             "and device")
        virtio.append((VOLUME, {"disk": volume["device"],
                                "guest_path": volume.get("guest_path", "")},
                       volume["transport"]))
    first_shared: int | None = None
    for slot, (kind, state, transport) in enumerate(virtio):
        if kind.shares_pin and first_shared is None:
            first_shared = slot
        devices.append({"kind": kind.name, "version": 1, "slot": slot,
                        "irq": slot_irq(slot, first_shared), "state": state,
                        "transport": transport})
    tree.pop("guest_cid", None)
    tree["devices"] = devices
    return tree


@runtime_checkable
class NativeVirtio(Protocol):
    """A virtio device served by its native transport (``devices/plan.py``'s
    ``NativeVirtio``): its state as the manager saves it, the record it was restored
    from when it was attached (None for a booted one), and its close."""

    @property
    def restored_from(self) -> DeviceState | None: ...

    def save_state(self, slot: int, irq: int) -> DeviceState: ...

    def close(self) -> None: ...


N = TypeVar("N", bound=NativeVirtio)


@dataclass
class _Attached:
    kind: DeviceKind[Any]
    device: Persist[Any] | NativeVirtio
    slot: int | None
    irq: int


class DeviceManager:
    """A machine's devices in attach order, with their slots and pins (see the module
    docstring). Attach on the machine's construction thread; ``save`` and ``restore``
    with the vCPUs paused, ``save`` on the I/O thread."""

    def __init__(self, vm_id: str | None = None) -> None:
        self._vm_id = vm_id   # for errors
        self._attached: list[_Attached] = []
        self._next_slot = 0
        self._first_shared_slot: int | None = None

    @property
    def next_slot(self) -> int:
        """The slot the next virtio device gets (the N of its ``virtio-mmio.N``)."""
        return self._next_slot

    def attach_legacy(self, kind: DeviceKind[R], device: Persist[R], irq: int) -> None:
        if kind.virtio:
            raise ValueError(f"{kind.name} is a virtio device: attach_native")
        self._attach_check(kind)
        self._attached.append(_Attached(kind, device, None, irq))

    def attach_native(self, kind: DeviceKind[Any], build: Callable[[int, int], N]) -> N:
        """Give a device served by its native transport the next window and its pin:
        ``build(slot, irq)`` makes it there (the machine's: the window, ioeventfds,
        the line, the command-line entry). ``HostError`` when no pin is left."""
        slot, irq, first_shared = self._place(kind)
        device = build(slot, irq)
        self._attached.append(_Attached(kind, device, slot, irq))
        self._next_slot = slot + 1
        self._first_shared_slot = first_shared
        return device

    def _place(self, kind: DeviceKind[Any]) -> tuple[int, int, int | None]:
        """The next virtio device's (slot, pin, first pin-sharing slot), or the
        refusal if ``kind`` may not go there."""
        slot = self._next_slot
        first_shared = self._first_shared_slot
        if kind.shares_pin and first_shared is None:
            first_shared = slot
        if not kind.virtio:
            raise ValueError(f"{kind.name} is not a virtio device: attach_legacy")
        self._attach_check(kind)
        if not kind.shares_pin and first_shared is not None:
            raise ValueError(f"{kind.name} has a pin of its own: it goes before the "
                             "devices that share pins")
        try:
            irq = slot_irq(slot, first_shared)
        except ValueError as err:
            raise HostError(str(err), vm_id=self._vm_id, op="add_virtio") from None
        return slot, irq, first_shared

    def _attach_check(self, kind: DeviceKind[Any]) -> None:
        if KINDS.get(kind.name) is not kind:
            raise ValueError(f"device kind {kind.name!r} is not in KINDS")
        if not kind.many and any(a.kind is kind for a in self._attached):
            raise ValueError(f"a machine has at most one {kind.name} device")

    def save(self) -> list[DeviceState]:
        """Every device's record, transport and place, in attach order."""
        return [_save(a) for a in self._attached]

    def restore(self, saved: Sequence[DeviceState]) -> None:
        """Restore every device from ``saved``, which must list the same devices in the
        same places (``HostError`` naming both lists if not, before any device is
        touched). A virtio device was restored from its record when it was attached:
        this checks it was this record."""
        have = [(a.kind.name, a.slot, a.irq) for a in self._attached]
        want = [(d.kind, d.slot, d.irq) for d in saved]
        if have != want:
            raise HostError("the snapshot's devices differ from this machine's: the "
                            f"snapshot has {_describe(want)}; this machine has "
                            f"{_describe(have)}", vm_id=self._vm_id, op="restore")
        for attached, state in zip(self._attached, saved):
            device = attached.device
            if isinstance(device, NativeVirtio):
                if device.restored_from is not state:
                    raise HostError(f"{attached.kind.name} is served natively: it is "
                                    "restored from its record when it is attached",
                                    vm_id=self._vm_id, op="restore")
                continue
            device.restore(state.state)

    def close(self) -> None:
        """Release each virtio device, last attached first. Idempotent; a failing
        close is raised after the others ran."""
        closing, self._attached = reversed(self._attached), []
        _run([a.device.close for a in closing if isinstance(a.device, NativeVirtio)])


def _save(a: _Attached) -> DeviceState:
    device = a.device
    if isinstance(device, NativeVirtio):
        assert a.slot is not None   # a virtio device
        return device.save_state(a.slot, a.irq)
    return DeviceState(a.kind.name, a.kind.version, a.slot, a.irq, device.save(), None)


def _run(steps: Iterable[Callable[[], None]]) -> None:
    """Run every step; the first failure is raised after the others ran."""
    failed: Exception | None = None
    for step in steps:
        try:
            step()
        except Exception as err:  # noqa: BLE001 - the others still run
            failed = failed or err
    if failed is not None:
        raise failed


def _describe(devices: list[tuple[str, int | None, int]]) -> str:
    return ", ".join(f"{kind}" + (f" at virtio-mmio.{slot}" if slot is not None else "")
                     + f" (irq {irq})" for kind, slot, irq in devices) or "no devices"
