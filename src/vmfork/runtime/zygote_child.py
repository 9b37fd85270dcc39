"""What a forked child does between ``fork()`` and its entry function.

The child contract, in the order the steps run (each has a reason):

1. **Wakeup fd off.** The zygote routes signals to its selector through
   ``signal.set_wakeup_fd``. The child inherits that setting at the C level; if it
   stayed, a signal in the child would write a byte into whatever file later gets
   that fd number. So it is the first thing undone.
2. **Die with the zygote.** ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel
   kill the child when its parent *thread* exits. The zygote is single-threaded,
   so that thread is the zygote itself. The race: the zygote can die between
   ``fork()`` and the ``prctl``; the child would then have been re-parented already
   and never get the signal. Hence the check right after: if ``getppid()`` is no
   longer the zygote's pid, the child exits at once. A jailed child is pid 1 of a
   PID namespace of its own (``jail.PidNamespaces``), where ``getppid()`` is 0: it
   checks the zygote's pidfd (inherited) instead, and, since the kernel spares a
   namespace's first process the signals it has no handler for, handles SIGTERM by
   exiting (128 + 15) until its entry installs its own handler.
3. **Own session.** ``setsid()`` makes the child a process-group (and session)
   leader, so ``kill`` can signal the child and anything it started with one
   ``killpg``, and a terminal's Ctrl-C reaches only the zygote, which shuts down in
   order.
4. **Signals as in a fresh interpreter.** The zygote forks with every signal
   blocked, so nothing sent to a new child (a kill right after spawn) can run the
   zygote's handlers, whose wakeup fd the child shares with the zygote. The child
   puts the handlers the zygote installed (SIGTERM, SIGINT) back to Python's
   start-up state (SIGTERM default, SIGINT raising KeyboardInterrupt), and only then
   empties the signal mask; pending signals are delivered at that point.
5. **OOM order.** ``oom_score_adj`` 1000 (``OOM_SCORE_ADJ``): when the host runs out
   of memory, the kernel kills VMMs (one sandbox each) before the zygote or the daemon
   (each holds every sandbox). A process may always raise its own score.
5b. **Cgroup.** If the spawn asked for a memory limit, the child writes its own pid
   into its group's ``cgroup.procs`` before it allocates anything of its own (v1
   charges do not follow a process that moves later).
6. **Fds.** stdin is ``/dev/null``; stdout and stderr go to ``args["log_path"]``
   (opened for append, created 0644) if given, else stay the zygote's. Every other
   fd is closed (``os.closerange`` uses close_range(2) on this kernel), so the
   zygote's listening socket, client connections, pidfds and epoll fd never leak
   into a child. The Python objects that wrapped them are still referenced by the
   zygote's frames below this one; those frames never unwind in the child (it
   always leaves through ``os._exit``) and the zygote calls ``gc.freeze()``, so no
   finalizer can close an fd number the entry has since reused.
7. **Jail** (only when the spawn asked for one: ``runtime/jail.py``). After the fds,
   since the log must be opened on the host's file system; before the entry, so no
   entry code runs with the zygote's privileges. A failure exits 71.
8. **Entry.** ``function(args)`` runs; ``current()`` gives it a ``ChildContext``.
   Its return value is the exit status (None is 0; an int must be 0-255). An
   exception prints its traceback to stderr (the log) and exits 70; a failure in
   steps 1-7 exits 71 with a message on stderr.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from vmfork.runtime import cgroups, jail, memphases, spawnprofile
from vmfork.runtime.zygote_protocol import EXIT_ENTRY_RAISED, EXIT_SETUP_FAILED

PR_SET_PDEATHSIG = 1
OOM_SCORE_ADJ = 1000
"""A VMM is the first process the OOM killer takes (the maximum; see step 5)."""
_libc = ctypes.CDLL(None, use_errno=True)

set_sigmask: Callable[[int, Iterable[int]], set[int]] = (
    importlib.import_module("_signal").pthread_sigmask)
"""``signal.pthread_sigmask`` without its wrapper, which turns the old mask it returns
into a set of ``Signals``, one enum lookup per signal: 62 of them after the zygote's
block-all, at each fork in the zygote and again in each child (the one profiled
cost of a child's set-up left in Python: ``bench/spawn_profile.py --cprofile``)."""

Entry = Callable[[dict[str, Any]], object]


@dataclass(frozen=True)
class ChildContext:
    """Facts about the running child, for its entry. Times are CLOCK_MONOTONIC ns."""

    vm_id: str
    zygote_pid: int
    forked_ns: int
    entry_started_ns: int
    cgroup: str | None
    jailed: bool = False
    """The child runs in a jail; its entry installs the seccomp filter once set up."""


_current: ChildContext | None = None


def current() -> ChildContext | None:
    """The context of this child, or None outside a zygote child."""
    return _current


def _fail(message: str) -> NoReturn:
    try:
        os.write(2, f"vmfork child: {message}\n".encode())
    finally:
        os._exit(EXIT_SETUP_FAILED)


def die_with_parent(parent_pid: int, parent_pidfd: int | None = None) -> bool:
    """SIGKILL this process when its parent dies; False if the parent is already gone.

    The check after the prctl closes the race where the parent died first (we were
    re-parented before the prctl, so the signal would never come). With
    ``parent_pidfd`` (the parent's pidfd, inherited) the check is that it is not yet
    readable: the first process of a PID namespace sees ``getppid()`` 0.
    """
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pidfd is not None:
        poller = select.poll()
        poller.register(parent_pidfd, select.POLLIN)
        return not poller.poll(0)
    return os.getppid() == parent_pid


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM's default action for the first process of a PID namespace, which the
    kernel spares signals it has no handler for (until the entry installs its own)."""
    os._exit(128 + signum)


def _setup(zygote_pid: int, cgroup: cgroups.ChildCgroup | None, log_path: str | None,
           zygote_pidfd: int | None = None) -> None:
    signal.set_wakeup_fd(-1)
    try:
        alive = die_with_parent(zygote_pid, zygote_pidfd)
    except OSError as err:
        _fail(f"{err.strerror}: {os.strerror(err.errno or 0)}")
    if not alive:
        os._exit(EXIT_SETUP_FAILED)  # the zygote died before the prctl; nobody to tell
    os.setsid()
    signal.signal(signal.SIGTERM, _terminate if zygote_pidfd is not None else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    set_sigmask(signal.SIG_SETMASK, ())
    try:
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write(str(OOM_SCORE_ADJ))
    except OSError as err:
        _fail(f"cannot set oom_score_adj: {err.strerror}")
    if cgroup is not None:
        try:
            cgroups.join(cgroup, os.getpid())
        except cgroups.CgroupError as err:
            _fail(str(err))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if log_path is not None:
        try:
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as err:
            _fail(f"cannot open log_path {log_path}: {err.strerror}")
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    os.closerange(3, 1 << 20)


def run_child(*, vm_id: str, zygote_pid: int, forked_ns: int, entry: Entry,
              args: dict[str, Any], cgroup: cgroups.ChildCgroup | None,
              log_path: str | None, jail_spec: jail.JailSpec | None = None,
              zygote_pidfd: int | None = None) -> NoReturn:
    """Set the child up (steps 1-6 above), run ``entry(args)`` and exit. Never returns.
    ``zygote_pidfd``: given when the child is the first process of a PID namespace of
    its own (a jailed one: ``jail.PidNamespaces``)."""
    global _current
    code = EXIT_SETUP_FAILED
    spawnprofile.start(forked_ns)
    run_dir = args.get("run_dir")
    memphases.record("forked", run_dir)
    try:
        if jail_spec is not None:
            # Before _setup closes the descriptors the joins need (the held empty
            # namespace; the host's root the sandbox's namespace is found from).
            try:
                if jail_spec.netns is None:
                    jail.join_empty_netns()
                else:
                    jail.join_sandbox_netns(jail_spec.netns)
            except OSError as err:
                _fail(str(err))
        _setup(zygote_pid, cgroup, log_path, zygote_pidfd)
        spawnprofile.mark("set_up")
        memphases.record("set_up", run_dir)
        if jail_spec is not None:
            try:
                jail.enter(jail_spec)
            except OSError as err:
                _fail(str(err))
            spawnprofile.mark("jailed")
            memphases.record("jailed", run_dir)
        _current = ChildContext(vm_id, zygote_pid, forked_ns, time.monotonic_ns(),
                                cgroup.name if cgroup else None, jail_spec is not None)
        code = EXIT_ENTRY_RAISED
        try:
            result = entry(args)
        except SystemExit as stop:
            result = stop.code if isinstance(stop.code, int) or stop.code is None else 1
            if not isinstance(stop.code, int) and stop.code is not None:
                print(stop.code, file=sys.stderr)
        if result is None:
            code = 0
        elif isinstance(result, int) and not isinstance(result, bool) and 0 <= result <= 255:
            code = result
        else:
            print(f"vmfork child {vm_id}: entry returned {result!r}; expected None or an "
                  "int exit status 0-255", file=sys.stderr)
            code = EXIT_ENTRY_RAISED
    except BaseException:  # noqa: BLE001 - the child must never unwind into the zygote
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
