"""Guest images: a kernel, an initramfs and (for users' images) a read-only root disk.

An image is a name pointing at content-addressed cache entries
(``kernel/<key>/vmlinux``, ``initramfs/<key>/initramfs.cpio`` and, for an image
that is more than the default, ``disks/<key>/root.img``) plus the kernel
command-line words the image needs. The default image's root is the initramfs;
a user's image boots a small initramfs that mounts the disk read-only under an
overlay whose upper layer is guest RAM (``builder.py``, ``docs/images.md``). The record ``<cache>/images/<name>.json``
stores keys, not paths, so moving the cache (``VMFORK_CACHE_DIR``) keeps images
valid; it is replaced atomically (temp file, fsync, rename), so a reader sees the
old image or the new one, never half of each.

``build_image`` builds only what is missing: an unchanged kernel config or an
unchanged agent reuses its entry, and two builders of the same entry build it
once (``cache.cached_entry`` holds a lock). ``find_image`` never builds; a
missing image is ``ImageMissing``, whose message says to run ``vmfork image build``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vmfork.image.errors import ImageBuildError, ImageError, ImageMissing, InvalidImageName
from vmfork.paths import cache_dir

__all__ = [
    "DEFAULT_CMDLINE",
    "DEFAULT_NAME",
    "GuestImage",
    "ImageBuildError",
    "ImageError",
    "ImageMissing",
    "InvalidImageName",
    "build_image",
    "disk_path",
    "entry_build_seconds",
    "find_image",
    "initrd_path",
    "kernel_path",
    "list_images",
    "read_record",
    "record_path",
    "validate_name",
    "write_record",
]

RECORD_FORMAT = 2
READABLE_FORMATS = (1, 2)
DEFAULT_NAME = "default"
# What this image needs on the kernel command line; the VMM adds its own
# (console, virtio-mmio devices). /init is the agent (initramfs.INIT_SCRIPT).
DEFAULT_CMDLINE = "rdinit=/init"
KERNEL_FILE = "vmlinux"
INITRD_FILE = "initramfs.cpio"
DISK_FILE = "root.img"

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid image name, else raise ``InvalidImageName``.

    Names become file names, so they are checked before any path is built.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidImageName(
            f"invalid image name {name!r}: use 1 to 64 letters, digits, '_' or '-'"
        )
    return name


@dataclass(frozen=True)
class GuestImage:
    """A built guest image. Sizes in bytes; build times in seconds."""

    name: str
    kernel: Path  # uncompressed ELF vmlinux
    initrd: Path  # uncompressed newc cpio
    kernel_key: str
    initramfs_key: str
    cmdline: str  # kernel command-line words the image needs
    created: datetime  # when the record was written (UTC)
    kernel_size: int
    initrd_size: int
    kernel_build_seconds: float | None = None  # set only when built by this call
    initramfs_build_seconds: float | None = None  # set only when built by this call
    # A user's image (format 2): its read-only root disk and what it was built from.
    disk_key: str | None = None
    disk_size: int = 0
    disk_format: str | None = None         # squashfs | erofs
    built_from: str = DEFAULT_NAME          # the base image, or an OCI reference
    definition: dict[str, Any] = field(default_factory=dict)   # ImageSpec.summary()
    env: tuple[str, ...] = ()               # K=V defaults for exec
    workdir: str | None = None
    user: str | None = None
    agent_python: str | None = None         # the interpreter the agent runs on
    disk_build_seconds: float | None = None  # set only when built by this call

    @property
    def disk(self) -> Path | None:
        """The root disk image, None for an initramfs-rooted image."""
        return disk_path(self.disk_key, self._cache) if self.disk_key else None

    @property
    def _cache(self) -> Path:
        # kernel is <cache>/kernel/<key>/vmlinux: the cache this record was read from.
        return self.kernel.parent.parent.parent

    @property
    def size(self) -> int:
        """Bytes of the image's own files (kernel, initramfs, disk)."""
        return self.kernel_size + self.initrd_size + self.disk_size

    def to_record(self) -> dict[str, Any]:
        """The JSON record; paths are derived from the keys when it is read back."""
        record: dict[str, Any] = {
            "format": RECORD_FORMAT,
            "name": self.name,
            "kernel_key": self.kernel_key,
            "initramfs_key": self.initramfs_key,
            "cmdline": self.cmdline,
            "created": self.created.isoformat(),
            "kernel_size": self.kernel_size,
            "initrd_size": self.initrd_size,
            "built_from": self.built_from,
        }
        if self.disk_key is not None:
            record.update(disk_key=self.disk_key, disk_size=self.disk_size,
                          disk_format=self.disk_format)
        if self.definition:
            record.update(definition=self.definition, env=list(self.env),
                          workdir=self.workdir, user=self.user, agent_python=self.agent_python)
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any], cache: Path) -> GuestImage:
        if record.get("format") not in READABLE_FORMATS:
            raise ValueError(f"unknown image record format {record.get('format')!r}")
        name = validate_name(record["name"])
        kernel_key = _validate_key(record["kernel_key"])
        initramfs_key = _validate_key(record["initramfs_key"])
        disk_key = record.get("disk_key")
        env = record.get("env") or []
        if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
            raise TypeError("env must be a list of K=V strings")
        definition = record.get("definition") or {}
        if not isinstance(definition, dict):
            raise TypeError("definition must be an object")
        disk: dict[str, Any] = {
            "definition": definition, "env": tuple(env),
            "workdir": _opt_str(record.get("workdir")), "user": _opt_str(record.get("user")),
            "agent_python": _opt_str(record.get("agent_python"))}
        if disk_key is not None:
            disk.update(disk_key=_validate_key(disk_key), disk_size=int(record["disk_size"]),
                        disk_format=str(record["disk_format"]))
        return cls(
            **disk,
            built_from=str(record.get("built_from", DEFAULT_NAME)),
            name=name,
            kernel=kernel_path(kernel_key, cache),
            initrd=initrd_path(initramfs_key, cache),
            kernel_key=kernel_key,
            initramfs_key=initramfs_key,
            cmdline=str(record["cmdline"]),
            created=datetime.fromisoformat(record["created"]),
            kernel_size=int(record["kernel_size"]),
            initrd_size=int(record["initrd_size"]),
        )

    def files_present(self) -> bool:
        disk = self.disk
        return self.kernel.is_file() and self.initrd.is_file() and (disk is None
                                                                    or disk.is_file())


