"""BRANCH: snapshot a running sandbox into the store, the source paused for an instant.

``branch_sandbox`` is what the daemon's ``POST /v1/sandboxes/:id/branch`` calls.
It claims the tag in the store first (a bad or taken tag fails before the
sandbox is touched), asks the sandbox's VMM over its control socket to capture
itself (the ``snapshot`` op, ``runtime.vmmchild.ControlServer.snapshot``) into
the pending directory, resolves a diff into a spawnable head
(``store.layers``), hashes what entered the store, and publishes atomically.
Any failure -- the VMM refusing, dying mid-write, a full disk -- aborts the
pending directory: nothing is ever listed ready unless complete.

A jailed VMM (its ``status`` says ``jailed``) sees nothing of the store and may write
only its run directory. It captures into two fresh names there, and this side copies
them into the pending directory (``_take_from_run_dir``): a copy, not a rename, so a
descriptor the VMM kept on its output cannot change the snapshot after its hashes are
taken, and the store's files are the daemon's (0600), never the jail uid's. Holes stay
holes (``layerfile.copy_sparse``); the copy runs after the source resumed, so it
lengthens the branch, not the pause.

A diff asked to settle (``settle_free_pages``: a build's ``snapshot-diff``) first lets
the guest hand back what it freed (``_settle_free_pages``): the
VMM's balloon drops every page the guest reports free (free page reporting,
``vmm/devices/virtio/balloon.py``), so a build's garbage -- pip's heap, a wheel it
downloaded and deleted -- is not kept as changed pages. The guest reports a block
about 2 s after freeing it; we poll the VMM's status until no report came for
``SETTLE_QUIET_S``, at most ``SETTLE_MAX_S``, while the source runs: the wait
lengthens the branch, never the pause, and each poll is an ordinary control call. It is
asked for, not the default, because it costs seconds on every such BRANCH, idle guest
or not (a BRANCH of a sandbox mid-work, an E2B fork or pause, wants its snapshot now,
and what the guest reported before it is dropped anyway): a guest never says that nothing
is pending, and a build's garbage is reported after it ends, not during it (pip's
builds reported twice in the 15-20 s before their BRANCH, the rest during the wait;
docs/chains.md), so "no report lately" cannot stand for "nothing to come".
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

from vmfork.ondisk import layerfile
from vmfork.ondisk.stateformat import read_state_file
from vmfork.store import PendingSnapshot, Snapshot, SnapshotMeta, SnapshotTimings, Store
from vmfork.store.errors import SnapshotCorrupt, SnapshotNotFound
from vmfork.store.store import ChainTooDeep, check_depth_for_child
from vmfork.store.tags import validate_tag
from vmfork.vmm.capture import MODES
from vmfork.vmm.vmstate import MachineState

CONTROL_TIMEOUT = 30.0       # connect and the pause itself
MAX_STATE_BYTES = 64 << 20   # a jailed VMM's state file taken into the store at most
WRITE_TIMEOUT = 3600.0       # a live capture's background write of guest RAM
MAX_REPLY_BYTES = 1 << 20
# Free page reporting settles when a pass found nothing more: a pass that did re-runs
# within the guest's 2 s delay, so 3 s without a report means it is idle; one that
# keeps freeing is waited for SETTLE_MAX_S at most (builds settled in 4-5 s).
SETTLE_QUIET_S = 3.0
SETTLE_MAX_S = 20.0
SETTLE_POLL_S = 0.25


class BranchFailed(RuntimeError):
    """The branch did not happen; nothing was published. ``stage`` says where it failed."""

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass(frozen=True)
class BranchResult:
    """A published branch. Times in milliseconds, sizes in bytes."""

    snapshot: Snapshot
    mode: str
    pause_ms: float              # the source's vCPUs were stopped this long
    total_ms: float              # request to published
    memory_bytes: int            # data written by the VMM (the layer's data for diff)
    dirty_pages: int | None      # pages changed since the base
    base_tag: str | None         # diff: the parent it was layered on
    vmm_timings: dict[str, float] = field(default_factory=dict)   # seconds, from the VMM


class BranchJob:
    """A branch in progress. ``wait=False`` returns one as soon as the source runs again.

    ``pause_ms`` is known from then on; ``result()`` waits for the snapshot to be
    published (or raises ``BranchFailed``); ``done()`` polls.
    """

    def __init__(self, tag: str, mode: str) -> None:
        self.tag = tag
        self.mode = mode
        self.pause_ms: float | None = None
        self._done = threading.Event()
        self._result: BranchResult | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> BranchResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"branch {self.tag!r} still writing after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    @property
    def error(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def _finish(self, result: BranchResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()


def branch_sandbox(store: Store, control_socket: str, tag: str, mode: str = "full", *,
                   parent_tag: str | None = None, wait: bool = True,
                   sandbox_id: str | None = None, settle_free_pages: bool = False,
                   on_done: Callable[[BranchJob], None] | None = None) -> BranchJob:
    """Branch the running sandbox whose VMM listens on ``control_socket`` into ``tag``.

    * ``store``: where the snapshot is published; ``tag``: its name
      (``InvalidTag``, ``TagExists``, ``TagBusy`` are raised before the sandbox is
      touched).
    * ``mode``: ``"full"`` (the pages the sandbox changed written while paused,
      the rest after the resume), ``"diff"`` (only the pages changed since a
      base, listed while paused and written by a forked writer after the source
      resumed; the snapshot is a chain link and its memory plan is computed once
      at publish) or ``"live"`` (whole memory written by a forked writer after the
      source resumed). ``ValueError`` for anything else.
    * ``parent_tag``: for ``diff``, the base to layer on: the snapshot the
      sandbox was restored from or a previous branch of it still in the store
      (default: the newest such base). ``BranchFailed`` (stage ``base``) when the
      sandbox cannot diff against it. Ignored otherwise.
    * ``wait``: ``True`` returns once published; ``False`` returns as soon as the
      source runs again (``job.pause_ms`` set, the write continues on a thread;
      ``job.result()`` waits, ``on_done(job)`` is called when it ends either way).
    * ``sandbox_id``: recorded in the snapshot's meta (``branched_from``).
    * ``settle_free_pages``: for ``diff``, first let the guest report the pages it
      freed (``_settle_free_pages``: seconds), so the layer does not hold them; what
      a build wants, not a BRANCH of a sandbox mid-work.

    Returns a ``BranchJob`` (finished when ``wait`` is true: ``job.result()`` is
    the ``BranchResult``, or raises ``BranchFailed``). With ``wait=False``, an error
    before the source resumed is raised here; later ones end the job.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if parent_tag is not None:
        parent_tag = validate_tag(parent_tag)
    started = time.monotonic()
    pending = store.begin(tag)        # claims the tag; raises before the sandbox is touched
    job = BranchJob(pending.tag, mode)
    resumed = threading.Event()
    early_error: list[BaseException] = []

    def run() -> None:
        result: BranchResult | None = None
        error: BaseException | None = None
        try:
            with pending:
                result = _branch(store, pending, control_socket, mode, parent_tag,
                                 sandbox_id, started, job, resumed,
                                 settle_free_pages=settle_free_pages)
        except BaseException as err:  # noqa: BLE001 -- handed to the job's owner
            error = err
            if not resumed.is_set():
                early_error.append(err)
        finally:
            resumed.set()
            job._finish(result, error)
            if on_done is not None:
                on_done(job)

    if wait:
        run()
        job.result()          # raises the failure, if any
        return job
    threading.Thread(target=run, name=f"branch-{pending.tag}", daemon=True).start()
    resumed.wait()
    if early_error:
        raise early_error[0]
    return job


