"""The agent's network steps, run for real in a private network namespace (the
netlink and ioctl calls act on the namespace of the thread that makes them)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from pyroute2 import IPRoute
from test_virtio_net import PrivateNet

from vmfork.agent import network


@pytest.fixture
def netns() -> Iterator[PrivateNet]:
    ns = PrivateNet()
    yield ns
    ns.close()


def test_cmdline_words_parse() -> None:
    words = {"vmfork.ip": "172.16.0.2/30", "vmfork.gw": "172.16.0.1",
             "vmfork.dns": "192.0.2.53,192.0.2.54"}
    assert network.parse_cmdline(words) == {
        "address": "172.16.0.2", "netmask": "255.255.255.252", "gateway": "172.16.0.1",
        "dns": ["192.0.2.53", "192.0.2.54"]}
    assert network.parse_cmdline({}) is None
    assert network.parse_cmdline({"vmfork.ip": "10.0.0.5/24"})["gateway"] is None  # type: ignore[index]


@pytest.mark.parametrize("words", [
    {"vmfork.ip": "172.16.0.300/30"},
    {"vmfork.ip": "172.16.0.2/30", "vmfork.gw": "10.0.0.1"},
    {"vmfork.ip": "172.16.0.2/30", "vmfork.dns": "resolver"},
])
def test_bad_cmdline_words_are_named(words: dict[str, str]) -> None:
    with pytest.raises(network.NetworkConfigError, match="vmfork"):
        network.parse_cmdline(words)


def _make_veth(name: str) -> int:
    with IPRoute() as ipr:  # veth, not dummy: this kernel may lack the dummy driver
        ipr.link("add", ifname=name, kind="veth", peer="peer0")
        return int(ipr.link_lookup(ifname=name)[0])


def test_configure_sets_address_and_default_route(netns: PrivateNet) -> None:
    index = netns.run(_make_veth, "eth0")
    config = network.parse_cmdline({"vmfork.ip": "172.16.0.2/30", "vmfork.gw": "172.16.0.1"})
    assert config is not None
    netns.run(network.configure, config, "eth0")

    def observe() -> tuple[list[str], list[str]]:
        with IPRoute() as ipr:
            addrs = [f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}"
                     for a in ipr.get_addr(index=index)]
            routes = [r.get_attr("RTA_GATEWAY") for r in ipr.get_default_routes()]
        return addrs, routes

    assert netns.run(observe) == (["172.16.0.2/30"], ["172.16.0.1"])


def _abort_scenario() -> tuple[int, str, str, bytes]:
    with IPRoute() as ipr:
        lo = ipr.link_lookup(ifname="lo")[0]
        ipr.link("set", index=lo, state="up")
        ipr.link("add", ifname="eth0", kind="veth", peer="peer0")
        eth = ipr.link_lookup(ifname="eth0")[0]
        ipr.addr("add", index=eth, address="10.9.0.1", prefixlen=24)
        ipr.link("set", index=eth, state="up")
    outside = socket.create_server(("10.9.0.1", 0))
    inside = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(outside.getsockname(), timeout=5)
    loop_client = socket.create_connection(inside.getsockname(), timeout=5)
    peer, _ = outside.accept()
    loop_peer, _ = inside.accept()
    aborted = network.abort_inherited_connections()
    try:
        client.send(b"x")
        client_saw = "nothing"
    except OSError as err:
        client_saw = type(err).__name__
    peer.settimeout(5)
    try:
        peer_saw = repr(peer.recv(10))
    except OSError as err:
        peer_saw = type(err).__name__
    loop_client.sendall(b"still here")
    kept = loop_peer.recv(10)
    for s in (outside, inside, client, loop_client, peer, loop_peer):
        s.close()
    return aborted, client_saw, peer_saw, kept


def test_inherited_connections_are_aborted_loopback_ones_kept(netns: PrivateNet) -> None:
    aborted, client_saw, peer_saw, kept = netns.run(_abort_scenario)
    # Both ends are guest sockets here; aborting one resets the other, so the second
    # destroy may find nothing left to abort.
    assert aborted in (1, 2)
    # Whichever end was aborted first sees ECONNABORTED, the other the RST it sent.
    assert {client_saw, peer_saw} <= {"ConnectionAbortedError", "ConnectionResetError", "b''"}
    assert "ConnectionAbortedError" in (client_saw, peer_saw)
    assert kept == b"still here"


def _neighbour_scenario() -> tuple[int, list[str]]:
    with IPRoute() as ipr:
        ipr.link("add", ifname="eth0", kind="veth", peer="peer0")
        eth = ipr.link_lookup(ifname="eth0")[0]
        ipr.addr("add", index=eth, address="10.9.0.1", prefixlen=24)
        ipr.link("set", index=eth, state="up")
        ipr.neigh("add", dst="10.9.0.7", lladdr="02:00:00:00:00:07", ifindex=eth,
                  state=0x02)  # NUD_REACHABLE
        ipr.neigh("add", dst="10.9.0.8", lladdr="02:00:00:00:00:08", ifindex=eth,
                  state=0x80)  # NUD_PERMANENT
        flushed = network.flush_neighbours(eth)
        left = [n.get_attr("NDA_DST") for n in ipr.get_neighbours(ifindex=eth)]
    return flushed, left


def test_neighbour_flush_keeps_permanent_entries(netns: PrivateNet) -> None:
    flushed, left = netns.run(_neighbour_scenario)
    assert flushed == 1 and left == ["10.9.0.8"]
