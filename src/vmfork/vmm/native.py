"""Whether the native core (``vmfork._core``) is here, and whether the VMM uses its
device paths; decided once.

The core is built by the set-up (scripts/lib.sh ``setup_native``) or by ``pip
install .``, not by importing: a source checkout that was never set up has none.
The vCPU loop, the console and the request paths of rng, the balloon, blk and net
have no Python twin any more, so a machine cannot run without it (``require_core``),
and those devices refuse guest memory without its native view. The pieces that still
have one (the virtqueue walk, the register file, vsock, the I/O loop) take it where
``VMFORK_NATIVE=0`` says so (to rule the core's paths out while chasing a bug); it is
read once, when the VMM's modules are imported. One module decides, so that guest memory, the virtqueues and the restore
never disagree about it.
"""

from __future__ import annotations

import os

from vmfork.vmm.errors import HostError

try:
    from vmfork import _core  # noqa: F401 -- that it imports is the question
    CORE_BUILT = True
except ImportError:
    CORE_BUILT = False
NATIVE = CORE_BUILT and os.environ.get("VMFORK_NATIVE", "1") != "0"


class CoreMissing(HostError):
    """A machine was asked for where the native core was never built."""


def require_core() -> None:
    """Raise ``CoreMissing``, saying how to build it, unless the core is here."""
    if not CORE_BUILT:
        raise CoreMissing(
            "the native core (vmfork._core) is not built, and a VM's vCPUs run on it: "
            "run the set-up (./scripts/demo or ./scripts/test; scripts/lib.sh setup_native "
            "alone needs Rust and cargo) or install the package with `pip install .`")
