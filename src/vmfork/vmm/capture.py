"""Snapshots of a running machine in three modes: full, diff and live.

Every mode is pause-consistent (DESIGN.md decision 4): the vCPUs are parked,
their state and the VM's are read, and then -- inside one callback on the I/O
thread, the only thread on which devices touch guest memory -- the device state
is saved and guest memory is *fixed*: written (full) or frozen by a ``fork``
(live, diff). Nothing can change guest memory or device state between the
two. The modes differ in what is written and in how long the source stays
paused:

* **full**: the whole memory image. For a sandbox (RAM mapped ``MAP_PRIVATE``
  from a snapshot file) only the pages it changed (``vmm.dirty``) are written
  while paused; the rest of the image is the immutable base file's data, copied
  in the kernel (``copy_file_range``) after the resume. Other machines (a
  booted memfd parent) are written whole while paused.
* **diff**: a layer file (``ondisk.layerfile``) holding only the pages changed
  since a *base*. The base is the snapshot the sandbox was restored from (its
  changed pages are its private anonymous pages) or this sandbox's previous
  capture (pages soft-dirty since then). ``take`` reports which; the store
  materialises the head image from base + layer afterwards. While paused, the
  changed pages are listed (the page-table scan, ``vmm.dirty``), the VMM forks
  as for live, and the soft-dirty bits are cleared; the forked writer writes the
  listed pages from its copy-on-write view after the resume, so the pause no
  longer grows with the bytes a diff writes, only with the scan and the fork.
  The list must be taken in the pause: a jailed VMM's writer cannot open its own
  ``/proc/self/pagemap`` (it is not dumpable), the pre-opened descriptor shows the
  source's page tables as they change after the resume, and the bits are
  cleared for the next diff before the resume. A machine whose RAM is a shared
  memfd (a booted parent with a previous capture) cannot be forked
  copy-on-write and writes its layer while paused.
* **live**: the same image as full, but the source is paused only while its
  state is read and the VMM process ``fork``\\ s. The forked writer inherits a
  copy-on-write view of guest RAM at that instant and writes the image while
  the source runs on; a guest write after the resume breaks copy-on-write in the
  source (KVM's mappings were write-protected by the fork through its MMU
  notifier), so the writer keeps the old page and the guest stalls for one page
  copy, never for the whole write.

**Fork safety.** ``os.fork`` in a threaded process copies only the calling
thread (here the I/O thread). Locks other threads held stay locked in the
writer, so the writer does only what needs none of them: ``os`` calls on file
descriptors and guest memory views, then ``os._exit`` (no ``atexit``, no stdio
flush, no logging). It asks the kernel to kill it if the VMM dies
(``PR_SET_PDEATHSIG``), reports over a pipe, and the VMM reaps it with
``waitpid`` before answering. A writer that fails (a full disk, a kill) fails the
capture after the resume: its temporary file is removed, nothing is renamed into
place, and the next diff is no longer offered the previous capture as its base
(the bits were cleared for a capture that does not exist) but the restore base. The fork's cost is the copy of the VMM's page
tables, which grows with the RAM the guest has written (a restored sandbox's
untouched file pages are not copied); ``bench/branch.py`` measures it.
Machines whose RAM is a ``MAP_SHARED`` memfd (a freshly booted parent, not a
sandbox) cannot be captured live: a fork shares, not copies, that memory.

**Dirty tracking** costs nothing until the first capture: the restore base is
always available from the page tables. Each successful capture then clears the
soft-dirty bits during its pause, so the next diff can be taken against it,
when the kernel supports soft-dirty (``vmm.dirty``).

**Nothing partial.** Memory goes to a temporary name next to its target, the
state file is written atomically, and the memory file is renamed into place
last; any failure removes what was written. The pause covers copying into the
page cache only: the fsync that makes the file durable runs after the resume.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from vmfork.ondisk import layerfile
from vmfork.ondisk.durable import fsync_file, write_file_atomic
from vmfork.ondisk.errors import OnDiskError
from vmfork.ondisk.stateformat import encode_state
from vmfork.vmm import dirty
from vmfork.vmm.errors import HostError
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory, subtract_runs
from vmfork.vmm.vmstate import MachineState, VcpuState, VmState

MODES = ("full", "diff", "live")
BASE_RESTORE = "restore"      # the snapshot the sandbox was restored from
BASE_PREVIOUS = "previous"    # this sandbox's previous successful capture
MEMORY_IMAGE = "image"        # a whole memory file (backing layout, sparse)
MEMORY_LAYER = "layer"        # a layer file: changed pages + index

_PR_SET_PDEATHSIG = 1
# Resolved here, not in the forked writer: a symbol lookup there could need a loader
# lock that another thread held at the fork.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


T = TypeVar("T")


class CaptureHold(Protocol):
    """A device that must keep what it would give back while a capture is in flight
    (the balloon's reported pages: ``balloon.py``'s "Holds")."""

    def hold(self) -> None: ...

    def release(self) -> None: ...


class CapturedMachine(Protocol):
    """What a capture reads of a running machine: a Python ``Machine``, or a native
    child's ``NativeMachine`` through its Python view (``vmm/native_view.py``)."""

    @property
    def memory(self) -> GuestMemory: ...

    @property
    def balloon_device(self) -> CaptureHold | None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def save_cpu_state(self) -> tuple[VmState, list[VcpuState]]:
        """The VM's and each vCPU's state; the vCPUs are paused."""
        ...

    def save_device_state(self, vm: VmState, vcpus: list[VcpuState]) -> MachineState:
        """The whole state around ``vm`` and ``vcpus``; inside ``with_devices_still``."""
        ...

    def with_devices_still(self, fn: Callable[[], T], timeout: float) -> T:
        """``fn()`` while no device touches guest RAM or changes its state (the I/O
        thread's guarantee; see the module notes); ``HostError`` after ``timeout``."""
        ...


