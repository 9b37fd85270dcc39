"""Users' guest images: a root tree built from a definition, on a read-only disk.

``build(name, spec)`` turns an ``ImageSpec`` into a root file system image
(squashfs or erofs; or, with ``root="initramfs"``, an initramfs) and records the
image. Recipe, each step named (a failure says which):

1. ``base``: the root tree to start from -- the default image's packages (the same
   pinned Debian packages as its initramfs, with pip, bash, CA certificates and
   libstdc++), another image's disk, or an imported OCI image;
2. ``apt``: the requested Debian packages and their closure, pinned by apt's solver
   (``debian.resolve_extra_packages``), extracted without maintainer scripts (their
   alternatives' links and the CA bundle are made here);
3. ``pip``: wheels for the image's interpreter, resolved and downloaded on the host
   (``pip download`` for the guest's platform and Python version), installed into its
   site-packages; console scripts get the guest's interpreter;
4. ``npm``: packages installed from a lock resolved on the host into
   ``/usr/local/lib/node-packages`` (``NODE_PATH`` points there; bins are linked into
   ``/usr/local/bin``); Debian's ``nodejs`` runs them (add it with ``--apt nodejs``);
5. ``copy``: host files and directories, owned by root, modes kept;
6. ``agent``: ``/.vmfork/image.json`` (env, workdir, user) and the agent's interpreter:
   the image's own Python 3.9+ if it has one, else a bundled 3.11 kept apart under
   ``/opt/vmfork/python`` (its own loader and libraries, never on the image's paths);
7. ``compile``: the guest 3.11's site-packages to ``.pyc``;
8. ``disk``: the tree as one read-only file-system image.

Content addressing: the key hashes the recipe, the base's key, every pinned package
(name, version, SHA-256), every wheel's SHA-256, the npm lock file, every copied
file's path, mode and SHA-256, and the env/workdir/user, so an unchanged definition
reuses its disk (``disk-builds/<key>/``) and any changed input builds a new one. The
disk itself is then named by the SHA-256 of its bytes (``disks/<sha256>/root.img``, a
hard link): that is what snapshots record and what a pack's disk is checked against.
Everything is built in a temporary directory and renamed into place
(``cache.cached_entry``); the record is written last, so a failed build leaves no
image and no half-written disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vmfork.image import (
    DEFAULT_CMDLINE,
    DEFAULT_NAME,
    DISK_FILE,
    GuestImage,
    debian,
    disk_path,
    entry_build_seconds,
    initramfs,
    read_record,
    validate_name,
    write_record,
)
from vmfork.image.cache import cached_entry, hash_inputs
from vmfork.image.errors import ImageBuildError, ImageError
from vmfork.image.spec import ImageSpec
from vmfork.paths import cache_dir

RECIPE_VERSION = "1"
NODE_PACKAGES = "usr/local/lib/node-packages"
BUNDLED_PYTHON = "opt/vmfork/python"
IMAGE_JSON = ".vmfork/image.json"
MIN_AGENT_PYTHON = (3, 9)
# The bundled interpreter runs through its own loader with its own libraries, so it
# works on any image (musl, no libc at all) and never reads the image's libraries.
BUNDLED_PYTHON_CMD = (f"/{BUNDLED_PYTHON}/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "
                      f"--library-path /{BUNDLED_PYTHON}/lib/x86_64-linux-gnu:"
                      f"/{BUNDLED_PYTHON}/usr/lib/x86_64-linux-gnu "
                      f"/{BUNDLED_PYTHON}/usr/bin/python3.11 -I")
# Packages of the default image's interpreter: what the bundled Python is made of.
_BUNDLE_SKIP = {"busybox-static", "bash", "python3-pip", "python3-setuptools",
                "python3-wheel", "python3-pkg-resources", "ca-certificates", "openssl",
                "base-files", "debianutils", "mawk", "libstdc++6"}

PIP_PLATFORMS = ("manylinux_2_36_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64",
                 "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                 "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64")
STEP_TIMEOUT = 3600

Progress = Callable[[str, str], None]   # (step, message)
_SOURCES = tuple(Path(__file__).resolve().parent / n
                 for n in ("builder.py", "debian.py", "initramfs.py", "spec.py"))


def _quiet(step: str, message: str) -> None:
    pass


@dataclass
class _Plan:
    """Everything a disk is built from, resolved (so it can be hashed) before building."""

    spec: ImageSpec
    base_parts: list[str | bytes | Path]
    base_packages: list[debian.DebPackage] = field(default_factory=list)
    base_disk: Path | None = None
    base_disk_format: str | None = None
    base_record: GuestImage | None = None
    oci_ref: str | None = None
    oci_options: dict[str, Any] = field(default_factory=dict)
    apt: list[debian.DebPackage] = field(default_factory=list)
    wheels: list[Path] = field(default_factory=list)
    npm_lock: bytes | None = None
    npm_manifest: bytes | None = None
    copies: list[tuple[str, str, int, str]] = field(default_factory=list)  # dest, rel, mode, hash

    def key(self) -> str:
        parts: list[str | bytes | Path] = [f"user image recipe {RECIPE_VERSION}", *_SOURCES]
        parts += self.base_parts
        parts += [p.pin() for p in self.apt]
        parts += [f"wheel {w.name} {debian.sha256_file(w)}" for w in self.wheels]
        if self.npm_lock is not None and self.npm_manifest is not None:
            parts += [b"npm-manifest", self.npm_manifest, b"npm-lock", self.npm_lock]
        parts += [f"copy {d} {r} {m:o} {h}" for d, r, m, h in self.copies]
        parts += [f"env {k}={v}" for k, v in self.spec.env]
        parts += [f"workdir {self.spec.workdir}", f"user {self.spec.user}",
                  f"format {self.spec.disk_format}", f"root {self.spec.root}"]
        return hash_inputs(parts)


def _run(step: str, cmd: list[str], *, cwd: Path | None = None,
         env: dict[str, str] | None = None, timeout: float = STEP_TIMEOUT) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except FileNotFoundError as err:
        raise ImageBuildError(step, f"{cmd[0]} is not installed (run the set-up, "
                                    "./scripts/demo, or install it)") from err
    except subprocess.TimeoutExpired as err:
        raise ImageBuildError(step, f"`{' '.join(cmd[:4])} ...` took over {timeout:.0f} s") \
            from err
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        raise ImageBuildError(step, f"`{' '.join(cmd[:6])} ...` failed:\n{tail}")
    return proc.stdout


# -- resolving the inputs --------------------------------------------------------------


def _base_packages() -> list[debian.DebPackage]:
    return debian.resolve_packages()


def _resolve_base(spec: ImageSpec) -> _Plan:
    if spec.base in (None, DEFAULT_NAME):
        packages = _base_packages()
        return _Plan(spec, ["base default", f"initramfs recipe {initramfs.RECIPE_VERSION}",
                            *(p.pin() for p in packages)], base_packages=packages)
    base = read_record(validate_name(spec.base))
    if base.disk_key is None:
        # A default-content image under another name: the same packages.
        packages = _base_packages()
        return _Plan(spec, ["base default", *(p.pin() for p in packages)],
                     base_packages=packages)
    disk = base.disk
    assert disk is not None
    if not disk.is_file():
        raise ImageBuildError("base", f"image {spec.base!r}'s disk {disk} is missing; "
                                      f"rebuild {spec.base!r} first")
    return _Plan(spec, [f"base disk {base.disk_key}"], base_disk=disk,
                 base_disk_format=base.disk_format, base_record=base)


def _pip_target(python: tuple[int, int]) -> list[str]:
    major, minor = python
    args = ["--only-binary=:all:", "--implementation", "cp",
            "--python-version", f"{major}.{minor}", "--abi", f"cp{major}{minor}"]
    for platform in PIP_PLATFORMS:
        args += ["--platform", platform]
    return args


def _pip_source(spec: ImageSpec) -> list[str]:
    args: list[str] = []
    if spec.pip_no_index:
        args.append("--no-index")
    if spec.pip_index_url:
        args += ["--index-url", spec.pip_index_url]
    for link in spec.pip_find_links:
        args += ["--find-links", link]
    return args


def _resolve_wheels(spec: ImageSpec, python: tuple[int, int], scratch: Path,
                    progress: Progress) -> list[Path]:
    """Download the wheels the requirements resolve to, for the guest's interpreter."""
    if not spec.pip and spec.requirements is None:
        return []
    progress("pip", f"resolving {len(spec.pip)} requirement(s) for CPython "
                    f"{python[0]}.{python[1]} manylinux x86-64")
    dest = scratch / "wheels"
    dest.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
           "--dest", str(dest), *_pip_target(python), *_pip_source(spec)]
    if spec.requirements is not None:
        cmd += ["--requirement", str(spec.requirements)]
    cmd += list(spec.pip)
    env = {**os.environ, "PIP_CACHE_DIR": str(cache_dir() / "pip")}
    try:
        _run("pip", cmd, env=env)
    except ImageBuildError as err:
        raise ImageBuildError("pip", f"{err}\n(the guest installs wheels only: each "
                                     "requirement needs a wheel for CPython "
                                     f"{python[0]}.{python[1]} on manylinux x86-64 or a "
                                     "pure-Python wheel)") from None
    wheels = sorted(dest.glob("*.whl"))
    others = sorted(p.name for p in dest.iterdir() if p.suffix != ".whl")
    if others:
        raise ImageBuildError("pip", f"pip fetched non-wheel files {others[:5]}; the guest "
                                     "installs wheels only")
    progress("pip", f"{len(wheels)} wheel(s), {sum(w.stat().st_size for w in wheels) >> 20}"
                    " MiB")
    return wheels


