"""Boot a parent, warm it, snapshot it into the store.

The tag is claimed in the store *before* the boot (``store.begin``), so a bad
or taken tag fails in milliseconds, and a failed boot, warm-up or capture
leaves nothing behind (the pending directory is removed; nothing is listed).

Two ways in:

* ``snapshot_parent`` boots the guest in the calling process (tests, benchmarks).
* ``boot_parent`` runs the same thing as a process of its own
  (``python -m vmfork.runtime.parent REQUEST RESULT``, like a sandbox's VMM
  process, ``runtime.vmmchild``) and returns a ``SnapshotReport`` or raises
  ``ParentFailed`` with a ``kind`` saying who caused the failure. The daemon and
  the CLI's local path both use it: a VM lives in a process of its own (DESIGN
  decision 1), so a crashing VMM cannot take the daemon with it, and the VMM gets
  the main thread its vCPU kick signal needs. With ``network=True`` and a
  ``HostNetwork``, ``boot_parent`` makes the parent a network namespace of its own
  (under an egress policy) and the process enters it before it builds the
  machine, so the warm-up can download; the namespace is removed afterwards
  whatever happened. Children of the snapshot are made unique on the network by
  the spawn (``net_refresh``), as for any networked snapshot.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from vmfork.image import GuestImage
from vmfork.ondisk.stateformat import write_state_file
from vmfork.runtime.guest import BootedGuest
from vmfork.runtime.network import (
    EgressPolicy,
    GuestNetwork,
    HostNetwork,
    NetworkError,
    host_dns_servers,
)
from vmfork.runtime.supervise import run_module_in_own_group
from vmfork.runtime.volumes import DEFAULT_FREE_SLOTS, PreparedVolume
from vmfork.store import Snapshot, SnapshotMeta, SnapshotTimings, Store


class WarmUpFailed(RuntimeError):
    """The warm-up code or command failed in the guest; nothing was snapshotted."""


def guest_network() -> GuestNetwork:
    """The guest side of every networked parent and sandbox: the fixed addresses
    (``GuestNetwork``), with the host's name servers for the guest."""
    return GuestNetwork(dns=host_dns_servers())


# What the guest kernel prints when memory runs out (mm/oom_kill.c, mm/page_alloc.c).
_OOM_MARKERS = ("Out of memory", "oom-kill", "invoked oom-killer", "page allocation failure")


def out_of_memory_hint(console_tail: str, mem_mib: int, error: str = "") -> str | None:
    """A sentence for a failure that the guest's console (the kernel's OOM killer) or
    the error itself (Python's MemoryError) shows as running out of memory, else None."""
    lines = [line for line in console_tail.splitlines()
             if any(marker in line for marker in _OOM_MARKERS)]
    if not lines and "MemoryError" in error:
        lines = ["MemoryError"]
    if not lines:
        return None
    return (f"the guest ran out of memory ({lines[-1].strip()[:160]}); it has "
            f"{mem_mib} MiB: give it more with --mem-mib {max(mem_mib * 2, 512)} "
            "(the root overlay's writes and the warm-up's allocations both live in guest RAM)")


# A parent boots once and then warms for minutes, under PARENT_TIMEOUT_S in all; on a
# loaded host (the emulated test host with several others beside it) its kernel alone
# was seen to take 107 s to reach /init, so the sandbox's 120 s would fail it for nothing.
PARENT_READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SnapshotReport:
    snapshot: Snapshot
    boot_s: float
    warm_s: float
    pause_ms: float
    capture_ms: float
    memory_write_ms: float
    memory_bytes: int


def _warm_up(guest: BootedGuest, warm_code: str | None, warm_cmd: str | None) -> None:
    if warm_code is not None:
        result = guest.agent.eval(warm_code)
        if result.exception is not None:
            raise WarmUpFailed(f"warm-up code raised {result.exception.type}: "
                               f"{result.exception.message}")
    elif warm_cmd is not None:
        done = guest.agent.exec(warm_cmd)
        if done.exit_code != 0:
            raise WarmUpFailed(
                f"warm-up command exited {done.exit_code}: "
                f"{done.stderr.decode(errors='replace').strip()[-500:]}")