class CaptureError(HostError):
    """A snapshot could not be taken; nothing was left at its paths."""


@dataclass(frozen=True)
class CaptureResult:
    """What ``SnapshotTaker.take`` wrote. Times in seconds, sizes in bytes."""

    mode: str
    state: MachineState
    memory_format: str
    memory_bytes: int                 # data bytes written to the memory file
    dirty_pages: int | None           # pages changed since the base (None: not known)
    base_tag: str | None              # diff: the snapshot the layer applies to
    base_kind: str | None             # diff: BASE_RESTORE or BASE_PREVIOUS
    tracking: str                     # "soft-dirty" or "restore-base-only"
    timings: dict[str, float] = field(default_factory=dict)
    changed_pages: int | None = None  # diff: the layer's pages that differ from its base
    """A diff's layer holds these and the unchanged pages of the small gaps its runs were
    merged across (``dirty.coalesced``); against the restore base, ``dirty_pages`` also
    counts the pages written back to the base's bytes, which the layer leaves out."""


@dataclass
class _Base:
    tag: str | None
    kind: str


def tracking() -> str:
    """How this host finds a diff's pages since a previous capture: "soft-dirty", or
    "restore-base-only" where the kernel lacks it (the module notes)."""
    return "soft-dirty" if dirty.soft_dirty_supported() else "restore-base-only"


