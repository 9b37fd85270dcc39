"""Packs carry read-only volumes (issue 14): the images of a snapshot's volumes travel
with it, once each, and are verified on unpack by what their keys are made of (an
image file's bytes; a directory's tree, recomputed from the erofs image's files); a
forged or tampered volume, or one neither in the pack nor here, refuses the pack with
nothing stored; a read-write volume is refused at pack time with the reason.

Real volume images (``runtime.volumes.prepare``: mkfs.erofs of a real directory, a
copied image file) in a private cache; snapshots with fake machine state, whose
volumes are what their meta recorded (the fallback ``packs._state_volumes`` takes for
a state that does not decode). tests/e2e/test_image_run.py packs a real one."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
from test_chains import MEM, PAGE_SIZE

from vmfork.image import GuestImage, write_record
from vmfork.image.cache import cached_entry
from vmfork.runtime.volumes import VolumeSpec, prepare, volume_image_path
from vmfork.store import SnapshotMeta, Store, packs
from vmfork.store.packs import PackError


@pytest.fixture(autouse=True)
def image_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(cache))
    for kind, key, name in (("kernel", "aaaaaaaaaaaa", "vmlinux"),
                            ("initramfs", "bbbbbbbbbbbb", "initramfs.cpio")):
        cached_entry(kind, key, lambda d, name=name: (d / name).write_bytes(b"X" * 512))
    write_record(GuestImage.from_record({
        "format": 1, "name": "default", "kernel_key": "aaaaaaaaaaaa",
        "initramfs_key": "bbbbbbbbbbbb", "cmdline": "rdinit=/init",
        "created": "2026-01-01T00:00:00+00:00", "kernel_size": 512, "initrd_size": 512},
        cache))
    return cache


def _volumes(tmp_path: Path) -> list[dict[str, Any]]:
    tree = tmp_path / "corpus"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub/data.bin").write_bytes(os.urandom(200_000))
    (tree / "readme").write_text("a directory volume\n")
    os.symlink("sub/data.bin", tree / "link")
    image_file = tmp_path / "vol.img"
    image_file.write_bytes(os.urandom(8 * 512))
    made = [prepare(VolumeSpec(str(tree), "/data", True)),
            prepare(VolumeSpec(str(image_file), "/blob", True))]
    return [{"guest_path": v.guest_path, "key": v.key, "read_only": True, "source": v.source}
            for v in made]


def _snapshot(store: Store, tag: str, volumes: list[dict[str, Any]]) -> None:
    with store.begin(tag) as pending:
        pending.state_path.write_bytes(b"STATE-" + tag.encode())
        with open(pending.memory_path, "wb") as f:
            f.truncate(MEM)
            f.write(b"page".ljust(PAGE_SIZE, b"\0"))
        pending.publish(SnapshotMeta(tag=tag, image="default", mem_mib=MEM >> 20,
                                     vcpus=1, extra={"volumes": volumes}))


def _rewrite(pack: Path, out: Path, change: Any) -> None:
    """The pack with ``change(name, data) -> data`` applied to each entry's bytes."""
    raw = subprocess.run(["zstd", "-q", "-d", "-c", str(pack)], check=True,
                         capture_output=True).stdout
    buf = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(raw)) as src, \
            tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
            f = src.extractfile(member)
            assert f is not None
            data = change(member.name, f.read())
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    out.write_bytes(subprocess.run(["zstd", "-q", "-c"], input=buf.getvalue(), check=True,
                                   capture_output=True).stdout)


def test_volumes_travel_and_are_installed_where_spawns_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = Store.open(tmp_path / "source")
    volumes = _volumes(tmp_path)
    _snapshot(source, "data", volumes)
    out = tmp_path / "data.tar.zst"
    packs.pack(source, "data", out)
    originals = {v["key"]: volume_image_path(v["key"]).read_bytes() for v in volumes}

    monkeypatch.setenv("VMFORK_CACHE_DIR", str(tmp_path / "other-host"))
    assert not any(volume_image_path(v["key"]).exists() for v in volumes)
    target = Store.open(tmp_path / "target")
    report = packs.unpack(target, out)
    assert report.stored == ["data"]
    for key, data in originals.items():
        path = volume_image_path(key)
        assert path.read_bytes() == data
        assert path.stat().st_mode & 0o222 == 0      # immutable, as every cache file
    # Unpacked again (the volumes already here): the same content, kept.
    packs.unpack(Store.open(tmp_path / "again"), out)


