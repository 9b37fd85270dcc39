"""Building (once) and caching the test host's kernel + initramfs.

The initramfs (written by ``vmfork.image.cpio``, uncompressed) holds busybox-static, the modules the host needs (decompressed, in
load order) and ``/init``; nothing else, because the host's real file system is this
machine's ``/`` over 9p. An entry of the content-addressed cache (``testhost-initramfs``)
holds ``initramfs.cpio``, the kernel to boot (``kernel``) and ``manifest.json``. Its key
covers everything that shapes it: the kernel version and package version, the module
table, the busybox package version, the recipe version and the text of ``/init``.

Building takes well under a second, so there is no separate ``build`` verb: the first
``vmfork testhost`` builds, later ones reuse.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vmfork.image import cpio
from vmfork.image.cache import cached_entry, hash_inputs
from vmfork.testhost import modules as kmod
from vmfork.testhost.errors import TesthostSetupError
from vmfork.testhost.initscript import RECIPE_VERSION, render_init
from vmfork.testhost.kernel_image import pvh_elf_from_bzimage

CACHE_KIND = "testhost-initramfs"
# The kernel QEMU boots: the ELF inside vmlinuz when it has a PVH entry (3 s faster to
# start under TCG, see kernel_image.py), else a copy of the bzImage itself.
KERNEL_FILE = "kernel"
BUSYBOX = Path("/bin/busybox")
BUSYBOX_PACKAGE = "busybox-static"
# Applets /init uses; symlinked to /bin/busybox at build time (no --install at boot).
_APPLETS = ("sh", "mount", "insmod", "mkdir", "cat", "cut", "echo", "sleep", "sync",
            "poweroff", "chroot", "hostname", "ip", "ls", "mv", "umount", "dmesg")


@dataclass(frozen=True)
class HostImage:
    """A built test-host image: what QEMU's ``-kernel`` and ``-initrd`` take."""

    kernel_version: str
    kernel: Path
    initramfs: Path
    modules: tuple[str, ...]
    built_now: bool


def _package_version(package: str) -> str | None:
    dpkg_query = shutil.which("dpkg-query")
    if dpkg_query is None:
        return None
    done = subprocess.run([dpkg_query, "-W", "-f", "${Version}", package],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _file_identity(path: Path) -> str:
    """A stand-in for a package version where dpkg cannot tell: size and mtime."""
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _busybox_applets() -> set[str]:
    done = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=False)
    return set(done.stdout.split())


def host_image() -> HostImage:
    """The cached kernel + initramfs for the newest suitable installed kernel, built if absent."""
    if not BUSYBOX.is_file():
        raise TesthostSetupError(
            f"{BUSYBOX} not found; install it: apt-get install {BUSYBOX_PACKAGE}")
    wanted = kmod.wanted_modules()
    kernel = kmod.find_kernel(wanted)
    deps = kernel.module_deps()
    order = deps.load_order(wanted)
    init_text = render_init(order)
    key = hash_inputs([
        f"recipe:{RECIPE_VERSION}",
        f"kernel:{kernel.version}",
        "kernel-package:" + (_package_version(f"linux-image-{kernel.version}")
                             or _file_identity(kernel.vmlinuz)),
        "busybox:" + (_package_version(BUSYBOX_PACKAGE) or _file_identity(BUSYBOX)),
        "modules:" + json.dumps({k: list(v) for k, v in kmod.MODULE_GROUPS.items()}),
        init_text,
    ])

    def build(tmp: Path) -> None:
        missing = [a for a in _APPLETS if a not in _busybox_applets()]
        if missing:
            raise TesthostSetupError(
                f"{BUSYBOX} lacks applets {', '.join(missing)}; reinstall {BUSYBOX_PACKAGE}")
        try:
            bzimage = kernel.vmlinuz.read_bytes()
        except PermissionError as err:
            raise TesthostSetupError(
                f"cannot read {kernel.vmlinuz} (Debian makes it root-only): run the first "
                "vmfork testhost as root, or make it readable") from err
        elf = pvh_elf_from_bzimage(bzimage)
        (tmp / KERNEL_FILE).write_bytes(elf if elf is not None else bzimage)
        entries = [cpio.directory(d) for d in
                   ("bin", "dev", "proc", "sys", "lib", "lib/modules", "newroot")]
        # /dev/console must exist before devtmpfs is mounted, or /init starts without
        # stdin/stdout/stderr and its first error message goes nowhere.
        entries += [cpio.char_device("dev/console", 5, 1),
                    cpio.char_device("dev/null", 1, 3, perm=0o666),
                    cpio.regular_file("bin/busybox", BUSYBOX.read_bytes(), perm=0o755)]
        entries += [cpio.symlink(f"bin/{applet}", "busybox") for applet in _APPLETS]
        entries += [cpio.regular_file(f"lib/modules/{name}.ko",
                                      kmod.read_module(kernel.modules_dir / deps.paths[name]))
                    for name in order]
        entries.append(cpio.regular_file("init", init_text.encode(), perm=0o755))
        with open(tmp / "initramfs.cpio", "wb") as out:
            cpio.write_cpio(out, entries)
        (tmp / "manifest.json").write_text(json.dumps({
            "kernel_version": kernel.version, "pvh_elf": elf is not None, "modules": order, "recipe": RECIPE_VERSION,
        }, indent=2) + "\n")

    entry, built_now = cached_entry(CACHE_KIND, key, build)
    return HostImage(kernel.version, entry / KERNEL_FILE, entry / "initramfs.cpio",
                     tuple(order), built_now)