def _resolve_npm(spec: ImageSpec, scratch: Path, progress: Progress) -> tuple[bytes, bytes]:
    """``(package.json, package-lock.json)`` for the requested packages, resolved by npm."""
    project = scratch / "npm"
    project.mkdir()
    deps: dict[str, str] = {}
    for word in spec.npm:
        at = word.rfind("@")
        name, version = (word[:at], word[at + 1:]) if at > 0 else (word, "*")
        deps[name] = version
    manifest = json.dumps({"name": "vmfork-image-node-packages", "private": True,
                           "dependencies": deps}, indent=2, sort_keys=True).encode()
    (project / "package.json").write_bytes(manifest)
    progress("npm", f"resolving {len(deps)} package(s)")
    _run("npm", ["npm", "install", "--package-lock-only", "--no-audit", "--no-fund",
                 "--ignore-scripts", "--cache", str(cache_dir() / "npm")], cwd=project)
    return manifest, (project / "package-lock.json").read_bytes()


def _walk_copy(source: Path) -> Iterator[tuple[str, Path]]:
    if not source.is_dir() or source.is_symlink():
        yield "", source
        return
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames.sort()
        base = Path(dirpath)
        rel = base.relative_to(source).as_posix()
        yield ("" if rel == "." else rel), base
        for name in sorted(filenames):
            path = base / name
            yield path.relative_to(source).as_posix(), path


