"""vCPU threads: running the guest, and getting a vCPU back from it.

Each vCPU is one Python thread looping on ``KVM_RUN`` (through ctypes, which
drops the GIL, so vCPUs run in parallel) and dispatching exits to the buses.

Getting a vCPU out of the guest -- to pause it for a snapshot, or to stop the
VM -- is the subtle part:

* A signal sent to the thread (``pthread_kill``) makes a blocked ``KVM_RUN``
  return ``EINTR``. The signal needs a handler (the default action of a
  real-time signal kills the process), installed once from the main thread.
* A signal that lands just *before* the thread enters ``KVM_RUN`` would be
  lost, so the kicker first sets ``kvm_run.immediate_exit = 1``: KVM then
  returns ``EINTR`` at once on the next entry. The kicker also re-kicks until
  the vCPU acknowledges (``pause`` waits on a condition with a short timeout).
* An exit for port or MMIO *input* is completed by KVM on the next ``KVM_RUN``
  (the value we put in the run page is copied into the guest register then),
  and string I/O advances RIP only then. Before acknowledging a pause we
  therefore enter ``KVM_RUN`` once more with ``immediate_exit = 1``: KVM finishes
  the pending instruction and returns without running guest code, so the
  captured state never has a half-done I/O instruction that a restored VM
  would replay.
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vmfork.kvm import api
from vmfork.vmm.bounded import BoundedCounter
from vmfork.vmm.bus import Bus
from vmfork.vmm.errors import StateError

log = logging.getLogger(__name__)

SIG_KICK = signal.SIGRTMIN + 2
KICK_RETRY_SECONDS = 0.02
_kick_installed = False


def install_kick_handler() -> None:
    """Install the no-op handler for the kick signal (main thread only, idempotent)."""
    global _kick_installed
    if _kick_installed:
        return
    if threading.current_thread() is not threading.main_thread():
        raise StateError("the vCPU kick handler must be installed from the main thread")
    signal.signal(SIG_KICK, lambda signum, frame: None)
    # Python sets SA_RESTART-free handlers (siginterrupt true) by default, which
    # is what lets KVM_RUN return EINTR; say so explicitly.
    signal.siginterrupt(SIG_KICK, True)
    _kick_installed = True


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


class Vcpu:
    def __init__(self, index: int, fd: int, mmap_size: int, pio: Bus, mmio: Bus,
                 on_exit: Callable[[VcpuExitEvent], None]) -> None:
        self.index = index
        self.fd = fd
        self.run_map, self.run = api.map_run(fd, mmap_size)
        self._run_view = memoryview(self.run_map)
        self.pio = pio
        self.mmio = mmio
        self.on_exit = on_exit
        # Fixed-size tables: exit reasons are few, but the ports and MMIO pages a guest
        # touches are its choice (a per-address Counter grew 46 MiB in 300k exits).
        self.exits: BoundedCounter[str] = BoundedCounter(64)
        self.io_exits: BoundedCounter[tuple[str, int]] = BoundedCounter(64)
        self.state = VcpuRunState.CREATED
        self._cond = threading.Condition()
        self._want_pause = False
        self._want_stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- control (any thread) -------------------------------------------------------
    def start(self, paused: bool = False) -> None:
        if not _kick_installed:
            install_kick_handler()  # raises unless on the main thread
        self._want_pause = paused
        self._thread = threading.Thread(target=self._loop, name=f"vcpu{self.index}", daemon=True)
        self._thread.start()

    def _kick(self) -> None:
        self.run.immediate_exit = 1
        thread = self._thread
        if thread is not None and thread.ident is not None and thread.is_alive():
            try:
                signal.pthread_kill(thread.ident, SIG_KICK)
            except ProcessLookupError:
                pass

    def pause(self, timeout: float = 5.0) -> None:
        """Return once the vCPU is out of the guest and parked."""
        with self._cond:
            # Asked first: a vCPU still PAUSED after a resume it has not woken up for
            # yet then stays parked (its wait loop sees the request again).
            self._want_pause = True
            if self.state in (VcpuRunState.PAUSED, VcpuRunState.STOPPED):
                return
            waited = 0.0
            while self.state not in (VcpuRunState.PAUSED, VcpuRunState.STOPPED):
                self._kick()
                self._cond.wait(KICK_RETRY_SECONDS)
                waited += KICK_RETRY_SECONDS
                if waited > timeout:
                    raise StateError(f"vcpu{self.index} did not pause within {timeout} s",
                                     op="pause")

    def resume(self) -> None:
        with self._cond:
            self._want_pause = False
            self._cond.notify_all()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._want_stop = True
            self._cond.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        deadline = timeout
        while thread.is_alive() and deadline > 0:
            self._kick()
            thread.join(KICK_RETRY_SECONDS)
            deadline -= KICK_RETRY_SECONDS

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop (vCPU thread) ------------------------------------------------------
    def _park_if_asked(self) -> bool:
        """Handle pause/stop requests; return False when the loop must end."""
        with self._cond:
            if self._want_stop:
                return False
            if not self._want_pause:
                return True
            # Complete any pending I/O instruction without running guest code.
            self.run.immediate_exit = 1
            api.run(self.fd)
            self.run.immediate_exit = 0
            self.state = VcpuRunState.PAUSED
            self._cond.notify_all()
            while self._want_pause and not self._want_stop:
                self._cond.wait()
            if self._want_stop:
                return False
            self.state = VcpuRunState.RUNNING
            return True

    def _loop(self) -> None:
        self.state = VcpuRunState.RUNNING
        try:
            while self._park_if_asked():
                if api.run(self.fd) < 0:
                    self.exits.add("intr")
                    self.run.immediate_exit = 0
                    continue
                if not self._handle_exit():
                    break
        except BaseException as err:  # report, never die silently
            log.exception("vcpu%d failed", self.index)
            self.error = err
            self.on_exit(VcpuExitEvent(self.index, "vmm_error", repr(err)))
        finally:
            with self._cond:
                self.state = VcpuRunState.STOPPED
                self._cond.notify_all()

    def _handle_exit(self) -> bool:
        run = self.run
        reason = run.exit_reason
        name = api.EXIT_NAMES.get(reason, "other")
        self.exits.add(name)
        if reason == api.EXIT_IO:
            io = run.exit.io
            port, size, off = io.port, io.size, io.data_offset
            self.io_exits.add(("pio", port))
            view = self._run_view
            for i in range(io.count):
                chunk = off + i * size
                if io.direction == api.EXIT_IO_OUT:
                    self.pio.write(port, bytes(view[chunk:chunk + size]))
                else:
                    view[chunk:chunk + size] = self.pio.read(port, size)
            return True
        if reason == api.EXIT_MMIO:
            mmio = run.exit.mmio
            length = min(mmio.len, 8)
            self.io_exits.add(("mmio", mmio.phys_addr & ~0xFFF))
            if mmio.is_write:
                self.mmio.write(mmio.phys_addr, bytes(mmio.data[:length]))
            else:
                data = self.mmio.read(mmio.phys_addr, length)
                for i in range(length):
                    mmio.data[i] = data[i]
            return True
        if reason in (api.EXIT_HLT, api.EXIT_IRQ_WINDOW_OPEN, api.EXIT_INTR):
            return True
        if reason == api.EXIT_SHUTDOWN:
            self.on_exit(VcpuExitEvent(self.index, "shutdown", "triple fault"))
            return False
        if reason == api.EXIT_SYSTEM_EVENT:
            kind = run.exit.system_event.type
            names = {api.SYSTEM_EVENT_SHUTDOWN: "poweroff", api.SYSTEM_EVENT_RESET: "reset",
                     api.SYSTEM_EVENT_CRASH: "crash"}
            self.on_exit(VcpuExitEvent(self.index, names.get(kind, "system_event"),
                                       f"system event {kind}"))
            return False
        if reason == api.EXIT_INTERNAL_ERROR:
            internal = run.exit.internal
            words = [hex(internal.data[i]) for i in range(min(internal.ndata, 16))]
            self.on_exit(VcpuExitEvent(self.index, "internal_error",
                                       f"suberror {internal.suberror} data {words}"))
            return False
        if reason == api.EXIT_FAIL_ENTRY:
            fail = run.exit.fail_entry
            self.on_exit(VcpuExitEvent(
                self.index, "fail_entry",
                f"hardware entry failure {fail.hardware_entry_failure_reason:#x}"))
            return False
        self.on_exit(VcpuExitEvent(self.index, "unhandled_exit", f"exit reason {name}"))
        return False

    def close(self) -> None:
        self._run_view.release()
        del self.run
        try:
            self.run_map.close()
        except BufferError:
            pass
