"""Fork N children of a snapshot through the zygote and wait until they are ready.

Each child is a VMM process (``runtime.vmmchild``) forked by the zygote with its
own run directory ``<run_root>/<vm_id>/``. Progress is read from each child's
``status.json`` (written atomically by the child): ``restored`` once the VM
runs again, ``ready`` once the agent has answered and the guest was reseeded
and its clock set, ``failed`` with a reason. Two instants are reported: all
children restored (host side) and all agents answered.

Each child also writes ``<vm_id> <state>`` to a FIFO of this spawn after every
status change, so the spawner sleeps until something changed and then reads
only that child's file, instead of re-reading N files every few milliseconds
(which, with 100 children on two cores, steals CPU from the children it waits
for). Every file is still re-read now and then, in case a line was lost. A line
saying ``prepared`` or ``restored`` short of the state waited for is taken at its
word, the file not read (``LINE_STATES``): those lines come as the batch's guests
start, and the spawner, one process among a hundred vCPU threads, read and parsed a
hundred files then before it saw the batch restored. A line names its writer's own
vm_id, which no jailed sibling can learn (the FIFO is write-only to its uid).

A batch (n > 1) starts together: each child restores everything, reports
``prepared`` and waits at a start gate (a second FIFO) before its vCPUs run; once
every child is prepared (or has failed), the spawner writes one byte per child
into the gate (also when no child became prepared for ``GATE_STALL_S``: one that
hangs in its restore does not hold back the others). Guests that already run would otherwise compete for the CPU with
siblings still restoring, and the batch's last restore would come later.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmfork.agent.client import AgentClient, vsock_uds_connector
from vmfork.agent.protocol import AGENT_PORT
from vmfork.ondisk.decoded import DecodedFiles
from vmfork.ondisk.errors import OnDiskError
from vmfork.ondisk.memplan import PLAN_FILE, read_plan
from vmfork.ondisk.stateformat import read_state_file
from vmfork.runtime.network import ChildNetwork, EgressPolicy, HostNetwork
from vmfork.runtime.volumes import PreparedVolume
from vmfork.runtime.zygote_client import ZygoteClient
from vmfork.runtime.zygote_protocol import SpawnItem
from vmfork.store import Snapshot
from vmfork.vmm.devices import manager as devices
from vmfork.vmm.vmstate import MachineState

VMM_ENTRY = "vmfork.runtime.vmmchild:main"
JAIL_UID_RANGE = (1_000_000, 65_536)
"""The uids (gid = uid) jailed VMMs take, one per live VMM (the zygote picks)."""
SECCOMP_LOG_ENV = "VMFORK_SECCOMP_LOG"
"""``1``: a jailed VMM's seccomp filter logs calls outside its list instead of killing
(the kernel's audit records, type 1326), to collect what a workload needs."""
JAIL_ENV = "VMFORK_JAIL"
"""``0`` spawns VMMs without a jail (for comparisons, and hosts that cannot build one);
anything else, or unset, jails every VMM this process spawns (docs/security.md)."""


def jail_by_default() -> bool:
    """Whether a spawn that does not say is jailed: yes unless ``VMFORK_JAIL=0``."""
    return os.environ.get(JAIL_ENV, "1") != "0"
# Every child's status.json is re-read once no FIFO line came for this long (a line
# can be lost: a child writes it without blocking). Not on a clock while lines come:
# at N = 100 a scan every 0.25 s read ~16,000 status files between the start gate and
# ready, and that CPU was the guests' (bench/spawn_profile.py's timeline).
FULL_SCAN_S = 0.25
# The zygote's exit events (children that died without a status) this often, the
# first this long after the spawn: each check is a round trip that wakes the zygote
# too.
EVENTS_CHECK_S = 0.5
# The start gate opens once every child is prepared, or once no child became
# prepared for this long: one child stuck in its restore must not hold back the
# siblings that are ready to run.
GATE_STALL_S = 20.0
LINE_STATES = ("prepared", "restored")
"""States a FIFO line is taken at its word for (module docstring); any other, and a
line missed (the full scan), is read from the child's ``status.json``."""


class SpawnFailed(RuntimeError):
    pass


@dataclass
class Child:
    vm_id: str
    pid: int
    run_dir: Path
    status: dict[str, Any] = field(default_factory=dict)
    network: ChildNetwork | None = None   # with per_child_netns; destroy it after the VMM

    @property
    def agent(self) -> AgentClient:
        return AgentClient(vsock_uds_connector(str(self.run_dir / "vsock.sock"), AGENT_PORT,
                                               timeout=5.0))

    def read_status(self) -> dict[str, Any]:
        try:
            self.status = json.loads((self.run_dir / "status.json").read_bytes())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        return self.status


@dataclass
class ForkReport:
    children: list[Child]
    spawn_s: float          # request to all pids
    restored_s: float       # request to all VMs restored and running
    ready_s: float          # request to all agents answered (reseeded, clock set)
    failed: list[tuple[str, str]]
    network_s: float = 0.0  # creating the per-child networks (before the request)


def new_vm_id() -> str:
    return "vm-" + secrets.token_hex(6)


def fork_children(zygote: ZygoteClient, snapshot: Snapshot, n: int, run_root: Path, *,
                  memory_limit_mib: int | None = None, timeout: float = 300.0,
                  wait_for: str = "ready", start_together: bool = True,
                  progress: Callable[[int, int, int], None] | None = None,
                  per_child_netns: bool = False, network: HostNetwork | None = None,
                  egress: EgressPolicy | None = None,
                  jail: bool | None = None,
                  volumes: Sequence[PreparedVolume] = (),
                  vm_ids: Sequence[str] | None = None,
                  networks: Sequence[ChildNetwork] | None = None,
                  runs_in: Path | None = None) -> ForkReport:
    """Spawn ``n`` children and wait until every one is ready (``wait_for="ready"``)
    or only restored and running (``"restored"``), or failed.

    ``start_together``: children of a batch start their vCPUs once all are
    prepared (the start gate, module docstring); False lets each start at once.

    ``per_child_netns``: each child gets a network of its own from ``network``
    (made before the spawn, in parallel, with ``egress`` applied), in
    ``Child.network``; the caller destroys it (``network.destroy``) once the child
    is gone. Networks of children that failed, or of all if this raises, are
    destroyed here.

    ``progress(restored, ready, failed)`` is called as counts change.

    ``jail``: build each VMM a jail (``runtime/jail.py``); None: ``jail_by_default()``.

    ``volumes``: prepared volumes (``runtime.volumes.prepare``) every child attaches
    into its snapshot's empty volume slots, or -- a read-write file a slot of the
    snapshot already holds (a workspace's) -- reopens there (``runtime.vmmchild``).
    A jailed VMM gets them opened before its uid changes (``_jail_request``).

    ``vm_ids``: the children's ids (default: new ones), and ``networks``: networks
    that exist already, one per child, kept by the caller whatever happens here --
    how a paused sandbox is resumed into its own id and network.

    ``runs_in``: a directory that holds ``run_root`` and every other spawn's (the
    daemon's ``run/``, which holds a directory per spawn): the zygote keeps one jail
    base there for all of them (``jail.KeptBases``), where by default it keeps one
    per ``run_root``.
    """
    if jail is None:
        jail = jail_by_default()
    if n > 1 and any(not v.read_only for v in volumes):
        raise ValueError("a read-write volume belongs to one sandbox: spawn it with n=1")
    if wait_for not in ("ready", "restored"):
        raise ValueError(f"wait_for must be 'ready' or 'restored', not {wait_for!r}")
    done_states = ("ready",) if wait_for == "ready" else ("restored", "ready")
    if not 1 <= n <= 1000:
        raise ValueError(f"n must be 1..1000, not {n}")
    if per_child_netns and network is None and networks is None:
        raise ValueError("per_child_netns needs a HostNetwork (network=...)")
    if vm_ids is not None and len(vm_ids) != n:
        raise ValueError(f"{len(vm_ids)} vm_ids for {n} children")
    if networks is not None and len(networks) != n:
        raise ValueError(f"{len(networks)} networks for {n} children")
    run_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    network_started = time.monotonic()
    if networks is not None:
        nets = list(networks)
        network = None   # the caller's: never destroyed here
    else:
        nets = (network.create_many(n, egress) if per_child_netns and network is not None
                else [])
    network_s = time.monotonic() - network_started
    token = secrets.token_hex(6)
    try:
        # A jailed VMM runs as a uid of its own: it may write the notify FIFO and read
        # the gate (both bound into its jail alone, by path).
        notify = _Fifo.create(run_root / f".notify-{token}", 0o622 if jail else 0o600)
    except BaseException:
        _destroy_networks(network, nets)
        raise
    gate = None
    try:
        if n > 1 and start_together:
            gate = _Fifo.create(run_root / f".start-{token}", 0o644 if jail else 0o600)
        jail_request = _jail_request(snapshot, [notify.path] + ([gate.path] if gate else []),
                                     volumes) if jail else None
        if jail_request is not None and runs_in is not None:
            jail_request["runs_in"] = str(runs_in)
        report = _fork_and_wait(zygote, snapshot, n, run_root, memory_limit_mib, timeout,
                                done_states, progress, notify, gate, nets, jail_request,
                                [v.to_json() for v in volumes], vm_ids)
    except BaseException:
        _destroy_networks(network, nets)
        raise
    finally:
        notify.remove()
        if gate is not None:
            gate.release(n)  # if it was not yet: never leave a child waiting for nothing
            gate.remove()
    kept = {id(c.network) for c in report.children}
    _destroy_networks(network, [net for net in nets if id(net) not in kept])
    report.network_s = network_s
    return report


@dataclass
class _Fifo:
    """A FIFO in the run root, held open read-write by the spawner: opening it
    never blocks, and it never reads as closed while the spawner holds it."""

    path: Path
    fd: int
    released: bool = False

    @classmethod
    def create(cls, path: Path, mode: int = 0o600) -> _Fifo:
        os.mkfifo(path, mode)
        os.chmod(path, mode)   # mkfifo's mode is masked by the umask
        try:
            return cls(path, os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError:
            path.unlink()
            raise

    def release(self, children: int) -> None:
        """Open the start gate: one byte for each child that waits (or will)."""
        if not self.released:
            os.write(self.fd, b"\0" * children)
            self.released = True

    def remove(self) -> None:
        os.close(self.fd)
        self.path.unlink()


def _keys_in_state(state_path: str) -> tuple[list[str], list[str]]:
    state = read_state_file(state_path, MachineState)
    blk = state.device(devices.BLK)
    return ([blk.disk_key] if blk is not None else [],
            [v.disk.disk_key for v in state.devices_of(devices.VOLUME)
             if v.disk.disk_key and v.disk.read_only])


def _content_keys(state_path: str) -> tuple[list[str], list[str]] | None:
    """The snapshot's root disk's and read-only volumes' content keys, from its
    ``state.bin`` (decoded once per file: ``_state_keys``); None for a state file that
    does not decode (a damaged snapshot: its VMM says so, as an unjailed one does)."""
    try:
        try:
            keys = _state_keys.get(state_path)
        except OSError:
            keys = _keys_in_state(state_path)   # no identity to keep it by
    except OnDiskError:
        return None
    return keys


def _sources_in_plan(plan_path: str) -> list[str]:
    plan = read_plan(plan_path)
    return [plan.source_path(i) for i in range(len(plan.sources))]


# What a jail needs from a snapshot's decoded files (``_content_keys``,
# ``_memory_sources``): a spawn decoded state.bin, and a diff snapshot's memory.plan
# (~600 runs at depth 5), only to learn these few paths and keys, at every spawn
# (design notes, session 24: the spawner's share of a chain's spawn).
_state_keys = DecodedFiles(_keys_in_state)
_plan_sources = DecodedFiles(_sources_in_plan)


def _files_in(directory: str) -> tuple[str, ...]:
    return tuple(entry.path for entry in os.scandir(directory) if entry.is_file())


# The snapshot directory's own files, listed once while the directory's identity
# holds (a file added or removed, such as a diff snapshot's materialised memory.bin,
# changes its mtime): a listing and a stat per file at every spawn were ~1 ms of a lone
# spawn's spawner time in the emulated test host.
_snapshot_files = DecodedFiles(_files_in)


def _memory_sources(plan_path: str) -> list[str]:
    """The memory files a diff snapshot's ``memory.plan`` maps (its chain's), decoded
    once per plan file (``_plan_sources``); none for a flat snapshot. A plan that does
    not decode raises, as ``read_plan`` does."""
    try:
        return list(_plan_sources.get(plan_path))
    except FileNotFoundError:
        return []


def _jail_request(snapshot: Snapshot, fifos: list[Path],
                  volumes: Sequence[PreparedVolume] = ()) -> dict[str, Any]:
    """What a VMM of ``snapshot`` may see: the snapshot's files, the memory files its
    plan maps (a diff's ancestors), its root disk (read-only, shared by design:
    decision 3) and this spawn's FIFOs. Files one by one, never their directories:
    the store's directories are the daemon's alone (0700), and a bound directory would
    keep that mode inside the jail, where the jail's parents are its own."""
    files = _snapshot_files.get(str(snapshot.path))
    read_only = list(files)
    # Opened before the uid changes: the jail's uid may not read the daemon's files.
    preopen = list(files)
    sources = _memory_sources(str(snapshot.path / PLAN_FILE))
    read_only += sources
    preopen += sources
    # The root disk and the snapshot's read-only volumes go by content key: the zygote
    # resolves them in its own image cache, which is the one its VMMs read (a spawner
    # may run with another).
    keys = _content_keys(str(snapshot.path / "state.bin"))
    disk_keys, volume_keys = keys if keys is not None else ([], [])
    # Volumes given at spawn: read-only ones bound and pre-opened as the others; a
    # read-write one (its sandbox's own file) only pre-opened for writing, never bound.
    preopen_rw: list[str] = []
    for prepared in volumes:
        if prepared.read_only:
            read_only.append(prepared.path)
            preopen.append(prepared.path)
        else:
            preopen_rw.append(prepared.path)
    read_only += [str(f) for f in fifos]
    return {"uid_range": list(JAIL_UID_RANGE), "read_only": read_only,
            "devices": ["/dev/kvm"], "preopen": preopen, "preopen_rw": preopen_rw,
            "disk_keys": list(disk_keys), "volume_keys": list(volume_keys)}


def _read_notifications(fd: int) -> dict[str, str]:
    """The last state each vm_id named by the lines waiting in the FIFO reported."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    states: dict[str, str] = {}
    for line in data.splitlines():
        vm_id, _, state = line.decode(errors="replace").partition(" ")
        states[vm_id] = state
    return states


def _state_of(child: Child, line: str | None, done_states: tuple[str, ...]) -> str | None:
    """``child``'s state: its FIFO ``line``'s where that is enough (``LINE_STATES``, short
    of the state waited for), else its ``status.json``'s."""
    if line in LINE_STATES and line not in done_states:
        return line
    state = child.read_status().get("state")
    return None if state is None else str(state)


def _fork_and_wait(zygote: ZygoteClient, snapshot: Snapshot, n: int, run_root: Path,
                   memory_limit_mib: int | None, timeout: float, done_states: tuple[str, ...],
                   progress: Callable[[int, int, int], None] | None, notify: _Fifo,
                   gate: _Fifo | None, nets: list[ChildNetwork],
                   jail: dict[str, Any] | None = None,
                   volumes: list[dict[str, Any]] | None = None,
                   vm_ids: Sequence[str] | None = None) -> ForkReport:
    items = []
    by_vm: dict[str, ChildNetwork] = {}
    for index in range(n):
        vm_id = vm_ids[index] if vm_ids is not None else new_vm_id()
        run_dir = run_root / vm_id
        args: dict[str, Any] = {
            "snapshot_dir": str(snapshot.path), "run_dir": str(run_dir), "vm_id": vm_id,
            "log_path": str(run_dir / "vmm.log"), "notify_path": str(notify.path),
            # a child gives up on its agent when the spawner would give up on it
            "ready_timeout": timeout}
        if volumes:
            args["volumes"] = volumes
        if gate is not None:
            args.update(start_gate=str(gate.path), start_gate_timeout=timeout)
        if jail is not None and os.environ.get(SECCOMP_LOG_ENV) == "1":
            args["seccomp_log_only"] = True
        if nets:
            by_vm[vm_id] = nets[index]
            args.update(netns=nets[index].netns, net_tap=nets[index].tap)
        items.append(SpawnItem(vm_id, args, memory_limit_mib, jail=jail))
    notify_fd = notify.fd
    started = time.monotonic()
    result = zygote.spawn_many(VMM_ENTRY, items, timeout=timeout)
    spawned = time.monotonic()
    # A child can die before it writes any status (killed, OOM, a crash in the
    # restore): the zygote's exit events catch those, from the cursor its reply gives
    # (a zygote older than that field: every event it keeps). An event counts by
    # vm_id and pid: a resumed sandbox's id has an older exit event of its own.
    events_cursor = result.events_next or 0
    pids = {c.vm_id: c.pid for c in result.children}
    children = [Child(c.vm_id, c.pid, Path(c.run_dir or run_root / c.vm_id),
                      network=by_vm.get(c.vm_id)) for c in result.children]
    failed = list(result.failed)
    restored_at: float | None = None
    pending = {c.vm_id: c for c in children}
    # Not at once: the zygote's exit events wait for the first check like every later
    # one. A round trip right after the spawn ran the zygote and this loop (at nice 0)
    # while the children, at nice 10 and in their set-up, waited for the CPU; a child
    # that fails early writes its status (a FIFO line) anyway.
    next_events_check = started + EVENTS_CHECK_S
    next_full_scan = started
    changed: dict[str, str | None] = dict.fromkeys(pending)   # None: read its status.json
    restored: set[str] = set()
    prepared: set[str] = set()   # at the start gate, or past it
    prepared_progress = started  # when the last child became prepared
    last = (-1, -1, -1)
    while pending:
        now = time.monotonic()
        if now - started > timeout:
            stuck = "; ".join(_describe_stuck(c) for c in list(pending.values())[:5])
            raise SpawnFailed(f"{len(pending)} of {n} children not ready after {timeout:.0f} s"
                              f" ({stuck})")
        lines = _read_notifications(notify_fd)
        if lines:
            changed.update(lines)
            next_full_scan = now + FULL_SCAN_S
        elif now >= next_full_scan:
            changed.update(dict.fromkeys(pending))
            next_full_scan = now + FULL_SCAN_S
        for vm_id in changed.keys() & pending.keys():
            child = pending[vm_id]
            state = _state_of(child, changed[vm_id], done_states)
            if state is None and changed[vm_id] is not None:
                # It wrote a line, then its status went: it exited and the zygote reaped
                # it, which removes its run directory. Its exit event says why: asked
                # for now, not at the next check.
                next_events_check = now
            if state in ("prepared", "restored", "ready") and vm_id not in prepared:
                prepared.add(vm_id)
                prepared_progress = now
            if state in ("restored", "ready"):
                restored.add(vm_id)
            if state in done_states:
                del pending[vm_id]
            elif state in ("failed", "exited"):
                failed.append((vm_id, str(child.status.get("reason"))))
                del pending[vm_id]
        if pending and time.monotonic() >= next_events_check:
            events, events_cursor = zygote.events(events_cursor)
            for event in events:
                dead = (pending.pop(event.vm_id) if event.vm_id in pending
                        and pids.get(event.vm_id) == event.pid else None)
                if dead is not None and dead.read_status().get("state") not in done_states:
                    tail = "; ".join(event.log_tail[-3:])
                    failed.append((event.vm_id, f"{event.description}"
                                   + (f" ({tail})" if tail else "")))
            next_events_check = time.monotonic() + EVENTS_CHECK_S
        changed.clear()
        if gate is not None and (pending.keys() <= prepared
                                 or time.monotonic() - prepared_progress > GATE_STALL_S):
            gate.release(len(children))
        if restored_at is None and len(restored) + len(failed) >= len(children):
            restored_at = time.monotonic()
        counts = (len(restored), len(children) - len(pending) - len(failed), len(failed))
        if progress is not None and counts != last:
            progress(*counts)
            last = counts
        if pending:
            wake = min(next_events_check, next_full_scan, started + timeout)
            if gate is not None and not gate.released:
                wake = min(wake, prepared_progress + GATE_STALL_S)
            select.select([notify_fd], [], [], max(0.0, wake - time.monotonic()))
    ready_at = time.monotonic()
    ok = [c for c in children if c.status.get("state") in done_states]
    return ForkReport(children=ok, spawn_s=spawned - started,
                      restored_s=(restored_at or ready_at) - started,
                      ready_s=ready_at - started, failed=failed)


def _describe_stuck(child: Child) -> str:
    """Where a child that never got ready is: its last state, whether its process
    lives and where it waits in the kernel, and the last line of its VMM log."""
    state = child.read_status().get("state", "no status yet")
    try:
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        proc_state = stat.rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{child.pid}/wchan").read_text().strip() or "-"
        process = f"pid {child.pid} state {proc_state} wchan {wchan}"
    except (OSError, IndexError):
        process = f"pid {child.pid} gone"
    try:
        with open(child.run_dir / "vmm.log", "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 400))
            lines = log.read().decode(errors="replace").splitlines()
        last = lines[-1].strip() if lines else "empty log"
    except OSError:
        last = "no log"
    return f"{child.vm_id}: {state}, {process}, log: {last}"


def _destroy_networks(network: HostNetwork | None, nets: Iterable[ChildNetwork]) -> None:
    if network is None:
        return
    for net in nets:
        network.destroy(net)
