"""Interrupt lines from devices to the in-kernel irqchip.

Each device owns an ``IrqLine``: an eventfd registered with ``KVM_IRQFD`` for a
GSI, so raising an interrupt is one ``write`` from any thread and never a VM
exit. The in-kernel IOAPIC treats irqfd injections as edge-triggered, which is
what virtio-mmio and our 8250 need (they re-raise on every new event).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Protocol


class Interrupt(Protocol):
    def trigger(self) -> None: ...


class IrqLine:
    """One line: an eventfd a write to which raises the GSI. With ``connect`` (the
    machine's ``KVM_IRQFD`` for the GSI), the eventfd is made, and connected, at its
    first use instead: a volume slot that stays empty never raises its line, and a
    spawn then pays no eventfd and no ``KVM_IRQFD`` for it. KVM injects a count the
    eventfd already holds when it is connected, but none is ever written first: the
    fd is handed out only once connected."""

    def __init__(self, gsi: int, connect: Callable[[int], None] | None = None) -> None:
        self.gsi = gsi
        self._connect = connect
        self._fd: int | None = None   # None: not made yet; -1: closed
        self._made = threading.Lock()
        if connect is None:
            self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._count = 0
        # Native code that writes ``fd`` itself (rng served on the native loop) counts
        # its own triggers; ``count`` adds them in.
        self._native_counters: list[Callable[[], int]] = []

    @property
    def fd(self) -> int:
        """The eventfd (made and connected now if it was not yet); -1 once closed."""
        fd = self._fd
        if fd is not None:
            return fd
        with self._made:
            if self._fd is None:
                fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                try:
                    assert self._connect is not None
                    self._connect(fd)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            return self._fd

    @property
    def in_use(self) -> bool:
        """Whether the eventfd exists (a lazily connected line that was never used
        has none)."""
        return self._fd is not None and self._fd >= 0

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
        with self._made:
            fd, self._fd = self._fd, -1
        if fd is not None and fd >= 0:
            os.close(fd)
