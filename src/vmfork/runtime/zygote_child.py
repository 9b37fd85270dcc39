"""What a forked child does between ``fork()`` and its entry function.

The zygote forks through ``fork`` (``_core.fork_single_threaded``), so the child
starts without CPython's after-fork work: no ``os.register_at_fork`` hook runs in it,
and the module-level ``random`` generator is the zygote's (nothing in a VMM draws from
it; its secrets come from ``os.urandom``).

The steps run natively (``native/src/child.rs``, whose doc comment gives each one's
reason), from a ``_core.ChildPlan`` the zygote built for this spawn before the fork
(``plan``), so that the child touches no Python object of the zygote's on its way to
the entry (each would be a copy-on-write page of its own). In the child, Python does
three things: switch the zygote's signal wakeup fd off (Python's state, not the
kernel's), call ``plan.set_up()`` and, when jailed, ``plan.enter_jail()`` (the
descriptors it opened registered by ``jail.adopt``), then the entry. The contract:

1. **Wakeup fd off** (``signal.set_wakeup_fd(-1)``, in Python): a signal in the child
   must never write a byte into whatever file later gets the zygote's fd number.
2. **Die with the zygote** (``PR_SET_PDEATHSIG``, then the parent check: ``getppid()``,
   or the zygote's pidfd for the first process of a PID namespace of its own,
   ``jail.PidNamespaces``). A child whose zygote is already gone exits 71 in silence.
3. **Own session** (``setsid``): one ``killpg`` reaches the child and what it started.
4. **Signals.** The zygote forks with every signal blocked, so nothing sent to a new
   child runs the zygote's handlers. SIGTERM and SIGINT get their default action (a
   PID namespace's first process, spared default-action signals by the kernel, a
   native SIGTERM handler exiting 128 + 15), until the entry installs its own; then
   the mask is emptied. Python's ``signal.getsignal`` still names the zygote's
   handlers (their C-level handler is gone, so they never run) until the entry calls
   ``signal.signal``. SIGINT terminates: a VMM has no terminal to be interrupted from.
5. **OOM order.** ``oom_score_adj`` 1000 (``OOM_SCORE_ADJ``): when the host runs out of
   memory, the kernel kills VMMs (one sandbox each) before the zygote or the daemon.
   **CPU order**: nice ``VMM_NICE`` (10 unless ``VMFORK_VMM_NICE`` says otherwise in
   the zygote's environment), inherited by every thread the VMM starts. A batch's
   guests all run at once, and without it they starved the processes that serve them:
   at N = 100 on one CPU the spawner saw the last child restored 44 s after it was
   (``bench/spawn_profile.py``'s timeline). The control plane runs at the nice it was
   started with. Where the cpu controller is on, the VMMs' groups share their parent
   group's weight against the control plane's group (``cgroups``), which the nice
   value, a ranking among one group's threads, does not change; it is what works
   where there is none (the emulated test host, a host without delegation).
5b. **Cgroup.** If the spawn asked for a memory limit, the child joins its group
   before it allocates anything of its own (v1 charges do not follow a later move).
6. **Fds.** stdin is ``/dev/null``; stdout and stderr go to ``args["log_path"]``
   (append, created 0644) if given, else stay the zygote's. Every other fd is closed
   (close_range(2)), so the zygote's sockets, pidfds and epoll fd never leak into a
   child. The Python objects that wrapped them are still referenced by the zygote's
   frames below this one; those frames never unwind in the child (it always leaves
   through ``os._exit``) and the zygote calls ``gc.freeze()``, so no finalizer can
   close an fd number the entry has since reused.
7. **Jail** (only when the spawn asked for one: ``runtime/jail.py``). After the fds,
   since the log must be opened on the host's file system; before the entry, so no
   entry code runs with the zygote's privileges. A jailed child joins its network
   namespace first of all, before step 6 closes the descriptors the join needs; so
   does an unjailed child given its sandbox's (``args["netns"]``), where its VMM
   attaches to the tap.
8. **Entry.** ``function(args)`` runs; ``current()`` gives it a ``ChildContext``.
   Its return value is the exit status (None is 0; an int must be 0-255). An
   exception prints its traceback to stderr (the log) and exits 70; a failure in
   steps 1-7 exits 71 (``EXIT_SETUP_FAILED``) with a message on stderr naming the
   step and its error.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from vmfork.runtime import cgroups, jail, memphases, spawnprofile
from vmfork.runtime.zygote_protocol import EXIT_ENTRY_RAISED, EXIT_SETUP_FAILED

if TYPE_CHECKING:
    from vmfork._core import ChildLife, ChildMachinePlan, ChildPlan, NativeFork, TinyMachinePlan

OOM_SCORE_ADJ = 1000
"""A VMM is the first process the OOM killer takes (the maximum; see step 5; set by
``native/src/child.rs``, named here for the tests)."""
NICE_ENV = "VMFORK_VMM_NICE"


def _vmm_nice(value: str | None) -> int:
    if value is None or value == "":
        return 10
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise SystemExit(f"{NICE_ENV} must be a nice value 0-19 (0: VMMs compete with the "
                         f"control plane as equals), got {value!r}")
    return nice


VMM_NICE = _vmm_nice(os.environ.get(NICE_ENV))
"""The nice value of every VMM this zygote forks (step 5; set by ``native/src/child.rs``).
Read once, in the zygote: a jailed child's environment is emptied."""
NATIVE_CHILD_ENV = "VMFORK_NATIVE_CHILD"
NATIVE_CHILD = os.environ.get(NATIVE_CHILD_ENV, "1") != "0"
"""Fork children that run no Python (``fork_native_batch``) for an entry that offers it
(``native_child``), unless ``VMFORK_NATIVE_CHILD=0`` (the way back to Python children
for every spawn). Read once, in the zygote. A spawn the hook refuses runs in a Python
child, saying why (``NATIVE_REFUSED``)."""
NATIVE_REFUSED = "native_refused"
"""The args key that tells a Python child why its spawn has no native child (set by the
zygote; absent where no native child was asked for)."""
set_sigmask: Callable[[int, Iterable[int]], set[int]] = (
    importlib.import_module("_signal").pthread_sigmask)