def test_forged_or_tampered_volumes_refuse_the_pack(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    source = Store.open(tmp_path / "source")
    volumes = _volumes(tmp_path)
    _snapshot(source, "data", volumes)
    out = tmp_path / "data.tar.zst"
    packs.pack(source, "data", out)
    tree_key, file_key = volumes[0]["key"], volumes[1]["key"]
    # Another directory's erofs image put under the directory volume's key, with a
    # manifest hash to match: its files are not the tree the key names.
    other = tmp_path / "other"
    other.mkdir()
    (other / "evil").write_text("not the corpus\n")
    forged = Path(prepare(VolumeSpec(str(other), "/x", True)).path).read_bytes()
    # And other bytes under the image file's key.
    junk = os.urandom(8 * 512)

    def swap(which: str, payload: bytes) -> Any:
        from vmfork.store.layers import hash_file

        holder = tmp_path / "payload"
        holder.write_bytes(payload)

        def change(name: str, data: bytes) -> bytes:
            if name == "manifest.json":
                manifest = json.loads(data)
                for v in manifest["volumes"]:
                    if v["key"] == which:
                        v["size"], v["hash"] = len(payload), hash_file(holder)
                return json.dumps(manifest).encode()
            return payload if name == f"volumes/{which}.img" else data
        return change

    monkeypatch.setenv("VMFORK_CACHE_DIR", str(tmp_path / "other-host"))
    for n, (which, payload, why) in enumerate([(tree_key, forged, "hash to"),
                                               (file_key, junk, "neither an image file")]):
        bad = tmp_path / f"bad{n}.tar.zst"
        _rewrite(out, bad, swap(which, payload))
        target = Store.open(tmp_path / f"target{n}")
        with pytest.raises(PackError, match=why):
            packs.unpack(target, bad)
        assert target.list() == []
        assert not volume_image_path(which).exists()
        assert not any(volume_image_path(v["key"]).exists() for v in volumes)
    # Bytes changed without the manifest knowing: the stream's own hash check.
    bad = tmp_path / "flipped.tar.zst"
    _rewrite(out, bad, lambda name, data: bytes([data[0] ^ 1]) + data[1:]
             if name == f"volumes/{file_key}.img" else data)
    with pytest.raises(PackError, match="does not match its hash"):
        packs.unpack(Store.open(tmp_path / "flipped"), bad)
    # A volume left out of the pack that this host does not have either.
    bad = tmp_path / "missing.tar.zst"

    def drop(name: str, data: bytes) -> bytes:
        if name == "manifest.json":
            manifest = json.loads(data)
            manifest["volumes"] = [v for v in manifest["volumes"] if v["key"] != file_key]
            return json.dumps(manifest).encode()
        return data
    raw = subprocess.run(["zstd", "-q", "-d", "-c", str(out)], check=True,
                         capture_output=True).stdout
    buf = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(raw)) as src, \
            tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
            if member.name == f"volumes/{file_key}.img":
                continue
            f = src.extractfile(member)
            assert f is not None
            data = drop(member.name, f.read())
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    bad.write_bytes(subprocess.run(["zstd", "-q", "-c"], input=buf.getvalue(), check=True,
                                   capture_output=True).stdout)
    target = Store.open(tmp_path / "missing")
    with pytest.raises(PackError, match="neither in the pack nor here"):
        packs.unpack(target, bad)
    assert target.list() == []


def test_a_read_write_volume_is_refused_at_pack_time(tmp_path: Path) -> None:
    source = Store.open(tmp_path / "source")
    _snapshot(source, "ws", [{"guest_path": "/work", "key": "0" * 32, "read_only": False,
                              "source": "/srv/work.img"}])
    out = tmp_path / "ws.tar.zst"
    with pytest.raises(PackError, match="read-write volume at /work.*workspace"):
        packs.pack(source, "ws", out)
    assert not out.exists() and not list(tmp_path.glob(".ws.tar.zst.*"))


def test_a_volume_gone_from_the_cache_is_refused_at_pack_time(tmp_path: Path) -> None:
    source = Store.open(tmp_path / "source")
    volumes = _volumes(tmp_path)
    _snapshot(source, "data", volumes)
    path = volume_image_path(volumes[1]["key"])
    os.chmod(path.parent, 0o755)
    path.unlink()
    with pytest.raises(PackError, match="gone from this host's cache"):
        packs.pack(source, "data", tmp_path / "data.tar.zst")
