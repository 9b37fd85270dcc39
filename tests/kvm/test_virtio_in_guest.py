"""A virtio queue driven by a guest over real MMIO exits, ioeventfds and irqfds.

The tiny script guest plays the driver: it negotiates features, sets up queue 0
of the virtio-rng device, notifies (caught by KVM as an ioeventfd, no exit),
and waits for the device to publish a used element. The host prepares the
descriptor table and rings in guest memory, as a driver's allocator would.
"""

from __future__ import annotations

import struct

from tests.kvm.tinyguest import Script
from vmfork.vmm.devices.virtio import mmio as R
from vmfork.vmm.devices.virtio.queue import VIRTQ_DESC_F_WRITE
from vmfork.vmm.x86.layout import VIRTIO_MMIO_BASE

DESC, AVAIL, USED, BUF = 0x300000, 0x301000, 0x302000, 0x400000
QUEUE_SIZE = 8
STATUS_NEEDS_RESET = 0x40


def _driver_setup(s: Script, base: int) -> Script:
    s.read32(base + R.REG_MAGIC).read32(base + R.REG_VERSION).read32(base + R.REG_DEVICE_ID)
    s.write32(base + R.REG_STATUS, 1).write32(base + R.REG_STATUS, 3)
    s.write32(base + R.REG_DRIVER_FEATURES_SEL, 1).write32(base + R.REG_DRIVER_FEATURES, 1)
    s.write32(base + R.REG_DRIVER_FEATURES_SEL, 0).write32(base + R.REG_DRIVER_FEATURES, 0)
    s.write32(base + R.REG_STATUS, 0xB).read32(base + R.REG_STATUS)
    s.write32(base + R.REG_QUEUE_SEL, 0).write32(base + R.REG_QUEUE_NUM, QUEUE_SIZE)
    for reg, addr in ((R.REG_QUEUE_DESC_LOW, DESC), (R.REG_QUEUE_DRIVER_LOW, AVAIL),
                      (R.REG_QUEUE_DEVICE_LOW, USED)):
        s.write32(base + reg, addr).write32(base + reg + 4, 0)
    s.write32(base + R.REG_QUEUE_READY, 1).write32(base + R.REG_STATUS, 0xF)
    return s


def _publish(machine: object, buf_addr: int, length: int) -> None:
    mem = machine.memory  # type: ignore[attr-defined]
    mem.write(DESC, struct.pack("<QIHH", buf_addr, length, VIRTQ_DESC_F_WRITE, 0))
    mem.write(AVAIL, struct.pack("<HHH", 0, 1, 0))   # flags, idx = 1, ring[0] = desc 0


def _rng_script() -> Script:
    base = VIRTIO_MMIO_BASE + 0x1000 * 0  # rng is the only virtio device: slot 0
    s = _driver_setup(Script(), base)
    s.write32(base + R.REG_QUEUE_NOTIFY, 0)
    s.wait16_change(USED + 2, 0)                 # used.idx leaves 0
    s.read32(base + R.REG_INTERRUPT_STATUS)
    s.read32(USED + 2)
    return s


def test_guest_driver_gets_random_bytes_through_a_virtqueue() -> None:
    from tests.kvm.tinyguest import script_machine

    machine, rec = script_machine(_rng_script(), rng=True)
    with machine:
        _publish(machine, BUF, 64)
        machine.start()
        exit_ = machine.wait(20)
        assert exit_ is not None and exit_.reason == "reset", exit_
        magic, version, device_id, status, int_status, used_idx = rec.u32s()
        assert (magic, version, device_id) == (R.MAGIC, 2, 4)
        assert status == 0xB                      # FEATURES_OK accepted
        # The device writes the used ring first and raises the notification after it
        # (virtio 1.2, 2.7.14), so a driver that polls used.idx, as this one does, may
        # read INTERRUPT_STATUS in between; the bit must be up once the VM is done (the
        # guest never acks it).
        del int_status
        assert machine.rng is not None
        assert machine.rng.device.registers.interrupt_status & R.INT_USED_BUFFER
        assert used_idx & 0xFFFF == 1
        _, used_len = struct.unpack_from("<II", machine.memory.read(USED + 4, 8))
        assert used_len == 64
        assert len(set(machine.memory.read(BUF, 64))) > 8
        # The notification came through the ioeventfd, not a QueueNotify exit.
        notify_exits = sum(n for (bus, addr), n in machine.vcpus[0].io_exits.items()
                           if bus == "mmio")
        assert notify_exits == len([op for op in _rng_script().ops if op[0] in (1, 2)
                                    and op[1] >= VIRTIO_MMIO_BASE]) - 1
        assert machine.exit_profile()["irqs"][5] >= 1


def test_descriptor_outside_guest_memory_is_a_device_error_not_a_crash() -> None:
    from tests.kvm.tinyguest import script_machine

    base = VIRTIO_MMIO_BASE
    s = _driver_setup(Script(), base).write32(base + R.REG_QUEUE_NOTIFY, 0)
    s.wait16_change(0x500000, 0)   # never changes: the host ends the VM below
    machine, rec = script_machine(s, rng=True)
    with machine:
        _publish(machine, 0x7FFF_F000_0000, 64)   # far outside the 64 MiB of RAM
        machine.start()
        assert machine.rng is not None
        transport = machine.rng.device.registers
        from tests.kvm.tinyguest import wait_until
        assert wait_until(lambda: transport.status & STATUS_NEEDS_RESET)
        assert machine.exit is None               # the VM runs on
        assert machine.memory.read_u16(USED + 2) == 0
        machine.stop()
