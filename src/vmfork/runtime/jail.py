"""The jail of one VMM process, built by the process itself right after fork.

A VMM runs a guest that runs untrusted code, and its device emulation parses what
the guest writes. If that code has a bug, the jail is what stands between the guest and
the host. The steps run natively (``native/src/child.rs``, ``ChildPlan.enter_jail``),
from a plan this module builds before the fork (``plan(spec)``: in the zygote, once per
spawn; ``enter(spec)`` for a parent VMM, which builds and enters it at once), so a
jailed child builds its jail without touching a Python object of the zygote's; the
descriptors opened before the drop come back to ``vmm/openfiles.py``'s registries
(``adopt``), which also empties ``os.environ`` (Python's copy of the environment). In
this order (each step needs the privileges the next ones drop):

0. **The sandbox's network**, when it has one: ``setns`` into its network namespace
   and attach to its tap there (``vmm/openfiles.preopen_tap``), while the process still
   has the capabilities both need; the VMM later takes that descriptor instead of
   opening ``/dev/net/tun`` (which the jail does not hold). A zygote child joins it
   first thing (its set-up's step 0), through the host's root that a zygote in a
   mount namespace of its own keeps (``host_root``), before its set-up closes every
   inherited descriptor, that one among them; a jail never holds it
   (``_let_go_of_host_root``).
1. **Namespaces.** A VMM without a network of its own joins an empty network
   namespace the zygote made once (``hold_empty_netns``): no interface but a loopback
   that is down, no route to the host or anywhere, none of the host's abstract Unix
   sockets. Made once and shared, because ``unshare(CLONE_NEWNET)`` per spawn costs
   milliseconds (a namespace to build, and one to tear down at exit), a ``setns`` into
   a held one microseconds; its only peers are other jailed VMMs, which have nothing
   listening in it. (Without a held one, as for a parent VMM, it unshares its own.)
   Then ``unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)``: a mount
   table, System V IPC and host name of its own. The PID namespace comes before, from
   the zygote's fork (``PidNamespaces``: the process is pid 1 of a namespace of its
   own), since ``unshare`` of one moves only the caller's children. Every mount is
   made private first, so nothing done here propagates back to the host.
2. **A new root** on a small tmpfs at ``spec.root`` (nosuid, nodev) holding only:
   ``spec.read_only`` paths (the snapshot's files, the disk images) bound read-only,
   nosuid and nodev at the same paths; the Python installation and vmfork's source
   (so that a late import still works) through the zygote's ``SharedTree`` (bound once
   by the zygote, read-only, nosuid and nodev, in a mount namespace of its own: the
   jail binds it whole at ``SHARED_AT`` with one ``MS_BIND | MS_REC`` and shows each of
   its paths at its own place through a symbolic link into it, placed at the shallowest
   directory above the path that holds nothing else of the jail's (``/usr`` for
   ``/usr/lib/python3.11``), so a child makes no directory the tree already has (the
   new root is laid out once per plan: ``child.rs``'s ``RootPlan``); a jail without
   one, a parent VMM's, binds them one by one like the rest); ``spec.writable`` (the run directory)
   bound read-write; and a ``/proc`` of its own PID namespace (``hidepid=invisible``
   besides, for a jail entered without one: a jailed parent VMM). No device node: the
   devices it uses (``spec.devices``: ``/dev/kvm``) are opened before the drop and
   reached through ``openfiles.open_device``, like the tap. ``pivot_root`` into it,
   the old root detached, the new root remounted read-only.
   *A zygote's children* do not each build that root: a batch's jailed children of one
   request join a **jail base** (``KeptBases``, ``native/src/child.rs``'s ``Base``),
   a mount namespace the zygote lays out, pivots into and detaches from once, on a
   thread of its own, with everything above but the run directory, the spawn's files
   beside it and ``/proc``, and an empty directory at the run directories' parent.
   Each child clones its run directory's mount and those files' while it still sees
   the host (``open_tree``), ``setns``es into the base, ``unshare``s a copy of that
   small tree (every mount in it private), mounts a tmpfs of its own over the parent
   (so no sibling's directory, not even its name, is there), moves its clones there
   (the files read-only) and mounts ``/proc`` of its own PID namespace: no copy of the
   zygote's whole tree and no old root to detach per child, each a wait behind every
   sibling for the kernel's namespace lock and an RCU grace period. The zygote keeps a base for the next batches of the same request while
   what it binds is unchanged (``KeptBases``); it goes away, mounts and all, once the
   zygote lets go of it and the last child has moved on to its own copy.
3. **Identity.** Capability bounding set emptied, no supplementary groups, then
   ``setresgid``/``setresuid`` to the jail's ids (an unused uid per sandbox, from the
   configured range): the kernel clears every capability at that change.
   ``PR_SET_NO_NEW_PRIVS``; ``PR_SET_DUMPABLE`` 0 (no ptrace or ``/proc/<pid>/mem`` by
   a peer of the same uid).
4. **Limits.** ``RLIMIT_NOFILE``, ``RLIMIT_NPROC`` (per uid, so per sandbox),
   ``RLIMIT_FSIZE``, ``RLIMIT_CORE`` 0. A clean environment.

The seccomp filter (``runtime/seccomp.py``) comes last, from the VMM's entry once its
machine is set up, since set-up uses calls the running VMM never needs.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import resource
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vmfork.vmm import openfiles

if TYPE_CHECKING:
    from vmfork._core import ChildPlan

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SYS_PIVOT_ROOT = 155

_libc = ctypes.CDLL(None, use_errno=True)


class JailError(OSError):
    """A step of the jail's set-up failed; ``step`` names it."""

    def __init__(self, step: str, err: int) -> None:
        super().__init__(err, f"jail: {step}: {os.strerror(err)}")
        self.step = step


