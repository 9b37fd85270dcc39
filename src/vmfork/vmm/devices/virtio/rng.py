"""virtio-rng (device id 4): one request queue, filled from the host's getrandom(2).

The guest decides how large its buffers are, and a chain may describe up to
256 buffers of 4 GiB each; we fill at most ``MAX_BYTES_PER_REQUEST`` of it and
report that many bytes written (the driver accepts short fills), so a request
never makes us allocate more than that. Work per notification is bounded by
``MAX_REQUESTS_PER_NOTIFY``; if the guest has offered more, the rest is picked
up on a later loop turn rather than starving the other devices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vmfork.vmm.devices.virtio.device import DEVICE_ID_RNG, VirtioDevice
from vmfork.vmm.devices.virtio.queue import Virtqueue
from vmfork.vmm.errors import VirtqueueError
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.memory import GuestMemory

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

    def __init__(self, loop: EventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.bytes_served = 0

    def queue_notify(self, index: int) -> None:
        if index == 0:
            self._serve()

    def _serve(self) -> None:
        if not self._usable() or self.memory is None:
            return
        memory, queue = self.memory, self.queues[0]
        if memory.native is not None:
            if not queue.ready:  # as Virtqueue.pop says it
                raise VirtqueueError("pop from a queue that is not ready")
            queue.next_avail, queue.next_used, served, written = memory.native.serve_rng(
                queue.size, queue.desc_table, queue.avail_ring, queue.used_ring,
                queue.next_avail, queue.next_used, MAX_REQUESTS_PER_NOTIFY,
                MAX_BYTES_PER_REQUEST)
            self.bytes_served += written
        else:
            served = self._serve_python(memory, queue)
        if served:
            assert self.interrupt is not None
            self.interrupt.trigger()
        if served == MAX_REQUESTS_PER_NOTIFY:
            self.loop.call_soon(lambda: self._guarded(self._serve))

    def _serve_python(self, memory: GuestMemory, queue: Virtqueue) -> int:
        served = 0
        while served < MAX_REQUESTS_PER_NOTIFY:
            chain = queue.pop(memory)
            if chain is None:
                break
            want = min(chain.writable_len, MAX_BYTES_PER_REQUEST)
            written = chain.write_writable(memory, os.getrandom(want)) if want else 0
            queue.add_used(memory, chain.head, written)
            self.bytes_served += written
            served += 1
        return served

    def save(self) -> RngState:
        return RngState(acked_features=self.acked_features)

    def restore(self, state: RngState) -> None:
        self.acked_features = state.acked_features
