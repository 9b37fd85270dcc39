"""Volumes on the host: parsing ``SRC:GUEST_PATH[:ro|:rw]``, checking guest paths, and
turning sources into disks a volume slot can hold (docs/volumes.md).

* A **host directory** becomes a read-only erofs image cached by the content of the
  tree under ``<cache>/volumes/<key>/volume.img``; the same tree gives the same key, so
  every snapshot and spawn that names it shares one file. Unlike a root disk
  (``image.builder.make_disk``, lz4hc) it is not compressed: a volume is made while a
  request waits and often holds data that is compressed already, and lz4hc spent
  20.7 s of CPU on 50 MiB of random bytes where the plain image took 0.9 s (natively;
  ten times that in the emulated test host, which timed the first e2e run out). Reads
  of a plain image are copies, with no decompression in the guest. Files are owned by
  root in the image (``--all-root``), as the key ignores owners.
* A **read-only image file** is copied into the same cache under its content hash:
  files in the cache are immutable (DESIGN decision 5), and the user's file may change
  after it was attached.
* A **read-write image file** is used in place: it is that one sandbox's disk (DESIGN
  decision 3). Its key names the file (device and inode), not its content, so the
  daemon's registry can say who holds it.

Everything here runs before a VM is touched, so a bad request fails in milliseconds
with a message that names what to fix, and nothing is left behind (a half-built
image is never published: ``image.cache.cached_entry``).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
import stat
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmfork.image.debian import sha256_file
from vmfork.paths import cache_dir

MAX_VOLUMES = 24                   # forkd's cap, per sandbox
DEFAULT_FREE_SLOTS = 4             # empty slots a parent reserves for spawn-time volumes
MAX_GUEST_PATH = 200               # bytes; the agent's mount point
SECTOR = 512
VOLUME_FILE = "volume.img"

# Mount points that would hide or break the guest's system: nothing at or below these.
RESERVED_TREES = ("/proc", "/sys", "/dev", "/opt/vmfork")
# Directories the guest's userland lives in: not on them, below them is fine.
RESERVED_DIRS = ("/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/opt",
                 "/root", "/run", "/sbin", "/tmp", "/usr", "/var")
_GUEST_PATH_CHARS = re.compile(r"[A-Za-z0-9._@+=,/-]+")


class VolumeError(ValueError):
    """A volume request that cannot be honoured as given (a 4xx: the caller's to fix)."""


class VolumeImageFailed(RuntimeError):
    """Making a directory's image failed on the host (not the caller's to fix)."""


@dataclass(frozen=True)
class VolumeSpec:
    source: str         # a host directory or image file
    guest_path: str
    read_only: bool

    def as_text(self) -> str:
        return f"{self.source}:{self.guest_path}:{'ro' if self.read_only else 'rw'}"


@dataclass(frozen=True)
class PreparedVolume:
    """A volume ready for a slot: its disk on the host and the key that names it."""

    guest_path: str
    read_only: bool
    key: str
    path: str           # the disk image (in the cache, or the rw file itself)
    source: str
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"guest_path": self.guest_path, "read_only": self.read_only, "key": self.key,
                "path": self.path, "source": self.source, "size_bytes": self.size_bytes}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PreparedVolume:
        return cls(guest_path=str(doc["guest_path"]), read_only=bool(doc["read_only"]),
                   key=str(doc["key"]), path=str(doc["path"]), source=str(doc["source"]),
                   size_bytes=int(doc["size_bytes"]))


# -- parsing and checking ------------------------------------------------------------


def parse_volume(item: str | Mapping[str, Any]) -> VolumeSpec:
    """``SRC:GUEST_PATH[:ro|:rw]`` (forkd's ``--volume``; read-only by default), or an
    object ``{"source", "guest_path", "mode": "ro"|"rw"}`` for a source whose name
    holds a colon."""
    if isinstance(item, Mapping):
        unknown = set(item) - {"source", "guest_path", "mode"}
        if unknown:
            raise VolumeError(f"volume {dict(item)!r:.200}: unknown fields "
                              f"{sorted(unknown)}; give source, guest_path and mode")
        source, guest = item.get("source"), item.get("guest_path")
        mode = item.get("mode", "ro")
        if not isinstance(source, str) or not isinstance(guest, str):
            raise VolumeError("a volume object needs \"source\" (a host path) and "
                              "\"guest_path\" (where the guest mounts it), both strings")
    elif isinstance(item, str):
        parts = item.split(":")
        if len(parts) == 3:
            source, guest, mode = parts
        elif len(parts) == 2:
            (source, guest), mode = parts, "ro"
        else:
            raise VolumeError(f"volume {item!r:.200}: write it SRC:GUEST_PATH[:ro|:rw] "
                              "(a source with a colon in its name needs the object form)")
    else:
        raise VolumeError(f"a volume is a string SRC:GUEST_PATH[:ro|:rw] or an object, "
                          f"not {type(item).__name__}")
    if mode not in ("ro", "rw"):
        raise VolumeError(f"volume {source[:200]}:{guest[:200]}: mode {mode!r:.40} is "
                          "neither ro nor rw")
    if not source:
        raise VolumeError(f"volume :{guest}: the source (a host directory or image file) "
                          "is empty")
    check_guest_path(guest)
    return VolumeSpec(source=source, guest_path=guest, read_only=mode == "ro")


