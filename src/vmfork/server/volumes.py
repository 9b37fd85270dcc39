"""The daemon's side of volumes: what a request asks for, checked against the
snapshot's volume slots and the registry's read-write holds, before anything starts.

A spawn's volumes go into the empty slots its snapshot reserved at boot; the
snapshot's own volumes (in the other slots) are already mounted in every child. A
read-write volume is held in the registry by exactly one holder, so a second attach
while it is held is a 409 naming the holder; the hold is taken before the spawn
(``spawn:<token>``), moved to the sandbox (``sandbox:<id>``) or the workspace
(``workspace:<name>``, kept while it is suspended) when the spawn succeeds, and
released if it fails, when the sandbox ends, or when the workspace is deleted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vmfork.ondisk.decoded import DecodedFiles
from vmfork.ondisk.errors import OnDiskError
from vmfork.ondisk.stateformat import read_state_file
from vmfork.runtime.volumes import (
    MAX_VOLUMES,
    PreparedVolume,
    VolumeError,
    check_volume_set,
    parse_volume,
    prepare,
)
from vmfork.server.errors import BadRequest, Conflict
from vmfork.server.registry import Registry, VolumeHold
from vmfork.store import Snapshot
from vmfork.vmm.devices import manager as devices
from vmfork.vmm.vmstate import MachineState


@dataclass(frozen=True)
class SlotInfo:
    guest_path: str   # "" for an empty slot
    key: str          # "" for an empty slot
    read_only: bool


def _slots_in_state(state_path: str) -> tuple[SlotInfo, ...]:
    state = read_state_file(state_path, MachineState)
    return tuple(SlotInfo(v.guest_path, v.disk.disk_key, v.disk.read_only)
                 for v in state.devices_of(devices.VOLUME))


# Every spawn asks (``Sandboxes._spawn_volumes``), and decoding the state file took
# more of a REST spawn than anything else the daemon does before the zygote's fork
# (design notes, "A REST spawn's own share"): decoded once per file.
_slots = DecodedFiles(_slots_in_state)


def snapshot_slots(snap: Snapshot) -> list[SlotInfo]:
    """The snapshot's volume slots, from its state file (a few KiB, decoded once per
    file). A state file that cannot be read has none here: the spawn's VMM reports
    what is wrong with it."""
    try:
        return list(_slots.get(str(snap.state_path)))
    except (OnDiskError, OSError):
        return []


def volumes_json(slots: Sequence[SlotInfo]) -> list[dict[str, Any]]:
    """A snapshot's volumes for ``SnapshotInfo``/``SandboxInfo``."""
    return [{"guest_path": s.guest_path, "mode": "ro" if s.read_only else "rw", "key": s.key}
            for s in slots if s.key]


def parse_request(items: Any, where: str) -> list[Any]:
    """The ``volumes`` field's items parsed (400 for a bad one); ``[]`` for none."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise BadRequest(f"{where}: volumes must be a list of \"SRC:GUEST_PATH[:ro|:rw]\" "
                         "strings or {source, guest_path, mode} objects")
    if len(items) > MAX_VOLUMES:
        raise BadRequest(f"{where}: {len(items)} volumes; a sandbox has at most "
                         f"{MAX_VOLUMES}")
    try:
        specs = [parse_volume(item) for item in items]
        check_volume_set([(s.guest_path, s.read_only) for s in specs])
    except VolumeError as err:
        raise BadRequest(f"{where}: {err}") from err
    return specs


def prepare_all(specs: Sequence[Any], where: str) -> list[PreparedVolume]:
    try:
        return [prepare(spec) for spec in specs]
    except VolumeError as err:
        raise BadRequest(f"{where}: {err}") from err


def check_fits(snap: Snapshot, slots: Sequence[SlotInfo], specs: Sequence[Any],
               where: str) -> None:
    """The new volumes fit the snapshot's empty slots and do not overlap its own."""
    free = sum(1 for s in slots if not s.key)
    try:
        check_volume_set([(s.guest_path, s.read_only) for s in specs],
                         existing=[s.guest_path for s in slots if s.key])
    except VolumeError as err:
        raise BadRequest(f"{where}: {err}") from err
    if len(specs) > free:
        raise Conflict(f"{where}: {len(specs)} volumes asked for, but snapshot {snap.tag!r} "
                       f"has {free} empty volume slots (slots are reserved when a snapshot "
                       "is created: volume_slots, `vmfork snapshot --volume-slots N`)")


def holder_text(holder: str) -> str:
    kind, _, name = holder.partition(":")
    return {"sandbox": f"sandbox {name}", "workspace": f"workspace {name}",
            "spawn": "a spawn in progress"}.get(kind, holder)


@contextmanager
def held(registry: Registry, volumes: Sequence[PreparedVolume],
         token: str) -> Iterator[str]:
    """Hold the read-write ``volumes`` as ``spawn:<token>`` for the block (409 if one is
    held); released when the block raises. Yields the holder."""
    holder = f"spawn:{token}"
    now = time.time()
    holds = [VolumeHold(v.key, v.path, v.guest_path, v.size_bytes, holder, now)
             for v in volumes if not v.read_only]
    if holds:
        taken = registry.hold_volumes(holds)
        if taken is not None:
            raise Conflict(f"read-write volume {taken.path} is attached to "
                           f"{holder_text(taken.holder)} (at {taken.guest_path}); a "
                           "read-write volume belongs to one sandbox at a time: stop or "
                           "delete that one first, or attach a copy")
    try:
        yield holder
    except BaseException:
        registry.release_volumes(holder)
        raise


def held_volumes(registry: Registry, holder: str) -> list[PreparedVolume]:
    """The read-write volumes ``holder`` holds, as the spawner takes them."""
    return [PreparedVolume(h.guest_path, False, h.key, h.path, h.path, h.size_bytes)
            for h in registry.volumes_held_by(holder)]