class SnapshotTaker:
    """Takes snapshots of one machine and remembers what the next diff can be based on.

    ``origin_tag`` names the snapshot the machine was restored from (``None``
    for a booted machine). Not thread-safe: one capture at a time (the control
    server serialises them).
    """

    def __init__(self, machine: CapturedMachine, origin_tag: str | None = None) -> None:
        self.machine = machine
        self.origin_tag = origin_tag
        self._previous: _Base | None = None   # set once soft-dirty bits track since it
        self.captures = 0

    @property
    def tracking(self) -> str:
        return tracking()

    def bases(self) -> list[dict[str, str | None]]:
        """The bases a diff can be taken against now, newest first."""
        out: list[dict[str, str | None]] = []
        if self._previous is not None:
            out.append({"tag": self._previous.tag, "kind": BASE_PREVIOUS})
        if self.machine.memory.private_file:
            out.append({"tag": self.origin_tag, "kind": BASE_RESTORE})
        return out

    def _choose_base(self, base_tag: str | None) -> _Base:
        memory = self.machine.memory
        if base_tag is None:
            if self._previous is not None:
                return self._previous
            if memory.private_file:
                return _Base(self.origin_tag, BASE_RESTORE)
        else:
            if self._previous is not None and self._previous.tag == base_tag:
                return self._previous
            if memory.private_file and self.origin_tag == base_tag:
                return _Base(base_tag, BASE_RESTORE)
        known = [b["tag"] for b in self.bases() if b["tag"] is not None]
        raise CaptureError(
            (f"cannot diff against {base_tag!r}: " if base_tag else "no base to diff against: ")
            + (f"this sandbox can diff against {', '.join(map(repr, known))}" if known else
               "this machine was not restored from a snapshot and has no previous capture")
            + "; take a full snapshot instead", op="snapshot")

    # -- the capture -------------------------------------------------------------------
    def take(self, mode: str, memory_path: str, state_path: str, *, tag: str | None = None,
             base_tag: str | None = None, resume: bool = True,
             on_resumed: Callable[[dict[str, float]], None] | None = None) -> CaptureResult:
        """Capture the machine in ``mode`` into ``memory_path`` and ``state_path``.

        ``memory_path`` receives a memory image (full, live) or a layer file
        (diff, relative to the base named in the result). ``tag`` names this
        capture so a later diff can use it as its base; ``base_tag`` picks the
        base of a diff (default: the previous capture if tracked, else the
        restore base). ``on_resumed(timings)`` is called once the source runs
        again (before the memory of a live capture, or of a diff of a sandbox, is
        written). Leaves nothing at either path on failure.
        """
        if mode not in MODES:
            raise CaptureError(f"mode must be one of {', '.join(MODES)}, not {mode!r}",
                               op="snapshot")
        machine = self.machine
        memory = machine.memory
        base = self._choose_base(base_tag) if mode == "diff" else None
        if mode == "live" and not _forks_copy_on_write(memory):
            raise CaptureError("live snapshots need guest RAM that a fork copies on write "
                               "(a sandbox restored from a snapshot); this machine's RAM is a "
                               "shared memfd: use mode full", op="snapshot")
        for path in (memory_path, state_path):
            if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise CaptureError(f"the directory of {path} does not exist", op="snapshot")
        track = dirty.soft_dirty_supported()
        tmp_memory = _temp_name(memory_path)
        timings: dict[str, float] = {}
        started = time.monotonic()
        writer: _Writer | None = None
        changed: list[dirty.Run] | None = None   # full, sandbox: base data still to copy
        changed_pages: int | None = None
        cleared = False
        balloon = machine.balloon_device
        if balloon is not None:
            balloon.hold()   # until the writer is done: balloon.py's "Holds" says why
        try:
            machine.pause()
            paused_at = time.monotonic()
            timings["pause_request_s"] = paused_at - started
            try:
                vm, vcpus = machine.save_cpu_state()
                timings["vcpu_state_s"] = time.monotonic() - paused_at

                def fix_memory() -> tuple[MachineState, int, int | None]:
                    nonlocal writer, cleared, changed, changed_pages
                    at = time.monotonic()
                    state = machine.save_device_state(vm, vcpus)
                    timings["device_state_s"] = time.monotonic() - at
                    written, pages = 0, None
                    at = time.monotonic()
                    if mode == "live":
                        writer = _Writer.fork(
                            tmp_memory, lambda: _write_image_file(tmp_memory, memory))
                        timings["fork_s"] = time.monotonic() - at
                    elif mode == "diff":
                        assert base is not None
                        runs = _changed_since(memory, base)
                        pages = dirty.page_count(runs)
                        timings["scan_s"] = time.monotonic() - at
                        at = time.monotonic()
                        if _forks_copy_on_write(memory):
                            # The pages are fixed: the writer's copy-on-write view holds
                            # them as of now, whatever the guest writes after the resume.
                            # Against the restore base it also leaves out the pages that
                            # were written back to the base's bytes (_without_unchanged).
                            against_restore = base.kind == BASE_RESTORE

                            def write_layer() -> tuple[int, int | None]:
                                kept = (_without_unchanged(memory, runs) if against_restore
                                        else runs)
                                # The pages kept, not the dirty ones: take reads it
                                # as changed_pages.
                                return (_write_layer_file(tmp_memory, memory, kept),
                                        dirty.page_count(kept))

                            writer = _Writer.fork(tmp_memory, write_layer)
                            timings["fork_s"] = time.monotonic() - at
                        else:
                            written = _write_layer_file(tmp_memory, memory, runs)
                            changed_pages = pages
                            timings["memory_write_s"] = time.monotonic() - at
                    elif memory.private_file:
                        written, changed = _write_changed_pages(tmp_memory, memory)
                        pages = dirty.page_count(changed)
                        timings["memory_write_s"] = time.monotonic() - at
                    else:
                        written, pages = _write_image_file(tmp_memory, memory)
                        timings["memory_write_s"] = time.monotonic() - at
                    if track:
                        at = time.monotonic()
                        dirty.clear_soft_dirty()
                        cleared = True
                        timings["clear_soft_dirty_s"] = time.monotonic() - at
                    return state, written, pages

                state, written, pages = machine.with_devices_still(fix_memory, timeout=3600)
            finally:
                if resume:
                    machine.resume()
                timings["pause_s"] = time.monotonic() - started
            if on_resumed is not None:
                on_resumed(dict(timings))
            at = time.monotonic()
            if writer is not None:
                if mode == "diff":
                    written, changed_pages = writer.wait()
                else:
                    written, pages = writer.wait()
                timings["memory_write_s"] = time.monotonic() - at
            else:
                if changed is not None:
                    written += _fill_from_base(tmp_memory, memory, changed)
                    timings["base_copy_s"] = time.monotonic() - at
                    at = time.monotonic()
                fsync_file(tmp_memory)
                timings["fsync_s"] = time.monotonic() - at
            at = time.monotonic()
            write_file_atomic(state_path, encode_state(state))
            try:
                os.rename(tmp_memory, memory_path)
            except OSError:
                _unlink_quietly(state_path)
                raise
            timings["state_write_s"] = time.monotonic() - at
        except BaseException as err:
            if writer is not None:
                writer.kill()
            _unlink_quietly(tmp_memory)
            if cleared:
                # The pages dirtied since the previous capture are forgotten, so it can
                # no longer be a base; the restore base always can.
                self._previous = None
            if isinstance(err, (HostError, OnDiskError, OSError)) \
                    and not isinstance(err, CaptureError):
                raise CaptureError(f"{mode} snapshot failed: {err}", op="snapshot") from err
            raise
        finally:
            if balloon is not None:
                balloon.release()
        timings["total_s"] = time.monotonic() - started
        if track:
            self._previous = _Base(tag, BASE_PREVIOUS)
        self.captures += 1
        return CaptureResult(
            mode=mode, state=state,
            memory_format=MEMORY_LAYER if mode == "diff" else MEMORY_IMAGE,
            memory_bytes=written, dirty_pages=pages, changed_pages=changed_pages,
            base_tag=base.tag if base else None, base_kind=base.kind if base else None,
            tracking=self.tracking, timings=timings)


