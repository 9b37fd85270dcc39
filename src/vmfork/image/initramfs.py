"""The guest's root file system: an initramfs holding busybox, CPython and the agent.

Why an initramfs: the guest's root then lives in guest RAM, so a memory
snapshot is the whole guest and no two sandboxes can ever share a writable disk
(DESIGN.md, decision 3). The price is that every byte here is unpacked into
guest memory on a cold boot, so the recipe prunes what a guest never uses and
precompiles the standard library (a cold ``import`` then reads a ``.pyc``
instead of compiling source in the guest).

Recipe (each step named; a failure says which):

1. ``resolve-packages``: pin the Debian packages (``debian.py``);
2. ``download`` the ``.deb`` files into ``<cache>/debs`` (reused when their hash matches);
3. ``extract`` them with ``dpkg-deb -x`` into a staging tree (no maintainer scripts);
4. ``prune`` documentation, locales, iconv modules, test packages and the
   extension modules whose libraries the allow-list leaves out;
5. ``check-libraries``: every ELF's interpreter and ``DT_NEEDED`` is in the tree;
6. ``busybox``: one symlink per applet, never over a file a package installed;
7. ``base-files``: ``/etc`` basics, mount points, ``python3``/``python`` links;
8. ``agent``: ``vmfork/__init__.py`` and ``vmfork/agent/`` into ``/opt/vmfork``, and ``/init``;
9. ``compile``: every ``.py`` to an unchecked-hash ``.pyc`` (see ``_compile_tree``);
10. ``archive``: the tree plus device nodes as one uncompressed newc cpio (``cpio.py``).

The entry ``initramfs/<key>/`` holds ``initramfs.cpio``, ``manifest.json`` and
``build-seconds``. The key covers the recipe version and this recipe's own
source, the pinned packages (name, version, hash), the agent's source files and
``/init``, so any change to what goes into the guest builds a new entry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import vmfork
from vmfork.image import cpio, debian, elf
from vmfork.image.cache import cached_entry, hash_inputs
from vmfork.image.errors import ImageBuildError
from vmfork.paths import cache_dir

RECIPE_VERSION = "1"
ARCHIVE_NAME = "initramfs.cpio"
GUEST_PYTHON = "usr/bin/python3.11"
GUEST_STDLIB = "usr/lib/python3.11"
AGENT_ROOT = "opt/vmfork"

# `-I` isolates the agent from the environment and the current directory. `site` runs
# (no `-S`): the guest has pip, and what a user pip-installs into dist-packages must be
# importable by warm-up code and eval in the agent's interpreter.
# One shebang argument only: Linux passes everything after the interpreter as a
# single argument, so the flags must be combined.
INIT_SCRIPT = """\
#!/usr/bin/python3.11 -I
# PID 1 of a vmfork guest: the vmfork agent (src/vmfork/agent), stdlib only.
# If it ever returns or raises, the kernel panics; the VMM sees the guest stop.
import sys

sys.path.insert(0, "/opt/vmfork")

from vmfork.agent.main import main

