"""The vmfork Python SDK: ``Controller`` (the REST API, forkd's method names) and
``Sandbox`` (E2B-shaped). Stdlib only; it never imports server or VMM code.

    from vmfork.client import Sandbox
    with Sandbox.create("numpy-warm") as sb:
        print(sb.commands.run("python3 -c 'print(1)'").stdout)
"""

from vmfork.client.controller import Controller, ControllerError, default_url
from vmfork.client.sandbox import (
    CommandExitError,
    CommandResult,
    CommandTimeout,
    EvalResult,
    Sandbox,
)

__all__ = ["CommandExitError", "CommandResult", "CommandTimeout", "Controller",
           "ControllerError", "EvalResult", "Sandbox", "default_url"]