def _changed_since(memory: GuestMemory, base: _Base) -> list[dirty.Run]:
    """The pages a diff against ``base`` holds; read while paused (see ``take``)."""
    if base.kind == BASE_PREVIOUS:
        return dirty.soft_dirty_pages(memory)
    return dirty.changed_private_pages(memory)


# -- memory files --------------------------------------------------------------------

# The writer compares a diff's pages with the restore base's a chunk at a time.
_COMPARE_CHUNK = 1 << 20


def _without_unchanged(memory: GuestMemory, runs: list[dirty.Run]) -> list[dirty.Run]:
    """``runs`` (the private pages of RAM restored ``MAP_PRIVATE``) without the pages
    that hold exactly what the restore base holds there. A guest write makes a page
    private whatever it writes, and the kernel writes many pages back to what they were
    (measured, a build's layer: 4% of its pages); such a page adds nothing to a layer,
    and the plan maps it from the base. Run in the forked writer, after the resume: it
    reads the base through the fds the restore mapped it from (``os.pread``, no
    lock), and its copy-on-write view of RAM as of the pause."""
    out: list[dirty.Run] = []
    for offset, length in runs:
        view = memory.backing_view(offset, length)
        for at in range(0, length, _COMPARE_CHUNK):
            n = min(_COMPARE_CHUNK, length - at)
            now = bytes(view[at:at + n])
            before = _read_base(memory, offset + at, n)
            if now == before:
                continue
            for page in range(0, n, PAGE_SIZE):
                if now[page:page + PAGE_SIZE] != before[page:page + PAGE_SIZE]:
                    start = offset + at + page
                    if out and out[-1][0] + out[-1][1] == start:
                        out[-1] = (out[-1][0], out[-1][1] + PAGE_SIZE)
                    else:
                        out.append((start, PAGE_SIZE))
    return out