def _hash_copies(spec: ImageSpec) -> list[tuple[str, str, int, str]]:
    out: list[tuple[str, str, int, str]] = []
    for copy in spec.copy:
        for rel, path in _walk_copy(copy.source):
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                digest = "link:" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                digest = debian.sha256_file(path)
            elif stat.S_ISDIR(st.st_mode):
                digest = "dir"
            else:
                raise ImageBuildError("copy", f"{path} is not a file, directory or symlink")
            out.append((copy.dest, rel, stat.S_IMODE(st.st_mode), digest))
    return out


# -- building the tree -----------------------------------------------------------------


def _extract_disk(disk: Path, fmt: str | None, dest: Path) -> None:
    if mount_type(fmt or "") == "erofs":
        _run("base", ["fsck.erofs", f"--extract={dest}", str(disk)])
    else:
        dest.rmdir()
        _run("base", ["unsquashfs", "-q", "-n", "-d", str(dest), str(disk)])


def _default_tree(root: Path, packages: list[debian.DebPackage]) -> None:
    """The default image's root (what its initramfs holds, without the agent)."""
    debs = debian.download(packages, cache_dir() / "debs")
    debian.extract(debs, root)
    debian.install_ca_bundle(root)
    debian.install_alternatives(root, debs)
    initramfs.prune(root)
    initramfs.install_busybox_links(root)
    initramfs.install_base_files(root)


def _prune_docs(root: Path) -> None:
    for rel in ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/lintian",
                "usr/share/bug"):
        path = root / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)


def find_python(root: Path) -> tuple[str, tuple[int, int]] | None:
    """The image's own CPython 3.9+ (``/usr/local/bin`` first, as images put theirs
    there), judged from its files, never by running it: an image is untrusted input
    and nothing of it runs on the host."""
    found: list[tuple[tuple[int, int], str]] = []
    for bindir, libdir in (("usr/local/bin", "usr/local/lib"), ("usr/bin", "usr/lib")):
        bin_path = root / bindir
        if not bin_path.is_dir():
            continue
        for path in bin_path.glob("python3.*"):
            m = re.fullmatch(r"python3\.(\d{1,2})", path.name)
            if not m:
                continue
            version = (3, int(m.group(1)))
            real = initramfs.resolve_in_root(root, f"/{bindir}/{path.name}")
            stdlib = initramfs.resolve_in_root(root, f"/{libdir}/python3.{version[1]}/os.py")
            if version >= MIN_AGENT_PYTHON and real is not None and real.is_file() \
                    and stdlib is not None:
                found.append((version, f"/{bindir}/{path.name}"))
        if found:
            break
    if not found:
        return None
    best_version, best_path = max(found)
    return best_path, best_version


