"""Portable packs: a snapshot's whole chain (and its guest image) in one ``.tar.zst``.

Layout of the tar stream (compressed by the ``zstd`` tool, see below)::

    manifest.json                  always the first entry
    snapshots/<tag>/state.bin      every snapshot of the chain, root to head
    snapshots/<tag>/memory.bin     the root only (holes read as zeros; zstd squeezes them)
    snapshots/<tag>/layer.bin      each link: only the pages it changed, once
    image/vmlinux, image/initramfs.cpio   the guest image, unless packed without it
    volumes/<key>.img              each read-only volume the chain's snapshots attach

The manifest carries a format name and version, each snapshot's tag, parent and
content hashes, its ``meta.json`` and, per file, its size and hash
(``blake2b-256`` of the bytes; ``blake2b-256-mib`` for memory, as in the store).

``unpack`` treats the pack as hostile. It reads the manifest first and accepts
nothing the manifest does not name: an entry must be a regular file (no links,
devices, directories), named exactly ``snapshots/<tag>/<file>`` or ``image/<file>``
for a tag and file the manifest lists (so no absolute paths, no ``..``), seen
once, and exactly as long as declared, with declared sizes bounded (memory by
the snapshot's RAM size). Files are written into the store's pending
directories (removed by the store after a crash), hashed as they stream, and
nothing is published until every hash matched and the stream ended cleanly;
any failure removes everything this unpack wrote. Snapshots already in the
store with the same content hash are not stored again. A link is published as
in the store it came from: its layer and a memory plan computed over the
unpacked chain (``PendingSnapshot.publish``, as every snapshot enters the store),
never a resolved memory image.

Volumes: a snapshot's read-only volumes (recorded in its machine state, by content
key) travel with it, once each, and are verified on unpack before anything is
published: an image file's key is the SHA-256 of its bytes, a directory's the hash of
its tree (``runtime.volumes.tree_key``), recomputed over the image's files
(``fsck.erofs --extract``, which checks the image too); a pack cannot put other bytes
where a volume is looked up. A volume that is neither in the pack nor already here
refuses the pack. A read-write volume (a workspace's suspension) is refused at pack
time: it is a file of this host that its workspace goes on writing (docs/volumes.md).

Compression uses the ``zstd`` command (a Debian package vmfork already installs
for the guest image) through pipes rather than a Python binding: no extra
wheel in every environment, multi-threaded compression, and a damaged or
truncated stream shows up as its exit status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmfork.image.tarstream import FILE, Member, TarFormatError, TarStream
from vmfork.ondisk.durable import fsync_dir
from vmfork.ondisk.stateformat import StateFormatError, from_json_value, to_json_value
from vmfork.store.errors import HasDependents, SnapshotCorrupt, SnapshotNotFound, StoreError
from vmfork.store.layers import HASH_NAME, LAYER_FILE, hash_file, hash_memory
from vmfork.store.meta import SnapshotMeta
from vmfork.store.store import (
    MAX_CHAIN_DEPTH,
    MEMORY_FILE,
    STATE_FILE,
    Snapshot,
    Store,
    chain_of,
)
from vmfork.store.tags import is_valid_tag, validate_tag

PACK_FORMAT = "vmfork-pack"
PACK_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KERNEL_FILE = "vmlinux"
INITRD_FILE = "initramfs.cpio"

MAX_MANIFEST_BYTES = 1 << 20
# A pack's tar headers are read by our own bounded reader (image/tarstream.py), never by
# tarfile, which reads a pax or GNU long-name header whole whatever size it claims (a
# 3.2 KB pack once took 309 MiB). Our packs' names are short and their pax records few.
MAX_TAR_HEADER_BYTES = 64 << 10
MAX_TAR_NAME_BYTES = 1024
MAX_TRAILER_BYTES = 1 << 20
MAX_GUEST_MEM_MIB = 65536        # the daemon's own limit for a snapshot's RAM
MAX_STATE_BYTES = 64 << 20
MAX_IMAGE_FILE_BYTES = 1 << 30
MAX_DISK_BYTES = 64 << 30     # a user's root disk (image/root.img)
DISK_FILE = "root.img"
MAX_VOLUME_BYTES = 64 << 30
MAX_PACK_VOLUMES = 24 * 4       # forkd's 24 per sandbox, over a chain's few snapshots
_BLOCK = 1 << 20
_ZERO = bytes(_BLOCK)
_PAGE = 4096


class PackError(StoreError):
    """A pack cannot be written, or is refused on unpack (nothing was stored)."""


@dataclass(frozen=True)
class PackReport:
    path: Path
    tags: list[str]                 # root to head
    bytes: int                      # the pack file's size
    image: str | None               # the guest image packed, if any


@dataclass
class UnpackReport:
    tags: list[str] = field(default_factory=list)        # the chain, root to head
    stored: list[str] = field(default_factory=list)      # published by this unpack
    present: list[str] = field(default_factory=list)     # already here, not stored again
    image: str | None = None                             # installed guest image
    image_note: str | None = None                        # why an image was not installed


# -- pack -------------------------------------------------------------------------------

def _file_entries(snap: Snapshot, is_root: bool) -> dict[str, Path]:
    own = MEMORY_FILE if is_root else LAYER_FILE
    return {STATE_FILE: snap.state_path, own: snap.path / own}


def _hash(name: str, path: Path) -> str:
    return hash_memory(path) if name == MEMORY_FILE else hash_file(path)


def chain_manifest(store: Store, tag: str, *, with_image: bool = True
                   ) -> tuple[dict[str, Any], list[tuple[str, Path, int]]]:
    """The manifest of the chain ending at ``tag`` (what a pack's ``manifest.json`` and
    a pushed snapshot's config hold) and its files, ``(name, path, size)`` root to head
    then the image's. Refuses a chain whose files no longer match the hashes recorded
    when they entered the store."""
    links = chain_of(store, validate_tag(tag))
    entries: list[tuple[str, Path, int]] = []
    snapshots = []
    for i, snap in enumerate(links):
        if i > 0 and snap.layer_path is None:
            raise PackError(f"snapshot {snap.tag!r} names a parent but has no layer of its own; "
                            f"compact it (`vmfork snapshot-compact --from {snap.tag} --to NEW`) "
                            "and pack NEW", tag=snap.tag)
        files = {}
        for name, path in _file_entries(snap, i == 0).items():
            digest = _hash(name, path)
            recorded = snap.meta.file_hashes.get(name)
            if recorded is not None and recorded != digest:
                raise PackError(f"snapshot {snap.tag!r}: {name} no longer matches the hash "
                                "recorded when it entered the store; run `vmfork verify "
                                f"{snap.tag}`", tag=snap.tag)
            size = os.stat(path).st_size
            files[name] = {"size": size, "hash": digest}
            entries.append((f"snapshots/{snap.tag}/{name}", path, size))
        snapshots.append({"tag": snap.tag, "parent_tag": snap.meta.parent_tag,
                          "content_hash": snap.meta.content_hash,
                          "parent_content_hash": snap.meta.parent_content_hash,
                          "meta": to_json_value(snap.meta), "files": files})
    volumes, volume_files = _volume_entries(links)
    entries.extend(volume_files)
    image_entry: dict[str, Any] | None = None
    if with_image:
        image_entry, image_files = _image_entry(links[-1].meta.image)
        entries.extend(image_files)
    elif "image_disk" in links[-1].meta.extra:
        raise PackError(f"snapshot {links[-1].tag!r} boots image {links[-1].meta.image!r}, "
                        "whose root disk its children open: pack it with its image "
                        "(without --no-image)", tag=links[-1].tag)
    manifest = {"format": PACK_FORMAT, "format_version": PACK_FORMAT_VERSION,
                "head": links[-1].tag, "hash": HASH_NAME, "snapshots": snapshots,
                "image": image_entry, "volumes": volumes}
    return manifest, entries


def pack(store: Store, tag: str, out: Path, *, with_image: bool = True) -> PackReport:
    """Write the chain ending at ``tag`` to ``out`` (``.tar.zst``), atomically: a
    temporary file next to it, fsynced, renamed. Refuses a chain whose files no
    longer match the hashes recorded when they entered the store."""
    manifest, entries = chain_manifest(store, tag, with_image=with_image)
    raw = json.dumps(manifest, indent=1).encode()
    image_entry = manifest["image"]
    tags = [s["tag"] for s in manifest["snapshots"]]

    out = Path(out)
    temp = out.with_name(f".{out.name}.{secrets.token_hex(8)}.tmp")
    try:
        with open(temp, "xb") as sink:
            zstd = subprocess.Popen(["zstd", "-q", "-c", "-T0", "-3"], stdin=subprocess.PIPE,
                                    stdout=sink)
            assert zstd.stdin is not None
            try:
                with tarfile.open(fileobj=zstd.stdin, mode="w|",
                                  format=tarfile.PAX_FORMAT) as tar:
                    _add(tar, MANIFEST, len(raw), _BytesReader(raw))
                    for name, path, size in entries:
                        with open(path, "rb") as f:
                            _add(tar, name, size, f)
            finally:
                zstd.stdin.close()
                status = zstd.wait()
            if status != 0:
                raise PackError(f"zstd exited with status {status} while writing {out}")
            sink.flush()
            os.fsync(sink.fileno())
        os.rename(temp, out)
        fsync_dir(out.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return PackReport(out, tags, out.stat().st_size,
                      image_entry["name"] if image_entry else None)


def _state_volumes(state_path: Path, meta: SnapshotMeta) -> list[tuple[str, bool, str]]:
    """``(disk_key, read_only, guest_path)`` of each filled volume slot of a snapshot: from
    its machine state (which names what its children attach), or, for a state that does
    not decode (its spawns fail anyway), what its meta recorded at snapshot time."""
    from vmfork.ondisk.errors import OnDiskError
    from vmfork.ondisk.stateformat import read_state_file
    from vmfork.vmm.devices.manager import VOLUME
    from vmfork.vmm.vmstate import MachineState
    try:
        state = read_state_file(str(state_path), MachineState)
    except OnDiskError:
        recorded = meta.extra.get("volumes") or []
        return [(str(v.get("key")), bool(v.get("read_only", True)), str(v.get("guest_path")))
                for v in recorded if isinstance(v, dict) and v.get("key")]
    return [(v.disk.disk_key, bool(v.disk.read_only), v.guest_path)
            for v in state.devices_of(VOLUME) if v.disk.disk_key]


def _volume_entries(links: list[Snapshot]) -> tuple[list[dict[str, Any]],
                                                    list[tuple[str, Path, int]]]:
    """The read-only volumes the chain's snapshots attach (once each), or ``PackError``
    for a read-write one or a volume image missing here."""
    from vmfork.runtime.volumes import VolumeError, volume_image_path
    found: dict[str, Path] = {}
    for snap in links:
        for key, read_only, guest_path in _state_volumes(snap.state_path, snap.meta):
            where = f" at {guest_path}" if guest_path else ""
            if not read_only:
                raise PackError(
                    f"snapshot {snap.tag!r} records a read-write volume{where} (a workspace's "
                    "suspension): that volume is a file of this host its workspace goes on "
                    "writing, not part of the snapshot, so it cannot travel in a pack; "
                    "resume the workspace, or copy the volume file yourself",
                    tag=snap.tag)
            try:
                path = volume_image_path(key)
            except VolumeError as err:
                raise PackError(f"snapshot {snap.tag!r}: {err}", tag=snap.tag) from None
            if not path.is_file():
                raise PackError(f"snapshot {snap.tag!r} attaches volume {key}{where}, whose "
                                f"image {path} is gone from this host's cache", tag=snap.tag)
            found[key] = path
    ordered = sorted(found.items())
    volumes: list[dict[str, Any]] = [
        {"key": key, "size": path.stat().st_size, "hash": hash_file(path)}
        for key, path in ordered]
    return volumes, [(f"volumes/{key}.img", path, path.stat().st_size)
                     for key, path in ordered]


def _image_entry(name: str) -> tuple[dict[str, Any], list[tuple[str, Path, int]]]:
    from vmfork.image import ImageError, find_image
    try:
        image = find_image(name)
    except ImageError as err:
        raise PackError(f"the snapshot's guest image cannot be packed: {err}; or pack without "
                        "it (`vmfork pack --no-image`)") from err
    files = {KERNEL_FILE: image.kernel, INITRD_FILE: image.initrd}
    if image.disk is not None:
        files[DISK_FILE] = image.disk   # stored once, whatever else uses the image
    entry = {"name": image.name, "record": image.to_record(),
             "files": {n: {"size": p.stat().st_size, "hash": hash_file(p)}
                       for n, p in files.items()}}
    return entry, [(f"image/{n}", p, p.stat().st_size) for n, p in files.items()]


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)

    def read(self, n: int = -1) -> bytes:
        n = len(self._view) if n < 0 else n
        chunk, self._view = self._view[:n], self._view[n:]
        return bytes(chunk)


def _add(tar: tarfile.TarFile, name: str, size: int, source: Any) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    tar.addfile(info, source)


# -- unpack -----------------------------------------------------------------------------

@dataclass
class _Expected:
    size: int
    digest: str
    target: Path | None          # None: already stored here; hashed, then discarded
    sparse: bool = False
    seen: bool = False


def unpack(store: Store, pack_path: Path, *, head_tag: str | None = None,
           force: bool = False) -> UnpackReport:
    """Restore a pack into ``store`` (see the module docstring for what is refused).
    ``head_tag`` renames the chain's head; ``force`` replaces snapshots that hold other
    content under the pack's tags (refused if others depend on them)."""
    if head_tag is not None:
        validate_tag(head_tag)
    pack_path = Path(pack_path)
    if not pack_path.is_file():
        raise PackError(f"{pack_path} is not a file; give the path of a .tar.zst written by "
                        "`vmfork pack`")
    report = UnpackReport()
    with contextlib.ExitStack() as cleanup:
        # Everything is written into one private pending directory of the store (a
        # throw-away tag), so a crash at any point leaves only what the store's own
        # stale cleanup removes; it is never published, only emptied into real tags.
        staging = cleanup.enter_context(store.begin(f"unpack-{secrets.token_hex(8)}"))
        zstd = subprocess.Popen(["zstd", "-q", "-d", "-c", str(pack_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        cleanup.callback(_reap, zstd)
        assert zstd.stdout is not None
        tar = TarStream(zstd.stdout, max_header_bytes=MAX_TAR_HEADER_BYTES,
                        max_name_bytes=MAX_TAR_NAME_BYTES)
        members = _members(tar, pack_path, zstd)
        manifest = _read_manifest(tar, members, pack_path, zstd)
        plan = _plan(store, manifest, head_tag, force, report)
        expected = _expected_entries(plan, manifest, staging.path)
        _extract(tar, members, expected, pack_path, zstd)
        # The archive's end is followed by the padding of its last record (tarfile
        # writes 10 KiB records): read it, so zstd is not cut off mid-write, but no
        # more than that; a stream that goes on is not one `vmfork pack` wrote.
        if len(zstd.stdout.read(MAX_TRAILER_BYTES + 1)) > MAX_TRAILER_BYTES:
            raise _refused(pack_path, "data follows the end of its archive", zstd)
        zstd.stdout.close()
        if zstd.wait() != 0:
            raise _refused(pack_path, "the compressed stream is damaged or truncated", zstd)
        missing = [n for n, e in expected.items() if not e.seen]
        if missing:
            raise _refused(pack_path, f"entries missing (truncated?): {', '.join(missing)}")
        _check_disk(manifest.get("image"), staging.path / "image")
        volume_keys = _check_volumes(plan, manifest, staging.path)
        # Verified. Only now does anything outside the staging directory change.
        _install_volumes(volume_keys, staging.path / "volumes")
        _replace_for_force(store, plan)
        _publish(store, plan, staging.path, report)
        if manifest.get("image") is not None:
            report.image, report.image_note = _install_image(manifest["image"],
                                                             staging.path / "image")
    return report


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _refused(pack_path: Path, why: str, zstd: subprocess.Popen[bytes] | None = None
             ) -> PackError:
    detail = ""
    if zstd is not None and zstd.poll() not in (None, 0) and zstd.stderr is not None:
        detail = zstd.stderr.read(2000).decode(errors="replace").strip()
        detail = f" (zstd: {detail})" if detail else ""
    return PackError(f"refusing pack {pack_path}: {why}{detail}; nothing was stored")


def _members(tar: TarStream, pack_path: Path,
             zstd: subprocess.Popen[bytes]) -> Iterator[Member]:
    while True:
        try:
            member = tar.next()
        except TarFormatError as err:
            raise _refused(pack_path, f"unreadable tar stream ({err})", zstd) from None
        if member is None:
            return
        yield member


def _check_member(member: Member, pack_path: Path) -> None:
    name = member.name
    if name.startswith("/"):
        raise _refused(pack_path, f"entry {name!r} has an absolute path")
    if ".." in name.split("/"):
        raise _refused(pack_path, f"entry {name!r} climbs out with '..'")
    if member.kind != FILE:
        kind = ("a link" if member.kind in ("symlink", "hardlink") else
                "a device" if member.kind in ("chardev", "blockdev") else
                "a directory" if member.kind == "directory" else "not a regular file")
        raise _refused(pack_path, f"entry {name!r} is {kind}; packs hold regular files only")


def _read_manifest(tar: TarStream, members: Iterator[Member],
                   pack_path: Path, zstd: subprocess.Popen[bytes]) -> dict[str, Any]:
    first = next(members, None)
    if first is None:
        raise _refused(pack_path, "it is empty", zstd)
    _check_member(first, pack_path)
    if first.name != MANIFEST:
        raise _refused(pack_path, f"the first entry is {first.name!r}, not {MANIFEST}")
    if first.size > MAX_MANIFEST_BYTES:
        raise _refused(pack_path, f"{MANIFEST} is {first.size} bytes (limit "
                       f"{MAX_MANIFEST_BYTES})")
    try:
        raw = tar.read(first.size)
        manifest = json.loads(raw)
    except (TarFormatError, ValueError, RecursionError) as err:
        raise _refused(pack_path, f"{MANIFEST} is not readable JSON ({str(err)[:100]})",
                       zstd) from None
    if not isinstance(manifest, dict) or manifest.get("format") != PACK_FORMAT:
        raise _refused(pack_path, f"{MANIFEST} is not a {PACK_FORMAT} manifest")
    version = manifest.get("format_version")
    if version != PACK_FORMAT_VERSION:
        raise _refused(pack_path, f"pack format version {version!r} is not one this vmfork "
                       f"reads ({PACK_FORMAT_VERSION}); upgrade vmfork to unpack it")
    return manifest


def _plan(store: Store, manifest: dict[str, Any], head_tag: str | None, force: bool,
          report: UnpackReport) -> list[dict[str, Any]]:
    """Validate the manifest's chain and decide, per snapshot, to store it or reuse the
    snapshot already here. Nothing is written."""
    entries = manifest.get("snapshots")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_CHAIN_DEPTH + 1:
        raise PackError("refusing pack: its manifest does not list a chain of 1 to "
                        f"{MAX_CHAIN_DEPTH + 1} snapshots; nothing was stored")
    plan: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for i, entry in enumerate(entries):
        tag = entry.get("tag") if isinstance(entry, dict) else None
        if not is_valid_tag(tag):
            raise PackError(f"refusing pack: snapshot {i} has an invalid tag {tag!r}; nothing "
                            "was stored")
        assert isinstance(entry, dict) and isinstance(tag, str)
        try:
            meta = from_json_value(entry.get("meta"), SnapshotMeta)
        except (StateFormatError, TypeError, ValueError) as err:
            raise PackError(f"refusing pack: the meta of {tag!r} is malformed ({err}); nothing "
                            "was stored") from None
        parent = previous["tag"] if previous else None
        if meta.tag != tag or entry.get("parent_tag") != parent or meta.parent_tag != parent:
            raise PackError(f"refusing pack: {tag!r} is not the child of {parent!r} its "
                            "position says; nothing was stored")
        if any(p["tag"] == tag for p in plan):
            raise PackError(f"refusing pack: {tag!r} is listed twice; nothing was stored")
        own = MEMORY_FILE if i == 0 else LAYER_FILE
        files = entry.get("files")
        if not isinstance(files, dict) or set(files) != {STATE_FILE, own}:
            raise PackError(f"refusing pack: {tag!r} must carry exactly {STATE_FILE} and {own};"
                            " nothing was stored")
        if not 1 <= meta.mem_mib <= MAX_GUEST_MEM_MIB:
            raise PackError(f"refusing pack: {tag!r} claims {meta.mem_mib} MiB of guest RAM "
                            f"(limit {MAX_GUEST_MEM_MIB}); nothing was stored")
        mem_bytes = meta.mem_mib << 20
        limits = {STATE_FILE: MAX_STATE_BYTES, MEMORY_FILE: mem_bytes,
                  LAYER_FILE: mem_bytes + (mem_bytes >> 6) + (1 << 20)}
        for name, spec in files.items():
            if not (isinstance(spec, dict) and isinstance(spec.get("size"), int)
                    and isinstance(spec.get("hash"), str)
                    and 0 <= spec["size"] <= limits[name]):
                raise PackError(f"refusing pack: {tag!r}/{name} has a malformed or oversized "
                                f"entry (limit {limits[name]} bytes); nothing was stored")
        if i == 0 and files[MEMORY_FILE]["size"] != mem_bytes:
            raise PackError(f"refusing pack: {tag!r}/memory.bin is not {meta.mem_mib} MiB as "
                            "its meta says; nothing was stored")
        new_tag = head_tag if (head_tag is not None and i == len(entries) - 1) else tag
        # A snapshot on top of one stored anew is stored anew too (its parent differs).
        present = None
        if previous is None or previous["present"] is not None:
            present = _present(store, new_tag, meta, files)
        exists = present is None and store.exists(new_tag)
        if exists and not force:
            raise PackError(f"refusing pack: snapshot tag {new_tag!r} already exists here "
                            "with other content; unpack with --tag NEW for the head, or "
                            "--force to replace it; nothing was stored", tag=new_tag)
        plan.append({"tag": tag, "new_tag": new_tag, "meta": meta, "files": files,
                     "present": present, "replace": exists})
        previous = plan[-1]
    report.tags = [p["new_tag"] for p in plan]
    return plan


def _present(store: Store, tag: str, meta: SnapshotMeta,
             files: dict[str, dict[str, Any]]) -> Snapshot | None:
    """The snapshot already stored under ``tag`` if it is the pack's (same content hash,
    or the same hashes for every file the pack carries), else None."""
    try:
        existing = store.get(tag)
    except (SnapshotNotFound, SnapshotCorrupt):
        return None
    if meta.content_hash is not None and existing.meta.content_hash == meta.content_hash:
        return existing
    for name, spec in files.items():
        path = existing.path / name
        recorded = existing.meta.file_hashes.get(name)
        if not path.is_file() or (recorded or _hash(name, path)) != spec["hash"]:
            return None
    return existing


def _replace_for_force(store: Store, plan: list[dict[str, Any]]) -> None:
    """Delete the snapshots ``--force`` replaces, refusing first (with nothing changed)
    if a snapshot outside the pack depends on one of them."""
    doomed = {item["new_tag"] for item in plan if item["replace"]}
    if not doomed:
        return
    children = store.dependents_map()
    for tag in sorted(doomed):
        outside = [c for c in children.get(tag, []) if c not in doomed]
        if outside:
            raise HasDependents(tag, outside)
    for item in reversed(plan):
        if item["replace"] and store.exists(item["new_tag"]):
            store.delete(item["new_tag"], cascade=True)


def _expected_entries(plan: list[dict[str, Any]], manifest: dict[str, Any],
                      staging: Path) -> dict[str, _Expected]:
    expected: dict[str, _Expected] = {}
    for item in plan:
        target_dir = None
        if item["present"] is None:
            target_dir = staging / "snapshots" / item["tag"]
            target_dir.mkdir(parents=True)
        for name, spec in item["files"].items():
            expected[f"snapshots/{item['tag']}/{name}"] = _Expected(
                spec["size"], spec["hash"], target_dir / name if target_dir else None,
                sparse=name == MEMORY_FILE)
    image = manifest.get("image")
    if image is not None:
        files = image.get("files") if isinstance(image, dict) else None
        record = image.get("record") if isinstance(image, dict) else None
        wanted = {KERNEL_FILE, INITRD_FILE}
        if isinstance(record, dict) and record.get("disk_key") is not None:
            wanted.add(DISK_FILE)
        if not isinstance(files, dict) or set(files) != wanted:
            raise PackError("refusing pack: its image entry must carry exactly "
                            f"{', '.join(sorted(wanted))}; nothing was stored")
        (staging / "image").mkdir()
        for name, spec in files.items():
            limit = MAX_DISK_BYTES if name == DISK_FILE else MAX_IMAGE_FILE_BYTES
            if not (isinstance(spec, dict) and isinstance(spec.get("size"), int)
                    and isinstance(spec.get("hash"), str)
                    and 0 <= spec["size"] <= limit):
                raise PackError(f"refusing pack: image/{name} has a malformed or oversized "
                                "entry; nothing was stored")
            expected[f"image/{name}"] = _Expected(spec["size"], spec["hash"],
                                                  staging / "image" / name)
    volumes = manifest.get("volumes") or []
    if not isinstance(volumes, list) or len(volumes) > MAX_PACK_VOLUMES:
        raise PackError(f"refusing pack: its volumes entry is not a list of at most "
                        f"{MAX_PACK_VOLUMES}; nothing was stored")
    if volumes:
        (staging / "volumes").mkdir()
    for spec in volumes:
        key = spec.get("key") if isinstance(spec, dict) else None
        if not (isinstance(key, str) and _VOLUME_KEY.fullmatch(key)
                and isinstance(spec.get("size"), int) and isinstance(spec.get("hash"), str)
                and 0 < spec["size"] <= MAX_VOLUME_BYTES and spec["size"] % 512 == 0
                and f"volumes/{key}.img" not in expected):
            raise PackError("refusing pack: a volume entry is malformed, oversized or "
                            "repeated; nothing was stored")
        expected[f"volumes/{key}.img"] = _Expected(spec["size"], spec["hash"],
                                                   staging / "volumes" / f"{key}.img")
    return expected


_VOLUME_KEY = re.compile(r"[0-9a-f]{32}")


def _check_volumes(plan: list[dict[str, Any]], manifest: dict[str, Any],
                   staging: Path) -> list[str]:
    """Every volume the unpacked snapshots attach is in the pack (and is what its key
    says: bytes or tree) or already here; returns the pack's volume keys, verified."""
    from vmfork.runtime.volumes import volume_image_path
    packed = [v["key"] for v in manifest.get("volumes") or []]
    for key in packed:
        _verify_volume(key, staging / "volumes" / f"{key}.img")
    for item in plan:
        if item["present"] is not None:
            continue
        state_path = staging / "snapshots" / item["tag"] / STATE_FILE
        attached = _state_volumes(state_path, item["meta"])
        for key, read_only, _ in attached:
            if not read_only:
                raise PackError(f"refusing pack: snapshot {item['tag']!r} records a "
                                "read-write volume, which packs never carry; nothing was "
                                "stored")
            if key not in packed and not volume_image_path(key).is_file():
                raise PackError(f"refusing pack: snapshot {item['tag']!r} attaches volume "
                                f"{key}, which is neither in the pack nor here; nothing "
                                "was stored")
    return packed


def _verify_volume(key: str, path: Path) -> None:
    from vmfork.image.debian import sha256_file
    if sha256_file(path)[:32] == key:
        return      # an image file's volume: named by its bytes
    # A directory's volume: named by its tree, so the tree is what is checked.
    from vmfork.runtime.volumes import tree_key
    tree = Path(tempfile.mkdtemp(prefix=".volume-", dir=path.parent))
    try:
        done = subprocess.run(["fsck.erofs", f"--extract={tree / 'root'}", "--preserve-perms",
                               "--no-preserve-owner", str(path)], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise PackError(f"refusing pack: volume {key} is neither an image file named by "
                            "its bytes nor a readable erofs volume (fsck.erofs: "
                            f"{done.stderr.strip()[-300:]}); nothing was stored")
        actual = tree_key(tree / "root", "erofs-plain")
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    if actual != key:
        raise PackError(f"refusing pack: volume {key}'s files hash to {actual}, not its "
                        "key; nothing was stored")


def _install_volumes(keys: list[str], staging: Path) -> None:
    """Put the verified volume images where spawns look for them (an entry already
    here is the same content: it is kept)."""
    from vmfork.image.cache import cached_entry
    from vmfork.runtime.volumes import VOLUME_FILE

    def put(source: Path, out: Path) -> None:
        shutil.move(source, out / VOLUME_FILE)   # the store and the cache may differ
        os.chmod(out / VOLUME_FILE, 0o444)

    for key in keys:
        cached_entry("volumes", key, functools.partial(put, staging / f"{key}.img"))


def _extract(tar: TarStream, members: Iterator[Member],
             expected: dict[str, _Expected], pack_path: Path,
             zstd: subprocess.Popen[bytes]) -> None:
    while True:
        member = next(members, None)
        if member is None:
            return
        _check_member(member, pack_path)
        want = expected.get(member.name)
        if want is None:
            raise _refused(pack_path, f"entry {member.name!r} is not in its manifest")
        if want.seen:
            raise _refused(pack_path, f"entry {member.name!r} appears twice")
        if member.size != want.size:
            raise _refused(pack_path, f"entry {member.name!r} is {member.size} bytes, its "
                           f"manifest says {want.size}")
        want.seen = True
        try:
            digest = _copy(tar, want)
        except TarFormatError as err:
            raise _refused(pack_path, f"entry {member.name!r} is truncated ({err})",
                           zstd) from None
        if digest != want.digest:
            raise _refused(pack_path, f"entry {member.name!r} does not match its hash "
                           f"(manifest {want.digest}, content {digest})")


def _copy(source: TarStream, want: _Expected) -> str:
    """Stream one entry to its target (holes for zero blocks of memory) and return its
    hash in the manifest's scheme."""
    plain = hashlib.blake2b(digest_size=32)
    mib = hashlib.blake2b(digest_size=32)
    mib.update(want.size.to_bytes(8, "little"))
    fd = -1
    if want.target is not None:
        fd = os.open(want.target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        offset = 0
        while offset < want.size:
            chunk = source.read(min(_BLOCK, want.size - offset))
            if not chunk:
                raise TarFormatError(f"ended at {offset} of {want.size} bytes")
            if want.sparse:
                # Blocks are whole MiB except the last; the reader fills each one.
                zero = chunk == _ZERO[:len(chunk)]
                mib.update(b"Z" if zero else b"D" + hashlib.blake2b(chunk, digest_size=32)
                           .digest())
                if fd >= 0 and not zero:
                    _write_nonzero_pages(fd, chunk, offset)
            else:
                plain.update(chunk)
                if fd >= 0:
                    os.write(fd, chunk)
            offset += len(chunk)
        if fd >= 0:
            os.ftruncate(fd, want.size)
    finally:
        if fd >= 0:
            os.close(fd)
    if want.sparse:
        return f"blake2b-256-mib:{mib.hexdigest()}"
    return f"{HASH_NAME}:{plain.hexdigest()}"


def _write_nonzero_pages(fd: int, chunk: bytes, offset: int) -> None:
    """Write the pages of ``chunk`` that hold data; zero pages stay holes (the file is
    extended to its full length afterwards), so memory comes back as sparse as it left."""
    view = memoryview(chunk)
    for start in range(0, len(chunk), _PAGE):
        page = view[start:start + _PAGE]
        if page != _ZERO[:len(page)]:
            os.pwrite(fd, page, offset + start)


def _check_disk(entry: Any, staging: Path) -> None:
    """A pack's root disk is stored under the hash of its bytes, checked before anything
    is published: a pack cannot put other bytes where a snapshot's (or a local build's)
    disk is looked up, and a bad disk leaves no snapshot behind that needs it."""
    if not isinstance(entry, dict) or not isinstance(entry.get("record"), dict):
        return
    key = entry["record"].get("disk_key")
    if key is None:
        return
    from vmfork.image.builder import disk_content_key

    actual = disk_content_key(staging / DISK_FILE)
    if actual != key:
        raise PackError(f"refusing pack: its root disk's SHA-256 is {actual}, not the "
                        f"{key} its image record names; nothing was stored")


def _content_key(path: Path) -> str:
    """The cache key a pack's kernel or initramfs is stored under: the SHA-256 of its
    bytes, whatever key the pack's record claims. A local build's entries are keyed by
    the hash of their *recipe*; a pack naming a recipe's key (so that every later
    ``vmfork image build`` found the pack's kernel and PID 1 in the cache) would need a
    SHA-256 preimage of that key to land there now."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _install_image(entry: dict[str, Any], staging: Path) -> tuple[str | None, str | None]:
    """Install the pack's guest image unless one of that name exists (never replaced).
    Its kernel and initramfs go under keys recomputed from their content."""
    from vmfork.image import GuestImage, ImageError, find_image, write_record
    from vmfork.image.cache import cached_entry
    from vmfork.paths import cache_dir
    record = entry.get("record")
    if not isinstance(record, dict):
        raise PackError("refusing pack: its image record is not an object; nothing was "
                        "stored")
    record = {**record, "kernel_key": _content_key(staging / KERNEL_FILE),
              "initramfs_key": _content_key(staging / INITRD_FILE)}
    try:
        image = GuestImage.from_record(record, cache_dir())
    except (KeyError, TypeError, ValueError) as err:
        raise PackError(f"refusing pack: its image record is malformed ({err}); nothing was "
                        "stored") from None
    try:
        existing = find_image(image.name)
    except ImageError:
        existing = None
    if image.disk_key is not None:
        from vmfork.image.builder import publish_disk

        publish_disk(staging / DISK_FILE, image.disk_key)   # checked by _check_disk
    if existing is not None:
        if (existing.kernel_key, existing.initramfs_key, existing.disk_key) == \
                (image.kernel_key, image.initramfs_key, image.disk_key):
            return image.name, None
        note = (" (its root disk is installed: the snapshots spawn)" if image.disk_key
                else " (snapshots spawn without it; it is only needed to boot new parents)")
        return None, f"a different image named {image.name!r} exists here and was kept{note}"
    for kind, key, name in (("kernel", image.kernel_key, KERNEL_FILE),
                            ("initramfs", image.initramfs_key, INITRD_FILE)):
        cached_entry(kind, key, functools.partial(_copy_into, staging / name, name))
    write_record(image)
    return image.name, None


def _copy_into(source: Path, name: str, directory: Path) -> None:
    shutil.copyfile(source, directory / name)


def _publish(store: Store, plan: list[dict[str, Any]], staging: Path,
             report: UnpackReport) -> None:
    """Publish root to head from the verified staging files; on failure delete what
    this unpack published."""
    published: list[str] = []
    try:
        parent: Snapshot | None = None
        for item in plan:
            if item["present"] is not None:
                parent = item["present"]
                report.present.append(item["new_tag"])
                continue
            meta = dataclasses.replace(item["meta"], tag=item["new_tag"])
            with store.begin(item["new_tag"]) as pending:
                for name in item["files"]:
                    os.rename(staging / "snapshots" / item["tag"] / name, pending.path / name)
                # The store's one publish path: a root keeps the content hash it was
                # packed with, a link's must come out as recorded.
                snap = pending.publish(meta, parent=parent,
                                       recorded_content_hash=meta.content_hash)
            published.append(snap.tag)
            report.stored.append(snap.tag)
            parent = snap
    except BaseException:
        for tag in reversed(published):
            with contextlib.suppress(StoreError):
                store.delete(tag)
        raise
