"""virtio-rng (device id 4): one request queue, filled from the host's getrandom(2).

The guest decides how large its buffers are, and a chain may describe up to
256 buffers of 4 GiB each; we fill at most ``MAX_BYTES_PER_REQUEST`` of it and
report that many bytes written (the driver accepts short fills), so a request
never makes us allocate more than that. Work per notification is bounded by
``MAX_REQUESTS_PER_NOTIFY``; if the guest has offered more, the rest is picked
up on a later loop turn rather than starving the other devices.

One implementation, native (``native/src/rng_serve.rs``), served by its native
transport on the queue's ioeventfd without the GIL (``devices/plan.py``). This module
keeps the bounds, the offer and the record.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmfork.vmm.devices.virtio.device import DEVICE_ID_RNG

MAX_BYTES_PER_REQUEST = 64 * 1024
MAX_REQUESTS_PER_NOTIFY = 64
QUEUE_SIZE = 256
# What the device offers: its id and its one queue's largest size.
DEVICE_TYPE = DEVICE_ID_RNG
QUEUE_MAX_SIZES = (QUEUE_SIZE,)


@dataclass
class RngState:
    """The device's record: its acked features (its queue is the transport's)."""

    acked_features: int
