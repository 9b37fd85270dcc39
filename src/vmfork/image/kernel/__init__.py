"""The guest kernel: built from Debian's ``linux-source-6.1`` with our config.

Recipe (each step named, cached as one entry keyed by every input):

1. unpack ``/usr/src/linux-source-6.1.tar.xz`` into a scratch tree;
2. apply our patches (``patches/*.patch``, in name order), if any;
3. ``make tinyconfig``, then merge ``vmfork.config`` and ``make olddefconfig``;
4. check that every symbol in ``vmfork.config`` took its value (a symbol whose
   dependencies are missing silently drops out otherwise);
5. ``make vmlinux`` and keep the uncompressed ELF ``vmlinux`` and ``.config``.

The entry holds ``vmlinux``, ``config`` and ``build-seconds``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from vmfork.image.cache import cached_entry, hash_inputs

SOURCE_TARBALL = Path("/usr/src/linux-source-6.1.tar.xz")
HERE = Path(__file__).resolve().parent
CONFIG_FRAGMENT = HERE / "vmfork.config"
PATCH_DIR = HERE / "patches"
RECIPE_VERSION = "1"


class KernelBuildError(RuntimeError):
    """The guest kernel could not be built; the message names the step."""


def _patches() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch")) if PATCH_DIR.is_dir() else []


def _wanted_symbols() -> dict[str, str]:
    wanted: dict[str, str] = {}
    for line in CONFIG_FRAGMENT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.partition("=")
        wanted[name] = value
    return wanted


def _check_config(config_text: str) -> None:
    have: dict[str, str] = {}
    for line in config_text.splitlines():
        if m := re.match(r"^(CONFIG_\w+)=(.*)$", line):
            have[m.group(1)] = m.group(2)
        elif m := re.match(r"^# (CONFIG_\w+) is not set$", line):
            have[m.group(1)] = "n"
    missing = [
        f"{name}={value} (got {have.get(name, 'absent')})"
        for name, value in _wanted_symbols().items()
        if have.get(name, "n") != value
    ]
    if missing:
        raise KernelBuildError(
            "step check-config: these symbols did not take their value (missing dependency?): "
            + ", ".join(missing)
        )


def _run(step: str, cmd: list[str], cwd: Path, log: Path) -> None:
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise KernelBuildError(f"step {step} failed ({' '.join(cmd)}):\n" + "\n".join(tail))


def _build(out_dir: Path) -> None:
    if not SOURCE_TARBALL.exists():
        raise KernelBuildError(
            f"step unpack: {SOURCE_TARBALL} is missing; install the Debian package "
            "linux-source-6.1 (scripts/setup does)"
        )
    started = time.monotonic()
    log = out_dir / "build.log"
    scratch = Path(tempfile.mkdtemp(prefix="vmfork-kernel-", dir=out_dir.parent))
    try:
        if shutil.which("tar"):
            # GNU tar unpacks the ~80,000 files several times faster than tarfile.
            _run("unpack", ["tar", "-xf", str(SOURCE_TARBALL), "-C", str(scratch)], scratch, log)
        else:
            with tarfile.open(SOURCE_TARBALL) as tar:
                tar.extractall(scratch, filter="tar")
        (tree,) = [p for p in scratch.iterdir() if p.is_dir()]
        for patch in _patches():
            _run(f"patch {patch.name}", ["patch", "-p1", "-i", str(patch)], tree, log)
        _run("tinyconfig", ["make", "ARCH=x86_64", "tinyconfig"], tree, log)
        with open(tree / ".config", "a") as cfg:
            cfg.write("\n" + CONFIG_FRAGMENT.read_text())
        _run("olddefconfig", ["make", "ARCH=x86_64", "olddefconfig"], tree, log)
        config_text = (tree / ".config").read_text()
        _check_config(config_text)
        jobs = str(os.cpu_count() or 1)
        _run("vmlinux", ["make", "ARCH=x86_64", f"-j{jobs}", "vmlinux"], tree, log)
        shutil.copyfile(tree / "vmlinux", out_dir / "vmlinux")
        (out_dir / "config").write_text(config_text)
        (out_dir / "build-seconds").write_text(f"{time.monotonic() - started:.1f}\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def kernel_key() -> str:
    return hash_inputs(
        [RECIPE_VERSION, SOURCE_TARBALL, CONFIG_FRAGMENT, *_patches()]
    )


def build_kernel() -> tuple[Path, bool]:
    """Return ``(entry_dir, built_now)``; ``entry_dir/vmlinux`` is the kernel."""
    return cached_entry("kernel", kernel_key(), _build)
