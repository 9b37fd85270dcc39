"""The daemon's per-sandbox networks: one ``HostNetwork`` and the ``ChildNetwork`` of
every sandbox spawned with ``per_child_netns``.

Lifetime. A network is made by the spawn (``fork_children``), recorded here and in
the registry (``sandbox_networks``) before the sandbox is, and destroyed when its
sandbox goes: deleted, died on its own, or lost with the zygote. The registry row
is what lets a restarted daemon tell a network to keep from one to remove:
``start`` (after the controller's reconciliation) spares the namespaces of the
sandboxes it re-adopted, removes every other namespace, host link and the host
table with our prefix (a crash's leftovers), makes the host table afresh and
publishes the re-adopted sandboxes' ports again.

Errors become API errors here, so the controller only threads calls through:
bad input 400, a sandbox without a network or a port taken 409, an allow-list
name that does not resolve 422, the host refusing 502.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from vmfork.runtime.network import (
    ChildNetwork,
    EgressPolicy,
    HostNetwork,
    NetworkError,
    cleanup_stale,
)
from vmfork.server.errors import BadGateway, BadRequest, Conflict, NotFound, Unprocessable
from vmfork.server.registry import Registry
from vmfork.store import Snapshot

log = logging.getLogger(__name__)


def egress_policy(spec: dict[str, Any] | None) -> EgressPolicy | None:
    """``{"mode": "allow"|"deny"|"allowlist", "cidrs": [...], "domains": [...],
    "reach_host": bool}`` as a policy; BadRequest naming what is wrong. ``reach_host``
    (default false) lets the sandbox reach the host's addresses and other sandboxes'
    published ports; link-local addresses need an allow-list entry."""
    if spec is None:
        return None
    unknown = sorted(set(spec) - {"mode", "cidrs", "domains", "reach_host"})
    if unknown:
        raise BadRequest(f"egress: unknown field {unknown[0]!r}; accepted: mode, cidrs, "
                         "domains, reach_host")
    mode = spec.get("mode", "allow")
    lists: dict[str, tuple[str, ...]] = {}
    for name in ("cidrs", "domains"):
        value = spec.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise BadRequest(f"egress: {name} must be an array of strings")
        if len(value) > 256:
            raise BadRequest(f"egress: {name} holds {len(value)} entries; at most 256")
        lists[name] = tuple(value)
    if not isinstance(mode, str):
        raise BadRequest("egress: mode must be a string: allow, deny or allowlist")
    reach_host = spec.get("reach_host", False)
    if not isinstance(reach_host, bool):
        raise BadRequest("egress: reach_host must be true or false")
    try:
        return EgressPolicy(mode, lists["cidrs"], lists["domains"],  # type: ignore[arg-type]
                            reach_host)
    except ValueError as err:
        raise BadRequest(f"egress: {err}") from err


def snapshot_has_network(snap: Snapshot) -> bool:
    """Whether the snapshot's machine has a network device (its parent was booted with
    one, or it is a BRANCH of a sandbox that had one)."""
    recorded = snap.meta.extra.get("network")
    if recorded is not None:
        return bool(recorded)
    from vmfork.ondisk.stateformat import read_state_file
    from vmfork.vmm.devices import manager as devices
    from vmfork.vmm.vmstate import MachineState
    try:
        state = read_state_file(str(snap.state_path), MachineState)
        return state.device(devices.NET) is not None
    except Exception:  # noqa: BLE001 - an unreadable state fails the spawn with its reason
        return False


class SandboxNetworks:
    def __init__(self, registry: Registry, host: HostNetwork) -> None:
        self.registry = registry
        self.host = host
        self._lock = threading.Lock()
        self._by_sandbox: dict[str, ChildNetwork] = {}

    # -- lifecycle ------------------------------------------------------------------

    def start(self, running: set[str]) -> None:
        """After the reconciliation: keep the networks of ``running`` sandboxes, remove
        everything else with our prefix, make the host table, adopt what was kept."""
        records: dict[str, ChildNetwork] = {}
        for sandbox_id, text in self.registry.list_networks().items():
            if sandbox_id not in running:
                self.registry.remove_network(sandbox_id)  # its sandbox is gone
                continue
            try:
                records[sandbox_id] = ChildNetwork.from_record(json.loads(text),
                                                               self.host.guest)
            except (ValueError, KeyError, TypeError) as err:
                log.error("sandbox %s: unreadable network record (%s); its network is "
                          "removed", sandbox_id, err)
                self.registry.remove_network(sandbox_id)
        removed = self.host.run_on_host(cleanup_stale, self.host.prefix,
                                        frozenset(c.netns for c in records.values()))
        if removed.namespaces or removed.links:
            log.warning("removed %d network namespaces and %d host links a previous daemon "
                        "left behind", len(removed.namespaces), len(removed.links))
        self.host.setup()
        for sandbox_id, child in records.items():
            try:
                self.host.adopt(child)
            except NetworkError as err:
                log.error("sandbox %s keeps running without its network: %s", sandbox_id, err)
                self.registry.remove_network(sandbox_id)
                continue
            with self._lock:
                self._by_sandbox[sandbox_id] = child

    def close(self, destroy: bool) -> None:
        """Stop; ``destroy`` removes every network (the sandboxes are being killed),
        else they stay for the next daemon, which adopts them."""
        if destroy:
            for sandbox_id in list(self._by_sandbox):
                self.release(sandbox_id)
            try:
                self.host.remove_host_table()  # nothing is left to route or publish
            except NetworkError as err:
                log.warning("%s", err)
        self.host.close(destroy_children=destroy)

    # -- per sandbox ----------------------------------------------------------------

    def register(self, sandbox_id: str, child: ChildNetwork) -> None:
        """Record a new sandbox's network (before the sandbox itself is recorded)."""
        with self._lock:
            self._by_sandbox[sandbox_id] = child
        self._save(sandbox_id, child)

    def release(self, sandbox_id: str) -> None:
        """Remove the network of a sandbox that is gone (its VMM exited). Idempotent."""
        with self._lock:
            child = self._by_sandbox.pop(sandbox_id, None)
        if child is not None:
            try:
                self.host.destroy(child)
            except Exception as err:  # noqa: BLE001 - the next daemon start removes it
                log.error("cannot remove the network %s of sandbox %s: %s", child.netns,
                          sandbox_id, err)
        self.registry.remove_network(sandbox_id)

    def destroy_unregistered(self, children: list[ChildNetwork]) -> None:
        """Networks of a spawn that was refused after the fact (some children failed)."""
        for child in children:
            self.host.destroy(child)

    def get(self, sandbox_id: str) -> ChildNetwork | None:
        with self._lock:
            return self._by_sandbox.get(sandbox_id)

    def _child(self, sandbox_id: str) -> ChildNetwork:
        child = self.get(sandbox_id)
        if child is None:
            raise Conflict(f"sandbox {sandbox_id} has no network of its own; spawn it with "
                           "per_child_netns=true from a snapshot made with network=true")
        return child

    def _save(self, sandbox_id: str, child: ChildNetwork) -> None:
        self.registry.put_network(sandbox_id, json.dumps(child.to_record()))

    def describe(self, sandbox_id: str) -> dict[str, Any] | None:
        child = self.get(sandbox_id)
        return None if child is None else child.describe()

    # -- ports and egress -----------------------------------------------------------

    def ports(self, sandbox_id: str) -> list[dict[str, Any]]:
        ports: list[dict[str, Any]] = self._child(sandbox_id).describe()["ports"]
        return ports

    def expose(self, sandbox_id: str, guest_port: int, host_port: int,
               protocol: str) -> dict[str, Any]:
        child = self._child(sandbox_id)
        try:
            port = self.host.expose_port(child, guest_port, host_port,
                                         protocol)  # type: ignore[arg-type]
        except ValueError as err:
            raise BadRequest(str(err)) from err
        except NetworkError as err:
            if "already published" in str(err) or "in use" in str(err):
                raise Conflict(f"{err}; choose another host_port, or 0 for a free one") from err
            raise BadGateway(f"cannot publish a port of sandbox {sandbox_id}: {err}") from err
        self._save(sandbox_id, child)
        return {"protocol": protocol, "host_port": port, "guest_port": guest_port,
                "address": child.address}

    def unexpose(self, sandbox_id: str, host_port: int, protocol: str) -> None:
        child = self._child(sandbox_id)
        if (protocol, host_port) not in child.ports:
            raise NotFound(f"{protocol}/{host_port} is not published for sandbox "
                           f"{sandbox_id}; GET /v1/sandboxes/{sandbox_id}/ports lists them")
        try:
            self.host.unexpose_port(child, host_port, protocol)  # type: ignore[arg-type]
        except NetworkError as err:
            raise BadGateway(f"cannot unpublish {protocol}/{host_port} of sandbox "
                             f"{sandbox_id}: {err}") from err
        finally:
            self._save(sandbox_id, child)

    def set_egress(self, sandbox_id: str, policy: EgressPolicy) -> dict[str, Any]:
        child = self._child(sandbox_id)
        try:
            self.host.set_egress(child, policy)
        except NetworkError as err:
            if "cannot resolve" in str(err):
                raise Unprocessable(f"egress of sandbox {sandbox_id}: {err}; the policy was "
                                    "not changed") from err
            raise BadGateway(f"cannot set the egress policy of sandbox {sandbox_id}: "
                             f"{err}") from err
        self._save(sandbox_id, child)
        return child.describe()