def check_guest_path(path: str) -> None:
    """Refuse a mount point that is relative, not normal, on a system path, or
    unsafe to hand to the guest."""
    if not path.startswith("/"):
        raise VolumeError(f"volume guest path {path!r:.200} is relative; give an absolute "
                          "path such as /data")
    if len(path.encode()) > MAX_GUEST_PATH:
        raise VolumeError(f"volume guest path {path[:60]!r}... is longer than "
                          f"{MAX_GUEST_PATH} bytes")
    if not _GUEST_PATH_CHARS.fullmatch(path):
        raise VolumeError(f"volume guest path {path!r:.200} has characters outside "
                          "A-Z a-z 0-9 . _ @ + = , - /")
    parts = path.split("/")[1:]
    if ".." in parts or "." in parts:
        raise VolumeError(f"volume guest path {path!r} has a '.' or '..' component; give "
                          "the plain absolute path")
    if path == "/":
        raise VolumeError("a volume cannot be mounted on / (it would hide the guest's "
                          "root file system); choose a directory such as /data")
    if "" in parts:
        raise VolumeError(f"volume guest path {path!r} has an empty component or a "
                          f"trailing slash; write it {posixpath.normpath(path)}")
    for tree in RESERVED_TREES:
        if _at_or_under(path, tree):
            raise VolumeError(f"volume guest path {path} is at or under {tree}, which the "
                              "guest's system needs; choose another directory")
    if path in RESERVED_DIRS:
        raise VolumeError(f"volume guest path {path} would hide the guest's {path}; mount "
                          f"it below (e.g. {path}/data) or elsewhere (e.g. /data)")


def _at_or_under(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree + "/")


def check_volume_set(specs: Iterable[tuple[str, bool]], *,
                     existing: Iterable[str] = (), limit: int = MAX_VOLUMES) -> None:
    """``specs``: (guest path, read_only) of the volumes asked for, ``existing``: the
    guest paths already mounted (a snapshot's volumes). At most ``limit`` in all, and
    no mount point at or under another."""
    asked = list(specs)
    held = list(existing)
    if len(asked) + len(held) > limit:
        raise VolumeError(f"{len(asked) + len(held)} volumes"
                          + (f" ({len(held)} from the snapshot)" if held else "")
                          + f"; a sandbox has at most {limit}")
    seen = [(p, "the snapshot's") for p in held]
    for path, _ro in asked:
        for other, whose in seen:
            if _at_or_under(path, other) or _at_or_under(other, path):
                what = "the same as" if path == other else "nested with"
                raise VolumeError(f"volume guest path {path} is {what} {whose} volume at "
                                  f"{other}; give each volume a directory of its own")
        seen.append((path, "another"))


# -- sources into disks ---------------------------------------------------------------


def prepare_snapshot_volumes(items: Sequence[str | Mapping[str, Any]],
                             volume_slots: int | None) -> tuple[list[PreparedVolume], int]:
    """A snapshot's volumes, prepared, and its empty slots (by default
    ``DEFAULT_FREE_SLOTS``, fewer if the volumes leave fewer of the 24). A snapshot's
    volumes are read-only: every child shares them."""
    specs = [parse_volume(item) for item in items]
    check_volume_set([(s.guest_path, s.read_only) for s in specs])
    for spec in specs:
        if not spec.read_only:
            raise VolumeError(f"{spec.as_text()}: a snapshot's volumes are shared by every "
                              "child, so they are read-only; attach a read-write volume at "
                              "spawn or workspace create")
    if volume_slots is None:
        volume_slots = min(DEFAULT_FREE_SLOTS, MAX_VOLUMES - len(specs))
    elif not 0 <= volume_slots <= MAX_VOLUMES - len(specs):
        raise VolumeError(f"{len(specs)} volumes and volume_slots={volume_slots}: a sandbox "
                          f"has at most {MAX_VOLUMES} volumes; lower volume_slots")
    return [prepare(spec) for spec in specs], volume_slots