def _install_bundled_python(root: Path, progress: Progress) -> None:
    progress("agent", "the image has no Python 3.9+: bundling vmfork's under /opt/vmfork/python")
    packages = [p for p in _base_packages() if p.name not in _BUNDLE_SKIP]
    dest = root / BUNDLED_PYTHON
    dest.mkdir(parents=True, exist_ok=True)
    debian.extract(debian.download(packages, cache_dir() / "debs"), dest)
    initramfs.prune(dest)
    initramfs.compile_tree(dest)
    _prune_docs(dest)


def _site_packages(root: Path, python: tuple[int, int]) -> Path:
    """Where pip would install for the image's interpreter (Debian's layout puts
    ``/usr/local/lib/python3.X/dist-packages`` on its path, upstream's ``site-packages``)."""
    debian_layout = (root / "usr/lib/python3/dist-packages").is_dir()
    name = "dist-packages" if debian_layout else "site-packages"
    return root / "usr/local/lib" / f"python3.{python[1]}" / name


def _install_wheels(root: Path, wheels: list[Path], python_cmd: str,
                    python: tuple[int, int], progress: Progress) -> None:
    target = _site_packages(root, python)
    target.mkdir(parents=True, exist_ok=True)
    progress("pip", f"installing {len(wheels)} wheel(s) into "
                    f"/{target.relative_to(root).as_posix()}")
    scratch = Path(tempfile.mkdtemp(prefix=".pip-", dir=root.parent))
    try:
        _run("pip", [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                     "--no-index", "--no-deps", "--no-compile", "--target", str(scratch),
                     *_pip_target(python), *map(str, wheels)],
             env={**os.environ, "PIP_CACHE_DIR": str(cache_dir() / "pip")})
        scripts = scratch / "bin"
        if scripts.is_dir():
            bindir = root / "usr/local/bin"
            bindir.mkdir(parents=True, exist_ok=True)
            interpreter = python_cmd.split()[0]
            for script in sorted(scripts.iterdir()):
                _retarget_script(script, interpreter)
                shutil.move(str(script), bindir / script.name)
            scripts.rmdir()
        for item in sorted(scratch.iterdir()):
            dest = target / item.name
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            elif os.path.lexists(dest):
                dest.unlink()
            shutil.move(str(item), dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _retarget_script(script: Path, interpreter: str) -> None:
    """pip wrote the host's interpreter into console scripts; the guest's runs them."""
    data = script.read_bytes()
    if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
        rest = data.split(b"\n", 1)[1] if b"\n" in data else b""
        script.write_bytes(f"#!{interpreter}\n".encode() + rest)
    script.chmod(0o755)


def _install_npm(root: Path, manifest: bytes, lock: bytes, progress: Progress) -> None:
    project = root / NODE_PACKAGES
    project.mkdir(parents=True, exist_ok=True)
    (project / "package.json").write_bytes(manifest)
    (project / "package-lock.json").write_bytes(lock)
    progress("npm", "installing from the lock into /" + NODE_PACKAGES)
    # --ignore-scripts: install scripts would run on the host, and a native addon
    # built here would be built for the host's Node, not the guest's.
    _run("npm", ["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts",
                 "--cache", str(cache_dir() / "npm")], cwd=project)
    bindir = root / "usr/local/bin"
    bindir.mkdir(parents=True, exist_ok=True)
    dot_bin = project / "node_modules/.bin"
    if dot_bin.is_dir():
        for link in sorted(dot_bin.iterdir()):
            target = os.path.realpath(link)
            guest = "/" + Path(target).relative_to(root.resolve()).as_posix()
            dest = bindir / link.name
            if not os.path.lexists(dest):
                dest.symlink_to(guest)


def _copy_in(root: Path, spec: ImageSpec, progress: Progress) -> None:
    for copy in spec.copy:
        dest = root / copy.dest.lstrip("/")
        progress("copy", f"{copy.source} -> {copy.dest}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(dest) and not dest.is_dir():
            dest.unlink()
        if copy.source.is_dir():
            shutil.copytree(copy.source, dest, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(copy.source, dest, follow_symlinks=False)
        for dirpath, dirnames, filenames in os.walk(dest if dest.is_dir() else dest.parent):
            for name in [*dirnames, *filenames]:
                os.lchown(Path(dirpath) / name, 0, 0)
            if not dest.is_dir():
                break


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def mount_type(fmt: str) -> str:
    """The guest's file-system type for a disk format (``vmfork.rootfs=`` for /init)."""
    return "erofs" if fmt in ("erofs", "erofs-plain") else "squashfs"


def make_disk(tree: Path, out: Path, fmt: str) -> None:
    """``tree`` as a read-only file-system image at ``out``; timestamps fixed at 0 so the
    same tree makes the same bytes."""
    if mount_type(fmt) == "erofs":
        compress = ["-zlz4hc"] if fmt == "erofs" else []
        _run("disk", ["mkfs.erofs", *compress, "-T0", str(out), str(tree)])
    else:
        comp = "lz4" if fmt == "squashfs-lz4" else "zstd"
        _run("disk", ["mksquashfs", str(tree), str(out), "-noappend", "-quiet",
                      "-no-progress", "-comp", comp, "-b", "128K", "-mkfs-time", "0",
                      "-all-time", "0", "-processors", str(os.cpu_count() or 1)])
    # virtio-blk serves whole 512-byte sectors
    size = out.stat().st_size
    if size % 512:
        with open(out, "ab") as f:
            f.write(b"\0" * (512 - size % 512))


@dataclass(frozen=True)
class _Agent:
    python_cmd: str
    python_version: tuple[int, int]
    bundled: bool


def _choose_agent_python(root: Path, progress: Progress) -> _Agent:
    found = find_python(root)
    if found is not None:
        path, version = found
        progress("agent", f"the agent runs on the image's {path} "
                          f"({version[0]}.{version[1]}) with its site-packages")
        return _Agent(f"{path} -I", version, False)
    _install_bundled_python(root, progress)
    return _Agent(BUNDLED_PYTHON_CMD, (3, 11), True)


def _write_image_json(root: Path, spec: ImageSpec, env: list[str], workdir: str | None,
                      user: str | None, agent: _Agent) -> None:
    meta = root / IMAGE_JSON
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"env": env, "workdir": workdir, "user": user,
                                "agent_python": agent.python_cmd,
                                "agent_python_bundled": agent.bundled}, indent=2) + "\n")
    (root / initramfs.AGENT_PYTHON_FILE).write_text(agent.python_cmd + "\n")
    if workdir is not None:
        (root / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)


