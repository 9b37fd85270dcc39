"""``vmfork image build|import|ls|rm``: build guest images and list the built ones.

Building works directly on the local cache (no daemon): an image is a build
artefact on this host, like a compiled binary, not sandbox state. (The daemon
builds the same way for ``POST /v1/images``.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
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
from vmfork.image.spec import DEFAULT_DISK_FORMAT, DISK_FORMATS


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("image", help="build and list guest images")
    verbs = parser.add_subparsers(dest="image_verb", metavar="VERB")
    parser.set_defaults(func=lambda _args: _usage(parser))

    build = verbs.add_parser(
        "build", help="build a guest image: the default, or yours (packages, wheels, files)",
        description="With no definition, builds the default image (kernel + initramfs). "
                    "With any of --from/--apt/--pip/--npm/--copy/--env/--workdir/--run or "
                    "-f, "
                    "builds a read-only root disk holding them. Cached by content.")
    build.add_argument("image_name", nargs="?", metavar="NAME",
                       help=f"image name (default {DEFAULT_NAME!r}; letters, digits, '_', '-')")
    build.add_argument("--name", dest="name_flag", help=argparse.SUPPRESS)
    build.add_argument("-f", "--file", type=Path, help="the definition as a TOML file")
    build.add_argument("--from", dest="base", metavar="BASE",
                       help="start from another image (default: the default image)")
    build.add_argument("--apt", nargs="+", default=[], metavar="PKG",
                       help="Debian packages (their dependencies come along)")
    build.add_argument("--pip", nargs="+", default=[], metavar="REQ",
                       help="Python requirements, installed as wheels")
    build.add_argument("--requirements", type=Path, metavar="FILE",
                       help="a pip requirements file")
    build.add_argument("--pip-index-url", metavar="URL", help="the package index pip uses")
    build.add_argument("--pip-find-links", nargs="+", default=[], metavar="DIR|URL",
                       help="where pip also looks for wheels")
    build.add_argument("--pip-no-index", action="store_true",
                       help="use only --pip-find-links (an offline build)")
    build.add_argument("--npm", nargs="+", default=[], metavar="PKG",
                       help="npm packages (run with Debian's nodejs: add --apt nodejs)")
    build.add_argument("--copy", nargs="+", default=[], metavar="SRC:DST",
                       help="host files or directories into the image")
    build.add_argument("--env", nargs="+", default=[], metavar="K=V",
                       help="environment for commands run in sandboxes of it")
    build.add_argument("--workdir", metavar="DIR", help="default working directory of exec")
    build.add_argument("--user", metavar="USER[:GROUP]", help="default user of exec")
    build.add_argument("--run", action="append", default=[], metavar="CMD",
                       help="a shell command run in a build VM booted from the image so far, "
                            "with a network; what it changes in the file system becomes the "
                            "next layer (repeatable, run in order after the other steps; "
                            "needs root)")
    build.add_argument("--egress", default=None, metavar="POLICY",
                       help="the --run steps' egress policy: allow (default), deny, or a "
                            "comma-separated allow-list of CIDRs and domain names")
    build.add_argument("--run-mem-mib", type=int, default=None, metavar="MIB",
                       help="memory of the --run steps' build VM (default 1024; the changes "
                            "live in its RAM until they are exported)")
    build.add_argument("--disk-format", choices=DISK_FORMATS, default=None,
                       help=f"root disk file system (default {DEFAULT_DISK_FORMAT})")
    build.add_argument("--root", choices=("disk", "initramfs"), default=None,
                       help="where the root lives: a read-only disk under a RAM overlay "
                            "(default), or all of it in guest RAM as an initramfs")
    build.add_argument("--json", action="store_true", help="print the image record as JSON")
    build.set_defaults(func=cmd_build)

    imp = verbs.add_parser(
        "import", help="import an OCI image (layout dir, oci-archive:, docker-archive:, "
                       "or a registry HOST/REPO:TAG)")
    imp.add_argument("image_name", metavar="NAME")
    imp.add_argument("ref", metavar="REF")
    imp.add_argument("--auth-file", type=Path,
                     help="Docker config file with registry credentials "
                          "(default $DOCKER_CONFIG/config.json or ~/.docker/config.json)")
    imp.add_argument("--insecure", action="store_true",
                     help="plain HTTP to the registry (always so for loopback registries)")
    imp.add_argument("--json", action="store_true", help="print the image record as JSON")
    imp.set_defaults(func=cmd_import)

    ls = verbs.add_parser("ls", help="list built images")
    ls.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    ls.set_defaults(func=cmd_ls)

    rm = verbs.add_parser("rm", help="remove an image (refused while snapshots use it)")
    rm.add_argument("image_name", metavar="NAME")
    rm.set_defaults(func=cmd_rm)


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


def _progress(step: str, message: str) -> None:
    print(f"  {step:<8} {message}", file=sys.stderr, flush=True)


def spec_from_args(args: argparse.Namespace) -> Any:
    """The ``ImageSpec`` the flags (and ``-f FILE``, which flags extend) define."""
    from vmfork.image.spec import ImageSpec, parse_copy, parse_env, spec_from_toml

    base = spec_from_toml(args.file) if args.file is not None else ImageSpec()
    return ImageSpec(
        base=args.base or base.base,
        apt=base.apt + tuple(args.apt), pip=base.pip + tuple(args.pip),
        requirements=(args.requirements.resolve() if args.requirements else base.requirements),
        pip_index_url=args.pip_index_url or base.pip_index_url,
        pip_find_links=base.pip_find_links + tuple(
            str(Path(p).resolve()) if "://" not in p else p for p in args.pip_find_links),
        pip_no_index=args.pip_no_index or base.pip_no_index,
        npm=base.npm + tuple(args.npm),
        copy=base.copy + tuple(parse_copy(w) for w in args.copy),
        env=base.env + parse_env(args.env), workdir=args.workdir or base.workdir,
        user=args.user or base.user,
        disk_format=args.disk_format or base.disk_format,
        root=args.root or base.root, run=base.run + tuple(args.run),
        egress=args.egress or base.egress,
        run_mem_mib=args.run_mem_mib or base.run_mem_mib).validate()


def _print_user_image(image: GuestImage, seconds: float, as_json: bool) -> None:
    if as_json:
        print(json.dumps(_row(image), indent=2))
        return
    disk = image.disk
    if disk is not None:
        took = _took(image.disk_build_seconds, entry_build_seconds(disk))
        root = f"{image.disk_format} disk {_mb(image.disk_size)}"
    else:
        took = _took(image.initramfs_build_seconds, entry_build_seconds(image.initrd))
        root = "root in the initramfs"
    print(f"image {image.name!r}: {_mb(image.size)} (kernel {_mb(image.kernel_size)}, "
          f"initramfs {_mb(image.initrd_size)}, {root}, {took}); {seconds:.1f} s in all")
    print(f"  from    {image.built_from}\n  root    {disk or image.initrd}\n"
          f"  agent   {image.agent_python}")
    if image.env:
        print("  env     " + " ".join(image.env))
    if image.workdir or image.user:
        print(f"  workdir {image.workdir or '/'}  user {image.user or 'root'}")
    for n, layer in enumerate(image.definition.get("run_layers", []), 1):
        print(f"  run #{n}  layer {layer['layer_bytes'] / 1e3:.1f} kB "
              f"({'cached' if layer['cached'] else 'built now'}): {layer['command'][:60]}")


def cmd_import(args: argparse.Namespace) -> int:
    from vmfork.image.builder import import_oci

    try:
        name = validate_name(args.image_name)
    except InvalidImageName as err:
        raise CliError(str(err)) from err
    started = time.monotonic()
    try:
        image = import_oci(name, args.ref, progress=_progress, auth_file=args.auth_file,
                           insecure=args.insecure)
    except ImageError as err:
        raise CliError(f"image import failed: {err}", status=1) from err
    _print_user_image(image, time.monotonic() - started, args.json)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from vmfork.image.builder import remove_image
    from vmfork.store import Store

    try:
        name = validate_name(args.image_name)
        used_by = [s.tag for s in Store.open().list() if s.meta.image == name]
        remove_image(name, used_by)
    except ImageError as err:
        raise CliError(str(err), status=1) from err
    print(f"removed image {name!r}")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from vmfork.image.spec import SpecError

    try:
        name = validate_name(args.image_name or args.name_flag or DEFAULT_NAME)
        spec = spec_from_args(args)
    except (InvalidImageName, SpecError) as err:
        raise CliError(str(err)) from err
    if not spec.is_default:
        from vmfork.image.builder import build as build_user_image
        from vmfork.image.kernel import KernelBuildError as KernelError

        started = time.monotonic()
        try:
            image = build_user_image(name, spec, progress=_progress)
        except (ImageError, KernelError) as err:
            raise CliError(f"image build failed: {err}", status=1) from err
        _print_user_image(image, time.monotonic() - started, args.json)
        return 0
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
            "disk": str(image.disk) if image.disk else None, "size": image.size,
            "files_present": image.files_present()}


def _built_from(image: GuestImage) -> str:
    parts = [image.built_from]
    d = image.definition
    for key in ("apt", "pip", "npm"):
        if d.get(key):
            parts.append(f"{key}: " + " ".join(d[key][:4]) + (" ..." if len(d[key]) > 4 else ""))
    if d.get("requirements"):
        parts.append(f"requirements: {Path(d['requirements']).name}")
    if d.get("copy"):
        parts.append(f"copy: {len(d['copy'])}")
    if d.get("run"):
        parts.append(f"run: {len(d['run'])}")
    return "; ".join(parts)


def cmd_ls(args: argparse.Namespace) -> int:
    images = list_images()
    if args.json:
        print(json.dumps([_row(i) for i in images], indent=2))
        return 0
    if not images:
        print("no images; run `vmfork image build`")
        return 0
    header = ("NAME", "SIZE", "ROOT", "BUILT FROM", "CREATED", "")
    lines = [header] + [
        (i.name, _mb(i.size), f"{i.disk_format} disk" if i.disk_key else "initramfs",
         _built_from(i) if i.definition else "default packages",
         i.created.strftime("%Y-%m-%d %H:%M:%S"),
         "" if i.files_present() else "files missing: rebuild")
        for i in images
    ]
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    return 0
