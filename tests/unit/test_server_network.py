"""The daemon's per-sandbox networks through its HTTP API, natively: the "host" is a
network namespace this test creates, the sandboxes' networks are real namespaces,
taps, veths and nftables rules made by a real ``HostNetwork``; only the VMs are
fake (``FakeSpawner``: no guest answers behind the taps; guest traffic through the
daemon is tests/e2e/test_daemon_network.py).

Covers: per_child_netns and egress validation (400/409/422/501), published ports
(201, 409 on a taken or busy host port, 404, 400), PUT egress, networks removed
when a sandbox is killed or dies, and a daemon restart: a re-adopted sandbox
keeps its namespace and published ports, a vanished one's network is removed,
stray leftovers of a crash are removed.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server_http import TOKEN, FakeSpawner, Served
from test_virtio_net import PrivateNet

from vmfork.client import Controller, ControllerError, Sandbox, egress_policy
from vmfork.runtime import network
from vmfork.runtime.network import EgressPolicy, HostNetwork
from vmfork.server.audit import AuditLog
from vmfork.server.controller import Controller as Ctl
from vmfork.server.http import HttpFront, ServerContext
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.networking import SandboxNetworks
from vmfork.server.registry import SCHEMA_VERSION, Registry
from vmfork.server.requests import SnapshotCreate
from vmfork.server.spawner import ExitNotice, Spawned, SpawnOutcome
from vmfork.store import Snapshot, SnapshotMeta, SnapshotTimings, Store

PREFIX = "vmfd"


class NetFakeSpawner(FakeSpawner):
    """FakeSpawner whose children get real networks, as ``ZygoteSpawner`` gives them."""

    def spawn(self, snapshot: Snapshot, n: int, memory_limit_mib: int | None, *,
              network: HostNetwork | None = None,
              egress: EgressPolicy | None = None) -> SpawnOutcome:
        outcome = super().spawn(snapshot, n, memory_limit_mib)
        if network is None:
            return outcome
        nets = network.create_many(n, egress)
        children = [Spawned(c.vm_id, c.pid, c.run_dir, net)
                    for c, net in zip(outcome.children, nets, strict=True)]
        return SpawnOutcome(children, [], 0.01, 0.02, 0.03)


def _snapshot_maker(store: Store, request: SnapshotCreate) -> Snapshot:
    with store.begin(request.tag) as pending:
        pending.state_path.write_bytes(b"state")
        pending.memory_path.write_bytes(b"\0" * 4096)
        return pending.publish(SnapshotMeta(
            tag=request.tag, image="test", mem_mib=64, vcpus=1,
            timings=SnapshotTimings(pause_ms=1.0), extra={"network": request.network}))


class Daemon:
    """Controller + HTTP server on a Unix socket, with host networking in ``host``."""

    def __init__(self, tmp_path: Path, host: PrivateNet, spawner: FakeSpawner,
                 pool_size: int = 0) -> None:
        self.store = Store.open(tmp_path / "home")
        self.registry = Registry(tmp_path / "registry.db")
        hn: HostNetwork = host.pool.submit(HostNetwork, None, prefix=PREFIX,
                                           pool_size=pool_size).result()
        self.networks = SandboxNetworks(self.registry, hn)
        self.ctl = Ctl(self.store, self.registry, spawner, DaemonMetrics("test"),
                       make_snapshot=_snapshot_maker, networks=self.networks)
        self.ctl.start()
        self.audit = AuditLog(tmp_path / "audit.log")
        sock = tmp_path / "api.sock"
        self.front = HttpFront(ServerContext(self.ctl, TOKEN, self.audit))
        self.front.listen_unix(sock)
        self.front.start()
        self.served = Served(f"unix://{sock}", sock, spawner, self.ctl,
                             tmp_path / "audit.log", self.audit, self.store)
        self.client = Controller(self.served.url, token=TOKEN.decode(), timeout=10)

    def stop(self, kill_sandboxes: bool = False) -> None:
        self.front.stop()
        self.ctl.stop(kill_sandboxes=kill_sandboxes)
        self.registry.close()
        self.audit.close()


@pytest.fixture
def host() -> Iterator[PrivateNet]:
    ns = PrivateNet()
    yield ns
    ns.run(network.cleanup_stale, PREFIX)
    ns.close()


@pytest.fixture
def daemon(tmp_path: Path, host: PrivateNet) -> Iterator[Daemon]:
    d = Daemon(tmp_path, host, NetFakeSpawner())
    yield d
    d.stop(kill_sandboxes=True)


def _leftovers(host: PrivateNet) -> network.CleanupReport:
    report: network.CleanupReport = host.run(network.leftovers, PREFIX)
    return report


def _published(host: PrivateNet) -> list[Any]:
    def elements() -> Any:
        listing = network._Nft.run([{"list": {"map": {"family": "ip", "table": PREFIX,
                                                      "name": "ports"}}}], "list ports")
        return listing["nftables"][1]["map"].get("elem", [])
    return list(host.run(elements))


def test_spawn_with_networks_and_refusals(daemon: Daemon, host: PrivateNet) -> None:
    req = daemon.served.request
    daemon.client.create_snapshot("plain")
    assert daemon.client.create_snapshot("wired", network=True)["network"] is True
    infos = {s["tag"]: s for s in daemon.client.list_snapshots()}
    assert infos["wired"].get("network") is True and "network" not in infos["plain"]

    status, body, _ = req("POST", "/v1/sandboxes", {"snapshot_tag": "plain",
                                                    "per_child_netns": True})
    assert status == 409 and "no network device" in body["error"]
    for egress, problem in (({"mode": "maybe"}, "egress mode"),
                            ({"mode": "allowlist", "cidrs": ["10.0.0.0/33"]}, "10.0.0.0/33"),
                            ({"mode": "deny", "cidrs": ["10.0.0.0/8"]}, "takes no cidrs"),
                            ({"mode": "allow", "extra": 1}, "unknown field"),
                            ({"mode": "allowlist", "domains": [7]}, "array of strings")):
        status, body, _ = req("POST", "/v1/sandboxes", {"snapshot_tag": "wired",
                                                        "per_child_netns": True,
                                                        "egress": egress})
        assert status == 400 and problem in body["error"], body
    status, body, _ = req("POST", "/v1/sandboxes", {
        "snapshot_tag": "wired", "per_child_netns": True,
        "egress": {"mode": "allowlist", "domains": ["no-such-host.invalid"]}})
    assert status == 422 and "cannot resolve" in body["error"]
    assert _leftovers(host).namespaces == [], "refusals make no namespaces"

    sandboxes = daemon.client.spawn_sandboxes("wired", 2, per_child_netns=True, egress="deny")
    netns = sorted(s["netns"] for s in sandboxes)
    assert len(set(netns)) == 2 and all(s["network"]["egress"] == "deny" for s in sandboxes)
    assert all(s["guest_addr"].startswith("10.200.") for s in sandboxes)
    assert sorted(_leftovers(host).namespaces) == netns
    listed = {s["id"]: s for s in daemon.client.list_sandboxes()}
    assert listed[sandboxes[0]["id"]]["netns"] == sandboxes[0]["netns"]
    plain = daemon.client.spawn_sandboxes("wired", 1)[0]
    assert plain["netns"] is None and "network" not in plain, "networks only when asked"

    daemon.client.kill_sandbox(sandboxes[0]["id"])
    assert _leftovers(host).namespaces == [sandboxes[1]["netns"]]
    assert set(daemon.registry.list_networks()) == {sandboxes[1]["id"]}
    # A sandbox that dies on its own takes its network with it.
    daemon.served.spawner.pending_exits.append(
        ExitNotice(sandboxes[1]["id"], "crashed", "killed by signal 11 (SIGSEGV)"))
    for _ in range(100):
        if not _leftovers(host).namespaces:
            break
        threading.Event().wait(0.05)
    found = _leftovers(host)
    assert found.namespaces == [] and found.links == []
    assert daemon.registry.list_networks() == {}


def test_a_network_pool_serves_spawns_and_goes_with_the_daemon(tmp_path: Path,
                                                               host: PrivateNet) -> None:
    d = Daemon(tmp_path, host, NetFakeSpawner(), pool_size=2)
    try:
        d.client.create_snapshot("wired", network=True)
        assert _leftovers(host).namespaces == [], "no spares before the first networked spawn"
        first = d.client.spawn_sandboxes("wired", 2, per_child_netns=True)
        assert d.networks.host.wait_for_pool(30) == 2
        spares = set(_leftovers(host).namespaces) - {s["netns"] for s in first}
        assert len(spares) == 2
        second = d.client.spawn_sandboxes("wired", 2, per_child_netns=True, egress="deny")
        assert {s["netns"] for s in second} == spares, "the spares were taken"
        assert all(s["network"]["egress"] == "deny" for s in second)
        assert d.networks.host.wait_for_pool(30) == 2, "and made again"
        for sandbox in first + second:
            d.client.kill_sandbox(sandbox["id"])
        assert len(_leftovers(host).namespaces) == 2, "only the spares stay"
    finally:
        d.stop()  # sandboxes kept for a restart, spares not: they belong to no one
    found = _leftovers(host)
    assert found.namespaces == [] and found.links == []


def test_ports_and_egress_routes(daemon: Daemon, host: PrivateNet) -> None:
    req = daemon.served.request
    daemon.client.create_snapshot("wired", network=True)
    a, b = daemon.client.spawn_sandboxes("wired", 2, per_child_netns=True)
    plain = daemon.client.spawn_sandboxes("wired", 1)[0]

    published = daemon.client.expose_port(a["id"], 80)
    port = published["host_port"]
    assert published == {"protocol": "tcp", "host_port": port, "guest_port": 80,
                         "address": a["guest_addr"]}
    status, body, _ = req("POST", f"/v1/sandboxes/{b['id']}/ports",
                          {"guest_port": 80, "host_port": port})
    assert status == 409 and "already published" in body["error"]
    busy = host.run(_listen)
    try:
        status, body, _ = req("POST", f"/v1/sandboxes/{b['id']}/ports",
                              {"guest_port": 80, "host_port": busy.getsockname()[1]})
        assert status == 409 and "in use on the host" in body["error"]
    finally:
        busy.close()
    for bad, field in (({"guest_port": 0}, "guest_port"), ({"guest_port": 70000}, "guest_port"),
                       ({"guest_port": 80, "host_port": -1}, "host_port"),
                       ({"guest_port": 80, "protocol": "sctp"}, "protocol"),
                       ({"guest_port": "80"}, "guest_port")):
        status, body, _ = req("POST", f"/v1/sandboxes/{a['id']}/ports", bad)
        assert status == 400 and field in body["error"], body
    status, body, _ = req("POST", f"/v1/sandboxes/{plain['id']}/ports", {"guest_port": 80})
    assert status == 409 and "no network of its own" in body["error"]

    sb = Sandbox.connect(b["id"], controller=daemon.client)
    udp = sb.expose(53, protocol="udp")
    assert {(p["protocol"], p["host_port"]) for p in sb.ports()} == {("udp", udp)}
    assert len(_published(host)) == 2
    assert daemon.client.get_sandbox(b["id"])["network"]["ports"][0]["guest_port"] == 53

    assert req("DELETE", f"/v1/sandboxes/{a['id']}/ports/{port}")[0] == 204
    status, body, _ = req("DELETE", f"/v1/sandboxes/{a['id']}/ports/{port}")
    assert status == 404 and "not published" in body["error"]
    for bad in ("abc", "0", "65536", "%2e%2e"):
        status, body, _ = req("DELETE", f"/v1/sandboxes/{a['id']}/ports/{bad}")
        assert status == 400 and "port" in body["error"], (bad, body)
    status, body, _ = req("DELETE", f"/v1/sandboxes/{b['id']}/ports/{udp}?protocol=tcp")
    assert status == 404
    assert len(_published(host)) == 1

    described = daemon.client.set_egress(a["id"], ["192.0.2.0/24", "localhost"])
    assert described["egress"] == "allowlist"
    assert described["allowed"] == ["127.0.0.1/32", "192.0.2.0/24"]
    status, body, _ = req("PUT", f"/v1/sandboxes/{a['id']}/egress",
                          {"mode": "allowlist", "domains": ["no-such-host.invalid"]})
    assert status == 422 and "not changed" in body["error"]
    assert daemon.client.get_sandbox(a["id"])["network"]["egress"] == "allowlist"
    status, body, _ = req("PUT", f"/v1/sandboxes/{a['id']}/egress", {"mode": "nope"})
    assert status == 400 and "mode" in body["error"]
    assert daemon.client.set_egress(a["id"], "deny")["allowed"] == []
    record = json.loads(daemon.registry.list_networks()[a["id"]])
    assert record["egress"]["mode"] == "deny", "the registry follows policy changes"

    daemon.client.kill_sandbox(b["id"])  # takes its published port with it
    assert _published(host) == []


def test_sdk_egress_shapes() -> None:
    assert egress_policy("deny") == {"mode": "deny"}
    assert egress_policy("10.0.0.0/8,example.com") == {
        "mode": "allowlist", "cidrs": ["10.0.0.0/8"], "domains": ["example.com"]}
    assert egress_policy({"mode": "allow"}) == {"mode": "allow"}


def _listen() -> socket.socket:
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    return s


def test_restart_keeps_adopted_networks_and_removes_the_rest(tmp_path: Path,
                                                             host: PrivateNet) -> None:
    spawner = NetFakeSpawner()
    first = Daemon(tmp_path, host, spawner)
    first.client.create_snapshot("wired", network=True)
    keep, gone = first.client.spawn_sandboxes("wired", 2, per_child_netns=True)
    port = first.client.expose_port(keep["id"], 8080)["host_port"]
    first.client.set_egress(keep["id"], "deny")
    first.stop()  # sandboxes keep running for the next daemon
    assert len(_leftovers(host).namespaces) == 2, "a daemon stopping keeps the networks"

    spawner.live.discard(gone["id"])  # died while no daemon ran
    # A crash left a namespace nobody records.
    stray_manager: HostNetwork = host.pool.submit(HostNetwork, None, prefix=PREFIX).result()
    stray = stray_manager.create()
    stray_manager.close(destroy_children=False)

    second = Daemon(tmp_path, host, spawner)
    try:
        found = _leftovers(host)
        assert found.namespaces == [keep["netns"]] and stray.netns not in found.namespaces
        assert found.links == [keep["netns"].replace("-", "h", 1)]
        info = second.client.get_sandbox(keep["id"])
        assert info["netns"] == keep["netns"] and info["network"]["egress"] == "deny"
        assert info["network"]["ports"] == [{"protocol": "tcp", "host_port": port,
                                             "guest_port": 8080}]
        assert len(_published(host)) == 1, "the adopted port is published again"
        assert second.client.get_sandbox(gone["id"])["status"] == "lost"
        # New networks do not collide with the adopted one.
        new = second.client.spawn_sandboxes("wired", 1, per_child_netns=True)[0]
        assert new["netns"] != keep["netns"]
        with pytest.raises(ControllerError) as err:
            second.client.expose_port(new["id"], 80, host_port=port)
        assert err.value.status == 409
    finally:
        second.stop(kill_sandboxes=True)
    found = _leftovers(host)
    assert found.namespaces == [] and found.links == []


def test_registry_migrates_a_version_2_database(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version VALUES (2);
        CREATE TABLE sandboxes (id TEXT PRIMARY KEY, snapshot_tag TEXT NOT NULL,
            pid INTEGER NOT NULL, run_dir TEXT NOT NULL, status TEXT NOT NULL,
            created_at REAL NOT NULL, memory_limit_mib INTEGER,
            branch_count INTEGER NOT NULL DEFAULT 0, last_branch_memory_path TEXT,
            exit_reason TEXT, exit_description TEXT, ended_at REAL);
        CREATE TABLE snapshot_jobs (tag TEXT PRIMARY KEY, status TEXT NOT NULL,
            started_at REAL NOT NULL, finished_at REAL, error TEXT,
            daemon_pid INTEGER NOT NULL);
        CREATE TABLE workspaces (name TEXT PRIMARY KEY, snapshot_tag TEXT NOT NULL,
            sandbox_id TEXT, suspended_tag TEXT, memory_limit_mib INTEGER,
            created_at REAL NOT NULL, updated_at REAL NOT NULL);
        INSERT INTO sandboxes (id, snapshot_tag, pid, run_dir, status, created_at)
            VALUES ('vm-old', 'base', 7, '/run/x', 'running', 1.0);
    """)
    db.close()
    reg = Registry(path)
    assert reg.schema_version() == SCHEMA_VERSION == 6
    assert reg.get_sandbox("vm-old") is not None, "existing rows survive"
    reg.put_network("vm-old", '{"x": 1}')
    assert reg.list_networks() == {"vm-old": '{"x": 1}'}
    assert reg.remove_network("vm-old") and reg.get_network("vm-old") is None
    reg.close()
