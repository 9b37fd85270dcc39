"""The VMM process of one sandbox: restore a snapshot, make the guest unique, serve.

Runs as the entry of a process forked by the zygote (``runtime.zygote``), so the
imports are already done and a spawn pays only for the restore. Contract:

* ``args``: ``snapshot_dir`` (holds ``state.bin`` and ``memory.bin``, or for a diff
  snapshot ``memory.plan``: its chain's files mapped layer over layer),
  ``run_dir`` (this sandbox's private directory: ``vsock.sock``,
  ``control.sock``, ``console.log``, ``status.json``), ``vm_id``,
  ``mem_mib``/``vcpus`` (checked against the snapshot).
* The guest is restored and resumed, then made a new machine: the host mixes
  fresh bytes into the guest kernel's CRNG and the agent's ``random``, and sets
  its wall clock -- two children of one snapshot must never share random
  streams or a stale clock.
* ``status.json`` is written atomically at each stage (``restored``, ``ready``
  with timings, or ``failed`` with the reason), each saying which child wrote it
  (``child``: ``"python"`` here, ``"native"`` for a ``native_child``) and, for a
  spawn the zygote could not give a native child, why (``native_refused``); the
  spawner reads it. If
  ``args["notify_path"]`` names a FIFO, one line ``<vm_id> <state>`` is written
  to it after each status change, so the spawner need not poll every file.
* If ``args["start_gate"]`` names a FIFO (a batch spawn), the child restores
  everything, reports ``prepared``, and starts its vCPUs only once it has read a
  byte from that FIFO: the spawner writes them when every sibling is prepared,
  so guests that already run do not take the CPU from siblings still restoring
  (which would delay the batch's last restore).
  It waits at most ``start_gate_timeout`` seconds, and not at all if the gate
  is gone: a guest is never held back for a spawner that went away. The time
  waited is reported as ``start_wait_s`` and is not part of ``restore_s``.
* The snapshot is decoded and its ioctl buffers built once, in the zygote
  (``prefork``), and inherited by every child forked after it; a child checks
  that ``state.bin`` is still the file that was decoded, and otherwise (or if
  the zygote could not decode it) reads it itself and reports what is wrong.
* A diff snapshot's RAM (its base with every run of its memory plan mapped over it)
  is mapped once in the zygote too (``premap_memory``, read-only, never touched
  there) and inherited only by the children of that snapshot, which adopt it as
  their RAM (copy-on-write, each its own) once its files are checked to be the ones
  mapped; any mismatch or failure and the child maps the plan itself, as before. A
  child that runs no Python (``native_child``) adopts it natively, as the zygote
  checked it at this batch's ``premap_memory`` (``inherited_ram``); without a premap
  its spawn runs in a Python child (it maps no plan run itself).
* ``netns``/``net_tap`` (optional): the child's network namespace, entered before
  anything else, and the tap in it that its virtio-net device attaches to. A
  restored guest with a network device is told it was forked (``net_refresh``:
  inherited connections aborted, neighbours flushed) once it answers.
* A guest booted on a read-only root disk is restored on the disk its state names
  by content key, found in the image cache (``vmfork.image.disk_path``); the
  machine checks that its size is the one recorded.
* ``volumes`` (optional): ``runtime.volumes.PreparedVolume`` documents. Those whose
  key a slot of the snapshot holds are that slot's disk (a read-write volume's file
  has no other way to be found; a read-only one not listed is found in the volume
  cache by its key); the others go into the snapshot's empty slots, lowest first,
  once the guest runs, and the agent mounts each (``attach_volumes``). A volume that
  cannot be attached or mounted fails the sandbox: it never runs without a volume it
  was asked for. A native child (``native_child``) takes the same volumes, placed the
  same way (``_child_volumes``): its machine restores a read-write volume's slot on
  the given file and a new volume's slot filled, announcing the change to the driver,
  and its agent mounts the new ones natively after ``after_fork``.
* ``control.sock`` takes JSON-lines requests (``runtime.control``): ``status``, ``pause``,
  ``resume``, ``snapshot`` (full, diff or live; see ``ControlServer.snapshot``),
  ``exits``, ``stop``.
* The process exits when the guest stops (status 0 for a clean stop, 3 when the
  guest died: panic, triple fault, KVM error -- the reason is in status.json and
  the console log), or on SIGTERM/SIGKILL from the spawner.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from vmfork.agent.client import (
    AgentClient,
    AgentError,
    AgentProtocolError,
    AgentTimeout,
    AgentUnavailable,
    vsock_uds_connector,
)
from vmfork.agent.protocol import AGENT_PORT
from vmfork.image import disk_path
from vmfork.kvm.api import KVM_PATH
from vmfork.ondisk.memplan import MAX_RUNS, PLAN_FILE, MemoryPlan, read_plan, snapshot_memory
from vmfork.ondisk.stateformat import read_state_file
from vmfork.runtime import control, jail, memphases, seccomp, spawnprofile, zygote_child
from vmfork.runtime.jail import JailSpec
from vmfork.runtime.volumes import PreparedVolume, volume_image_path
from vmfork.vmm.bounded import LogBudget, limit_log_handlers
from vmfork.vmm.capture import BASE_RESTORE, CaptureError, SnapshotTaker, tracking
from vmfork.vmm.devices import manager as devices
from vmfork.vmm.devices import serial
from vmfork.vmm.devices.plan import Plan, machine_plan, restore_plans
from vmfork.vmm.devices.virtio import vsock
from vmfork.vmm.devices.virtio.blk import SECTOR_SIZE, BlkState
from vmfork.vmm.devices.virtio.net import valid_tap_name
from vmfork.vmm.machine import Machine, MachineConfig, VolumeMedia
from vmfork.vmm.memory import PremappedRam
from vmfork.vmm.native import CORE_BUILT
from vmfork.vmm.native_view import NativeMachineView
from vmfork.vmm.vmstate import MachineState, PreparedRestore, prepare_restore

if TYPE_CHECKING:
    from vmfork._core import AgentTarget, ChildReporter
if CORE_BUILT:   # else no machine is made, and no control server (Machine needs the core)
    from vmfork import _core

log = logging.getLogger(__name__)
T = TypeVar("T")

ZYGOTE_ENTRIES = ("main",)
"""What the zygote may run of this module (see ``zygote.register_entries``)."""
_libc = ctypes.CDLL(None)

START_GATE_TIMEOUT = 300.0
READY_TIMEOUT = 120.0
CONNECT_TIMEOUT = vsock.CONNECT_TIMEOUT   # per connection: as long as the device waits
AGENT_IO_TIMEOUT = 60.0  # a call's whole reply (AgentClient's default io_timeout)
EXIT_GUEST_DIED = 3


# Decoded snapshots kept by the zygote (and inherited by its children), keyed by
# state.bin's path; at most this many, the oldest dropped first.
SNAPSHOTS_KEPT = 8


@dataclass(frozen=True)
class _LoadedSnapshot:
    # st_dev, st_ino, st_size, st_mtime_ns of state.bin; None: not cached
    identity: tuple[int, int, int, int] | None
    state: MachineState
    prepared: PreparedRestore
    # The natively served devices' plans (``plan.restore_plans``); None for records
    # that do not fit their device: the child's machine then says why.
    plans: dict[int, Plan] | None


_snapshots: dict[str, _LoadedSnapshot] = {}
# Decoded memory plans of diff snapshots, keyed by the plan file's path, with its
# identity (a plan is immutable once published; a changed identity is re-read).
_plans: dict[str, tuple[tuple[int, int, int, int], MemoryPlan]] = {}


def _identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def load_snapshot(snapshot_dir: str) -> tuple[MachineState, PreparedRestore]:
    """The decoded state of ``snapshot_dir`` and its ioctl buffers, from the cache when
    ``state.bin`` is unchanged (same inode, size and mtime), else read, checked and
    cached. Raises what ``read_state_file``/``prepare_restore`` raise for a bad file."""
    loaded = _load_snapshot(snapshot_dir)
    return loaded.state, loaded.prepared


def _load_snapshot(snapshot_dir: str) -> _LoadedSnapshot:
    """``load_snapshot``'s cache entry, its devices' plans with it."""
    path = os.path.join(snapshot_dir, "state.bin")
    try:
        before = _identity(path)
    except OSError:
        before = None
    cached = _snapshots.get(path)
    if cached is not None and cached.identity == before:
        return cached
    state = read_state_file(path, MachineState)
    prepared = prepare_restore(state)
    try:
        plans: dict[int, Plan] | None = restore_plans(state)
    except ValueError:
        plans = None
    loaded = _LoadedSnapshot(before, state, prepared, plans)
    # Cache only if the file did not change while it was read.
    if before is not None and _identity(path) == before:
        _snapshots.pop(path, None)
        _snapshots[path] = loaded
        while len(_snapshots) > SNAPSHOTS_KEPT:
            del _snapshots[next(iter(_snapshots))]
    return loaded


def load_memory(snapshot_dir: str) -> tuple[str, MemoryPlan | None]:
    """The memory file a restore of ``snapshot_dir`` maps and, for a diff snapshot,
    its memory plan (``ondisk.memplan``), decoded once per plan file (in the zygote,
    whose children inherit it) rather than once per spawn."""
    plan_path = os.path.join(snapshot_dir, PLAN_FILE)
    if os.path.exists(os.path.join(snapshot_dir, "memory.bin")):
        return snapshot_memory(snapshot_dir)       # flat (see snapshot_memory)
    try:
        identity = _identity(plan_path)
    except FileNotFoundError:
        return snapshot_memory(snapshot_dir)       # says what is missing
    cached = _plans.get(plan_path)
    if cached is not None and cached[0] == identity:
        plan = cached[1]
    else:
        plan = read_plan(plan_path)
        if _identity(plan_path) == identity:
            _plans.pop(plan_path, None)
            _plans[plan_path] = (identity, plan)
            while len(_plans) > SNAPSHOTS_KEPT:
                del _plans[next(iter(_plans))]
    return plan.source_path(0), plan


# Guest RAM of diff snapshots mapped in the zygote (``PremappedRam``), keyed by the
# plan file's path: the children restoring that snapshot inherit it and adopt it, so
# none of them maps the chain's runs itself. Bounded in count and in runs (each run is
# one or two VMAs in the zygote, and every fork walks every VMA, inherited or not).
# One plan's budget in all (~33k VMAs at most, half of vm.max_map_count's default):
# measured (bench/premap_fork_cost.py, natively) a fork of anyone else's snapshot
# then takes ~30 ms more, while each child of that plan saves ~250 ms of mmaps
# (in the emulated test host: ~60 ms against ~8.9 s).
PREMAP_RUNS_KEPT = MAX_RUNS


@dataclass
class _Premap:
    identity: tuple[int, int, int, int]   # the plan file's (see _identity)
    plan: MemoryPlan
    ram: PremappedRam
    inherited: bool = False
    """Copied into the children forked now (MADV_DOFORK): only for the batch's own
    snapshots. A child sees the value it had at its fork."""


_premaps: dict[str, _Premap] = {}


def _drop_premap(plan_path: str) -> None:
    entry = _premaps.pop(plan_path)
    entry.ram.release()


def _sources_unchanged(entry: _Premap) -> bool:
    """Every file the premap maps is still at its path, the same file."""
    try:
        return all(_identity(entry.plan.source_path(i)) == identity
                   for i, identity in enumerate(entry.ram.sources))
    except OSError:
        return False


def premap_memory(snapshot_dirs: set[str]) -> None:
    """Map the RAM of each diff snapshot of ``snapshot_dirs`` here, once (zygote, before
    a batch is forked), and let only that batch's children inherit it.

    A cached premap is dropped when its plan file or one of the files it maps changed
    or went away (checked at every batch: a deleted snapshot's files must not stay
    held open by a mapping), and the oldest ones when the cache is full. A plan that
    cannot be mapped is logged and left to the children, which map it as without a
    premap (and report the error, if it is one)."""
    for plan_path, kept in list(_premaps.items()):
        try:
            unchanged = _identity(plan_path) == kept.identity and _sources_unchanged(kept)
        except OSError:
            unchanged = False
        if not unchanged:
            _drop_premap(plan_path)
    wanted: set[str] = set()
    for snapshot_dir in sorted(snapshot_dirs):
        plan_path = os.path.join(snapshot_dir, PLAN_FILE)
        try:
            memory_file, plan = load_memory(snapshot_dir)
            if plan is None:
                if plan_path in _premaps:   # materialised since (memory.bin wins)
                    _drop_premap(plan_path)
                continue
            identity = _identity(plan_path)
        except Exception as err:  # noqa: BLE001 -- the children report it
            log.info("premap: %s not mapped: %s", snapshot_dir, err)
            continue
        entry = _premaps.get(plan_path)
        if entry is not None and entry.identity == identity and entry.plan is plan:
            _premaps[plan_path] = _premaps.pop(plan_path)   # most recently used last
            wanted.add(plan_path)
            continue
        if entry is not None:
            _drop_premap(plan_path)
        if len(plan.runs) > PREMAP_RUNS_KEPT:
            continue
        while _premaps and (len(_premaps) >= SNAPSHOTS_KEPT or len(plan.runs) + sum(
                e.ram.runs for e in _premaps.values()) > PREMAP_RUNS_KEPT):
            oldest = next((p for p in _premaps if p not in wanted), None)
            if oldest is None:
                break
            _drop_premap(oldest)
        try:
            ram = PremappedRam.map(memory_file, plan.mem_size, plan)
        except Exception as err:  # noqa: BLE001 -- each child maps it itself
            log.warning("premap: the RAM of %s not mapped ahead (each child maps it): %s",
                        snapshot_dir, err)
            continue
        _premaps[plan_path] = _Premap(identity, plan, ram)
        wanted.add(plan_path)
        log.info("premap: the RAM of %s mapped ahead (%d runs)", snapshot_dir, ram.runs)
    for plan_path, entry in list(_premaps.items()):
        inherited = plan_path in wanted
        if entry.inherited == inherited:
            continue
        try:
            entry.ram.set_inherited(inherited)
            entry.inherited = inherited
        except OSError as err:
            # DOFORK refused: not inherited, children map it. DONTFORK refused:
            # inherited, and the children of other snapshots unmap it.
            log.warning("premap: madvise of %s refused: %s", plan_path, err)


def inherited_premap(snapshot_dir: str, plan: MemoryPlan | None) -> PremappedRam | None:
    """In a forked child: the premapped RAM of ``snapshot_dir`` it inherited, if it maps
    ``plan`` (the plan file unchanged since), after unmapping every other premap it
    inherited (another snapshot of its batch): a child maps no more than its own RAM.
    ``GuestMemory.from_file_private`` checks the files before it adopts it.

    Premaps that were not inherited (MADV_DONTFORK) are not mapped here, and their
    addresses may be reused: they are left alone, and stay referenced (the child
    leaves through ``os._exit``, so nothing unmaps them at exit either)."""
    plan_path = os.path.join(snapshot_dir, PLAN_FILE)
    mine: PremappedRam | None = None
    for path, entry in _premaps.items():
        if not entry.inherited:
            continue
        entry.inherited = False   # whatever happens next, this process owns it
        try:
            ok = (path == plan_path and plan is not None and entry.plan is plan
                  and _identity(plan_path) == entry.identity)
        except OSError:
            ok = False
        if ok:
            mine = entry.ram
        else:
            entry.ram.release()
    return mine


_warmed_up: set[tuple[str, tuple[int, int, int, int]]] = set()


def prefork(batch: list[dict[str, Any]]) -> None:
    """Zygote hook, run before a batch is forked: decode each snapshot once here so
    every child inherits it (its ioctl buffers and its native devices' plans with it),
    and warm the restore path up on its first batch. A
    snapshot that cannot be loaded is left to the children, which report why. Then
    the RAM of each diff snapshot is mapped, once (``premap_memory``). The seccomp
    program of a jailed child is built here too (``seccomp.vmm_filter``), and the
    memory-phase probe warmed up when it is on (``memphases.warm_up``)."""
    snapshot_dirs = {str(args.get("snapshot_dir")) for args in batch}
    _prepare_child_ends(batch)
    for log_only in {bool(args.get("seccomp_log_only")) for args in batch}:
        seccomp.vmm_filter(log_only=log_only)   # built here once, inherited by each child
    memphases.warm_up()
    for snapshot_dir in snapshot_dirs:
        try:
            load_snapshot(snapshot_dir)
            key = (snapshot_dir, _identity(os.path.join(snapshot_dir, "state.bin")))
            if key not in _warmed_up:
                _warm_up_restore(snapshot_dir)
                _warmed_up.add(key)
        except Exception as err:  # noqa: BLE001 -- each child reports it
            log.info("prefork: %s not prepared: %s", snapshot_dir, err)
    premap_memory(snapshot_dirs)
    _batch_snapshots.clear()
    _batch_learners.clear()
    for snapshot_dir in snapshot_dirs if zygote_child.NATIVE_CHILD else ():
        try:
            _batch_snapshots[snapshot_dir] = _native_snapshot(snapshot_dir)
        except Exception:  # noqa: BLE001 -- native_child finds it again, and refuses
            continue
        if write_sets_wanted():
            _learn_write_set(_batch_snapshots[snapshot_dir].machine, snapshot_dir)


WRITE_SET_ENV = "VMFORK_WRITE_SET"
"""``0``: native children neither learn their snapshot's write set nor copy its pages
at their restore (``native/src/write_set.rs``)."""

WRITE_SET_FILE = "write-set.json"
"""Where a learner saves its write set, in its run directory (``write_set.rs``)."""

LEARNERS_KEPT = 16
"""The learners whose files the zygote looks for, the newest: one that died before
ready never writes its file, and the next batch of its snapshot names another."""

# The learners (``_is_learner``) by run directory, oldest first: each one's snapshot
# plan and directory, until its plan learns a set or its run directory goes.
_learners: dict[str, tuple[Any, str]] = {}
# The snapshots of the batch being forked that have a learner in it.
_batch_learners: set[str] = set()
# How many write sets this zygote learnt: part of the forker's image key, since a
# forker cloned before holds the plan without the set.
_write_sets_learnt = 0


def write_sets_wanted() -> bool:
    """Whether native children learn and copy their snapshot's write set: yes unless
    ``VMFORK_WRITE_SET=0``."""
    return os.environ.get(WRITE_SET_ENV) != "0"


def _learn_write_set(machine: Any, snapshot_dir: str) -> None:
    """Give ``machine`` (a snapshot's ``SnapshotMachinePlan``) the write set its newest
    learner saved at ready, if one has and the plan has none."""
    for run_dir, (learner_of, _) in reversed(list(_learners.items())):
        if learner_of is machine and _take_write_set(run_dir):
            return


def _take_write_set(run_dir: str) -> bool:
    """Give the learner's plan the set the learner in ``run_dir`` saved, if it saved
    one; whether its plan has a set now. A file that is not a valid set is logged,
    and its learner forgotten."""
    global _write_sets_learnt
    machine, snapshot_dir = _learners[run_dir]
    path = os.path.join(run_dir, WRITE_SET_FILE)
    if machine.write_set_pages is None:
        if not os.path.lexists(path):
            return False
        try:
            pages = machine.learn_write_set(path)
        except ValueError as err:
            log.warning("%s: the write set a learner saved is refused: %s", snapshot_dir, err)
            del _learners[run_dir]
            return False
        log.info("%s: write set learnt, %d pages (%s)", snapshot_dir, pages, path)
        _write_sets_learnt += 1
    for other in [d for d, (m, _) in _learners.items() if m is machine]:
        del _learners[other]
    return True


def run_dir_ending(run_dir: str) -> None:
    """Zygote hook, run before it removes an exited child's run directory: a learner's
    write set is taken now or never."""
    if run_dir in _learners:
        _take_write_set(run_dir)
        _learners.pop(run_dir, None)


def _is_learner(machine: Any, snapshot_dir: str, run_dir: str) -> bool:
    """Whether the child of ``snapshot_dir`` in ``run_dir`` saves its write set at ready:
    the first of its batch for a snapshot whose plan has none."""
    if (machine.write_set_pages is not None or snapshot_dir in _batch_learners
            or not write_sets_wanted()):
        return False
    _batch_learners.add(snapshot_dir)
    _learners[run_dir] = (machine, snapshot_dir)
    while len(_learners) > LEARNERS_KEPT:
        del _learners[next(iter(_learners))]
    return True


def _warm_up_restore(snapshot_dir: str) -> None:
    """Restore the snapshot here, into a VM that never runs, and close it again.

    CPython 3.11 rewrites a function's bytecode in place (quickening, inline
    caches) the first times it runs. Done here, once, those writes land in pages
    every child then shares; left to the children, each one copies those pages
    (measured: ~0.5 MiB less per child, and as many fewer copy-on-write faults).
    Nothing of it survives: the VM, its fds, mappings and I/O thread are gone
    before the zygote forks (it checks that it has one thread).
    """
    scratch = Path(tempfile.mkdtemp(prefix="vmfork-warm-up-"))
    try:
        machine, _ = restore(snapshot_dir, scratch, "warm-up")
        machine.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass(frozen=True)
class _ChildEnd:
    """What a child needs after its machine runs, as native values: where its status
    goes (``_core.ChildReporter``: status.json's paths and the FIFO's, as C strings)
    and where its agent is (``_core.AgentTarget``). Built by the zygote before the
    fork (``prefork``), so the child's reports and its handshake touch no Python
    object of their own (docs/native.md, "Nothing of Python's between fork and
    entry")."""

    reporter: ChildReporter
    agent: AgentTarget
    agent_args: tuple[str, int, float, float]
    """``agent``'s arguments (a forker's recipe carries them: ``runtime/forker.py``)."""


# The children of the batch being forked, by vm_id: replaced at every batch.
_child_ends: dict[str, _ChildEnd] = {}


def _child_end(args: dict[str, Any]) -> _ChildEnd:
    from vmfork import _core
    run_dir = str(args["run_dir"])
    notify = args.get("notify_path")
    agent_args = (os.path.join(run_dir, "vsock.sock"), AGENT_PORT, CONNECT_TIMEOUT,
                  AGENT_IO_TIMEOUT)
    return _ChildEnd(
        reporter=_core.ChildReporter(run_dir, str(args["vm_id"]),
                                     None if notify is None else str(notify)),
        agent=_core.AgentTarget(*agent_args), agent_args=agent_args)


def _prepare_child_ends(batch: list[dict[str, Any]]) -> None:
    _child_ends.clear()
    for args in batch:
        try:
            _child_ends[str(args["vm_id"])] = _child_end(args)
        except Exception as err:  # noqa: BLE001 -- the child builds it, or says why
            log.info("prefork: %s's reporter not prepared: %s", args.get("vm_id"), err)


NATIVE_HANDOVER = f"{__name__}:native_handover"


def native_child(args: dict[str, Any], jail_spec: JailSpec | None) -> zygote_child.NativeChild:
    """The zygote's hook for a child that runs no Python (the default; not with
    ``VMFORK_NATIVE_CHILD=0``; ``zygote_child.NativeChild``): ``main``'s steps from the
    filter on, as native values (``_core.ChildLife``), built before the fork from what
    ``prefork`` built (the agent's target, the snapshot's decoded state, the seccomp
    program). Raises for a spawn a native child cannot serve, which the zygote then
    gives a Python child (``main``, told why): a snapshot that does not load or that
    ``_snapshot_machine`` refuses, a diff snapshot whose RAM the zygote did not map
    ahead (``inherited_ram``), volumes that do not fit the snapshot's slots
    (``_child_volumes``)."""
    from vmfork import _core
    vm_id = str(args["vm_id"])
    end = _child_ends.get(vm_id) or _child_end(args)
    snapshot_dir = str(args["snapshot_dir"])
    snapshot = _batch_snapshots.get(snapshot_dir) or _native_snapshot(snapshot_dir)
    state = snapshot.state
    volumes, mounts = _child_volumes(state, args, jail_spec)
    jailed = jail_spec is not None
    notify, gate = args.get("notify_path"), args.get("start_gate")
    life_args: dict[str, Any] = dict(
        run_dir=str(args["run_dir"]), vm_id=vm_id,
        notify_path=None if notify is None else str(notify),
        start_gate=None if gate is None else str(gate),
        start_gate_timeout=float(args.get("start_gate_timeout", START_GATE_TIMEOUT)),
        jailed=jailed, ready_timeout=float(args.get("ready_timeout", READY_TIMEOUT)),
        net_refresh=state.device(devices.NET) is not None, mounts=mounts,
        profile=spawnprofile.MODE is not None,
        # A restored machine's RAM is its snapshot's file, mapped MAP_PRIVATE: what a
        # Python child's SnapshotTaker.bases says before its first capture.
        snapshot_bases=[(snapshot.base_tag, BASE_RESTORE)],
        snapshot_tracking=tracking(),
        learn_write_set=_is_learner(snapshot.machine, snapshot_dir, str(args["run_dir"])))
    program = seccomp.vmm_filter(log_only=bool(args.get("seccomp_log_only"))) if jailed else None
    life = _core.ChildLife(**life_args, seccomp=program, agent=end.agent)
    machine_args = _native_machine(args, jail_spec, volumes, snapshot)
    machine = snapshot.machine.for_child(**machine_args)
    adopted = None if jail_spec is None else jail.adoption(jail_spec)
    recipe = {
        "life": {**life_args, "seccomp": None if program is None else program.hex(),
                 "agent": end.agent_args},
        "machine": {"restored": {"snapshot": snapshot.machine.number, "child": machine_args}},
        "handover": NATIVE_HANDOVER,
        "prelude": [f"{__name__}:_native_prelude_plain", json.dumps([snapshot_dir, adopted])]}
    return zygote_child.NativeChild(
        life, machine, NATIVE_HANDOVER,
        functools.partial(_native_prelude, snapshot_dir, jail_spec), recipe)


@dataclass(frozen=True)
class _NativeSnapshot:
    """What every native child of one snapshot shares: its decoded state, its machine
    (``_snapshot_machine``), the premaps a child forked next inherits
    (``inherited_ram``) and its restore base's tag."""

    state: MachineState
    machine: Any            # _core.SnapshotMachinePlan
    memory_file: str
    disks: dict[int, str]
    premapped: list[tuple[int, int, int]] | None
    other_premaps: list[tuple[int, int]]
    base_tag: str | None


def _native_snapshot(snapshot_dir: str) -> _NativeSnapshot:
    """``_NativeSnapshot`` of ``snapshot_dir``, its files checked (``load_snapshot``,
    ``load_memory``: a ``stat`` each) and its premaps looked up; raises what they raise
    for a snapshot a native child cannot restore."""
    state, _ = load_snapshot(snapshot_dir)
    machine, memory_file, disks = _snapshot_machine(snapshot_dir)
    premapped, other_premaps = inherited_ram(snapshot_dir)
    return _NativeSnapshot(state, machine, memory_file, disks, premapped, other_premaps,
                           restore_base_tag(*load_memory(snapshot_dir)))


# The batch being forked: each snapshot's ``_NativeSnapshot``, made once by ``prefork``
# (which checked its files), so its children do not check them again one by one
# (~5 ``stat`` calls of the same few files a child, and the lookups around them).
# Replaced at every batch; a snapshot missing here (it failed) is looked up again by
# its child's ``native_child``, which then refuses with the reason.
_batch_snapshots: dict[str, _NativeSnapshot] = {}


# Each snapshot's native machine (``_core.SnapshotMachinePlan``), keyed by its
# ``state.bin`` path, valid while ``load_snapshot`` gives the same ``PreparedRestore``.
_snapshot_machines: dict[str, tuple[PreparedRestore, Any, str, dict[int, str]]] = {}


def _snapshot_disks(state: MachineState) -> dict[int, str]:
    """Each read-only disk of the snapshot by slot, found by its content key where a
    Python child finds it (``restore``, ``snapshot_slot_media``) and the jail opens it
    (``spawn._jail_request``): the root disk in the image cache, a read-only volume in
    the volume cache; never a path the guest gave. A read-write volume's file is its
    sandbox's own, given at each spawn (``_child_volumes``)."""
    disks: dict[int, str] = {}
    for device in state.devices:
        if device.slot is None:
            continue
        if isinstance(device.state, BlkState):
            disks[device.slot] = str(disk_path(device.state.disk_key))
        elif (isinstance(device.state, devices.VolumeSlotState)
              and device.state.disk.disk_key and device.state.disk.read_only):
            disks[device.slot] = str(volume_image_path(device.state.disk.disk_key))
    return disks


# A native child's own volume, as ``SnapshotMachinePlan.for_child`` takes it: (virtio-mmio
# slot, path, key, bytes, read-only, guest path, index among the jail's opened files).
ChildVolume = tuple[int, str, str, int, bool, str, "int | None"]
# A new volume for the agent to mount, as ``ChildLife`` takes it: (virtio-mmio slot,
# guest path, read-only, sectors).
ChildMount = tuple[int, str, bool, int]


def _child_volumes(state: MachineState, args: dict[str, Any], jail_spec: JailSpec | None
                   ) -> tuple[list[ChildVolume], list[ChildMount]]:
    """A native child's own volumes, given at its spawn (``args["volumes"]``, placed as
    a Python child places them, ``snapshot_slot_media``): a read-write volume its
    snapshot's slot holds (that sandbox's own file), and each new one, in an empty
    slot, with the agent's mount of it. A jailed child's come from its jail's opened
    files (``spawn._jail_request`` opens them: read-only, or read-write). Sized here,
    in the zygote (an ``fstat``'s worth, not the disk's bytes); ``ValueError`` for a
    volume that does not fit, or that the jail did not open."""
    asked = [PreparedVolume.from_json(v) for v in args.get("volumes") or ()]
    if not asked:
        return [], []
    held, new = snapshot_slot_media(state, asked)
    slots = [d.slot for d in state.devices if d.kind == devices.VOLUME.name]
    volumes: list[ChildVolume] = []
    mounts: list[ChildMount] = []
    for media in [*(m for m in held if not m.read_only), *new]:
        size = os.stat(media.path).st_size
        if size <= 0 or size % SECTOR_SIZE:
            raise ValueError(f"volume {media.path} is {size} bytes; a disk image must be a "
                             f"positive multiple of {SECTOR_SIZE} bytes")
        opened = None
        if jail_spec is not None:
            files = jail_spec.preopen if media.read_only else jail_spec.preopen_rw
            if media.path not in files:
                raise ValueError(f"the jail opens no {media.path} for the machine")
            opened = files.index(media.path)
        slot = slots[media.slot]
        assert slot is not None   # a virtio device's
        volumes.append((slot, media.path, media.key, size, media.read_only,
                        media.guest_path, opened))
        if media in new:
            mounts.append((slot, media.guest_path, media.read_only, size // SECTOR_SIZE))
    return volumes, mounts


def _snapshot_machine(snapshot_dir: str) -> tuple[Any, str, dict[int, str]]:
    """The machine of ``snapshot_dir`` as ``_core.SnapshotMachinePlan``, built once per
    snapshot in the zygote (beside its ``PreparedRestore``, which it holds), the
    memory file it maps (a diff snapshot's base: its children adopt the premap
    instead, ``inherited_ram``) and its read-only disks by slot (``_snapshot_disks``).
    Raises ``ValueError`` for a snapshot a native machine cannot restore."""
    from vmfork import _core
    state, prepared = load_snapshot(snapshot_dir)
    key = os.path.join(snapshot_dir, "state.bin")
    cached = _snapshot_machines.get(key)
    if cached is not None and cached[0] is prepared:
        return cached[1], cached[2], cached[3]
    memory_file, _ = load_memory(snapshot_dir)
    if prepared.native is None:
        raise ValueError(f"{snapshot_dir}'s restore buffers are not native")
    com1 = state.device(devices.SERIAL)
    disks = _snapshot_disks(state)
    machine = _core.SnapshotMachinePlan(
        memory_file, state.mem_size, prepared.native, devices=machine_plan(state),
        serial=None if com1 is None else (com1.dll, com1.dlm, com1.ier, com1.lcr, com1.mcr,
                                          com1.scr, com1.thre_pending, bytes(com1.rx)),
        log_burst=serial.CONSOLE_BURST, log_per_second=serial.CONSOLE_LINES_PER_S,
        log_total_bytes=serial.CONSOLE_LOG_BYTES, disks=disks)
    _snapshot_machines.pop(key, None)
    _snapshot_machines[key] = (prepared, machine, memory_file, disks)
    while len(_snapshot_machines) > SNAPSHOTS_KEPT:
        del _snapshot_machines[next(iter(_snapshot_machines))]
    return machine, memory_file, disks


def forker_image_key() -> tuple[int, tuple[tuple[str, int, tuple[tuple[int, int, int], ...],
                                                 bool], ...]]:
    """What a native child's recipe names of the zygote's image besides its snapshot
    plan: the premaps (their plans, places, and which the children inherit), and the
    write sets learnt (a plan's set is in the image, not in the recipe). The zygote's
    forker hook (``runtime/forker.py``): a forker cloned with another key holds other
    mappings at those places, or plans without their sets, so the zygote clones a new
    one."""
    return _write_sets_learnt, tuple(
        (path, id(entry.plan), tuple(entry.ram.host_regions()), entry.inherited)
        for path, entry in _premaps.items())


def inherited_ram(snapshot_dir: str) -> tuple[list[tuple[int, int, int]] | None,
                                              list[tuple[int, int]]]:
    """What a native child of ``snapshot_dir`` forked next (after ``prefork``) inherits
    of the zygote's premaps, as plain values for ``SnapshotMachinePlan.for_child``: its
    own RAM's regions (``PremappedRam.host_regions``), None for a flat snapshot, and
    ``(host address, length)`` of each other premap the fork copies (the batch's other
    snapshots'), which it unmaps, as ``inherited_premap`` does in a Python child.

    The zygote checked the plan and every file it maps at this batch's
    ``premap_memory``; the child adopts the mapping without looking again (it runs no
    Python). Raises ``ValueError`` for a diff snapshot that has no premap to inherit
    (its plan beyond ``PREMAP_RUNS_KEPT``, a map or ``MADV_DOFORK`` that failed): a
    native child maps no run of a plan itself."""
    plan_path = os.path.join(snapshot_dir, PLAN_FILE)
    _, plan = load_memory(snapshot_dir)
    mine = _premaps.get(plan_path) if plan is not None else None
    if plan is not None and (mine is None or not mine.inherited or mine.plan is not plan):
        raise ValueError(f"{snapshot_dir} is a diff snapshot whose RAM the zygote did not map "
                         "ahead (see its log): a native child maps no memory plan itself")
    others = [(host, size) for path, entry in _premaps.items()
              if entry.inherited and path != plan_path
              for _, size, host in entry.ram.host_regions()]
    return (None if mine is None else mine.ram.host_regions()), others


def _native_machine(args: dict[str, Any], jail_spec: JailSpec | None,
                    volumes: list[ChildVolume], snapshot: _NativeSnapshot) -> dict[str, Any]:
    """The arguments of ``SnapshotMachinePlan.for_child`` for the machine a native
    child restores from ``args["snapshot_dir"]``: its ``snapshot``'s, with its run directory, the
    premaps it inherits (``inherited_ram``), its own ``volumes`` (``_child_volumes``) and,
    jailed, where the jail's opened descriptors hold ``/dev/kvm``, each disk and, for
    a flat snapshot, the memory file. A
    networked snapshot's child given a tap (``net_tap``) takes the one its jail opened
    in its network namespace, or, unjailed, opens it in the namespace its set-up joined
    (``ChildMachinePlan.build``); given none, its device has no tap, as a Python
    child's. ``ValueError`` for a tap name that is not an interface's."""
    memory_file, disks = snapshot.memory_file, snapshot.disks
    premapped, other_premaps = snapshot.premapped, snapshot.other_premaps
    run_dir = str(args["run_dir"])
    if jail_spec is None:
        tap = args.get("net_tap") or None
        if tap is not None and not (isinstance(tap, str) and valid_tap_name(tap)):
            raise ValueError(f"net_tap {tap!r:.40} is not a Linux interface name")
        return dict(run_dir=run_dir, premapped=premapped, other_premaps=other_premaps,
                    volumes=volumes, tap=tap)
    needed = [*disks.values(), *([memory_file] if premapped is None else [])]
    unopened = [path for path in needed if path not in jail_spec.preopen]
    if unopened or KVM_PATH not in jail_spec.devices:
        raise ValueError(f"the jail opens no {', '.join(unopened) or KVM_PATH} for the "
                         "machine")
    return dict(
        run_dir=run_dir, jail_kvm=jail_spec.devices.index(KVM_PATH), premapped=premapped,
        other_premaps=other_premaps, volumes=volumes,
        jail_memory=None if premapped is not None else jail_spec.preopen.index(memory_file),
        jail_disks={slot: jail_spec.preopen.index(path) for slot, path in disks.items()})


# A native child's snapshot directory, set by its hand-over's prelude (in the child,
# before its first hand-over; never in the zygote).
_native_snapshot_dir: str | None = None


def _native_prelude(snapshot_dir: str, jail_spec: JailSpec | None,
                    opened: tuple[list[int], list[int], tuple[int, int], list[int],
                                  int | None] | None) -> None:
    """A native child's first Python, before its first hand-over: the jail's
    descriptors adopted (``jail.adopt``) and which snapshot it restored remembered
    (for the machine's view, ``_NativeCaptures``)."""
    _native_prelude_plain(snapshot_dir, None if jail_spec is None else jail.adoption(jail_spec),
                          opened)


def _native_prelude_plain(snapshot_dir: str, adopted: dict[str, Any] | None,
                          opened: jail.Opened | None) -> None:
    """``_native_prelude`` from plain values (``jail.adoption``'s): a forker's child's
    (``runtime/forker.py``), whose zygote built no ``JailSpec`` for it."""
    global _native_snapshot_dir
    if adopted is not None:
        assert opened is not None
        jail.adopt_plain(adopted, opened)
    _native_snapshot_dir = snapshot_dir


class _NativeCaptures:
    """A native child's captures: its machine's Python view (``NativeMachineView``)
    and the ``SnapshotTaker`` over it, built at the first ``snapshot`` hand-over; what
    ``status`` says of snapshots is the machine handle's, which the native control
    server shares."""

    def __init__(self, machine: _core.NativeMachine, snapshot_dir: str) -> None:
        state, _ = load_snapshot(snapshot_dir)
        memory_file, plan = load_memory(snapshot_dir)
        self.machine = machine
        self.view = NativeMachineView(machine, state, memory_file, plan)
        self.snapshots = SnapshotTaker(self.view, restore_base_tag(memory_file, plan))

    def push_status(self) -> None:
        self.machine.set_snapshot_status(
            [(b["tag"], str(b["kind"])) for b in self.snapshots.bases()],
            self.snapshots.tracking)


_native_captures: _NativeCaptures | None = None


def _native_captures_now() -> _NativeCaptures:
    global _native_captures
    if _native_captures is None:
        machine = _core.forked_machine() if CORE_BUILT else None
        if machine is None or _native_snapshot_dir is None:
            raise _Refused("this process runs no native child's machine")
        _native_captures = _NativeCaptures(machine, _native_snapshot_dir)
    return _native_captures


def native_handover(line: bytes, fd: int) -> bytes:
    """A native child's hand-over (``NATIVE_HANDOVER``): a line its control server does
    not serve, parsed as ``ControlServer.handle_line`` parses it. ``snapshot`` is
    taken of the machine's Python view (``_NativeCaptures``, built at the first one),
    as ``ControlServer.snapshot`` takes it of a ``Machine``; a natively served op in a
    line the server did not recognise as plain is refused, saying so."""
    def dispatch(request: control.AnyRequest) -> control.WireRecord:
        if not isinstance(request, control.Snapshot):
            raise _Refused(f"a native child serves {type(request).__name__} only as a "
                           "plain line ({\"op\": ...})")
        captures = _native_captures_now()
        with socket.socket(fileno=os.dup(fd)) as sock:
            return take_snapshot(captures.snapshots, request, sock, captures.push_status)

    return handover_reply(line, dispatch)


def make_unique(target: AgentTarget, timeout: float = READY_TIMEOUT, *,
                net_refresh: bool = False) -> dict[str, Any]:
    """Set the guest's clock, reseed it and (``net_refresh``) tell its network it was
    forked; returns timings in seconds and, with ``net_refresh``, what the guest's
    refresh did (``{"connections_aborted", "neighbours_flushed"}``).

    One ``after_fork`` connection does all of it, the clock's correction included,
    natively (``_core.agent_after_fork`` on ``target``, a ``_core.AgentTarget``, with
    the GIL released: ``AgentClient.after_fork``'s contract, retried every 50 ms
    until ``timeout`` while the guest cannot take a connection yet). An agent older
    than that op gets the same steps one call each, natively too (``agent_op_by_op``).
    Its failures are raised as the client's (``AgentUnavailable``, ``AgentTimeout``,
    ``AgentProtocolError``, ``AgentError``).
    """
    from vmfork import _core
    started = time.monotonic()
    done, failure = _core.agent_after_fork(target, timeout, net_refresh)
    if failure is not None:
        raise _agent_failure(*failure)
    assert done is not None   # one of the two is
    bound_ns, _step_ns, net, retries, (connected_ns, first_frame_ns, call_ns), op_by_op = done
    out: dict[str, Any] = {"agent_ready": time.monotonic() - started,  # all steps included
                           # the answering call: CONNECT answered, the agent's first
                           # frame, its result (agent_handshake.CallTiming; one call
                           # each for an agent older than after_fork: the reseed
                           # answered, the clock set, all done)
                           "agent_retries": retries, "agent_op_by_op": op_by_op,
                           "agent_connected": connected_ns / 1e9,
                           "agent_first_frame": first_frame_ns / 1e9,
                           "agent_call": call_ns / 1e9,
                           "clock_error_bound_s": bound_ns / 1e9}
    if net is not None:
        out["net_refresh"] = {"connections_aborted": net[0], "neighbours_flushed": net[1]}
    return out


def _agent_failure(kind: str, op: str | None, code: str, message: str) -> AgentError:
    """The client's exception for a native handshake's failure (``agent_handshake.rs``)."""
    if kind == "unavailable":
        return AgentUnavailable(message)
    if kind == "timeout":
        return AgentTimeout(message, op=op)
    if kind == "protocol":
        return AgentProtocolError(message, op=op)
    return AgentError(code, message, op=op)


def _retry_until(deadline: float, step: Callable[[], T]) -> T:
    """``step()``, again every 50 ms while the guest cannot answer, until ``deadline``."""
    while True:
        try:
            return step()
        except (AgentUnavailable, AgentTimeout):
            spawnprofile.mark("agent_unavailable")
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def snapshot_slot_media(state: MachineState,
                        volumes: list[PreparedVolume]) -> tuple[tuple[VolumeMedia, ...],
                                                                list[VolumeMedia]]:
    """The disks for the snapshot's filled volume slots, and the new volumes placed in
    its empty slots (lowest first). ``ValueError`` if a filled slot's read-write disk
    is not given, or the new volumes do not fit."""
    by_key = {v.key: v for v in volumes}
    held: list[VolumeMedia] = []
    free: list[int] = []
    for slot, volume in enumerate(state.devices_of(devices.VOLUME)):
        key = volume.disk.disk_key
        if not key:
            free.append(slot)
            continue
        given = by_key.pop(key, None)
        if given is None and not volume.disk.read_only:
            raise ValueError(f"the snapshot's read-write volume at {volume.guest_path} "
                             f"({key}) needs its file: only the sandbox that holds it "
                             "(a workspace) can be restored from this snapshot")
        path = given.path if given is not None else str(volume_image_path(key))
        held.append(VolumeMedia(slot, path, key, volume.disk.read_only, volume.guest_path))
    new = list(by_key.values())
    if len(new) > len(free):
        raise ValueError(f"{len(new)} volumes asked for, but the snapshot has {len(free)} "
                         "empty volume slots")
    return tuple(held), [VolumeMedia(slot, v.path, v.key, v.read_only, v.guest_path)
                         for slot, v in zip(free, new)]


def attach_volumes(machine: Machine, agent: AgentClient, new: list[VolumeMedia],
                   deadline: float) -> None:
    """Put each new volume into its slot and have the agent mount it."""
    for media in new:
        machine.attach_volume(media)
        sectors = machine.volumes[media.slot].disk.capacity_bytes // SECTOR_SIZE

        def mount(media: VolumeMedia = media, sectors: int = sectors) -> dict[str, Any]:
            return agent.mount_volume(machine.volume_devices[media.slot], media.guest_path,
                                      read_only=media.read_only, sectors=sectors)

        _retry_until(deadline, mount)


def restore(snapshot_dir: str, run_dir: Path, vm_id: str,
            net_tap: str | None = None,
            volumes: tuple[VolumeMedia, ...] = ()) -> tuple[Machine, MachineState]:
    loaded = _load_snapshot(snapshot_dir)
    state = loaded.state
    memory_file, plan = load_memory(snapshot_dir)
    # In a child of the zygote, the RAM its prefork mapped (never in the zygote itself:
    # its warm-up restore maps its own, and the premap is never written there).
    premapped = (inherited_premap(snapshot_dir, plan)
                 if zygote_child.current() is not None else None)
    # A guest booted on a root disk is named by the disk's content key alone: the
    # snapshot says which disk, the image cache says where it is.
    blk = state.device(devices.BLK)
    disk_key = blk.disk_key if blk is not None else None
    config = MachineConfig(
        restore_state=state, restore_prepared=loaded.prepared, restore_plans=loaded.plans,
        memory_file=memory_file, memory_plan=plan, memory_premapped=premapped,
        mem_mib=state.mem_size >> 20, vcpus=len(state.vcpus),
        vsock_uds=(str(run_dir / "vsock.sock") if state.device(devices.VSOCK) is not None
                   else None),
        guest_cid=state.guest_cid,
        console_log=str(run_dir / "console.log"), vm_id=vm_id, memfd=False,
        net_tap=net_tap,
        root_disk=str(disk_path(disk_key)) if disk_key is not None else None,
        root_disk_key=disk_key, volumes=volumes)
    return Machine(config), state


class StopSignal(threading.Event):
    """The child's stop request (SIGTERM, or a control ``stop``): an Event that is
    also a readable file descriptor once set, so an idle child blocks on it in
    ``poll`` beside the machine's exit instead of waking to look (an idle VMM that
    wakes runs Python, and every page that touches becomes its own)."""

    def __init__(self) -> None:
        super().__init__()
        self._pipe = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def fileno(self) -> int:
        return self._pipe[0]

    @property
    def write_fd(self) -> int:
        """The pipe's write end: the native control server writes a byte to it for a
        ``stop`` (it has no way to set the Event), which ``is_set`` then sees."""
        return self._pipe[1]

    def is_set(self) -> bool:
        if super().is_set():
            return True
        poller = select.poll()
        poller.register(self._pipe[0], select.POLLIN)
        if poller.poll(0):
            super().set()   # set from the native side: remembered as set here too
            return True
        return False

    def set(self) -> None:
        # Also run from the SIGTERM handler: a non-blocking write, nothing to wait for.
        super().set()
        try:
            os.write(self._pipe[1], b"x")
        except BlockingIOError:
            pass  # full: readable already

    def close(self) -> None:
        for fd in self._pipe:
            os.close(fd)


class _Refused(Exception):
    """A request the VMM will not carry out; its message is the reply's error."""


def restore_base_tag(memory_file: str | None, plan: MemoryPlan | None) -> str | None:
    """The tag of the snapshot a machine was restored from (the base of its first
    diff): the name of the directory holding its memory plan or, for a flat snapshot,
    the memory file it maps (the tag in a store)."""
    if plan is not None:
        return os.path.basename(plan.directory or "") or None
    if memory_file is not None:
        return os.path.basename(os.path.dirname(os.path.abspath(memory_file))) or None
    return None


def handover_reply(line: bytes,
                   dispatch: Callable[[control.AnyRequest], control.WireRecord]) -> bytes:
    """The reply line to a request line the native server handed over: the request
    parsed (``control.parse_request``: the one author of a refusal's text), then
    ``dispatch``-ed; what it raises is the reply's error, never the VMM's end."""
    try:
        request = control.parse_request(line)
    except control.ControlError as err:
        return control.encode(control.error_reply(err.message))
    try:
        reply = dispatch(request).to_wire()
    except (_Refused, CaptureError) as err:
        reply = control.error_reply(str(err))
    except Exception as err:  # noqa: BLE001 - reported to the caller, never fatal to the VMM
        reply = control.error_reply(f"{type(err).__name__}: {err}")
    return control.encode(reply)


def take_snapshot(snapshots: SnapshotTaker, req: control.Snapshot, sock: socket.socket,
                  push_status: Callable[[], None]) -> control.SnapshotReply:
    """The ``snapshot`` op: capture the running machine, pause-consistent, with
    ``snapshots`` (a Python ``Machine``'s or a native child's view of its machine);
    ``sock``: the request's connection (progress goes there); ``push_status``: tell
    the native control server what ``status`` now says of snapshots.

    Request (``control.Snapshot``; on the wire, one JSON object)::

        {"op": "snapshot", "mode": "full" | "diff" | "live",   # absent: "full"
         "memory_path": P, "state_path": S,      # files to create (their directory
                                                 # must exist; they must not)
         "tag": T,          # optional: names this capture, so a later diff can be
                            # based on it (the store tag it is published as)
         "base_tag": B,     # optional, diff only: the base to diff against, one of
                            # status's "snapshot_bases" (default: the newest)
         "resume": true,    # false leaves the source paused afterwards
         "progress": false} # true: also send {"ok": true, "stage": "resumed",
                            # "timings": {...}} as soon as the source runs again,
                            # before the final reply (useful for live)

    A field the op does not take is refused (``control.parse_request``), not
    ignored: a caller that expects another contract must not get a layer at P.

    What is written: S is the vCPU/device state (``ondisk.stateformat``). P is a
    whole memory image in memory-file layout (``memory_format: "image"``; full
    and live) or a layer file (``"layer"``; diff): the pages changed since the
    base named by ``base_tag`` in the reply, plus their index
    (``ondisk.layerfile``). The base is either the snapshot this sandbox was
    restored from (``base_kind: "restore"``, its tag is the directory name of
    the memory file it maps) or this sandbox's previous successful capture
    (``base_kind: "previous"``, named by that capture's ``tag``; available when
    the host kernel tracks soft-dirty bits). base image + layer = this capture.

    Reply (``control.SnapshotReply``), sent once both files are completely written::

        {"ok": true, "mode": ..., "memory_format": "image" | "layer",
         "memory_bytes": int,            # data bytes written to P
         "dirty_pages": int | null,      # pages changed since the base
         "changed_pages": int | null,    # diff: the layer's pages that differ from it
         "base_tag": str | null, "base_kind": "restore" | "previous" | null,
         "tag": T | null, "tracking": "soft-dirty" | "restore-base-only",
         "timings": {"pause_s": float,   # the source's vCPUs were stopped this long
                     "vcpu_state_s", "device_state_s", "fork_s" (live),
                     "scan_s" (diff), "memory_write_s", "clear_soft_dirty_s",
                     "state_write_s", ..., "total_s": float}}

    or ``{"ok": false, "error": "..."}`` with nothing left at P or S.
    """
    memory_path, state_path = req.memory_path, req.state_path
    if os.path.abspath(memory_path) == os.path.abspath(state_path):
        raise _Refused("memory_path and state_path must differ")
    for name, path in (("memory_path", memory_path), ("state_path", state_path)):
        if os.path.lexists(path):
            raise _Refused(f"{name} {path} exists; give a new path")

    def resumed(timings: dict[str, float]) -> None:
        if req.progress:
            try:
                sock.sendall(control.encode(control.Resumed(timings)))
            except OSError:
                pass   # the final reply will not arrive either; the capture goes on

    try:
        result = snapshots.take(req.mode, memory_path, state_path, tag=req.tag,
                                base_tag=req.base_tag, resume=req.resume,
                                on_resumed=resumed)
    finally:
        push_status()
    return control.SnapshotReply(
        mode=result.mode, memory_format=result.memory_format,
        memory_bytes=result.memory_bytes, dirty_pages=result.dirty_pages,
        base_tag=result.base_tag, base_kind=result.base_kind, tag=req.tag,
        tracking=result.tracking, timings=result.timings, changed_pages=result.changed_pages)


class ControlServer:
    """The control socket (``runtime.control``: the protocol, its records and the
    client), served by a native thread (``_core.ControlServe``, ``control_serve.rs``):
    ``pause``, ``resume``, ``stop``, ``status`` (the balloon's counters are its native
    device's) and ``exits`` (the vCPU loops' counters; the buses' and interrupt lines',
    which are Python objects, from ``Machine.exit_counters`` with the GIL) there, without
    Python's dispatch; every other line is handed to
    ``handle_line`` with the GIL, for that line only, on the control thread. This
    object owns what the hand-over needs: the snapshot state (``SnapshotTaker``) and
    what ``status`` says of it, pushed to the native server after each capture.

    ``origin_tag`` names the snapshot the machine was restored from (the base of
    its first diff); by default the name of the directory holding its memory plan
    or, for a flat snapshot, the memory file it maps: the tag in a store.
    """

    def __init__(self, machine: Machine, path: str, on_stop: StopSignal,
                 origin_tag: str | None = None, *, jailed: bool = False) -> None:
        self.machine = machine
        # A jailed VMM sees only its run directory: a BRANCH must name files there
        # (runtime/branch.py copies them into the store), and status says so.
        self.jailed = jailed
        self.on_stop = on_stop
        if origin_tag is None:
            origin_tag = restore_base_tag(machine.config.memory_file, machine.config.memory_plan)
        self.snapshots = SnapshotTaker(machine, origin_tag)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
            sock.listen(8)
        except BaseException:
            sock.close()
            raise
        # The listener is the native server's from here (it closes it).
        self._server = _core.ControlServe(
            sock.detach(), on_stop.write_fd, [vcpu.loop for vcpu in machine.vcpus],
            jailed, None if machine.balloon is None else machine.balloon.device,
            machine.exit_counters, self.handle_line)
        self._push_snapshot_status()
        machine.on_exit(self._server.set_exit)
        self._closed = False

    def _push_snapshot_status(self) -> None:
        self._server.set_snapshot_status(
            [(b["tag"], str(b["kind"])) for b in self.snapshots.bases()],
            self.snapshots.tracking)

    def handle_line(self, line: bytes, fd: int) -> bytes:
        """A request line the native server hands over, its reply line out; ``fd``:
        the connection, borrowed for the call (a snapshot's progress goes there)."""
        return handover_reply(line, lambda request: self._dispatch(request, fd))

    def _dispatch(self, request: control.AnyRequest, fd: int) -> control.WireRecord:
        # Status, pause, resume, exits and stop come here only for a line the native
        # server did not recognise as plain (an escaped op name, say): the same loops,
        # the same counters and the same stop pipe either way.
        m = self.machine
        match request:
            case control.Status():
                exit_ = m.exit
                fpr = m.free_page_reporting()
                return control.StatusReply(
                    paused=m.paused, exit=None if exit_ is None else exit_.reason,
                    snapshot_bases=tuple(control.SnapshotBase(tag=b["tag"], kind=str(b["kind"]))
                                         for b in self.snapshots.bases()),
                    snapshot_tracking=self.snapshots.tracking, jailed=self.jailed,
                    free_page_reporting=None if fpr is None
                    else control.FreePageReporting.from_wire(fpr))
            case control.Pause():
                m.pause()
                return control.Ack()
            case control.Resume():
                m.resume()
                return control.Ack()
            case control.Exits():
                return control.ExitsReply(profile=m.exit_profile())
            case control.Snapshot():
                # The connection stays the native server's: the capture gets its own
                # descriptor of it, closed when the capture returns.
                with socket.socket(fileno=os.dup(fd)) as sock:
                    return self.snapshot(request, sock)
            case control.Stop():
                self.on_stop.set()
                return control.Ack()

    def snapshot(self, req: control.Snapshot, sock: socket.socket) -> control.SnapshotReply:
        """The ``snapshot`` op (``take_snapshot``) of this machine."""
        return take_snapshot(self.snapshots, req, sock, self._push_snapshot_status)

    @property
    def serving(self) -> bool:
        """Whether the native thread still serves."""
        return bool(self._server.serving)

    @property
    def thread_id(self) -> int:
        """The native thread's kernel id (0 until it has started)."""
        return int(self._server.thread_id)

    def close(self) -> None:
        """Stop serving: the native thread closes the socket and its connections.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.on_stop.set()
        # (A thread still inside a request -- a snapshot -- ends when it is done.)
        self._server.close(2.0)


def _wait_for_start_gate(path: str, timeout: float, stop: StopSignal) -> float:
    """Block until this child takes a byte from the start gate FIFO, the gate is
    closed or gone, ``stop`` is set (SIGTERM) or ``timeout`` passes; returns the
    seconds waited. ``stop``'s own pipe ends the wait, so it sleeps until something
    happens instead of looking for ``stop`` every so often."""
    started = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0.0
    try:
        deadline = started + timeout
        while (remaining := deadline - time.monotonic()) > 0 and not stop.is_set():
            if fd not in select.select([fd, stop.fileno()], [], [], remaining)[0]:
                continue
            try:
                os.read(fd, 1)  # a byte: our turn; b"": the spawner closed it
                break
            except BlockingIOError:
                continue  # a sibling took the byte that woke us
    finally:
        os.close(fd)
    return time.monotonic() - started


def _guest_ram_files(machine: Machine) -> list[str]:
    """The files this machine's guest RAM is mapped from (for ``memphases``)."""
    config = machine.config
    if config.memory_plan is not None:
        return [config.memory_plan.source_path(i)
                for i in range(len(config.memory_plan.sources))]
    return [config.memory_file] if config.memory_file is not None else []


def _release_start_up_memory() -> None:
    """Give back what restoring and the first handshake allocated and freed.

    Memory a child has written is its own (copy-on-write), so every freed page
    counts against the idle child until it is returned: collect the cycles
    those steps left, then ask glibc to hand free heap pages back to the kernel.
    """
    gc.collect()
    _libc.malloc_trim(0)


def main(args: dict[str, Any]) -> int:
    started = time.monotonic()
    run_dir = Path(args["run_dir"])
    vm_id = str(args["vm_id"])
    end = _child_ends.get(vm_id)
    if end is None:   # not forked by a zygote's batch (or its prefork failed)
        try:
            end = _child_end(args)
        except ImportError as err:
            # No status.json without the core (a machine needs it anyway): the zygote
            # passes this line on with the exit.
            print(f"vmfork vmm {vm_id}: the native core is not built: {err}", file=sys.stderr,
                  flush=True)
            return 1
    # Which child this is, in every report (a native child says "native",
    # child_life.rs): a Python child of a spawn the zygote could not give a native one
    # says why.
    refused = args.get(zygote_child.NATIVE_REFUSED)
    which: dict[str, Any] = {"child": "python"}
    if refused is not None:
        which["native_refused"] = str(refused)

    def report(fields: dict[str, Any]) -> None:
        end.reporter.report({**fields, **which})

    # The VMM logs what its devices see, and the guest decides what they see: one
    # budget for the whole process log, so no guest can fill the disk through it.
    limit_log_handlers(logging.getLogger(), LogBudget("VMM log"))
    stop = StopSignal()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if refused is not None:
        log.warning("%s runs in a Python child: no native child (%s)", vm_id, refused)
    try:
        forked = zygote_child.current()
        # In its sandbox's network namespace already, if it has one: its set-up (or
        # its jail, which also attached the tap while it could) joined it.
        jailed = forked is not None and forked.jailed
        asked = [PreparedVolume.from_json(v) for v in args.get("volumes") or ()]
        state, _ = load_snapshot(args["snapshot_dir"])
        held, new_volumes = snapshot_slot_media(state, asked)
        spawnprofile.mark("entry")
        machine, state = restore(args["snapshot_dir"], run_dir, vm_id, args.get("net_tap"),
                                 held)
        spawnprofile.mark("machine")
    except Exception as err:  # noqa: BLE001 - whatever failed, the spawner is told why
        report({"state": "failed", "reason": f"restore: {err}"})
        return 1
    with machine:
        start_wait = 0.0
        gate = args.get("start_gate")
        if jailed:
            # Last step of set-up, before the guest runs a single instruction: from
            # here the process may only do what a running VMM does (runtime/seccomp.py;
            # waiting at the start gate is such a thing).
            seccomp.install_vmm_filter(log_only=bool(args.get("seccomp_log_only")))
            spawnprofile.mark("seccomp")
        # Behind a start gate, everything but the guest's first instruction happens
        # before it: once the gate opens, the batch's guests run and take the CPU from
        # every sibling still on its way (bench/spawn_profile.py's timeline), so each
        # child then only wakes its parked vCPUs and says so.
        machine.start(paused=gate is not None)
        spawnprofile.mark("vcpu_start")
        if gate is not None:
            report({"state": "prepared", "pid": os.getpid()})
            spawnprofile.mark("prepared_report")
            start_wait = _wait_for_start_gate(
                str(gate), float(args.get("start_gate_timeout", START_GATE_TIMEOUT)), stop)
            spawnprofile.mark("start_gate")
            if stop.is_set():
                return 0
            machine.resume()
            spawnprofile.mark("resumed")
        timings = {"restore_s": time.monotonic() - started - start_wait,
                   "start_wait_s": start_wait,
                   # fork() in the zygote to this entry: the child's set-up (zygote_child)
                   "fork_to_entry_s": None if forked is None
                   else (forked.entry_started_ns - forked.forked_ns) / 1e9}
        report({"state": "restored", "pid": os.getpid(), **timings})
        spawnprofile.mark("restored_report")
        guest_ram = (memphases.guest_ram_paths(_guest_ram_files(machine), state.mem_size)
                     if memphases.IDLE_S is not None else memphases.no_guest_ram)
        memphases.record("restored", str(run_dir), guest_ram)
        control = ControlServer(machine, str(run_dir / "control.sock"), stop, jailed=jailed)
        spawnprofile.mark("control_server")
        def agent() -> AgentClient:
            return AgentClient(vsock_uds_connector(str(run_dir / "vsock.sock"), AGENT_PORT,
                                                   timeout=CONNECT_TIMEOUT),
                               io_timeout=AGENT_IO_TIMEOUT)

        try:
            ready_timeout = float(args.get("ready_timeout", READY_TIMEOUT))
            unique = make_unique(end.agent, ready_timeout,
                                 net_refresh=state.device(devices.NET) is not None)
            spawnprofile.mark("agent_answered")
            if new_volumes:
                mount_started = time.monotonic()
                attach_volumes(machine, agent(), new_volumes, time.monotonic() + ready_timeout)
                unique["volumes_s"] = time.monotonic() - mount_started
        except Exception as err:  # noqa: BLE001 - reported as the child's failure
            exit_ = machine.exit
            reason = f"guest not ready: {err}" + (f" ({exit_.reason})" if exit_ else "")
            report({"state": "failed", "reason": reason,
                    "console_tail": machine.serial.tail_text()})
            control.close()
            return EXIT_GUEST_DIED
        report({"state": "ready", "pid": os.getpid(), **timings,
                "ready_s": time.monotonic() - started, **unique})
        spawnprofile.mark("ready_report")
        spawnprofile.finish(str(run_dir))
        memphases.record("ready", str(run_dir), guest_ram)
        _release_start_up_memory()
        memphases.record("released", str(run_dir), guest_ram)
        idle_probe_at = (None if memphases.IDLE_S is None
                         else time.monotonic() + memphases.IDLE_S)
        # Idle: block until SIGTERM, a control stop or the guest's end (no timeout
        # but the memory probe's, when it is on).
        waiting = select.poll()
        waiting.register(stop.fileno(), select.POLLIN)
        waiting.register(machine.exit_fd(), select.POLLIN)
        while not stop.is_set():
            waiting.poll(None if idle_probe_at is None
                         else max(0.0, idle_probe_at - time.monotonic()) * 1000)
            exit_ = machine.wait(0)
            if idle_probe_at is not None and time.monotonic() >= idle_probe_at:
                memphases.record("idle", str(run_dir), guest_ram)
                idle_probe_at = None
            if exit_ is not None:
                report({"state": "exited", "reason": exit_.reason, "detail": exit_.detail,
                        "panicked": exit_.panicked, "console_tail": exit_.console_tail})
                control.close()
                return 0 if exit_.clean else EXIT_GUEST_DIED
        control.close()
    return 0