raise SystemExit(main())
"""

# Paths (relative to the root) that no guest needs. Several are absent from
# Debian's split packages already (idlelib, tkinter, ...): they are listed so that
# a packaging change cannot quietly bring them back.
PRUNED_PATHS: tuple[str, ...] = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bug",
    "usr/share/binfmts",
    "usr/share/initramfs-tools",
    "usr/lib/binfmt.d",
    # iconv converters (8 MB): CPython's codecs are its own, glibc's are never loaded.
    "usr/lib/x86_64-linux-gnu/gconv",
    f"{GUEST_STDLIB}/test",
    f"{GUEST_STDLIB}/idlelib",
    f"{GUEST_STDLIB}/tkinter",
    f"{GUEST_STDLIB}/turtledemo",
    f"{GUEST_STDLIB}/turtle.py",
    f"{GUEST_STDLIB}/ensurepip",
    f"{GUEST_STDLIB}/lib2to3",
    f"{GUEST_STDLIB}/pydoc_data",
    f"{GUEST_STDLIB}/__phello__",
    # PEP 668's marker: a guest is a sandbox of its own, and `pip install` in it (a
    # warm-up, forkd's `snapshot-diff --exec "pip install ..."`) must just work.
    f"{GUEST_STDLIB}/EXTERNALLY-MANAGED",
)

# Directory names removed anywhere in the standard library.
PRUNED_DIR_NAMES = frozenset({"test", "tests", "idle_test", "__pycache__"})

# lib-dynload modules removed: CPython's own test helpers, and the two whose
# libraries debian.DENY leaves out (`_dbm` needs libdb, `nis` needs libnsl).
PRUNED_EXTENSIONS: tuple[str, ...] = (
    "_dbm", "nis",
    "_ctypes_test", "_testbuffer", "_testcapi", "_testclinic", "_testimportmultiple",
    "_testinternalcapi", "_testmultiphase", "_xxtestfuzz", "xxlimited", "xxlimited_35",
)

# Where the guest's dynamic loader looks without an ld.so.cache (Debian's glibc
# has the multiarch directories built in; checked by chroot during development).
LIBRARY_DIRS: tuple[str, ...] = (
    "lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib", "usr/lib", "lib64", "usr/lib64",
)

BASE_DIRS: dict[str, int] = {
    "dev": 0o755, "proc": 0o555, "sys": 0o555, "run": 0o755, "tmp": 0o1777,
    "root": 0o700, "home": 0o755, "home/user": 0o755, "mnt": 0o755, "var": 0o755, "var/tmp": 0o1777,
    "etc": 0o755, "opt": 0o755, AGENT_ROOT: 0o755,
}

BASE_FILES: dict[str, str] = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n"
                  "user:x:1000:1000:user:/home/user:/bin/bash\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "etc/group": "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n",
    "etc/hostname": "vmfork\n",
    "etc/hosts": "127.0.0.1\tlocalhost vmfork\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "etc/resolv.conf": "# Placeholder: the vmfork agent writes name servers here when the\n"
                       "# sandbox has a network.\n",
    # glibc >= 2.34 has the files and dns back-ends built in; without this file it
    # would try "nis" first for some databases.
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\n"
                         "hosts: files dns\nnetworks: files\nprotocols: files\n"
                         "services: files\n",
}

BASE_OWNERS: dict[str, tuple[int, int]] = {"home/user": (1000, 1000)}
"""``user`` (uid 1000), the non-root user E2B's SDKs ask for (``user="user"``), owns
its home; everything else in the image is root's."""

BASE_SYMLINKS: dict[str, str] = {
    "usr/bin/python3": "python3.11",
    "usr/bin/python": "python3.11",
    "var/run": "/run",
}

# Device nodes the kernel needs before anything mounts devtmpfs: it opens
# /dev/console as PID 1's stdin/stdout/stderr. (major, minor, permissions)
DEVICE_NODES: dict[str, tuple[int, int, int]] = {
    "dev/console": (5, 1, 0o600),
    "dev/null": (1, 3, 0o666),
    # CPython reads these for its hash seed before the agent mounts devtmpfs when
    # getrandom() would block (a CRNG not yet initialised: e.g. under QEMU).
    "dev/urandom": (1, 9, 0o666),
    "dev/random": (1, 8, 0o666),
}

_RECIPE_SOURCES: tuple[Path, ...] = tuple(
    Path(__file__).resolve().parent / name
    for name in ("initramfs.py", "debian.py", "cpio.py", "elf.py")
)


@dataclass(frozen=True)
class Initramfs:
    """A cached initramfs entry."""

    key: str
    path: Path  # the cpio archive
    built_now: bool
    build_seconds: float | None  # how long the build of this entry took, if recorded

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def default_vmfork_source() -> Path:
    """The ``vmfork`` package directory whose agent goes into the guest."""
    return Path(vmfork.__file__).resolve().parent


def agent_files(vmfork_source: Path) -> list[tuple[str, Path]]:
    """``(path under /opt/vmfork/vmfork, source file)`` for the package init and the agent."""
    init = vmfork_source / "__init__.py"
    agent = vmfork_source / "agent"
    if not (agent / "main.py").is_file() or not init.is_file():
        raise ImageBuildError(
            "agent",
            f"{agent / 'main.py'} does not exist; the guest agent (vmfork.agent.main.main) "
            "must be present before an image can be built",
        )
    files = [("__init__.py", init)]
    for path in sorted(agent.rglob("*.py")):
        if "__pycache__" not in path.parts:
            files.append((path.relative_to(vmfork_source).as_posix(), path))
    return files


