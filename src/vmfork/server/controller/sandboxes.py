"""Sandboxes: spawn from a snapshot (admission, volumes, networks), list, get,
delete, and the network of a sandbox (published ports, egress)."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from vmfork.runtime.network import NetworkError
from vmfork.runtime.volumes import PreparedVolume
from vmfork.server import volumes
from vmfork.server.controller.core import PAUSE_TAG_PREFIX, Part, sandbox_info
from vmfork.server.errors import BadGateway, BadRequest, Conflict, NotImplementedApi, Unprocessable
from vmfork.server.networking import SandboxNetworks, egress_policy, snapshot_has_network
from vmfork.server.registry import EXITED, RUNNING, SandboxRecord
from vmfork.server.requests import Egress, PortExpose, SandboxCreate
from vmfork.server.spawner import SpawnerError
from vmfork.store import Snapshot, SnapshotCorrupt, SnapshotNotFound, StoreError, chains
from vmfork.store.errors import HasDependents

log = logging.getLogger(__name__)


class Sandboxes(Part):
    """Spawns are admitted under the daemon-wide caps and take a heavy slot; what a
    spawn cannot be given (a network, a volume) is refused before anything starts."""

    def create_sandboxes(self, request: SandboxCreate, *,
                         workspace: str | None = None) -> list[dict[str, Any]]:
        """``workspace``: the spawn is that workspace's sandbox (its read-write volumes
        are held by the workspace, and a suspension snapshot's are reopened)."""
        for flag, asked, why in (
                ("live_fork", request.live_fork, "children always map the snapshot "
                 "copy-on-write; forkd's live_fork copies RAM per child and is not offered"),
                ("hugepages", request.hugepages, "hugepage-backed guest RAM is not "
                 "implemented yet")):
            if asked:
                raise BadRequest(f"{flag}=true is not supported: {why}; omit it")
        tag = request.snapshot_tag
        n = request.n
        snap = self.core.ready_snapshot(tag)
        try:
            # A diff snapshot's memory is mapped from its ancestors' files: refuse (409)
            # rather than map files that are not the ones its plan was computed on.
            chains.check_plan(self.store, snap)
        except SnapshotCorrupt as err:
            raise Conflict(str(err)) from err
        spawner = self.core.require_spawner()
        network_args = self._network_args(request, snap)
        new_volumes, reopened = self._spawn_volumes(request, snap, workspace)
        # Only when there are any: a spawner from before volumes takes no such argument.
        volume_args: dict[str, Any] = ({"volumes": [*new_volumes, *reopened]}
                                       if new_volumes or reopened else {})
        with self.core.heavy_slot(f"spawn {n} sandboxes of {tag!r}"), \
                self.core.admission(n, snap.meta.mem_mib, tag), \
                volumes.held(self.registry, new_volumes, secrets.token_hex(6)) as holder:
            started = time.time()
            try:
                outcome = spawner.spawn(snap, n, request.memory_limit_mib, **network_args,
                                        **volume_args)
            except SpawnerError as err:
                self.metrics.spawn_seconds.observe(time.time() - started, outcome="failed")
                raise BadGateway(str(err)) from err
            if outcome.failed:
                for child in outcome.children:
                    spawner.kill(child.vm_id)
                if self.networks is not None:
                    self.networks.destroy_unregistered(
                        [c.network for c in outcome.children if c.network is not None])
                self.metrics.spawn_seconds.observe(outcome.ready_s, outcome="failed")
                reasons = "; ".join(f"{vm}: {why}" for vm, why in outcome.failed[:5])
                raise BadGateway(
                    f"{len(outcome.failed)} of {n} sandboxes of {tag!r} failed to start "
                    f"({reasons}); none were kept. See the daemon log and the snapshot's "
                    "health (GET /v1/snapshots/{tag}/info)",
                    extra={"failed": [{"id": vm, "reason": why} for vm, why in outcome.failed]})
            timeout = request.timeout_secs
            listed = self._volumes_listed(snap, [*new_volumes, *reopened])
            records = [SandboxRecord(id=c.vm_id, snapshot_tag=tag, pid=c.pid,
                                     run_dir=c.run_dir, status=RUNNING, created_at=started,
                                     memory_limit_mib=request.memory_limit_mib,
                                     timeout_secs=timeout,
                                     end_at=None if timeout is None else started + timeout,
                                     on_timeout=request.on_timeout,
                                     metadata=dict(request.metadata or {}),
                                     envs=dict(request.envs or {}), volumes=listed)
                       for c in outcome.children]
            if self.networks is not None:
                for child in outcome.children:
                    if child.network is not None:
                        self.networks.register(child.vm_id, child.network)
            self.registry.add_sandboxes(records)
            self.registry.move_volume_holds(
                holder, f"workspace:{workspace}" if workspace else f"sandbox:{records[0].id}")
        self.metrics.spawn_seconds.observe(outcome.ready_s, outcome="ok")
        self.metrics.restore_seconds.observe(outcome.restored_s)
        self.metrics.sandboxes_spawned.inc(len(records))
        # An extension beside forkd's fields: this request's spawn timings.
        timings = {"spawn_ms": round(outcome.spawn_s * 1000, 3),
                   "restored_ms": round(outcome.restored_s * 1000, 3),
                   "ready_ms": round(outcome.ready_s * 1000, 3)}
        return [{**self.core.with_network(sandbox_info(r)), "timings": timings}
                for r in records]

    @staticmethod
    def _volumes_listed(snap: Snapshot, attached: list[PreparedVolume]
                        ) -> list[dict[str, Any]]:
        """A sandbox's volumes as ``SandboxInfo`` lists them: its snapshot's own (read-only,
        every child has them) and those its spawn attached or reopened."""
        own = [{"source": v["source"], "guest_path": v["guest_path"], "mode": "ro",
                "from_snapshot": True} for v in snap.meta.extra.get("volumes", [])]
        given = {v.guest_path: {"source": v.source, "guest_path": v.guest_path,
                                "mode": "ro" if v.read_only else "rw",
                                "from_snapshot": False} for v in attached}
        return [v for v in own if v["guest_path"] not in given] + list(given.values())

    def _spawn_volumes(self, request: SandboxCreate, snap: Snapshot, workspace: str | None
                       ) -> tuple[list[PreparedVolume], list[PreparedVolume]]:
        """The volumes a spawn attaches (parsed, checked against the snapshot's slots,
        their disks made), and the read-write files of the snapshot's own slots that a
        workspace's sandbox reopens. Refuses (before anything starts) what cannot be."""
        where = "volumes"
        specs = volumes.parse_request(request.volumes, where)
        slots = volumes.snapshot_slots(snap)
        rw_slots = [s for s in slots if s.key and not s.read_only]
        reopened: list[PreparedVolume] = []
        if rw_slots:
            mine = ({v.key: v for v in volumes.held_volumes(self.registry,
                                                            f"workspace:{workspace}")}
                    if workspace else {})
            missing = [s for s in rw_slots if s.key not in mine]
            if missing:
                raise Conflict(f"snapshot {snap.tag!r} holds the read-write volume at "
                               f"{missing[0].guest_path} of the workspace it suspends; "
                               "resume that workspace (POST /v1/workspaces/{name}/resume) "
                               "instead of spawning it")
            reopened = [mine[s.key] for s in rw_slots]
        if not specs:
            return [], reopened
        volumes.check_fits(snap, slots, specs, where)
        if request.n > 1 and any(not s.read_only for s in specs):
            raise Conflict(f"{where}: a read-write volume belongs to one sandbox, and n is "
                           f"{request.n}; spawn it with n=1 (read-only volumes are shared "
                           "by any number)")
        prepared = volumes.prepare_all(specs, where)
        rw_keys = [v.key for v in prepared if not v.read_only]
        if len(set(rw_keys)) != len(rw_keys):
            raise BadRequest(f"{where}: the same read-write file is given twice")
        return prepared, reopened

    def _network_args(self, request: SandboxCreate, snap: Snapshot) -> dict[str, Any]:
        """The spawner's network arguments for ``per_child_netns``/``egress``; refuses
        (before anything starts) what cannot get a network."""
        egress = egress_policy(request.egress)
        if not request.per_child_netns:
            if egress is not None:
                raise BadRequest("egress applies to a sandbox's own network: add "
                                 "per_child_netns=true, or drop egress")
            return {}
        if self.networks is None:
            raise NotImplementedApi("per_child_netns=true: this daemon runs without host "
                                    "networking (it needs root: CAP_NET_ADMIN, "
                                    "CAP_SYS_ADMIN); omit per_child_netns")
        if not snapshot_has_network(snap):
            raise Conflict(f"snapshot {snap.tag!r} has no network device, so its sandboxes "
                           "cannot be given networks; create a snapshot with network=true "
                           "(`vmfork snapshot --network`) and spawn that one")
        if egress is not None and egress.domains:
            try:
                egress.resolve()  # a name that does not resolve: refused before the spawn
            except NetworkError as err:
                raise Unprocessable(f"egress: {err}") from err
        return {"network": self.networks.host, "egress": egress}

    def list_sandboxes(self, metadata: dict[str, str] | None = None,
                       states: set[str] | None = None) -> list[dict[str, Any]]:
        """Every sandbox, or those whose metadata has every pair of ``metadata`` and
        whose status is one of ``states``."""
        wanted = (metadata or {}).items()
        return [self.core.with_network(sandbox_info(r))
                for r in self.registry.list_sandboxes()
                if (states is None or r.status in states)
                and all(r.metadata.get(k) == v for k, v in wanted)]

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return self.core.sandbox(sandbox_id)

    def sandbox_run_dir(self, sandbox_id: str) -> str:
        """Where the sandbox's VMM keeps its files (its console log among them)."""
        return self.core.record(sandbox_id).run_dir

    def delete_sandbox(self, sandbox_id: str) -> None:
        with self.core.lifecycle(sandbox_id):
            record = self.core.record(sandbox_id)
            if record.status == RUNNING:
                try:
                    self.core.require_spawner().kill(sandbox_id)
                except SpawnerError as err:
                    raise BadGateway(str(err)) from err
                if self.registry.mark_ended(sandbox_id, EXITED, "killed",
                                            "deleted through the API"):
                    self.metrics.sandbox_exits.inc(reason="killed")
            self.core.release_sandbox(sandbox_id)
            self.registry.remove_sandbox(sandbox_id)
            self._drop_pause_snapshots(record)

    def _drop_pause_snapshots(self, record: SandboxRecord) -> None:
        """Delete the snapshots this sandbox's pauses made (``pause-<id>-*``): a diff
        pause of a resumed sandbox builds on the previous one, so dependents go first
        (each round deletes those nothing depends on any more)."""
        prefix = f"{PAUSE_TAG_PREFIX}{record.id}-"
        # By name: loading every snapshot of the store (and sweeping its leftovers) at
        # every delete made a delete cost what the store holds.
        left = [tag for tag in self.store.tag_names() if tag.startswith(prefix)]
        while left:
            kept = []
            for tag in left:
                try:
                    self.store.delete(tag)
                except SnapshotNotFound:
                    pass
                except HasDependents:
                    kept.append(tag)
                except StoreError as err:
                    log.warning("cannot delete %s, a pause snapshot of %s: %s", tag,
                                record.id, err)
            if len(kept) == len(left):   # what depends on them is not this sandbox's
                log.warning("pause snapshots of %s kept (other snapshots depend on them): "
                            "%s", record.id, ", ".join(kept))
                return
            left = kept

    # -- networks of sandboxes (per_child_netns) ---------------------------------------

    def _networked(self, sandbox_id: str) -> SandboxNetworks:
        record = self.core.record(sandbox_id)
        if record.status != RUNNING:
            raise Conflict(f"sandbox {sandbox_id!r} is not running ({record.status}); its "
                           "network is gone")
        if self.networks is None:
            raise Conflict(f"sandbox {sandbox_id} has no network of its own: this daemon "
                           "runs without host networking")
        return self.networks

    def list_ports(self, sandbox_id: str) -> list[dict[str, Any]]:
        return self._networked(sandbox_id).ports(sandbox_id)

    def expose_port(self, sandbox_id: str, request: PortExpose) -> dict[str, Any]:
        return self._networked(sandbox_id).expose(sandbox_id, request.guest_port,
                                                  request.host_port, request.protocol)

    def unexpose_port(self, sandbox_id: str, host_port: int, protocol: str) -> None:
        self._networked(sandbox_id).unexpose(sandbox_id, host_port, protocol)

    def set_egress(self, sandbox_id: str, request: Egress) -> dict[str, Any]:
        policy = egress_policy(request.as_policy_spec())
        assert policy is not None
        return self._networked(sandbox_id).set_egress(sandbox_id, policy)
