"""runtime/network.py for real, natively: the "host" is a network namespace this test
creates (so nothing touches the machine's own network), the children are real
namespaces with real taps, veths and nftables rulesets. Guest traffic needs a VM and
is tested in tests/e2e/test_network.py."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

import pytest
from test_virtio_net import PrivateNet

from vmfork.runtime import network
from vmfork.runtime.network import EgressPolicy, GuestNetwork, HostNetwork, NetworkError

PREFIX = "vmfu"


@pytest.fixture
def host() -> Iterator[PrivateNet]:
    ns = PrivateNet()
    yield ns
    ns.run(network.cleanup_stale, PREFIX)
    ns.close()


@pytest.fixture
def manager(host: PrivateNet) -> Iterator[HostNetwork]:
    hn: HostNetwork = host.pool.submit(HostNetwork, None, prefix=PREFIX).result()
    hn.setup()
    yield hn
    hn.close()


def _nft(hn: HostNetwork, child: network.ChildNetwork, chain: str) -> list[dict[str, Any]]:
    listing = hn._on_host(hn._in_child, child, lambda: network._Nft.run(
        [{"list": {"chain": {"family": "inet", "table": "vmfork", "name": chain}}}], "list"))
    return [item["rule"]["expr"] for item in listing["nftables"] if "rule" in item]


def test_guest_network_and_policy_validation() -> None:
    assert GuestNetwork().kernel_cmdline() == "vmfork.ip=172.16.0.2/30 vmfork.gw=172.16.0.1"
    assert "vmfork.dns=192.0.2.53" in GuestNetwork(dns=("192.0.2.53",)).kernel_cmdline()
    with pytest.raises(ValueError, match="gateway"):
        GuestNetwork(gateway="10.0.0.1")
    with pytest.raises(ValueError, match="takes no cidrs"):
        EgressPolicy("deny", cidrs=("10.0.0.0/8",))
    with pytest.raises(ValueError, match="not a domain"):
        EgressPolicy("allowlist", domains=("bad domain",))
    with pytest.raises(ValueError, match="allow-list entry"):
        EgressPolicy("allowlist", cidrs=("10.0.0.0/33",))
    policy = EgressPolicy("allowlist", cidrs=("192.0.2.7/24",), domains=("localhost",))
    assert policy.resolve() == ("127.0.0.1/32", "192.0.2.0/24"), "DNS answers pinned at set-up"
    with pytest.raises(NetworkError, match="cannot resolve"):
        EgressPolicy("allowlist", domains=("no-such-host.invalid",)).resolve()
    with pytest.raises(ValueError, match="prefix"):
        HostNetwork(prefix="Bad-1")


def test_children_get_their_own_namespace_addresses_and_are_removed(
        host: PrivateNet, manager: HostNetwork) -> None:
    children = manager.create_many(6)
    addresses = {c.address for c in children} | {c.host_address for c in children}
    assert len(addresses) == 12 and all(
        ipaddress.IPv4Address(a) in manager.subnet for a in addresses)
    found = host.run(network.leftovers, PREFIX)
    assert sorted(found.namespaces) == sorted(c.netns for c in children)
    assert sorted(found.links) == sorted(c.host_veth for c in children)
    assert found.tables == [PREFIX]
    inbound = _nft(manager, children[0], "prerouting")
    assert inbound[0][-1] == {"dnat": {"family": "ip", "addr": "172.16.0.2"}}, \
        "the child address is the guest"
    for child in children:
        manager.destroy(child)
    manager.destroy(children[0])  # idempotent
    found = host.run(network.leftovers, PREFIX)
    assert found.namespaces == [] and found.links == []


def _is_link_local_reject(rule: list[dict[str, Any]]) -> bool:
    return "169.254.0.0" in str(rule) and rule[-1] == network._REJECT


def test_egress_policies_become_rules(manager: HostNetwork) -> None:
    ipv6_refused = [{"match": {"op": "==", "left": {"meta": {"key": "nfproto"}},
                               "right": "ipv6"}}, network._REJECT_ANY]
    child = manager.create(EgressPolicy("deny"))
    rules = _nft(manager, child, "egress")
    assert rules[0] == ipv6_refused and _is_link_local_reject(rules[1])
    assert rules[2:] == [[network._REJECT]]
    # An allow-list may name a link-local address: its accept comes before the refusal.
    manager.set_egress(child, EgressPolicy("allowlist",
                                           cidrs=("192.0.2.0/24", "169.254.169.254/32")))
    rules = _nft(manager, child, "egress")
    assert rules[0] == ipv6_refused
    assert rules[1][-1] == {"accept": None} and "@allowed" in str(rules[1])
    assert _is_link_local_reject(rules[2]) and rules[-1] == [network._REJECT]
    assert child.allowed == ("169.254.169.254/32", "192.0.2.0/24")
    manager.set_egress(child, EgressPolicy())
    rules = _nft(manager, child, "egress")
    assert rules[0] == ipv6_refused and _is_link_local_reject(rules[1])
    assert rules[2:] == [[{"accept": None}]]


def test_the_host_guard_refuses_the_host_unless_a_policy_reaches_it(
        manager: HostNetwork) -> None:
    listing = manager._on_host(network._Nft.run, [{"list": {"chain": {
        "family": "inet", "table": PREFIX, "name": "guard"}}}], "list guard")
    rules = [item["rule"]["expr"] for item in listing["nftables"] if "rule" in item]
    assert rules[-1][-1] == network._REJECT_ANY and "fib" in str(rules[-1])
    assert any("@host_ok" in str(r) for r in rules)

    def host_ok() -> list[str]:
        out = manager._on_host(network._Nft.run, [{"list": {"set": {
            "family": "inet", "table": PREFIX, "name": "host_ok"}}}], "list host_ok")
        return list(out["nftables"][1]["set"].get("elem", []))

    child = manager.create(EgressPolicy(reach_host=True))
    assert host_ok() == [child.host_veth]
    manager.set_egress(child, EgressPolicy())
    assert host_ok() == []
    manager.set_egress(child, EgressPolicy("deny", reach_host=True))
    manager.destroy(child)
    assert host_ok() == []   # a later child on this slot's link starts without it


def test_published_ports_are_map_elements(host: PrivateNet, manager: HostNetwork) -> None:
    a, b = manager.create_many(2)
    port = manager.expose_port(a, 8080)
    assert port > 0 and a.ports == {("tcp", port): 8080}
    with pytest.raises(NetworkError, match="already published"):
        manager.expose_port(b, 80, host_port=port)
    manager.expose_port(b, 8080, host_port=port + 1 if port < 65535 else port - 1)

    def elements() -> Any:
        listing = network._Nft.run([{"list": {"map": {"family": "ip", "table": PREFIX,
                                                      "name": "ports"}}}], "list ports")
        return listing["nftables"][1]["map"].get("elem", [])

    assert len(host.run(elements)) == 2
    manager.unexpose_port(a, port)
    with pytest.raises(NetworkError, match="not published"):
        manager.unexpose_port(a, port)
    manager.destroy(b)  # takes its published port with it
    assert host.run(elements) == []
    with pytest.raises(ValueError, match="guest_port"):
        manager.expose_port(a, 0)


def test_exhausted_subnet_fails_cleanly(host: PrivateNet) -> None:
    small: HostNetwork = host.pool.submit(HostNetwork, None, prefix=PREFIX,
                                          subnet="10.201.0.0/30").result()
    try:
        small.setup()
        with pytest.raises(NetworkError, match="no free network slot"):
            small.create_many(3)
        assert host.run(network.leftovers, PREFIX).namespaces == []
        assert len(small.create_many(2)) == 2
    finally:
        small.close()


def test_cleanup_stale_removes_what_a_crashed_manager_left(host: PrivateNet) -> None:
    crashed: HostNetwork = host.pool.submit(HostNetwork, None, prefix=PREFIX).result()
    crashed.setup()
    children = crashed.create_many(3)
    crashed._pool.shutdown()  # "crash": nothing destroyed
    removed = host.run(network.cleanup_stale, PREFIX)
    assert sorted(removed.namespaces) == sorted(c.netns for c in children)
    assert len(removed.links) == 3 and removed.tables == [PREFIX]
    assert host.run(network.leftovers, PREFIX).empty


def test_pool_hands_out_spares_once_with_the_requested_policy(host: PrivateNet) -> None:
    pooled: HostNetwork = host.pool.submit(HostNetwork, None, prefix=PREFIX,
                                           pool_size=2).result()
    try:
        pooled.setup()
        assert pooled.wait_for_pool(30) == 0, "the pool fills on first use, not at start"
        first = pooled.create()
        assert pooled.wait_for_pool(30) == 2
        spares = sorted(host.run(network.leftovers, PREFIX).namespaces)
        assert len(spares) == 3 and first.netns in spares
        taken = pooled.create_many(3, EgressPolicy("deny"))
        names = {c.netns for c in taken}
        assert len(names) == 3 and first.netns not in names
        assert len(names & set(spares)) == 2, "both spares were used"
        for child in taken:  # a spare got the spawn's policy before it was handed out
            assert child.egress.mode == "deny"
            assert _nft(pooled, child, "egress")[2:] == [[network._REJECT]]
        assert pooled.wait_for_pool(30) == 2, "topped up again"
        assert len(host.run(network.leftovers, PREFIX).namespaces) == 6
        for child in [first, *taken]:
            pooled.destroy(child)
        assert len(host.run(network.leftovers, PREFIX).namespaces) == 2, "only the spares"
        pooled.resize_pool(1)
        assert pooled.wait_for_pool(30) == 1
        assert len(host.run(network.leftovers, PREFIX).namespaces) == 1
        with pytest.raises(ValueError, match="pool_size"):
            HostNetwork(prefix=PREFIX, pool_size=-1)
    finally:
        pooled.close()
    found = host.run(network.leftovers, PREFIX)
    assert found.namespaces == [] and found.links == [], "close removes the spares"
