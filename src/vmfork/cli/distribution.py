"""``vmfork push`` and ``vmfork pull``: snapshots to and from an OCI registry.

Both work on the local store (``VMFORK_HOME``), with or without a daemon; the
format, dedupe, auth and signatures are ``vmfork.store.distribution``'s (and
docs/distribution.md's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from vmfork.cli import CliError
from vmfork.cli.daemon_client import add_json_option, print_json


def register(sub: Any) -> None:
    p = sub.add_parser("push", help="push a snapshot's chain (and its guest image) to an "
                                    "OCI registry; only blobs the registry lacks are sent")
    p.add_argument("tag", metavar="TAG", help="the snapshot (its whole chain goes)")
    p.add_argument("ref", metavar="REF", help="HOST[:PORT]/REPO[:TAG] (the registry tag "
                                              "defaults to the snapshot's)")
    p.add_argument("--sign", type=Path, metavar="KEY",
                   help="sign with this Ed25519 private key (PEM)")
    p.add_argument("--no-image", action="store_true",
                   help="leave the guest image out (the puller must have it)")
    _registry_options(p)
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", help="pull a snapshot chain from an OCI registry into the "
                                    "store, verifying every blob; skips what is here")
    p.add_argument("ref", metavar="REF", help="HOST[:PORT]/REPO[:TAG|@sha256:HEX]")
    p.add_argument("--tag", metavar="T", help="store the chain's head under T")
    p.add_argument("--force", action="store_true",
                   help="replace snapshots that hold other content under the chain's tags")
    p.add_argument("--verify-key", type=Path, metavar="KEY",
                   help="refuse the snapshot unless it is signed by this Ed25519 public "
                        "key (PEM)")
    _registry_options(p)
    p.set_defaults(func=cmd_pull)


def _registry_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--auth-file", type=Path, metavar="FILE",
                   help="Docker config with the registry's credentials (default "
                        "$DOCKER_CONFIG/config.json or ~/.docker/config.json)")
    p.add_argument("--insecure", action="store_true",
                   help="plain HTTP to a registry that is not on loopback")
    add_json_option(p)


class _Progress:
    """``what  12.3/40.0 MiB`` on stderr, on a terminal, at most every 0.2 s."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < 0.2:
            return
        self.last = now
        sys.stderr.write(f"\r{what[:60]:<60} {done / (1 << 20):8.1f}/"
                         f"{max(total, done) / (1 << 20):.1f} MiB ")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 90 + "\r")
            sys.stderr.flush()


def cmd_push(args: argparse.Namespace) -> int:
    from vmfork.image.errors import ImageBuildError
    from vmfork.store import Store, StoreError, distribution
    started = time.monotonic()
    shown = _Progress()
    try:
        report = distribution.push(Store.open(), args.tag, args.ref, sign_key=args.sign,
                                   auth_file=args.auth_file, insecure=args.insecure,
                                   with_image=not args.no_image, progress=shown)
    except (StoreError, ImageBuildError, OSError) as err:
        raise CliError(str(err), 1) from err
    finally:
        shown.clear()
    if args.json:
        print_json({"ref": report.ref, "digest": report.digest, "tags": report.tags,
                    "uploaded": report.uploaded, "mounted": report.mounted,
                    "present": report.present, "bytes_uploaded": report.bytes_uploaded,
                    "signature": report.signature, "seconds": time.monotonic() - started})
        return 0
    print(f"pushed {' <- '.join(report.tags)} to {report.ref}@{report.digest}")
    print(f"  blobs: {len(report.uploaded)} uploaded "
          f"({report.bytes_uploaded / (1 << 20):.1f} MiB), {len(report.mounted)} mounted, "
          f"{len(report.present)} already there")
    if report.signature:
        print(f"  signed: {report.signature}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from vmfork.image.errors import ImageBuildError
    from vmfork.store import Store, StoreError, distribution
    started = time.monotonic()
    shown = _Progress()
    try:
        report = distribution.pull(Store.open(), args.ref, head_tag=args.tag,
                                   force=args.force, verify_key=args.verify_key,
                                   auth_file=args.auth_file, insecure=args.insecure,
                                   progress=shown)
    except (StoreError, ImageBuildError, OSError) as err:
        raise CliError(str(err), 1) from err
    finally:
        shown.clear()
    if args.json:
        print_json({"ref": report.ref, "digest": report.digest, "tags": report.tags,
                    "stored": report.stored, "present": report.present,
                    "downloaded": report.downloaded, "skipped": report.skipped,
                    "bytes_downloaded": report.bytes_downloaded, "resumed": report.resumed,
                    "image": report.image, "image_note": report.image_note,
                    "signed_by": report.signed_by, "seconds": time.monotonic() - started})
        return 0
    print(f"pulled {' <- '.join(report.tags)} from {report.ref}@{report.digest}: stored "
          f"{', '.join(report.stored) or 'none'}; already present "
          f"{', '.join(report.present) or 'none'}")
    print(f"  blobs: {len(report.downloaded)} downloaded "
          f"({report.bytes_downloaded / (1 << 20):.1f} MiB), {len(report.skipped)} skipped")
    if report.signed_by:
        print(f"  signature: good, key {report.signed_by}")
    if report.image_note:
        print(f"  image: {report.image_note}")
    elif report.image:
        print(f"  image: {report.image}")
    return 0
