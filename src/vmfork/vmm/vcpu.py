"""vCPU threads: running the guest, and getting a vCPU back from it.

Each vCPU is one native thread on ``KVM_RUN`` (``vmfork._core.VcpuLoop``,
``native/src/vcpu.rs``, whose module comment says how kicking, pausing with an I/O
instruction half done and stopping work there). COM1 and the i8042 (``console``) and
the virtio-mmio register files (``mmio.windows``) it serves itself; it takes the GIL
only for what those hand back to Python, for other port and MMIO exits, which it
hands to the ``Bus`` objects, and for the one exit that ends it (reported to
``on_exit`` as a ``VcpuExitEvent``).

There is no Python vCPU loop any more (issue 19: one implementation of each piece);
a machine needs the native core (``vmm.native.require_core``).
"""

from __future__ import annotations

import atexit
import collections
import enum
import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from vmfork.vmm.bus import Bus
from vmfork.vmm.errors import StateError
from vmfork.vmm.native import CORE_BUILT

if CORE_BUILT:   # else no machine is made (Machine calls native.require_core first)
    from vmfork import _core


class VcpuRunState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


@dataclass(frozen=True)
class VcpuExitEvent:
    """A vCPU stopped running the guest for good, and why."""

    vcpu: int
    reason: str          # "reset", "shutdown", "system_event", "internal_error", "fail_entry", ...
    detail: str = ""


log = logging.getLogger(__name__)

# Native vCPU threads call into Python; none may still run when the interpreter
# finalises, so every live one is stopped at exit (a Machine left unclosed).
_live: weakref.WeakSet[Vcpu] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for vcpu in list(_live):
        vcpu.stop(1.0)


def _report(on_exit: Callable[[VcpuExitEvent], None], index: int, reason: str,
            detail: str) -> None:
    # A module function (not a bound method), so the native loop holds no
    # reference back to its Vcpu.
    if reason == "vmm_error":
        log.error("vcpu%d failed: %s", index, detail)
    on_exit(VcpuExitEvent(index, reason, detail))


class Vcpu:
    """vCPU ``index``, at ``position`` in the machine's VM core (``_core.VmCore``,
    which owns its descriptor: ``fd`` is for the state ioctls, never closed here)."""

    def __init__(self, index: int, core: _core.VmCore, position: int, pio: Bus, mmio: Bus,
                 on_exit: Callable[[VcpuExitEvent], None],
                 console: _core.Console | None = None) -> None:
        self.index = index
        self.fd = core.vcpu_fd(position)
        self.pio = pio
        self.mmio = mmio
        self.on_exit = on_exit
        self._loop = _core.VcpuLoop(core, position, pio, mmio,
                                    functools.partial(_report, on_exit, index), console,
                                    mmio.windows)
        _live.add(self)

    def start(self, paused: bool = False) -> None:
        self._loop.start(paused)

    def pause(self, timeout: float = 5.0) -> None:
        """Return once the vCPU is out of the guest and parked."""
        if not self._loop.pause(timeout):
            raise StateError(f"vcpu{self.index} did not pause within {timeout} s", op="pause")

    def resume(self) -> None:
        self._loop.resume()

    def stop(self, timeout: float = 5.0) -> None:
        self._loop.stop(timeout)

    def join(self, timeout: float | None = None) -> None:
        self._loop.join(timeout)

    @property
    def loop(self) -> _core.VcpuLoop:
        """The native loop (the control server pauses and resumes it without Python)."""
        return self._loop

    @property
    def state(self) -> VcpuRunState:
        return VcpuRunState(self._loop.state)

    @property
    def error(self) -> BaseException | None:
        return self._loop.error

    @property
    def exits(self) -> collections.Counter[str]:
        return collections.Counter(self._loop.exits())

    @property
    def io_exits(self) -> collections.Counter[tuple[str, int]]:
        return collections.Counter(self._loop.io_exits())

    def close(self) -> None:
        self._loop.close()
        _live.discard(self)
