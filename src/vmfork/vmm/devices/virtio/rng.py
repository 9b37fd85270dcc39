"""virtio-rng (device id 4): one request queue, filled from the host's getrandom(2).

The guest decides how large its buffers are, and a chain may describe up to
256 buffers of 4 GiB each; we fill at most ``MAX_BYTES_PER_REQUEST`` of it and
report that many bytes written (the driver accepts short fills), so a request
never makes us allocate more than that. Work per notification is bounded by
``MAX_REQUESTS_PER_NOTIFY``; if the guest has offered more, the rest is picked
up on a later loop turn rather than starving the other devices.

One implementation, native (``native/src/rng_serve.rs``); Python only owns it. Where
the transport can (the native loop, an irqfd), the queue is handed
at activation to a ``_core.RngQueue`` that the native loop serves on the queue's
ioeventfd without ever taking the GIL; it owns the ring indices until reset, and
``sync_queues`` copies them back for a snapshot. Where the transport cannot (no
ioeventfd or irqfd to hand over: the unit tests' bare transports, ``native_serve``
False), the same walk is entered per notification, ``GuestRam.serve_rng``. There is no
walk in Python any more: guest memory without its native view cannot be served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vmfork.vmm.devices.virtio.device import (
    DEVICE_ID_RNG,
    VirtioDevice,
    VirtioInterrupt,
)
from vmfork.vmm.devices.virtio.queue import Virtqueue
from vmfork.vmm.errors import GuestError, HostError, VirtqueueError
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.memory import GuestMemory

try:
    from vmfork import _core
except ImportError:
    pass

MAX_BYTES_PER_REQUEST = 64 * 1024
MAX_REQUESTS_PER_NOTIFY = 64
QUEUE_SIZE = 256


@dataclass
class RngState:
    """Plain-data twin of ``VirtioRng``: nothing to keep beyond the queue (transport state)."""

    acked_features: int


class VirtioRng(VirtioDevice):
    device_type = DEVICE_ID_RNG
    queue_max_sizes = (QUEUE_SIZE,)

    def __init__(self, loop: EventLoop, native_serve: bool = True) -> None:
        super().__init__()
        self.loop = loop
        # False keeps the walk entered per notification even where the loop could serve
        # the queue itself (the tests and bench/rng_notify.py compare the two entries).
        self.native_serve = native_serve
        self._bytes_served = 0
        self._server: _core.RngQueue | None = None
        self._detach_server: Callable[[], None] | None = None

    @property
    def serving_natively(self) -> bool:
        """Whether the native loop serves the queue without the GIL (this activation)."""
        return self._server is not None

    @property
    def bytes_served(self) -> int:
        if self._server is not None:
            return self._bytes_served + self._server.sync()[3]
        return self._bytes_served

    def activate(self, memory: GuestMemory, queues: list[Virtqueue],
                 interrupt: VirtioInterrupt) -> None:
        super().activate(memory, queues, interrupt)
        queue = queues[0]
        if not (self.native_serve and queue.ready and memory.native is not None):
            return
        native = interrupt.native_queue(0)
        if native is None:
            return
        self._server = _core.RngQueue(
            memory.native, native.registers, native.epoch,
            (queue.size, queue.desc_table, queue.avail_ring, queue.used_ring,
             queue.next_avail, queue.next_used),
            native.irq_fd, native.notify_fd, MAX_REQUESTS_PER_NOTIFY,
            MAX_BYTES_PER_REQUEST, self._native_fault)
        native.attach(self._server)
        self._detach_server = native.detach

    def _native_fault(self, err: BaseException) -> None:
        """The native server found a guest fault (on the loop thread, with the GIL)."""
        if self.interrupt is not None and isinstance(err, GuestError):
            self.interrupt.device_error(err)

    def sync_queues(self) -> None:
        if self._server is not None and self.queues:
            queue = self.queues[0]
            queue.next_avail, queue.next_used = self._server.sync()[:2]

    def reset(self) -> None:
        if self._server is not None:
            self._bytes_served += self._server.sync()[3]
            assert self._detach_server is not None
            self._detach_server()
        self._server, self._detach_server = None, None
        super().reset()

    def close(self) -> None:
        """Let go of the native server (after the transport's close): it holds
        duplicates of the queue's eventfds, and this device through ``on_error``."""
        if self._detach_server is not None:
            self._detach_server()
        self._server, self._detach_server = None, None

    def queue_notify(self, index: int) -> None:
        if index == 0:
            self._serve()

    def _serve(self) -> None:
        if not self._usable() or self.memory is None:
            return
        if self._server is not None:
            # A guest fault raises, as below. Without an ioeventfd to re-arm with, a
            # spent budget is picked up on a later loop turn, as below.
            if self._server.serve():
                self.loop.call_soon(lambda: self._guarded(self._serve))
            return
        memory, queue = self.memory, self.queues[0]
        if memory.native is None:
            raise HostError("virtio-rng is served only natively, and this guest memory has "
                            "no native view (is the native core built?)", op="rng serve")
        if not queue.ready:  # the driver never enabled it: no rings to walk
            raise VirtqueueError("pop from a queue that is not ready")
        queue.next_avail, queue.next_used, served, written = memory.native.serve_rng(
            queue.size, queue.desc_table, queue.avail_ring, queue.used_ring,
            queue.next_avail, queue.next_used, MAX_REQUESTS_PER_NOTIFY,
            MAX_BYTES_PER_REQUEST)
        self._bytes_served += written
        if served:
            assert self.interrupt is not None
            self.interrupt.trigger()
        if served == MAX_REQUESTS_PER_NOTIFY:
            self.loop.call_soon(lambda: self._guarded(self._serve))

    def save(self) -> RngState:
        return RngState(acked_features=self.acked_features)

    def restore(self, state: RngState) -> None:
        self.acked_features = state.acked_features