def branch_into_pending(store: Store, pending: PendingSnapshot, control_socket: str,
                        mode: str, *, parent_tag: str | None = None,
                        sandbox_id: str | None = None, settle_free_pages: bool = False,
                        on_resumed: Callable[[float], None] | None = None) -> BranchResult:
    """The body of ``branch_sandbox`` for a caller that claimed the tag itself
    (``pending = store.begin(tag)``): capture the sandbox into ``pending`` and publish
    it. ``on_resumed(pause_ms)`` is called as soon as the source runs again. On
    failure it raises (``BranchFailed``, ``StoreError``, ...) and leaves ``pending``
    to the caller, who must ``abort()`` it (``PendingSnapshot`` as a context manager
    does)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    job = BranchJob(pending.tag, mode)
    resumed = threading.Event()
    return _branch(store, pending, control_socket, mode, parent_tag, sandbox_id,
                   time.monotonic(), job, resumed, on_resumed,
                   settle_free_pages=settle_free_pages)


def _branch(store: Store, pending: PendingSnapshot, control_socket: str, mode: str,
            parent_tag: str | None, sandbox_id: str | None, started: float, job: BranchJob,
            resumed: threading.Event,
            on_resumed: Callable[[float], None] | None = None, *,
            settle_free_pages: bool = False) -> BranchResult:
    def source_resumed(pause_ms: float) -> None:
        if not resumed.is_set():
            job.pause_ms = pause_ms
            resumed.set()
            if on_resumed is not None:
                on_resumed(pause_ms)

    with _connect(control_socket) as control:
        status = control.call({"op": "status"})
        bases = status.get("snapshot_bases") or []
        origin = next((b["tag"] for b in bases if b.get("kind") == "restore"), None)
        parent: Snapshot | None = None
        if mode == "diff":
            parent = _choose_parent(store, bases, parent_tag)
            try:
                check_depth_for_child(store, parent.tag)
            except ChainTooDeep as err:
                raise BranchFailed(str(err), stage="base") from err
        # After the checks that can refuse the branch, before the pause.
        settled = _settle_free_pages(control, status) \
            if mode == "diff" and settle_free_pages else None
        memory_path = str(pending.layer_path if mode == "diff" else pending.memory_path)
        state_path = str(pending.state_path)
        staged: tuple[str, str] | None = None
        if status.get("jailed"):
            run_dir = os.path.dirname(os.path.abspath(control_socket))
            name = f".branch-{secrets.token_hex(8)}"
            staged = (os.path.join(run_dir, name + ".memory"),
                      os.path.join(run_dir, name + ".state"))
        request: dict[str, Any] = {
            "op": "snapshot", "mode": mode,
            "memory_path": staged[0] if staged else memory_path,
            "state_path": staged[1] if staged else state_path,
            "tag": pending.tag, "progress": True}
        if parent is not None:
            request["base_tag"] = parent.tag
        try:
            control.send(request)
            first = control.receive(CONTROL_TIMEOUT)
            if first.get("stage") == "resumed":
                source_resumed(float(first["timings"]["pause_s"]) * 1000)
                reply = control.receive(WRITE_TIMEOUT)
            else:
                reply = first
            if reply.get("ok") and staged is not None:
                _take_from_run_dir(staged[1], state_path, MAX_STATE_BYTES)
                # The state says how large the guest is: a memory image is that size, a
                # layer (its pages and their index) at most twice it. No more is copied.
                mem_size = read_state_file(state_path, MachineState).mem_size
                _take_from_run_dir(staged[0], memory_path, 2 * mem_size + (1 << 20))
        finally:
            if staged is not None:
                for path in staged:
                    _unlink_quietly(path)
    if not reply.get("ok"):
        raise BranchFailed(f"the sandbox's VMM could not snapshot: {reply.get('error')}",
                           stage="capture")
    timings = {k: float(v) for k, v in reply["timings"].items()}
    source_resumed(timings["pause_s"] * 1000)

    state = read_state_file(str(pending.state_path), MachineState)
    if mode == "diff":
        assert parent is not None
        if reply.get("base_tag") != parent.tag:
            raise BranchFailed(f"the VMM layered on {reply.get('base_tag')!r}, not on "
                               f"{parent.tag!r}", stage="capture")
    origin_meta = _meta_or_none(store, parent.tag if parent else origin)
    meta = SnapshotMeta(
        tag=pending.tag, image=origin_meta.image if origin_meta else "unknown",
        mem_mib=state.mem_size >> 20, vcpus=len(state.vcpus),
        warm_up=origin_meta.warm_up if origin_meta else None,
        timings=SnapshotTimings(
            pause_ms=timings["pause_s"] * 1000,
            capture_ms=(timings.get("vcpu_state_s", 0.0) + timings.get("device_state_s", 0.0))
            * 1000,
            write_ms=timings.get("memory_write_s", 0.0) * 1000),
        branch_mode=mode, branched_from=sandbox_id, branched_from_tag=origin,
        extra={"dirty_pages": reply.get("dirty_pages"),
               "memory_bytes_written": reply.get("memory_bytes"),
               **({"free_page_reporting": settled} if settled is not None else {})})
    # A link on parent: the store hashes the layer, computes the link's memory plan
    # over its chain and publishes; a full snapshot is a root.
    snapshot = pending.publish(meta, parent=parent)
    return BranchResult(snapshot=snapshot, mode=mode, pause_ms=timings["pause_s"] * 1000,
                        total_ms=(time.monotonic() - started) * 1000,
                        memory_bytes=int(reply["memory_bytes"]),
                        dirty_pages=reply.get("dirty_pages"),
                        base_tag=parent.tag if parent else None, vmm_timings=timings)


def _settle_free_pages(control: _Control, status: dict[str, Any]) -> dict[str, Any] | None:
    """Wait (bounded) for the guest to finish reporting its free pages; what the VMM's
    balloon did, with the seconds waited and how long ago the guest had last reported
    when the wait began, or None for a VMM or guest without one."""
    started = time.monotonic()
    balloon = status.get("free_page_reporting")
    if not isinstance(balloon, dict) or not balloon.get("active"):
        return None
    age_at_start = balloon.get("last_report_age_s")
    while isinstance(balloon, dict) and balloon.get("active"):
        waited = time.monotonic() - started
        if settled(balloon.get("last_report_age_s"), waited):
            return {**balloon, "settle_s": round(waited, 2),
                    "report_age_at_start_s": (None if age_at_start is None
                                              else round(float(age_at_start), 2))}
        time.sleep(SETTLE_POLL_S)
        balloon = control.call({"op": "status"}).get("free_page_reporting")
    return None


def settled(age: object, waited: float) -> bool:
    """Whether a diff may be taken now: no report came for ``SETTLE_QUIET_S`` of this
    wait (``age``: seconds since the guest's last report, None if it never reported),
    or the wait reached ``SETTLE_MAX_S``."""
    quiet = waited if not isinstance(age, (int, float)) else min(float(age), waited)
    return quiet >= SETTLE_QUIET_S or waited >= SETTLE_MAX_S


def _take_from_run_dir(source: str, target: str, max_bytes: int) -> None:
    """Copy a jailed VMM's output ``source`` (in its run directory) to ``target``, a new
    0600 file of ours. The VMM is not trusted with what it names: ``source`` must be a
    regular file with one link owned by the run directory's owner (the jail's uid), so
    that a symlink or hard link to a host file cannot be copied into the store (and
    from there into a guest's memory), and no larger than ``max_bytes`` (a VMM may
    write up to its RLIMIT_FSIZE into its run directory; the store takes only what a
    capture of its guest can be)."""
    owner = os.stat(os.path.dirname(source)).st_uid
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        raise BranchFailed(f"the sandbox's VMM reported a snapshot but {source} cannot be "
                           f"opened: {err.strerror}", stage="capture") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != owner:
            raise BranchFailed(f"the sandbox's VMM left {source} as something other than a "
                               "file of its own (refused)", stage="capture")
        if st.st_size > max_bytes:
            raise BranchFailed(f"the sandbox's VMM left {source} of {st.st_size} bytes, more "
                               f"than a capture of its guest can be ({max_bytes}; refused)",
                               stage="capture")
        out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(out, st.st_size)
            layerfile.copy_sparse(fd, out, st.st_size)
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _meta_or_none(store: Store, tag: str | None) -> SnapshotMeta | None:
    if tag is None:
        return None
    try:
        return store.get(tag).meta
    except (SnapshotNotFound, SnapshotCorrupt, ValueError):
        return None


def _choose_parent(store: Store, bases: list[dict[str, Any]],
                   parent_tag: str | None) -> Snapshot:
    """The base of a diff: ``parent_tag`` if the sandbox can diff against it, else the
    newest base the sandbox offers that is a ready snapshot in this store."""
    offered: list[str] = [b["tag"] for b in bases if isinstance(b.get("tag"), str)]
    wanted = [parent_tag] if parent_tag is not None else offered
    for tag in wanted:
        if tag not in offered:
            break
        try:
            return store.get(tag)
        except (SnapshotNotFound, SnapshotCorrupt, ValueError):
            continue
    if parent_tag is not None:
        raise BranchFailed(
            f"cannot diff against {parent_tag!r}: the sandbox can diff against "
            f"{', '.join(map(repr, offered)) or 'nothing'} (the snapshot it was restored "
            "from, or its previous branch), and the parent must be a ready snapshot in the "
            "store", stage="base")
    raise BranchFailed("no base to diff against: the snapshot this sandbox was restored "
                       f"from and its previous branches ({', '.join(map(repr, offered)) or 'none'}"
                       ") are not in the store; branch with mode full or live", stage="base")


class _Control:
    """A JSON-lines connection to a VMM's control socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, request: dict[str, Any]) -> None:
        try:
            self.sock.sendall(json.dumps(request).encode() + b"\n")
        except OSError as err:
            raise BranchFailed(f"the sandbox's VMM is gone ({err})", stage="control") from err

    def receive(self, timeout: float) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError as err:
                raise BranchFailed(f"the sandbox's VMM did not answer within {timeout:.0f} s",
                                   stage="control") from err
            except OSError as err:
                raise BranchFailed(f"the sandbox's VMM is gone ({err})",
                                   stage="control") from err
            if not chunk:
                raise BranchFailed("the sandbox's VMM closed the control connection (did it "
                                   "exit?)", stage="control")
            self._buffer += chunk
            if len(self._buffer) > MAX_REPLY_BYTES:
                raise BranchFailed("the sandbox's VMM sent an oversized reply",
                                   stage="control")
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise BranchFailed("the sandbox's VMM sent a malformed reply", stage="control")
        return reply

    def call(self, request: dict[str, Any], timeout: float = CONTROL_TIMEOUT) -> dict[str, Any]:
        self.send(request)
        reply = self.receive(timeout)
        if not reply.get("ok"):
            raise BranchFailed(f"the sandbox's VMM refused {request.get('op')!r}: "
                               f"{reply.get('error')}", stage="control")
        return reply


def _connect(path: str) -> _Control:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(CONTROL_TIMEOUT)
    try:
        sock.connect(path)
    except OSError as err:
        sock.close()
        raise BranchFailed(f"cannot reach the sandbox's VMM at {path}: {err.strerror or err}",
                           stage="control") from err
    return _Control(sock)
