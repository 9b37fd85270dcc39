"""The spawner: a pre-imported, single-threaded process that forks VMM processes.

``python -m vmfork.runtime.zygote --socket PATH [--preload MOD ...]`` imports the
heavy modules once, then serves the JSON-lines protocol of ``zygote_protocol`` on
a Unix socket. A spawn is one ``fork()``: the child starts with every module
already imported, so it never pays interpreter start-up (DESIGN.md decision 1). A
KVM VM does not survive fork (it belongs to the mm that created it), so the
zygote holds no KVM fd when it forks (an entry's ``prefork`` hook may create and
close a VM to warm code up); each child creates its own VM in its entry.

Fork safety. ``fork()`` copies only the calling thread. A lock held by any other
thread at that instant stays locked forever in the child (the malloc arena lock,
the import lock, a logging handler's lock), so the zygote must never have a
second thread: not its own, not one started by a preloaded module or a C
extension. The count of ``/proc/self/task`` entries (which sees native threads
too, unlike ``threading``) is asserted to be 1 before every fork batch; a zygote
that grew a thread refuses to fork rather than produce children that hang. Since
there is nothing for CPython to repair after such a fork, the zygote forks without
CPython's after-fork work (``zygote_child.fork``, which checks the count again at
every fork): the child runs none of the ~53 Python-level after-fork calls, each a
page it would have copied.
Everything is therefore one ``selectors`` loop: the listening socket, client
connections, one pidfd per child, and a signal wakeup socket.

Reaping with pidfds. ``pidfd_open(pid)`` right after ``fork()`` is race-free
(nobody else can reap our child, so the pid cannot be recycled before we hold
the pidfd). A pidfd becomes readable when its process exits; the loop then calls
``waitid(P_PIDFD, fd, WEXITED)``, which reaps exactly that child exactly once and
can never collect a recycled pid. No SIGCHLD handler is needed. Signals go
through the pidfd as well (``pidfd_send_signal``). While a child is an unreaped
zombie its pid, and hence its process-group id, stays allocated, so
``killpg(pid)`` before ``waitid`` safely reaches only what the child left in its
group.

Leak safety: when a child ends (exit, kill, crash, OOM), the zygote kills what is
left of its process group and its cgroup, removes its cgroup directory and its
``run_dir`` (see below), and closes its pidfd. The zygote's own fds are never
inherited: each child closes everything above 2 (``zygote_child``).

Outliving the daemon, with a lease. The controller daemon starts its zygote in a
session of its own (not as a child that dies with it), so a daemon restart does
not kill the sandboxes: the new daemon connects to the same socket, lists the
children and re-adopts them. What keeps a crashed daemon from leaving VMs running
forever is the lease (``--lease-s``): a connection that sent ``lease`` holds it
while it stays open; once no holder is connected and no holder request has come
for ``lease_s`` seconds, the zygote kills every child and exits. The kernel
closes a dead daemon's sockets, so a crash starts the clock at once.

Entries: the zygote runs only the entries it registered at start, never an arbitrary
``module:function`` a request names (it would be code execution for anyone who can
reach its socket, and imports after start are what a jail cannot allow). A module
offers entries by listing their function names in ``ZYGOTE_ENTRIES``; the zygote
registers those of ``REGISTERED_MODULES`` and of each ``--entries-module``, importing
them before it serves. A spawn naming anything else is refused (``EntryNotAllowed``)
and nothing is imported for it.

Per-batch preparation: if the entry's module defines ``prefork(batch)``, the
zygote calls it with the list of the batch's ``args`` before forking, so work
that every child of the batch would repeat (decoding a snapshot) is done once
and inherited. It must leave no thread running and no KVM fd open; an exception
from it is logged and the batch is forked anyway. Then the zygote collects and
freezes its heap (``gc.collect`` + ``gc.freeze``): the collector in a child
never walks, and so never writes to, what the child inherited, and those pages
stay shared with the zygote instead of being copied into every child.

Jail: a spawn may carry ``jail: {uid, gid | uid_range, read_only: [path],
devices: [path]}`` (it needs a ``run_dir``); the child then builds
``runtime/jail.py``'s jail before its entry, rooted at ``<run_dir>/.jail-root``, with
the run directory writable and Python's own paths (``jail.python_paths()``)
read-only besides ``read_only``: those from one ``jail.SharedTree`` the zygote binds
once, at ``<socket>.jail`` in a mount namespace of its own, that each jail binds
whole. ``uid_range: [first, count]`` has the zygote pick the lowest uid of the range
that no live child of its holds (gid = uid), so no two sandboxes ever share a uid;
explicit ids must be positive.

``run_dir`` contract: if a spawn's ``args`` contain ``run_dir`` (an absolute path,
at least two levels below ``/``), the zygote creates that directory (mode 0700)
before forking if it does not exist, and removes the whole tree after the child
has been reaped. Put sockets and scratch files there; put a log you want to keep
(``log_path``) outside it. The log tail is read before the tree is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vmfork.image import disk_path
from vmfork.paths import cache_dir
from vmfork.runtime import cgroups, supervise
from vmfork.runtime.forker import Forker, ForkerGone, spare_quiet_ms
from vmfork.runtime.forker import wanted as forker_wanted
from vmfork.runtime.jail import (
    JailError,
    JailSpec,
    KeptBases,
    PidNamespaces,
    SharedTree,
    hold_empty_netns,
    last_capability,
    own_mount_namespace,
    python_paths,
)
from vmfork.runtime.volumes import VolumeError, volume_image_path
from vmfork.runtime.zygote_child import (
    NATIVE_CHILD,
    NATIVE_REFUSED,
    Entry,
    NativeChild,
    die_with_parent,
    fork_native_batch,
    native_fork,
    run_child,
    set_sigmask,
)
from vmfork.runtime.zygote_child import fork as fork_child
from vmfork.runtime.zygote_child import plan_args as plan_child_args
from vmfork.runtime.zygote_child import plan_of as plan_child_of
from vmfork.runtime.zygote_protocol import MAX_LINE, encode

if TYPE_CHECKING:
    from vmfork._core import NativeFork

log = logging.getLogger("vmfork.zygote")

DEFAULT_PRELOAD = ("vmfork.vmm.machine", "vmfork.runtime.vmmchild")
# glibc mallopt(M_ARENA_MAX): by default every thread that allocates gets its own
# malloc arena, each a few pages a child dirties for itself; a VMM child's threads
# run Python under one GIL anyway, so one shared arena costs nothing.
M_ARENA_MAX = -8
# prctl(PR_SET_THP_DISABLE): no transparent huge pages in this process's memory, a flag
# of the address space that every fork copies, so every child has it too. Where THP is
# "always" (many distributions' default), khugepaged collapses a 2 MiB-aligned range
# around a few touched pages into a new huge page: in a child, one of its own (the I/O
# thread's stack, on a 4 MiB block glibc reuses from a thread the zygote ran in its
# prefork, went from ~2 to ~4 MiB a few seconds into its idle life); in the zygote, a
# copy that leaves every live child the old pages of that range as its own (~0.5 MiB
# more a lone child, measured). Design notes, "A lone child's memory doubled by a huge
# page". Guest RAM is a file mapping, which this flag does not change.
PR_SET_THP_DISABLE = 41
EVENTS_KEPT = 10_000
JAIL_REQUESTS_KEPT = 16
FORKER_TIMEOUT_S = 30.0
FORKER_TIMEOUT_PER_CHILD_S = 2.0
"""How long a forker may take over a batch before the zygote gives up on it (a
forker forks ~1 child a millisecond natively; the emulated test host is ~50x slower)."""
_BLOCK_AT_FORK = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}


class RequestError(Exception):
    """A request the zygote refuses; ``type`` goes into the error reply."""

    def __init__(self, message: str, type: str = "BadRequest") -> None:
        super().__init__(message)
        self.type = type


@dataclass
class _Child:
    vm_id: str
    pid: int
    pidfd: int
    entry: str
    cgroup: cgroups.ChildCgroup | None
    log_path: str | None
    run_dir: str | None
    started_mono: float
    started_at: float
    kill_requested: bool = False
    jail_uid: int | None = None

    def info(self) -> dict[str, Any]:
        return {"vm_id": self.vm_id, "pid": self.pid, "entry": self.entry,
                "cgroup": self.cgroup.name if self.cgroup else None,
                "started_at": self.started_at, "log_path": self.log_path,
                "run_dir": self.run_dir}


@dataclass
class _Prepared:
    vm_id: str
    args: dict[str, Any]
    cgroup: cgroups.ChildCgroup | None
    log_path: str | None
    run_dir: str | None
    jail: JailSpec | None = None
    plan: Any = None
    """The child's ``_core.ChildPlan`` (``zygote_child.plan``), built here, not in it."""
    plan_args: dict[str, Any] | None = None
    """``plan``'s arguments as plain values (``zygote_child.plan_args``), for a forker."""


