"""Which of the caller's environment variables the command sees inside the test host.

The command runs in another kernel, so the caller's environment cannot simply be
inherited; it is written into the per-run job script. We pass a documented allowlist
rather than everything, because much of a desktop or CI environment points at things
that do not exist inside the test host and would mislead programs there
(``SSH_AUTH_SOCK``, ``DISPLAY``, ``DBUS_SESSION_BUS_ADDRESS``, ``XDG_RUNTIME_DIR`` name
sockets of this machine; ``LD_PRELOAD`` could break every process in the chroot).

The rule: a variable passes if its name is in ``PASS_NAMES`` or starts with one of
``PASS_PREFIXES``; ``--env NAME`` passes one more by name, ``--env NAME=VALUE`` sets
one. ``VMFORK_IN_TESTHOST=1`` is always set last, so it cannot be overridden.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

PASS_NAMES: frozenset[str] = frozenset({
    # the basics every program expects
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "TMPDIR",
    "LANG", "LANGUAGE", "COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR",
    # where tools keep state; these name directories of the shared file system
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "VIRTUAL_ENV",
    # CI detection (pytest and others change their output under CI)
    "CI",
})
PASS_PREFIXES: tuple[str, ...] = (
    "LC_",        # locale categories
    "PYTHON",     # PYTHONPATH, PYTHONDONTWRITEBYTECODE, PYTHONHASHSEED, ...
    "PYENV",      # pyenv shims need PYENV_ROOT / PYENV_VERSION to pick the same python
    "PYTEST_",    # PYTEST_ADDOPTS, PYTEST_XDIST_*
    "VMFORK_",    # our own knobs (VMFORK_CACHE_DIR, ...)
)
IN_TESTHOST = "VMFORK_IN_TESTHOST"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def passes(name: str) -> bool:
    """Whether the default rule passes the variable ``name``."""
    return name in PASS_NAMES or name.startswith(PASS_PREFIXES)


def assignments(extra: Iterable[str]) -> dict[str, str]:
    """The ``NAME=VALUE`` items of ``extra`` as a dict (``NAME``-only items are skipped)."""
    result: dict[str, str] = {}
    for item in extra:
        name, sep, value = item.partition("=")
        if not _NAME.match(name):
            raise ValueError(f"--env {item!r}: {name!r} is not a valid variable name")
        if sep:
            result[name] = value
    return result


def guest_environment(caller: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """The environment of the command inside the test host.

    ``extra`` holds ``--env`` arguments: ``NAME`` (pass the caller's value, if any) or
    ``NAME=VALUE``. Raises ``ValueError`` for a name a shell could not export.
    """
    env = {name: value for name, value in caller.items() if passes(name) and _NAME.match(name)}
    for item in extra:
        name, sep, value = item.partition("=")
        if not _NAME.match(name):
            raise ValueError(f"--env {item!r}: {name!r} is not a valid variable name")
        if sep:
            env[name] = value
        elif name in caller:
            env[name] = caller[name]
    env[IN_TESTHOST] = "1"
    return env
