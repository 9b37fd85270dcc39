"""The virtio-mmio transport, version 2 (virtio 1.x, 4.2). No legacy (version 1).

One ``MmioTransport`` is a ``BusDevice`` on the MMIO bus, 0x1000 bytes wide,
and fronts one ``VirtioDevice``. Register accesses arrive on vCPU threads; all
device work runs on the I/O thread (``EventLoop``).

The register file is an object of its own with one lock, which both sides touch
(the I/O thread sets interrupt bits and DEVICE_NEEDS_RESET): ``_core.MmioRegisters``
(``native/src/mmio.rs``; it has no Python twin). It applies every rule listed here
and hands back *events* for what needs the device model (reset, acked features,
activation, a notification, a needs-reset to signal, a config write to a device
whose config is not plain bytes); the transport acts on them with the register lock
released. The native vCPU loop serves a register access without the GIL
(``Bus.register`` puts the file into the bus's ``_core.MmioWindows``) and calls
``apply_events`` (or ``read``, for a config read the device answers) only when there
are any: an idle guest's interrupt handling (InterruptStatus, InterruptACK) never
enters Python. Plain config bytes (``config_bytes`` is all a device's config is) are
copied into the register file at construction, restore and ``notify_config_change``.

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
from typing import Protocol

from vmfork.vmm.devices.virtio.device import (
    STATUS_FEATURES_OK,
    VirtioDevice,
    run_on_loop,
)
from vmfork.vmm.devices.virtio.queue import QueueState, Virtqueue
from vmfork.vmm.errors import GuestError, HostError
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop, NativeServer
from vmfork.vmm.irq import Interrupt, IrqLine
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.native import CORE_BUILT, require_core

if CORE_BUILT:
    from vmfork import _core

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

RegisterIoeventfd = Callable[[int, int, int], None]


# Events a register write causes, for the transport to act on once the register lock is
# released: (kind, number, number, detail).
Event = tuple[str, int, int, "str | bytes"]
# One queue's registers: (max_size, size, ready, desc, avail, used).
QueueRegs = tuple[int, int, bool, int, int, int]


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
        return self._transport.registers.failed_in(self._epoch)

    def native_queue(self, index: int) -> NativeQueue | None:
        """What serving queue ``index`` natively on the loop needs, or None where that
        is not possible (no irqfd, or a loop that is not the native one: a unit test's
        stand-in)."""
        return self._transport._native_queue(index, self._epoch)


class AttachNative(Protocol):
    """``NativeQueue.attach``: a device's native server (``native/src/rng_serve.rs``,
    ``net_serve.rs``) takes the queue's ioeventfd."""

    def __call__(self, handler: NativeServer,
                 count_interrupts: bool = True) -> None: ...


@dataclass(frozen=True)
class NativeQueue:
    """The transport's side of a queue served by native code on the native loop: the
    register file (the interrupt bit, the epoch check), the interrupt's eventfd, and
    the queue's ioeventfd (None without ioeventfds). ``attach`` hands the ioeventfd's
    readiness to a native handler and adds the interrupts it raises to the line's count
    (``count_interrupts``: once per handler, so a handler of two queues, virtio-net's,
    says it for one); ``detach`` gives the ioeventfd back to the transport."""

    registers: _core.MmioRegisters
    epoch: int
    irq_fd: int
    notify_fd: int | None
    attach: AttachNative
    detach: Callable[[], None]


