"""The contract between a virtio transport and a virtio device back end.

The transport (``mmio.MmioTransport``) owns the register file, the feature
negotiation, the status state machine and the ``Virtqueue`` objects; a device
(``VirtioDevice`` subclass) owns what the queues carry. The device learns of
its queues only at ``activate`` (DRIVER_OK) and forgets them at ``reset``.

Threads. Every device method except ``read_config``/``write_config`` runs on
the VMM's I/O thread (the ``EventLoop``): the transport hands ``activate``,
``queue_notify`` and ``reset`` over with ``loop.call_soon``. A device may then
use the loop freely (``add_reader`` for its sockets) and needs no lock of its
own for queue work. Config space: a device whose config is plain bytes (it
overrides neither ``read_config`` nor ``write_config``) has its ``config_bytes``
copied into the transport's register file, which serves them itself; such bytes may
change only before the transport is made (a booted machine's volume disks go in
first), by the device's ``restore`` (the transport's follows it) or right before
``transport.notify_config_change()`` (which copies them again). Other devices' config
accesses come from the vCPU thread, with no transport lock held; they keep their
config immutable or guarded (the balloon's lock).

Errors. A device that finds the guest at fault raises ``GuestError`` out of
``queue_notify``, or, from work it started itself (a socket became readable),
calls ``interrupt.device_error(err)``. Either way the transport marks the
device DEVICE_NEEDS_RESET, raises a configuration-change interrupt, and calls
into the device no more until the driver resets it. ``_guarded`` is the
helper for the second case.

Snapshots. Each device has a plain-data ``*State`` dataclass; live resources
(fds, sockets, threads) are constructor arguments or rebuilt on restore, never
state. Queue state is saved by the transport, which owns the queues.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from vmfork.vmm.devices.virtio.queue import Virtqueue
from vmfork.vmm.errors import GuestError, HostError
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.memory import GuestMemory

if TYPE_CHECKING:  # the transport imports this module
    from vmfork.vmm.devices.virtio.mmio import NativeQueue

log = logging.getLogger(__name__)

VIRTIO_F_VERSION_1 = 1 << 32

# Device status bits (virtio 1.x, 2.1).
STATUS_ACKNOWLEDGE = 0x01
STATUS_DRIVER = 0x02
STATUS_DRIVER_OK = 0x04
STATUS_FEATURES_OK = 0x08
STATUS_DEVICE_NEEDS_RESET = 0x40
STATUS_FAILED = 0x80

# Device ids (virtio 1.x, 5).
DEVICE_ID_RNG = 4
DEVICE_ID_VSOCK = 19


class VirtioInterrupt(Protocol):
    """What the transport gives a device at activation to signal the driver."""

    def trigger(self) -> None:
        """Used-buffer notification: the device put chains on a used ring."""
        ...

    def trigger_config(self) -> None:
        """Configuration-change notification."""
        ...

    def device_error(self, err: GuestError) -> None:
        """The guest broke the protocol: set DEVICE_NEEDS_RESET, stop the device."""
        ...

    @property
    def failed(self) -> bool:
        """True once ``device_error`` was called (until the driver resets the device)."""
        ...

    def native_queue(self, index: int) -> NativeQueue | None:
        """What serving queue ``index`` natively needs (None: serve it in Python)."""
        ...


class VirtioDevice:
    """Base class of the device back ends. Subclasses set the class attributes."""

    device_type: int = 0
    queue_max_sizes: tuple[int, ...] = ()

    def __init__(self) -> None:
        # Feature bits the device offers; VERSION_1 is mandatory (no legacy interface).
        self.features: int = VIRTIO_F_VERSION_1
        self.acked_features: int = 0
        self.memory: GuestMemory | None = None
        self.queues: list[Virtqueue] = []
        self.interrupt: VirtioInterrupt | None = None

    @property
    def queue_count(self) -> int:
        return len(self.queue_max_sizes)

    @property
    def active(self) -> bool:
        return self.memory is not None

    @property
    def wants_ioeventfds(self) -> bool:
        """Whether its transport should give its queues ioeventfds now. A device that
        expects no notifications until something happens on the host (an empty volume
        slot, until a disk goes in: ``MmioTransport.add_ioeventfds``) says False, and
        a notification the guest sends meanwhile exits to the vCPU thread, which hands
        it on all the same."""
        return True

    # -- config space (see the module comment) -------------------------------------------
    def config_bytes(self) -> bytes:
        return b""

    def read_config(self, offset: int, size: int) -> bytes:
        """Bytes of the device-specific config space; zeros past its end."""
        cfg = self.config_bytes()
        return (cfg[offset:offset + size] + bytes(size))[:size]

    def write_config(self, offset: int, data: bytes) -> None:
        """Config space is read-only for every device we have: writes are dropped."""
        log.debug("%s: dropped config write at %#x", type(self).__name__, offset)

    # -- lifecycle (I/O thread) -----------------------------------------------------------------
    def activate(self, memory: GuestMemory, queues: list[Virtqueue],
                 interrupt: VirtioInterrupt) -> None:
        """DRIVER_OK: the queues are validated and ready; start serving them."""
        self.memory = memory
        self.queues = queues
        self.interrupt = interrupt

    def queue_notify(self, index: int) -> None:
        """The driver made buffers available on queue ``index``."""
        raise NotImplementedError

    def sync_queues(self) -> None:
        """Bring the ``Virtqueue`` objects' ring indices up to date, where native code
        owns them while the device is active (the transport calls it before ``save``,
        on the I/O thread). Nothing to do for a device served in Python."""

    def reset(self) -> None:
        """The driver reset the device: drop the queues and every in-flight request."""
        self.memory = None
        self.queues = []
        self.interrupt = None
        self.acked_features = 0

    # -- helpers for subclasses -------------------------------------------------------------
    def _usable(self) -> bool:
        return self.interrupt is not None and not self.interrupt.failed

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run device-initiated queue work, turning a guest fault into NEEDS_RESET."""
        if not self._usable():
            return
        try:
            work()
        except GuestError as err:
            assert self.interrupt is not None
            self.interrupt.device_error(err)


def run_on_loop(loop: EventLoop, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
    """Run ``fn`` on the loop thread and wait for its result (or run it here if we are it).

    Use it for anything that must not race with device work: saving device
    state for a snapshot, a device reset the driver expects to be complete.
    """
    if loop.in_loop_thread():
        return fn()
    done = threading.Event()
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001 -- re-raised in the caller's thread
            box["error"] = err
        finally:
            done.set()

    loop.call_soon(call)
    if not done.wait(timeout):
        raise HostError(f"I/O thread {loop.name} did not run {fn!r} within {timeout} s "
                        f"(is the loop started?)", op="run_on_loop")
    if "error" in box:
        raise box["error"]
    return box["result"]