"""``signal.pthread_sigmask`` without its wrapper, which turns the old mask it returns
into a set of ``Signals``, one enum lookup per signal: 62 of them after the zygote's
block-all, at each fork in the zygote (a child empties its mask natively)."""

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


def die_with_parent(parent_pid: int) -> bool:
    """SIGKILL this process when its parent dies; False if the parent is already gone
    (the zygote itself, under ``--parent-pid``; a child's set-up does the same
    natively). The check after the prctl closes the race where the parent died first
    (we were re-parented before the prctl, so the signal would never come)."""
    from vmfork import _core
    alive: bool = _core.die_with_parent(parent_pid)
    return alive


def fork() -> int:
    """``fork()`` for the zygote, without CPython's after-fork work in the child
    (``_core.fork_single_threaded``: why it is sound for a one-thread zygote, what the
    child does without it, and the check at every fork): 0 in the child, its pid in
    the zygote. ``RuntimeError`` if the process has another thread."""
    from vmfork import _core
    pid: int = _core.fork_single_threaded()
    return pid


@dataclass(frozen=True)
class NativeChild:
    """What a child forked by ``fork_native_batch`` runs instead of an entry, built by the
    entry module's ``native_child(args, jail_spec)`` in the zygote, before the fork."""

    life: ChildLife
    machine: ChildMachinePlan | TinyMachinePlan
    handover: str
    """``module:function``: the Python handler of the control lines the native server
    hands over (``ControlServer.handle_line``'s contract), resolved in the child at the
    first one, after ``PyOS_AfterFork_Child``."""
    prelude: Callable[..., object] | None = None
    """Called with the jail's descriptors (None unjailed) before the first hand-over
    (``vmmchild._native_prelude``: ``jail.adopt``, and what the hand-over needs to know
    of the spawn)."""
    recipe: dict[str, Any] | None = None
    """The same child as plain values, for a forker (``runtime/forker.py``; the keys of
    ``native/src/forker.rs``'s ``Recipe`` but ``plan`` and ``own_pid_namespace``, which
    the zygote adds): ``life`` (``ChildLife``'s arguments, ``agent`` as
    ``AgentTarget``'s, ``seccomp`` in hex), ``machine`` (``{"restored": {"snapshot":
    SnapshotMachinePlan.number, "child": for_child's arguments}}`` or ``{"tiny":
    {"code": hex}}``), ``handover``, and ``prelude`` as ``[module:function, JSON list
    of its arguments before the jail's descriptors]`` or None. None: this child can
    only be forked by the zygote itself."""