@dataclass(frozen=True)
class JailSpec:
    root: str
    """An empty directory to build the jail's root in (a tmpfs is mounted on it)."""
    uid: int
    gid: int
    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("/dev/kvm",)
    """Character devices the VMM uses, opened before the drop (``openfiles.open_device``):
    the jail holds no device node."""
    shared: SharedTree | None = None
    """The zygote's tree of read-only paths every jail holds, bound whole; its paths are
    then not in ``read_only``."""
    nofile: int = 4096
    nproc: int = 512
    """Threads count: a VMM has one per vCPU, an I/O thread and a few helpers."""
    fsize: int = 1 << 40
    """A VMM writes BRANCH snapshots of its guest's RAM: large, but not unbounded."""
    hostname: str = "vmfork"
    env: dict[str, str] = field(default_factory=dict)
    preopen: tuple[str, ...] = ()
    preopen_rw: tuple[str, ...] = ()
    """Files opened read-write before the drop and never bound in: a sandbox's
    read-write volumes (``vmm/openfiles.open_rw``)."""
    """Files the VMM must read but its uid may not open (a snapshot's 0600
    ``memory.bin``): opened read-only before the drop (``vmm/openfiles.py``)."""
    netns: str | None = None
    """The sandbox's network namespace (``/run/netns/<name>``), joined before the drop."""
    tap: str | None = None
    """The tap in ``netns`` its virtio-net attaches to, opened before the drop."""


def _check(rc: int, step: str) -> None:
    if rc != 0:
        raise JailError(step, ctypes.get_errno())


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None, step: str) -> None:
    _check(_libc.mount(source.encode() if source else None, target.encode(),
                       fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                       data.encode() if data else None), step)


def _bind(host: str, inside: str, *, read_only: bool) -> None:
    """Bind ``host`` at ``inside`` (created to match: directory or file), then remount
    the bind with its flags (a bind mount ignores them on the first call)."""
    _make_mount_point(inside, os.path.isdir(host), set())
    _bind_at(host, inside, read_only=read_only)


