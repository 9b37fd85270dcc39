"""Boot a parent, warm it, snapshot it into the store.

The tag is claimed in the store *before* the boot (``store.begin``), so a bad
or taken tag fails in milliseconds, and a failed boot, warm-up or capture
leaves nothing behind (the pending directory is removed; nothing is listed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vmfork.image import GuestImage
from vmfork.runtime.guest import BootedGuest
from vmfork.runtime.network import GuestNetwork
from vmfork.store import Snapshot, SnapshotMeta, SnapshotTimings, Store
from vmfork.vmm.stateformat import write_state_file


class WarmUpFailed(RuntimeError):
    """The warm-up code or command failed in the guest; nothing was snapshotted."""


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
                    network: GuestNetwork | None = None) -> SnapshotReport:
    """``network``: boot the parent with a network device configured with it, so
    that its children can be given networks (``fork_children(per_child_netns=True)``
    with a ``HostNetwork`` of the same ``GuestNetwork``)."""
    if warm_code is not None and warm_cmd is not None:
        raise ValueError("give warm_code (Python run by the agent) or warm_cmd "
                         "(a shell command), not both")
    with store.begin(tag) as pending:
        started = time.monotonic()
        with BootedGuest(image, mem_mib=mem_mib, vcpus=vcpus, network=network) as guest:
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
                   **({"image_disk": image.disk_key} if image.disk_key else {})})
        snapshot = pending.publish(meta)
    return SnapshotReport(snapshot=snapshot, boot_s=booted - started, warm_s=warmed - booted,
                          pause_ms=timings["paused"] * 1000,
                          capture_ms=timings["vcpu_state"] * 1000,
                          memory_write_ms=timings["memory_write"] * 1000,
                          memory_bytes=int(timings["memory_bytes"]))
