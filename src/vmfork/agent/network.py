"""The guest's network: configured at boot from the kernel command line, refreshed
after a fork. Stdlib only (ioctls and netlink through ``socket``/``fcntl``).

Boot. The host puts the guest-facing address on the kernel command line::

    vmfork.ip=172.16.0.2/30 vmfork.gw=172.16.0.1 vmfork.dns=192.0.2.53,192.0.2.54

and PID 1 gives the first Ethernet interface (virtio-net, ``eth0``) that
address, brings it up, adds the default route and writes ``/etc/resolv.conf``
(only when ``vmfork.dns`` is given). The classic ioctls (SIOCSIFADDR,
SIOCSIFNETMASK, SIOCADDRT) do all of it in a few system calls; the kernel's own
``ip=`` autoconfiguration would need CONFIG_IP_PNP and waits for a carrier, and
it cannot write resolv.conf. No command-line words: no network, nothing done.

After a fork. Every child resumes with the parent's TCP connections and
neighbour cache. The address stays (each child sits behind its own network
namespace on the host, with the same guest-facing address), but connections
the parent had opened to the outside are meaningless in the child: the host
side of them is not there. ``refresh`` aborts each of them with SOCK_DESTROY
(sock_diag, CONFIG_INET_DIAG_DESTROY), which sends the peer a RST and makes the
owning process see ECONNABORTED at once instead of hanging on retransmits;
listening sockets and connections over loopback are kept (they are inside the
guest and still whole). It then flushes the neighbour (ARP) cache of the
interface, so the child learns its gateway afresh. vsock is untouched: the
agent's own channel never depends on the network.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import Any

SIOCADDRT = 0x890B
SIOCSIFADDR = 0x8916
SIOCSIFNETMASK = 0x891C
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
RTF_UP = 0x1
RTF_GATEWAY = 0x2

_IFREQ_FLAGS = struct.Struct("16sh22x")
# struct rtentry (x86-64): rt_pad1 (8), rt_dst, rt_gateway, rt_genmask (a struct
# sockaddr each, from offset 8), rt_flags (u16 at 56), ... 120 bytes in all. A NULL
# rt_dev lets the kernel pick the interface that reaches the gateway.
RTENTRY_SIZE = 120
RTENTRY_FLAGS_OFFSET = 56

NETLINK_ROUTE = 0
NETLINK_SOCK_DIAG = 4
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
SOCK_DIAG_BY_FAMILY = 20
SOCK_DESTROY = 21
RTM_NEWNEIGH = 28
RTM_DELNEIGH = 29
RTM_GETNEIGH = 30
NDA_DST = 1
NUD_PERMANENT = 0x80
_NLMSGHDR = struct.Struct("=IHHII")
# struct inet_diag_sockid: ports and addresses (network order), then interface and
# cookie (host order): 48 bytes. A destroy request names the socket by all of it.
_INET_DIAG_SOCKID = struct.Struct(">HH16s16s")
SOCKID_SIZE = 48
_INET_DIAG_REQ = struct.Struct("=BBBxI")        # family, protocol, ext, pad, states
_NDMSG = struct.Struct("=BxxxiHBB")

TCP_LISTEN = 10
TCP_TIME_WAIT = 6
TCP_CLOSE = 7
# Every state but LISTEN, TIME_WAIT and CLOSE (nothing to abort there).
_ABORTABLE_STATES = 0xFFF & ~((1 << TCP_LISTEN) | (1 << TCP_TIME_WAIT) | (1 << TCP_CLOSE))
MAX_NETLINK_REPLIES = 100_000  # bound on what one dump may make us walk


class NetworkConfigError(ValueError):
    """The command line's network words are malformed; the message names the word."""


def _sockaddr_in(address: str) -> bytes:
    return struct.pack("=H2s4s8x", socket.AF_INET, b"\0\0", socket.inet_aton(address))


def parse_cmdline(words: dict[str, str]) -> dict[str, Any] | None:
    """``vmfork.ip``/``vmfork.gw``/``vmfork.dns`` -> a config dict; None if absent."""
    if "vmfork.ip" not in words:
        return None
    try:
        iface = ipaddress.IPv4Interface(words["vmfork.ip"])
    except ValueError as err:
        raise NetworkConfigError(f"vmfork.ip={words['vmfork.ip']!r}: {err}") from err
    gateway = None
    if "vmfork.gw" in words:
        try:
            gateway = ipaddress.IPv4Address(words["vmfork.gw"])
        except ValueError as err:
            raise NetworkConfigError(f"vmfork.gw={words['vmfork.gw']!r}: {err}") from err
        if gateway not in iface.network:
            raise NetworkConfigError(f"vmfork.gw={gateway} is not on {iface.network}")
    dns = []
    for server in filter(None, words.get("vmfork.dns", "").split(",")):
        try:
            dns.append(str(ipaddress.IPv4Address(server)))
        except ValueError as err:
            raise NetworkConfigError(f"vmfork.dns server {server!r}: {err}") from err
    return {"address": str(iface.ip), "netmask": str(iface.netmask),
            "gateway": None if gateway is None else str(gateway), "dns": dns}


def ethernet_interface() -> str | None:
    """The first interface that is not loopback (virtio-net's ``eth0``)."""
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError:
        return None
    return next((n for n in names if n != "lo"), None)