def _bind_at(host: str, inside: str, *, read_only: bool) -> None:
    # Not MS_REC: mounts below ``host`` (the jail's own root when it sits in the run
    # directory, anything a host mounted there) stay out of the jail.
    _mount(host, inside, None, MS_BIND, None, f"bind {host}")
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    _mount(None, inside, None, flags, None, f"remount {host}")


def _make_dirs(path: str, made: set[str]) -> None:
    """``os.makedirs`` for a tree this process alone fills (the jail's fresh tmpfs):
    ``made`` remembers what exists, so no directory is looked up twice."""
    if path in made or path == "/":
        return
    _make_dirs(os.path.dirname(path), made)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    made.add(path)


def _make_mount_point(inside: str, is_dir: bool, made: set[str]) -> None:
    if is_dir:
        _make_dirs(inside, made)
    else:
        _make_dirs(os.path.dirname(inside), made)
        try:
            os.mknod(inside, stat.S_IFREG | 0o600)
        except FileExistsError:
            pass


SHARED_AT = "/.vmfork-shared"
"""Where a jail sees its zygote's ``SharedTree`` (inside the jail's root)."""


_host_root: int | None = None
"""The host mount namespace's root (an ``O_PATH`` descriptor), kept by a zygote that
took a mount namespace of its own: the paths the host makes after that (a sandbox's
network namespace, ``/run/netns/<name>``) are looked up through it."""
_host_root_id: tuple[int, int] = (0, 0)


def own_mount_namespace() -> bool:
    """Give this process (the zygote, once, as root, before it forks anything) a mount
    namespace of its own that sends no mount back: the ``SharedTree`` it mounts there is
    seen by no one else and goes away with the namespace, however the zygote ends. It
    receives the host's mounts only where propagation reaches (``MS_SLAVE``), and a
    host whose ``/run`` is private shares none, so a sandbox's network namespace (a bind
    mount in ``/run/netns`` made after the zygote started) is looked up from the host's
    root (``host_root``) instead, which a lookup through it sees as the host does.
    False if it cannot (no ``CAP_SYS_ADMIN``)."""
    global _host_root, _host_root_id
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    if _libc.unshare(CLONE_NEWNS) != 0:
        os.close(root)
        return False
    st = os.fstat(root)
    _host_root, _host_root_id = root, (st.st_dev, st.st_ino)
    _mount(None, "/", None, MS_REC | MS_SLAVE, None, "make the zygote's mounts slaves")
    return True


def host_root() -> int | None:
    """``own_mount_namespace``'s descriptor of the host's root, if it took one."""
    return _host_root


def host_root_plan() -> tuple[int, int, int] | None:
    """``host_root`` as a ``ChildPlan`` takes it: (descriptor, device, inode), the last
    two to let go of it only while it still is the host's root; None without one."""
    return None if _host_root is None else (_host_root, *_host_root_id)


def _let_go_of_host_root() -> None:
    """Forget the host's root and close its descriptor if it still is the host's root
    (``_core.let_go_of_host_root``, the jail's own step: a jail must not hold it, since
    ``openat`` from it walks the host's tree past any ``pivot_root``; a zygote child
    has closed it already with every inherited descriptor, and its number may be
    another file's by now)."""
    global _host_root
    fd, _host_root = _host_root, None
    if fd is not None:
        from vmfork import _core
        _core.let_go_of_host_root(fd, *_host_root_id)