def initramfs_key(packages: list[debian.DebPackage], agent: list[tuple[str, Path]]) -> str:
    parts: list[str | bytes | Path] = [f"recipe {RECIPE_VERSION}", *_RECIPE_SOURCES]
    parts += [p.pin() for p in packages]
    for rel, source in agent:
        parts += [f"agent {rel}", source]
    parts.append(INIT_SCRIPT)
    return hash_inputs(parts)


def build_initramfs(vmfork_source: Path | None = None) -> Initramfs:
    """Return the cached initramfs for the current packages and agent, building it if absent."""
    packages = debian.resolve_packages()
    agent = agent_files(vmfork_source or default_vmfork_source())
    key = initramfs_key(packages, agent)
    entry, built_now = cached_entry(
        "initramfs", key, lambda out: _build(out, packages, agent)
    )
    seconds_file = entry / "build-seconds"
    seconds = float(seconds_file.read_text()) if seconds_file.is_file() else None
    return Initramfs(key, entry / ARCHIVE_NAME, built_now, seconds)


def _build(out: Path, packages: list[debian.DebPackage], agent: list[tuple[str, Path]]) -> None:
    started = time.monotonic()
    timings: dict[str, float] = {}
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out.parent))
    try:
        def step(name: str, t0: float) -> float:
            now = time.monotonic()
            timings[name] = round(now - t0, 3)
            return now

        t = time.monotonic()
        debs = debian.download(packages, cache_dir() / "debs")
        t = step("download", t)
        debian.extract(debs, staging)
        debian.install_ca_bundle(staging)
        debian.install_alternatives(staging, debs)
        t = step("extract", t)
        prune(staging)
        t = step("prune", t)
        check_libraries(staging)
        t = step("check-libraries", t)
        install_busybox_links(staging)
        install_base_files(staging)
        install_agent(staging, agent)
        t = step("layout", t)
        compiled = compile_tree(staging)
        t = step("compile", t)
        archive = out / ARCHIVE_NAME
        with open(archive, "wb") as f:
            size = cpio.write_cpio(f, [*cpio.entries_from_tree(staging, BASE_OWNERS), *device_entries()])
            f.flush()
            os.fsync(f.fileno())
        step("archive", t)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    total = time.monotonic() - started
    manifest = {
        "recipe_version": RECIPE_VERSION,
        "packages": [p.pin() for p in packages],
        "agent_files": [rel for rel, _ in agent],
        "compiled_modules": compiled,
        "archive_bytes": size,
        "step_seconds": timings,
        "build_seconds": round(total, 3),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "build-seconds").write_text(f"{total:.1f}\n")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def prune(root: Path) -> None:
    """Remove what a guest never needs (see ``PRUNED_*``)."""
    for rel in PRUNED_PATHS:
        _remove(root / rel)
    stdlib = root / GUEST_STDLIB
    if not stdlib.is_dir():
        raise ImageBuildError("prune", f"{stdlib} is missing; did libpython3.11-minimal extract?")
    for dirpath, dirnames, _ in os.walk(stdlib):
        for name in [d for d in dirnames if d in PRUNED_DIR_NAMES]:
            shutil.rmtree(Path(dirpath) / name)
            dirnames.remove(name)
    dynload = stdlib / "lib-dynload"
    for module in PRUNED_EXTENSIONS:
        for path in dynload.glob(f"{module}.cpython-*.so"):
            path.unlink()