def configure(config: dict[str, Any], name: str) -> None:
    """Address, netmask, up, default route, resolv.conf -- in that order."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifname = name.encode()
        fcntl.ioctl(sock, SIOCSIFADDR, ifname.ljust(16, b"\0") + _sockaddr_in(config["address"])
                    + bytes(8))
        fcntl.ioctl(sock, SIOCSIFNETMASK, ifname.ljust(16, b"\0")
                    + _sockaddr_in(config["netmask"]) + bytes(8))
        flags = _IFREQ_FLAGS.unpack(fcntl.ioctl(sock, SIOCGIFFLAGS,
                                                _IFREQ_FLAGS.pack(ifname, 0)))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, _IFREQ_FLAGS.pack(ifname, flags | IFF_UP))
        if config["gateway"] is not None:
            route = bytearray(RTENTRY_SIZE)
            struct.pack_into("16s16s16s", route, 8, _sockaddr_in("0.0.0.0"),
                             _sockaddr_in(config["gateway"]), _sockaddr_in("0.0.0.0"))
            struct.pack_into("H", route, RTENTRY_FLAGS_OFFSET, RTF_UP | RTF_GATEWAY)
            fcntl.ioctl(sock, SIOCADDRT, bytes(route))
    if config["dns"]:
        text = "".join(f"nameserver {server}\n" for server in config["dns"])
        os.makedirs("/etc", exist_ok=True)
        with open("/etc/resolv.conf", "w") as f:
            f.write(text)


def configure_from_cmdline(words: dict[str, str]) -> str | None:
    """PID 1's boot step: returns a line for the console, or None if there is no network."""
    config = parse_cmdline(words)
    if config is None:
        return None
    name = ethernet_interface()
    if name is None:
        return "network: vmfork.ip given but the guest has no Ethernet interface"
    configure(config, name)
    return f"network: {name} {words['vmfork.ip']} via {config['gateway']}"


# -- after a fork -----------------------------------------------------------------------


def _netlink_exchange(protocol: int, msg_type: int, flags: int, payload: bytes,
                      on_reply: Any = None) -> None:
    """Send one request and read replies until DONE / the ACK; raise on a netlink error."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       protocol) as sock:
        sock.bind((0, 0))
        sock.settimeout(5.0)
        sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(payload), msg_type, flags, 1, 0)
                  + payload)
        seen = 0
        while True:
            data = sock.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
                if length < _NLMSGHDR.size:
                    return
                body = data[offset + _NLMSGHDR.size:offset + length]
                offset += (length + 3) & ~3
                seen += 1
                if seen > MAX_NETLINK_REPLIES or kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    error = struct.unpack_from("=i", body)[0]
                    if error:
                        raise OSError(-error, os.strerror(-error))
                    return
                if on_reply is not None:
                    on_reply(kind, body)


def _is_loopback(family: int, raw: bytes) -> bool:
    if family == socket.AF_INET:
        return raw[0] == 127
    return raw == bytes(15) + b"\1"


def abort_inherited_connections() -> int:
    """SOCK_DESTROY every TCP connection that does not stay inside the guest."""
    found: list[tuple[int, bytes]] = []

    def collect(kind: int, body: bytes) -> None:
        if kind != SOCK_DIAG_BY_FAMILY or len(body) < 4 + SOCKID_SIZE:
            return
        family = body[0]
        sockid = body[4:4 + SOCKID_SIZE]
        _, _, src, dst = _INET_DIAG_SOCKID.unpack_from(sockid)
        if not (_is_loopback(family, src) or _is_loopback(family, dst)):
            found.append((family, sockid))

    aborted = 0
    for family in (socket.AF_INET, socket.AF_INET6):
        request = _INET_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, _ABORTABLE_STATES) \
            + bytes(SOCKID_SIZE)
        try:
            _netlink_exchange(NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY,
                              NLM_F_REQUEST | NLM_F_DUMP, request, collect)
        except OSError:
            continue  # no such family in this kernel (IPv6 is off)
    for sock_family, sockid in found:
        request = _INET_DIAG_REQ.pack(sock_family, socket.IPPROTO_TCP, 0, 0xFFFF_FFFF) + sockid
        try:
            _netlink_exchange(NETLINK_SOCK_DIAG, SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK,
                              request)
            aborted += 1
        except OSError:
            pass  # closed meanwhile
    return aborted


def flush_neighbours(ifindex: int) -> int:
    """Delete every non-permanent IPv4 neighbour entry of interface ``ifindex``."""
    entries: list[bytes] = []

    def collect(kind: int, body: bytes) -> None:
        if kind != RTM_NEWNEIGH or len(body) < _NDMSG.size:
            return
        _, index, state, _, _ = _NDMSG.unpack_from(body)
        if index != ifindex or state & NUD_PERMANENT:
            return
        offset = _NDMSG.size
        while offset + 4 <= len(body):
            length, kind_ = struct.unpack_from("=HH", body, offset)
            if length < 4:
                break
            if kind_ == NDA_DST:
                entries.append(body[offset:offset + length])
            offset += (length + 3) & ~3

    _netlink_exchange(NETLINK_ROUTE, RTM_GETNEIGH, NLM_F_REQUEST | NLM_F_DUMP,
                      _NDMSG.pack(socket.AF_INET, 0, 0, 0, 0), collect)
    flushed = 0
    for dst in entries:
        attr = dst + bytes((4 - len(dst) % 4) % 4)
        try:
            _netlink_exchange(NETLINK_ROUTE, RTM_DELNEIGH, NLM_F_REQUEST | NLM_F_ACK,
                              _NDMSG.pack(socket.AF_INET, ifindex, 0, 0, 0) + attr)
            flushed += 1
        except OSError:
            pass  # expired meanwhile
    return flushed


def refresh(req: dict[str, Any]) -> dict[str, Any]:
    """The ``net_refresh`` op: this guest was just forked from a snapshot."""
    aborted = abort_inherited_connections()
    name = ethernet_interface()
    flushed = flush_neighbours(socket.if_nametoindex(name)) if name is not None else 0
    return {"interface": name, "connections_aborted": aborted, "neighbours_flushed": flushed}
