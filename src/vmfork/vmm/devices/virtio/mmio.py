"""The virtio-mmio transport, version 2 (virtio 1.x, 4.2), no legacy (version 1): its
registers, its record and the rules its register file keeps.

The transport is native (``native/src/mmio.rs``, the register file, served on the vCPU
thread without the GIL; ``native/src/transport.rs``, what a register write causes, for
every device: ``NativeTransport``). A machine puts each device's window on its MMIO
bus's ``_core.MmioWindows`` (``Machine._native_device``); notifications reach the
device's server through one ioeventfd per queue (KVM_IOEVENTFD for offset 0x50 with
datamatch = the queue's index), served on the native loop, or on the writing vCPU's
thread for a queue without one. ``MmioTransportState`` is the registers' record in a
snapshot (``DevicePlan``'s register image is built from it, ``devices/plan.py``).
The Python transport that fronted Python devices is deleted with them (session 22).

Resets. Writing 0 to Status gives the registers fresh values at once and retires the
device's server before the write returns: when the driver's reset write returns, the
device touches those rings no more. A counter (``epoch``) makes work queued before a
reset a no-op after it.

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

from dataclasses import dataclass, field

from vmfork.vmm.devices.virtio.queue import QueueState

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


@dataclass
class MmioTransportState:
    """The transport's record: its registers and queues (``MmioRegisters.save``'s)."""

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
