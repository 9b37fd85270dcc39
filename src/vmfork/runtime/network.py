"""Per-child networks on the host: a network namespace per sandbox, NAT out, egress
policy, published ports. Netlink through pyroute2, nftables through its JSON.

Why this shape. Children of one snapshot are clones: the same MAC, the same IP,
the same TCP state. Isolation therefore comes from the host: each child's VMM
runs in a network namespace of its own, where the guest's gateway address
exists once more. Every child's namespace looks the same from the guest::

    guest eth0 172.16.0.2/30 ── tap0 172.16.0.1/30 (fixed MAC) ┐ child netns
                                veth0 10.200.a.b+1/31 ─────────┘   "vmf-<slot>"
                                     │ veth pair
    host:                       vmfh<slot> 10.200.a.b/31 ── routing, NAT ── uplink

* **Addressing: a routed /31 per child, no bridge.** Slot ``s`` gets
  ``10.200.0.0/16 + 2s`` (host end) and ``+ 2s + 1`` (child end): 32,768
  children per /16 (a larger ``subnet`` gives more), no address shared between
  two children, and a host route to each child is just the /31's connected
  route. A Linux bridge was the other choice; it takes at most 1,024 ports
  (BR_MAX_PORTS) and puts every child on one L2 segment that then has to be
  split again with port isolation. forkd's /24-per-child scheme stops at 253.
* **Two NATs.** In the child's namespace, the guest's traffic is SNATed to the
  child end of its /31 (all guests have the same address), and everything that
  arrives for that address from the host is DNATed to the guest: the child end
  *is* the guest, seen from the host. On the host, ``subnet`` is masqueraded
  out of every other interface, and a published port is one element of an
  nftables map (``<proto> . <host port> : <child address> . <guest port>``),
  so publishing and unpublishing are O(1) whatever the number of children.
* **Egress policy lives in the child's namespace** (a ``forward`` chain with
  policy drop, an ``egress`` chain per policy), where the guest cannot touch it
  and where it dies with the namespace. Allow-list entries are CIDRs and domain
  names; **names are resolved once, when the policy is set, and the addresses
  they had then are what is allowed** (DNS answers pinned; re-set the policy to
  re-resolve). The guest's own DNS servers are then reachable on port 53 only.
  Denied traffic is rejected (ICMP admin-prohibited), so the guest fails fast.
* **Children cannot reach each other**: the host's forward chain drops every
  new connection into a child that is not a published port.
* **Creation is cheap and parallel.** A namespace is made by a worker thread
  that ``unshare(CLONE_NEWNET)``s itself, bind-mounts its namespace at
  ``/run/netns/<name>``, configures it from inside (netlink sockets, the tap,
  the ``ip_forward`` sysctl and the nftables ruleset all bind to the namespace
  of the thread that opens them) and ``setns``es back. nftables JSON is run
  through libnftables, the library behind ``nft -j -f -``, in that thread:
  a process per child would cost more than the namespace. ``create_many``
  runs several workers.
* **A pool of spares takes creation off the spawn path** (``pool_size``, off by
  default). Spares are built with the default policy (allow all) by the same
  workers, in the background; ``create_many`` takes spares first, builds the
  rest in parallel, gives each taken spare its requested egress policy (one
  nftables transaction, before any guest runs in it) and tops the pool up again.
  The pool fills on first use, not at start-up, so a daemon that never spawns a
  networked child makes no namespace. A spare is never handed out twice and
  never reused after its child: a used namespace is destroyed (its conntrack and
  neighbour state belong to a guest that is gone), the pool builds a new one.
* **The VMM opens the tap inside the namespace.** The tap is created
  persistent (address, MAC, up) with the namespace; the child's VMM process
  calls ``enter_netns`` before it builds its machine, so its ``/dev/net/tun``
  attach finds ``tap0`` there. Unix sockets (vsock, control) are unaffected.
* **Nothing outlives the child.** ``destroy`` removes the published ports, the
  host veth (its peer goes with it) and the namespace mount; the kernel frees
  the namespace, the tap and its nftables table once the VMM is gone.
  ``cleanup_stale`` removes whatever a crashed daemon left, by name prefix.

All names carry the manager's ``prefix`` (default ``vmf``): namespaces
``<prefix>-<slot>``, host links ``<prefix>h<slot>``, the host table
``ip <prefix>``. Everything here needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root).
"""

from __future__ import annotations

import collections
import ctypes
import ipaddress
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
TAP_NAME = "tap0"
INNER_VETH = "veth0"
# The gateway's MAC is the same in every child namespace, so the ARP entry a
# parent guest had for its gateway stays right in each of its children.
TAP_MAC = "02:00:ac:10:00:01"
DEFAULT_SUBNET = "10.200.0.0/16"
DEFAULT_PREFIX = "vmf"
MAX_POOL_SIZE = 1024  # spare namespaces kept ready; each is a namespace, two links, a table
NFT_TABLE_CHILD = "vmfork"
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
_PREFIX_RE = re.compile(r"^[a-z]{1,6}$")
_DOMAIN_RE = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.)*"
                        r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?$")
Proto = Literal["tcp", "udp"]


class NetworkError(RuntimeError):
    """A host network operation failed; the message names the step and the object."""


# -- namespaces of threads --------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise NetworkError(f"{what}: {os.strerror(err)}")


def _setns(fd: int, what: str) -> None:
    _check(_libc.setns(fd, CLONE_NEWNET), f"setns({what})")


