"""Snapshot verbs: ``snapshot`` (boot, warm, capture), ``fork`` (spawn children),
``images`` (list snapshots) and ``rmi`` (delete them)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vmfork.cli import CliError


def register(sub: Any) -> None:
    p = sub.add_parser("snapshot", help="boot the image, warm it up, snapshot it as TAG")
    p.add_argument("--tag", required=True, help="name of the snapshot ([A-Za-z0-9_-]{1,64})")
    p.add_argument("--image", default="default", help="guest image (default: default)")
    p.add_argument("--mem-mib", type=int, default=256, help="guest memory in MiB (default 256)")
    p.add_argument("--vcpus", type=int, default=1, help="vCPUs (default 1)")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--warm", metavar="CODE",
                      help="Python run in the guest's warm interpreter, e.g. 'import json'")
    warm.add_argument("--warm-cmd", metavar="CMD", help="shell command run in the guest first")
    p.add_argument("--local", action="store_true",
                   help="boot the parent in this process, not through the daemon (the "
                        "daemon itself uses this)")
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("fork", help="spawn N children of snapshot TAG and report timings")
    p.add_argument("--tag", required=True, help="snapshot to fork")
    p.add_argument("-n", type=int, default=1, help="number of children (1..1000)")
    p.add_argument("--memory-limit-mib", type=int, default=None,
                   help="per-child memory limit (cgroup v2 memory.max or v1 limit_in_bytes)")
    p.add_argument("--exec", dest="exec_cmd", metavar="CMD",
                   help="run this shell command in every child and print each result")
    p.add_argument("--hold", action="store_true",
                   help="keep the children running until Ctrl-C (default: tear down)")
    p.set_defaults(func=cmd_fork)

    p = sub.add_parser("images", help="list snapshots")
    p.set_defaults(func=cmd_images)

    p = sub.add_parser("rmi", help="delete snapshots")
    p.add_argument("tags", nargs="+", metavar="TAG")
    p.set_defaults(func=cmd_rmi)


def _store() -> Any:
    from vmfork.store import Store
    return Store.open()


def cmd_snapshot(args: argparse.Namespace) -> int:
    from vmfork.image import ImageError, find_image
    from vmfork.runtime.guest import GuestBootError
    from vmfork.runtime.parent import WarmUpFailed, snapshot_parent
    from vmfork.store import StoreError

    try:
        image = find_image(args.image)
        report = snapshot_parent(_store(), args.tag, image, mem_mib=args.mem_mib,
                                 vcpus=args.vcpus, warm_code=args.warm, warm_cmd=args.warm_cmd)
    except (ImageError, StoreError, WarmUpFailed, GuestBootError, ValueError) as err:
        raise CliError(str(err), 1) from err
    print(f"snapshot {report.snapshot.tag}: {report.memory_bytes / (1 << 20):.1f} MiB of guest "
          f"memory written ({args.mem_mib} MiB logical)")
    print(f"  boot {report.boot_s:.2f} s, warm-up {report.warm_s:.2f} s, paused "
          f"{report.pause_ms:.1f} ms (state {report.capture_ms:.1f} ms, memory "
          f"{report.memory_write_ms:.1f} ms)")
    print(f"  {report.snapshot.path}")
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    from vmfork.paths import run_dir
    from vmfork.runtime.spawn import SpawnFailed, fork_children
    from vmfork.runtime.zygote_client import start_zygote
    from vmfork.store import StoreError

    try:
        snapshot = _store().get(args.tag)
    except StoreError as err:
        raise CliError(str(err), 1) from err
    if not 1 <= args.n <= 1000:
        raise CliError(f"-n must be 1..1000, not {args.n}")
    base = run_dir()
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    session = Path(tempfile.mkdtemp(prefix="fork-", dir=base))
    zygote = start_zygote(str(session / "zygote.sock"))
    try:
        client = zygote.client()

        def progress(restored: int, ready: int, failed: int) -> None:
            print(f"\r  restored {restored}/{args.n}, ready {ready}/{args.n}"
                  + (f", failed {failed}" if failed else ""), end="", file=sys.stderr,
                  flush=True)

        try:
            report = fork_children(client, snapshot, args.n, session / "vms",
                                   memory_limit_mib=args.memory_limit_mib, progress=progress)
        except SpawnFailed as err:
            raise CliError(str(err), 1) from err
        print(file=sys.stderr)
        print(f"forked {len(report.children)} children of {snapshot.tag}: all forked in "
              f"{report.spawn_s * 1000:.0f} ms, restored in {report.restored_s * 1000:.0f} ms, "
              f"agents answered in {report.ready_s * 1000:.0f} ms")
        for vm_id, reason in report.failed:
            print(f"  {vm_id} failed: {reason}", file=sys.stderr)
        if args.exec_cmd:
            for child in report.children:
                started = time.monotonic()
                result = child.agent.exec(args.exec_cmd)
                out = result.stdout.decode(errors="replace").strip()
                print(f"  {child.vm_id} (pid {child.pid}) exit {result.exit_code} in "
                      f"{(time.monotonic() - started) * 1000:.0f} ms: {out}")
        if args.hold:
            print("children running; Ctrl-C to stop them", file=sys.stderr)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 1 if report.failed else 0
    finally:
        zygote.close()
        try:
            os.rmdir(session / "vms")
        except OSError:
            pass
        for leftover in ("zygote.sock",):
            try:
                os.unlink(session / leftover)
            except OSError:
                pass
        try:
            os.rmdir(session)
        except OSError:
            pass


def cmd_images(args: argparse.Namespace) -> int:
    from vmfork.store import disk_usage
    store = _store()
    snapshots = store.list()
    print(f"{'TAG':24} {'MEM':>7} {'DISK':>9} {'VCPUS':>5}  CREATED              WARM-UP")
    for snap in snapshots:
        usage = disk_usage(snap)
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap.meta.created_at_unix))
        print(f"{snap.tag:24} {snap.meta.mem_mib:>5}Mi {usage.physical_bytes / (1 << 20):>7.1f}Mi "
              f"{snap.meta.vcpus:>5}  {created}  {snap.meta.warm_up or ''}")
    for problem in store.list_corrupt():
        print(f"damaged: {problem}", file=sys.stderr)
    return 0


def cmd_rmi(args: argparse.Namespace) -> int:
    from vmfork.store import StoreError
    store = _store()
    status = 0
    for tag in args.tags:
        try:
            store.delete(tag)
            print(f"deleted {tag}")
        except StoreError as err:
            print(f"vmfork: {err}", file=sys.stderr)
            status = 1
    return status
