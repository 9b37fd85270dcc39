"""Interrupt lines from devices to the in-kernel irqchip.

Each device owns an ``IrqLine``: an eventfd registered with ``KVM_IRQFD`` for a
GSI, so raising an interrupt is one ``write`` from any thread and never a VM
exit. The in-kernel IOAPIC treats irqfd injections as edge-triggered, which is
what virtio-mmio and our 8250 need (they re-raise on every new event).
"""

from __future__ import annotations

import os
from typing import Protocol


class Interrupt(Protocol):
    def trigger(self) -> None: ...


class IrqLine:
    def __init__(self, gsi: int) -> None:
        self.gsi = gsi
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.count = 0

    def trigger(self) -> None:
        fd = self.fd
        if fd < 0:  # closed: the machine is going away, nobody is listening
            return
        self.count += 1
        os.eventfd_write(fd, 1)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