def native_fork(child_plan: ChildPlan, native: NativeChild,
                own_pid_namespace: int | None) -> NativeFork:
    """One child of ``fork_native_batch``: ``child_plan``'s set-up and jail, then
    ``native``. ``own_pid_namespace``: given (the zygote's, ``jail.PidNamespaces.own``),
    the child is the first process of a new PID namespace."""
    from vmfork import _core
    return _core.NativeFork(child_plan, native.life, native.machine, native.handover,
                            native.prelude, own_pid_namespace)


def fork_native_batch(forks: list[NativeFork]) -> tuple[list[int], BaseException | None]:
    """Fork each child of ``forks``, back to back, all natively; none returns into
    Python (``native/src/native_fork.rs``). The pids of those forked, in order, and the
    error that stopped the rest (``RuntimeError`` if the process has another thread, as
    ``fork``; ``OSError``), None if all were forked."""
    from vmfork import _core
    return _core.fork_native_batch(forks)


def plan(zygote_pid: int, cgroup: cgroups.ChildCgroup | None, log_path: str | None,
         jail_spec: jail.JailSpec | None, zygote_pidfd: int | None = None,
         netns: object = None, jail_base: tuple[int, int, str] | None = None) -> ChildPlan:
    """The ``_core.ChildPlan`` of one spawn, built by the zygote before the fork.
    ``zygote_pidfd``: given when the child is the first process of a PID namespace of
    its own (a jailed one: ``jail.PidNamespaces``). ``netns``: an unjailed child's
    sandbox network namespace (``/run/netns/<name>``), joined by its set-up (a jail's
    spec names its own). ``jail_base``: the batch's jail base the jail joins
    (``jail.KeptBases``). Raises ``JailError`` for a jail no child could build, or a
    namespace name no sandbox has."""
    return plan_of(plan_args(zygote_pid, cgroup, log_path, jail_spec, zygote_pidfd, netns,
                             jail_base))


def plan_of(args: dict[str, Any]) -> ChildPlan:
    """The ``_core.ChildPlan`` of ``plan_args``'s arguments."""
    from vmfork import _core
    return _core.ChildPlan(error=jail.JailError, **args)


def plan_args(zygote_pid: int, cgroup: cgroups.ChildCgroup | None, log_path: str | None,
              jail_spec: jail.JailSpec | None, zygote_pidfd: int | None = None,
              netns: object = None, jail_base: tuple[int, int, str] | None = None
              ) -> dict[str, Any]:
    """``plan``'s ``ChildPlan`` arguments but ``error``, as plain values (a forker
    builds the plan from them: ``runtime/forker.py``); its refusals."""
    set_up = (zygote_pid, zygote_pidfd,
              [str(path / "cgroup.procs") for path in cgroup.paths] if cgroup else [],
              log_path, VMM_NICE)
    if jail_spec is not None:
        return jail.plan_args(jail_spec, set_up, base=jail_base)
    # The namespace is looked up from the host's root, as a jail's: a zygote in a mount
    # namespace of its own may not see a sandbox's namespace made after it started.
    return dict(set_up=set_up, netns=None if netns is None else jail.check_netns(netns),
                host_root=None if netns is None else jail.host_root_plan())


def run_child(*, vm_id: str, zygote_pid: int, forked_ns: int, entry: Entry,
              args: dict[str, Any], cgroup: cgroups.ChildCgroup | None,
              child_plan: ChildPlan, jail_spec: jail.JailSpec | None = None) -> NoReturn:
    """Set the child up (steps 1-7 above, ``child_plan``: ``plan``), run ``entry(args)``
    and exit. Never returns."""
    global _current
    code = EXIT_SETUP_FAILED
    spawnprofile.start(forked_ns)
    run_dir = args.get("run_dir")
    memphases.record("forked", run_dir)
    try:
        signal.set_wakeup_fd(-1)
        child_plan.set_up()   # a failed step exits 71 from there
        spawnprofile.mark("set_up")
        memphases.record("set_up", run_dir)
        if jail_spec is not None:
            try:
                opened = child_plan.enter_jail()
            except OSError as err:
                _fail(str(err))
            jail.adopt(jail_spec, opened)
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