class _Slot:
    """One reply, in request order; ``reply`` is None until it is known (``wait``)."""

    __slots__ = ("reply",)

    def __init__(self, reply: dict[str, Any] | None = None) -> None:
        self.reply = reply


@dataclass
class _Conn:
    sock: socket.socket
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    slots: deque[_Slot] = field(default_factory=deque)
    writing: bool = False
    holds_lease: bool = False


CHILD_PIDS_MAX = 1024
"""Tasks (threads count) in a child's cgroup on v2: a VMM has one per vCPU, its I/O
and control threads, a live-BRANCH writer; far fewer than this, far more than a
fork bomb gets."""
CHILD_CPU_WEIGHT = 100
"""Every sandbox the same share of CPU under contention (cgroup v2's default, set
explicitly so that a parent group's weight is what decides sandboxes against the rest)."""


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@dataclass(frozen=True)
class _JailRequest:
    """A spawn's ``jail`` request, checked and resolved once for the children that ask
    the same (``Zygote._resolve_jail``): what they share (``spec``, its root and ids
    placeholders) and where each child's ids come from."""

    spec: JailSpec
    uid_range: tuple[int, int] | None
    runs_in: str | None = None
    """Where every spawn's run directories are, below their batch's directory (the
    daemon's ``run/``): a jail base there serves every batch of this request, where one
    at a batch's own directory serves that batch alone (``Zygote._jail_base``)."""
    spawn_files: tuple[str, ...] = ()
    """The read-only paths of the request below ``runs_in``: one spawn's own files (the
    spawner's FIFOs beside its run directories), bound into its jails like the rest,
    kept out of what is resolved once (``Zygote._resolve_jail``): every spawn has
    others. ``spec.read_only`` holds the rest."""


class _BatchJails:
    """A batch's jail bases, one per request and mount point (``Zygote._jail_base``),
    each looked up once in the zygote's kept ones (``jail.KeptBases``: a base serves later
    batches too); None where this batch could not have one."""

    def __init__(self) -> None:
        self.bases: dict[tuple[int, str], tuple[int, int, str] | None] = {}


