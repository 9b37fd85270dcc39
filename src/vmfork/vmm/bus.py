"""Address-range buses for port I/O and MMIO exits.

A device claims ``[base, base + length)`` on a bus; an exit at address ``a``
reaches the device that claims ``a`` with the offset ``a - base``. Ranges may not
overlap (``BusConflict`` at registration time, never a silent shadowing).

Unmapped accesses have one behaviour, on both buses, as on a PC's open bus:
**reads return all ones** (``0xff`` in every byte) **and writes are dropped**.
Each is counted (``Bus.unmapped_reads``/``unmapped_writes``) and the first few
of each address are logged (for at most ``_LOGGED_ADDRESSES`` addresses: the
addresses are the guest's choice), so a probing guest neither crashes the VMM nor
floods the log or grows it. Linux probes many legacy ports at boot and expects exactly this.

A device's handler runs on the vCPU thread that exited. A device shared with
other threads (an I/O thread, another vCPU) takes its own lock.

With the native core, the MMIO bus also keeps ``windows`` (``_core.MmioWindows``): the
machine adds each virtio device's register window there (``add_native``), and the
native vCPU loop serves it without calling ``read``/``write`` here.
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import Protocol

from vmfork.vmm.native import CORE_BUILT

if CORE_BUILT:
    from vmfork import _core

log = logging.getLogger(__name__)

_LOGGED_PER_ADDRESS = 3
_LOGGED_ADDRESSES = 256


class BusDevice(Protocol):
    def read(self, offset: int, size: int) -> bytes:
        """Return ``size`` bytes read at ``offset`` in the device's window."""
        ...

    def write(self, offset: int, data: bytes) -> None:
        """Handle a write of ``data`` at ``offset`` in the device's window."""
        ...


class BusConflict(ValueError):
    pass


class Bus:
    def __init__(self, name: str) -> None:
        self.name = name
        self._bases: list[int] = []
        self._ranges: list[tuple[int, int, BusDevice]] = []  # (base, length, device), by base
        self._lock = threading.Lock()
        self.unmapped_reads = 0
        self.unmapped_writes = 0
        self._logged: dict[int, int] = {}
        self.windows: _core.MmioWindows | None = _core.MmioWindows() if CORE_BUILT else None

    def register(self, base: int, length: int, device: BusDevice) -> None:
        if length <= 0:
            raise ValueError(f"{self.name}: empty range at {base:#x}")
        with self._lock:
            i = bisect.bisect_left(self._bases, base)
            if i > 0:
                pbase, plen, _ = self._ranges[i - 1]
                if pbase + plen > base:
                    raise BusConflict(f"{self.name}: {base:#x}+{length:#x} overlaps {pbase:#x}")
            if i < len(self._ranges) and base + length > self._ranges[i][0]:
                raise BusConflict(
                    f"{self.name}: {base:#x}+{length:#x} overlaps {self._ranges[i][0]:#x}")
            self._bases.insert(i, base)
            self._ranges.insert(i, (base, length, device))

    def find(self, addr: int) -> tuple[BusDevice, int] | None:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            base, length, device = self._ranges[i]
            if addr < base + length:
                return device, addr - base
        return None

    def _note_unmapped(self, kind: str, addr: int, size: int) -> None:
        seen = self._logged.get(addr, 0)
        if seen == 0 and len(self._logged) >= _LOGGED_ADDRESSES:
            return
        if seen < _LOGGED_PER_ADDRESS:
            self._logged[addr] = seen + 1
            log.debug("%s: unmapped %s of %d bytes at %#x", self.name, kind, size, addr)

    def read(self, addr: int, size: int) -> bytes:
        hit = self.find(addr)
        if hit is None:
            self.unmapped_reads += 1
            self._note_unmapped("read", addr, size)
            return b"\xff" * size
        device, offset = hit
        data = device.read(offset, size)
        if len(data) != size:  # a device bug must not turn into a short read for the guest
            data = (data + b"\xff" * size)[:size]
        return data

    def write(self, addr: int, data: bytes) -> None:
        hit = self.find(addr)
        if hit is None:
            self.unmapped_writes += 1
            self._note_unmapped("write", addr, len(data))
            return
        device, offset = hit
        device.write(offset, data)