def snapshot_parent(store: Store, tag: str, image: GuestImage, *, mem_mib: int = 256,
                    vcpus: int = 1, warm_code: str | None = None,
                    warm_cmd: str | None = None,
                    network: GuestNetwork | None = None,
                    net_tap: str | None = None,
                    volumes: tuple[PreparedVolume, ...] = (),
                    free_volume_slots: int = DEFAULT_FREE_SLOTS) -> SnapshotReport:
    """``network``: boot the parent with a network device configured with it, so
    that its children can be given networks (``fork_children(per_child_netns=True)``
    with a ``HostNetwork`` of the same ``GuestNetwork``); ``net_tap``: the tap (in
    this thread's network namespace) that cables it, so the warm-up can reach out.
    ``volumes``: read-only volumes mounted before the warm-up and recorded in the
    snapshot (every child has them at the same paths); ``free_volume_slots``: empty
    slots reserved for volumes given at spawn. In this process, unjailed (tests,
    benchmarks); ``boot_parent`` is the jailed way."""
    _check_parent_args(warm_code, warm_cmd, volumes)
    with store.begin(tag) as pending:
        captured = boot_and_capture(image, str(pending.memory_path), str(pending.state_path),
                                    mem_mib=mem_mib, vcpus=vcpus, warm_code=warm_code,
                                    warm_cmd=warm_cmd, network=network, net_tap=net_tap,
                                    volumes=volumes, free_volume_slots=free_volume_slots)
        snapshot = pending.publish(parent_meta(
            pending.tag, image, captured, mem_mib=mem_mib, vcpus=vcpus,
            warm_up=warm_code if warm_code is not None else warm_cmd,
            network=network is not None, connected=net_tap is not None, volumes=volumes,
            free_volume_slots=free_volume_slots))
    return SnapshotReport(snapshot=snapshot, boot_s=captured.boot_s, warm_s=captured.warm_s,
                          pause_ms=captured.pause_ms, capture_ms=captured.capture_ms,
                          memory_write_ms=captured.memory_write_ms,
                          memory_bytes=captured.memory_bytes)


def _check_parent_args(warm_code: str | None, warm_cmd: str | None,
                       volumes: tuple[PreparedVolume, ...]) -> None:
    for volume in volumes:
        if not volume.read_only:
            raise ValueError(f"volume {volume.source}:{volume.guest_path}:rw: a snapshot's "
                             "volumes are shared by all its children, so they are "
                             "read-only; attach a read-write volume at spawn or "
                             "workspace create")
    if warm_code is not None and warm_cmd is not None:
        raise ValueError("give warm_code (Python run by the agent) or warm_cmd "
                         "(a shell command), not both")


@dataclass(frozen=True)
class Captured:
    """What booting, warming and capturing a parent took (seconds, milliseconds, bytes)."""

    boot_s: float
    warm_s: float
    pause_ms: float
    capture_ms: float
    memory_write_ms: float
    memory_bytes: int


def boot_and_capture(image: GuestImage, memory_path: str, state_path: str, *,
                     mem_mib: int, vcpus: int, warm_code: str | None, warm_cmd: str | None,
                     network: GuestNetwork | None, net_tap: str | None,
                     volumes: tuple[PreparedVolume, ...], free_volume_slots: int,
                     before_start: Callable[[], None] | None = None,
                     balloon: bool | None = None) -> Captured:
    """Boot ``image``, run the warm-up, write the paused guest to ``memory_path`` and
    ``state_path`` (new files). ``before_start``: see ``BootedGuest``."""
    started = time.monotonic()
    with BootedGuest(image, mem_mib=mem_mib, vcpus=vcpus, network=network,
                     net_tap=net_tap, volumes=volumes,
                     free_volume_slots=free_volume_slots, balloon=balloon,
                     ready_timeout=PARENT_READY_TIMEOUT_S, before_start=before_start) as guest:
        booted = time.monotonic()
        try:
            _warm_up(guest, warm_code, warm_cmd)
        except WarmUpFailed as err:
            hint = out_of_memory_hint(guest.console_tail(), mem_mib, str(err))
            if hint is not None:
                raise WarmUpFailed(f"{err}; {hint}") from None
            raise
        warmed = time.monotonic()
        assert guest.machine is not None
        state, timings = guest.machine.snapshot(memory_path, resume=False)
        write_state_file(state_path, state)
    return Captured(boot_s=booted - started, warm_s=warmed - booted,
                    pause_ms=timings["paused"] * 1000, capture_ms=timings["vcpu_state"] * 1000,
                    memory_write_ms=timings["memory_write"] * 1000,
                    memory_bytes=int(timings["memory_bytes"]))


