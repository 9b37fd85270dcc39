"""The emulated KVM test host: run a command where ``/dev/kvm`` can run real guests.

The development and CI machines have a ``/dev/kvm`` that cannot run a Linux guest's
user space (shared/ENVIRONMENT.md). ``run_in_testhost`` runs a command inside a small
x86 host emulated by QEMU (TCG, AMD CPU with SVM) whose Debian kernel provides a real,
nested ``/dev/kvm``; the host sees this machine's ``/`` read-only under a RAM overlay
and the chosen paths writable. On a machine whose own KVM works the command simply
runs here, unchanged, so test scripts need not care where they are.

Where the command runs is decided in ``needs_emulation`` and nowhere else:

- inside the test host (``VMFORK_IN_TESTHOST=1``): here, directly;
- ``VMFORK_TESTHOST=never``: here; ``always``: emulated;
- ``auto`` (default): here if ``vmfork.kvm.probe.native_kvm_runs_guests()`` says this
  machine's KVM runs unmodified guests, else emulated (also if that probe is missing).

What the command sees: ``/`` of this machine read-only (9p, ``cache=loose``) under a
RAM overlay, so writes work and vanish; the ``rw_paths`` (default: the working
directory) writable through to this machine; a fresh tmpfs ``/tmp`` and ``/run`` (so
this machine's ``/tmp`` is hidden unless shared with ``rw_paths``); ``lo`` up; the
kernel's modules in ``/lib/modules`` (``modprobe tun`` works). QEMU's 9p server runs
as the caller, so run as root for a faithful view of root-owned files.

Measured here (2 noisy shared cores): boot to the command ~3 s, a whole
``vmfork testhost -- true`` ~4 s; ``python3 -c pass`` ~1 s inside, ``pytest --version``
~3 s. The cost is TCG, not 9p: ``cache=loose`` with ``msize=512000`` was the fastest
root mount (``none`` ~20-50 % slower, ``mmap``/``fscache`` 3-4x), and a copy of the
stdlib into tmpfs (10 s to make) imported no faster, so there is no copy option.

This package is test infrastructure: nothing in the product imports it.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Literal

from vmfork.paths import run_dir
from vmfork.testhost.environment import IN_TESTHOST, assignments, guest_environment
from vmfork.testhost.errors import (
    STATUS_HOST_FAILED,
    STATUS_SIGINT,
    STATUS_SIGTERM,
    STATUS_TIMEOUT,
    TesthostBootError,
    TesthostError,
    TesthostSetupError,
    TesthostTimeout,
)
from vmfork.testhost.initscript import CGROUP_LAYOUTS, CgroupLayout, Job

__all__ = [
    "DEFAULT_CPUS",
    "DEFAULT_MEM_MIB",
    "MODE_ENV",
    "STATUS_HOST_FAILED",
    "STATUS_SIGINT",
    "STATUS_SIGTERM",
    "STATUS_TIMEOUT",
    "Mode",
    "TesthostBootError",
    "TesthostError",
    "TesthostSetupError",
    "TesthostTimeout",
    "needs_emulation",
    "run_in_testhost",
]

DEFAULT_MEM_MIB = 4096
# One vCPU: QEMU 7.2's emulated SVM has let an interrupt from another vCPU through
# right after VMRUN, where the global interrupt flag must hold it off (the test
# host's KVM then faults on the guest's GS base: recursive page faults, a panic or
# a silent hang). Hosts with two vCPUs crashed that way in about half of the long
# runs; with one there are no cross-vCPU interrupts (docs/design-notes.md).
DEFAULT_CPUS = 1
MODE_ENV = "VMFORK_TESTHOST"
Mode = Literal["auto", "always", "never"]
_MODES: tuple[Mode, ...] = ("auto", "always", "never")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _native_kvm_runs_guests() -> bool:
    """The one call into ``vmfork.kvm``'s probe; without the probe, assume KVM cannot.

    The probe boots a throwaway VM (about 2 s here), and its answer cannot change until
    the machine reboots, so it is remembered per boot id in the run directory.
    """
    boot_id = _boot_id()
    memo = run_dir() / f"testhost-native-kvm-{boot_id}" if boot_id else None
    if memo is not None:
        try:
            return memo.read_text().strip() == "yes"
        except OSError:
            pass
    try:
        probe = importlib.import_module("vmfork.kvm.probe")
    except ImportError:
        return False
    answer = bool(probe.native_kvm_runs_guests())
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.write_text("yes\n" if answer else "no\n")
        except OSError:
            pass  # only a lost shortcut
    return answer


def needs_emulation(mode: Mode | None = None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a command must run in the emulated host (see the module docstring)."""
    if environ.get(IN_TESTHOST) == "1":
        return False
    chosen = mode if mode is not None else environ.get(MODE_ENV, "auto")
    if chosen not in _MODES:
        raise TesthostSetupError(
            f"{MODE_ENV}={chosen!r} is not one of {', '.join(_MODES)}")
    if chosen == "auto":
        return not _native_kvm_runs_guests()
    return chosen == "always"