def _merged_env(base: tuple[str, ...], spec: ImageSpec, node: bool) -> list[str]:
    env: dict[str, str] = {}
    for word in base:
        k, _, v = word.partition("=")
        env[k] = v
    if node:
        env["NODE_PATH"] = f"/{NODE_PACKAGES}/node_modules"
    for k, v in spec.env:
        env[k] = v
    return [f"{k}={v}" for k, v in env.items()]


def _build_disk(out: Path, plan: _Plan, progress: Progress) -> None:
    spec = plan.spec
    timings: dict[str, float] = {}
    root = Path(tempfile.mkdtemp(prefix=".root-", dir=out.parent))
    t = time.monotonic()

    def step(name: str) -> None:
        nonlocal t
        now = time.monotonic()
        timings[name] = round(timings.get(name, 0.0) + now - t, 3)
        t = now

    try:
        base_env: tuple[str, ...] = ()
        workdir, user = spec.workdir, spec.user
        if plan.oci_ref is not None:
            from vmfork.image.oci import import_image

            progress("base", f"importing {plan.oci_ref}")
            config = import_image(plan.oci_ref, root, **plan.oci_options,
                                      progress=lambda what, done, total: progress(
                                          "base", f"{what} {done >> 20}"
                                          + (f"/{total >> 20}" if total else "") + " MiB"))
            base_env = tuple(config.env)
            workdir = workdir or config.working_dir or None
            user = user or config.user or None
        elif plan.base_disk is not None:
            progress("base", f"unpacking {plan.base_disk}")
            _extract_disk(plan.base_disk, plan.base_disk_format, root)
            assert plan.base_record is not None
            base_env = plan.base_record.env
            workdir = workdir or plan.base_record.workdir
            user = user or plan.base_record.user
        else:
            progress("base", f"{len(plan.base_packages)} Debian packages (the default image)")
            _default_tree(root, plan.base_packages)
        step("base")
        if plan.apt:
            progress("apt", f"{len(plan.apt)} package(s): "
                            + " ".join(p.name for p in plan.apt[:12])
                            + (" ..." if len(plan.apt) > 12 else ""))
            debs = debian.download(plan.apt, cache_dir() / "debs")
            debian.extract(debs, root)
            debian.install_ca_bundle(root)
            debian.install_alternatives(root, debs)
            _prune_docs(root)
            step("apt")
        agent = _choose_agent_python(root, progress)
        step("agent")
        if plan.wheels:
            if agent.bundled:
                raise ImageBuildError("pip", "the image has no Python 3.9+ to install wheels "
                                             "for; add one (--apt python3) or drop --pip")
            _install_wheels(root, plan.wheels, agent.python_cmd, agent.python_version,
                            progress)
            step("pip")
        if plan.npm_lock is not None and plan.npm_manifest is not None:
            _install_npm(root, plan.npm_manifest, plan.npm_lock, progress)
            step("npm")
        if spec.copy:
            _copy_in(root, spec, progress)
            step("copy")
        env = _merged_env(base_env, spec, plan.npm_lock is not None)
        _write_image_json(root, spec, env, workdir, user, agent)
        if (root / initramfs.GUEST_STDLIB / "os.py").is_file() and not agent.bundled \
                and agent.python_version == (3, 11):
            progress("compile", "the standard library and site-packages to bytecode")
            initramfs.compile_tree(root)
            step("compile")
        tree_bytes = _tree_bytes(root)
        if spec.root == "initramfs":
            progress("disk", f"an initramfs of {tree_bytes >> 20} MiB of files (the root "
                             "in guest RAM)")
            _make_initramfs(root, out / initramfs.ARCHIVE_NAME, agent)
            output = out / initramfs.ARCHIVE_NAME
        else:
            progress("disk", f"{spec.disk_format} image of {tree_bytes >> 20} MiB of files")
            make_disk(root, out / DISK_FILE, spec.disk_format)
            output = out / DISK_FILE
        step("disk")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    disk_bytes = output.stat().st_size
    total = round(sum(timings.values()), 3)
    manifest = {"recipe_version": RECIPE_VERSION, "definition": spec.summary(),
                "content_key": disk_content_key(output), "root": spec.root,
                "apt": [p.pin() for p in plan.apt],
                "wheels": [f"{w.name} sha256:{debian.sha256_file(w)}" for w in plan.wheels],
                "copies": len(plan.copies), "tree_bytes": tree_bytes,
                "disk_bytes": disk_bytes, "disk_format": spec.disk_format,
                "env": env, "workdir": workdir, "user": user,
                "agent_python": agent.python_cmd, "step_seconds": timings,
                "build_seconds": total}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "build-seconds").write_text(f"{total:.1f}\n")
    progress("disk", f"{disk_bytes >> 20} MiB disk from {tree_bytes >> 20} MiB of files "
                     f"in {total:.1f} s")