def _opt_str(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _validate_key(key: object) -> str:
    # Keys also become path components; a record is data read from disk.
    if not isinstance(key, str) or not re.fullmatch(r"[0-9a-f]{8,64}", key):
        raise ValueError(f"malformed cache key {key!r}")
    return key


def kernel_path(key: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "kernel" / key / KERNEL_FILE


def initrd_path(key: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "initramfs" / key / INITRD_FILE


def disk_path(key: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "disks" / _validate_key(key) / DISK_FILE


def record_path(name: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "images" / f"{validate_name(name)}.json"


def entry_build_seconds(entry_file: Path) -> float | None:
    """How long the cache entry holding ``entry_file`` took to build, if it recorded it."""
    try:
        return float((entry_file.parent / "build-seconds").read_text())
    except (OSError, ValueError):
        return None


def _build_hint(name: str) -> str:
    what = "" if name == DEFAULT_NAME else f" {name}"
    return f"run `vmfork image build{what}`" + ("" if name == DEFAULT_NAME
                                                  else " with its definition")


def write_record(image: GuestImage, cache: Path | None = None) -> Path:
    """Write ``images/<name>.json`` atomically (temp file, fsync, rename, fsync dir)."""
    path = record_path(image.name, cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{image.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(image.to_record(), f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def read_record(name: str, cache: Path | None = None) -> GuestImage:
    """The recorded image ``name`` (its files may be gone; see ``find_image``)."""
    path = record_path(name, cache)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ImageMissing(f"image {name!r} has not been built; {_build_hint(name)}") from None
    except (OSError, ValueError) as err:
        raise ImageMissing(
            f"image record {path} is unreadable ({err}); {_build_hint(name)} to rewrite it"
        ) from err
    try:
        return GuestImage.from_record(record, cache or cache_dir())
    except (KeyError, TypeError, ValueError) as err:
        raise ImageMissing(
            f"image record {path} is malformed ({err!r}); {_build_hint(name)} to rewrite it"
        ) from err


def find_image(name: str = DEFAULT_NAME) -> GuestImage:
    """The built image ``name``; raises ``ImageMissing`` (saying what to run) if absent."""
    image = read_record(name)
    if not image.files_present():
        raise ImageMissing(
            f"image {name!r} refers to cache entries that no longer exist "
            f"(kernel {image.kernel_key}, initramfs {image.initramfs_key}"
            + (f", disk {image.disk_key}" if image.disk_key else "") + f"); {_build_hint(name)}"
        )
    return image


def list_images() -> list[GuestImage]:
    """Every recorded image, by name; unreadable records are skipped."""
    images: list[GuestImage] = []
    for path in sorted((cache_dir() / "images").glob("*.json")):
        try:
            images.append(read_record(path.stem))
        except ImageError:
            continue
    return images


def build_image(name: str = DEFAULT_NAME) -> GuestImage:
    """Build (or reuse) the kernel and initramfs, record image ``name`` and return it.

    The first kernel build takes minutes; later calls reuse the cached entry.
    Raises ``ImageBuildError`` or ``vmfork.image.kernel.KernelBuildError`` naming
    the failed step.
    """
    validate_name(name)
    # Imported here: the recipes pull in subprocess-heavy code that readers of
    # images (find_image, the VMM) never need.
    from vmfork.image.initramfs import build_initramfs
    from vmfork.image.kernel import build_kernel

    kernel_entry, kernel_built = build_kernel()
    kernel = kernel_entry / KERNEL_FILE
    initramfs = build_initramfs()
    image = GuestImage(
        name=name,
        kernel=kernel,
        initrd=initramfs.path,
        kernel_key=kernel_entry.name,
        initramfs_key=initramfs.key,
        cmdline=DEFAULT_CMDLINE,
        created=datetime.now(UTC).replace(microsecond=0),
        kernel_size=kernel.stat().st_size,
        initrd_size=initramfs.size,
        kernel_build_seconds=entry_build_seconds(kernel) if kernel_built else None,
        initramfs_build_seconds=initramfs.build_seconds if initramfs.built_now else None,
    )
    write_record(image)
    return image
