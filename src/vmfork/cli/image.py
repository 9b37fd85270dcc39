"""``vmfork image build|ls``: build the guest image and list the built ones.

Building works directly on the local cache (no daemon): an image is a build
artefact on this host, like a compiled binary, not sandbox state.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from vmfork.cli import CliError
from vmfork.image import (
    DEFAULT_NAME,
    GuestImage,
    ImageError,
    InvalidImageName,
    build_image,
    entry_build_seconds,
    kernel_path,
    list_images,
    record_path,
    validate_name,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("image", help="build and list guest images")
    verbs = parser.add_subparsers(dest="image_verb", metavar="VERB")
    parser.set_defaults(func=lambda _args: _usage(parser))

    build = verbs.add_parser(
        "build", help="build the guest kernel and initramfs (reuses cached parts)"
    )
    build.add_argument("--name", default=DEFAULT_NAME,
                       help=f"image name (default {DEFAULT_NAME!r}; letters, digits, '_', '-')")
    build.set_defaults(func=cmd_build)

    ls = verbs.add_parser("ls", help="list built images")
    ls.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    ls.set_defaults(func=cmd_ls)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _took(built_now: float | None, recorded: float | None) -> str:
    if built_now is not None:
        return f"built now in {built_now:.1f} s"
    if recorded is not None:
        return f"cached (its build took {recorded:.1f} s)"
    return "cached"


def cmd_build(args: argparse.Namespace) -> int:
    try:
        name = validate_name(args.name)
    except InvalidImageName as err:
        raise CliError(str(err)) from err
    # Imported here so that `vmfork image ls` does not load the kernel recipe.
    from vmfork.image.kernel import KernelBuildError, kernel_key

    if not kernel_path(kernel_key()).is_file():
        print("kernel: not cached; building it takes several minutes the first time "
              "(or waits for a build already running)", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        image = build_image(name)
    except (ImageError, KernelBuildError) as err:
        raise CliError(f"image build failed: {err}", status=1) from err
    total = time.monotonic() - started
    rows = [
        ("kernel", image.kernel_key, _mb(image.kernel_size),
         _took(image.kernel_build_seconds, entry_build_seconds(image.kernel))),
        ("initramfs", image.initramfs_key, _mb(image.initrd_size),
         _took(image.initramfs_build_seconds, entry_build_seconds(image.initrd))),
    ]
    for part, key, size, took in rows:
        print(f"{part:<10} {key}  {size:>9}  {took}")
    print(f"image {image.name!r} recorded in {record_path(image.name)} ({total:.1f} s in all)")
    print(f"  kernel  {image.kernel}\n  initrd  {image.initrd}\n  cmdline {image.cmdline}")
    return 0


def _row(image: GuestImage) -> dict[str, Any]:
    return {**image.to_record(), "kernel": str(image.kernel), "initrd": str(image.initrd),
            "files_present": image.files_present()}


def cmd_ls(args: argparse.Namespace) -> int:
    images = list_images()
    if args.json:
        print(json.dumps([_row(i) for i in images], indent=2))
        return 0
    if not images:
        print("no images; run `vmfork image build`")
        return 0
    header = ("NAME", "KERNEL", "INITRAMFS", "KERNEL SIZE", "INITRD SIZE", "CREATED", "")
    lines = [header] + [
        (i.name, i.kernel_key, i.initramfs_key, _mb(i.kernel_size), _mb(i.initrd_size),
         i.created.strftime("%Y-%m-%d %H:%M:%S"),
         "" if i.files_present() else "files missing: rebuild")
        for i in images
    ]
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    return 0