# -- the entry points ------------------------------------------------------------------


def _plan(spec: ImageSpec, scratch: Path, progress: Progress, *, oci_ref: str | None = None,
          oci_options: dict[str, Any] | None = None) -> _Plan:
    spec.validate()
    if oci_ref is not None:
        from vmfork.image.oci import resolve

        progress("base", f"resolving {oci_ref}")
        digest = resolve(oci_ref, **(oci_options or {}))
        plan = _Plan(spec, [f"base oci {digest}"], oci_ref=oci_ref,
                     oci_options=dict(oci_options or {}))
    else:
        plan = _resolve_base(spec)
    if spec.apt:
        # What the base already has is left out of the closure; an imported image's
        # packages are not known by name, so apt's solver decides all of them.
        present = _packages_present(plan)
        progress("apt", f"resolving {' '.join(spec.apt)}")
        plan.apt = debian.resolve_extra_packages(spec.apt, present)
    python = (3, 11)
    if spec.pip or spec.requirements is not None:
        python = _python_for_pip(plan)
    plan.wheels = _resolve_wheels(spec, python, scratch, progress)
    if spec.npm:
        plan.npm_manifest, plan.npm_lock = _resolve_npm(spec, scratch, progress)
    plan.copies = _hash_copies(spec)
    return plan


def _packages_present(plan: _Plan) -> set[str]:
    names = {p.name for p in plan.base_packages}
    if plan.base_record is not None:
        names |= set(plan.base_record.definition.get("packages_present", []))
    return names


def _python_for_pip(plan: _Plan) -> tuple[int, int]:
    # Wheels are chosen before the tree exists: the default tree and Debian-built
    # disks have Debian's 3.11; an imported image's version is in its record.
    if plan.base_record is not None and plan.base_record.agent_python:
        m = re.search(r"python3\.(\d+)", plan.base_record.agent_python)
        if m and "opt/vmfork/python" not in plan.base_record.agent_python:
            return (3, int(m.group(1)))
    return (3, 11)


