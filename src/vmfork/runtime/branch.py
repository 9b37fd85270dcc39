"""BRANCH: snapshot a running sandbox into the store, the source paused for an instant.

``branch_sandbox`` is what the daemon's ``POST /v1/sandboxes/:id/branch`` calls.
It claims the tag in the store first (a bad or taken tag fails before the
sandbox is touched), asks the sandbox's VMM over its control socket
(``runtime.control``) to capture itself (the ``snapshot`` op,
``runtime.vmmchild.ControlServer.snapshot``) into the pending directory, resolves
a diff into a spawnable head (``store.layers``), hashes what entered the store, and
publishes atomically.
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

import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vmfork.ondisk import layerfile
from vmfork.ondisk.stateformat import read_state_file
from vmfork.runtime import control
from vmfork.store import PendingSnapshot, Snapshot, SnapshotMeta, SnapshotTimings, Store
from vmfork.store.errors import SnapshotCorrupt, SnapshotNotFound
from vmfork.store.store import ChainTooDeep, check_depth_for_child
from vmfork.store.tags import validate_tag
from vmfork.vmm.capture import MODES
from vmfork.vmm.vmstate import MachineState

# Timeouts and the reply bound of the VMM's control socket: runtime.control.
MAX_STATE_BYTES = 64 << 20   # a jailed VMM's state file taken into the store at most
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

    try:
        with control.ControlClient.connect(control_socket) as client:
            reply, settled, origin, parent = _capture(
                client, store, pending, control_socket, mode, parent_tag,
                settle_free_pages, source_resumed)
    except control.ControlError as err:
        # Where callers expect it (the daemon answers 502 and points at the sandbox).
        raise BranchFailed(f"the sandbox's VMM refused {err.op!r}: {err}" if err.refused
                           else str(err), stage="control") from err
    timings = dict(reply.timings)
    source_resumed(reply.pause_s * 1000)

    state = read_state_file(str(pending.state_path), MachineState)
    if mode == "diff":
        assert parent is not None
        if reply.base_tag != parent.tag:
            raise BranchFailed(f"the VMM layered on {reply.base_tag!r}, not on "
                               f"{parent.tag!r}", stage="capture")
    origin_meta = _meta_or_none(store, parent.tag if parent else origin)
    meta = SnapshotMeta(
        tag=pending.tag, image=origin_meta.image if origin_meta else "unknown",
        mem_mib=state.mem_size >> 20, vcpus=len(state.vcpus),
        warm_up=origin_meta.warm_up if origin_meta else None,
        timings=SnapshotTimings(
            pause_ms=reply.pause_s * 1000,
            capture_ms=(timings.get("vcpu_state_s", 0.0) + timings.get("device_state_s", 0.0))
            * 1000,
            write_ms=timings.get("memory_write_s", 0.0) * 1000),
        branch_mode=mode, branched_from=sandbox_id, branched_from_tag=origin,
        extra={"dirty_pages": reply.dirty_pages,
               **({"changed_pages": reply.changed_pages}
                  if reply.changed_pages is not None else {}),
               "memory_bytes_written": reply.memory_bytes,
               **({"free_page_reporting": settled} if settled is not None else {})})
    # A link on parent: the store hashes the layer, computes the link's memory plan
    # over its chain and publishes; a full snapshot is a root.
    snapshot = pending.publish(meta, parent=parent)
    return BranchResult(snapshot=snapshot, mode=mode, pause_ms=reply.pause_s * 1000,
                        total_ms=(time.monotonic() - started) * 1000,
                        memory_bytes=reply.memory_bytes, dirty_pages=reply.dirty_pages,
                        base_tag=parent.tag if parent else None, vmm_timings=timings)


def _capture(client: control.ControlClient, store: Store, pending: PendingSnapshot,
             control_socket: str, mode: str, parent_tag: str | None,
             settle_free_pages: bool, source_resumed: Callable[[float], None],
             ) -> tuple[control.SnapshotReply, dict[str, Any] | None, str | None,
                        Snapshot | None]:
    """Have the VMM on ``client`` capture itself into ``pending``'s files: its reply,
    what settling free pages did (or None), the tag it was restored from and the
    diff's parent. ``ControlError`` for the VMM unreachable or misbehaving;
    ``BranchFailed`` for a base it cannot diff against or a capture it refused."""
    status = client.call(control.Status())
    bases = status.snapshot_bases
    origin = next((b.tag for b in bases if b.kind == "restore"), None)
    parent: Snapshot | None = None
    if mode == "diff":
        parent = _choose_parent(store, bases, parent_tag)
        try:
            check_depth_for_child(store, parent.tag)
        except ChainTooDeep as err:
            raise BranchFailed(str(err), stage="base") from err
    # After the checks that can refuse the branch, before the pause.
    settled = _settle_free_pages(client, status) \
        if mode == "diff" and settle_free_pages else None
    memory_path = str(pending.layer_path if mode == "diff" else pending.memory_path)
    state_path = str(pending.state_path)
    staged: tuple[str, str] | None = None
    if status.jailed:
        run_dir = os.path.dirname(os.path.abspath(control_socket))
        name = f".branch-{secrets.token_hex(8)}"
        staged = (os.path.join(run_dir, name + ".memory"),
                  os.path.join(run_dir, name + ".state"))
    request = control.Snapshot(memory_path=staged[0] if staged else memory_path,
                               state_path=staged[1] if staged else state_path, mode=mode,
                               tag=pending.tag, base_tag=parent.tag if parent else None,
                               progress=True)
    try:
        try:
            reply = client.snapshot(request,
                                    on_resumed=lambda r: source_resumed(r.pause_s * 1000))
        except control.ControlError as err:
            if err.refused:
                raise BranchFailed(f"the sandbox's VMM could not snapshot: {err}",
                                   stage="capture") from err
            raise
        if staged is not None:
            _take_from_run_dir(staged[1], state_path, MAX_STATE_BYTES)
            # The state says how large the guest is: a memory image is that size, a
            # layer (its pages and their index) at most twice it. No more is copied.
            mem_size = read_state_file(state_path, MachineState).mem_size
            _take_from_run_dir(staged[0], memory_path, 2 * mem_size + (1 << 20))
    finally:
        if staged is not None:
            for path in staged:
                _unlink_quietly(path)
    return reply, settled, origin, parent


def _settle_free_pages(client: control.ControlClient,
                       status: control.StatusReply) -> dict[str, Any] | None:
    """Wait (bounded) for the guest to finish reporting its free pages; what the VMM's
    balloon did, with the seconds waited and how long ago the guest had last reported
    when the wait began, or None for a VMM or guest without one."""
    started = time.monotonic()
    balloon = status.free_page_reporting
    if balloon is None or not balloon.active:
        return None
    age_at_start = balloon.last_report_age_s
    while balloon is not None and balloon.active:
        waited = time.monotonic() - started
        if settled(balloon.last_report_age_s, waited):
            return {**balloon.to_wire(), "settle_s": round(waited, 2),
                    "report_age_at_start_s": (None if age_at_start is None
                                              else round(age_at_start, 2))}
        time.sleep(SETTLE_POLL_S)
        balloon = client.call(control.Status()).free_page_reporting
    return None


def settled(age: float | None, waited: float) -> bool:
    """Whether a diff may be taken now: no report came for ``SETTLE_QUIET_S`` of this
    wait (``age``: seconds since the guest's last report, None if it never reported),
    or the wait reached ``SETTLE_MAX_S``."""
    quiet = waited if age is None else min(age, waited)
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


def _choose_parent(store: Store, bases: tuple[control.SnapshotBase, ...],
                   parent_tag: str | None) -> Snapshot:
    """The base of a diff: ``parent_tag`` if the sandbox can diff against it, else the
    newest base the sandbox offers that is a ready snapshot in this store."""
    offered = [b.tag for b in bases if b.tag is not None]
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
