"""The vmfork Python SDK: ``Controller`` (the REST API, forkd's method names) and
``Sandbox`` (E2B-shaped). It speaks HTTP through httpx and never imports server or
VMM code.

    from vmfork.client import Sandbox
    with Sandbox.create("numpy-warm") as sb:
        print(sb.commands.run("python3 -c 'print(1)'").stdout)

    async with await AsyncSandbox.create("numpy-warm") as sb:
        print((await sb.commands.run("uname -r")).stdout)

The names that need the HTTP client are loaded on first use (PEP 562), so a module
that only catches ``ControllerError`` (every CLI command) does not import httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vmfork.client.errors import ControllerError, ImageBuildFailed
from vmfork.client.images import ImageInfo, ImageProgress

if TYPE_CHECKING:
    from vmfork.client.controller import (
        Controller,
        Copy,
        Egress,
        ExecStream,
        default_url,
        egress_policy,
    )
    from vmfork.client.sandbox import (
        AsyncCommandHandle,
        AsyncSandbox,
        CommandExitError,
        CommandHandle,
        CommandResult,
        CommandTimeout,
        DirWatcher,
        EvalResult,
        Process,
        Pty,
        Sandbox,
    )

_LAZY = {name: "vmfork.client.controller" for name in
         ("Controller", "Copy", "Egress", "ExecStream", "default_url", "egress_policy")}
_LAZY |= {name: "vmfork.client.sandbox" for name in
          ("AsyncCommandHandle", "AsyncSandbox", "CommandExitError", "CommandHandle",
           "CommandResult", "CommandTimeout", "DirWatcher", "EvalResult", "Process", "Pty",
           "Sandbox")}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vmfork.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["AsyncCommandHandle", "AsyncSandbox", "CommandExitError", "CommandHandle",
           "CommandResult", "CommandTimeout", "Controller", "ControllerError", "Copy",
           "DirWatcher", "Egress", "EvalResult", "ExecStream", "ImageBuildFailed", "ImageInfo",
           "ImageProgress", "Process", "Pty", "Sandbox", "default_url", "egress_policy"]
