"""An entry module with a ``native_child`` hook, for the zygote's choice between a child
that runs no Python and a Python one (no tests here).

The zygote imports it by name (``test_zygote_native_entries:python_child``) with
``tests/unit`` on its PYTHONPATH. The hook gives each spawn a one-vCPU real-mode machine
that halts forever (``_core.TinyMachinePlan``), or refuses a spawn whose args say
``refuse``; the zygote then runs ``python_child`` for it, which writes what it was
told to ``args["out"]`` and sleeps until killed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from vmfork.runtime.jail import JailSpec
from vmfork.runtime.zygote_child import NATIVE_REFUSED, NativeChild

# Real mode, interrupts off: hlt; jmp back to it.
HALT_FOREVER = bytes.fromhex("f4" "ebfd")

ZYGOTE_ENTRIES = ("python_child",)


def native_child(args: dict[str, Any], jail_spec: JailSpec | None) -> NativeChild:
    from vmfork import _core
    if "refuse" in args:
        raise ValueError(args["refuse"])
    life = _core.ChildLife(
        run_dir=args["run_dir"], vm_id=args["vm_id"], notify_path=None, start_gate=None,
        start_gate_timeout=60.0, seccomp=None, jailed=False,
        # No agent listens there: the child reports restored, then waits for none.
        agent=_core.AgentTarget(os.path.join(args["run_dir"], "no-agent.sock"), None, 5.0,
                                30.0),
        ready_timeout=600.0, net_refresh=False)
    return NativeChild(life, _core.TinyMachinePlan(HALT_FOREVER), "json:dumps")


def python_child(args: dict[str, Any]) -> int:
    out = Path(args["out"])
    out.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid(),
                                                   NATIVE_REFUSED: args.get(NATIVE_REFUSED)}))
    out.with_suffix(".tmp").rename(out)
    time.sleep(3600)
    return 0