class MmioTransport:
    """A virtio-mmio v2 register window in front of one device.

    The register file is ``registers`` (``_core.MmioRegisters``). ``Bus.register`` also
    hands it to the bus's ``MmioWindows``, so the native vCPU loop serves the guest's
    register accesses without Python and calls ``read`` (a config read the device
    answers) or ``apply_events`` only for what needs the device model.
    """

    def __init__(self, device: VirtioDevice, memory: GuestMemory, interrupt: Interrupt,
                 loop: EventLoop, register_ioeventfd: RegisterIoeventfd | None = None,
                 name: str | None = None) -> None:
        self.device = device
        self.memory = memory
        self.irq = interrupt
        self.loop = loop
        self.name = name or f"virtio-mmio({type(device).__name__})"
        self._plain_config = (type(device).read_config is VirtioDevice.read_config
                              and type(device).write_config is VirtioDevice.write_config)
        require_core()
        self.registers = _core.MmioRegisters(device.device_type, device.features,
                                             list(device.queue_max_sizes), self._config())
        # The device's view of the queues: their registers are copied in from
        # ``registers`` (frozen from DRIVER_OK on), their ring indices are the device's.
        # Replaced by fresh ones at a reset, so a device's old references are detached.
        self._queues_lock = threading.Lock()
        self._queues = [Virtqueue(m) for m in device.queue_max_sizes]
        self._ioeventfds: list[int] = []
        self._register_ioeventfd = register_ioeventfd
        if register_ioeventfd is not None and device.wants_ioeventfds:
            self._setup_ioeventfds(register_ioeventfd)

    def _config(self) -> bytes | None:
        """The device's config bytes if they are plain (``config_bytes`` is all there is
        to it; they change only by a restore or before ``notify_config_change``), which
        the register file then serves itself; else None (config accesses go to it)."""
        return self.device.config_bytes() if self._plain_config else None

    @property
    def native_registers(self) -> _core.MmioRegisters:
        """What the bus's native windows serve."""
        return self.registers

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

    def add_ioeventfds(self) -> bool:
        """Give the queues the ioeventfds a device that did not want them at first
        (``VirtioDevice.wants_ioeventfds``) now wants; True if they were added, False if
        it had them already. On the loop thread, as the readers are added at once."""
        if self._ioeventfds or self._register_ioeventfd is None:
            return False
        self._setup_ioeventfds(self._register_ioeventfd)
        return True

    def _native_queue(self, index: int, epoch: int) -> NativeQueue | None:
        registers = self.registers
        irq_fd = getattr(self.irq, "fd", None)
        if not isinstance(self.loop, NativeEventLoop) or not isinstance(irq_fd, int) or irq_fd < 0:
            return None
        loop = self.loop
        notify_fd = self._ioeventfds[index] if index < len(self._ioeventfds) else None

        irq = self.irq
        counters: list[Callable[[], int]] = []

        def attach(handler: NativeServer,
                   count_interrupts: bool = True) -> None:
            if isinstance(irq, IrqLine) and count_interrupts:
                counters.append(lambda: handler.interrupts)
                irq.add_native_counter(counters[-1])
            if notify_fd is not None:
                loop.remove_reader(notify_fd)
                loop.add_native_reader(notify_fd, handler)

        def detach() -> None:
            for counter in counters:
                assert isinstance(irq, IrqLine)
                irq.remove_native_counter(counter)
            counters.clear()
            # Only if the fd is still ours (``close`` may have dropped it already).
            if notify_fd is not None and notify_fd in self._ioeventfds:
                loop.remove_reader(notify_fd)
                loop.add_reader(notify_fd, partial(self._ioeventfd_ready, index, notify_fd))

        return NativeQueue(registers, epoch, irq_fd, notify_fd, attach, detach)

    def close(self) -> None:
        """Drop the ioeventfds (the machine unregisters them from KVM first)."""
        fds, self._ioeventfds = self._ioeventfds, []

        def drop() -> None:
            for fd in fds:
                self.loop.remove_reader(fd)
                os.close(fd)

        loop_call(self.loop, drop)

    # -- the registers, read-only views (tests, the machine's stats) --------------------------
    @property
    def status(self) -> int:
        return self.registers.status

    @property
    def interrupt_status(self) -> int:
        return self.registers.interrupt_status

    @property
    def driver_features(self) -> int:
        return self.registers.driver_features

    @property
    def config_generation(self) -> int:
        return self.registers.config_generation

    @property
    def ignored_writes(self) -> int:
        return self.registers.ignored_writes

    @property
    def bad_accesses(self) -> int:
        return self.registers.bad_accesses

    @property
    def device_errors(self) -> int:
        return self.registers.device_errors

    @property
    def last_device_error(self) -> str | None:
        return self.registers.last_device_error

    @property
    def queues(self) -> list[Virtqueue]:
        """The queues with the registers' current values copied in."""
        with self._queues_lock:
            queues = list(self._queues)
            _load_queue_regs(queues, self.registers.queues())
        return queues

    # -- BusDevice ------------------------------------------------------------------------
    def read(self, offset: int, size: int) -> bytes:
        data = self.registers.read(offset, size)
        if data is None:
            # The device's config is not plain bytes: it answers (under its own lock,
            # from the vCPU thread, as device.py's contract says).
            return self.device.read_config(offset - CONFIG_SPACE, size)
        return data

    def write(self, offset: int, data: bytes) -> None:
        events = self.registers.write(offset, bytes(data))
        if events:
            self.apply_events(events)

    def apply_events(self, events: list[Event]) -> None:
        """Act on what a register write caused (on the writing vCPU's thread, the
        register lock released: the native loop calls this with the GIL)."""
        for kind, number, other, detail in events:
            if kind == "reset":
                self._after_reset()
            elif kind == "features_ok":
                self.device.acked_features = number
            elif kind == "features_refused":
                log.info("%s: FEATURES_OK refused: %s", self.name, detail)
            elif kind == "activate":
                self.loop.call_soon(partial(self._activate, number))
            elif kind == "needs_reset":
                self._needs_reset_raised(str(detail))
            elif kind == "notify":
                self.loop.call_soon(partial(self._notify, number, other))
            elif kind == "config_write":
                assert isinstance(detail, bytes)
                self.device.write_config(number, detail)

    def _needs_reset_raised(self, reason: str) -> None:
        """The register file set DEVICE_NEEDS_RESET and the config-change bit: tell the
        driver."""
        log.warning("%s: device needs reset: %s", self.name, reason)
        self.irq.trigger()

    # -- reset ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Device reset (Status = 0): fresh registers now, ``device.reset`` on the loop."""
        self.write(REG_STATUS, bytes(4))

    def _after_reset(self) -> None:
        with self._queues_lock:
            self._queues = [Virtqueue(m) for m in self.device.queue_max_sizes]
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
        epoch = self.registers.running_epoch()
        if epoch is not None:
            self._notify(index, epoch)

    def _activate(self, epoch: int) -> None:
        # The queue list first, then the epoch check: a reset bumps the epoch before it
        # replaces the list, so a current epoch means these are the current queues.
        with self._queues_lock:
            queues = list(self._queues)
            regs = self.registers.activation(epoch)
            if regs is None:
                return
            _load_queue_regs(queues, regs)
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
                if q.ready and not self.registers.failed_in(epoch):
                    self.device.queue_notify(index)
        except GuestError as err:
            self._device_error(err, epoch)

    def _notify(self, index: int, epoch: int) -> None:
        if self.registers.failed_in(epoch) or not self.device.active:
            return
        try:
            self.device.queue_notify(index)
        except GuestError as err:
            self._device_error(err, epoch)

    def _raise(self, bits: int, epoch: int) -> None:
        if self.registers.raise_interrupt(bits, epoch):
            self.irq.trigger()

    def notify_config_change(self) -> None:
        """The device's configuration space changed (a volume slot got its disk): a
        new ``ConfigGeneration`` (so a driver reading the multi-byte fields across the
        change reads them again) and, if the driver is running, the interrupt. A
        driver that has not started yet reads the new values when it probes."""
        if self.registers.config_changed(self._config()):
            self.irq.trigger()

    def _device_error(self, err: GuestError, epoch: int) -> None:
        if self.registers.device_error(str(err), epoch):
            self._needs_reset_raised(str(err))

    # -- snapshots ----------------------------------------------------------------------------
    def save(self) -> MmioTransportState:
        """Capture the registers and queues. Call on the I/O thread (``run_on_loop``)
        with the vCPUs paused, so no device work or register write races it."""
        self.device.sync_queues()  # a native server owns the ring indices while active
        with self._queues_lock:
            (status, dfs, drfs, df, bad, qsel, isr, cg, regs) = self.registers.save()
            queues = [QueueState(m, size, ready, desc, avail, used, q.next_avail, q.next_used)
                      for q, (m, size, ready, desc, avail, used) in zip(self._queues, regs)]
        return MmioTransportState(
            device_type=self.device.device_type, status=status, device_features_sel=dfs,
            driver_features_sel=drfs, driver_features=df, driver_features_bad=bad,
            queue_sel=qsel, interrupt_status=isr, config_generation=cg, queues=queues)

    def restore(self, state: MmioTransportState) -> None:
        """Load registers and queues; re-activate the device (on the loop) if it was live.

        Restore the device's own state first: activation may start it serving.
        """
        if state.device_type != self.device.device_type:
            raise ValueError(f"{self.name}: state is for device type {state.device_type}, "
                             f"this is {self.device.device_type}")
        if len(state.queues) != len(self._queues):
            raise ValueError(f"{self.name}: state has {len(state.queues)} queues, "
                             f"device has {len(self._queues)}")
        queues = [Virtqueue(m) for m in self.device.queue_max_sizes]
        for q, qs in zip(queues, state.queues):
            q.restore(qs)
        with self._queues_lock:
            epoch, live = self.registers.restore((
                state.status, state.device_features_sel, state.driver_features_sel,
                state.driver_features, state.driver_features_bad, state.queue_sel,
                state.interrupt_status, state.config_generation,
                [(q.max_size, q.size, q.ready, q.desc_table, q.avail_ring, q.used_ring)
                 for q in queues]))
            self._queues = queues
            self.registers.set_config(self._config())
            if state.status & STATUS_FEATURES_OK:
                self.device.acked_features = state.driver_features
        if live:
            self.loop.call_soon(partial(self._activate, epoch))


def _load_queue_regs(queues: list[Virtqueue], regs: list[QueueRegs]) -> None:
    for q, (_, size, ready, desc, avail, used) in zip(queues, regs):
        q.size, q.ready, q.desc_table, q.avail_ring, q.used_ring = size, ready, desc, avail, used


def loop_call(loop: EventLoop, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the loop thread: now if we are on it, else queued."""
    if loop.in_loop_thread():
        fn()
    else:
        loop.call_soon(fn)