class SharedTree:
    """The read-only paths every jail of a zygote holds (Python's installation and
    vmfork's source: ``python_paths``), bound once by the zygote on a small read-only
    tmpfs at ``path`` in its own mount namespace (``own_mount_namespace``), instead of
    once per jail. A jail binds the whole tree (``MS_BIND | MS_REC``: one mount, whose
    copies keep the read-only, nosuid and nodev flags they were made with) at
    ``SHARED_AT`` and shows each path at its own place through a symbolic link into it
    (at the shallowest directory above it holding nothing else of the jail's), on
    its own root (read-only too once it is built)."""

    def __init__(self, path: str, paths: tuple[str, ...]) -> None:
        self.path = path
        self.paths = _outermost(paths)
        self.base_at = path + "-base"
        """An empty directory a jail base's root is mounted on (``KeptBases``), in the
        base's own mount namespace only."""

    @classmethod
    def build(cls, path: str, paths: tuple[str, ...]) -> SharedTree:
        """Mount and fill the tree at ``path`` (made if missing; left empty by ``close``).
        Raises ``JailError`` with nothing left mounted."""
        tree = cls(path, tuple(p for p in paths if os.path.isdir(p)))
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.makedirs(tree.base_at, mode=0o700, exist_ok=True)
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755",
               "tmpfs for the shared tree")
        try:
            for shared in tree.paths:
                _bind(shared, path + shared, read_only=True)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
                   None, "remount the shared tree read-only")
            # Private: nothing the host mounts below these paths later reaches a jail.
            _mount(None, path, None, MS_REC | MS_PRIVATE, None, "make the shared tree private")
        except BaseException:
            tree.close()
            raise
        return tree

    def close(self) -> None:
        """Unmount the tree (its binds with it) and remove its mount point and the
        jail bases' one."""
        _libc.umount2(self.path.encode(), MNT_DETACH)
        for path in (self.path, self.base_at):
            try:
                os.rmdir(path)
            except OSError:
                pass


def _outermost(paths: tuple[str, ...]) -> tuple[str, ...]:
    """``paths`` without those under another of them (seen through it), parents first."""
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(path.startswith(parent.rstrip("/") + "/") for parent in kept):
            kept.append(path)
    return tuple(kept)


_empty_netns: int | None = None
"""A descriptor of the zygote's empty network namespace, inherited by every child."""


def hold_empty_netns() -> bool:
    """Make the empty network namespace jailed VMMs without a network join, and keep a
    descriptor of it (the zygote, once, as root, before it forks anything). False if
    this process cannot make one (no ``CAP_SYS_ADMIN``); a jail then makes its own."""
    global _empty_netns
    if _empty_netns is not None:
        return True
    own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            return False
        try:
            _empty_netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            # Back at once: the zygote itself stays where it was.
            _check(_libc.setns(own, CLONE_NEWNET), "setns back to the zygote's network "
                   "namespace")
    finally:
        os.close(own)
    return True


def check_netns(name: object) -> str:
    """``name``, if it names a sandbox's network namespace (what ``runtime.network``
    creates), which a child's set-up joins; else ``JailError``."""
    from vmfork.runtime.network import NetworkError, _validate_netns_name
    if not isinstance(name, str):
        raise JailError(f"a network namespace's name is a string, not {name!r:.40}",
                        errno.EINVAL)
    try:
        _validate_netns_name(name)
    except NetworkError as err:
        raise JailError(f"join network namespace {name}: {err}", errno.EINVAL) from None
    return name


KEPT_BASES = 8
"""How many jail bases a zygote keeps (``KeptBases``): one per jail request and mount
point its spawners use (a daemon's spawns share one of each per snapshot
and volume set), least recently used first out."""


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