def resolve_in_root(root: Path, guest_path: str) -> Path | None:
    """Follow ``guest_path`` as the guest would, with ``root`` as ``/``.

    Absolute symlink targets are taken relative to ``root``, never the host.
    Returns the host path of what it names, or None if it does not exist.
    """
    parts = list(PurePosixPath(guest_path).parts)
    if parts and parts[0] == "/":
        parts = parts[1:]
    current: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if current:
                current.pop()
            continue
        candidate = root.joinpath(*current, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                return None
            target = PurePosixPath(os.readlink(candidate))
            if target.is_absolute():
                current = []
                parts = list(target.parts[1:]) + parts
            else:
                parts = list(target.parts) + parts
            continue
        if not os.path.lexists(candidate):
            return None
        current.append(part)
    return root.joinpath(*current)


def _regular_files(root: Path) -> Iterator[Path]:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink() and path.is_file():
                yield path


def check_libraries(root: Path) -> None:
    """Fail unless every ELF file's interpreter and needed libraries are in ``root``."""
    problems: list[str] = []
    for path in _regular_files(root):
        if not elf.is_elf(path):
            continue
        try:
            deps = elf.read_deps(path)
        except elf.ElfError as err:
            problems.append(str(err))
            continue
        rel = path.relative_to(root).as_posix()
        if deps.interpreter and resolve_in_root(root, deps.interpreter) is None:
            problems.append(f"/{rel}: interpreter {deps.interpreter} is missing")
        for soname in deps.needed:
            if not any(resolve_in_root(root, f"{d}/{soname}") for d in LIBRARY_DIRS):
                problems.append(f"/{rel}: needs {soname}, which no allowed package provides")
    if problems:
        raise ImageBuildError(
            "check-libraries",
            "; ".join(sorted(problems)[:20])
            + ". Add the Debian package that ships the library to debian.ALLOW, or prune "
            "the file that needs it (initramfs.PRUNED_*)",
        )


def install_busybox_links(root: Path) -> None:
    busybox = root / "bin/busybox"
    try:
        listing = subprocess.run(
            [str(busybox), "--list-full"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise ImageBuildError(
            "busybox", f"could not list applets with {busybox} --list-full ({err}); "
            "the build host must be able to run the x86-64 busybox-static binary"
        ) from err
    for rel in listing.split():
        link = root / rel
        if os.path.lexists(link):
            continue  # a package's real program wins over the applet
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("/bin/busybox")


def install_base_files(root: Path) -> None:
    for rel, perm in BASE_DIRS.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel).chmod(perm)
    for rel, text in BASE_FILES.items():
        (root / rel).write_text(text)
        (root / rel).chmod(0o644)
    for rel, target in BASE_SYMLINKS.items():
        _remove(root / rel)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).symlink_to(target)


def install_agent(root: Path, agent: list[tuple[str, Path]]) -> None:
    package = root / AGENT_ROOT / "vmfork"
    for rel, source in agent:
        dest = package / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
        dest.chmod(0o644)
    init = root / "init"
    init.write_text(INIT_SCRIPT)
    init.chmod(0o755)


def device_entries() -> list[cpio.CpioEntry]:
    return [cpio.char_device(p, major, minor, perm)
            for p, (major, minor, perm) in DEVICE_NODES.items()]


_GUEST_MAGIC = re.compile(
    r"^MAGIC_NUMBER = \((\d+)\)\.to_bytes\(2, 'little'\) \+ b'\\r\\n'$", re.MULTILINE
)


def check_bytecode_compatible(root: Path) -> None:
    """Fail unless this interpreter writes ``.pyc`` files the guest's CPython accepts.

    The stdlib is compiled by the host's Python (the build may not be able to
    run the guest's). Bytecode is compatible iff the magic numbers match; within
    3.11 they do (3495 for every 3.11.x release), which this checks rather than assumes.
    """
    source = (root / GUEST_STDLIB / "importlib/_bootstrap_external.py").read_text()
    m = _GUEST_MAGIC.search(source)
    if m is None:
        raise ImageBuildError("compile", "cannot find MAGIC_NUMBER in the guest's importlib")
    guest = int(m.group(1)).to_bytes(2, "little") + b"\r\n"
    if guest != importlib.util.MAGIC_NUMBER or sys.implementation.cache_tag != "cpython-311":
        raise ImageBuildError(
            "compile",
            f"the guest's CPython expects bytecode magic {guest!r} but this is "
            f"{sys.version.split()[0]} with {importlib.util.MAGIC_NUMBER!r}; "
            "build images with Python 3.11",
        )


def _compile_one(job: tuple[str, str, str]) -> str | None:
    source, cfile, dfile = job
    try:
        py_compile.compile(source, cfile=cfile, dfile=dfile, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    except py_compile.PyCompileError as err:
        return f"{dfile}: {err.msg.strip().splitlines()[-1]}"
    return None


SITE_DIRS = ("usr/lib/python3/dist-packages", "usr/local/lib/python3.11/dist-packages")


def extra_tops(root: Path) -> list[Path]:
    """The site-packages directories of the guest's 3.11 that exist (pip, users' wheels)."""
    return [root / d for d in SITE_DIRS if (root / d).is_dir()]


def compile_jobs(root: Path) -> list[tuple[str, str, str]]:
    """``(source to read, .pyc to write, path shown in tracebacks)`` per guest module.

    Symlinked modules are read through ``resolve_in_root``: Debian links a few
    stdlib files to absolute paths, which on the host would name the host's files.
    """
    jobs: list[tuple[str, str, str]] = []
    for top in (root / GUEST_STDLIB, root / AGENT_ROOT, *extra_tops(root)):
        for dirpath, _, filenames in os.walk(top):
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = Path(dirpath) / name
                guest = "/" + path.relative_to(root).as_posix()
                real = resolve_in_root(root, guest)
                if real is None or not real.is_file():
                    continue  # a dangling link: nothing to import, nothing to compile
                tag = sys.implementation.cache_tag
                cfile = path.parent / "__pycache__" / f"{name[:-3]}.{tag}.pyc"
                jobs.append((str(real), str(cfile), guest))
    return jobs


def compile_tree(root: Path) -> int:
    """Precompile the guest's stdlib and agent; return the number of modules.

    Unchecked-hash pycs are used because the archive's mtimes are all 0: a
    timestamp pyc would never match its source, and a checked-hash pyc would
    make every import hash its source. The files are immutable in the guest.
    """
    check_bytecode_compatible(root)
    jobs = compile_jobs(root)
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(_compile_one, jobs, chunksize=32))
    # The stdlib and the agent must compile; a package in site-packages may carry files
    # that are not meant to (templates, other Pythons' code): those import as they would
    # anywhere, failing only if someone imports them.
    strict = (f"/{GUEST_STDLIB}/", f"/{AGENT_ROOT}/")
    failures = [f for f in results if f and f.startswith(strict)]
    if failures:
        raise ImageBuildError("compile", "these modules do not compile: " + "; ".join(failures))
    for (_, cfile, _), failure in zip(jobs, results, strict=True):
        if failure:
            continue
        os.chmod(cfile, 0o644)
        os.chmod(Path(cfile).parent, 0o755)
    return len(jobs)


# -- the boot initramfs of an image with a root disk (issue 13) ------------------------

BOOT_RECIPE_VERSION = "1"
BOOT_AGENT_DIR = "vmfork-agent"          # in the boot initramfs; copied into the new root
GUEST_AGENT_DIR = "/opt/vmfork/agent"    # where the agent lives in a disk-rooted guest
AGENT_PYTHON_FILE = ".vmfork/agent-python"   # in the disk: the agent's interpreter command

# The agent's entry in a disk-rooted guest. `-I` (not `-IS`): the agent runs on the
# image's interpreter *with* its site-packages, so warm-up imports and eval see the
# user's packages. The agent's own directory goes on sys.path first.
GUEST_INIT_PY = f"""\
# PID 1 of a vmfork guest booted from a root disk: the vmfork agent, stdlib only.
import sys

sys.path.insert(0, "{GUEST_AGENT_DIR}")

from vmfork.agent.main import main

raise SystemExit(main())
"""

# PID 1 of the boot initramfs: mount the image's disk read-only, put an overlay with a
# tmpfs upper layer on it (every write stays in this guest's RAM: no disk is ever
# writable, DESIGN decision 3), copy the agent in, and hand over to the agent on the
# interpreter the builder chose (the image's own Python, or the bundled one under
# /opt/vmfork/python). switch_root frees the initramfs's RAM. Any failure prints why
# and ends PID 1, which panics the kernel: the host sees the reason on the console.
BOOT_INIT_SCRIPT = f"""\
#!/bin/busybox sh
# PID 1 of a vmfork guest with a root disk (vmfork.image.initramfs.BOOT_INIT_SCRIPT).
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
fail() {{ echo "vmfork-init: $*" >/dev/console; exit 1; }}
mount -t proc proc /proc || fail "cannot mount /proc"
mount -t devtmpfs devtmpfs /dev || fail "cannot mount /dev"
fstype=squashfs
build=
for word in $(cat /proc/cmdline); do
  case "$word" in
    vmfork.rootfs=*) fstype=${{word#vmfork.rootfs=}} ;;
    vmfork.build=1) build=1 ;;
  esac
done
i=0
while [ ! -b /dev/vda ]; do
  i=$((i + 1)); [ $i -gt 500 ] && fail "no root disk (/dev/vda) appeared"; usleep 10000
done
mkdir -p /lower /rw /newroot
# noload: an ext4 rootfs from elsewhere may carry a journal to replay, and replaying it
# would write the read-only disk (the mount would fail on the device's IOERR).
opts=ro; [ "$fstype" = ext4 ] && opts=ro,noload
mount -t "$fstype" -o $opts /dev/vda /lower || fail "cannot mount the root disk ($fstype)"
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "cannot mount the overlay's tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \\
  || fail "cannot mount the root overlay"
mkdir -p /newroot{GUEST_AGENT_DIR} /newroot/proc /newroot/sys /newroot/dev /newroot/tmp \\
  || fail "cannot make the agent's directories in the root"
cp -a /{BOOT_AGENT_DIR}/. /newroot{GUEST_AGENT_DIR}/ || fail "cannot copy the agent"
# A disk vmfork built names the agent's interpreter; a rootfs from elsewhere (forkd's
# POST /v1/snapshots body) does not, and its own Python 3.9+ is used if it has one.
if ! read -r python 2>/dev/null < /newroot/{AGENT_PYTHON_FILE}; then
  python=
  for candidate in /usr/bin/python3 /usr/local/bin/python3 /bin/python3; do
    # chroot, not a test of the path: the rootfs's links may be absolute.
    if chroot /newroot "$candidate" -I -c \\
        'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
      python=$candidate; break
    fi
  done
  [ -n "$python" ] || fail "the root file system has no Python 3.9 or newer for vmfork's \\
agent (looked for /{AGENT_PYTHON_FILE}, /usr/bin/python3, /usr/local/bin/python3, \\
/bin/python3): install python3 in it, or build a vmfork image (vmfork image build)"
fi
# A build VM (an image's --run step): the overlay's tmpfs, upper directory and all,
# stays reachable in the new root, so the agent can export what the step changed
# (vmfork.agent.upper). Ordinary guests never see it.
if [ -n "$build" ]; then
  mkdir -p /newroot/.vmfork-rw && mount -o move /rw /newroot/.vmfork-rw \
    || fail "cannot move the overlay's tmpfs into the build VM's root"
fi
umount /dev
umount /proc
exec switch_root /newroot $python {GUEST_AGENT_DIR}/init.py
"""

_BOOT_DIRS = ("bin", "dev", "proc", "sys", "lower", "rw", "newroot", BOOT_AGENT_DIR)


def build_boot_initramfs(vmfork_source: Path | None = None) -> Initramfs:
    """The cached initramfs that boots a disk-rooted image: busybox, ``BOOT_INIT_SCRIPT``
    and the agent's source (compiled for 3.11; other interpreters compile it at start)."""
    busybox = [p for p in debian.resolve_packages() if p.name == "busybox-static"]
    agent = agent_files(vmfork_source or default_vmfork_source())
    parts: list[str | bytes | Path] = [f"boot recipe {BOOT_RECIPE_VERSION}",
                                       *_RECIPE_SOURCES, *(p.pin() for p in busybox)]
    for rel, source in agent:
        parts += [f"agent {rel}", source]
    parts += [BOOT_INIT_SCRIPT, GUEST_INIT_PY]
    key = hash_inputs(parts)

    def build(out: Path) -> None:
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out.parent))
        extracted = Path(tempfile.mkdtemp(prefix=".busybox-", dir=out.parent))
        try:
            debian.extract(debian.download(busybox, cache_dir() / "debs"), extracted)
            for rel in _BOOT_DIRS:
                (staging / rel).mkdir(parents=True, exist_ok=True)
            shutil.copy2(extracted / "bin/busybox", staging / "bin/busybox")
            install_busybox_links(staging)
            package = staging / BOOT_AGENT_DIR / "vmfork"
            for rel, source in agent:
                (package / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, package / rel)
            (staging / BOOT_AGENT_DIR / "init.py").write_text(GUEST_INIT_PY)
            init = staging / "init"
            init.write_text(BOOT_INIT_SCRIPT)
            init.chmod(0o755)
            with open(out / ARCHIVE_NAME, "wb") as f:
                cpio.write_cpio(f, [*cpio.entries_from_tree(staging, BASE_OWNERS), *device_entries()])
                f.flush()
                os.fsync(f.fileno())
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(extracted, ignore_errors=True)
        (out / "build-seconds").write_text(f"{time.monotonic() - started:.1f}\n")

    entry, built_now = cached_entry("initramfs", key, build)
    seconds_file = entry / "build-seconds"
    seconds = float(seconds_file.read_text()) if seconds_file.is_file() else None
    return Initramfs(key, entry / ARCHIVE_NAME, built_now, seconds)
