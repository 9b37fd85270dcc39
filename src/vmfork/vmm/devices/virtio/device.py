"""What every virtio device shares: the feature bit and status bits the transport
checks (virtio 1.x, 2.1 and 6), the device ids, and ``run_on_loop``.

Every device and its transport are native (``native/src/transport.rs`` and the
``*_serve.rs`` servers; ``devices/plan.py`` says what each takes): the Python device
contract (``VirtioDevice``, the transport's ``activate``/``queue_notify``/``reset``
calls on the I/O thread) is deleted with the last Python device (session 22). A
device's record stays a plain ``*State`` dataclass in its module (``rng.py``,
``balloon.py``, ``vsock.py``, ``blk.py``, ``net.py``), the format both sides read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from vmfork.vmm.errors import HostError
from vmfork.vmm.eventloop import EventLoop

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