class KeptBases:
    """The zygote's jail bases (``native/src/child.rs``'s ``Base``), kept across
    batches: a mount namespace holding the root every jail of a request would lay out
    alike (its read-only paths and the shared tree, an empty ``/proc`` and an empty
    run directories' parent), built, pivoted into and detached from once, which each
    child joins to attach its own run directory, the spawn's files beside it (the
    spawner's FIFOs, never in a base) and ``/proc``. A base costs its build (~6 ms of
    a lone spawn in the emulated test host) once, not once per batch.

    A base shows what its read-only paths were when it was built, so it is kept by
    what it binds (the paths, the shared tree, the run directories' parent) and by
    each path's identity then (``st_dev``, ``st_ino``, or missing): a path replaced
    (a snapshot published again under the same name), removed or made since is a new
    inode, and the base is built again. A path removed on the host drops its mount in
    the base too (the kernel detaches a mount whose mount point another namespace
    unlinks), so a kept base holds no deleted snapshot's blocks. At most ``capacity``
    are kept; the descriptors are the base's only holders besides the children that
    joined it, and ``close`` lets every one go."""

    def __init__(self, capacity: int = KEPT_BASES) -> None:
        self.capacity = capacity
        # key -> (namespace fd, root fd, identities); in order of use, oldest first.
        self._kept: dict[tuple[object, ...], tuple[int, int, tuple[tuple[int, int] | None,
                                                                     ...]]] = {}
        self.built = 0
        """Bases built so far (the tests read it)."""

    def get(self, spec: JailSpec, mount_point: str) -> tuple[int, int, str]:
        """The base for ``spec``'s jails whose run directories are under ``mount_point``
        (their parent, or ``jail.runs_in`` above it, where every spawn's are): the
        namespace's descriptor and its root's, owned here, and ``mount_point``, as
        ``plan`` takes them. Needs the zygote's ``SharedTree`` (its directory is where a
        base is built). Raises ``JailError``."""
        from vmfork import _core
        if spec.shared is None:
            raise JailError("a jail base needs the zygote's shared tree", errno.EINVAL)
        # What is under the mount point is one batch's (the spawner's FIFOs beside its
        # run directories): each child binds it (``native/src/child.rs``'s
        # ``base_places``), so it is not in the base, which the next batches join.
        point = mount_point.rstrip("/")
        read_only = sorted({p for p in spec.read_only
                            if p != point and not p.startswith(point + "/")}, key=len)
        key = (frozenset(read_only), spec.shared.base_at, spec.shared.path,
               tuple(spec.shared.paths), point)
        identities = tuple(_identity(p) for p in read_only)
        kept = self._kept.pop(key, None)
        if kept is not None:
            if kept[2] == identities:
                self._kept[key] = kept
                return kept[0], kept[1], point
            self._close(kept)
        fd, root = _core.jail_base(JailError, spec.shared.base_at, read_only,
                                   (spec.shared.path, list(spec.shared.paths)), [point])
        self.built += 1
        self._kept[key] = (fd, root, identities)
        while len(self._kept) > self.capacity:
            self._close(self._kept.pop(next(iter(self._kept))))
        return fd, root, point

    def __len__(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        while self._kept:
            self._close(self._kept.popitem()[1])

    @staticmethod
    def _close(kept: tuple[int, int, object]) -> None:
        os.close(kept[0])
        os.close(kept[1])


def plan(spec: JailSpec, set_up: tuple[int, int | None, list[str], str | None, int] | None = None,
         base: tuple[int, int, str] | None = None) -> ChildPlan:
    """The native plan (``_core.ChildPlan``, ``native/src/child.rs``) of the jail
    ``spec`` and, for a zygote child, of its set-up (``zygote_child``: the zygote's pid,
    its pidfd for a PID namespace's first process, the ``cgroup.procs`` files to join,
    the log, the nice value): everything resolved here, before the fork, so the child runs the steps
    without building a Python object. ``base``: a jail base's descriptors and mount
    point (``KeptBases.get``, for this spec's request and run directory), which the child joins
    instead of building its own root. Raises ``JailError`` for a spec no jail can be
    built from."""
    from vmfork import _core
    return _core.ChildPlan(error=JailError, **plan_args(spec, set_up, base))


def plan_args(spec: JailSpec,
              set_up: tuple[int, int | None, list[str], str | None, int] | None = None,
              base: tuple[int, int, str] | None = None) -> dict[str, Any]:
    """``plan``'s ``ChildPlan`` arguments but ``error``, as plain values (a forker
    builds the plan from them: ``runtime/forker.py``)."""
    from vmfork.vmm.devices.virtio.net import valid_tap_name
    if spec.netns is not None:
        check_netns(spec.netns)
    if spec.tap is not None and not valid_tap_name(spec.tap):
        raise JailError(f"tap {spec.tap!r} is not a Linux interface name", errno.EINVAL)
    shared = None if spec.shared is None else (spec.shared.path, list(spec.shared.paths))
    return dict(
        set_up=set_up,
        jail=(spec.root, spec.uid, spec.gid, spec.hostname,
              (spec.nofile, spec.nproc, spec.fsize), last_capability()),
        paths=(sorted(set(spec.read_only), key=len), list(spec.writable), list(spec.devices),
               shared, [os.path.abspath(p) for p in spec.preopen],
               [os.path.abspath(p) for p in spec.preopen_rw]),
        tap=spec.tap if spec.netns is not None else None,
        host_root=host_root_plan(),
        held_netns=_empty_netns if set_up is not None else None, netns=spec.netns, base=base)


Opened = tuple[list[int], list[int], tuple[int, int], list[int], int | None]
"""What ``ChildPlan.enter_jail`` opened before the drop: (read-only files in
``preopen``'s order, read-write files likewise, (pagemap, clear_refs), devices, the
tap's or None)."""


def adopt(spec: JailSpec, opened: Opened) -> None:
    """Register the descriptors ``ChildPlan.enter_jail`` opened before the drop (the
    VMM takes them through ``vmm/openfiles.py``) and give Python the jail's clean
    environment: ``os.environ`` is Python's copy, which a native ``clearenv`` would
    leave stale, so it is emptied here, the jail's last step."""
    adopt_plain(adoption(spec), opened)


def adoption(spec: JailSpec) -> dict[str, Any]:
    """What ``adopt`` reads of ``spec``, as plain values (``adopt_plain``)."""
    return {"preopen": list(spec.preopen), "preopen_rw": list(spec.preopen_rw),
            "devices": list(spec.devices), "tap": spec.tap, "env": dict(spec.env)}


def adopt_plain(adopted: dict[str, Any], opened: Opened) -> None:
    """``adopt`` from ``adoption``'s values: how a forker's child adopts, whose
    zygote built no ``JailSpec`` for it (``runtime/forker.py``)."""
    ro, rw, (pagemap, clear_refs), devices, tap = opened
    openfiles.adopt(ro=zip(adopted["preopen"], ro), rw=zip(adopted["preopen_rw"], rw),
                    proc_self={"pagemap": (pagemap, os.O_RDONLY),
                               "clear_refs": (clear_refs, os.O_WRONLY)},
                    devices=zip(adopted["devices"], devices),
                    tap=None if tap is None or adopted["tap"] is None
                    else (adopted["tap"], tap))
    os.environ.clear()
    os.environ.update(adopted["env"])


def enter(spec: JailSpec) -> None:
    """Build the jail and move this process into it, for a process the zygote did not
    fork (a parent VMM): the native steps (``native/src/child.rs``), then ``adopt``.
    Raises ``JailError`` naming the step that failed; the process must then exit."""
    adopt(spec, plan(spec).enter_jail())


class PidNamespaces:
    """Each jailed child the zygote forks is the first process (pid 1) of a new PID
    namespace: it sees no other process of the host, so it can name (signal, trace,
    open in ``/proc``) none of them, a sibling sandbox included.

    ``unshare(CLONE_NEWPID)`` moves only the caller's *next* children, and a second one
    is refused while the first is pending, so the zygote brackets each jailed
    fork with ``before_fork`` (a new namespace for the child to come) and
    ``after_fork`` (``setns`` back to its own, so the next jailed fork gets a fresh
    one and an unjailed fork none). A plain ``fork()`` (``zygote_child.fork``), no raw
    ``clone``; a native batch (``_core.fork_native_batch``) brackets each of its forks
    the same way natively, returning to ``own``. What a namespace's first
    process changes (``zygote_child``): ``getppid()`` is 0 (the zygote is outside), and
    the kernel delivers it only the signals it has a handler for, besides SIGKILL and
    SIGSTOP from the zygote's namespace."""

    def __init__(self) -> None:
        self.own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        """The zygote's own PID namespace, a descriptor kept open."""

    def before_fork(self) -> None:
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")

    def after_fork(self) -> None:
        _check(_libc.setns(self.own, CLONE_NEWPID), "setns back to the zygote's PID namespace")


def become_pid_namespace_init() -> None:
    """Go on as pid 1 of a new PID namespace, for a process the zygote did not fork (a
    parent VMM, ``runtime/parent.py``): ``unshare(CLONE_NEWPID)`` then ``fork``; the
    caller's process stays outside only to wait for it and end as it ended (the same
    exit status, or killed by the same signal), and the new process dies with it.
    Call it before any thread exists."""
    import signal
    _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    pid = os.fork()
    if pid == 0:
        _check(_libc.prctl(1, signal.SIGKILL, 0, 0, 0), "die with the waiter")  # PDEATHSIG
        return
    for forwarded in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(forwarded, lambda signum, _frame: os.kill(pid, signal.SIGKILL))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


@functools.cache
def last_capability() -> int:
    """The host kernel's highest capability number (the bounding set ``enter`` empties).
    Read once per process: the zygote reads it before it forks, for every jail."""
    return int(Path("/proc/sys/kernel/cap_last_cap").read_text())


@functools.cache
def python_paths() -> tuple[str, ...]:
    """What this interpreter may still read after the pivot: its standard library
    (``lib-dynload`` included), its site-packages and vmfork's own source. Nothing
    else of ``sys.path``: an entry such as the working directory or ``/tmp`` would
    show the jail a whole host directory. The interpreter's own facts: worked out once
    per process (the zygote's, for each jailed spawn)."""
    import site
    import sys
    import sysconfig

    import vmfork

    paths = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
             *site.getsitepackages(), str(Path(vmfork.__file__).resolve().parents[1])}
    if site.ENABLE_USER_SITE and site.USER_SITE:
        paths.add(site.USER_SITE)
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    return tuple(sorted(p for p in paths if p and os.path.isabs(p) and p != "/"))