def _run_here(argv: Sequence[str], cwd: str, env: Mapping[str, str],
              timeout: float | None) -> int:
    try:
        proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        print(f"vmfork testhost: {argv[0]}: command not found", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"vmfork testhost: {argv[0]}: permission denied", file=sys.stderr)
        return 126
    try:
        status = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise TesthostTimeout(
            f"the command did not finish within {timeout:g} s and was killed "
            "(raise --timeout)") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return 128 - status if status < 0 else status


def _resolve_rw_paths(rw_paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    resolved: list[str] = []
    for raw in rw_paths:
        path = os.path.realpath(raw)
        if not os.path.isdir(path):
            raise TesthostSetupError(f"writable share {os.fspath(raw)!r} is not a directory")
        if path == "/":
            raise TesthostSetupError("the whole root cannot be a writable share; name a directory")
        if path not in resolved:
            resolved.append(path)
    return resolved


def run_in_testhost(
    argv: Sequence[str],
    *,
    mem_mib: int = DEFAULT_MEM_MIB,
    cpus: int = DEFAULT_CPUS,
    rw_paths: Sequence[str | os.PathLike[str]] | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    pass_env: Sequence[str] = (),
    cwd: str | None = None,
    cgroup: CgroupLayout = "hybrid",
    mode: Mode | None = None,
    show_console: bool = False,
) -> int:
    """Run ``argv`` where KVM works and return its exit status (0-255).

    ``rw_paths``: directories the command may change on this machine (default: ``cwd``);
    the rest of the file system is read-only with writes kept in RAM until exit.
    ``timeout`` is in seconds for the whole run including boot (~4 s). ``env`` is the
    command's whole environment; by default it is this process's, whole when the
    command runs here and filtered by ``vmfork.testhost.environment`` when it runs in
    the test host. ``pass_env`` adds ``NAME`` or ``NAME=VALUE`` items on top (``--env``).
    Inside the test host ``VMFORK_IN_TESTHOST=1`` is always set. ``cgroup`` picks the
    emulated host's cgroup layout: ``hybrid`` (v1 memory controller + v2 at
    ``/sys/fs/cgroup/unified``, like the dev machines) or ``v2``.
    ``mode`` overrides ``$VMFORK_TESTHOST``. The command's stdout and stderr go to ours;
    its stdin is ``/dev/null``.

    Raises ``TesthostSetupError`` / ``TesthostBootError`` (``.status`` 125) when the test
    host cannot run the command, ``TesthostTimeout`` (``.status`` 124) on timeout.
    """
    if not argv:
        raise ValueError("run_in_testhost needs a command")
    if mem_mib < 256 or cpus < 1:
        raise ValueError(f"mem_mib={mem_mib} / cpus={cpus}: need at least 256 MiB and 1 CPU")
    if cgroup not in CGROUP_LAYOUTS:
        raise ValueError(f"cgroup={cgroup!r} is not one of {CGROUP_LAYOUTS}")
    workdir = os.path.realpath(cwd if cwd is not None else os.getcwd())
    caller = dict(env) if env is not None else dict(os.environ)
    # An explicit env is passed whole; the default one goes through the filter.
    guest_env = guest_environment(caller, [*caller, *pass_env] if env is not None else pass_env)
    if not needs_emulation(mode):
        return _run_here(argv, workdir, {**caller, **assignments(pass_env)}, timeout)

    # Imported here: the native path needs neither the image builder nor QEMU.
    from vmfork.testhost.initramfs import host_image
    from vmfork.testhost.qemu import run_emulated

    job = Job(argv=list(argv), cwd=workdir, env=guest_env,
              rw_paths=_resolve_rw_paths(rw_paths if rw_paths is not None else [workdir]),
              cgroup=cgroup)
    image = host_image()
    sys.stdout.flush()
    sys.stderr.flush()
    result = run_emulated(job, image, mem_mib=mem_mib, cpus=cpus, timeout=timeout,
                          show_console=show_console)
    return result.status
