"""Fork N children of a snapshot through the zygote and wait until they are ready.

Each child is a VMM process (``runtime.vmmchild``) forked by the zygote with its
own run directory ``<run_root>/<vm_id>/``. Progress is read from each child's
``status.json`` (written atomically by the child): ``restored`` once the VM
runs again, ``ready`` once the agent has answered and the guest was reseeded
and its clock set, ``failed`` with a reason. Two instants are reported: all
children restored (host side) and all agents answered.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmfork.agent.client import AgentClient, vsock_uds_connector
from vmfork.agent.protocol import AGENT_PORT
from vmfork.runtime.network import ChildNetwork, EgressPolicy, HostNetwork
from vmfork.runtime.zygote_client import ZygoteClient
from vmfork.runtime.zygote_protocol import SpawnItem
from vmfork.store import Snapshot

VMM_ENTRY = "vmfork.runtime.vmmchild:main"


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
                  wait_for: str = "ready",
                  progress: Callable[[int, int, int], None] | None = None,
                  per_child_netns: bool = False, network: HostNetwork | None = None,
                  egress: EgressPolicy | None = None) -> ForkReport:
    """Spawn ``n`` children and wait until every one is ready (``wait_for="ready"``)
    or only restored and running (``"restored"``), or failed.

    ``per_child_netns``: each child gets a network of its own from ``network``
    (made before the spawn, in parallel, with ``egress`` applied), in
    ``Child.network``; the caller destroys it (``network.destroy``) once the child
    is gone. Networks of children that failed, or of all if this raises
    ``SpawnFailed``, are destroyed here.

    ``progress(restored, ready, failed)`` is called as counts change.
    """
    if wait_for not in ("ready", "restored"):
        raise ValueError(f"wait_for must be 'ready' or 'restored', not {wait_for!r}")
    done_states = ("ready",) if wait_for == "ready" else ("restored", "ready")
    if not 1 <= n <= 1000:
        raise ValueError(f"n must be 1..1000, not {n}")
    if per_child_netns and network is None:
        raise ValueError("per_child_netns needs a HostNetwork (network=...)")
    run_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    network_started = time.monotonic()
    nets = network.create_many(n, egress) if per_child_netns and network is not None else []
    network_s = time.monotonic() - network_started
    by_vm: dict[str, ChildNetwork] = {}
    items = []
    for index in range(n):
        vm_id = new_vm_id()
        run_dir = run_root / vm_id
        args = {"snapshot_dir": str(snapshot.path), "run_dir": str(run_dir), "vm_id": vm_id,
                "log_path": str(run_dir / "vmm.log")}
        if nets:
            by_vm[vm_id] = nets[index]
            args.update(netns=nets[index].netns, net_tap=nets[index].tap)
        items.append(SpawnItem(vm_id, args, memory_limit_mib))
    # A child can die before it writes any status (killed, OOM, a crash in the
    # restore): the zygote's exit events catch those; take the cursor first.
    _, events_cursor = zygote.events()
    started = time.monotonic()
    result = zygote.spawn_many(VMM_ENTRY, items)
    spawned = time.monotonic()
    children = [Child(c.vm_id, c.pid, Path(c.run_dir or run_root / c.vm_id),
                      network=by_vm.get(c.vm_id)) for c in result.children]
    failed = list(result.failed)
    restored_at: float | None = None
    pending = {c.vm_id: c for c in children}
    next_events_check = started
    restored: set[str] = set()
    last = (-1, -1, -1)
    while pending:
        if time.monotonic() - started > timeout:
            _destroy_networks(network, by_vm.values())
            raise SpawnFailed(f"{len(pending)} of {n} children not ready after {timeout:.0f} s")
        for vm_id, child in list(pending.items()):
            state = child.read_status().get("state")
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
                dead = pending.pop(event.vm_id) if event.vm_id in pending else None
                if dead is not None and dead.read_status().get("state") not in done_states:
                    tail = "; ".join(event.log_tail[-3:])
                    failed.append((event.vm_id, f"{event.description}"
                                   + (f" ({tail})" if tail else "")))
            next_events_check = time.monotonic() + 0.1
        if restored_at is None and len(restored) + len(failed) >= len(children):
            restored_at = time.monotonic()
        counts = (len(restored), len(children) - len(pending) - len(failed), len(failed))
        if progress is not None and counts != last:
            progress(*counts)
            last = counts
        if pending:
            time.sleep(0.002)
    ready_at = time.monotonic()
    ok = [c for c in children if c.status.get("state") in done_states]
    ok_ids = {c.vm_id for c in ok}
    _destroy_networks(network, [net for vm_id, net in by_vm.items() if vm_id not in ok_ids])
    return ForkReport(children=ok, spawn_s=spawned - started,
                      restored_s=(restored_at or ready_at) - started,
                      ready_s=ready_at - started, failed=failed, network_s=network_s)


def _destroy_networks(network: HostNetwork | None, nets: Iterable[ChildNetwork]) -> None:
    for net in nets:
        if network is not None:
            network.destroy(net)
