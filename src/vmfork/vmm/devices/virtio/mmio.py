"""The virtio-mmio transport, version 2 (virtio 1.x, 4.2). No legacy (version 1).

One ``MmioTransport`` is a ``BusDevice`` on the MMIO bus, 0x1000 bytes wide,
and fronts one ``VirtioDevice``. Register accesses arrive on vCPU threads; all
device work runs on the I/O thread (``EventLoop``). A lock guards the register
file, which both sides touch (the I/O thread sets interrupt bits and
DEVICE_NEEDS_RESET).

Notifications reach us two ways. Without ioeventfds, a guest write to
QueueNotify exits to the vCPU thread, which hands the work to the loop. With a
``register_ioeventfd(offset, datamatch, fd)`` callable, we create one eventfd
per queue and ask the machine to register it for offset 0x50 with datamatch =
queue index (KVM_IOEVENTFD with DATAMATCH, 4 bytes); KVM then signals the
eventfd without a VM exit and the loop drains it. Both paths end in the same
``_notify`` on the loop thread, so a device never sees two threads.

Resets. Writing 0 to Status gives the registers fresh values at once (new
``Virtqueue`` objects, so the device's old references are detached) and then
runs ``device.reset()`` on the loop, waiting for it: when the driver's reset
write returns, the device touches those rings no more. A counter (``epoch``)
makes work queued before a reset a no-op after it.

What we do with garbage, by case. The rule: an access we can simply refuse is
ignored (and counted in ``ignored_writes``/``bad_accesses``); a write that would
leave driver and device disagreeing about where memory is sets
DEVICE_NEEDS_RESET, because ignoring it would make us read rings the driver is
not using.

* Register access (offset < 0x100) that is not a 4-byte aligned 4-byte access:
  reads return zeros, writes are ignored.
* Unknown register offsets, writes to read-only registers: reads return zero,
  writes are ignored.
* Config space (0x100..0xfff): any access of 1, 2, 4 or 8 bytes is forwarded to
  the device; other sizes read zeros / are ignored.
* Status: 0 resets. A write may only add bits, in the order ACKNOWLEDGE,
  DRIVER, FEATURES_OK, DRIVER_OK; one that clears a bit or skips a step is
  ignored. FAILED is accepted at any time. DEVICE_NEEDS_RESET is the device's
  bit; the driver cannot set or clear it (only reset clears it).
* FEATURES_OK is refused (the bit stays clear, which is how the spec says a
  device refuses) when the driver accepted a bit we never offered or did not
  accept VIRTIO_F_VERSION_1.
* DriverFeatures written outside DRIVER..FEATURES_OK: ignored. Feature words
  beyond the second (select >= 2) hold no offered bits: a non-zero write there
  makes FEATURES_OK fail as above.
* Queue registers for a QueueSel with no queue: reads 0 (so QueueNumMax = 0,
  the spec's "no such queue"), writes ignored.
* QueueNum, QueueReady and the ring addresses may be written only before
  DRIVER_OK; the ring size and addresses only while the queue is not ready.
  Other writes are ignored.
* QueueNum of 0, above QueueNumMax, or not a power of 2: DEVICE_NEEDS_RESET
  (the driver would lay its rings out for a size we cannot use).
* QueueNotify for a queue that does not exist, or before DRIVER_OK: ignored.
* A ring that does not lie in guest RAM or is misaligned, found at DRIVER_OK,
  or any ``GuestError`` from the device later: DEVICE_NEEDS_RESET plus a
  configuration-change interrupt; the device gets no more calls until reset.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from vmfork.vmm.devices.virtio.device import (
    STATUS_ACKNOWLEDGE,
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_DRIVER,
    STATUS_DRIVER_OK,
    STATUS_FAILED,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
    VirtioDevice,
    run_on_loop,
)
from vmfork.vmm.devices.virtio.queue import QueueState, Virtqueue
from vmfork.vmm.errors import GuestError, HostError
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.irq import Interrupt
from vmfork.vmm.memory import GuestMemory

log = logging.getLogger(__name__)

MMIO_WINDOW_SIZE = 0x1000
MAGIC = 0x74726976  # "virt"
VERSION = 2
VENDOR_ID = 0x554D4551  # "QEMU": what Linux guests are used to; nothing keys on it

# Register offsets (virtio 1.x, 4.2.2).
REG_MAGIC = 0x000
REG_VERSION = 0x004
REG_DEVICE_ID = 0x008
REG_VENDOR_ID = 0x00C
REG_DEVICE_FEATURES = 0x010
REG_DEVICE_FEATURES_SEL = 0x014
REG_DRIVER_FEATURES = 0x020
REG_DRIVER_FEATURES_SEL = 0x024
REG_QUEUE_SEL = 0x030
REG_QUEUE_NUM_MAX = 0x034
REG_QUEUE_NUM = 0x038
REG_QUEUE_READY = 0x044
REG_QUEUE_NOTIFY = 0x050
REG_INTERRUPT_STATUS = 0x060
REG_INTERRUPT_ACK = 0x064
REG_STATUS = 0x070
REG_QUEUE_DESC_LOW = 0x080
REG_QUEUE_DESC_HIGH = 0x084
REG_QUEUE_DRIVER_LOW = 0x090
REG_QUEUE_DRIVER_HIGH = 0x094
REG_QUEUE_DEVICE_LOW = 0x0A0
REG_QUEUE_DEVICE_HIGH = 0x0A4
REG_CONFIG_GENERATION = 0x0FC
CONFIG_SPACE = 0x100

INT_USED_BUFFER = 0x1
INT_CONFIG_CHANGE = 0x2

_DRIVER_STATUS_BITS = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK
# Each step's bit may be set only once the bits before it are.
_STATUS_ORDER = (STATUS_ACKNOWLEDGE, STATUS_DRIVER, STATUS_FEATURES_OK, STATUS_DRIVER_OK)

RegisterIoeventfd = Callable[[int, int, int], None]


@dataclass
class MmioTransportState:
    """Plain-data twin of ``MmioTransport`` (registers and queues, not fds)."""

    device_type: int
    status: int
    device_features_sel: int
    driver_features_sel: int
    driver_features: int
    driver_features_bad: bool
    queue_sel: int
    interrupt_status: int
    config_generation: int
    queues: list[QueueState] = field(default_factory=list)


class _Signals:
    """The ``VirtioInterrupt`` handed to a device for one activation (one epoch)."""

    def __init__(self, transport: MmioTransport, epoch: int) -> None:
        self._transport = transport
        self._epoch = epoch

    def trigger(self) -> None:
        self._transport._raise(INT_USED_BUFFER, self._epoch)

    def trigger_config(self) -> None:
        self._transport._raise(INT_CONFIG_CHANGE, self._epoch)

    def device_error(self, err: GuestError) -> None:
        self._transport._device_error(err, self._epoch)

    @property
    def failed(self) -> bool:
        return self._transport._failed_in(self._epoch)


class MmioTransport:
    """A virtio-mmio v2 register window in front of one device."""

    def __init__(self, device: VirtioDevice, memory: GuestMemory, interrupt: Interrupt,
                 loop: EventLoop, register_ioeventfd: RegisterIoeventfd | None = None,
                 name: str | None = None) -> None:
        self.device = device
        self.memory = memory
        self.irq = interrupt
        self.loop = loop
        self.name = name or f"virtio-mmio({type(device).__name__})"
        self._lock = threading.Lock()
        self._epoch = 0
        self._reset_registers()
        self.ignored_writes = 0
        self.bad_accesses = 0
        self.device_errors = 0
        self.last_device_error: str | None = None
        self._ioeventfds: list[int] = []
        if register_ioeventfd is not None:
            self._setup_ioeventfds(register_ioeventfd)

    def _reset_registers(self) -> None:
        self.status = 0
        self.device_features_sel = 0
        self.driver_features_sel = 0
        self.driver_features = 0
        self.driver_features_bad = False
        self.queue_sel = 0
        self.interrupt_status = 0
        self.config_generation = 0
        self.queues = [Virtqueue(m) for m in self.device.queue_max_sizes]

    def _setup_ioeventfds(self, register: RegisterIoeventfd) -> None:
        try:
            for index in range(self.device.queue_count):
                fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self._ioeventfds.append(fd)
                register(REG_QUEUE_NOTIFY, index, fd)
        except OSError as err:
            self.close()
            raise HostError(f"{self.name}: ioeventfd for queue {len(self._ioeventfds) - 1}: "
                            f"{err}", op="ioeventfd", errno=err.errno) from err
        fds = list(self._ioeventfds)

        def add_readers() -> None:
            for index, fd in enumerate(fds):
                self.loop.add_reader(fd, partial(self._ioeventfd_ready, index, fd))

        loop_call(self.loop, add_readers)

    def close(self) -> None:
        """Drop the ioeventfds (the machine unregisters them from KVM first)."""
        fds, self._ioeventfds = self._ioeventfds, []

        def drop() -> None:
            for fd in fds:
                self.loop.remove_reader(fd)
                os.close(fd)

        loop_call(self.loop, drop)

    # -- BusDevice ------------------------------------------------------------------------
    def read(self, offset: int, size: int) -> bytes:
        if offset >= CONFIG_SPACE:
            if size not in (1, 2, 4, 8) or offset + size > MMIO_WINDOW_SIZE:
                self.bad_accesses += 1
                return bytes(size)
            with self._lock:
                return self.device.read_config(offset - CONFIG_SPACE, size)
        if size != 4 or offset % 4:
            self.bad_accesses += 1
            return bytes(size)
        with self._lock:
            value = self._read_register(offset)
        return value.to_bytes(4, "little")

    def write(self, offset: int, data: bytes) -> None:
        size = len(data)
        if offset >= CONFIG_SPACE:
            if size not in (1, 2, 4, 8) or offset + size > MMIO_WINDOW_SIZE:
                self.bad_accesses += 1
                return
            with self._lock:
                self.device.write_config(offset - CONFIG_SPACE, bytes(data))
            return
        if size != 4 or offset % 4:
            self.bad_accesses += 1
            return
        value = int.from_bytes(data, "little")
        if offset == REG_STATUS and value == 0:
            self.reset()
            return
        with self._lock:
            self._write_register(offset, value)

    # -- registers (under the lock) --------------------------------------------------------
    def _selected_queue(self) -> Virtqueue | None:
        if self.queue_sel < len(self.queues):
            return self.queues[self.queue_sel]
        return None

    def _read_register(self, offset: int) -> int:
        q = self._selected_queue()
        if offset == REG_MAGIC:
            return MAGIC
        if offset == REG_VERSION:
            return VERSION
        if offset == REG_DEVICE_ID:
            return self.device.device_type
        if offset == REG_VENDOR_ID:
            return VENDOR_ID
        if offset == REG_DEVICE_FEATURES:
            if self.device_features_sel > 1:
                return 0
            return (self.device.features >> (32 * self.device_features_sel)) & 0xFFFF_FFFF
        if offset == REG_QUEUE_NUM_MAX:
            return q.max_size if q is not None else 0
        if offset == REG_QUEUE_READY:
            return int(q.ready) if q is not None else 0
        if offset == REG_INTERRUPT_STATUS:
            return self.interrupt_status
        if offset == REG_STATUS:
            return self.status
        if offset == REG_CONFIG_GENERATION:
            return self.config_generation
        return 0

    def _ignore(self, what: str) -> None:
        self.ignored_writes += 1
        log.debug("%s: ignored write: %s", self.name, what)

    def _write_register(self, offset: int, value: int) -> None:
        if offset == REG_DEVICE_FEATURES_SEL:
            self.device_features_sel = value
        elif offset == REG_DRIVER_FEATURES_SEL:
            self.driver_features_sel = value
        elif offset == REG_DRIVER_FEATURES:
            self._write_driver_features(value)
        elif offset == REG_QUEUE_SEL:
            self.queue_sel = value
        elif offset == REG_QUEUE_NOTIFY:
            self._write_queue_notify(value)
        elif offset == REG_INTERRUPT_ACK:
            self.interrupt_status &= ~value
        elif offset == REG_STATUS:
            self._write_status(value)
        elif offset in (REG_QUEUE_NUM, REG_QUEUE_READY, REG_QUEUE_DESC_LOW,
                        REG_QUEUE_DESC_HIGH, REG_QUEUE_DRIVER_LOW, REG_QUEUE_DRIVER_HIGH,
                        REG_QUEUE_DEVICE_LOW, REG_QUEUE_DEVICE_HIGH):
            self._write_queue_register(offset, value)
        else:
            self._ignore(f"offset {offset:#x} is not a writable register")

    def _write_driver_features(self, value: int) -> None:
        if not self.status & STATUS_DRIVER or self.status & STATUS_FEATURES_OK:
            self._ignore("DriverFeatures outside feature negotiation")
            return
        if self.driver_features_sel > 1:
            if value:
                self.driver_features_bad = True
            return
        shift = 32 * self.driver_features_sel
        self.driver_features = ((self.driver_features & ~(0xFFFF_FFFF << shift))
                                | (value << shift))

    def _write_status(self, value: int) -> None:
        current = self.status & _DRIVER_STATUS_BITS
        wanted = value & _DRIVER_STATUS_BITS
        if value & STATUS_FAILED:
            self.status |= STATUS_FAILED
        if wanted == current:
            return
        if current & ~wanted:
            self._ignore(f"status {value:#x} would clear bits of {self.status:#x}")
            return
        for bit in _STATUS_ORDER:
            if wanted & bit and not current & bit:
                previous = _STATUS_ORDER[:_STATUS_ORDER.index(bit)]
                if any(not wanted & b for b in previous):
                    self._ignore(f"status {value:#x} skips a step before {bit:#x}")
                    return
        if wanted & STATUS_FEATURES_OK and not current & STATUS_FEATURES_OK:
            refused = self._features_refusal()
            if refused:
                log.info("%s: FEATURES_OK refused: %s", self.name, refused)
                wanted &= ~(STATUS_FEATURES_OK | STATUS_DRIVER_OK)
            else:
                self.device.acked_features = self.driver_features
        self.status = (self.status & ~_DRIVER_STATUS_BITS) | wanted
        if (wanted & STATUS_DRIVER_OK and not current & STATUS_DRIVER_OK
                and not self.status & STATUS_DEVICE_NEEDS_RESET):
            epoch = self._epoch
            self.loop.call_soon(lambda: self._activate(epoch))

    def _features_refusal(self) -> str | None:
        unoffered = self.driver_features & ~self.device.features
        if unoffered or self.driver_features_bad:
            return f"driver accepted feature bits never offered ({unoffered:#x})"
        if not self.driver_features & VIRTIO_F_VERSION_1:
            return "driver did not accept VIRTIO_F_VERSION_1 (legacy is not supported)"
        return None

    def _write_queue_register(self, offset: int, value: int) -> None:
        q = self._selected_queue()
        if q is None:
            self._ignore(f"queue register {offset:#x} for missing queue {self.queue_sel}")
            return
        if self.status & STATUS_DRIVER_OK or not self.status & STATUS_DRIVER:
            self._ignore(f"queue register {offset:#x} outside queue setup "
                         f"(status {self.status:#x})")
            return
        if offset == REG_QUEUE_READY:
            if value in (0, 1):
                q.ready = bool(value)
            else:
                self._ignore(f"QueueReady value {value}")
            return
        if q.ready:
            self._ignore(f"queue register {offset:#x} while queue {self.queue_sel} is ready")
            return
        if offset == REG_QUEUE_NUM:
            if not Virtqueue.size_is_valid(value, q.max_size):
                self._set_needs_reset(f"queue {self.queue_sel} size {value} is not a power "
                                      f"of 2 in 1..{q.max_size}")
                return
            q.size = value
            return
        low = 0xFFFF_FFFF
        high = low << 32
        if offset == REG_QUEUE_DESC_LOW:
            q.desc_table = (q.desc_table & high) | value
        elif offset == REG_QUEUE_DESC_HIGH:
            q.desc_table = (q.desc_table & low) | (value << 32)
        elif offset == REG_QUEUE_DRIVER_LOW:
            q.avail_ring = (q.avail_ring & high) | value
        elif offset == REG_QUEUE_DRIVER_HIGH:
            q.avail_ring = (q.avail_ring & low) | (value << 32)
        elif offset == REG_QUEUE_DEVICE_LOW:
            q.used_ring = (q.used_ring & high) | value
        elif offset == REG_QUEUE_DEVICE_HIGH:
            q.used_ring = (q.used_ring & low) | (value << 32)

    def _write_queue_notify(self, index: int) -> None:
        if index >= len(self.queues):
            self._ignore(f"QueueNotify for missing queue {index}")
            return
        if not self.status & STATUS_DRIVER_OK or self.status & STATUS_DEVICE_NEEDS_RESET:
            self._ignore(f"QueueNotify {index} while the device is not running")
            return
        epoch = self._epoch
        self.loop.call_soon(lambda: self._notify(index, epoch))

    # -- reset ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Device reset (Status = 0): fresh registers now, ``device.reset`` on the loop."""
        with self._lock:
            self._epoch += 1
            self._reset_registers()
        try:
            run_on_loop(self.loop, self.device.reset)
        except HostError as err:
            log.error("%s: device reset did not complete: %s", self.name, err)

    # -- I/O thread side ---------------------------------------------------------------------
    def _ioeventfd_ready(self, index: int, fd: int) -> None:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            return
        with self._lock:
            running = (self.status & STATUS_DRIVER_OK
                       and not self.status & STATUS_DEVICE_NEEDS_RESET)
            epoch = self._epoch
        if running:
            self._notify(index, epoch)

    def _activate(self, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch or self.status & STATUS_DEVICE_NEEDS_RESET:
                return
            queues = list(self.queues)
        try:
            for index, q in enumerate(queues):
                if q.ready:
                    try:
                        q.validate(self.memory)
                    except GuestError as err:
                        raise type(err)(f"queue {index}: {err}") from err
            if self.device.active:  # re-activation after restore onto a live device
                self.device.reset()
            self.device.activate(self.memory, queues, _Signals(self, epoch))
            # An ioeventfd kick right after DRIVER_OK can reach the loop before this
            # callback (the loop serves ready fds before queued calls) and be dropped as
            # "not active"; after a restore, the rings may hold unserved buffers. A
            # notification per ready queue catches both; a spurious one costs a look.
            for index, q in enumerate(queues):
                if q.ready and not self._failed_in(epoch):
                    self.device.queue_notify(index)
        except GuestError as err:
            self._device_error(err, epoch)

    def _notify(self, index: int, epoch: int) -> None:
        if self._failed_in(epoch) or not self.device.active:
            return
        try:
            self.device.queue_notify(index)
        except GuestError as err:
            self._device_error(err, epoch)

    def _failed_in(self, epoch: int) -> bool:
        with self._lock:
            return epoch != self._epoch or bool(self.status & STATUS_DEVICE_NEEDS_RESET)

    def _raise(self, bits: int, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch:
                return
            self.interrupt_status |= bits
        self.irq.trigger()

    def notify_config_change(self) -> None:
        """The device's configuration space changed (a volume slot got its disk): a
        new ``ConfigGeneration`` (so a driver reading the multi-byte fields across the
        change reads them again) and, if the driver is running, the interrupt. A
        driver that has not started yet reads the new values when it probes."""
        with self._lock:
            self.config_generation = (self.config_generation + 1) & 0xFFFF_FFFF
            if not self.status & STATUS_DRIVER_OK or self.status & STATUS_DEVICE_NEEDS_RESET:
                return
            self.interrupt_status |= INT_CONFIG_CHANGE
        self.irq.trigger()

    def _set_needs_reset(self, reason: str) -> None:
        """Under the lock: mark the device broken and tell the driver."""
        self.device_errors += 1
        self.last_device_error = reason
        log.warning("%s: device needs reset: %s", self.name, reason)
        self.status |= STATUS_DEVICE_NEEDS_RESET
        self.interrupt_status |= INT_CONFIG_CHANGE
        self.irq.trigger()

    def _device_error(self, err: GuestError, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch or self.status & STATUS_DEVICE_NEEDS_RESET:
                return
            self._set_needs_reset(str(err))

    # -- snapshots ----------------------------------------------------------------------------
    def save(self) -> MmioTransportState:
        """Capture the registers and queues. Call on the I/O thread (``run_on_loop``)
        with the vCPUs paused, so no device work or register write races it."""
        with self._lock:
            return MmioTransportState(
                device_type=self.device.device_type, status=self.status,
                device_features_sel=self.device_features_sel,
                driver_features_sel=self.driver_features_sel,
                driver_features=self.driver_features,
                driver_features_bad=self.driver_features_bad, queue_sel=self.queue_sel,
                interrupt_status=self.interrupt_status,
                config_generation=self.config_generation,
                queues=[q.save() for q in self.queues])

    def restore(self, state: MmioTransportState) -> None:
        """Load registers and queues; re-activate the device (on the loop) if it was live.

        Restore the device's own state first: activation may start it serving.
        """
        if state.device_type != self.device.device_type:
            raise ValueError(f"{self.name}: state is for device type {state.device_type}, "
                             f"this is {self.device.device_type}")
        if len(state.queues) != len(self.queues):
            raise ValueError(f"{self.name}: state has {len(state.queues)} queues, "
                             f"device has {len(self.queues)}")
        with self._lock:
            self._epoch += 1
            self._reset_registers()
            self.status = state.status
            self.device_features_sel = state.device_features_sel
            self.driver_features_sel = state.driver_features_sel
            self.driver_features = state.driver_features
            self.driver_features_bad = state.driver_features_bad
            self.queue_sel = state.queue_sel
            self.interrupt_status = state.interrupt_status
            self.config_generation = state.config_generation
            for q, qs in zip(self.queues, state.queues):
                q.restore(qs)
            if self.status & STATUS_FEATURES_OK:
                self.device.acked_features = self.driver_features
            epoch = self._epoch
            live = (self.status & STATUS_DRIVER_OK
                    and not self.status & STATUS_DEVICE_NEEDS_RESET)
        if live:
            self.loop.call_soon(lambda: self._activate(epoch))


def loop_call(loop: EventLoop, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the loop thread: now if we are on it, else queued."""
    if loop.in_loop_thread():
        fn()
    else:
        loop.call_soon(fn)
