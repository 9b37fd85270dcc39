"""``vmfork serve``: wire the store, registry, zygote, controller and listeners.

Start-up order matters: the token and bind address are checked first (refusing
to start is cheaper than refusing requests), then the zygote is joined (the one a
previous daemon left running) or started, then the registry is reconciled with it
(running sandboxes re-adopted, vanished ones marked lost, half-written snapshots
failed), and only then do the sockets accept requests.

Shutdown runs in reverse: stop accepting, let go of the zygote, close the
registry. By default the sandboxes keep running: a daemon restarted within the
zygote's lease (``--zygote-lease``, default 60 s) re-adopts them, and if none
comes the zygote kills them. ``--kill-sandboxes-on-exit`` stops them with the daemon.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from vmfork import __version__
from vmfork.paths import private_dir
from vmfork.runtime.volumes import PreparedVolume, VolumeError, prepare_snapshot_volumes
from vmfork.server import auth
from vmfork.server.audit import AuditLog
from vmfork.server.controller import Controller, Limits
from vmfork.server.errors import (
    ApiError,
    BadGateway,
    BadRequest,
    Conflict,
    GatewayTimeout,
    NotFound,
    Unprocessable,
)
from vmfork.server.http import HttpFront, ServerContext, parse_bind
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.networking import SandboxNetworks
from vmfork.server.registry import Registry
from vmfork.server.requests import SnapshotCreate
from vmfork.server.spawner import DEFAULT_LEASE_S, Spawner, ZygoteSpawner
from vmfork.store import Snapshot, Store

log = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1:8889"
SOCKET_NAME = "api.sock"


def default_state_dir() -> Path:
    """``$VMFORK_STATE_DIR``, else ``$XDG_STATE_HOME/vmfork``, else ``~/.local/state/vmfork``
    (the SDK computes the same default socket path)."""
    override = os.environ.get("VMFORK_STATE_DIR")
    if override:
        return Path(os.path.abspath(override))
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return Path(os.path.abspath(base)) / "vmfork"


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: Path
    socket_path: Path | None          # None: no Unix socket
    bind: str | None                  # None: no TCP listener
    snapshot_root: Path | None = None  # None: the store's default ($VMFORK_HOME …)
    token_file: Path | None = None
    audit_log: Path | None = None     # default <state>/audit.log
    heavy_concurrency: int = 4
    branch_concurrency: int = 2
    spawner: bool = True              # False: API only (tests, hosts without KVM)
    zygote_lease_s: float = DEFAULT_LEASE_S
    kill_sandboxes_on_exit: bool = False
    # Per-sandbox networks (per_child_netns). The prefix names every namespace, host
    # link and nftables table of this daemon: two daemons on one host need two
    # prefixes (each removes whatever carries its own at start-up).
    networking: bool = True
    network_prefix: str = "vmf"
    network_subnet: str = "10.200.0.0/16"
    network_pool: int = 0             # spare networks kept ready (HostNetwork.pool_size)
    # Every VMM in a jail (runtime/jail.py). False only when asked for
    # (--insecure-no-jail): a daemon that cannot build one refuses to start.
    jail: bool = True
    max_sandboxes: int = 1000          # running sandboxes (429 beyond)
    max_guest_mib: int | None = None   # guest RAM committed to them; None: 4 x host RAM
    # TLS on the TCP listener (server/tls.py): both or neither.
    tls_cert: Path | None = None
    tls_key: Path | None = None


class JailUnavailable(RuntimeError):
    """The daemon would run sandboxes uncontained; it refuses to start."""


# How each kind of ParentFailed reaches the API: the request's fault 4xx, the user's
# warm-up 422 (the request was well-formed; what it ran failed), the host's 502/504.
_PARENT_ERRORS: dict[str, type[ApiError]] = {
    "invalid": BadRequest, "image_missing": NotFound, "image": BadRequest,
    "tag_exists": Conflict, "tag_busy": Conflict, "warm_up": Unprocessable,
    "boot": BadGateway, "network": BadGateway, "store": BadGateway, "crashed": BadGateway,
    "timeout": GatewayTimeout, "internal": BadGateway}


class ParentMaker:
    """The daemon's ``make_snapshot``: boots a parent with ``runtime.parent.boot_parent``
    (a process of its own), cabled to a namespace of the daemon's ``HostNetwork`` when
    the request asks for a network and the daemon has networks."""

    def __init__(self, log_dir: Path, *, jail: bool = True) -> None:
        self.log_dir = log_dir
        self.jail = jail   # the parent's VMM jailed as the sandboxes' (--insecure-no-jail)
        self.networks: SandboxNetworks | None = None  # set once the controller has them

    def __call__(self, store: Store, request: SnapshotCreate) -> Snapshot:
        from vmfork.image import ImageError, ImageMissing, find_image
        from vmfork.runtime.parent import ParentFailed, ParentRequest, boot_parent
        from vmfork.server.networking import egress_policy
        if request.kernel is not None:
            # forkd's body: the kernel and rootfs become an image of their own (checked,
            # copied into the cache by content) before anything boots.
            from vmfork.image.foreign import import_kernel_rootfs
            assert request.rootfs is not None   # the route refuses one without the other
            try:
                request = request.replace(image=import_kernel_rootfs(
                    request.kernel, request.rootfs).name)
            except ImageError as err:
                raise BadRequest(f"{err}") from err
        try:  # before a process is started for it: a missing image is the caller's 404
            find_image(request.image)
        except ImageMissing as err:
            raise NotFound(f"{err}") from err
        except ImageError as err:
            raise BadRequest(f"image {request.image[:80]!r}: {err}") from err
        egress = egress_policy(request.egress)
        network = bool(request.network)
        if egress is not None and not network:
            raise BadRequest("egress applies to the parent's network: add \"network\": true")
        prepared, free_slots = snapshot_volumes(request.volumes, request.volume_slots)
        req = ParentRequest(tag=request.tag, image=request.image, mem_mib=request.mem_mib,
                            vcpus=request.vcpus, warm_code=request.warm_code,
                            warm_cmd=request.warm_cmd, network=network,
                            store_root=str(store.root),
                            volumes=tuple(v.to_json() for v in prepared),
                            free_volume_slots=free_slots)
        host = self.networks.host if self.networks is not None else None
        if network and host is None and (egress is not None or request.warm_cmd is not None
                                         or request.warm_code is not None):
            log.warning("snapshot %s: this daemon has no host networks; the parent's NIC has "
                        "no cable, its warm-up cannot reach out", request.tag)
        try:
            boot_parent(req, host_network=host, egress=egress,
                        log_path=self.log_dir / f"parent-{request.tag}.log", jail=self.jail)
        except ParentFailed as err:
            raise _PARENT_ERRORS[err.kind](f"snapshot {request.tag!r} failed: "
                                           f"{err.message}") from err
        return store.get(request.tag)


def snapshot_volumes(items: Any, volume_slots: int | None
                     ) -> tuple[list[PreparedVolume], int]:
    """``runtime.volumes.snapshot_volumes`` for a request: 400 for what it refuses."""
    if items is not None and not isinstance(items, list):
        raise BadRequest("volumes must be a list of \"SRC:GUEST_PATH[:ro]\" strings or "
                         "{source, guest_path, mode} objects")
    try:
        return prepare_snapshot_volumes(items or [], volume_slots)
    except VolumeError as err:
        raise BadRequest(f"volumes: {err}") from err


def lock_state_dir(state_dir: Path) -> int:
    """Hold ``<state>/daemon.lock`` (flock) for the daemon's life; the fd, or OSError
    naming the daemon that holds it."""
    path = state_dir / "daemon.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise OSError(errno.EBUSY, f"another daemon ({holder}) uses the state directory "
                      f"{state_dir}; stop it, or give this one another --state") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    return fd


def _check_jail() -> None:
    """Refuse to start (``JailUnavailable``) when this host cannot jail a VMM: running
    guests of untrusted code uncontained must be a choice, never a fallback."""
    from vmfork.runtime import jail, seccomp

    problems = jail.problems()
    no_filter = seccomp.available()
    if no_filter is not None:
        problems.append(no_filter)
    if problems:
        raise JailUnavailable("cannot jail sandbox VMMs on this host: " + "; ".join(problems)
                              + ". Run the daemon as root on a kernel with seccomp and "
                              "mount namespaces (`vmfork doctor` says what is missing), or "
                              "start it with --insecure-no-jail (VMFORK_JAIL=0) to run "
                              "sandboxes uncontained")


def _tls_context(config: DaemonConfig) -> ssl.SSLContext | None:
    """The TCP listener's TLS context, checked before anything else starts."""
    if config.tls_cert is None and config.tls_key is None:
        return None
    from vmfork.server.tls import TlsConfigError, server_context
    if config.tls_cert is None or config.tls_key is None:
        raise TlsConfigError("--tls-cert and --tls-key go together: give both")
    if config.bind is None:
        raise TlsConfigError("--tls-cert/--tls-key secure the TCP listener: add --bind "
                             "HOST:PORT (the Unix socket is never TLS)")
    return server_context(config.tls_cert, config.tls_key)


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.token = auth.load_token(config.token_file) if config.token_file else None
        if config.bind is not None:
            auth.check_bind(parse_bind(config.bind)[0], self.token)
        if config.socket_path is None and config.bind is None:
            raise ValueError("nothing to listen on: give a Unix socket path or --bind")
        self.tls = _tls_context(config)
        if config.spawner and config.jail:
            _check_jail()
        # The registry, the zygote's socket and every sandbox's run directory live here:
        # a directory another user owns or can write would hand them our sandboxes.
        private_dir(config.state_dir, "give --state a directory of your own")
        # One daemon per state directory: a second one would reconcile the zygote's
        # children against a registry another daemon is still writing (and kill the
        # children of its spawns in flight as unknown).
        self._state_lock = lock_state_dir(config.state_dir)
        self.store = Store.open(config.snapshot_root)
        self.registry = Registry(config.state_dir / "registry.db")
        self.metrics = DaemonMetrics(__version__, config.branch_concurrency)
        self.audit = AuditLog(config.audit_log or config.state_dir / "audit.log")
        self.spawner: Spawner | None = None
        if config.spawner:
            self.spawner = ZygoteSpawner(config.state_dir, lease_s=config.zygote_lease_s,
                                         log_path=config.state_dir / "zygote.log",
                                         jail=config.jail)
        maker = ParentMaker(config.state_dir, jail=config.jail)
        self.controller = Controller(self.store, self.registry, self.spawner, self.metrics,
                                     make_snapshot=maker,
                                     limits=Limits(heavy_concurrency=config.heavy_concurrency,
                                                   branch_concurrency=config.branch_concurrency,
                                                   max_sandboxes=config.max_sandboxes,
                                                   max_guest_mib=config.max_guest_mib),
                                     networks=self._host_networks())
        self.controller.start()
        maker.networks = self.controller.networks  # None if they failed to start
        self.front = HttpFront(ServerContext(self.controller, self.token, self.audit))
        try:
            if config.socket_path is not None:
                self.front.listen_unix(config.socket_path)
            if config.bind is not None:
                self.front.listen_tcp(config.bind, tls=self.tls)
        except BaseException:
            self.front.stop()
            raise
        self._stopped = threading.Event()

    def _host_networks(self) -> SandboxNetworks | None:
        """The manager of per-sandbox networks, or None (and per_child_netns is refused
        with the reason) when networking is off or this host cannot do it."""
        if not self.config.networking or not self.config.spawner:
            return None
        from vmfork.runtime.network import HostNetwork
        from vmfork.runtime.parent import guest_network
        from vmfork.server.networking import SandboxNetworks
        try:
            host = HostNetwork(guest_network(), subnet=self.config.network_subnet,
                               prefix=self.config.network_prefix,
                               pool_size=self.config.network_pool)
        except ValueError:
            raise  # a bad --network-prefix/--network-subnet/--netns-pool: refuse to start
        except Exception as err:  # noqa: BLE001 - no root, no pyroute2: run without
            log.warning("sandboxes get no networks of their own (per_child_netns is "
                        "refused): %s", err)
            return None
        return SandboxNetworks(self.registry, host)

    def addresses(self) -> list[str]:
        return self.front.addresses()

    def start(self) -> None:
        self.front.start()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.front.stop()
        self.controller.stop(kill_sandboxes=self.config.kill_sandboxes_on_exit)
        self.registry.close()
        self.audit.close()
        os.close(self._state_lock)

    def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT; SIGHUP reopens the audit log."""
        done = threading.Event()

        def on_stop(signum: int, frame: FrameType | None) -> None:
            done.set()

        def on_hup(signum: int, frame: FrameType | None) -> None:
            self.audit.request_reopen()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)
        self.start()
        try:
            while not done.wait(1.0):
                pass
        finally:
            self.stop()
