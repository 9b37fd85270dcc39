"""An entry module with a ``native_child`` hook, for the zygote's choice between a child
that runs no Python and a Python one (no tests here).

The zygote imports it by name (``test_zygote_native_entries:python_child``) with
``tests/unit`` on its PYTHONPATH. The hook gives each spawn a one-vCPU real-mode machine
that halts forever (``_core.TinyMachinePlan``), or refuses a spawn whose args say
``refuse``; the zygote then runs ``python_child`` for it, which writes what it was
told to ``args["out"]`` and sleeps until killed.
"""

from __future__ import annotations

import functools
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
    """A tiny machine that halts forever; its hand-over answers with ``answer``, after
    the prelude (``prelude``) noted ``args["vm_id"]``. With its recipe, for a forker."""
    from vmfork import _core
    global _image
    if "refuse" in args:
        raise ValueError(args["refuse"])
    _image = args.get("image", 0)
    life_args: dict[str, Any] = dict(
        run_dir=args["run_dir"], vm_id=args["vm_id"], notify_path=None, start_gate=None,
        start_gate_timeout=60.0, jailed=False, ready_timeout=600.0, net_refresh=False)
    # No agent listens there: the child reports restored, then waits for none.
    agent = (os.path.join(args["run_dir"], "no-agent.sock"), None, 5.0, 30.0)
    life = _core.ChildLife(**life_args, seccomp=None, agent=_core.AgentTarget(*agent))
    handover = f"{__name__}:answer"
    prelude = [f"{__name__}:prelude", json.dumps([args["vm_id"]])]
    # ``bad_recipe``: a recipe no forker can build (its code is not hex), the objects
    # here being right: what a forker, or its spare, refuses.
    code = "zz" if "bad_recipe" in args else HALT_FOREVER.hex()
    return NativeChild(
        life, _core.TinyMachinePlan(HALT_FOREVER), handover,
        functools.partial(globals()["prelude"], args["vm_id"]),
        {"life": {**life_args, "seccomp": None, "agent": agent},
         "machine": {"tiny": {"code": code}}, "handover": handover,
         "prelude": prelude})


_noted: list[str] = []
_image = 0


def forker_image_key() -> int:
    """What a forker must have been cloned with (the zygote's forker hook): the last
    spawn's ``image`` arg, for the tests of when the zygote clones a new one."""
    return _image


def prelude(vm_id: str, opened: object) -> None:
    _noted.append(vm_id)


def answer(line: bytes, fd: int) -> bytes:
    """A handed-over line's answer: this process, what its prelude noted, the line."""
    return json.dumps({"ok": True, "profile": {"pid": os.getpid(), "noted": _noted,
                                               "line": line.decode()}}).encode() + b"\n"


def python_child(args: dict[str, Any]) -> int:
    out = Path(args["out"])
    out.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid(),
                                                   NATIVE_REFUSED: args.get(NATIVE_REFUSED)}))
    out.with_suffix(".tmp").rename(out)
    time.sleep(3600)
    return 0