def build(name: str, spec: ImageSpec, *, progress: Progress = _quiet,
          oci_ref: str | None = None, oci_options: dict[str, Any] | None = None,
          built_from: str | None = None) -> GuestImage:
    """Build (or reuse) image ``name`` from ``spec`` and record it. See the module doc."""
    validate_name(name)
    from vmfork.image.kernel import build_kernel

    if spec.is_default and oci_ref is None:
        from vmfork.image import build_image

        return build_image(name)
    started = time.monotonic()
    progress("kernel", "the guest kernel (cached after the first build)")
    kernel_entry, kernel_built = build_kernel()
    kernel = kernel_entry / "vmlinux"
    boot = initramfs.build_boot_initramfs()
    scratch = Path(tempfile.mkdtemp(prefix=".plan-", dir=_scratch_root()))
    try:
        plan = _plan(spec, scratch, progress, oci_ref=oci_ref, oci_options=oci_options)
        key = plan.key()
        entry, disk_built = cached_entry("disk-builds", key,
                                         lambda out: _build_disk(out, plan, progress))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    manifest = json.loads((entry / "manifest.json").read_text())
    if manifest.get("root") == "initramfs":
        return _record_initramfs_root(name, spec, entry, manifest, kernel_entry, kernel_built,
                                      plan, built_from or oci_ref, disk_built)
    content_key = publish_disk(entry / DISK_FILE, str(manifest["content_key"]))
    if not disk_built:
        progress("disk", f"cached: {disk_path(content_key)}")
    definition = spec.summary()
    if oci_ref is not None:
        definition["from"] = oci_ref
    definition["packages_present"] = sorted(_packages_present(plan)
                                            | {p.name for p in plan.apt})

    def image_of(content_key: str, manifest: dict[str, Any], seconds: float | None,
                 layers: list[dict[str, Any]]) -> GuestImage:
        return GuestImage(
            name=name, kernel=kernel, initrd=boot.path, kernel_key=kernel_entry.name,
            initramfs_key=boot.key,
            cmdline=f"{DEFAULT_CMDLINE} vmfork.rootfs="
                    f"{mount_type(str(manifest['disk_format']))}",
            created=datetime.now(UTC).replace(microsecond=0),
            kernel_size=kernel.stat().st_size, initrd_size=boot.size,
            kernel_build_seconds=entry_build_seconds(kernel) if kernel_built else None,
            initramfs_build_seconds=boot.build_seconds if boot.built_now else None,
            disk_key=content_key, disk_size=int(manifest["disk_bytes"]),
            disk_format=str(manifest["disk_format"]),
            built_from=built_from or oci_ref or spec.base or DEFAULT_NAME,
            definition={**definition, **({"run_layers": layers} if layers else {})},
            env=tuple(manifest["env"]), workdir=manifest["workdir"],
            user=manifest["user"], agent_python=manifest["agent_python"],
            disk_build_seconds=seconds)

    seconds = float(manifest["build_seconds"]) if disk_built else None
    image = image_of(content_key, manifest, seconds, [])
    layers: list[dict[str, Any]] = []
    first_disk = disk_path(content_key)
    prior_layers: list[Path] = []
    for index, command in enumerate(spec.run):
        # Each step boots the image so far (not recorded: a failed step records nothing).
        from vmfork.image.buildrun import LAYER_FILE, run_step

        entry, manifest, step_built = run_step(image, index, command, egress=spec.egress,
                                               first_disk=first_disk,
                                               prior_layers=list(prior_layers),
                                               mem_mib=spec.run_mem_mib, progress=progress)
        prior_layers.append(entry / LAYER_FILE)
        content_key = publish_disk(entry / DISK_FILE, str(manifest["content_key"]))
        layers.append({"command": command, "disk": content_key,
                       "diff_id": manifest["layer"]["diff_id"],
                       "layer_bytes": manifest["layer"]["bytes"], "cached": not step_built})
        if step_built:
            seconds = (seconds or 0.0) + float(manifest["build_seconds"])
        image = image_of(content_key, manifest, seconds, layers)
    write_record(image)
    progress("done", f"image {name!r}: {image.size >> 20} MiB in "
                     f"{time.monotonic() - started:.1f} s")
    return image


