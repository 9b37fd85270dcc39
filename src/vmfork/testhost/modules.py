"""Finding the Debian generic kernel and the modules the test host must load, in order.

The test host boots the kernel of this machine's ``linux-image-amd64`` package, not a
kernel we build: it is the one Debian kernel with 9p, overlayfs and ``kvm_amd`` as
modules (the *cloud* flavour has no 9p). Its modules live in ``/lib/modules/<version>``
and must be loaded by busybox ``insmod``, which knows nothing about dependencies or
compression. So at build time we:

- pick the newest installed version that has both ``/boot/vmlinuz-<v>`` and a
  ``modules.dep`` providing every wanted module (so a newer cloud kernel installed
  next to the generic one is skipped, not chosen and then found wanting);
- expand the wanted list through ``modules.dep`` into the full set, ordered so that
  every module comes after everything it needs (a depth-first post-order; the wanted
  list's own order only breaks ties, so a wrong guess in it cannot break the boot);
- skip modules built into that kernel (``modules.builtin``): nothing to load;
- decompress ``.ko.xz`` / ``.ko.gz`` / ``.ko.zst`` (busybox ``insmod`` loads raw ELF).

Everything the running test-host kernel might need later (``modprobe tun`` inside the
chroot) is reachable anyway: the chroot is this machine's root, so
``/lib/modules/<version>`` of the very kernel that booted is right there over 9p.
"""

from __future__ import annotations

import gzip
import lzma
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vmfork.testhost.errors import TesthostSetupError

# What the test host needs, by purpose. Each line names the *top* modules of one
# feature; their dependencies are computed from modules.dep. To give the host a
# new feature (e.g. networking tests: "tun", "veth", "bridge", "nf_tables"), add
# one line here; the cache key includes this table, so the initramfs is rebuilt.
MODULE_GROUPS: Mapping[str, tuple[str, ...]] = {
    "virtio transport": ("virtio_pci",),
    "host file system over 9p": ("9pnet_virtio", "9p"),
    "ram overlay on the read-only root": ("overlay",),
    "stdout/stderr ports": ("virtio_console",),
    "nested kvm": ("kvm_amd",),
    "/dev/vhost-vsock for QEMU peers in bench/spawn.py": ("vhost_vsock",),
    # crc32c_generic first: libcrc32c (under nf_tables) only soft-depends on it, which
    # modules.dep does not list, and fails to load without a crc32c implementation.
    "per-child networks (runtime/network.py): taps, veths, nftables NAT, fib, reject": (
        "tun", "veth", "crc32c_generic", "nf_tables", "nft_chain_nat", "nft_nat", "nft_masq", "nft_ct",
        "nft_fib_ipv4", "nft_reject_ipv4",
        # the inet tables of the egress rules and the host guard (IPv6 covered too)
        "nft_fib_inet", "nft_reject_inet"),
}

KERNEL_PACKAGE = "linux-image-amd64"
_MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.gz", ".ko.zst")


def wanted_modules() -> list[str]:
    """The top-level modules of every group, in table order."""
    return [name for group in MODULE_GROUPS.values() for name in group]


def module_name(path: str) -> str:
    """``kernel/arch/x86/kvm/kvm-amd.ko.xz`` -> ``kvm_amd`` (the kernel treats - and _ alike)."""
    base = path.rsplit("/", 1)[-1]
    for suffix in _MODULE_SUFFIXES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")