def _jail_request(value: object, shared: SharedTree | None) -> _JailRequest:
    if not isinstance(value, dict) or set(value) - {"uid", "gid", "uid_range", "read_only",
                                                    "devices", "preopen", "preopen_rw",
                                                    "disk_keys", "volume_keys", "runs_in"}:
        raise RequestError("jail must be {uid, gid | uid_range, read_only: [path], "
                           "devices: [path], runs_in?: path}")
    runs_in = value.get("runs_in")
    if runs_in is not None and not (isinstance(runs_in, str) and os.path.isabs(runs_in)
                                    and ".." not in runs_in.split("/")
                                    and runs_in.strip("/")):
        raise RequestError(f"jail.runs_in must be an absolute path below /, got {runs_in!r:.80}")
    uid, gid = value.get("uid"), value.get("gid")
    uid_range = None
    if "uid_range" in value:
        span = value["uid_range"]
        if not (isinstance(span, list) and len(span) == 2
                and all(isinstance(v, int) and v > 0 for v in span)):
            raise RequestError("jail.uid_range must be [first uid, count], both positive")
        uid_range = (span[0], span[1])
        uid = gid = span[0]
    if not (isinstance(uid, int) and isinstance(gid, int) and uid > 0 and gid > 0):
        raise RequestError(f"jail.uid and jail.gid must be positive integers, got "
                           f"{uid!r}/{gid!r}: a jail never runs as root")
    paths: dict[str, tuple[str, ...]] = {}
    for key in ("read_only", "devices", "preopen", "preopen_rw"):
        paths[key] = _absolute_paths(value.get(key, []), key)
    # Root disks and read-only volumes by content key, in this zygote's cache (the one
    # its VMMs open them from): bound and opened before the drop, like the rest.
    content: list[str] = []
    cache = cache_dir()
    for key, place in (("disk_keys", disk_path), ("volume_keys", volume_image_path)):
        keys = value.get(key, [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise RequestError(f"jail.{key} must be a list of content keys")
        try:
            content += [str(place(k, cache)) for k in keys]
        except (ValueError, VolumeError) as err:
            raise RequestError(f"jail.{key}: {err}") from None
    paths["read_only"] += tuple(content)
    paths["preopen"] += tuple(content)
    # The environment is emptied; what vmfork reads from it (where its cache is) is
    # resolved here and passed on, nothing else of the daemon's environment is.
    env = {"VMFORK_CACHE_DIR": str(cache)}
    return _JailRequest(JailSpec(root="", uid=uid, gid=gid, read_only=(
        *(python_paths() if shared is None else ()), *paths["read_only"]), shared=shared,
        devices=paths["devices"] or ("/dev/kvm",), env=env, preopen=paths["preopen"],
        preopen_rw=paths["preopen_rw"]), uid_range,
        None if runs_in is None else os.path.normpath(runs_in))


def _absolute_paths(items: object, key: str) -> tuple[str, ...]:
    if not isinstance(items, list) or not all(
            isinstance(p, str) and os.path.isabs(p) and ".." not in p.split("/")
            for p in items):
        raise RequestError(f"jail.{key} must be a list of absolute paths")
    return tuple(items)


def _split_spawn_files(value: object) -> tuple[object, tuple[str, ...]]:
    """``value`` without the read-only paths below its ``runs_in`` (a spawn's own
    files: ``_JailRequest.spawn_files``), and those paths; ``value`` itself where it
    names none (or is not a request ``_jail_request`` accepts, which refuses it)."""
    if not isinstance(value, dict):
        return value, ()
    runs_in, read_only = value.get("runs_in"), value.get("read_only")
    if not (isinstance(runs_in, str) and os.path.isabs(runs_in) and isinstance(read_only, list)):
        return value, ()
    below = os.path.normpath(runs_in).rstrip("/") + "/"
    files = tuple(p for p in read_only if isinstance(p, str) and p.startswith(below))
    if not files:
        return value, ()
    _absolute_paths(list(files), "read_only")
    return {**value, "read_only": [p for p in read_only if p not in files]}, files


def _jail_spec(request: _JailRequest | None, run_dir: str | None, taken: set[int],
               args: dict[str, Any]) -> JailSpec | None:
    """One child's jail: ``request``'s, rooted in its ``run_dir``, with uids of its own
    (the lowest of the range no live child holds) and its network."""
    if request is None:
        return None
    if run_dir is None:
        raise RequestError("a jailed spawn needs args.run_dir (the jail's writable place)")
    uid = gid = request.spec.uid
    if request.uid_range is not None:
        first, count = request.uid_range
        free = next((u for u in range(first, first + count) if u not in taken), None)
        if free is None:
            raise RequestError(f"every uid of jail.uid_range {list(request.uid_range)} is "
                               "held by a live child", "Busy")
        uid = gid = free
    else:
        gid = request.spec.gid
    # A networked VMM's namespace and tap are in its args (one per child, where the
    # jail request is one per batch); the jail joins and opens them before the drop.
    netns, tap = args.get("netns"), args.get("net_tap")
    if not (netns is None or isinstance(netns, str)) or not (tap is None or isinstance(tap, str)):
        raise RequestError("args.netns and args.net_tap must be strings")
    return replace(request.spec, root=os.path.join(run_dir, ".jail-root"), uid=uid, gid=gid,
                   read_only=request.spec.read_only + request.spawn_files,
                   writable=(run_dir,), netns=netns, tap=tap)


def _validate_run_dir(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not os.path.isabs(value):
        raise RequestError(f"args.run_dir must be an absolute path, got {value!r}")
    norm = os.path.normpath(value)
    if sum(1 for part in norm.split("/") if part) < 2:
        raise RequestError(f"args.run_dir {value!r} is too close to / to be removed on exit; "
                           "use a per-child directory such as /run/vmfork/<vm_id>")
    return norm


REGISTERED_MODULES = ("vmfork.runtime.vmmchild",)
"""Modules whose ``ZYGOTE_ENTRIES`` every zygote registers."""


def register_entries(modules: list[str]) -> dict[str, Entry]:
    """``module:function`` -> function, for every name in each module's
    ``ZYGOTE_ENTRIES``. Raises ``TypeError``/``ValueError`` for a module that offers none."""
    entries: dict[str, Entry] = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        names = getattr(module, "ZYGOTE_ENTRIES", None)
        if not isinstance(names, tuple):
            raise TypeError(f"module {module_name} lists no ZYGOTE_ENTRIES tuple")
        if not names:
            raise ValueError(f"module {module_name} lists no ZYGOTE_ENTRIES")
        for func_name in names:
            func = getattr(module, func_name, None)
            if not callable(func):
                raise TypeError(f"{module_name}.ZYGOTE_ENTRIES names {func_name!r}, which "
                                 "is not a function of the module")
            entries[f"{module_name}:{func_name}"] = func
    return entries


class Zygote:
    def __init__(self, socket_path: str, preloaded: list[str], preload_failed: list[str],
                 lease_s: float | None = None,
                 entries: dict[str, Entry] | None = None) -> None:
        self.socket_path = socket_path
        self.lease_s = lease_s                 # None: no lease, live until told to stop
        self.lease_renewed = time.monotonic()
        self.preloaded = preloaded
        self.preload_failed = preload_failed
        self.pid = os.getpid()
        # Readable once the zygote exited: how a child in a PID namespace of its own
        # (getppid() 0) tells that its zygote died before it could ask to die with it.
        self.own_pidfd = os.pidfd_open(self.pid)
        # Opened now, where jails can be made, so that the descriptors a zygote holds
        # are all there before its first child (a leak check compares with that);
        # otherwise on the first jailed fork, which then fails with the reason.
        self._pid_namespaces: PidNamespaces | None = None
        if os.geteuid() == 0:
            with contextlib.suppress(OSError):
                self._pid_namespaces = PidNamespaces()
        self._shared_tree = self._build_shared_tree(socket_path)
        self._kept_bases = KeptBases()
        self._forker: Forker | None = None
        self._last_miss: tuple[frozenset[int], Hashable] | None = None
        """The last native batch the forker could not serve (``_forker_for``)."""
        self._jail_requests: OrderedDict[str, _JailRequest] = OrderedDict()
        self.started = time.monotonic()
        self.children: dict[str, _Child] = {}
        self.by_pidfd: dict[int, _Child] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.next_seq = 1
        self.waiters: dict[str, list[_Slot]] = {}
        self.entries: dict[str, Entry] = dict(entries or {})
        self._uids_taken: set[int] = set()   # jail uids of children prepared or alive
        self.conns: dict[int, _Conn] = {}
        self.stopping = False
        self.sel = selectors.DefaultSelector()
        self.listener = self._listen(socket_path)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self.sig_r, self.sig_w = socket.socketpair()
        self.sig_r.setblocking(False)
        self.sig_w.setblocking(False)
        signal.set_wakeup_fd(self.sig_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)
        self.sel.register(self.sig_r, selectors.EVENT_READ, "signal")

    @staticmethod
    def _build_shared_tree(socket_path: str) -> SharedTree | None:
        """The read-only tree every jail of this zygote binds whole (``jail.SharedTree``),
        in a mount namespace of the zygote's own, so that no mount of it outlives the
        zygote. None where jails cannot be built (not root): each jail then binds
        Python's paths itself, as it did before."""
        if os.geteuid() != 0:
            return None
        try:
            if not own_mount_namespace():
                return None
            return SharedTree.build(socket_path + ".jail", python_paths())
        except (JailError, OSError) as err:
            log.warning("no shared jail tree (%s); each jail binds Python's paths itself", err)
            return None

    @staticmethod
    def _listen(path: str) -> socket.socket:
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale socket from a dead zygote
            else:
                raise SystemExit(f"vmfork zygote: another zygote already listens on {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    # -- the loop ---------------------------------------------------------------------

    def _lease_holders(self) -> int:
        return sum(1 for c in self.conns.values() if c.holds_lease)

    def _select_timeout(self) -> float | None:
        """None (block) while the lease is held or there is none; else the time left."""
        if self.lease_s is None or self._lease_holders():
            return None
        return max(0.0, self.lease_renewed + self.lease_s - time.monotonic())

    def _lease_expired(self) -> bool:
        if self.lease_s is None or self._lease_holders():
            return False
        return time.monotonic() - self.lease_renewed >= self.lease_s

    def serve_forever(self) -> None:
        while not self.stopping:
            if self._lease_expired():
                log.warning("no daemon held the lease for %.0f s; killing %d children and "
                            "exiting", self.lease_s, len(self.children))
                break
            for key, mask in self.sel.select(self._select_timeout()):
                tag = key.data
                if tag == "listen":
                    self._accept()
                elif tag == "signal":
                    self._signals()
                elif isinstance(tag, _Child):
                    if self.by_pidfd.get(tag.pidfd) is tag:  # not reaped, fd not reused
                        self._reap(tag)
                elif isinstance(tag, _Conn):
                    if mask & selectors.EVENT_READ:
                        self._read(tag)
                    if mask & selectors.EVENT_WRITE and tag.sock.fileno() in self.conns:
                        self._flush(tag)
                if self.stopping:
                    break
        self._shutdown_all()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            conn = _Conn(sock)
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _signals(self) -> None:
        try:
            data = self.sig_r.recv(256)
        except BlockingIOError:
            return
        if any(b in (signal.SIGTERM, signal.SIGINT) for b in data):
            log.info("signal received; shutting down")
            self.stopping = True

    def _close_conn(self, conn: _Conn) -> None:
        if conn.holds_lease:
            self.lease_renewed = time.monotonic()  # the lease clock starts at the disconnect
        fd = conn.sock.fileno()
        if fd in self.conns:
            del self.conns[fd]
            self.sel.unregister(conn.sock)
        for slots in self.waiters.values():
            for slot in list(slots):
                if slot in conn.slots:
                    slots.remove(slot)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_conn(conn)
            return
        conn.inbuf += data
        while True:
            nl = conn.inbuf.find(b"\n")
            if nl < 0:
                break
            line = bytes(conn.inbuf[:nl])
            del conn.inbuf[:nl + 1]
            if line.strip():
                if conn.holds_lease:
                    self.lease_renewed = time.monotonic()
                conn.slots.append(self._handle_line(line, conn))
            if self.stopping:
                break
        if len(conn.inbuf) > MAX_LINE:
            conn.slots.append(_Slot(_error("BadRequest", f"request line over {MAX_LINE} bytes")))
            conn.inbuf.clear()
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.slots and conn.slots[0].reply is not None:
            reply = conn.slots.popleft().reply
            assert reply is not None
            conn.outbuf += encode(reply)
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except BlockingIOError:
                break
            except OSError:
                self._close_conn(conn)
                return
            del conn.outbuf[:sent]
        want = bool(conn.outbuf)
        if want != conn.writing and conn.sock.fileno() in self.conns:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self.sel.modify(conn.sock, events, conn)
            conn.writing = want

    # -- requests ---------------------------------------------------------------------

    def _handle_line(self, line: bytes, conn: _Conn | None = None) -> _Slot:
        op = "?"
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise RequestError("a request must be a JSON object")
            op = str(req.get("op"))
            if op == "lease":
                return _Slot({"ok": True, **self._lease(req, conn)})
            handler = getattr(self, "_op_" + op, None) if op.isidentifier() else None
            if handler is None:
                raise RequestError(f"unknown op {op!r}; expected one of spawn, spawn_many, "
                                   "kill, wait, list, events, ping, lease, shutdown")
            result = handler(req)
            if isinstance(result, _Slot):
                return result
            return _Slot({"ok": True, **result})
        except RequestError as err:
            return _Slot(_error(err.type, f"{op}: {err}"))
        except json.JSONDecodeError as err:
            return _Slot(_error("BadRequest", f"request is not valid JSON: {err}"))
        except (ValueError, TypeError, KeyError) as err:
            return _Slot(_error("BadRequest", f"{op}: {err}"))
        except cgroups.CgroupError as err:
            return _Slot(_error(type(err).__name__, f"{op}: {err}"))
        except Exception as err:  # one bad request must not stop the zygote
            log.exception("request %s failed", op)
            return _Slot(_error(type(err).__name__, f"{op}: {err}"))

    def _op_ping(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"pid": self.pid, "preloaded": self.preloaded,
                "preload_failed": self.preload_failed, "children": len(self.children),
                "uptime_s": time.monotonic() - self.started, "lease_s": self.lease_s,
                "lease_holders": self._lease_holders(),
                "jail_bases": {"kept": len(self._kept_bases), "built": self._kept_bases.built},
                "forker": None if self._forker is None else {
                    "pid": self._forker.pid, "snapshot_plans": sorted(self._forker.plans)}}

    def _lease(self, req: dict[str, Any], conn: _Conn | None) -> dict[str, Any]:
        """``lease {seconds?}``: this connection holds the lease while it is open;
        ``seconds`` (if given) sets how long the zygote outlives the last holder."""
        seconds = req.get("seconds")
        if seconds is not None:
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                    or not 0 < seconds <= 86400 * 7:
                raise RequestError(f"lease seconds must be a number in (0, 604800], got "
                                   f"{seconds!r}")
            self.lease_s = float(seconds)
        if conn is None:
            raise RequestError("lease needs a connection to hold it")
        conn.holds_lease = True
        self.lease_renewed = time.monotonic()
        return {"lease_s": self.lease_s, "holders": self._lease_holders()}

    def _op_list(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"children": [c.info() for c in self.children.values()]}

    def _op_events(self, req: dict[str, Any]) -> dict[str, Any]:
        since = int(req.get("since", 0))
        return {"events": [e for e in self.events if e["seq"] > since],
                "next": self.next_seq - 1}

    def _op_spawn(self, req: dict[str, Any]) -> dict[str, Any]:
        entry = self._resolve(req.get("entry"))
        prepared = self._prepare(req, _BatchJails())
        self._before_forks(entry, [prepared])
        try:
            children, error = self._fork_batch(str(req["entry"]), entry, [prepared])
            if error is not None:
                raise error
        except BaseException:
            self._discard(prepared)
            raise
        return {"child": children[0].info()}

    def _op_spawn_many(self, req: dict[str, Any]) -> dict[str, Any]:
        entry = self._resolve(req.get("entry"))
        items = req.get("items")
        if not isinstance(items, list):
            raise RequestError("spawn_many needs items: a list of {vm_id, args?, ...}")
        return self._spawn_batch(entry, str(req["entry"]), items, _BatchJails())

    def _spawn_batch(self, entry: Entry, name: str, items: list[Any], jails: _BatchJails
                     ) -> dict[str, Any]:
        failed: list[dict[str, str]] = []
        batch: list[_Prepared] = []
        seen: set[str] = set()
        for item in items:
            vm_id = str(item.get("vm_id")) if isinstance(item, dict) else "?"
            try:
                if not isinstance(item, dict):
                    raise RequestError("each item must be an object")
                if vm_id in seen:
                    raise RequestError(f"vm_id {vm_id!r} appears twice in this batch",
                                       "AlreadyExists")
                batch.append(self._prepare(item, jails))
                seen.add(vm_id)
            except (RequestError, ValueError, cgroups.CgroupError, OSError) as err:
                failed.append({"vm_id": vm_id, "error": str(err)})
        self._before_forks(entry, batch)
        children, error = self._fork_batch(name, entry, batch)
        for rest in batch[len(children):]:
            self._discard(rest)
            failed.append({"vm_id": rest.vm_id, "error": f"fork failed: {error}"})
        # No child of this batch is reaped before this reply is made (the loop reaps),
        # so each one's exit event is newer than this cursor.
        return {"children": [child.info() for child in children], "failed": failed,
                "events_next": self.next_seq - 1}

    def _op_kill(self, req: dict[str, Any]) -> dict[str, Any]:
        child = self._child(req)
        sig = int(req.get("signal", signal.SIGKILL))
        child.kill_requested = True
        self._signal_child(child, sig)
        return {"sent": True}

    def _op_wait(self, req: dict[str, Any]) -> _Slot | dict[str, Any]:
        vm_id = str(req.get("vm_id"))
        if vm_id in self.children:
            slot = _Slot()
            self.waiters.setdefault(vm_id, []).append(slot)
            return slot
        for event in reversed(self.events):
            if event["vm_id"] == vm_id:
                return {"event": event}
        raise RequestError(f"no child with vm_id {vm_id!r} (never spawned, or its exit "
                           "event is no longer kept)", "NotFound")

    def _op_shutdown(self, req: dict[str, Any]) -> dict[str, Any]:
        self.stopping = True
        return {"children_killed": len(self.children)}

    # -- spawning ---------------------------------------------------------------------

    def _resolve(self, name: object) -> Entry:
        if not isinstance(name, str) or name.count(":") != 1:
            raise RequestError(f"entry must be 'module:function', got {name!r:.200}")
        entry = self.entries.get(name)
        if entry is None:
            raise RequestError(f"entry {name!r:.200} is not registered with this zygote "
                               f"(registered: {', '.join(sorted(self.entries))}); a module "
                               "offers entries in ZYGOTE_ENTRIES and is named with "
                               "--entries-module", "EntryNotAllowed")
        return entry

    def _before_forks(self, entry: Entry, batch: list[_Prepared]) -> None:
        """The entry's ``prefork`` hook, then a clean, frozen heap (module docstring)."""
        hook = getattr(sys.modules.get(entry.__module__), "prefork", None)
        if callable(hook) and batch:
            try:
                hook([prep.args for prep in batch])
            except Exception:  # the children will meet the same problem and report it
                log.exception("prefork hook of %s failed", entry.__module__)
        self._check_threads()
        gc.collect()
        gc.freeze()

    def _check_threads(self) -> None:
        n = _thread_count()
        if n != 1:
            raise RequestError(f"the zygote has {n} threads (a preloaded or entry module "
                               "started one); forking now could deadlock children, so it "
                               "refuses. Remove the thread from import time, or restart the "
                               "zygote without that module", "NotForkSafe")

    def _prepare(self, req: dict[str, Any], jails: _BatchJails) -> _Prepared:
        """One child's cgroup, run directory, jail and plan. ``jails``: the batch's jail
        bases. What it made is removed when it raises (a run directory that was there
        before is left alone)."""
        vm_id = cgroups.validate_name(str(req.get("vm_id")))
        if vm_id in self.children:
            raise RequestError(f"a child with vm_id {vm_id!r} is already running "
                               f"(pid {self.children[vm_id].pid})", "AlreadyExists")
        args = req.get("args", {})
        if not isinstance(args, dict):
            raise RequestError("args must be a JSON object")
        log_path = args.get("log_path")
        if log_path is not None and not isinstance(log_path, str):
            raise RequestError("args.log_path must be a string")
        run_dir = _validate_run_dir(args.get("run_dir"))
        limit = req.get("memory_limit_mib")
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise RequestError(f"memory_limit_mib must be a positive integer, got {limit!r}")
        request = self._resolve_jail(req.get("jail"))
        jail_spec = _jail_spec(request, run_dir, self._uids_taken, args)
        cg: cgroups.ChildCgroup | None = None
        made_run_dir = False
        base: tuple[int, int, str] | None = None
        try:
            if limit is not None:
                parent = str(req.get("cgroup_parent") or cgroups.DEFAULT_PARENT)
                cg = cgroups.create(cgroups.require(), vm_id, limit << 20, parent,
                                    pids_max=CHILD_PIDS_MAX, cpu_weight=CHILD_CPU_WEIGHT)
            if run_dir is not None:
                try:
                    made_run_dir = not os.path.isdir(run_dir)
                    os.makedirs(run_dir, mode=0o700, exist_ok=True)
                    base = None if request is None else self._jail_base(request, jail_spec,
                                                                         jails)
                    if jail_spec is not None and base is None:
                        os.makedirs(jail_spec.root, mode=0o755, exist_ok=True)
                except OSError as err:
                    raise RequestError(f"cannot create args.run_dir {run_dir}: "
                                       f"{err.strerror}", "HostError") from err
            try:
                # An unjailed child joins its sandbox's network namespace in its set-up
                # (a jailed one's spec names it).
                plan_args = plan_child_args(
                    self.pid, cg, log_path, jail_spec,
                    self.own_pidfd if jail_spec is not None else None,
                    netns=(args.get("netns") or None) if jail_spec is None else None,
                    jail_base=base)
                child_plan = plan_child_of(plan_args)
            except JailError as err:
                raise RequestError(str(err)) from None
        except BaseException:
            self._discard(_Prepared(vm_id, args, cg, log_path,
                                    run_dir if made_run_dir else None))
            raise
        if jail_spec is not None:
            self._uids_taken.add(jail_spec.uid)
        return _Prepared(vm_id, args, cg, log_path, run_dir, jail_spec, child_plan, plan_args)

    def _resolve_jail(self, value: object) -> _JailRequest | None:
        """``value`` checked and resolved (``_jail_request``) once for every child that
        asks the same jail: a spawner's batch asks one, and so do its later spawns of one
        snapshot. Each spawn's own files (its FIFOs, below ``runs_in``) are not part of
        what is kept, or no two spawns would ask the same (``_split_spawn_files``). The
        last ``JAIL_REQUESTS_KEPT`` are kept (resolving one again was ~2-3 ms of a lone
        spawn in the emulated test host: design notes, "A lone spawn's jail request
        resolved once")."""
        if value is None:
            return None
        shared, spawn_files = _split_spawn_files(value)
        key = json.dumps(shared, sort_keys=True)
        request = self._jail_requests.get(key)
        if request is None:
            request = _jail_request(shared, self._shared_tree)
            self._jail_requests[key] = request
            while len(self._jail_requests) > JAIL_REQUESTS_KEPT:
                self._jail_requests.popitem(last=False)
        else:
            self._jail_requests.move_to_end(key)
        return replace(request, spawn_files=spawn_files) if spawn_files else request

    def _jail_base(self, request: _JailRequest, spec: JailSpec | None, jails: _BatchJails
                   ) -> tuple[int, int, str] | None:
        """The jail base for ``spec`` (``jail.KeptBases``: one per request and mount
        point, looked up on a batch's first child), or None where the jail builds its
        own root: no shared tree (the zygote has no mount namespace of its own), or a
        base that could not be built (logged, once per batch). Its mount point is the
        request's ``runs_in`` (every batch's run directories below it: one base serves
        them all), else the run directory's parent (this batch's alone)."""
        if spec is None or spec.shared is None or len(spec.writable) != 1:
            return None
        parent = os.path.dirname(spec.writable[0].rstrip("/"))
        point = parent if request.runs_in is None else request.runs_in
        if not (parent == point or parent.startswith(point.rstrip("/") + "/")):
            raise RequestError(f"args.run_dir {spec.writable[0]} is not under jail.runs_in "
                               f"{point}")
        key = (id(request.spec), point)   # the request is one spawn's copy of the kept one
        if key not in jails.bases:
            try:
                jails.bases[key] = self._kept_bases.get(spec, point)
            except JailError as err:
                log.warning("no jail base for %s (%s): each jail builds its own root",
                            point, err)
                jails.bases[key] = None
        return jails.bases[key]

    def _discard(self, prep: _Prepared) -> None:
        if prep.cgroup is not None:
            try:
                cgroups.remove(prep.cgroup)
            except cgroups.CgroupError as err:
                log.warning("%s", err)
        if prep.run_dir is not None:
            shutil.rmtree(prep.run_dir, ignore_errors=True)
        if prep.jail is not None:
            self._uids_taken.discard(prep.jail.uid)

    def _fork_batch(self, name: str, entry: Entry,
                    batch: list[_Prepared]) -> tuple[list[_Child], Exception | None]:
        """Fork ``batch`` in order: the children forked, recorded, and the error (an
        ``OSError``, or a native batch's ``RuntimeError``) that stopped the batch; the
        rest, from ``len(children)`` on, are not forked. Each run of children that
        run no Python (``NATIVE_CHILD``, an entry module with a ``native_child``
        hook) is forked in one native batch; a spawn the hook refuses runs ``entry``
        in a Python child (``_native_child``)."""
        hook = getattr(sys.modules.get(entry.__module__), "native_child", None)
        natives = [self._native_child(hook, prep) if NATIVE_CHILD and callable(hook)
                   else None for prep in batch]
        children: list[_Child] = []
        while len(children) < len(batch):
            at = len(children)
            if natives[at] is None:
                try:
                    children.append(self._fork(name, entry, batch[at]))
                except OSError as err:
                    return children, err
                continue
            run = next((i for i in range(at, len(batch)) if natives[i] is None), len(batch))
            forked, stopped = self._fork_native_batch(
                name, entry, batch[at:run], [n for n in natives[at:run] if n is not None])
            children += forked
            if stopped is not None:
                return children, stopped
        return children, None

    def _pid_namespaces_for(self, prep: _Prepared) -> PidNamespaces | None:
        """Where a jailed child's PID namespace comes from; None for an unjailed one.
        A jailed child is the first process of a PID namespace of its own
        (jail.PidNamespaces): it can name no other process of the host."""
        if prep.jail is None:
            return None
        if self._pid_namespaces is None:
            self._pid_namespaces = PidNamespaces()
        return self._pid_namespaces

    def _fork(self, name: str, entry: Entry, prep: _Prepared) -> _Child:
        sys.stdout.flush()
        sys.stderr.flush()
        # Signals stay blocked across fork(): until the child has reset its handlers
        # and its wakeup fd, a signal sent to it (a quick kill) would run the zygote's
        # handler and write into the zygote's own wakeup socket, which the child
        # shares: the zygote would read the child's SIGTERM as its own.
        pidns = self._pid_namespaces_for(prep)
        set_sigmask(signal.SIG_BLOCK, _BLOCK_AT_FORK)
        try:
            if pidns is not None:
                pidns.before_fork()
            try:
                forked_ns = time.monotonic_ns()
                pid = fork_child()
                if pid == 0:
                    run_child(vm_id=prep.vm_id, zygote_pid=self.pid, forked_ns=forked_ns,
                              entry=entry, args=prep.args, cgroup=prep.cgroup,
                              child_plan=prep.plan, jail_spec=prep.jail)
            finally:
                if pidns is not None:
                    pidns.after_fork()
        finally:
            set_sigmask(signal.SIG_UNBLOCK, _BLOCK_AT_FORK)
        return self._record(name, prep, pid)

    def _fork_native_batch(self, name: str, entry: Entry, batch: list[_Prepared],
                           natives: list[NativeChild]) -> tuple[list[_Child], Exception | None]:
        """``_fork_batch``'s run of children that run no Python, each ``batch[i]`` running
        ``natives[i]``: one native call forks them back to back, then the records.
        Between two forks the zygote runs no Python: a page it wrote there would leave
        each earlier sibling the only holder of the old one, memory of its own (design
        notes, "A native batch forked back to back")."""
        namespaces = [self._pid_namespaces_for(prep) for prep in batch]
        sys.stdout.flush()
        sys.stderr.flush()
        pids: list[int] | None = None
        unforked: BaseException | None = None
        forker = self._forker_for(entry, batch, natives)
        if forker is not None:
            recipes = [{**native.recipe, "plan": prep.plan_args,
                        "own_pid_namespace": pidns.own if pidns is not None else None}
                       for prep, native, pidns in zip(batch, natives, namespaces)
                       if native.recipe is not None]
            timeout = FORKER_TIMEOUT_S + FORKER_TIMEOUT_PER_CHILD_S * len(recipes)
            pids, unforked = forker.fork(recipes, timeout)
            if isinstance(unforked, ForkerGone):
                # A forker killed just before or during the batch: every child it forked
                # goes with it (none is recorded yet), and a new one forks the batch.
                log.warning("%s; forking the batch again with a new forker", unforked)
                self._retire_forker()
                pids, unforked = None, None
                forker = self._forker_for(entry, batch, natives)
                if forker is not None:
                    pids, unforked = forker.fork(recipes, timeout)
                    if isinstance(unforked, ForkerGone):
                        self._retire_forker()
                        pids = []
        if pids is None:
            forks: list[NativeFork] = [
                native_fork(prep.plan, native, pidns.own if pidns is not None else None)
                for prep, native, pidns in zip(batch, natives, namespaces)]
            set_sigmask(signal.SIG_BLOCK, _BLOCK_AT_FORK)   # as in _fork
            try:
                pids, unforked = fork_native_batch(forks)
            finally:
                set_sigmask(signal.SIG_UNBLOCK, _BLOCK_AT_FORK)
        children = [self._record(name, prep, pid) for prep, pid in zip(batch, pids)]
        if unforked is None or isinstance(unforked, Exception):
            return children, unforked   # the rest are discarded, as after an OSError
        raise unforked

    def _forker_for(self, entry: Entry, batch: list[_Prepared], natives: list[NativeChild]
                    ) -> Forker | None:
        """The forker for this run of native children (``runtime/forker.py``): the one
        there is if it holds their snapshot plans and was cloned with the entry
        module's image key as it is now, else one cloned now where there is none (or
        it died) or the batch before was like this one. None where the zygote forks
        them itself: no forker wanted (``VMFORK_FORKER``), a child with no recipe, the
        first of such batches, or no clone possible."""
        if not forker_wanted() or any(n.recipe is None or p.plan_args is None
                                      for p, n in zip(batch, natives)):
            return None
        plans = {int(n.recipe["machine"]["restored"]["snapshot"]) for n in natives
                 if n.recipe is not None and "restored" in n.recipe["machine"]}
        key_of = getattr(sys.modules.get(entry.__module__), "forker_image_key", None)
        image_key = key_of() if callable(key_of) else None
        if self._forker is not None and self._forker.serves(plans, image_key):
            self._last_miss = None
            return self._forker
        # A new forker is cloned for a batch like the one before it (or when there is
        # none): batches that take turns between snapshots whose premaps differ would
        # otherwise clone one for every batch (a fork of the zygote each); the zygote
        # forks those itself, as it does with no forker.
        miss = (frozenset(plans), image_key)
        if self._forker is not None and self._forker.alive and miss != self._last_miss:
            self._last_miss = miss
            return None
        self._last_miss = None
        self._retire_forker()
        try:
            self._forker = Forker(image_key)
        except (OSError, RuntimeError) as err:
            # No forker now (the clone refused, another thread): the zygote forks the
            # batch itself, as with VMFORK_FORKER=0, and tries again next batch.
            log.warning("no forker (%s): the zygote forks this batch itself", err)
            return None
        log.info("forker %d cloned for snapshot plans %s", self._forker.pid,
                 sorted(self._forker.plans))
        return self._forker

    def _retire_forker(self) -> None:
        """Kill and reap the forker, then every child of the zygote's that it does not
        know: the forker's spare (``runtime/forker.py``), and after a forker that
        failed (killed, or gone during a batch) a child it forked that the batch did
        not record. Between two batches every child the zygote has is recorded."""
        if self._forker is None:
            return
        failed = not self._forker.alive
        self._forker.close()
        self._forker = None
        known = {child.pid for child in self.children.values()}
        for pid in _own_children(self.pid) - known:
            if failed:
                log.warning("killing child %d, forked by a forker that failed", pid)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass

    def _record(self, name: str, prep: _Prepared, pid: int) -> _Child:
        pidfd = os.pidfd_open(pid)
        child = _Child(prep.vm_id, pid, pidfd, name, prep.cgroup, prep.log_path, prep.run_dir,
                       time.monotonic(), time.time(),
                       jail_uid=prep.jail.uid if prep.jail is not None else None)
        self.children[prep.vm_id] = child
        self.by_pidfd[pidfd] = child
        self.sel.register(pidfd, selectors.EVENT_READ, child)
        return child

    @staticmethod
    def _native_child(hook: Callable[..., NativeChild], prep: _Prepared) -> NativeChild | None:
        """The entry module's ``native_child`` plan for this spawn, or None where the hook
        refuses it (a diff snapshot the zygote could not premap, a damaged snapshot, a
        machine it cannot build natively): that spawn runs its entry in a Python child,
        which serves it or fails it as every Python child does (a damaged snapshot's
        exits and leaves its exit event). Never silently: the reason is in the zygote's
        log and in the child's args (``NATIVE_REFUSED``), which its entry reports
        (``vmmchild.main``: its log and every report)."""
        try:
            native: NativeChild = hook(prep.args, prep.jail)
        except Exception as err:  # noqa: BLE001 -- any refusal: a Python child instead
            reason = f"{type(err).__name__}: {err}"
            log.info("%s runs in a Python child: no native child (%s)", prep.vm_id, reason)
            prep.args[NATIVE_REFUSED] = reason
            return None
        return native

    def _child(self, req: dict[str, Any]) -> _Child:
        vm_id = str(req.get("vm_id"))
        child = self.children.get(vm_id)
        if child is None:
            raise RequestError(f"no running child with vm_id {vm_id!r}", "NotFound")
        return child

    @staticmethod
    def _signal_child(child: _Child, sig: int) -> None:
        # The child may not have reached setsid() yet, so signal it through its pidfd
        # and, separately, whatever is in its process group.
        try:
            signal.pidfd_send_signal(child.pidfd, sig)
        except ProcessLookupError:
            pass
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # -- reaping ----------------------------------------------------------------------

    def _reap(self, child: _Child, block: bool = False) -> None:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # leftovers; the zombie still holds the pgid
        except (ProcessLookupError, PermissionError):
            pass
        result = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED | (0 if block else os.WNOHANG))
        if result is None:
            return  # readable but not yet waitable; the next select() will come back
        self.sel.unregister(child.pidfd)
        del self.by_pidfd[child.pidfd]
        os.close(child.pidfd)
        del self.children[child.vm_id]
        if child.jail_uid is not None:
            self._uids_taken.discard(child.jail_uid)
        cleanup_errors: list[str] = []
        oom: cgroups.OomInfo | None = None
        if child.cgroup is not None:
            try:
                oom = cgroups.read_oom(child.cgroup)
                cgroups.kill_all(child.cgroup, signal.SIGKILL)
                cgroups.remove(child.cgroup)
            except cgroups.CgroupError as err:
                cleanup_errors.append(str(err))
        tail = supervise.log_tail(child.log_path)
        if child.run_dir is not None:
            self._run_dir_ending(child.entry, child.run_dir)
            try:
                shutil.rmtree(child.run_dir)
            except FileNotFoundError:
                pass
            except OSError as err:
                cleanup_errors.append(f"cannot remove run_dir {child.run_dir}: {err}")
        cls = supervise.classify_exit(result.si_code, result.si_status,
                                      kill_requested=child.kill_requested, oom=oom)
        event = {"seq": self.next_seq, "vm_id": child.vm_id, "pid": child.pid,
                 "reason": cls.reason, "description": cls.description,
                 "exit_code": cls.exit_code, "signal": cls.signal,
                 "core_dumped": cls.core_dumped, "kill_requested": child.kill_requested,
                 "oom_kills": oom.oom_kills if oom else None,
                 "runtime_s": time.monotonic() - child.started_mono,
                 "log_tail": tail, "cleanup_errors": cleanup_errors}
        self.next_seq += 1
        self.events.append(event)
        for problem in cleanup_errors:
            log.warning("child %s: %s", child.vm_id, problem)
        for slot in self.waiters.pop(child.vm_id, []):
            slot.reply = {"ok": True, "event": event}
        for conn in list(self.conns.values()):
            if conn.slots and conn.slots[0].reply is not None:
                self._flush(conn)

    def _run_dir_ending(self, name: str, run_dir: str) -> None:
        """The entry module's ``run_dir_ending`` hook, told of a run directory the zygote
        is about to remove (vmmchild takes a learner's write set from it). A forker
        whose image key the hook changed is retired at once: the next batch clones one
        that holds what changed, instead of being forked by the zygote first (the
        change is for good, unlike batches that take turns between snapshots)."""
        entry = self.entries.get(name)
        module = sys.modules.get(entry.__module__) if entry else None
        hook = getattr(module, "run_dir_ending", None)
        if not callable(hook):
            return
        try:
            hook(run_dir)
        except Exception:  # noqa: BLE001 -- a hook's failure never stops a reap
            log.exception("run_dir_ending hook of %s failed", getattr(module, "__name__", name))
            return
        key_of = getattr(module, "forker_image_key", None)
        if (self._forker is not None and callable(key_of)
                and key_of() != self._forker.image_key):
            self._retire_forker()

    def _shutdown_all(self) -> None:
        for child in list(self.children.values()):
            child.kill_requested = True
            self._signal_child(child, signal.SIGKILL)
        for child in list(self.children.values()):
            self._reap(child, block=True)
        for conn in list(self.conns.values()):
            conn.sock.setblocking(True)
            conn.sock.settimeout(1.0)
            for slot in conn.slots:
                if slot.reply is None:
                    slot.reply = _error("ShuttingDown", "the zygote is shutting down")
            try:
                self._flush(conn)
                if conn.outbuf:
                    conn.sock.sendall(conn.outbuf)
            except OSError:
                pass
            self._close_conn(conn)
        signal.set_wakeup_fd(-1)
        self.sel.close()
        self.listener.close()
        self.sig_r.close()
        self.sig_w.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        self._kept_bases.close()
        if self._shared_tree is not None:
            self._shared_tree.close()
        self._retire_forker()


def _own_children(pid: int) -> set[int]:
    """The pids of ``pid``'s children (its one thread's: the zygote's)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def _error(type: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"type": type, "message": message}}


def preload(required: list[str]) -> tuple[list[str], list[str]]:
    """Import the default (optional) and the asked-for (required) modules."""
    done: list[str] = []
    failed: list[str] = []
    for name in DEFAULT_PRELOAD:
        try:
            importlib.import_module(name)
            done.append(name)
        except ImportError as err:
            log.warning("optional preload %s not imported: %s", name, err)
            failed.append(name)
    for name in required:
        importlib.import_module(name)
        done.append(name)
    return done, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmfork.runtime.zygote",
                                     description="vmfork's pre-imported VMM spawner")
    parser.add_argument("--socket", required=True, help="Unix socket path to serve on")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="a module to import before serving (repeatable; must import)")
    parser.add_argument("--entries-module", action="append", default=[], metavar="MODULE",
                        help="register the entries a module lists in ZYGOTE_ENTRIES "
                             "(repeatable; vmfork.runtime.vmmchild's always are)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="die when this process (our parent) dies")
    parser.add_argument("--lease-s", type=float, default=None, metavar="SECONDS",
                        help="kill the children and exit once no client has held the lease "
                             "(op lease) for this long; default: no lease")
    opts = parser.parse_args(argv)
    if opts.lease_s is not None and opts.lease_s <= 0:
        parser.error("--lease-s must be positive")
    try:
        spare_quiet_ms()   # read at every forker's clone: a bad value stops the start
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="vmfork zygote[%(process)d] %(levelname)s %(message)s")
    # Before the preloads' imports and any thread: every page after it is a small one.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_THP_DISABLE) failed (%s): a child's thread stack or heap "
                    "may fault in 2 MiB pages", os.strerror(ctypes.get_errno()))
    if opts.parent_pid is not None and not die_with_parent(opts.parent_pid):
        return 1  # the parent is already gone
    done, failed = preload(opts.preload)
    entries = register_entries([*REGISTERED_MODULES, *opts.entries_module])
    if _thread_count() != 1:
        log.error("preloading started %d threads; a zygote must stay single-threaded",
                  _thread_count() - 1)
        return 1
    libc.mallopt(M_ARENA_MAX, 1)  # inherited by every child
    if os.geteuid() == 0 and not hold_empty_netns():
        log.warning("cannot make the empty network namespace for jailed VMMs; each "
                    "jail will try to make its own")
    with contextlib.suppress(OSError, ValueError):
        last_capability()   # once here for every jail (else each jail reads it, and fails)
    gc.collect()
    gc.freeze()  # keep the collector off inherited objects: fewer CoW faults, no finalizers
    zygote = Zygote(opts.socket, done, failed, lease_s=opts.lease_s, entries=entries)
    zygote.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
