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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from vmfork.image import GuestImage
from vmfork.runtime.guest import BootedGuest
from vmfork.runtime.network import (
    EgressPolicy,
    GuestNetwork,
    HostNetwork,
    NetworkError,
    host_dns_servers,
)
from vmfork.runtime.volumes import DEFAULT_FREE_SLOTS, PreparedVolume
from vmfork.store import Snapshot, SnapshotMeta, SnapshotTimings, Store
from vmfork.vmm.stateformat import write_state_file


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
    slots reserved for volumes given at spawn."""
    for volume in volumes:
        if not volume.read_only:
            raise ValueError(f"volume {volume.source}:{volume.guest_path}:rw: a snapshot's "
                             "volumes are shared by all its children, so they are "
                             "read-only; attach a read-write volume at spawn or "
                             "workspace create")
    if warm_code is not None and warm_cmd is not None:
        raise ValueError("give warm_code (Python run by the agent) or warm_cmd "
                         "(a shell command), not both")
    with store.begin(tag) as pending:
        started = time.monotonic()
        with BootedGuest(image, mem_mib=mem_mib, vcpus=vcpus, network=network,
                         net_tap=net_tap, volumes=volumes,
                         free_volume_slots=free_volume_slots,
                         ready_timeout=PARENT_READY_TIMEOUT_S) as guest:
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
            state, timings = guest.machine.snapshot(str(pending.memory_path), resume=False)
            write_state_file(str(pending.state_path), state)
        meta = SnapshotMeta(
            tag=pending.tag, image=image.name, mem_mib=mem_mib, vcpus=vcpus,
            warm_up=warm_code if warm_code is not None else warm_cmd,
            timings=SnapshotTimings(boot_ms=(booted - started) * 1000,
                                    warm_ms=(warmed - booted) * 1000,
                                    pause_ms=timings["paused"] * 1000,
                                    capture_ms=timings["vcpu_state"] * 1000,
                                    write_ms=timings["memory_write"] * 1000),
            # Whether sandboxes of it can get networks (the daemon checks before a spawn),
            # and the root disk its children open (by content hash), if its image has one.
            extra={"network": network is not None,
                   **({"network_connected": True} if net_tap is not None else {}),
                   **({"image_disk": image.disk_key} if image.disk_key else {}),
                   **({"volumes": [{"guest_path": v.guest_path, "key": v.key,
                                    "read_only": True, "source": v.source}
                                   for v in volumes]} if volumes else {}),
                   "volume_slots": len(volumes) + free_volume_slots})
        snapshot = pending.publish(meta)
    return SnapshotReport(snapshot=snapshot, boot_s=booted - started, warm_s=warmed - booted,
                          pause_ms=timings["paused"] * 1000,
                          capture_ms=timings["vcpu_state"] * 1000,
                          memory_write_ms=timings["memory_write"] * 1000,
                          memory_bytes=int(timings["memory_bytes"]))


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


def _process_main(request_path: str, result_path: str) -> int:
    """The process entry: read the request, make the snapshot, write the result.
    The exit status is 0 whenever a result was written (success or a typed failure)."""
    with open(request_path) as f:
        doc = json.load(f)
    doc["dns"] = tuple(doc.get("dns") or ())
    doc["volumes"] = tuple(doc.get("volumes") or ())
    req = ParentRequest(**doc)
    try:
        # Before any thread exists: the VMM's threads inherit the namespace, and the
        # tap is found there (runtime.network.enter_netns).
        if req.netns is not None:
            from vmfork.runtime.network import enter_netns
            enter_netns(req.netns)
        from vmfork.image import find_image
        image = find_image(req.image)
        store = Store.open(Path(req.store_root) if req.store_root else None)
        network = GuestNetwork(dns=req.dns) if req.network else None
        report = snapshot_parent(store, req.tag, image, mem_mib=req.mem_mib, vcpus=req.vcpus,
                                 warm_code=req.warm_code, warm_cmd=req.warm_cmd,
                                 network=network, net_tap=req.net_tap,
                                 volumes=tuple(PreparedVolume.from_json(v)
                                               for v in req.volumes),
                                 free_volume_slots=req.free_volume_slots)
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
    result = ParentResult(tag=report.snapshot.tag, boot_s=report.boot_s, warm_s=report.warm_s,
                          pause_ms=report.pause_ms, capture_ms=report.capture_ms,
                          memory_write_ms=report.memory_write_ms,
                          memory_bytes=report.memory_bytes)
    _write_json_atomic(result_path, {"ok": True, "result": asdict(result)})
    return 0


def _run_process(req: ParentRequest, timeout: float, log_path: Path | None) -> ParentResult:
    from vmfork.paths import run_dir
    base = run_dir()
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    work = Path(tempfile.mkdtemp(prefix="parent-", dir=base))
    try:
        request_path, result_path = work / "request.json", work / "result.json"
        request_path.write_text(json.dumps(asdict(req)))
        stderr_path = log_path if log_path is not None else work / "stderr.log"
        src = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (src, os.environ.get("PYTHONPATH")) if p))
        with open(stderr_path, "ab") as stderr:
            # Its own session, so a timeout kills the process and anything it started.
            proc = subprocess.Popen(
                [sys.executable, "-m", "vmfork.runtime.parent", str(request_path),
                 str(result_path)], stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                env=env, start_new_session=True)
            try:
                status = proc.wait(timeout)
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if sys.exc_info()[0] is subprocess.TimeoutExpired:
                    raise ParentFailed("timeout", f"snapshot {req.tag!r} was not ready after "
                                       f"{timeout:.0f} s; the boot or warm-up hangs") from None
                raise
        try:
            outcome = json.loads(result_path.read_text())
        except (OSError, ValueError):
            tail = stderr_path.read_bytes()[-_STDERR_TAIL:].decode("utf-8", "replace").strip()
            last = tail.splitlines()[-1] if tail else "no output"
            how = (f"was killed by signal {-status}" if status < 0
                   else f"exited with status {status}")
            raise ParentFailed("crashed", f"the parent's VMM process {how} before it "
                               f"reported a result: {last}") from None
        if not outcome["ok"]:
            raise ParentFailed(outcome["kind"], outcome["message"])
        return ParentResult(**outcome["result"])
    finally:
        import shutil
        shutil.rmtree(work, ignore_errors=True)


def boot_parent(req: ParentRequest, *, host_network: HostNetwork | None = None,
                egress: EgressPolicy | None = None, timeout: float = PARENT_TIMEOUT_S,
                log_path: Path | None = None) -> ParentResult:
    """Make snapshot ``req.tag`` in a process of its own; ``ParentFailed`` on failure.

    ``req.network``: the parent gets a NIC; with ``host_network`` it is cabled to a
    namespace of its own made there under ``egress`` (default allow) and removed
    when the process is gone. Without one the NIC has no cable (the parent cannot
    reach anything, its children still get networks of their own).
    ``log_path``: where the process's output goes (default: discarded after)."""
    if not req.network and egress is not None:
        raise ParentFailed("invalid", "an egress policy needs a network: add network=true "
                           "(--network)")
    if not req.network or host_network is None:
        return _run_process(req, timeout, log_path)
    try:
        child = host_network.create(egress)
    except NetworkError as err:
        kind: FailureKind = "invalid" if "cannot resolve" in str(err) else "network"
        raise ParentFailed(kind, f"cannot make the parent's network: {err}") from err
    try:
        cabled = ParentRequest(**{**asdict(req), "netns": child.netns, "net_tap": child.tap,
                                  "dns": host_network.guest.dns})
        return _run_process(cabled, timeout, log_path)
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
