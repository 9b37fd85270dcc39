"""Test-host errors and the exit statuses they map to.

A command run through the test host may exit with any status 0-255, so the host's own
failures borrow the conventions that ``timeout(1)`` and ``docker run`` already taught
people, rather than inventing new numbers:

- ``124`` the ``--timeout`` expired (as ``timeout(1)``);
- ``125`` the test host itself failed: a package is missing, QEMU would not start, the
  guest kernel panicked, or ``/init`` failed before the command ran (as ``docker run``);
- ``126``/``127`` come from the shell inside: command not executable / not found;
- ``130``/``143`` the caller interrupted us with SIGINT/SIGTERM (QEMU is killed).
"""

from __future__ import annotations

STATUS_TIMEOUT = 124
STATUS_HOST_FAILED = 125
STATUS_SIGINT = 130
STATUS_SIGTERM = 143


class TesthostError(Exception):
    """The test host could not run the command; ``status`` is the exit status to report."""

    status = STATUS_HOST_FAILED
    __test__ = False  # the name starts with "Test"; keep pytest from collecting it

    def __init__(self, message: str, *, console_tail: str = "") -> None:
        super().__init__(message)
        self.console_tail = console_tail


class TesthostSetupError(TesthostError):
    """Something this machine lacks (a package, a kernel, a readable file): fix and retry."""


class TesthostBootError(TesthostError):
    """QEMU failed or the guest died (panic, init error) before reporting an exit status."""


class TesthostTimeout(TesthostError):
    """The command ran longer than the timeout; QEMU was killed."""

    status = STATUS_TIMEOUT