@dataclass(frozen=True)
class ModuleDeps:
    """``modules.dep`` parsed: module name -> (its file path, its dependencies' names)."""

    paths: Mapping[str, str]
    deps: Mapping[str, tuple[str, ...]]
    builtin: frozenset[str]

    @classmethod
    def parse(cls, dep_text: str, builtin_text: str = "") -> ModuleDeps:
        paths: dict[str, str] = {}
        deps: dict[str, tuple[str, ...]] = {}
        for lineno, line in enumerate(dep_text.splitlines(), 1):
            if not line.strip():
                continue
            target, sep, rest = line.partition(":")
            if not sep:
                raise ValueError(f"modules.dep line {lineno} has no ':': {line!r}")
            name = module_name(target.strip())
            paths[name] = target.strip()
            deps[name] = tuple(module_name(d) for d in rest.split())
        builtin = frozenset(module_name(p) for p in builtin_text.split())
        return cls(paths, deps, builtin)

    def provides(self, name: str) -> bool:
        key = name.replace("-", "_")
        return key in self.paths or key in self.builtin

    def load_order(self, wanted: Iterable[str]) -> list[str]:
        """Every module needed for ``wanted``, each after all of its dependencies.

        ``modules.dep`` lists a module's dependencies transitively, in the order
        modprobe unloads them, so they are visited last-first. Built-in modules are
        dropped. Raises ``KeyError`` naming the first unknown module.
        """
        order: list[str] = []
        done: set[str] = set()
        visiting: set[str] = set()

        def visit(name: str, needed_by: str | None) -> None:
            if name in done or name in self.builtin:
                return
            if name not in self.paths:
                why = f" (needed by {needed_by})" if needed_by else ""
                raise KeyError(f"module {name}{why} is neither in modules.dep nor built in")
            if name in visiting:
                raise ValueError(f"dependency cycle through module {name}")
            visiting.add(name)
            for dep in reversed(self.deps[name]):
                visit(dep, name)
            visiting.discard(name)
            done.add(name)
            order.append(name)

        for name in wanted:
            visit(name.replace("-", "_"), None)
        return order


@dataclass(frozen=True)
class Kernel:
    """One installed kernel: its version string, image and module tree."""

    version: str
    vmlinuz: Path
    modules_dir: Path

    def module_deps(self) -> ModuleDeps:
        builtin = self.modules_dir / "modules.builtin"
        return ModuleDeps.parse(
            (self.modules_dir / "modules.dep").read_text(),
            builtin.read_text() if builtin.exists() else "",
        )


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key for kernel versions: numeric runs compare as numbers (6.1.0-10 > 6.1.0-9)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part)
                 for part in re.findall(r"\d+|[A-Za-z]+", version))


def find_kernel(wanted: Sequence[str], boot: Path = Path("/boot"),
                modules_root: Path = Path("/lib/modules")) -> Kernel:
    """The newest installed kernel that provides every module in ``wanted``."""
    candidates: list[Kernel] = []
    if modules_root.is_dir():
        for tree in modules_root.iterdir():
            vmlinuz = boot / f"vmlinuz-{tree.name}"
            if vmlinuz.is_file() and (tree / "modules.dep").is_file():
                candidates.append(Kernel(tree.name, vmlinuz, tree))
    if not candidates:
        raise TesthostSetupError(
            f"no installed kernel found (no {boot}/vmlinuz-<v> with {modules_root}/<v>/"
            f"modules.dep); install Debian's generic kernel: apt-get install {KERNEL_PACKAGE}")
    rejected: list[str] = []
    for kernel in sorted(candidates, key=lambda k: version_key(k.version), reverse=True):
        deps = kernel.module_deps()
        missing = [m for m in wanted if not deps.provides(m)]
        if not missing:
            return kernel
        rejected.append(f"{kernel.version} lacks {', '.join(missing)}")
    raise TesthostSetupError(
        "no installed kernel has the modules the test host needs ("
        + "; ".join(rejected)
        + f"); install Debian's generic kernel: apt-get install {KERNEL_PACKAGE} "
        "(the cloud kernel has no 9p)")


def read_module(path: Path) -> bytes:
    """A module's ELF bytes, decompressed if the file is ``.xz``, ``.gz`` or ``.zst``."""
    raw = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(raw)
    if path.name.endswith(".gz"):
        return gzip.decompress(raw)
    if path.name.endswith(".zst"):
        # Python 3.11's stdlib has no zstd; Debian's zstd tool does it.
        zstd = shutil.which("zstd")
        if zstd is None:
            raise TesthostSetupError(
                f"{path} is zstd-compressed and the zstd tool is missing: apt-get install zstd")
        return subprocess.run([zstd, "-dcq", str(path)], check=True, capture_output=True).stdout
    return raw
