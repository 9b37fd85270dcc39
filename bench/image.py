"""Users' images benchmark (issue 13): what a root disk costs against the initramfs.

Two phases, in one run:

1. **builds**, natively (a build runs no VM): each image built cold (a fresh cache that
   shares only the kernel and the downloaded ``.deb`` files and wheels, so the time is
   the build, not the network) and again cached, for the default image, numpy+pandas
   (Debian packages, on a disk and as an initramfs of the same content) and a 1 GiB
   image;
2. **VMs**, in the emulated test host where this host's KVM cannot run guests: per
   variant, boot to agent ready, the warm-up, the guest RAM in use after boot and after
   the warm-up (``/proc/meminfo``), the snapshot's ``memory.bin`` (bytes on disk), and
   spawn-to-ready of 10 children.

Targets: spawn-to-ready of the numpy+pandas snapshot within 1.1x the default image's;
a disk-rooted guest's RAM after boot at most 10% of its image's size.

Writes ``bench/results/image.{json,md}``. Inside the test host only ratios between
variants of the same run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, ensure_kvm_host, summary, where, write_results

SHARED = ("kernel", "debs", "pip", "npm", "test-assets")
SCI = ("python3-numpy", "python3-pandas")
# variant -> (image name, warm-up code)
VARIANTS: dict[str, tuple[str, str]] = {
    "default (initramfs)": ("default", "import json"),
    "numpy+pandas (initramfs root)": ("bench-sci-ram", "import numpy, pandas"),
    "numpy+pandas (disk root)": ("bench-sci-disk", "import numpy, pandas"),
    "numpy+pandas (disk root, squashfs lz4)": ("bench-sci-lz4", "import numpy, pandas"),
    "numpy+pandas (disk root, erofs lz4hc)": ("bench-sci-erofs", "import numpy, pandas"),
    "1 GiB (disk root)": ("bench-big", "import json"),
}
BUILD_JSON = RESULTS / "image-builds.json"


def _specs() -> dict[str, Any]:
    from tests.images.prepare import big_file
    from vmfork.image.spec import CopySpec, ImageSpec

    return {
        "bench-sci-disk": ImageSpec(apt=SCI).validate(),
        "bench-sci-ram": ImageSpec(apt=SCI, root="initramfs").validate(),
        "bench-sci-lz4": ImageSpec(apt=SCI, disk_format="squashfs-lz4").validate(),
        "bench-sci-erofs": ImageSpec(apt=SCI, disk_format="erofs").validate(),
        "bench-big": ImageSpec(copy=(CopySpec(big_file(), "/data/big.bin"),)).validate(),
    }


def _build_once(name: str, spec: Any) -> tuple[float, Any]:
    from vmfork.image import build_image
    from vmfork.image.builder import build

    started = time.monotonic()
    image = build_image(name) if spec is None else build(name, spec)
    return time.monotonic() - started, image


def build_phase(args: argparse.Namespace) -> dict[str, Any]:
    """Cold and cached builds in a scratch cache; then the same images in the real
    cache (for the VM phase)."""
    from vmfork.paths import cache_dir

    real = cache_dir()
    specs: dict[str, Any] = {"default": None, **_specs()}
    results: dict[str, Any] = {}
    scratch = Path(tempfile.mkdtemp(prefix="vmfork-bench-cache-"))
    try:
        for part in SHARED:
            if (real / part).exists():
                (scratch / part).symlink_to(real / part)
        os.environ["VMFORK_CACHE_DIR"] = str(scratch)
        for name, spec in specs.items():
            cold, image = _build_once(name, spec)
            cached, _ = _build_once(name, spec)
            results[name] = {"cold_s": cold, "cached_s": cached, "image_bytes": image.size,
                             "root": "disk" if image.disk_key else "initramfs",
                             "disk_bytes": image.disk_size, "initrd_bytes": image.initrd_size}
            print(f"build {name}: cold {cold:.1f} s, cached {cached:.1f} s, "
                  f"{image.size >> 20} MiB", file=sys.stderr)
    finally:
        os.environ["VMFORK_CACHE_DIR"] = str(real)
        shutil.rmtree(scratch, ignore_errors=True)
    for name, spec in specs.items():   # the real cache: what the VM phase boots
        _build_once(name, spec)
    return results


def _meminfo(guest: Any) -> dict[str, int]:
    done = guest.agent.exec("cat /proc/meminfo")
    out = {}
    for line in done.stdout.decode().splitlines():
        key, _, value = line.partition(":")
        out[key] = int(value.split()[0]) << 10
    return out


def _used(info: dict[str, int]) -> dict[str, int]:
    return {"used_bytes": info["MemTotal"] - info["MemFree"],
            "unavailable_bytes": info["MemTotal"] - info["MemAvailable"]}


def vm_phase(args: argparse.Namespace) -> dict[str, Any]:
    from vmfork.image import find_image
    from vmfork.runtime.guest import BootedGuest
    from vmfork.runtime.parent import snapshot_parent
    from vmfork.runtime.spawn import fork_children
    from vmfork.runtime.zygote_client import start_zygote
    from vmfork.store import Store

    work = Path(tempfile.mkdtemp(prefix="vmfork-bench-image-"))
    store = Store.open(work / "home")
    zygote = start_zygote(str(work / "zygote.sock"), timeout=300.0)
    results: dict[str, Any] = {}
    try:
        for label, (name, warm) in VARIANTS.items():
            image = find_image(name)
            row: dict[str, Any] = {"image": name, "image_bytes": image.size,
                                   "root": "disk" if image.disk_key else "initramfs"}
            with BootedGuest(image, mem_mib=args.mem_mib) as guest:
                row["boot_to_ready_s"] = guest.timings.total
                row["after_boot"] = _used(_meminfo(guest))
                started = time.monotonic()
                result = guest.agent.eval(warm)
                assert result.exception is None, result.exception
                row["warm_s"] = time.monotonic() - started
                row["after_warm"] = _used(_meminfo(guest))
            tag = name.replace("_", "-")
            report = snapshot_parent(store, tag, image, mem_mib=args.mem_mib, warm_code=warm)
            row["snapshot_boot_s"] = report.boot_s
            row["snapshot_warm_s"] = report.warm_s
            row["memory_bin_bytes"] = report.snapshot.meta.sizes.memory_physical_bytes
            spawns = []
            for _ in range(args.repeat):
                fork = fork_children(zygote.client(), report.snapshot, args.n, work / "vms",
                                     timeout=args.timeout)
                assert not fork.failed, fork.failed
                spawns.append(fork.ready_s)
                for child in fork.children:
                    zygote.client().kill_and_wait(child.vm_id)
            row["spawn_ready_s"] = summary(spawns)
            results[label] = row
            print(f"{label}: boot {row['boot_to_ready_s']:.1f} s, warm {row['warm_s']:.1f} s, "
                  f"RAM after boot {row['after_boot']['used_bytes'] >> 20} MiB, "
                  f"{args.n} children ready in {row['spawn_ready_s']['median']:.1f} s",
                  file=sys.stderr, flush=True)
    finally:
        zygote.close()
        shutil.rmtree(work, ignore_errors=True)
    return results


def render(args: argparse.Namespace, builds: dict[str, Any], vms: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [f"# Users' images ({where()})", "",
             f"`python bench/image.py --n {args.n} --repeat {args.repeat} --mem-mib "
             f"{args.mem_mib}`", "", "## Builds (native; cold = fresh cache, packages "
             "already downloaded)", "", "| image | root | size | cold | cached |",
             "|---|---|---:|---:|---:|"]
    for name, b in builds.items():
        lines.append(f"| {name} | {b['root']} | {b['image_bytes'] / mib:.0f} MiB | "
                     f"{b['cold_s']:.1f} s | {b['cached_s']:.2f} s |")
    lines += ["", f"## Guests ({args.mem_mib} MiB each)", "",
              "| variant | boot to ready | warm-up | RAM after boot (used / unreclaimable) "
              "| RAM after warm-up | memory.bin | spawn-to-ready x"
              f"{args.n} (median) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, r in vms.items():
        lines.append(
            f"| {label} | {r['boot_to_ready_s']:.1f} s | {r['warm_s']:.2f} s | "
            f"{r['after_boot']['used_bytes'] / mib:.0f} / "
            f"{r['after_boot']['unavailable_bytes'] / mib:.0f} MiB | "
            f"{r['after_warm']['used_bytes'] / mib:.0f} MiB | "
            f"{r['memory_bin_bytes'] / mib:.0f} MiB | {r['spawn_ready_s']['median']:.2f} s |")
    default = vms["default (initramfs)"]["spawn_ready_s"]["median"]
    sci = vms["numpy+pandas (disk root)"]["spawn_ready_s"]["median"]
    big = vms["1 GiB (disk root)"]
    lines += ["", "## Targets", "",
              f"- spawn-to-ready, numpy+pandas (disk) / default: **{sci / default:.2f}x** "
              "(target <= 1.1x)",
              f"- RAM in use after boot of the 1 GiB disk-rooted guest / its image: "
              f"**{big['after_boot']['used_bytes'] / big['image_bytes']:.1%}** "
              "(target <= 10%)", ""]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10, help="children per spawn (default 10)")
    parser.add_argument("--repeat", type=int, default=2, help="spawns per variant")
    # 1024: an initramfs root is unpacked from a copy of itself, so at boot the guest
    # holds the numpy+pandas tree (208 MiB) twice
    parser.add_argument("--mem-mib", type=int, default=1024, help="guest RAM (default 1024)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--phase", choices=("all", "builds", "vms"), default="all",
                        help="builds: only the native build phase; vms: only the guests "
                             "(with the builds' images already made)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.phase in ("all", "builds") and os.environ.get("VMFORK_IN_TESTHOST") != "1":
        RESULTS.mkdir(exist_ok=True)
        BUILD_JSON.write_text(json.dumps(build_phase(args), indent=2) + "\n")
        if args.phase == "builds":
            return 0
        argv = ["--phase", "vms", "--n", str(args.n), "--repeat", str(args.repeat),
                "--mem-mib", str(args.mem_mib), "--timeout", str(args.timeout)]
        ensure_kvm_host(__file__, argv, mem_mib=6144, timeout=5400.0)
    builds = json.loads(BUILD_JSON.read_text()) if BUILD_JSON.is_file() else {}
    vms = vm_phase(args)
    write_results("image", {"n": args.n, "repeat": args.repeat, "mem_mib": args.mem_mib,
                            "builds": builds, "vms": vms}, render(args, builds, vms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
