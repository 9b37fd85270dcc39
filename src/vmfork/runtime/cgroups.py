"""Per-child memory cgroups, on cgroup v2 or on a v1 memory hierarchy.

Why both: production hosts run the unified (v2) hierarchy, where a group's limit is
``memory.max`` and OOM kills are counted in ``memory.events``. The development and
CI machines run a *hybrid* layout: a v2 tree exists but has no memory controller,
and memory is a separate v1 hierarchy (``/sys/fs/cgroup/memory``) with
``memory.limit_in_bytes`` and ``memory.oom_control``. ``detect()`` looks at
``/proc/self/mountinfo`` once and picks the hierarchy that actually carries the
memory controller (v2 first); every other function takes that choice as its
argument, so the version is decided in exactly one place.

Layout: one parent group (default ``vmfork``) directly under the root of the
memory hierarchy, one group per child below it: ``<root>/vmfork/<vm_id>``. The
spawner creates a child's group and writes its limit *before* forking; the child
writes its own pid into ``cgroup.procs`` before it runs its entry, so nothing the
entry allocates escapes the limit. No group is made for a child without a limit:
a spawn without one costs no cgroup syscalls at all.

The subtle parts:

* v2's "no internal processes" rule: a group can hand the memory controller to its
  children (``+memory`` in ``cgroup.subtree_control``) only while it has no member
  processes itself. The parent group is only ever a container of child groups, so
  the spawner enables ``+memory`` down the path from the root to the parent.
* v1 charges stay where a page was first charged (unless
  ``memory.move_charge_at_immigrate``), so a child must join before it allocates —
  hence joining in the child, right after fork, before anything else.
* A limit means RAM, not RAM plus swap: on v1 ``memory.memsw.limit_in_bytes`` (present
  only with swap accounting) is set to the same value, on v2 ``memory.swap.max`` to 0.
  On v2 ``memory.oom.group`` is set so an OOM kill takes the whole group at once.
* OOM evidence: v2 ``memory.events`` has ``oom_kill N``. v1 ``memory.oom_control``
  has an ``oom_kill`` field since Linux 4.13; older kernels only show
  ``memory.failcnt`` / ``memory.memsw.failcnt`` (times the limit was hit; with
  swap accounting the memsw counter is the one that fails), which is weaker
  evidence and is reported as such.
* Processes and CPU: on v2 a child's group also gets ``pids.max`` and ``cpu.weight``
  (``+pids +cpu`` delegated down like ``+memory``, where the root offers them). On v1
  each controller is a hierarchy of its own: where the host mounts ``pids`` and
  ``cpu``, the child gets a group of the same name (``<parent>/<vm_id>``) in each,
  with ``pids.max`` and ``cpu.shares`` (the v2 weight scaled: 100 is 1024), joined,
  killed, swept and removed with its memory group (``ChildCgroup.others``). Where
  they are not mounted (the emulated test host's hybrid layout mounts only
  ``memory``), a jailed VMM's tasks are bounded by ``RLIMIT_NPROC`` of its own uid.
* A spawn's groups are cheap: a parent is made ready once per process, a child's
  groups cost their own ``mkdir`` and writes (``_ready_parent``, ``_files_of``).
* ``rmdir`` removes a group only once it has no processes; right after the last
  member is reaped it can still be briefly busy, so removal retries on EBUSY.
* A child's join is a migration, and migrations take the kernel's global
  ``cgroup_threadgroup_rwsem`` for writing. Kept in its fast (per-CPU) mode, that
  waits for an RCU grace period each time on the kernels of Debian 12 and other 6.1
  hosts: ~14 ms of a lone native child's ~16 ms set-up in the emulated test host,
  CPU it does not use. cgroup2's ``favordynmods`` (Linux 6.0) keeps the lock in its
  slow mode, which the kernel's documentation recommends for this pattern (groups
  made and joined all the time) at some cost to every fork and exit. The first
  process to ready a parent group turns it on, once (``favor_dynamic_moves``), unless
  ``VMFORK_CGROUP_FAVOR_DYNMODS=0``; the remount keeps the mount's other options.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import functools
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

DEFAULT_PARENT = "vmfork"
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_REMOVE_RETRY_S = 2.0


class CgroupError(Exception):
    """A cgroup operation failed. ``op`` names the step, ``path`` the file or directory."""

    def __init__(self, message: str, *, op: str, path: str | None = None,
                 errno: int | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.path = path
        self.errno = errno


class CgroupUnavailable(CgroupError):
    """A memory limit was asked for, but this host has no usable memory controller."""


class CgroupBusy(CgroupError):
    """The group still has processes (rmdir refused, or a live group of that name exists)."""


@dataclass(frozen=True)
class MemoryHierarchy:
    """Where the memory controller lives: its version and its mount point."""

    version: Literal[1, 2]
    root: Path

    @property
    def limit_file(self) -> str:
        return "memory.max" if self.version == 2 else "memory.limit_in_bytes"


@dataclass(frozen=True)
class ChildCgroup:
    """One child's group. ``path`` is absolute; ``name`` is relative to the hierarchy root.
    ``others``: on v1, the child's groups of the same name in the ``pids`` and ``cpu``
    hierarchies (each a hierarchy of its own there), joined and removed with it."""

    hierarchy: MemoryHierarchy
    path: Path
    limit_bytes: int
    others: tuple[Path, ...] = ()

    @property
    def paths(self) -> tuple[Path, ...]:
        return (self.path, *self.others)

    @property
    def name(self) -> str:
        return "/" + str(self.path.relative_to(self.hierarchy.root))


@dataclass(frozen=True)
class OomInfo:
    """OOM evidence read from a group. ``oom_kills`` is None where the kernel has no counter."""

    oom_kills: int | None
    limit_hits: int

    @property
    def oom_killed(self) -> bool:
        if self.oom_kills is not None:
            return self.oom_kills > 0
        return self.limit_hits > 0


@dataclass(frozen=True)
class SweepReport:
    removed: tuple[str, ...]
    busy: tuple[str, ...]


def _mountinfo_entries(text: str) -> list[tuple[str, str, str, str]]:
    """(mount point, fs type, super options, the mount's own options) for each line of
    /proc/self/mountinfo."""
    out: list[tuple[str, str, str, str]] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        rfields = right.split()
        if len(fields) < 6 or len(rfields) < 3:
            continue
        mount_point = fields[4].replace("\\040", " ")
        out.append((mount_point, rfields[0], rfields[2], fields[5]))
    return out


def detect_from(mountinfo: str) -> MemoryHierarchy | None:
    """Pick the memory hierarchy from a mountinfo text: v2 with memory first, then v1."""
    entries = _mountinfo_entries(mountinfo)
    for mount_point, fstype, _, _ in entries:
        if fstype != "cgroup2":
            continue
        try:
            controllers = Path(mount_point, "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "memory" in controllers:
            return MemoryHierarchy(2, Path(mount_point))
    for mount_point, fstype, options, _ in entries:
        if fstype == "cgroup" and "memory" in options.split(","):
            return MemoryHierarchy(1, Path(mount_point))
    return None


def v1_controllers_from(mountinfo: str, names: tuple[str, ...] = ("pids", "cpu")
                        ) -> dict[str, Path]:
    """Where each v1 controller of ``names`` is mounted (``cpu`` is often co-mounted
    with ``cpuacct``: ``/sys/fs/cgroup/cpu,cpuacct``), from a mountinfo text."""
    found: dict[str, Path] = {}
    for mount_point, fstype, options, _ in _mountinfo_entries(mountinfo):
        if fstype != "cgroup":
            continue
        for name in names:
            if name in options.split(",") and name not in found:
                found[name] = Path(mount_point)
    return found


@functools.cache
def v1_controllers() -> dict[str, Path]:
    """This host's v1 ``pids`` and ``cpu`` hierarchies (probed once per process)."""
    try:
        return v1_controllers_from(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return {}


V1_DEFAULT_SHARES = 1024
V2_DEFAULT_WEIGHT = 100


def shares_for_weight(weight: int) -> int:
    """v1 ``cpu.shares`` for a v2 ``cpu.weight``: the defaults map onto each other
    (100 is 1024), proportionally, within v1's 2..262144."""
    return max(2, min(262144, weight * V1_DEFAULT_SHARES // V2_DEFAULT_WEIGHT))


@functools.cache
def detect() -> MemoryHierarchy | None:
    """The host's memory hierarchy (probed once per process), or None if there is none."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    return detect_from(text)


def require() -> MemoryHierarchy:
    """The memory hierarchy, or a CgroupUnavailable that says what to do."""
    found = detect()
    if found is None:
        raise CgroupUnavailable(
            "a memory limit was requested but no cgroup memory controller is mounted "
            "(neither cgroup v2 with 'memory' in cgroup.controllers nor a v1 'memory' "
            "hierarchy in /proc/self/mountinfo); mount one, or spawn without "
            "memory_limit_mib", op="detect")
    return found


def validate_name(name: str, what: str = "vm_id") -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid {what} {name!r}: use 1-64 characters from "
                         "[A-Za-z0-9_.-], not starting with '.' or '-'")
    return name


def validate_parent(parent: str) -> str:
    """A parent group path relative to the hierarchy root, e.g. ``vmfork`` or ``a/b``."""
    parts = parent.strip("/").split("/")
    for part in parts:
        validate_name(part, "cgroup_parent component")
    return "/".join(parts)


def _write(path: Path, value: str, op: str) -> None:
    # One write(2) of the whole value, as the kernel's cgroup files want, and none of
    # the text layers open() would build for it (a child's group takes four of these).
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
    except OSError as err:
        raise CgroupError(f"cgroup {op}: writing {value!r} to {path} failed: "
                          f"{os.strerror(err.errno or 0)}", op=op, path=str(path),
                          errno=err.errno) from err


def parent_path(h: MemoryHierarchy, parent: str = DEFAULT_PARENT) -> Path:
    return h.root / validate_parent(parent)


def ensure_parent(h: MemoryHierarchy, parent: str = DEFAULT_PARENT) -> Path:
    """Create the parent group (and its ancestors); on v2 delegate memory down to it."""
    if h.version == 1:
        return _ready_parent(h.root / validate_parent(parent))
    return _ready_parent(h.root / validate_parent(parent),
                         functools.partial(_delegate_offered, h.root))


_ready_parents: set[Path] = set()
"""Parent groups this process made ready (``_ready_parent``)."""
_child_files: dict[Path, frozenset[str]] = {}
"""Per parent group, the files of a child's group (``_files_of``)."""


FAVOR_DYNMODS_ENV = "VMFORK_CGROUP_FAVOR_DYNMODS"
_MS_REMOUNT = 32
# mount(2)'s flag for each of a mount's own options (mountinfo's sixth field): a
# remount sets exactly the flags it is given, so each one the mount has is given again.
_MOUNT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "nosymfollow": 256,
                "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21,
                "strictatime": 1 << 24}


def cgroup2_mount(mountinfo: str) -> tuple[str, list[str], list[str]] | None:
    """The first cgroup2 mount of a mountinfo text: its mount point, its own options
    (mountinfo's sixth field) and its super options; None if there is none."""
    for mount_point, fstype, super_options, mount_options in _mountinfo_entries(mountinfo):
        if fstype == "cgroup2":
            return mount_point, mount_options.split(","), super_options.split(",")
    return None


def favordynmods_offered() -> bool:
    """Whether this kernel offers cgroup2's ``favordynmods`` (Linux 6.0)."""
    try:
        return "favordynmods" in Path("/sys/kernel/cgroup/features").read_text().split()
    except OSError:
        return False


def favor_dynmods_remount(mountinfo: str) -> tuple[str, int, str] | None:
    """The remount of the first cgroup2 mount of a mountinfo text that turns
    ``favordynmods`` on: ``(mount point, mount(2) flags, data)``. The data repeats the
    mount's cgroup2 options, since a remount clears those it is not given. None when
    it is on already, when there is no cgroup2 mount, or when the mount is read-only
    (a container's view: not this process's to change)."""
    mount = cgroup2_mount(mountinfo)
    if mount is None:
        return None
    target, mount_options, super_options = mount
    options = [o for o in super_options if o not in ("rw", "ro")]
    if "ro" in mount_options or "ro" in super_options or "favordynmods" in options:
        return None
    flags = _MS_REMOUNT
    for option in mount_options:
        flags |= _MOUNT_FLAGS.get(option, 0)
    return target, flags, ",".join([*options, "favordynmods"])


@functools.cache
def favor_dynamic_moves() -> str:
    """Turn cgroup2's ``favordynmods`` on (module docstring), once per process; what
    happened, for the log. Never raises: without it a join is slower, not wrong."""
    if os.environ.get(FAVOR_DYNMODS_ENV, "1") == "0":
        return f"left as it is ({FAVOR_DYNMODS_ENV}=0)"
    if not favordynmods_offered():
        return "not offered by this kernel"
    try:
        remount = favor_dynmods_remount(Path("/proc/self/mountinfo").read_text())
    except OSError as err:
        return f"not known: {err}"
    if remount is None:
        return "on already, or no cgroup2 mount of ours to change"
    target, flags, data = remount
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"cgroup2", os.fsencode(target), b"cgroup2", ctypes.c_ulong(flags),
                  data.encode()) != 0:
        return f"the remount of {target} was refused: {os.strerror(ctypes.get_errno())}"
    log.info("cgroup2 at %s now favours dynamic changes (favordynmods): a child's join "
             "no longer waits for an RCU grace period; %s=0 leaves it off",
             target, FAVOR_DYNMODS_ENV)
    return "turned on"


def _ready_parent(target: Path, prepare: Callable[[Path], None] | None = None) -> Path:
    """``target`` (and its ancestors) made, and ``prepare``d, once per process: a
    child's group then costs its own mkdir and writes only (its parent's ``mkdir -p``
    and a stat per optional knob were ~7 of a child's ~15 ms of cgroup calls in the
    emulated test host). A parent removed since (a sweep, an operator) is made again:
    ``_make_group``."""
    if target in _ready_parents:
        return target
    favor_dynamic_moves()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CgroupError(f"cgroup mkdir: cannot create {target}: {os.strerror(err.errno or 0)} "
                          "(run as root, or pass a cgroup_parent delegated to this user)",
                          op="mkdir", path=str(target), errno=err.errno) from err
    if prepare is not None:
        prepare(target)
    _ready_parents.add(target)
    return target


def _delegate_offered(root: Path, target: Path) -> None:
    """memory, and each of ``_OPTIONAL_V2`` the hierarchy offers, delegated down to
    ``target``: read when a parent is made ready, not at every child's group."""
    offered = (root / "cgroup.controllers").read_text().split()
    _delegate(root, ("memory", *(c for c in _OPTIONAL_V2 if c in offered)), target)


def _delegate(root: Path, controllers: tuple[str, ...], target: Path) -> None:
    """``controllers`` enabled from ``root`` down to ``target`` (its children get
    them)."""
    node = root
    for part in [*target.relative_to(root).parts, None]:
        control = node / "cgroup.subtree_control"
        enabled = control.read_text().split()
        for controller in controllers:
            if controller not in enabled:
                _write(control, f"+{controller}", f"enable-{controller}")
        if part is None:
            break
        node = node / part


_OPTIONAL_V2 = ("pids", "cpu")
"""v2 controllers a child's group also gets where the hierarchy offers them."""


def _make_group(ready_parent: Callable[[], Path], name: str) -> Path:
    """The group ``name`` made in ``ready_parent()``, in place of an empty leftover (a
    crashed spawner's); CgroupBusy where a live group holds the name."""
    group = ready_parent() / name
    retried = False
    while True:
        try:
            group.mkdir()
            return group
        except FileNotFoundError as err:
            if retried:
                raise _mkdir_failed(group, err) from err
            _ready_parents.discard(group.parent)   # removed since it was made ready
            ready_parent()
        except FileExistsError as err:
            live = _procs(group)
            if live or retried:
                raise CgroupBusy(f"cgroup {group} already exists and has processes {live}: "
                                 f"another child with vm_id {name!r} is alive", op="mkdir",
                                 path=str(group), errno=errno_mod.EEXIST) from err
            _rmdir(group)
        except OSError as err:
            raise _mkdir_failed(group, err) from err
        retried = True


def _mkdir_failed(group: Path, err: OSError) -> CgroupError:
    return CgroupError(f"cgroup mkdir: cannot create {group}: {os.strerror(err.errno or 0)}",
                       op="mkdir", path=str(group), errno=err.errno)


def _files_of(group: Path) -> frozenset[str]:
    """The files of ``group``, a child of its parent: the same for every child of one
    parent (its controllers, whether swap is accounted), so listed once, from the
    first, instead of a stat per optional knob for each."""
    files = _child_files.get(group.parent)
    if files is None:
        files = _child_files[group.parent] = frozenset(os.listdir(group))
    return files


def _set_weight(group: Path, knob: str, value: int | None, default: int) -> None:
    """``cpu.weight``/``cpu.shares`` of a group just made: a value equal to the
    default is already there."""
    if value is not None and value != default:
        _write(group / knob, str(value), f"set-{knob}")


def _create_v1_others(cg: ChildCgroup, vm_id: str, parent: str, pids_max: int | None,
                      cpu_weight: int | None) -> ChildCgroup:
    """On v1, the child's groups in the ``pids`` and ``cpu`` hierarchies where the host
    mounts them (in the memory group itself where one is co-mounted with memory),
    with ``pids.max`` and ``cpu.shares``: ``cg`` with them. On failure the groups
    made here are removed (the caller removes the memory group)."""
    shares = None if cpu_weight is None else shares_for_weight(cpu_weight)
    made: list[Path] = []
    try:
        for name, value in (("pids", pids_max), ("cpu", shares)):
            root = v1_controllers().get(name)
            if value is None or root is None:
                continue
            group = cg.path if root == cg.hierarchy.root else _make_group(
                functools.partial(_ready_parent, root / validate_parent(parent)), vm_id)
            if group != cg.path:
                made.append(group)
            if name == "pids":
                _write(group / "pids.max", str(value), "set-pids.max")
            else:
                _set_weight(group, "cpu.shares", value, V1_DEFAULT_SHARES)
    except BaseException:
        for group in made:
            try:
                _rmdir(group, 0.0)
            except CgroupError:
                pass
        raise
    return ChildCgroup(cg.hierarchy, cg.path, cg.limit_bytes, (*cg.others, *made))


def _procs(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def create(h: MemoryHierarchy, vm_id: str, limit_bytes: int,
           parent: str = DEFAULT_PARENT, *, pids_max: int | None = None,
           cpu_weight: int | None = None) -> ChildCgroup:
    """Make ``<parent>/<vm_id>`` with a memory limit of ``limit_bytes`` and, on v2
    where the controllers are delegated, ``pids.max`` and ``cpu.weight`` (1-10000).

    An empty leftover group of the same name (a crashed spawner's) is replaced; a
    group that still has processes is CgroupBusy.
    """
    validate_name(vm_id)
    if limit_bytes <= 0:
        raise ValueError(f"memory limit must be positive, got {limit_bytes} bytes")
    path = _make_group(functools.partial(ensure_parent, h, parent), vm_id)
    cg = ChildCgroup(h, path, limit_bytes)
    try:
        _write(path / h.limit_file, str(limit_bytes), "set-limit")
        files = _files_of(path)
        if h.version == 1:
            if "memory.memsw.limit_in_bytes" in files:
                _write(path / "memory.memsw.limit_in_bytes", str(limit_bytes),
                       "set-memsw-limit")
            cg = _create_v1_others(cg, vm_id, parent, pids_max, cpu_weight)
        else:
            if "memory.swap.max" in files:
                _write(path / "memory.swap.max", "0", "set-swap-max")
            if "memory.oom.group" in files:
                _write(path / "memory.oom.group", "1", "set-oom-group")
            if pids_max is not None and "pids.max" in files:
                _write(path / "pids.max", str(pids_max), "set-pids-max")
            if "cpu.weight" in files:
                _set_weight(path, "cpu.weight", cpu_weight, V2_DEFAULT_WEIGHT)
    except BaseException:
        remove(cg)
        raise
    return cg


def join(cg: ChildCgroup, pid: int) -> None:
    """Move process ``pid`` (all its threads) into the group (on v1, into each of its
    hierarchies' groups)."""
    for path in cg.paths:
        _write(path / "cgroup.procs", str(pid), "join")


def procs(cg: ChildCgroup) -> list[int]:
    return sorted({pid for path in cg.paths for pid in _procs(path)})


def read_oom(cg: ChildCgroup) -> OomInfo:
    """OOM evidence for the group: kill count where the kernel has one, and limit hits."""
    h = cg.hierarchy
    try:
        if h.version == 2:
            fields = _keyed(cg.path / "memory.events")
            return OomInfo(fields.get("oom_kill", 0), fields.get("max", 0))
        fields = _keyed(cg.path / "memory.oom_control")
        # With swap accounting the memsw counter is charged (and fails) first.
        hits = [int((cg.path / name).read_text())
                for name in ("memory.failcnt", "memory.memsw.failcnt")
                if name == "memory.failcnt" or (cg.path / name).exists()]
        return OomInfo(fields.get("oom_kill"), max(hits))
    except OSError as err:
        raise CgroupError(f"cgroup read-oom: cannot read OOM counters of {cg.path}: "
                          f"{os.strerror(err.errno or 0)}", op="read-oom", path=str(cg.path),
                          errno=err.errno) from err


def _keyed(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def kill_all(cg: ChildCgroup, sig: int) -> None:
    """Signal every process in the group (catches grandchildren that left the process group)."""
    if cg.hierarchy.version == 2 and sig == 9 and (cg.path / "cgroup.kill").exists():
        _write(cg.path / "cgroup.kill", "1", "kill")
        return
    for pid in procs(cg):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _rmdir(path: Path, timeout: float = _REMOVE_RETRY_S) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno_mod.EBUSY or time.monotonic() >= deadline:
                cls = CgroupBusy if err.errno == errno_mod.EBUSY else CgroupError
                raise cls(f"cgroup rmdir: cannot remove {path}: {os.strerror(err.errno or 0)}"
                          f" (processes still inside: {_procs(path)}; kill them first)",
                          op="rmdir", path=str(path), errno=err.errno) from err
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def remove(cg: ChildCgroup, timeout: float = _REMOVE_RETRY_S) -> None:
    """Remove the group (and its v1 ``pids``/``cpu`` groups) once its processes are gone
    (retrying briefly on EBUSY)."""
    for path in reversed(cg.paths):
        _rmdir(path, timeout)


def _other_roots(h: MemoryHierarchy) -> list[Path]:
    """Where a child's ``others`` live beside a v1 memory hierarchy (``_create_v1_others``)."""
    if h.version == 2:
        return []
    return [r for r in dict.fromkeys(v1_controllers().values()) if r != h.root]


def remove_parent(h: MemoryHierarchy, parent: str) -> None:
    """Remove an (empty) parent group, in the ``pids``/``cpu`` hierarchies too."""
    for root in [h.root, *_other_roots(h)]:
        target = root / validate_parent(parent)
        _ready_parents.discard(target)
        _child_files.pop(target, None)
        try:
            os.rmdir(target)
        except FileNotFoundError:
            pass


def list_groups(h: MemoryHierarchy, parent: str = DEFAULT_PARENT) -> list[str]:
    """Names of the child groups under ``parent`` (for leak checks and sweeps)."""
    try:
        return sorted(e.name for e in os.scandir(parent_path(h, parent)) if e.is_dir())
    except FileNotFoundError:
        return []


def sweep_stale(active_ids: set[str] | frozenset[str], *, parent: str = DEFAULT_PARENT,
                kill: bool = False, hierarchy: MemoryHierarchy | None = None) -> SweepReport:
    """Remove child groups under ``parent`` whose vm_id is not in ``active_ids``.

    For crash recovery: after a spawner restart, groups of children nobody tracks
    are leftovers. Empty ones are removed. Ones that still hold processes are left
    alone and reported as busy, unless ``kill`` is set: then their processes are
    SIGKILLed first (only do that when ``parent`` is owned by this spawner alone).
    """
    h = hierarchy or detect()
    if h is None:
        return SweepReport((), ())
    removed: list[str] = []
    busy: list[str] = []
    for name in list_groups(h, parent):
        if name in active_ids:
            continue
        others = tuple(root / validate_parent(parent) / name for root in _other_roots(h)
                       if (root / validate_parent(parent) / name).is_dir())
        cg = ChildCgroup(h, parent_path(h, parent) / name, 0, others)
        if procs(cg) and kill:
            kill_all(cg, 9)
        try:
            remove(cg, timeout=1.0 if kill else 0.0)
            removed.append(name)
        except CgroupError:
            busy.append(name)
    return SweepReport(tuple(removed), tuple(busy))