def _record_initramfs_root(name: str, spec: ImageSpec, entry: Path, manifest: dict[str, Any],
                           kernel_entry: Path, kernel_built: bool, plan: _Plan,
                           built_from: str | None, built_now: bool) -> GuestImage:
    key = str(manifest["content_key"])[:24]
    archive = entry / initramfs.ARCHIVE_NAME

    def put(out: Path) -> None:
        try:
            os.link(archive, out / initramfs.ARCHIVE_NAME)
        except OSError:
            shutil.copyfile(archive, out / initramfs.ARCHIVE_NAME)

    initrd_entry, _ = cached_entry("initramfs", key, put)
    kernel = kernel_entry / "vmlinux"
    definition = spec.summary()
    definition["packages_present"] = sorted(_packages_present(plan) | {p.name for p in plan.apt})
    image = GuestImage(
        name=name, kernel=kernel, initrd=initrd_entry / initramfs.ARCHIVE_NAME,
        kernel_key=kernel_entry.name, initramfs_key=key, cmdline=DEFAULT_CMDLINE,
        created=datetime.now(UTC).replace(microsecond=0), kernel_size=kernel.stat().st_size,
        initrd_size=int(manifest["disk_bytes"]),
        kernel_build_seconds=entry_build_seconds(kernel) if kernel_built else None,
        initramfs_build_seconds=float(manifest["build_seconds"]) if built_now else None,
        built_from=built_from or spec.base or DEFAULT_NAME, definition=definition,
        env=tuple(manifest["env"]), workdir=manifest["workdir"], user=manifest["user"],
        agent_python=manifest["agent_python"])
    write_record(image)
    return image


def import_oci(name: str, ref: str, *, progress: Progress = _quiet,
               auth_file: Path | None = None, insecure: bool = False) -> GuestImage:
    """Import the OCI image ``ref`` as image ``name`` (its Env, WorkingDir and User
    become exec's defaults); it can then be the base of a build."""
    options: dict[str, Any] = {"insecure": insecure}
    if auth_file is not None:
        options["auth_file"] = auth_file
    return build(name, ImageSpec(), progress=progress, oci_ref=ref, oci_options=options)


def _make_initramfs(root: Path, out: Path, agent: _Agent) -> None:
    """The tree as the default image's kind of root: the agent as ``/init`` on the
    image's own 3.11, every byte unpacked into guest RAM at boot."""
    if agent.bundled or not agent.python_cmd.startswith("/usr/bin/python3.11"):
        raise ImageBuildError("disk", "an initramfs root needs the image's own "
                                      "/usr/bin/python3.11 for /init; use the disk root")
    initramfs.install_agent(root, initramfs.agent_files(initramfs.default_vmfork_source()))
    initramfs.compile_tree(root)
    from vmfork.image import cpio

    with open(out, "wb") as f:
        cpio.write_cpio(f, [*cpio.entries_from_tree(root), *initramfs.device_entries()])
        f.flush()
        os.fsync(f.fileno())


def disk_content_key(disk: Path) -> str:
    """A disk's identity: the SHA-256 of its bytes. Snapshots name their disk by it, and
    a disk from elsewhere (a pack) is stored only under the hash of what it holds, so it
    can never stand in for another."""
    return debian.sha256_file(disk)


def publish_disk(source: Path, content_key: str) -> str:
    """Make ``source`` (whose SHA-256 is ``content_key``, checked by the caller) the disk
    ``disks/<content_key>/root.img``: a hard link when it can be (same file system), so
    the build entry and the disk share their bytes; returns ``content_key``."""
    def put(out: Path) -> None:
        try:
            os.link(source, out / DISK_FILE)
        except OSError:
            shutil.copyfile(source, out / DISK_FILE)
        os.chmod(out / DISK_FILE, 0o444)

    cached_entry("disks", content_key, put)
    return content_key


def _scratch_root() -> Path:
    path = cache_dir() / "disks"
    path.mkdir(parents=True, exist_ok=True)
    return path


class ImageInUse(ImageError):
    """The image cannot be removed: snapshots use it (named in the message)."""

    def __init__(self, name: str, tags: list[str]) -> None:
        shown = ", ".join(tags[:10]) + (f" and {len(tags) - 10} more" if len(tags) > 10 else "")
        super().__init__(f"image {name!r} is used by snapshot(s) {shown}; remove them first "
                         "(vmfork rmi TAG) or keep the image")
        self.name = name
        self.tags = tags


def remove_image(name: str, used_by: list[str]) -> None:
    """Remove image ``name``'s record (its cache entries stay for other images that share
    them; ``used_by``: the snapshots that use it, which refuse the removal)."""
    validate_name(name)
    if used_by:
        raise ImageInUse(name, used_by)
    record = read_record(name)
    from vmfork.image import record_path

    record_path(record.name).unlink()