def parent_meta(tag: str, image: GuestImage, captured: Captured, *, mem_mib: int, vcpus: int,
                warm_up: str | None, network: bool, connected: bool,
                volumes: tuple[PreparedVolume, ...], free_volume_slots: int) -> SnapshotMeta:
    """The meta of a parent snapshot, from what was asked (never from what a jailed
    process says, beyond its timings)."""
    return SnapshotMeta(
        tag=tag, image=image.name, mem_mib=mem_mib, vcpus=vcpus, warm_up=warm_up,
        timings=SnapshotTimings(boot_ms=captured.boot_s * 1000, warm_ms=captured.warm_s * 1000,
                                pause_ms=captured.pause_ms, capture_ms=captured.capture_ms,
                                write_ms=captured.memory_write_ms),
        # Whether sandboxes of it can get networks (the daemon checks before a spawn),
        # and the root disk its children open (by content hash), if its image has one.
        extra={"network": network,
               **({"network_connected": True} if connected else {}),
               **({"image_disk": image.disk_key} if image.disk_key else {}),
               **({"volumes": [{"guest_path": v.guest_path, "key": v.key,
                                "read_only": True, "source": v.source}
                               for v in volumes]} if volumes else {}),
               "volume_slots": len(volumes) + free_volume_slots})


# -- the parent as a process of its own -------------------------------------------------

# Who caused a failure, so that callers can answer with the right status: the
# request ("invalid", "image_missing", "image", "tag_exists", "tag_busy"), the
# user's warm-up ("warm_up"), the guest ("boot"), the host ("network", "store",
# "crashed", "timeout", "internal").
FailureKind = Literal["invalid", "image_missing", "image", "tag_exists", "tag_busy",
                      "warm_up", "boot", "network", "store", "crashed", "timeout",
                      "internal"]

PARENT_TIMEOUT_S = 1800.0
_STDERR_TAIL = 4000