def volume_image_path(key: str, cache: Path | None = None) -> Path:
    """Where the read-only volume ``key`` lives in the cache."""
    if not re.fullmatch(r"[0-9a-f]{24,64}", key):
        raise VolumeError(f"volume key {key!r:.80} is not a content key")
    return (cache or cache_dir()) / "volumes" / key / VOLUME_FILE


def tree_key(root: Path, fmt: str) -> str:
    """A key over a directory tree's names, types, modes, link targets and file
    contents (not timestamps or owners: the image is made with both fixed)."""
    h = hashlib.sha256(f"vmfork-volume-tree-v1 {fmt}\0".encode())
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted([*dirnames, *filenames]):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            h.update(f"{rel}\0{stat.S_IFMT(st.st_mode):o}\0{stat.S_IMODE(st.st_mode):o}\0"
                     .encode("utf-8", "surrogateescape"))
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(full).encode("utf-8", "surrogateescape") + b"\0")
            elif stat.S_ISREG(st.st_mode):
                h.update(f"{st.st_size}\0".encode())
                h.update(bytes.fromhex(sha256_file(Path(full))))
            elif not stat.S_ISDIR(st.st_mode):
                raise VolumeError(f"volume source {root}: {rel} is neither a file, a "
                                  "directory nor a symlink (a device, socket or FIFO); "
                                  "remove it or mount a directory without it")
    return h.hexdigest()[:32]


def rw_key(st: os.stat_result) -> str:
    """The key of a read-write volume: its file's identity on this host."""
    return hashlib.sha256(f"vmfork-rw-volume {st.st_dev}:{st.st_ino}".encode()).hexdigest()[:32]


def make_volume_image(tree: Path, out: Path) -> None:
    """``tree`` as an uncompressed erofs image at ``out``, padded to whole sectors,
    with times fixed at 0 and every file root's, so the same tree makes the same bytes."""
    done = subprocess.run(["mkfs.erofs", "-T0", "--all-root", str(out), str(tree)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise VolumeImageFailed(f"mkfs.erofs of {tree} exited {done.returncode}: "
                                f"{done.stderr.strip()[-500:]}")
    size = out.stat().st_size
    if size % SECTOR:
        with open(out, "ab") as f:
            f.write(b"\0" * (SECTOR - size % SECTOR))


def prepare(spec: VolumeSpec, disk_format: str = "erofs-plain") -> PreparedVolume:
    """The disk for ``spec``: built or imported into the cache (read-only), or checked
    in place (read-write). ``VolumeError`` for anything the caller can fix."""
    from vmfork.image.cache import cached_entry

    if not spec.source.startswith("/"):
        # A daemon would resolve it from its own directory, not the caller's.
        raise VolumeError(f"volume source {spec.source!r:.200} is relative; give an absolute "
                          "host path (the CLI makes --volume sources absolute)")
    source = os.path.normpath(spec.source)
    try:
        st = os.stat(source)
    except OSError as err:
        raise VolumeError(f"volume source {spec.source}: {err.strerror}; give an existing "
                          "host directory or image file") from None
    if stat.S_ISDIR(st.st_mode):
        if not spec.read_only:
            raise VolumeError(f"volume {spec.as_text()}: a directory becomes a read-only "
                              "image; a read-write volume needs an image file of its own "
                              "(e.g. `truncate -s 1G vol.img && mkfs.ext4 vol.img`)")
        key = tree_key(Path(source), disk_format)

        def build(tmp: Path) -> None:
            make_volume_image(Path(source), tmp / VOLUME_FILE)

        entry, _ = cached_entry("volumes", key, build)
        disk = entry / VOLUME_FILE
        return PreparedVolume(spec.guest_path, True, key, str(disk), source,
                              disk.stat().st_size)
    if not stat.S_ISREG(st.st_mode):
        raise VolumeError(f"volume source {spec.source} is neither a directory nor a "
                          "regular file")
    if st.st_size <= 0 or st.st_size % SECTOR:
        raise VolumeError(f"volume image {spec.source} is {st.st_size} bytes; an image "
                          f"must be a positive multiple of {SECTOR} bytes")
    if not spec.read_only:
        if not os.access(source, os.R_OK | os.W_OK):
            raise VolumeError(f"volume image {spec.source} is not readable and writable by "
                              "the daemon; a read-write volume is written in place")
        return PreparedVolume(spec.guest_path, False, rw_key(st), source, source,
                              st.st_size)
    key = sha256_file(Path(source))[:32]

    def import_file(tmp: Path) -> None:
        shutil.copyfile(source, tmp / VOLUME_FILE)
        os.chmod(tmp / VOLUME_FILE, 0o444)

    entry, _ = cached_entry("volumes", key, import_file)
    disk = entry / VOLUME_FILE
    return PreparedVolume(spec.guest_path, True, key, str(disk), source, disk.stat().st_size)
