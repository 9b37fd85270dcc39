"""The vmfork Python SDK: ``Controller`` (the REST API, forkd's method names) and
``Sandbox`` (E2B-shaped). Stdlib only; it never imports server or VMM code.

    from vmfork.client import Sandbox
    with Sandbox.create("numpy-warm") as sb:
        print(sb.commands.run("python3 -c 'print(1)'").stdout)

    async with await AsyncSandbox.create("numpy-warm") as sb:
        print((await sb.commands.run("uname -r")).stdout)
"""

from vmfork.client.controller import (
    Controller,
    ControllerError,
    Copy,
    Egress,
    ExecStream,
    ImageBuildFailed,
    default_url,
    egress_policy,
)
from vmfork.client.images import ImageInfo, ImageProgress
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

__all__ = ["AsyncCommandHandle", "AsyncSandbox", "CommandExitError", "CommandHandle",
           "CommandResult", "CommandTimeout", "Controller", "ControllerError", "Copy",
           "DirWatcher", "Egress", "EvalResult", "ExecStream", "ImageBuildFailed", "ImageInfo",
           "ImageProgress", "Process", "Pty", "Sandbox", "default_url", "egress_policy"]