class ParentFailed(RuntimeError):
    """Booting, warming or snapshotting a parent failed; nothing was published."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind
        self.message = message


@dataclass(frozen=True)
class ParentRequest:
    """What ``boot_parent`` is asked to make. ``store_root``: the store (None: the
    default one)."""

    tag: str
    image: str = "default"
    mem_mib: int = 256
    vcpus: int = 1
    warm_code: str | None = None
    warm_cmd: str | None = None
    network: bool = False
    store_root: str | None = None
    # Set by boot_parent, not by callers: the namespace the process enters and the
    # tap there that cables the guest's NIC (None: a NIC with no cable).
    netns: str | None = None
    net_tap: str | None = None
    dns: tuple[str, ...] = field(default_factory=tuple)
    # Prepared read-only volumes (PreparedVolume.to_json) and the empty slots to add.
    volumes: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    free_volume_slots: int = DEFAULT_FREE_SLOTS
    # Set by _run_process: where the process writes the snapshot (the pending snapshot's
    # files; a jailed one's staging directory), and its jail: its uid, its run
    # directory (the jail's writable place, also VMFORK_RUN_DIR inside) and the staging
    # directory, bound writable beside it.
    memory_path: str | None = None
    state_path: str | None = None
    jail_uid: int | None = None
    run_dir: str | None = None
    staging_dir: str | None = None
    seccomp_log_only: bool = False
    # The free-page-reporting balloon (a measurement switch, bench/pip_chain.py
    # --no-balloon): read from the caller's environment when the request is made,
    # because the process that boots runs in a jail's clean environment.
    balloon: bool = field(default_factory=lambda: os.environ.get("VMFORK_BALLOON", "1") != "0")


@dataclass(frozen=True)
class ParentResult:
    """The typed outcome the process writes (JSON) for ``boot_parent``."""

    tag: str
    boot_s: float
    warm_s: float
    pause_ms: float
    capture_ms: float
    memory_write_ms: float
    memory_bytes: int


def _classify(err: BaseException) -> FailureKind:
    from vmfork.image import ImageError, ImageMissing
    from vmfork.runtime.guest import GuestBootError
    from vmfork.store import StoreError, TagBusy, TagExists
    from vmfork.store.errors import InvalidTag
    kinds: list[tuple[type[BaseException], FailureKind]] = [
        (WarmUpFailed, "warm_up"), (GuestBootError, "boot"), (ImageMissing, "image_missing"),
        (ImageError, "image"), (TagExists, "tag_exists"), (TagBusy, "tag_busy"),
        (InvalidTag, "invalid"), (StoreError, "store"), (NetworkError, "network"),
        (ValueError, "invalid")]
    for cls, kind in kinds:
        if isinstance(err, cls):
            return kind
    return "internal"


def _init_refusal(err: BaseException) -> str | None:
    """What the boot /init said when it stopped on the image's root (no Python for the
    agent, a disk it cannot mount): the image's fault, not the host's, so the caller
    gets it as such (``BOOT_INIT_SCRIPT`` prints these as ``vmfork-init: ...``)."""
    from vmfork.runtime.guest import GuestBootError
    if not isinstance(err, GuestBootError):
        return None
    said = [line.split("vmfork-init:", 1)[1].strip()
            for line in err.console_tail.splitlines() if "vmfork-init:" in line]
    return said[-1] if said else None


def _write_json_atomic(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def _enter_parent_jail(req: ParentRequest, image: GuestImage,
                       volumes: tuple[PreparedVolume, ...]) -> None:
    """Jail this process (``runtime/jail.py``) as a zygote child is jailed: what it
    may see is the image's kernel, initramfs and root disk and the snapshot's volumes
    (read-only, opened before the drop), Python's own paths, ``/dev/kvm``, the tap's
    descriptor when networked, its run directory and the staging directory."""
    from vmfork.paths import cache_dir
    from vmfork.runtime import jail
    assert req.jail_uid is not None and req.run_dir is not None and req.staging_dir is not None
    files = [str(image.kernel), str(image.initrd),
             *([str(image.disk)] if image.disk is not None else []),
             *(v.path for v in volumes)]
    root = os.path.join(req.run_dir, ".jail-root")
    os.mkdir(root, 0o755)
    spec = jail.JailSpec(
        root=root, uid=req.jail_uid, gid=req.jail_uid,
        read_only=(*jail.python_paths(), *files), writable=(req.run_dir, req.staging_dir),
        preopen=tuple(files), netns=req.netns, tap=req.net_tap,
        # Its largest file is the memory image; the console and VMM logs are capped.
        fsize=(req.mem_mib << 20) + (64 << 20),
        env={"VMFORK_CACHE_DIR": str(cache_dir()), "VMFORK_RUN_DIR": req.run_dir})
    try:
        jail.enter(spec)
    except jail.JailError as err:
        if err.step.startswith("join network namespace"):
            raise NetworkError(str(err)) from err
        raise


def _process_main(request_path: str, result_path: str) -> int:
    """The process entry: read the request, jail itself (``jail_uid``), boot, warm and
    capture into ``memory_path``/``state_path``, write the result. The exit status is 0
    whenever a result was written (success or a typed failure)."""
    with open(request_path) as f:
        doc = json.load(f)
    doc["dns"] = tuple(doc.get("dns") or ())
    doc["volumes"] = tuple(doc.get("volumes") or ())
    req = ParentRequest(**doc)
    try:
        if req.memory_path is None or req.state_path is None:
            raise ValueError("the request names no memory_path/state_path (boot_parent sets "
                             "them)")
        from vmfork.image import find_image
        image = find_image(req.image)
        volumes = tuple(PreparedVolume.from_json(v) for v in req.volumes)
        _check_parent_args(req.warm_code, req.warm_cmd, volumes)
        before_start: Callable[[], None] | None = None
        if req.jail_uid is not None:
            from vmfork.runtime.jail import become_pid_namespace_init
            become_pid_namespace_init()   # from here, pid 1 of a namespace of its own
            # Before any thread exists: the jail joins the network namespace (the VMM's
            # threads inherit it) and attaches to the tap while it still may.
            _enter_parent_jail(req, image, volumes)
            from vmfork.runtime import seccomp
            log_only = req.seccomp_log_only

            def install_filter() -> None:
                # The machine is built; from here the process does what a booting,
                # capturing VMM does (runtime/seccomp.py PARENT_ALLOWED), before the
                # guest's first instruction.
                seccomp.install_parent_filter(log_only=log_only)
            before_start = install_filter
        elif req.netns is not None:
            from vmfork.runtime.network import enter_netns
            enter_netns(req.netns)
        network = GuestNetwork(dns=req.dns) if req.network else None
        captured = boot_and_capture(image, req.memory_path, req.state_path,
                                    mem_mib=req.mem_mib, vcpus=req.vcpus,
                                    warm_code=req.warm_code, warm_cmd=req.warm_cmd,
                                    network=network, net_tap=req.net_tap, volumes=volumes,
                                    free_volume_slots=req.free_volume_slots,
                                    before_start=before_start, balloon=req.balloon)
    except Exception as err:  # noqa: BLE001 - every failure becomes a typed result
        kind = _classify(err)
        message = f"{err}" or type(err).__name__
        refused = _init_refusal(err)
        if refused is not None:
            kind, message = "image", f"the image cannot boot: {refused}"
        if kind == "internal":
            import traceback
            traceback.print_exc()
        _write_json_atomic(result_path, {"ok": False, "kind": kind, "message": message})
        return 0
    _write_json_atomic(result_path, {"ok": True, "result": asdict(captured)})
    return 0


PARENT_UID_RANGE = (1_065_536, 4096)
"""The uids (gid = uid) jailed parent VMMs take, one per parent being made: after the
zygote's range (``runtime.spawn.JAIL_UID_RANGE``), so a parent never shares a uid with
a sandbox."""
MAX_RESULT_BYTES = 1 << 20
MAX_STATE_BYTES = 64 << 20
_FAILURE_KINDS = frozenset(get_args(FailureKind))


class _UidLease:
    """A uid of ``PARENT_UID_RANGE`` held for one parent: an flock on
    ``<run dir>/parent-uids/<uid>`` (other makers of parents, the daemon's and the
    CLI's, skip it) and no live process with that uid (one in another run directory's
    lease). Released by ``close``."""

    def __init__(self) -> None:
        import fcntl
        import secrets

        from vmfork.paths import private_dir, run_dir
        locks = private_dir(run_dir() / "parent-uids")
        in_use = _uids_in_use()
        first, count = PARENT_UID_RANGE
        start = secrets.randbelow(count)
        for i in range(count):
            uid = first + (start + i) % count
            if uid in in_use:
                continue
            fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise ParentFailed("internal", f"every uid of {PARENT_UID_RANGE} is held by a parent "
                           "being made")

    def close(self) -> None:
        os.close(self._fd)


def _uids_in_use() -> set[int]:
    """The real uids of every live process (from ``/proc/<pid>/status``: a jailed
    process is not dumpable, so its ``/proc/<pid>`` belongs to root)."""
    uids: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        uids.add(int(line.split()[1]))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return uids


def _take_staged(source: Path, target: Path, max_bytes: int, owner: int) -> None:
    """Move a jailed parent's output ``source`` (in the staging directory) to
    ``target`` (in the pending snapshot, the same file system), made ours and 0600.
    Called once the process and its group are gone, so nothing can write it any more.
    The process is not trusted with what it left: ``source`` must be a regular file
    with one link owned by its uid (no symlink or hard link to a host file can be
    laundered into the store, and from there into guests' memory), no larger than
    ``max_bytes``; the file renamed must be the file checked."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        raise ParentFailed("crashed", f"the parent's VMM reported a snapshot but {source.name} "
                           f"cannot be opened: {err.strerror}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != owner:
            raise ParentFailed("crashed", f"the parent's VMM left {source.name} as something "
                               "other than a file of its own (refused)")
        if st.st_size > max_bytes:
            raise ParentFailed("crashed", f"the parent's VMM left {source.name} of "
                               f"{st.st_size} bytes, more than its capture can be "
                               f"({max_bytes}; refused)")
        os.rename(source, target)
        after = os.lstat(target)
        if (after.st_dev, after.st_ino) != (st.st_dev, st.st_ino):
            raise ParentFailed("crashed", f"{source.name} changed while it was taken (refused)")
        os.fchown(fd, os.geteuid(), os.getegid())
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _read_result(path: Path) -> dict[str, Any] | None:
    """The process's result document, checked as a typed record (it wrote it from its
    jail); None if there is none to read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RESULT_BYTES:
            return None
        data = os.read(fd, MAX_RESULT_BYTES)
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    if doc.get("ok") is True and isinstance(doc.get("result"), dict):
        fields = {f: doc["result"].get(f) for f in Captured.__dataclass_fields__}
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e15
               for v in fields.values()):
            return {"ok": True, "result": fields}
        return None
    if doc.get("ok") is False and doc.get("kind") in _FAILURE_KINDS \
            and isinstance(doc.get("message"), str):
        return {"ok": False, "kind": doc["kind"], "message": doc["message"][:_STDERR_TAIL]}
    return None


def _run_process(req: ParentRequest, timeout: float, log_path: Path | None,
                 jail: bool) -> ParentResult:
    """Claim the tag, run the process (jailed: with a uid of its own, writing into a
    staging directory), take and check what it wrote, publish. Nothing is published
    unless every step succeeded."""
    from vmfork.image import find_image
    from vmfork.paths import run_dir
    from vmfork.store.tags import validate_tag
    try:
        store = Store.open(Path(req.store_root) if req.store_root else None)
        validate_tag(req.tag)
        image = find_image(req.image)
        volumes = tuple(PreparedVolume.from_json(v) for v in req.volumes)
        _check_parent_args(req.warm_code, req.warm_cmd, volumes)
        pending = store.begin(req.tag)
    except Exception as err:  # noqa: BLE001 - typed for the caller
        raise ParentFailed(_classify(err), f"{err}" or type(err).__name__) from err
    with pending:
        lease = _UidLease() if jail else None
        base = run_dir()
        work = Path(tempfile.mkdtemp(prefix="parent-", dir=base))
        try:
            staging: Path | None = None
            memory_path, state_path = pending.memory_path, pending.state_path
            if lease is not None:
                staging = pending.path / "staging"
                staging.mkdir(mode=0o700)
                memory_path, state_path = staging / "memory.bin", staging / "state.bin"
            child = ParentRequest(**{
                **asdict(req), "memory_path": str(memory_path), "state_path": str(state_path),
                "jail_uid": lease.uid if lease else None, "run_dir": str(work),
                "staging_dir": str(staging) if staging else None,
                "seccomp_log_only": os.environ.get("VMFORK_SECCOMP_LOG") == "1"})
            captured = _run_child(child, work, timeout, log_path)
            mem_bytes = req.mem_mib << 20
            if lease is not None and staging is not None:
                _take_staged(staging / "state.bin", pending.state_path, MAX_STATE_BYTES,
                             lease.uid)
                _take_staged(staging / "memory.bin", pending.memory_path,
                             mem_bytes + (1 << 20), lease.uid)
                import shutil
                shutil.rmtree(staging)
            _check_state(pending.state_path, mem_bytes, req.vcpus)
            try:
                snapshot = pending.publish(parent_meta(
                    pending.tag, image, captured, mem_mib=req.mem_mib, vcpus=req.vcpus,
                    warm_up=req.warm_code if req.warm_code is not None else req.warm_cmd,
                    network=req.network, connected=req.net_tap is not None, volumes=volumes,
                    free_volume_slots=req.free_volume_slots))
            except Exception as err:  # noqa: BLE001 - typed for the caller
                raise ParentFailed(_classify(err), f"{err}") from err
        finally:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
            if lease is not None:
                lease.close()
    return ParentResult(tag=snapshot.tag, boot_s=captured.boot_s, warm_s=captured.warm_s,
                        pause_ms=captured.pause_ms, capture_ms=captured.capture_ms,
                        memory_write_ms=captured.memory_write_ms,
                        memory_bytes=captured.memory_bytes)


def _check_state(path: Path, mem_bytes: int, vcpus: int) -> None:
    """The state the process wrote is a valid state file of the machine asked for."""
    from vmfork.ondisk.errors import OnDiskError
    from vmfork.ondisk.stateformat import read_state_file
    from vmfork.vmm.vmstate import MachineState
    try:
        state = read_state_file(str(path), MachineState)
    except (OnDiskError, OSError, ValueError) as err:
        raise ParentFailed("crashed", f"the parent's VMM wrote a state file that cannot be "
                           f"read: {err}") from err
    if state.mem_size != mem_bytes or len(state.vcpus) != vcpus:
        raise ParentFailed("crashed", f"the parent's VMM captured a machine of "
                           f"{state.mem_size >> 20} MiB and {len(state.vcpus)} vCPUs, not "
                           f"the {mem_bytes >> 20} MiB and {vcpus} asked for (refused)")


def _run_child(req: ParentRequest, work: Path, timeout: float,
               log_path: Path | None) -> Captured:
    request_path, result_path = work / "request.json", work / "result.json"
    request_path.write_text(json.dumps(asdict(req)))
    stderr_path = log_path if log_path is not None else work / "stderr.log"
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p))
    # Read back through this descriptor, never by path: a jailed process may replace
    # what its run directory holds.
    with open(stderr_path, "a+b") as stderr:
        # Its own session, so a timeout kills the process and anything it started.
        try:
            proc = run_module_in_own_group("vmfork.runtime.parent",
                                           [str(request_path), str(result_path)],
                                           output=stderr, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ParentFailed("timeout", f"snapshot {req.tag!r} was not ready after "
                               f"{timeout:.0f} s; the boot or warm-up hangs") from None
        status = proc.returncode
        try:   # anything it left in its group (it cannot leave the group: no setsid)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        outcome = _read_result(result_path)
        if outcome is None:
            size = stderr.seek(0, os.SEEK_END)
            stderr.seek(max(0, size - _STDERR_TAIL))
            tail = stderr.read(_STDERR_TAIL).decode("utf-8", "replace").strip()
            last = tail.splitlines()[-1] if tail else "no output"
            how = (f"was killed by signal {-status}" if status < 0
                   else f"exited with status {status}")
            raise ParentFailed("crashed", f"the parent's VMM process {how} before it "
                               f"reported a result: {last}")
    if not outcome["ok"]:
        raise ParentFailed(outcome["kind"], outcome["message"])
    return Captured(**outcome["result"])


def boot_parent(req: ParentRequest, *, host_network: HostNetwork | None = None,
                egress: EgressPolicy | None = None, timeout: float = PARENT_TIMEOUT_S,
                log_path: Path | None = None, jail: bool | None = None) -> ParentResult:
    """Make snapshot ``req.tag`` in a process of its own; ``ParentFailed`` on failure.

    ``req.network``: the parent gets a NIC; with ``host_network`` it is cabled to a
    namespace of its own made there under ``egress`` (default allow) and removed
    when the process is gone. Without one the NIC has no cable (the parent cannot
    reach anything, its children still get networks of their own).
    ``log_path``: where the process's output goes (default: discarded after).
    ``jail``: the process jails itself before it builds the machine (as a sandbox's
    VMM: ``runtime/jail.py``, docs/security.md) and its snapshot is taken into the
    store by this side; None: ``runtime.spawn.jail_by_default()`` (``VMFORK_JAIL=0``
    turns it off)."""
    if jail is None:
        from vmfork.runtime.spawn import jail_by_default
        jail = jail_by_default()
    if not req.network and egress is not None:
        raise ParentFailed("invalid", "an egress policy needs a network: add network=true "
                           "(--network)")
    if not req.network or host_network is None:
        return _run_process(req, timeout, log_path, jail)
    try:
        child = host_network.create(egress)
    except NetworkError as err:
        kind: FailureKind = "invalid" if "cannot resolve" in str(err) else "network"
        raise ParentFailed(kind, f"cannot make the parent's network: {err}") from err
    try:
        cabled = ParentRequest(**{**asdict(req), "netns": child.netns, "net_tap": child.tap,
                                  "dns": host_network.guest.dns})
        return _run_process(cabled, timeout, log_path, jail)
    except ParentFailed as err:
        if err.kind == "warm_up" and child.egress.mode != "allow":
            raise ParentFailed("warm_up", f"{err.message}; {egress_hint(child.egress)}") \
                from None
        raise
    finally:
        host_network.destroy(child)


def egress_hint(policy: EgressPolicy) -> str:
    """Why a download in a guest under ``policy`` may have failed, and what to change."""
    if policy.mode == "deny":
        return ("the guest's egress policy is deny: every connection out of it is refused "
                "(ICMP admin-prohibited, seen as 'No route to host'); allow it with "
                "--egress allow or an allow-list naming the index")
    allowed = ", ".join(policy.cidrs + policy.domains) or "nothing"
    return (f"the guest's egress policy allows only {allowed}; a download from anywhere "
            "else is refused (seen as 'No route to host'): add the index's address or name")


if __name__ == "__main__":
    sys.exit(_process_main(sys.argv[1], sys.argv[2]))