def enter_netns(name: str, root_fd: int | None = None) -> None:
    """Move the calling thread into network namespace ``/run/netns/<name>``, looked up
    from ``root_fd`` when given (the host's root, for a process in a mount namespace of
    its own that the host's later mounts may not reach: ``jail.host_root``).

    For the VMM process of a child, before it creates any thread: threads it
    starts afterwards inherit the namespace, and ``/dev/net/tun`` then attaches
    to the tap inside it.
    """
    _validate_netns_name(name)
    path = NETNS_DIR / name
    try:
        if root_fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        else:
            fd = os.open(path.relative_to("/"), os.O_RDONLY | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError as err:
        raise NetworkError(f"open network namespace {name}: {err.strerror}") from err
    try:
        _setns(fd, name)
    finally:
        os.close(fd)


def _validate_netns_name(name: str) -> None:
    if not re.match(r"^[a-z]{1,6}-\d{1,6}$", name):
        raise NetworkError(f"network namespace name {name!r} is not one of ours "
                           f"(<prefix>-<slot>)")


# -- nftables through libnftables -----------------------------------------------------------

NFT_CTX_OUTPUT_JSON = 1 << 4


class _Nft:
    """Run nftables JSON commands in the calling thread's network namespace."""

    _lib: ctypes.CDLL | None = None

    @classmethod
    def lib(cls) -> ctypes.CDLL:
        if cls._lib is None:
            try:
                lib = ctypes.CDLL("libnftables.so.1", use_errno=True)
            except OSError as err:
                raise NetworkError("libnftables.so.1 is missing: install the Debian package "
                                   "'nftables' (scripts/lib.sh does)") from err
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            cls._lib = lib
        return cls._lib

    @classmethod
    def run(cls, commands: list[dict[str, Any]], what: str) -> Any:
        """One JSON batch (one transaction); returns the parsed JSON output, if any."""
        out = cls._run(json.dumps({"nftables": commands}), what, json_mode=True)
        return json.loads(out) if out.strip() else None

    @classmethod
    def run_text(cls, text: str, what: str) -> None:
        """Native nft syntax, for what nftables 1.0.6 cannot take as JSON: its JSON
        parser crashes (SIGSEGV, in ``nft -j -f -`` too) on a ``dnat`` whose address
        comes from a map with concatenated keys and data, and a map declared in JSON
        with concatenated types crashes the rule that uses it."""
        cls._run(text, what, json_mode=False)

    @classmethod
    def _run(cls, buffer: str, what: str, *, json_mode: bool) -> str:
        lib = cls.lib()
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise NetworkError(f"nft ({what}): nft_ctx_new failed")
        try:
            if json_mode:
                lib.nft_ctx_output_set_flags(ctx, NFT_CTX_OUTPUT_JSON)
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            rc = lib.nft_run_cmd_from_buffer(ctx, buffer.encode())
            out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode().strip()
        finally:
            lib.nft_ctx_free(ctx)
        if rc != 0:
            raise NetworkError(f"nft ({what}) failed: {err or 'no message'}")
        return out


def _match(left: Any, right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def _payload(protocol: str, fld: str) -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": fld}}


_ACCEPT: dict[str, Any] = {"accept": None}
_REJECT: dict[str, Any] = {"reject": {"type": "icmp", "expr": "admin-prohibited"}}
# For both families (an inet chain): ICMPv6 for IPv6, ICMP for IPv4.
_REJECT_ANY: dict[str, Any] = {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}


# -- what the caller chooses -------------------------------------------------------------------

@dataclass(frozen=True)
class GuestNetwork:
    """The guest-facing side: the same in a parent and in every child of it."""

    address: str = "172.16.0.2"
    gateway: str = "172.16.0.1"
    prefix_len: int = 30
    mac: str = "52:54:00:00:00:02"
    dns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            iface = ipaddress.IPv4Interface(f"{self.address}/{self.prefix_len}")
            gateway = ipaddress.IPv4Address(self.gateway)
            for server in self.dns:
                ipaddress.IPv4Address(server)
        except ValueError as err:
            raise ValueError(f"guest network: {err}") from err
        if gateway not in iface.network or gateway == iface.ip:
            raise ValueError(f"guest network: gateway {gateway} is not another address on "
                             f"{iface.network}")

    def kernel_cmdline(self) -> str:
        """The words the guest agent reads at boot (``agent/network.py``)."""
        words = [f"vmfork.ip={self.address}/{self.prefix_len}", f"vmfork.gw={self.gateway}"]
        if self.dns:
            words.append("vmfork.dns=" + ",".join(self.dns))
        return " ".join(words)


def host_dns_servers(resolv_conf: str = "/etc/resolv.conf") -> tuple[str, ...]:
    """The host's IPv4 name servers that a guest can reach (not loopback ones)."""
    servers = []
    try:
        text = Path(resolv_conf).read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                addr = ipaddress.IPv4Address(parts[1])
            except ValueError:
                continue
            if not addr.is_loopback:
                servers.append(str(addr))
    return tuple(servers)


@dataclass(frozen=True)
class EgressPolicy:
    """What a sandbox may connect to: ``allow`` all (default), ``deny`` all, or
    ``allowlist`` (``cidrs`` and ``domains``; domains resolved when applied); never,
    whatever the mode, the host or link-local addresses unless asked for (below)."""

    mode: Literal["allow", "deny", "allowlist"] = "allow"
    cidrs: tuple[str, ...] = ()
    domains: tuple[str, ...] = ()
    reach_host: bool = False
    """Let the sandbox reach the host's own addresses (its host end among them) and
    other sandboxes' published ports, which every policy refuses otherwise. Link-local
    addresses (cloud metadata) are refused unless ``cidrs`` names them."""

    def __post_init__(self) -> None:
        if self.mode not in ("allow", "deny", "allowlist"):
            raise ValueError(f"egress mode must be allow, deny or allowlist, not {self.mode!r}")
        if self.mode != "allowlist" and (self.cidrs or self.domains):
            raise ValueError(f"egress mode {self.mode!r} takes no cidrs or domains")
        for cidr in self.cidrs:
            try:
                ipaddress.IPv4Network(cidr, strict=False)
            except ValueError as err:
                raise ValueError(f"egress allow-list entry {cidr!r}: {err}") from err
        for domain in self.domains:
            if not _DOMAIN_RE.match(domain):
                raise ValueError(f"egress allow-list entry {domain!r} is not a domain name")

    def resolve(self) -> tuple[str, ...]:
        """The allow-list as networks: the CIDRs, and each domain's IPv4 addresses now."""
        networks = {str(ipaddress.IPv4Network(c, strict=False)) for c in self.cidrs}
        for domain in self.domains:
            try:
                infos = socket.getaddrinfo(domain, None, socket.AF_INET, socket.SOCK_STREAM)
            except socket.gaierror as err:
                raise NetworkError(f"egress allow-list: cannot resolve {domain!r}: "
                                   f"{err.strerror}") from err
            networks.update(f"{info[4][0]}/32" for info in infos)
        return tuple(sorted(networks, key=lambda n: ipaddress.IPv4Network(n)))


@dataclass
class ChildNetwork:
    """One child's network. ``address`` is how the host reaches the guest."""

    slot: int
    netns: str
    tap: str
    host_veth: str
    host_address: str
    address: str
    guest: GuestNetwork
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    allowed: tuple[str, ...] = ()
    ports: dict[tuple[str, int], int] = field(default_factory=dict)  # (proto, host) -> guest

    def to_record(self) -> dict[str, Any]:
        """What a daemon stores to re-adopt this network after a restart (``adopt``)."""
        return {"slot": self.slot, "netns": self.netns, "tap": self.tap,
                "host_veth": self.host_veth, "host_address": self.host_address,
                "address": self.address,
                "egress": {"mode": self.egress.mode, "cidrs": list(self.egress.cidrs),
                           "domains": list(self.egress.domains),
                           "reach_host": self.egress.reach_host},
                "allowed": list(self.allowed),
                "ports": [[p, h, g] for (p, h), g in sorted(self.ports.items())]}

    @classmethod
    def from_record(cls, record: dict[str, Any], guest: GuestNetwork) -> ChildNetwork:
        egress = record["egress"]
        return cls(slot=int(record["slot"]), netns=str(record["netns"]), tap=str(record["tap"]),
                   host_veth=str(record["host_veth"]),
                   host_address=str(record["host_address"]), address=str(record["address"]),
                   guest=guest,
                   egress=EgressPolicy(egress["mode"], tuple(egress["cidrs"]),
                                       tuple(egress["domains"]),
                                       bool(egress.get("reach_host", False))),
                   allowed=tuple(record["allowed"]),
                   ports={(str(p), int(h)): int(g) for p, h, g in record["ports"]})

    def describe(self) -> dict[str, Any]:
        return {"netns": self.netns, "address": self.address, "guest_address": self.guest.address,
                "egress": self.egress.mode, "allowed": list(self.allowed),
                "ports": [{"protocol": p, "host_port": h, "guest_port": g}
                          for (p, h), g in sorted(self.ports.items())]}


# -- the manager ------------------------------------------------------------------------------

def _iproute() -> Any:
    from pyroute2 import IPRoute  # type: ignore[import-not-found,import-untyped,unused-ignore]  # the VMM needs none

    return IPRoute()


def _write_sysctl(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class HostNetwork:
    """Creates and destroys child networks. Thread-safe.

    The namespace this object is created in is "the host": every operation runs
    on worker threads that live there (tests create it inside a namespace of
    their own). Call ``setup()`` once before the first child.
    """

    def __init__(self, guest: GuestNetwork | None = None, *, subnet: str = DEFAULT_SUBNET,
                 prefix: str = DEFAULT_PREFIX, workers: int = 4, pool_size: int = 0) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must be 1-6 lowercase letters")
        if not 0 <= pool_size <= MAX_POOL_SIZE:
            raise ValueError(f"pool_size {pool_size} must be 0-{MAX_POOL_SIZE}")
        self.guest = guest or GuestNetwork()
        self.subnet = ipaddress.IPv4Network(subnet)
        if self.subnet.prefixlen > 30:
            raise ValueError(f"subnet {subnet} is too small for even two children")
        if self.subnet.overlaps(ipaddress.IPv4Interface(
                f"{self.guest.address}/{self.guest.prefix_len}").network):
            raise ValueError(f"subnet {subnet} overlaps the guest network")
        self.prefix = prefix
        self.table = prefix
        self.capacity = min(self.subnet.num_addresses // 2, 10 ** 6)
        self._host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._next_slot = 0
        self._used: set[int] = set()
        self.children: dict[int, ChildNetwork] = {}
        self.pool_size = pool_size
        self._spares: collections.deque[ChildNetwork] = collections.deque()
        self._building = 0  # spares submitted and not yet in the pool
        self._pool_changed = threading.Condition(self._lock)
        self._closing = False
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers),
                                        thread_name_prefix=f"{prefix}-net",
                                        initializer=self._enter_host)

    def _enter_host(self) -> None:
        _setns(self._host_ns, "the host namespace")

    def _on_host(self, fn: Callable[..., T], *args: Any) -> T:
        return self._pool.submit(fn, *args).result()

    # -- host set-up ------------------------------------------------------------------------
    def setup(self) -> None:
        """Forwarding on, and the host table (NAT out, published ports, isolation)."""
        self._on_host(self._setup)

    def _setup(self) -> None:
        _write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")
        t = {"family": "ip", "table": self.table}
        links = f"{self.prefix}h*"
        commands: list[dict[str, Any]] = [
            {"add": {"table": {"family": "ip", "name": self.table}}},
            {"delete": {"table": {"family": "ip", "name": self.table}}},
            {"add": {"table": {"family": "ip", "name": self.table}}},
            {"add": {"chain": {**t, "name": "prerouting", "type": "nat", "hook": "prerouting",
                               "prio": -100, "policy": "accept"}}},
            {"add": {"chain": {**t, "name": "output", "type": "nat", "hook": "output",
                               "prio": -100, "policy": "accept"}}},
            {"add": {"chain": {**t, "name": "postrouting", "type": "nat",
                               "hook": "postrouting", "prio": 100, "policy": "accept"}}},
            {"add": {"chain": {**t, "name": "forward", "type": "filter", "hook": "forward",
                               "prio": 0, "policy": "accept"}}},
            {"add": {"rule": {**t, "chain": "postrouting", "expr": [
                _match(_payload("ip", "saddr"), {"prefix": {
                    "addr": str(self.subnet.network_address), "len": self.subnet.prefixlen}}),
                _match(_meta("oifname"), links, "!="), {"masquerade": None}]}}},
            # A published port reached from the host's own loopback: the guest must
            # answer someone it can route to.
            {"add": {"rule": {**t, "chain": "postrouting", "expr": [
                _match(_meta("oifname"), links),
                _match(_payload("ip", "saddr"), {"prefix": {"addr": "127.0.0.0", "len": 8}}),
                {"masquerade": None}]}}},
            {"add": {"rule": {**t, "chain": "forward", "expr": [
                _match(_meta("oifname"), links),
                _match({"ct": {"key": "state"}}, ["established", "related"], "in"), _ACCEPT]}}},
            {"add": {"rule": {**t, "chain": "forward", "expr": [
                _match(_meta("oifname"), links),
                _match({"ct": {"key": "status"}}, "dnat", "in"), _ACCEPT]}}},
            {"add": {"rule": {**t, "chain": "forward", "expr": [
                _match(_meta("oifname"), links), {"drop": None}]}}},
        ]
        _Nft.run(commands, f"host table ip {self.table}")
        _Nft.run(self._guard_commands(links), f"host table inet {self.table}")
        _Nft.run_text("\n".join([
            (f"add map ip {self.table} ports {{ type inet_proto . inet_service : "
             f"ipv4_addr . inet_service; }}"),
            *(f"add rule ip {self.table} {chain} fib daddr type local "
              f"dnat ip to meta l4proto . th dport map @ports"
              for chain in ("prerouting", "output"))]), "published-port map")

    def _guard_commands(self, links: str) -> list[dict[str, Any]]:
        """The host's guard (table ``inet <prefix>``): what a sandbox sends to the host
        itself is refused before the published-port DNAT (priority -150 < -100) sees
        it, so a guest reaches neither a service of the host on any of its addresses
        (its host end included) nor another sandbox's published port, over IPv4 or
        IPv6. Replies to connections the host opened pass (conntrack has run by then,
        at -200), and so do the guest's DNS servers on port 53 when one is a host
        address. A sandbox whose policy has ``reach_host`` has its link in the set
        ``host_ok`` (``_set_host_access``)."""
        t = {"family": "inet", "table": self.table}
        iif = _meta("iifname")
        table = {"family": "inet", "name": self.table}

        def rule(*expr: dict[str, Any]) -> dict[str, Any]:
            return {"add": {"rule": {**t, "chain": "guard", "expr": list(expr)}}}

        commands: list[dict[str, Any]] = [
            {"add": {"table": table}}, {"delete": {"table": table}}, {"add": {"table": table}},
            {"add": {"set": {**t, "name": "host_ok", "type": "ifname"}}},
            {"add": {"chain": {**t, "name": "guard", "type": "filter", "hook": "prerouting",
                               "prio": -150, "policy": "accept"}}},
            rule(_match(iif, links, "!="), _ACCEPT),
            rule(_match({"ct": {"key": "state"}}, ["established", "related"], "in"), _ACCEPT),
            rule(_match(iif, "@host_ok"), _ACCEPT),
            rule(_match(_meta("nfproto"), "ipv6"), _REJECT_ANY),
        ]
        if self.guest.dns:
            commands.append(rule(
                _match(_payload("ip", "daddr"), {"set": list(self.guest.dns)}),
                _match(_meta("l4proto"), {"set": ["tcp", "udp"]}),
                _match(_payload("th", "dport"), 53), _ACCEPT))
        commands.append(rule(_match({"fib": {"result": "type", "flags": ["daddr"]}}, "local"),
                             _REJECT_ANY))
        return commands

    def _set_host_access(self, child: ChildNetwork, policy: EgressPolicy) -> None:
        """On a worker: ``child``'s host link in the guard's ``host_ok`` set exactly when
        its policy asks to reach the host (a slot's link name is reused by later
        children, so it is also taken out on teardown)."""
        element = {"family": "inet", "table": self.table, "name": "host_ok",
                   "elem": [child.host_veth]}
        if policy.reach_host:
            _Nft.run([{"add": {"element": element}}], f"host access of {child.netns}")
        else:
            try:
                _Nft.run([{"delete": {"element": element}}], f"host access of {child.netns}")
            except NetworkError:
                pass   # it was not there

    # -- children ----------------------------------------------------------------------------
    def _claim_slot(self) -> int:
        with self._lock:
            for _ in range(self.capacity):
                slot = self._next_slot
                self._next_slot = (self._next_slot + 1) % self.capacity
                if slot not in self._used and not (NETNS_DIR / self._netns_name(slot)).exists():
                    self._used.add(slot)
                    return slot
        raise NetworkError(f"no free network slot: all {self.capacity} of subnet "
                           f"{self.subnet} are in use")

    def _release_slot(self, slot: int) -> None:
        with self._lock:
            self._used.discard(slot)

    def _netns_name(self, slot: int) -> str:
        return f"{self.prefix}-{slot}"

    def _addresses(self, slot: int) -> tuple[str, str]:
        host = self.subnet.network_address + 2 * slot
        return str(host), str(host + 1)

    def create(self, egress: EgressPolicy | None = None) -> ChildNetwork:
        """A new child network (namespace, tap, veth, NAT, egress policy)."""
        return self.create_many(1, egress)[0]

    def create_many(self, n: int, egress: EgressPolicy | None = None) -> list[ChildNetwork]:
        """``n`` child networks: spares from the pool first, the rest built in
        parallel; all or none (on error, the ones made are destroyed before the
        error is raised)."""
        policy = egress or EgressPolicy()
        allowed = policy.resolve() if policy.mode == "allowlist" else ()
        with self._lock:
            spares = [self._spares.popleft() for _ in range(min(n, len(self._spares)))]
        slots: list[int] = []
        try:
            for _ in range(n - len(spares)):
                slots.append(self._claim_slot())
        except NetworkError:
            for slot in slots:
                self._release_slot(slot)
            for child in spares:
                self.destroy(child)
            raise
        futures = [self._pool.submit(self._build, slot, policy, allowed) for slot in slots]
        made: list[ChildNetwork] = []
        if policy.mode == "allow":  # what spares are built with
            made += spares
        else:
            futures += [self._pool.submit(self._repolicy, child, policy, allowed)
                        for child in spares]
        errors: list[BaseException] = []
        for future in futures:
            try:
                made.append(future.result())
            except BaseException as err:  # noqa: BLE001 -- collected, re-raised below
                errors.append(err)
        if errors:
            for child in made:
                self.destroy(child)
            for child in spares:  # a spare whose policy failed is not in ``made``
                self.destroy(child)
            self.refill()
            raise NetworkError(f"{len(errors)} of {n} child networks failed; first: "
                               f"{errors[0]}") from errors[0]
        self.refill()
        return made

    # -- the pool of spares ------------------------------------------------------------------
    def refill(self) -> None:
        """Start building spares until the pool (ready + being built) holds
        ``pool_size``. Returns at once; a spare that fails to build is logged."""
        with self._lock:
            if self._closing:
                return
            missing = self.pool_size - len(self._spares) - self._building
        for _ in range(max(0, missing)):
            try:
                slot = self._claim_slot()
            except NetworkError as err:
                log.warning("network pool not refilled: %s", err)
                return
            with self._lock:
                self._building += 1
            self._pool.submit(self._build_spare, slot)

    def resize_pool(self, size: int) -> None:
        """Keep ``size`` spares from now on: the excess ones are destroyed, the
        missing ones built in the background (``wait_for_pool`` waits for them)."""
        if not 0 <= size <= MAX_POOL_SIZE:
            raise ValueError(f"pool_size {size} must be 0-{MAX_POOL_SIZE}")
        with self._lock:
            self.pool_size = size
            excess = [self._spares.pop() for _ in range(max(0, len(self._spares) - size))]
        for child in excess:
            self.destroy(child)
        self.refill()

    def _build_spare(self, slot: int) -> None:
        """On a worker: one spare, appended to the pool in this thread (so that
        ``close``, once no spare is being built, sees every one of them)."""
        child = None
        try:
            if self._closing:
                self._release_slot(slot)
            else:
                child = self._build(slot, EgressPolicy(), ())
        except BaseException as err:  # noqa: BLE001 -- _build tore it down; logged
            log.warning("building a spare network failed: %s", err)
        with self._pool_changed:
            if child is not None:
                self._spares.append(child)
            self._building -= 1
            self._pool_changed.notify_all()

    def wait_for_pool(self, timeout: float | None = None) -> int:
        """Block until no spare is being built (for benchmarks, tests and ``close``);
        returns how many spares are ready."""
        with self._pool_changed:
            self._pool_changed.wait_for(lambda: self._building == 0, timeout)
            return len(self._spares)

    def _repolicy(self, child: ChildNetwork, policy: EgressPolicy,
                  allowed: tuple[str, ...]) -> ChildNetwork:
        """On a worker: ``child``'s egress policy replaced (``set_egress``; a spare
        given the one its spawn asked for)."""
        self._in_child(child, lambda: _Nft.run(self._egress_commands(policy, allowed),
                                               f"egress policy of {child.netns}"))
        self._set_host_access(child, policy)
        child.egress, child.allowed = policy, allowed
        return child

    def _build(self, slot: int, policy: EgressPolicy, allowed: tuple[str, ...]) -> ChildNetwork:
        host_address, address = self._addresses(slot)
        child = ChildNetwork(slot=slot, netns=self._netns_name(slot), tap=TAP_NAME,
                             host_veth=f"{self.prefix}h{slot}", host_address=host_address,
                             address=address, guest=self.guest, egress=policy, allowed=allowed)
        try:
            self._new_namespace(child)
            self._configure_host_end(child)
            if policy.reach_host:
                self._set_host_access(child, policy)
        except BaseException:
            self._teardown(child)
            raise
        with self._lock:
            self.children[slot] = child
        return child

    def _new_namespace(self, child: ChildNetwork) -> None:
        """Runs on a worker: unshare, mount, configure from inside, come back."""
        from pyroute2 import netns as pyroute2_netns

        _check(_libc.unshare(CLONE_NEWNET), f"unshare for {child.netns}")
        try:
            try:
                pyroute2_netns.attach(child.netns, "thread-self")
            except OSError as err:
                raise NetworkError(f"mount network namespace {child.netns}: {err}") from err
            self._configure_inside(child)
        finally:
            self._enter_host()

    def _configure_inside(self, child: ChildNetwork) -> None:
        guest = child.guest
        _make_persistent_tap(child.tap)
        with _iproute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            tap = ipr.link_lookup(ifname=child.tap)[0]
            ipr.link("set", index=tap, address=TAP_MAC)
            ipr.addr("add", index=tap, address=guest.gateway, prefixlen=guest.prefix_len)
            ipr.link("set", index=tap, state="up")
            ipr.link("add", ifname=INNER_VETH, kind="veth",
                     peer={"ifname": child.host_veth, "net_ns_fd": self._host_ns})
            veth = ipr.link_lookup(ifname=INNER_VETH)[0]
            ipr.addr("add", index=veth, address=child.address, prefixlen=31)
            ipr.link("set", index=veth, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=child.host_address)
        _write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")
        _Nft.run(self._child_ruleset(child) + self._egress_commands(child.egress, child.allowed),
                 f"ruleset of {child.netns}")

    def _configure_host_end(self, child: ChildNetwork) -> None:
        with _iproute() as ipr:
            index = ipr.link_lookup(ifname=child.host_veth)[0]
            ipr.addr("add", index=index, address=child.host_address, prefixlen=31)
            ipr.link("set", index=index, state="up")
        # Published ports reached from 127.0.0.1 leave through this link.
        _write_sysctl(f"/proc/sys/net/ipv4/conf/{child.host_veth}/route_localnet", "1")

    def _child_ruleset(self, child: ChildNetwork) -> list[dict[str, Any]]:
        t = {"family": "inet", "table": NFT_TABLE_CHILD}
        iif, oif = _meta("iifname"), _meta("oifname")
        return [
            {"add": {"table": {"family": "inet", "name": NFT_TABLE_CHILD}}},
            {"add": {"set": {**t, "name": "allowed", "type": "ipv4_addr",
                             "flags": ["interval"]}}},
            {"add": {"chain": {**t, "name": "prerouting", "type": "nat", "hook": "prerouting",
                               "prio": -100, "policy": "accept"}}},
            {"add": {"chain": {**t, "name": "postrouting", "type": "nat",
                               "hook": "postrouting", "prio": 100, "policy": "accept"}}},
            {"add": {"chain": {**t, "name": "forward", "type": "filter", "hook": "forward",
                               "prio": 0, "policy": "drop"}}},
            {"add": {"chain": {**t, "name": "egress"}}},
            {"add": {"rule": {**t, "chain": "prerouting", "expr": [
                _match(iif, INNER_VETH), _match(_payload("ip", "daddr"), child.address),
                {"dnat": {"family": "ip", "addr": child.guest.address}}]}}},
            {"add": {"rule": {**t, "chain": "postrouting", "expr": [
                _match(oif, INNER_VETH), _match(_meta("nfproto"), "ipv4"),
                {"snat": {"family": "ip", "addr": child.address}}]}}},
            {"add": {"rule": {**t, "chain": "forward", "expr": [
                _match({"ct": {"key": "state"}}, ["established", "related"], "in"), _ACCEPT]}}},
            {"add": {"rule": {**t, "chain": "forward", "expr": [
                _match({"ct": {"key": "state"}}, "invalid", "in"), {"drop": None}]}}},
            {"add": {"rule": {**t, "chain": "forward", "expr": [
                _match(iif, INNER_VETH), _match(oif, child.tap),
                _match({"ct": {"key": "status"}}, "dnat", "in"), _ACCEPT]}}},
            {"add": {"rule": {**t, "chain": "forward", "expr": [
                _match(iif, child.tap), _match(oif, INNER_VETH),
                {"jump": {"target": "egress"}}]}}},
        ]

    def _egress_commands(self, policy: EgressPolicy,
                         allowed: tuple[str, ...]) -> list[dict[str, Any]]:
        """The ``egress`` chain for ``policy``. Whatever the mode, a guest reaches no
        IPv6 destination (it has no IPv6 address; the table is ``inet`` so that a
        forged packet is refused, not forwarded) and no link-local IPv4 address
        (169.254.0.0/16: cloud metadata services answer there) unless its allow-list
        names it. The host's own addresses and other sandboxes' published ports are
        refused on the host side (``_setup``, chain ``guard``)."""
        t = {"family": "inet", "table": NFT_TABLE_CHILD}
        commands: list[dict[str, Any]] = [{"flush": {"chain": {**t, "name": "egress"}}},
                                          {"flush": {"set": {**t, "name": "allowed"}}}]

        def rule(*expr: dict[str, Any]) -> dict[str, Any]:
            return {"add": {"rule": {**t, "chain": "egress", "expr": list(expr)}}}

        commands.append(rule(_match(_meta("nfproto"), "ipv6"), _REJECT_ANY))
        if policy.mode == "allowlist" and allowed:
            commands.append({"add": {"element": {**t, "name": "allowed", "elem": [
                {"prefix": {"addr": str(ipaddress.IPv4Network(n).network_address),
                            "len": ipaddress.IPv4Network(n).prefixlen}}
                for n in allowed]}}})
            commands.append(rule(_match(_payload("ip", "daddr"), "@allowed"), _ACCEPT))
        commands.append(rule(_match(_payload("ip", "daddr"),
                                    {"prefix": {"addr": "169.254.0.0", "len": 16}}), _REJECT))
        if policy.mode == "allow":
            commands.append(rule(_ACCEPT))
            return commands
        if policy.mode == "allowlist":
            if policy.domains and self.guest.dns:
                commands.append(rule(
                    _match(_payload("ip", "daddr"), {"set": list(self.guest.dns)}),
                    _match(_meta("l4proto"), {"set": ["tcp", "udp"]}),
                    _match(_payload("th", "dport"), 53), _ACCEPT))
        commands.append(rule(_REJECT))
        return commands

    def set_egress(self, child: ChildNetwork, egress: EgressPolicy) -> None:
        """Replace a child's egress policy (atomically: one nftables transaction)."""
        allowed = egress.resolve() if egress.mode == "allowlist" else ()
        self._on_host(self._repolicy, child, egress, allowed)

    def _in_child(self, child: ChildNetwork, fn: Callable[[], T]) -> T:
        fd = os.open(NETNS_DIR / child.netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(fd, child.netns)
            try:
                return fn()
            finally:
                self._enter_host()
        finally:
            os.close(fd)

    # -- published ports ---------------------------------------------------------------------
    def expose_port(self, child: ChildNetwork, guest_port: int, host_port: int = 0,
                    protocol: Proto = "tcp") -> int:
        """Publish ``guest_port`` of the child's guest on ``host_port`` of every host
        address (0: pick a free port). Returns the host port."""
        if protocol not in ("tcp", "udp"):
            raise ValueError(f"protocol must be tcp or udp, not {protocol!r}")
        for name, port in (("guest_port", guest_port), ("host_port", host_port)):
            if not 0 <= port <= 65535 or (name == "guest_port" and port == 0):
                raise ValueError(f"{name} {port} is not a port number")
        if host_port == 0:
            host_port = _free_port(protocol)
        elif not self._on_host(_port_is_free, protocol, host_port):
            # The published port would hijack the connections of whoever listens there.
            raise NetworkError(f"host port {protocol}/{host_port} is in use on the host")
        with self._lock:
            taken = [c for c in self.children.values() if (protocol, host_port) in c.ports]
            if taken:
                raise NetworkError(f"host port {protocol}/{host_port} is already published "
                                   f"for {taken[0].netns}")
            child.ports[(protocol, host_port)] = guest_port
        try:
            self._on_host(_Nft.run, [{"add": {"element": self._port_element(
                protocol, host_port, child.address, guest_port)}}],
                f"publish {protocol}/{host_port}")
        except BaseException:
            with self._lock:
                child.ports.pop((protocol, host_port), None)
            raise
        return host_port

    def unexpose_port(self, child: ChildNetwork, host_port: int,
                      protocol: Proto = "tcp") -> None:
        with self._lock:
            guest_port = child.ports.pop((protocol, host_port), None)
        if guest_port is None:
            raise NetworkError(f"{protocol}/{host_port} is not published for {child.netns}")
        self._on_host(_Nft.run, [{"delete": {"element": self._port_element(
            protocol, host_port)}}], f"unpublish {protocol}/{host_port}")

    def _port_element(self, protocol: str, host_port: int, address: str | None = None,
                      guest_port: int | None = None) -> dict[str, Any]:
        key = {"concat": [protocol, host_port]}
        elem: Any = key if address is None else [key, {"concat": [address, guest_port]}]
        return {"family": "ip", "table": self.table, "name": "ports", "elem": [elem]}

    # -- re-adoption -------------------------------------------------------------------------
    def adopt(self, child: ChildNetwork) -> None:
        """Take over a child network a previous manager made (a daemon restarted while
        its sandbox ran): claim its slot and publish its ports again (``setup`` made the
        host table afresh). NetworkError if its namespace or host link is gone."""
        _validate_netns_name(child.netns)
        if child.netns != self._netns_name(child.slot):
            raise NetworkError(f"{child.netns} is not slot {child.slot} of prefix {self.prefix}")
        if not (NETNS_DIR / child.netns).exists():
            raise NetworkError(f"network namespace {child.netns} is gone")
        if not self._on_host(_link_exists, child.host_veth):
            raise NetworkError(f"host link {child.host_veth} of {child.netns} is gone")
        with self._lock:
            if child.slot in self._used:
                raise NetworkError(f"slot {child.slot} ({child.netns}) is already in use")
            self._used.add(child.slot)
            self.children[child.slot] = child
        ports = [self._port_element(p, h, child.address, g)
                 for (p, h), g in sorted(child.ports.items())]
        if ports:
            self._on_host(_Nft.run, [{"add": {"element": e}} for e in ports],
                          f"publish the ports of {child.netns} again")

    # -- teardown ----------------------------------------------------------------------------
    def destroy(self, child: ChildNetwork) -> None:
        """Remove everything of this child (call once its VMM process is gone, or the
        namespace is freed only when it exits). Idempotent."""
        self._on_host(self._teardown, child)

    def _teardown(self, child: ChildNetwork) -> None:
        with self._lock:
            ports = list(child.ports)
            child.ports.clear()
            self.children.pop(child.slot, None)
        if ports:
            try:
                _Nft.run([{"delete": {"element": self._port_element(p, h)}} for p, h in ports],
                         f"unpublish the ports of {child.netns}")
            except NetworkError as err:
                log.warning("%s", err)
        if child.egress.reach_host:
            self._set_host_access(child, EgressPolicy(child.egress.mode))
        with _iproute() as ipr:
            for index in ipr.link_lookup(ifname=child.host_veth):
                try:
                    ipr.link("del", index=index)
                except Exception as err:  # noqa: BLE001 -- the namespace going removes it too
                    log.warning("delete link %s: %s", child.host_veth, err)
        _remove_netns_mount(child.netns)
        self._release_slot(child.slot)

    def run_on_host(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread in this manager's host namespace."""
        return self._on_host(fn, *args)

    def close(self, destroy_children: bool = True) -> None:
        """Destroy every child network this manager made (unless not
        ``destroy_children``: a daemon leaving its sandboxes running for the next
        one, which adopts them); stop its workers."""
        with self._lock:
            self._closing = True  # spares not yet started give their slot back
        self.wait_for_pool()  # a spare half-built must not outlive us
        with self._lock:
            spares = list(self._spares)
            self._spares.clear()
        for child in spares:  # spares belong to no sandbox: always removed
            self.destroy(child)
        for child in list(self.children.values()) if destroy_children else []:
            self.destroy(child)
        self._pool.shutdown()
        os.close(self._host_ns)

    def remove_host_table(self) -> None:
        """Drop the host table (NAT, published ports). For a manager shutting down for good."""
        self._on_host(_Nft.run, [{"delete": {"table": {"family": "ip", "name": self.table}}},
                                 {"delete": {"table": {"family": "inet", "name": self.table}}}],
                      f"delete host tables ip/inet {self.table}")


def _make_persistent_tap(name: str) -> None:
    import fcntl
    import struct

    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(),
                                               IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
    except OSError as err:
        raise NetworkError(f"create tap {name}: {err.strerror}") from err
    finally:
        os.close(fd)


def _remove_netns_mount(name: str) -> None:
    path = NETNS_DIR / name
    MNT_DETACH = 2
    _libc.umount2(str(path).encode(), MNT_DETACH)  # not mounted (a failed create): fine
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _link_exists(name: str) -> bool:
    with _iproute() as ipr:
        return bool(ipr.link_lookup(ifname=name))


def _port_is_free(protocol: str, port: int) -> bool:
    kind = socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _free_port(protocol: str) -> int:
    kind = socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


# -- after a crash -------------------------------------------------------------------------------

@dataclass
class CleanupReport:
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.namespaces or self.links or self.tables)


def leftovers(prefix: str = DEFAULT_PREFIX) -> CleanupReport:
    """What exists with our names in this namespace: namespaces, host links, tables."""
    report = CleanupReport()
    ns_re = re.compile(rf"^{re.escape(prefix)}-\d+$")
    link_re = re.compile(rf"^{re.escape(prefix)}h\d+$")
    if NETNS_DIR.is_dir():
        report.namespaces = sorted(n for n in os.listdir(NETNS_DIR) if ns_re.match(n))
    with _iproute() as ipr:
        report.links = sorted(name for link in ipr.get_links()
                              if (name := link.get_attr("IFLA_IFNAME")) and link_re.match(name))
    listing = _Nft.run([{"list": {"tables": {"family": "ip"}}}], "list tables") or {}
    report.tables = [item["table"]["name"] for item in listing.get("nftables", [])
                     if "table" in item and item["table"]["name"] == prefix]
    return report


def cleanup_stale(prefix: str = DEFAULT_PREFIX,
                  keep: frozenset[str] = frozenset()) -> CleanupReport:
    """Remove every namespace, host link and host table with our ``prefix``.

    For the daemon at start-up, after a crash: call it before any child is made
    with this prefix (it removes live ones too). ``keep``: namespace names to
    spare with their host links (``<prefix>-<slot>`` keeps ``<prefix>h<slot>``), the
    networks of sandboxes a restarted daemon re-adopts (the host table goes
    regardless: ``setup`` makes it afresh, ``adopt`` publishes their ports again).
    Returns what it removed.
    """
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix {prefix!r} must be 1-6 lowercase letters")
    found = leftovers(prefix)
    kept_links = {name.replace("-", "h", 1) for name in keep}
    found.namespaces = [n for n in found.namespaces if n not in keep]
    found.links = [n for n in found.links if n not in kept_links]
    with _iproute() as ipr:
        for name in found.links:
            for index in ipr.link_lookup(ifname=name):
                ipr.link("del", index=index)
    for name in found.namespaces:
        _remove_netns_mount(name)
    for table in found.tables:
        _Nft.run([{"delete": {"table": {"family": "ip", "name": table}}}], f"delete {table}")
    guard = {"family": "inet", "name": prefix}   # the host guard, if a manager left one
    _Nft.run([{"add": {"table": guard}}, {"delete": {"table": guard}}], f"delete inet {prefix}")
    return found