def problems() -> list[str]:
    """What this host lacks to build a jail (empty: it can). Probed in a throwaway
    child, so nothing here changes the caller."""
    out: list[str] = []
    if os.geteuid() != 0:
        out.append("not root: a jail needs CAP_SYS_ADMIN (namespaces, mounts) and "
                   "CAP_SETUID/CAP_SETGID (its own uid)")
        return out
    pid = os.fork()
    if pid == 0:
        code = 0
        if _libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
            code |= 1
        if _libc.prctl(21, 0, 0, 0, 0) < 0:   # PR_GET_SECCOMP
            code |= 2
        if _libc.unshare(CLONE_NEWPID) != 0:
            code |= 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0 or code & 1:
        out.append("unshare(mount, IPC, UTS namespaces) is refused here")
    if code > 0 and code & 2:
        out.append("this kernel has no seccomp filters")
    if code > 0 and code & 4:
        out.append("unshare(CLONE_NEWPID) is refused here (a PID namespace per VMM)")
    return out


def user_namespaces() -> str | None:
    """None if a new user namespace can be made here, else why not (probed by
    ``unshare(CLONE_NEWUSER)`` in a throwaway child, with the sysctls that forbid it)."""
    for path, bad in (("/proc/sys/user/max_user_namespaces", "0"),
                      ("/proc/sys/kernel/unprivileged_userns_clone", "0")):
        try:
            if Path(path).read_text().strip() == bad:
                return f"{path} is {bad}"
        except OSError:
            continue
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _libc.unshare(CLONE_NEWUSER) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return "unshare(CLONE_NEWUSER) is refused here"
    return None
