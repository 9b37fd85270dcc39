"""Whether the native core (``vmfork._core``) is here; decided once.

The core is built by the set-up (scripts/lib.sh ``setup_native``) or by ``pip
install .``, not by importing: a source checkout that was never set up has none.
The vCPU loop, the console, the virtqueue walk, the virtio-mmio register file, the
I/O loop and the request paths of rng, the balloon, blk, net and vsock have no Python
twin, so a machine cannot run without it (``require_core``), and those devices refuse
guest memory without its native view. There is no switch to turn the core off: the
modules only ask whether it imported, so that one without it can still be imported
and report what is missing (``vmfork doctor``).
"""

from __future__ import annotations

from vmfork.vmm.errors import HostError

try:
    from vmfork import _core  # noqa: F401 -- that it imports is the question
    CORE_BUILT = True
except ImportError:
    CORE_BUILT = False


class CoreMissing(HostError):
    """A machine was asked for where the native core was never built."""


def require_core() -> None:
    """Raise ``CoreMissing``, saying how to build it, unless the core is here."""
    if not CORE_BUILT:
        raise CoreMissing(
            "the native core (vmfork._core) is not built, and a VM's vCPUs run on it: "
            "run the set-up (./scripts/demo or ./scripts/test; scripts/lib.sh setup_native "
            "alone needs Rust and cargo) or install the package with `pip install .`")
