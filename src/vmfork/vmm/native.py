"""Whether the VMM uses the native core (``vmfork._core``), decided once.

The core is built by the set-up (scripts/lib.sh ``setup_native``) or by ``pip
install .``, not by importing: a source checkout that was never set up has none and
runs the Python paths. ``VMFORK_NATIVE=0`` takes the Python paths on purpose (to
compare the two, or to rule the core out while chasing a bug); it is read once, when
the VMM's modules are imported. One module decides, so that guest memory, the
virtqueues, the restore and the vCPU loop never disagree about it.
"""

from __future__ import annotations

import os

try:
    from vmfork import _core  # noqa: F401 -- that it imports is the question
    NATIVE = os.environ.get("VMFORK_NATIVE", "1") != "0"
except ImportError:
    NATIVE = False