def _read_base(memory: GuestMemory, offset: int, length: int) -> bytes:
    """The restore base's bytes at ``offset`` (backing layout): the overlays (a chain's
    layers) where they lie, the snapshot's memory file elsewhere."""
    assert memory.backing_fd is not None
    pieces = []
    at, end = offset, offset + length
    for overlay in memory.overlays:            # sorted by offset, disjoint
        o_end = overlay.offset + overlay.length
        if o_end <= at:
            continue
        if overlay.offset >= end:
            break
        if overlay.offset > at:
            pieces.append(_pread_all(memory.backing_fd, overlay.offset - at, at))
            at = overlay.offset
        upto = min(end, o_end)
        pieces.append(_pread_all(overlay.fd, upto - at,
                                 overlay.file_offset + at - overlay.offset))
        at = upto
    if at < end:
        pieces.append(_pread_all(memory.backing_fd, end - at, at))
    return b"".join(pieces)


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            raise OSError(f"memory file ends before {offset + length:#x}")
        chunks.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _forks_copy_on_write(memory: GuestMemory) -> bool:
    """A fork copies private mappings on write; a memfd mapped shared it would share."""
    return memory.private_file or memory.backing_fd is None


def _temp_name(path: str) -> str:
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_file(path: str, write: Callable[[int], int]) -> int:
    """Create ``path`` and fill it; no fsync (``durable.fsync_file``), which is kept out of
    the pause: once written, the page cache holds the capture's bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        return write(fd)
    finally:
        os.close(fd)


def _write_layer_file(path: str, memory: GuestMemory, runs: list[dirty.Run]) -> int:
    """Create the layer file of ``runs`` of ``memory`` at ``path``, merged across their
    smallest gaps (``dirty.coalesced``: a gap's pages are read as of the pause, like
    the runs', so they hold what the layers below hold there); returns data bytes."""
    extents = dirty.coalesced(runs)
    return _write_file(path, lambda fd: layerfile.write_layer(fd, memory, extents))


def _write_image_file(path: str, memory: GuestMemory) -> tuple[int, int | None]:
    """Write the whole memory image to ``path``; returns (data bytes, changed pages or None).

    A sandbox's image is its base file's data plus the pages it changed; any
    other machine's is ``GuestMemory.dump`` (memfd extents, or non-zero blocks).
    """
    if not memory.private_file:
        return memory.dump(path), None
    written, runs = _write_changed_pages(path, memory)
    return written + _fill_from_base(path, memory, runs), dirty.page_count(runs)


def _write_changed_pages(path: str, memory: GuestMemory) -> tuple[int, list[dirty.Run]]:
    """Create the image of a sandbox's RAM at ``path`` with only the pages it changed
    written (the part that must be taken while paused); ``_fill_from_base`` adds the
    rest, which comes from the immutable base file and can wait until after the resume."""
    runs = dirty.changed_private_pages(memory)

    def write(fd: int) -> int:
        os.ftruncate(fd, memory.size)
        for offset, length in runs:
            view = memory.backing_view(offset, length)
            try:
                layerfile.pwrite_all(fd, view, offset)
            finally:
                view.release()
        return sum(length for _, length in runs)

    return _write_file(path, write), runs


def _fill_from_base(path: str, memory: GuestMemory, changed: list[dirty.Run]) -> int:
    """Copy the base's data into the image at ``path`` everywhere but ``changed``: from
    the snapshot file, and where a diff chain's layers are mapped over it, from them."""
    assert memory.backing_fd is not None
    sources = list(memory.base_sources(layerfile.data_extents(memory.backing_fd,
                                                              memory.size)))
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        copied = 0
        at = 0
        # Each piece lies inside one source (subtract_runs never joins its extents).
        for offset, length in subtract_runs([(s.offset, s.length) for s in sources], changed):
            while sources[at].offset + sources[at].length <= offset:
                at += 1
            source = sources[at]
            layerfile.copy_range(source.fd, source.file_offset + offset - source.offset, fd,
                                 offset, length)
            copied += length
    finally:
        os.close(fd)
    return copied


class _Writer:
    """The forked process that writes a capture's memory after the source resumed (a live
    capture's image, a diff's layer) from its copy-on-write view of guest RAM at the
    fork. ``write()`` runs in it and returns (data bytes written, changed pages or None);
    the writer then fsyncs ``path`` and reports over a pipe."""

    def __init__(self, pid: int, report_fd: int, path: str) -> None:
        self.pid = pid
        self.report_fd = report_fd
        self.path = path
        self._reaped = False

    @classmethod
    def fork(cls, path: str, write: Callable[[], tuple[int, int | None]]) -> _Writer:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError as err:
            os.close(read_fd)
            os.close(write_fd)
            raise CaptureError(f"fork for the snapshot writer failed: {err}", op="fork",
                               errno=err.errno) from err
        if pid == 0:   # the writer: raw system calls only, then _exit (see module notes)
            status = 1
            report: dict[str, object]
            try:
                os.close(read_fd)
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != parent:
                    os._exit(1)
                written, pages = write()
                fsync_file(path)
                report = {"ok": True, "written": written, "pages": pages}
                status = 0
            except BaseException as err:  # noqa: BLE001 -- reported to the VMM, then _exit
                report = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            try:
                os.write(write_fd, json.dumps(report).encode()[:4000])
            finally:
                os._exit(status)
        os.close(write_fd)
        return cls(pid, read_fd, path)

    def _close_report(self) -> None:
        if self.report_fd >= 0:
            os.close(self.report_fd)
            self.report_fd = -1

    def wait(self) -> tuple[int, int | None]:
        chunks = []
        try:
            while True:
                chunk = os.read(self.report_fd, 4096)
                if not chunk:
                    break
                chunks.append(chunk)
            _, status = os.waitpid(self.pid, 0)
            self._reaped = True
        finally:
            self._close_report()
        try:
            report = json.loads(b"".join(chunks) or b"{}")
        except ValueError:
            report = {}
        if os.waitstatus_to_exitcode(status) != 0 or not report.get("ok"):
            reason = report.get("error") or f"wait status {status:#x}"
            raise CaptureError(f"the snapshot writer failed: {reason}", op="memory_write")
        return int(report["written"]), report.get("pages")

    def kill(self) -> None:
        if self._reaped:
            self._close_report()
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self._reaped = True
        self._close_report()
