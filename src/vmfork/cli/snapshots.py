"""Snapshot verbs: ``snapshot`` (boot, warm, capture; or BRANCH a sandbox), ``fork``
(spawn children and report timings), ``images``, ``rmi``, ``snapshot-info``,
``snapshot-diff``, ``snapshot-compact``, ``pack``, ``unpack``, ``verify``.

They go through the daemon when one answers, so its registry sees every change.
The store-only verbs (``snapshot``, ``images``, ``rmi``, ``snapshot-info``,
``snapshot-compact``) also work without a daemon, and ``pack``, ``unpack`` and
``verify`` always work directly on the local store (safe next to a running daemon:
the store locks each tag and each parent/child link); ``fork`` and
``snapshot-diff`` start an embedded daemon for the duration of the command when
none runs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vmfork.cli import VOLUME_HELP, CliError, volume_args
from vmfork.cli.daemon_client import (
    add_daemon_options,
    add_json_option,
    call,
    controller,
    daemon_answers,
    print_json,
    print_table,
    progress,
    when,
)
from vmfork.cli.sandboxes import EGRESS_HELP, _egress, add_branch_options, branch
from vmfork.client.errors import ControllerError

if TYPE_CHECKING:
    from vmfork.client.controller import Controller


def register(sub: Any) -> None:
    p = sub.add_parser("snapshot", help="boot the image, warm it up, snapshot it as TAG; or "
                                        "BRANCH a running sandbox (--from-sandbox ID)")
    p.add_argument("--tag", default=None, help="name of the snapshot ([A-Za-z0-9_-]{1,64})")
    p.add_argument("--image", default="default", help="guest image (default: default)")
    p.add_argument("--mem-mib", type=int, default=256, help="guest memory in MiB (default 256)")
    p.add_argument("--vcpus", type=int, default=1, help="vCPUs (default 1)")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--warm", metavar="CODE",
                      help="Python run in the guest's warm interpreter, e.g. 'import json'")
    warm.add_argument("--warm-cmd", metavar="CMD", help="shell command run in the guest first")
    p.add_argument("--network", action="store_true",
                   help="boot the parent with a real network (a namespace of its own, NAT "
                        "out), so the warm-up can download and its sandboxes can be spawned "
                        "with --per-child-netns")
    p.add_argument("--egress", default=None, metavar="POLICY",
                   help="the parent's egress policy with --network: " + EGRESS_HELP)
    p.add_argument("--volume", action="append", metavar="SRC:GUEST_PATH[:ro]",
                   help=VOLUME_HELP + "; a snapshot's volumes are read-only, mounted before "
                        "the warm-up and in every child")
    p.add_argument("--volume-slots", type=int, default=None, metavar="N",
                   help="empty volume slots to reserve for volumes given at spawn (default "
                        "4; volumes + slots <= 24)")
    p.add_argument("--local", action="store_true",
                   help="boot the parent in this process, not through the daemon (the "
                        "daemon itself uses this)")
    p.add_argument("--from-sandbox", default=None, metavar="ID",
                   help="snapshot this running sandbox instead of booting (BRANCH)")
    add_json_option(p)
    add_branch_options(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("fork", help="spawn N children of snapshot TAG and report timings "
                                    "(through the daemon; an embedded one if none runs)")
    p.add_argument("--tag", required=True, help="snapshot to fork")
    p.add_argument("-n", type=int, default=1, help="number of children (1..1000)")
    p.add_argument("--memory-limit-mib", type=int, default=None,
                   help="per-child memory limit (cgroup v2 memory.max or v1 limit_in_bytes)")
    p.add_argument("--exec", dest="exec_cmd", metavar="CMD",
                   help="run this shell command in every child and print each result")
    keep = p.add_mutually_exclusive_group()
    keep.add_argument("--hold", action="store_true",
                      help="keep the children running until Ctrl-C, then kill them")
    keep.add_argument("--keep", action="store_true",
                      help="leave the children running in the daemon (see `vmfork ls`)")
    add_daemon_options(p)
    p.set_defaults(func=cmd_fork)

    p = sub.add_parser("images", help="list snapshots")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_images)

    p = sub.add_parser("rmi", help="delete snapshots")
    p.add_argument("tags", nargs="+", metavar="TAG")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--cascade", action="store_true",
                     help="also delete the snapshots built on it (its whole subtree)")
    how.add_argument("--force", action="store_true",
                     help="delete it even if other snapshots are built on it; they become "
                          "standalone snapshots (their memory is kept, they stay spawnable)")
    add_daemon_options(p)
    p.set_defaults(func=cmd_rmi)

    p = sub.add_parser("snapshot-info", help="details of one snapshot")
    p.add_argument("tag", metavar="TAG")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_snapshot_info)

    p = sub.add_parser("snapshot-diff", help="spawn from TAG, run a command, and keep what it "
                                             "changed as a diff snapshot NEW on top of TAG")
    p.add_argument("--from", dest="source", required=True, metavar="TAG",
                   help="the snapshot to build on (flat or a chain head)")
    p.add_argument("--tag", required=True, metavar="NEW", help="name of the new snapshot")
    p.add_argument("--exec", dest="exec_cmd", required=True, metavar="CMD",
                   help="shell command run in the sandbox; its output is streamed, and a "
                        "non-zero exit fails the build (nothing is kept)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="kill the command after this long (default 600)")
    p.add_argument("--network", action="store_true",
                   help="give the build sandbox a network of its own (the snapshot must have "
                        "been made with --network), e.g. for pip install")
    p.add_argument("--egress", default=None, metavar="POLICY",
                   help="the build sandbox's egress policy with --network: " + EGRESS_HELP)
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_snapshot_diff)

    p = sub.add_parser("snapshot-compact", help="publish a chain as one flat snapshot")
    p.add_argument("--from", dest="source", required=True, metavar="TAG",
                   help="the snapshot (a chain head at any depth) to compact")
    p.add_argument("--to", required=True, metavar="NEW", help="tag of the flat snapshot")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_snapshot_compact)

    p = sub.add_parser("pack", help="write a snapshot's whole chain (and its guest image) to "
                                    "one .tar.zst")
    p.add_argument("--tag", required=True, metavar="TAG", help="the snapshot (a chain head)")
    p.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                   help="the pack to write (default TAG.tar.zst here)")
    p.add_argument("--no-image", action="store_true",
                   help="leave the guest image out (snapshots spawn without it; a host needs "
                        "it only to boot new parents)")
    add_json_option(p)
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("unpack", help="restore a pack into the store, verifying every hash "
                                      "first")
    p.add_argument("file", type=Path, metavar="FILE")
    p.add_argument("--tag", default=None, metavar="NEW", help="store the head under this tag")
    p.add_argument("--force", action="store_true",
                   help="replace snapshots that hold other content under the pack's tags")
    add_json_option(p)
    p.set_defaults(func=cmd_unpack)

    p = sub.add_parser("verify", help="re-hash snapshot files and compare with the hashes "
                                      "recorded when they entered the store")
    p.add_argument("tag", nargs="?", metavar="TAG", help="one snapshot (default: all)")
    add_json_option(p)
    p.set_defaults(func=cmd_verify)


def _store() -> Any:
    from vmfork.store import Store
    return Store.open()


def _daemon_or_none(args: argparse.Namespace, timeout: float = 60) -> Controller | None:
    """The daemon if one answers; None if there is none at the default address. A daemon
    named explicitly (--url, VMFORK_URL) must answer."""
    ctl = controller(args, timeout)
    if daemon_answers(ctl):
        return ctl
    if args.url is not None:
        raise CliError(f"no daemon at {ctl.base_url}; start one with `vmfork serve` or drop "
                       "--url to use the local store", 1)
    return None


def cmd_snapshot(args: argparse.Namespace) -> int:
    if args.from_sandbox is not None:
        return branch(args, args.from_sandbox, args.tag)
    if args.tag is None:
        raise CliError("--tag is required: the name of the new snapshot")
    if args.egress is not None and not args.network:
        raise CliError("--egress is the parent's policy on its network: add --network")
    _egress(args.egress)
    volumes = volume_args(args.volume)
    ctl = None if args.local else _daemon_or_none(args, timeout=3600)
    if ctl is None:
        return _snapshot_here(args, volumes)
    with progress(f"booting and snapshotting {args.tag}"):
        info = call(ctl, lambda: ctl.create_snapshot(
            args.tag, image=args.image, mem_mib=args.mem_mib, vcpus=args.vcpus,
            warm_code=args.warm, warm_cmd=args.warm_cmd, network=args.network,
            egress=args.egress, timeout=3600, volumes=volumes,
            volume_slots=args.volume_slots))
    if args.json:
        print_json(info)
    else:
        print(f"snapshot {info['tag']}: ready ({args.mem_mib} MiB guest), paused "
              f"{info.get('pause_ms', 0):.1f} ms")
        print(f"  {info['dir']}")
    return 0


def _snapshot_here(args: argparse.Namespace, volumes: list[str]) -> int:
    from vmfork.image import ImageError, find_image
    from vmfork.runtime.parent import ParentFailed, ParentRequest, boot_parent
    from vmfork.runtime.volumes import VolumeError, prepare_snapshot_volumes

    try:
        find_image(args.image)
    except ImageError as err:
        raise CliError(str(err), 1) from err
    try:   # the daemon's checks, so that both paths refuse the same requests
        prepared, free_slots = prepare_snapshot_volumes(volumes, args.volume_slots)
    except VolumeError as err:
        raise CliError(f"--volume: {err}") from err
    store = _store()
    req = ParentRequest(tag=args.tag, image=args.image, mem_mib=args.mem_mib, vcpus=args.vcpus,
                        warm_code=args.warm, warm_cmd=args.warm_cmd, network=args.network,
                        store_root=str(store.root),
                        volumes=tuple(v.to_json() for v in prepared),
                        free_volume_slots=free_slots)
    try:
        with _local_host_network(args.network) as host:
            egress = _local_egress(args.egress)
            with progress(f"booting and snapshotting {args.tag}"):
                result = boot_parent(req, host_network=host, egress=egress)
    except ParentFailed as err:
        raise CliError(err.message, 1) from err
    report = store.get(result.tag)
    print(f"snapshot {report.tag}: {result.memory_bytes / (1 << 20):.1f} MiB of guest "
          f"memory written ({args.mem_mib} MiB logical)")
    print(f"  boot {result.boot_s:.2f} s, warm-up {result.warm_s:.2f} s, paused "
          f"{result.pause_ms:.1f} ms (state {result.capture_ms:.1f} ms, memory "
          f"{result.memory_write_ms:.1f} ms)")
    print(f"  {report.path}")
    return 0


def _local_egress(policy: str | None) -> Any:
    from vmfork.client.controller import egress_policy
    from vmfork.runtime.network import EgressPolicy
    if policy is None:
        return None
    spec = egress_policy(policy)
    try:
        return EgressPolicy(spec["mode"], tuple(spec.get("cidrs", ())),
                            tuple(spec.get("domains", ())))
    except ValueError as err:
        raise CliError(f"--egress: {err}") from err


# The CLI's own networks (no daemon): a prefix and subnet of their own, so they never
# meet a daemon's (whose start-up removes whatever carries its prefix).
LOCAL_NETWORK_PREFIX = "vmfl"
LOCAL_NETWORK_SUBNET = "10.201.0.0/24"


@contextmanager
def _local_host_network(wanted: bool) -> Iterator[Any]:
    """A ``HostNetwork`` for a parent booted without a daemon, or None. Local builds take
    one lock, so two of them never claim the same namespace; whatever carries the
    prefix when the lock is taken is a killed build's leftover and is removed first."""
    if not wanted:
        yield None
        return
    import fcntl
    import os

    from vmfork.paths import run_dir
    from vmfork.runtime.network import HostNetwork, NetworkError, cleanup_stale
    from vmfork.runtime.parent import guest_network
    if os.geteuid() != 0:
        raise CliError("--network needs root (network namespaces, nftables), or a daemon "
                       "run as root (`vmfork serve`)", 1)
    base = run_dir()
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(base / "local-network.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cleanup_stale(LOCAL_NETWORK_PREFIX)
            host = HostNetwork(guest_network(), prefix=LOCAL_NETWORK_PREFIX,
                               subnet=LOCAL_NETWORK_SUBNET, workers=1)
            host.setup()
        except (NetworkError, OSError) as err:
            raise CliError(f"cannot make the parent's network: {err}", 1) from err
        try:
            yield host
        finally:
            # The table first: removing it needs the worker pool close() shuts down.
            host.remove_host_table()
            host.close()
    finally:
        os.close(lock)


@contextmanager
def embedded_daemon() -> Iterator[Controller]:
    """A daemon in this process, on a private state directory, for one command: its
    sandboxes die with it (and, should this process be killed, with the zygote's
    short lease)."""
    from vmfork.client.controller import Controller
    from vmfork.paths import run_dir
    from vmfork.runtime.spawn import jail_by_default
    from vmfork.server.daemon import Daemon, DaemonConfig

    base = run_dir()
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    state = Path(tempfile.mkdtemp(prefix="fork-", dir=base))
    try:
        daemon = Daemon(DaemonConfig(state_dir=state, socket_path=state / "api.sock",
                                     bind=None, kill_sandboxes_on_exit=True,
                                     zygote_lease_s=10.0, jail=jail_by_default()))
    except Exception as err:
        shutil.rmtree(state, ignore_errors=True)
        raise CliError(f"cannot start an embedded daemon: {err}", 1) from err
    daemon.start()
    try:
        yield Controller(f"unix://{state / 'api.sock'}", timeout=600)
    finally:
        daemon.stop()
        shutil.rmtree(state, ignore_errors=True)


def _exec_in(ctl: Controller, sandbox_id: str, command: str) -> dict[str, Any]:
    return call(ctl, lambda: ctl.exec_command(sandbox_id, ["/bin/sh", "-c", command]))


def cmd_fork(args: argparse.Namespace) -> int:
    if not 1 <= args.n <= 1000:
        raise CliError(f"-n must be 1..1000, not {args.n}")
    shared = _daemon_or_none(args, timeout=600)
    if shared is None and args.keep:
        raise CliError("--keep leaves the children in a running daemon, and none answers; "
                       "start one with `vmfork serve`")
    if shared is None:
        print("vmfork: no daemon running; using an embedded one for this command",
              file=sys.stderr)
    with nullcontext(shared) if shared is not None else embedded_daemon() as ctl:
        assert ctl is not None
        with progress(f"forking {args.n} children of {args.tag}"):
            infos = call(ctl, lambda: ctl.spawn_sandboxes(
                args.tag, args.n, memory_limit_mib=args.memory_limit_mib))
        t = infos[0].get("timings", {})
        print(f"forked {len(infos)} children of {args.tag}: all forked in "
              f"{t.get('spawn_ms', 0):.0f} ms, restored in {t.get('restored_ms', 0):.0f} ms, "
              f"agents answered in {t.get('ready_ms', 0):.0f} ms")
        try:
            if args.exec_cmd:
                for info in infos:
                    started = time.monotonic()
                    r = _exec_in(ctl, info["id"], args.exec_cmd)
                    print(f"  {info['id']} (pid {info['pid']}) exit {r['exit_code']} in "
                          f"{(time.monotonic() - started) * 1000:.0f} ms: "
                          f"{r['stdout'].strip()}")
            if args.keep:
                for info in infos:
                    print(info["id"])
                return 0
            if args.hold:
                print(f"children running (reach them at {ctl.base_url}: VMFORK_URL="
                      f"{ctl.base_url} vmfork ls); Ctrl-C to stop them", file=sys.stderr)
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
        finally:
            if not args.keep:
                for info in infos:
                    try:
                        ctl.kill_sandbox(info["id"])
                    except ControllerError as err:
                        if err.status != 404:
                            print(f"vmfork: cannot kill {info['id']}: {err.message}",
                                  file=sys.stderr)
    return 0


def _local_snapshot_info(snap: Any) -> dict[str, Any]:
    """A ready snapshot of the local store, in the daemon's ``SnapshotInfo`` shape."""
    meta = snap.meta
    info: dict[str, Any] = {
        "tag": snap.tag, "dir": str(snap.path), "created_at_unix": int(meta.created_at_unix),
        "status": "ready", "bootable": True, "image": meta.image, "mem_mib": meta.mem_mib,
        "vcpus": meta.vcpus, "warm_up": meta.warm_up}
    if meta.extra.get("branched_from") or meta.parent_tag:
        info["branched_from"] = meta.extra.get("branched_from") or meta.parent_tag
    if meta.timings.pause_ms is not None:
        info["pause_ms"] = round(meta.timings.pause_ms, 3)
    return info


def cmd_images(args: argparse.Namespace) -> int:
    ctl = _daemon_or_none(args)
    if ctl is not None:
        snapshots = call(ctl, ctl.list_snapshots)
    else:
        store = _store()
        snapshots = [_local_snapshot_info(s) for s in store.list()]
        for problem in store.list_corrupt():
            print(f"damaged: {problem}", file=sys.stderr)
    if args.json:
        print_json(snapshots)
        return 0
    rows = []
    for s in snapshots:
        origin = s.get("warm_up") or ""
        if s.get("branched_from"):
            origin = f"branch of {s['branched_from']}"
        if s.get("error"):
            origin = s["error"]
        rows.append([s["tag"], s["status"], f"{s['mem_mib']}Mi" if "mem_mib" in s else "-",
                     str(s.get("vcpus", "-")), when(s.get("created_at_unix")), origin])
    print_table(["TAG", "STATUS", "MEM", "VCPUS", "CREATED", "ORIGIN"], rows)
    return 0


def cmd_rmi(args: argparse.Namespace) -> int:
    from vmfork.store import StoreError
    ctl = _daemon_or_none(args)
    store = None if ctl is not None else _store()
    status = 0
    for tag in args.tags:
        try:
            if ctl is not None:
                ctl.delete_snapshot(tag, cascade=args.cascade, force=args.force)
                print(f"deleted {tag}")
            elif store is not None:
                for gone in store.delete(tag, cascade=args.cascade, force=args.force):
                    print(f"deleted {gone}")
        except ControllerError as err:
            print(f"vmfork: {tag}: {err.message}", file=sys.stderr)
            status = 1
        except StoreError as err:
            print(f"vmfork: {err}", file=sys.stderr)
            status = 1
    return status


def cmd_snapshot_info(args: argparse.Namespace) -> int:
    from vmfork.store import StoreError, chains
    ctl = _daemon_or_none(args)
    if ctl is not None:
        info = call(ctl, lambda: ctl.snapshot_info(args.tag))
    else:
        try:
            info = chains.snapshot_info(_store(), args.tag)
        except StoreError as err:
            raise CliError(str(err), 1) from err
    if args.json:
        print_json(info)
        return 0
    for key in ("tag", "status", "dir", "image", "mem_mib", "vcpus", "warm_up",
                "content_hash", "parent_tag", "parent_content_hash", "chain_depth",
                "ancestors", "dependents", "descendants", "orphaned_from",
                "memory_logical_bytes", "memory_physical_bytes", "vmstate_bytes",
                "layer_bytes", "changed_bytes", "logical_bytes", "physical_bytes",
                "unique_bytes", "memory_mapping"):
        if key in info:
            value = info[key]
            if isinstance(value, list):
                value = ", ".join(value) or "-"
            elif key == "memory_mapping" and isinstance(value, dict):
                value = (f"{value.get('kind')}" + (f", {value['runs']} runs over "
                                                   f"{value['files']} files"
                                                   if "runs" in value else "")
                         + (f" ({value['materialised']})" if value.get("materialised") else ""))
            print(f"{key + ':':24} {value if value is not None else '-'}")
    print(f"{'created:':24} {when(info.get('created_at_unix'))}")
    return 0


def _build_egress_hint(policy: str | None) -> str:
    """What the build sandbox's egress policy refuses, for a command that failed."""
    from vmfork.runtime.parent import egress_hint
    local = _local_egress(policy)
    return "" if local is None or local.mode == "allow" else f"; {egress_hint(local)}"


def cmd_snapshot_diff(args: argparse.Namespace) -> int:
    from vmfork.store import StoreError, validate_tag
    from vmfork.store.store import MAX_CHAIN_DEPTH, ChainTooDeep
    if args.egress is not None and not args.network:
        raise CliError("--egress is the build sandbox's policy on its network: add --network")
    _egress(args.egress)
    try:
        validate_tag(args.source)
        validate_tag(args.tag)
    except StoreError as err:
        raise CliError(str(err)) from err
    shared = _daemon_or_none(args, timeout=3600)
    with nullcontext(shared) if shared is not None else embedded_daemon() as ctl:
        assert ctl is not None
        depth = call(ctl, lambda: ctl.snapshot_info(args.source))["chain_depth"]
        if depth >= MAX_CHAIN_DEPTH:
            raise CliError(str(ChainTooDeep(args.source, depth)), 1)
        try:
            ctl.snapshot_info(args.tag)
        except ControllerError as err:
            if err.status != 404:
                raise CliError(f"{args.tag}: {err.message}", 1) from err
        else:
            raise CliError(f"snapshot tag {args.tag!r} already exists; choose another tag or "
                           f"delete it first with `vmfork rmi {args.tag}`", 1)
        with progress(f"spawning a sandbox of {args.source}"
                      + (" with a network" if args.network else "")):
            sandbox = call(ctl, lambda: ctl.spawn_sandboxes(
                args.source, 1, per_child_netns=args.network,
                egress=args.egress))[0]["id"]
        try:
            code = _stream_command(ctl, sandbox, args.exec_cmd, args.timeout)
            if code != 0:
                hint = _build_egress_hint(args.egress) if args.network else (
                    "; the sandbox has no network: add --network if it downloads")
                raise CliError(f"the command exited with status {code}; nothing was built "
                               f"(fix the command and run snapshot-diff again){hint}", 1)
            with progress(f"taking the diff {args.tag} of {args.source}"):
                info = call(ctl, lambda: ctl.branch_sandbox(
                    sandbox, tag=args.tag, mode="diff", parent_tag=args.source,
                    settle_free_pages=True))
        finally:
            try:
                ctl.kill_sandbox(sandbox)
            except ControllerError as err:
                if err.status != 404:
                    print(f"vmfork: cannot kill sandbox {sandbox}: {err.message}",
                          file=sys.stderr)
    if args.json:
        print_json(info)
    else:
        print(f"snapshot {info['tag']}: diff on {args.source} (chain depth {depth + 1}), "
              f"paused {info.get('pause_ms', 0):.1f} ms")
    return 0


def _stream_command(ctl: Controller, sandbox: str, command: str, timeout: float) -> int:
    """Run ``command`` in the sandbox, copying its output here as it comes; its status
    (128+N for a signal, 124 for the timeout)."""
    try:
        for event, data in ctl.exec_stream(sandbox, ["/bin/sh", "-c", command], timeout):
            if event in ("stdout", "stderr"):
                stream = sys.stdout if event == "stdout" else sys.stderr
                stream.write(data["data"])
                stream.flush()
            elif event == "exit":
                code = int(data["exit_code"])
                return code if code >= 0 else 128 - code
            elif event == "error":
                if data.get("timed_out"):
                    print(f"vmfork: the command timed out after {timeout} s and was killed "
                          "(raise --timeout to allow longer)", file=sys.stderr)
                    return 124
                raise CliError(f"the command failed in the sandbox: {data.get('error')}", 1)
    except ControllerError as err:
        raise CliError(f"running the command failed: {err.message}", 1) from err
    raise CliError("the command's output stream ended without a result (did the daemon "
                   "stop?)", 1)


def cmd_snapshot_compact(args: argparse.Namespace) -> int:
    from vmfork.store import StoreError, chains
    ctl = _daemon_or_none(args, timeout=3600)
    if ctl is not None:
        with progress(f"compacting {args.source} into {args.to}"):
            info = call(ctl, lambda: ctl.compact_snapshot(args.source, args.to))
    else:
        try:
            store = _store()
            info = chains.snapshot_info(store, chains.compact(store, args.source, args.to).tag)
        except (StoreError, OSError) as err:
            raise CliError(str(err), 1) from err
    if args.json:
        print_json(info)
    else:
        print(f"snapshot {info['tag']}: flat copy of {args.source} (chain depth 0)")
        print(f"  {info['dir']}")
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from vmfork.store import StoreError, packs
    out = args.output if args.output is not None else Path(f"{args.tag}.tar.zst")
    started = time.monotonic()
    try:
        with progress(f"packing {args.tag}"):
            report = packs.pack(_store(), args.tag, out, with_image=not args.no_image)
    except (StoreError, OSError) as err:
        raise CliError(str(err), 1) from err
    if args.json:
        print_json({"path": str(report.path), "tags": report.tags, "bytes": report.bytes,
                    "image": report.image, "seconds": time.monotonic() - started})
    else:
        print(f"packed {' <- '.join(report.tags)} into {report.path} "
              f"({report.bytes / (1 << 20):.1f} MiB, image {report.image or 'not included'})")
    return 0


def cmd_unpack(args: argparse.Namespace) -> int:
    from vmfork.store import StoreError, packs
    started = time.monotonic()
    try:
        with progress(f"unpacking {args.file}"):
            report = packs.unpack(_store(), args.file, head_tag=args.tag, force=args.force)
    except (StoreError, OSError) as err:
        raise CliError(str(err), 1) from err
    if args.json:
        print_json({"tags": report.tags, "stored": report.stored, "present": report.present,
                    "image": report.image, "image_note": report.image_note,
                    "seconds": time.monotonic() - started})
        return 0
    print(f"unpacked {' <- '.join(report.tags)}: stored {', '.join(report.stored) or 'none'}"
          f"; already present {', '.join(report.present) or 'none'}")
    if report.image_note:
        print(f"  image: {report.image_note}")
    elif report.image:
        print(f"  image: {report.image}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from vmfork.store import StoreError, chains
    try:
        checks = chains.verify(_store(), args.tag)
    except StoreError as err:
        raise CliError(str(err), 1) from err
    bad = [c for c in checks if c.status in ("mismatch", "missing")]
    if args.json:
        print_json([{"tag": c.tag, "file": c.name, "status": c.status, "detail": c.detail}
                    for c in checks])
    else:
        print_table(["TAG", "FILE", "STATUS", "DETAIL"],
                    [[c.tag, c.name, c.status, c.detail] for c in checks])
    if bad:
        print(f"vmfork: {len(bad)} file(s) do not match the hashes recorded when they entered "
              "the store; delete the snapshots named above (`vmfork rmi TAG`) and rebuild or "
              "unpack them again", file=sys.stderr)
        return 1
    return 0
