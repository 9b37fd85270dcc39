"""Interrupt lines from devices to the in-kernel irqchip.

Each device owns an ``IrqLine``: an eventfd registered with ``KVM_IRQFD`` for a
GSI, so raising an interrupt is one ``write`` from any thread and never a VM
exit. The in-kernel IOAPIC treats irqfd injections as edge-triggered, which is
what virtio-mmio and our 8250 need (they re-raise on every new event).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol


class Interrupt(Protocol):
    def trigger(self) -> None: ...


class IrqLine:
    def __init__(self, gsi: int) -> None:
        self.gsi = gsi
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._count = 0
        # Native code that writes ``fd`` itself (rng served on the native loop) counts
        # its own triggers; ``count`` adds them in.
        self._native_counters: list[Callable[[], int]] = []

    @property
    def count(self) -> int:
        """Interrupts raised on this line (statistics)."""
        return self._count + sum(counter() for counter in self._native_counters)

    def add_native_counter(self, counter: Callable[[], int]) -> None:
        self._native_counters.append(counter)

    def remove_native_counter(self, counter: Callable[[], int]) -> None:
        """Stop asking ``counter``; what it counted so far stays in ``count``."""
        if counter in self._native_counters:
            self._native_counters.remove(counter)
            self._count += counter()

    def trigger(self) -> None:
        fd = self.fd
        if fd < 0:  # closed: the machine is going away, nobody is listening
            return
        self._count += 1
        os.eventfd_write(fd, 1)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
