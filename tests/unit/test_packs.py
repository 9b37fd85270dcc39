"""Packs without KVM: round trip into a second store, dedupe, --tag/--force, and hostile
packs (traversal, links, devices, size bombs, hash mismatch, truncation, unknown
versions, duplicates) refused with nothing left behind."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_chains import image, make_link, make_root, page
from test_store import SRC

from tests.memory_support import reset_peak, status_kib
from vmfork.image import GuestImage, find_image, write_record
from vmfork.image.cache import cached_entry
from vmfork.store import SnapshotMeta, Store, chains, packs
from vmfork.store.errors import HasDependents
from vmfork.store.packs import PackError


@pytest.fixture(autouse=True)
def image_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private image cache holding a small fake image named 'default'."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(cache))
    files = {"kernel": ("aaaaaaaaaaaa", "vmlinux", b"KERNEL" * 100),
             "initramfs": ("bbbbbbbbbbbb", "initramfs.cpio", b"CPIO" * 100)}
    for kind, (key, name, data) in files.items():
        cached_entry(kind, key, lambda d, name=name, data=data: (d / name).write_bytes(data))
    write_record(GuestImage.from_record({
        "format": 1, "name": "default", "kernel_key": "aaaaaaaaaaaa",
        "initramfs_key": "bbbbbbbbbbbb", "cmdline": "rdinit=/init",
        "created": "2026-01-01T00:00:00+00:00", "kernel_size": 600, "initrd_size": 400},
        cache))
    return cache


@pytest.fixture
def source(tmp_path: Path) -> Store:
    store = Store.open(tmp_path / "source")
    make_root(store, "base", {1: b"base-1", 700: b"base-700"})
    make_link(store, "base", "numpy", {2: b"numpy-2"})
    make_link(store, "numpy", "pandas", {3: b"pandas-3"})
    return store


@pytest.fixture
def target(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "target")


def leftovers(store: Store) -> list[str]:
    return sorted(os.listdir(store.snapshots_dir))


def test_round_trip_restores_the_chain_and_its_image(source: Store, target: Store,
                                                     tmp_path: Path, image_cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "pandas.tar.zst"
    report = packs.pack(source, "pandas", out)
    assert report.tags == ["base", "numpy", "pandas"] and report.image == "default"
    assert out.stat().st_size < 64 << 10          # 4 MiB of mostly holes, compressed
    fresh_cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(fresh_cache))
    result = packs.unpack(target, out)
    assert result.stored == ["base", "numpy", "pandas"] and result.image == "default"
    assert find_image("default").kernel.read_bytes() == b"KERNEL" * 100
    for tag in ("base", "numpy", "pandas"):
        assert image(target, tag) == image(source, tag)
        assert target.get(tag).meta.content_hash == source.get(tag).meta.content_hash
    assert page(target, "pandas", 700) == b"base-700"
    # Unpacked links keep only their layers and map the chain: no resolved memory.bin.
    assert target.get("pandas").is_layered and not target.get("pandas").memory_path.exists()
    info = chains.snapshot_info(target, "pandas")
    assert info["ancestors"] == ["base", "numpy"] and info["chain_depth"] == 2
    assert os.stat(target.get("base").memory_path).st_blocks * 512 < 1 << 20   # sparse
    assert {c.status for c in chains.verify(target)} <= {"ok", "unhashed"}
    # Unpacking again stores nothing: every snapshot is already here.
    again = packs.unpack(target, out)
    assert again.stored == [] and again.present == ["base", "numpy", "pandas"]
    assert leftovers(target) == ["base", "numpy", "pandas"]


def test_unpack_dedupes_shared_ancestors_and_renames_the_head(
        source: Store, target: Store, tmp_path: Path) -> None:
    packs.pack(source, "numpy", tmp_path / "numpy.tar.zst", with_image=False)
    packs.unpack(target, tmp_path / "numpy.tar.zst")
    packs.pack(source, "pandas", tmp_path / "pandas.tar.zst", with_image=False)
    report = packs.unpack(target, tmp_path / "pandas.tar.zst", head_tag="pandas-copy")
    assert report.present == ["base", "numpy"] and report.stored == ["pandas-copy"]
    assert chains.snapshot_info(target, "pandas-copy")["ancestors"] == ["base", "numpy"]


def test_existing_tags_with_other_content_need_force(source: Store, target: Store,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "p.tar.zst"
    packs.pack(source, "numpy", out, with_image=False)
    make_root(target, "base", {1: b"something else"})
    with pytest.raises(PackError, match="--force"):
        packs.unpack(target, out)
    assert leftovers(target) == ["base"]
    make_link(target, "base", "mine", {9: b"mine"})
    with pytest.raises(HasDependents):                    # 'mine' depends on the old base
        packs.unpack(target, out, force=True)
    assert leftovers(target) == ["base", "mine"] and page(target, "base", 1) == b"something else"
    target.delete("mine")
    report = packs.unpack(target, out, force=True)
    assert report.stored == ["base", "numpy"] and page(target, "base", 1) == b"base-1"


# -- hostile packs ------------------------------------------------------------------------

def write_pack(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path.write_bytes(subprocess.run(["zstd", "-q", "-c"], input=buf.getvalue(),
                                    stdout=subprocess.PIPE, check=True).stdout)
    return path


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def real_members(source: Store, tmp_path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    """The entries of a genuine pack of 'numpy' (without image), to tamper with."""
    out = packs.pack(source, "numpy", tmp_path / "genuine.tar.zst", with_image=False).path
    raw = subprocess.run(["zstd", "-q", "-d", "-c", str(out)], stdout=subprocess.PIPE,
                         check=True).stdout
    members = []
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        for m in tar:
            f = tar.extractfile(m)
            assert f is not None
            members.append((m, f.read()))
    return members


def manifest_of(members: list[tuple[tarfile.TarInfo, bytes]]) -> dict[str, Any]:
    return json.loads(members[0][1])  # type: ignore[no-any-return]


def with_manifest(members: list[tuple[tarfile.TarInfo, bytes]],
                  edit: Callable[[dict[str, Any]], None]) -> list[tuple[tarfile.TarInfo, bytes]]:
    manifest = manifest_of(members)
    edit(manifest)
    return [regular("manifest.json", json.dumps(manifest).encode()), *members[1:]]


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def device(name: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    return info, None


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


HOSTILE: dict[str, tuple[Callable[[list[Any]], list[Any]], str]] = {
    "absolute path": (lambda m: [m[0], regular("/etc/evil", b"x"), *m[1:]], "absolute path"),
    "dot-dot": (lambda m: [m[0], regular("snapshots/../../evil", b"x"), *m[1:]], "'..'"),
    "symlink": (lambda m: [m[0], link("snapshots/base/state.bin", "/etc/passwd"), *m[1:]],
                "is a link"),
    "hard link": (lambda m: [m[0], link("snapshots/base/state.bin", "/etc/passwd",
                                        tarfile.LNKTYPE), *m[1:]], "is a link"),
    "device": (lambda m: [m[0], device("snapshots/base/state.bin"), *m[1:]], "is a device"),
    "unlisted entry": (lambda m: [*m, regular("snapshots/base/extra.bin", b"x")],
                       "not in its manifest"),
    "duplicate entry": (lambda m: [*m, m[1]], "appears twice"),
    "hash mismatch": (lambda m: [m[0], m[1], (m[2][0], _flip_last_byte(m[2][1])), *m[3:]],
                      "does not match its hash"),
    "missing entry": (lambda m: m[:-1], "entries missing"),
    "manifest not first": (lambda m: [m[1], m[0], *m[2:]], "first entry"),
    "unknown version": (lambda m: with_manifest(m, lambda d: d.update(format_version=99)),
                        "format version 99"),
    "size bomb": (lambda m: with_manifest(m, lambda d: d["snapshots"][0]["files"]
                                          ["memory.bin"].update(size=1 << 40)), "oversized"),
    "guest RAM bomb": (lambda m: with_manifest(m, lambda d: d["snapshots"][0]["meta"]
                                               .update(mem_mib=1 << 30)), "MiB of guest RAM"),
    "entry larger than declared": (
        lambda m: with_manifest(m, lambda d: d["snapshots"][0]["files"]["state.bin"]
                                .update(size=3)), "manifest says 3"),
    "traversal in a manifest tag": (
        lambda m: with_manifest(m, lambda d: d["snapshots"][1].update(tag="../../x")),
        "invalid tag"),
    "broken chain": (lambda m: with_manifest(m, lambda d: d["snapshots"].reverse()),
                     "not the child"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_packs_are_refused_and_leave_nothing(case: str, source: Store, target: Store,
                                                    tmp_path: Path) -> None:
    tamper, message = HOSTILE[case]
    evil = write_pack(tmp_path / "evil.tar.zst", tamper(real_members(source, tmp_path)))
    with pytest.raises(PackError, match=message):
        packs.unpack(target, evil)
    assert leftovers(target) == [] and not (tmp_path / "evil").exists()
    assert not list(Path("/etc").glob("evil*"))


def test_truncated_and_garbage_packs_are_refused(source: Store, target: Store,
                                                 tmp_path: Path) -> None:
    out = packs.pack(source, "numpy", tmp_path / "p.tar.zst", with_image=False).path
    data = out.read_bytes()
    for cut in (len(data) // 2, len(data) - 40, 20):
        (tmp_path / "cut.tar.zst").write_bytes(data[:cut])
        with pytest.raises(PackError, match="refusing pack"):
            packs.unpack(target, tmp_path / "cut.tar.zst")
        assert leftovers(target) == []
    (tmp_path / "junk.tar.zst").write_bytes(os.urandom(4096))
    with pytest.raises(PackError, match="refusing pack"):
        packs.unpack(target, tmp_path / "junk.tar.zst")
    with pytest.raises(PackError, match="not a file"):
        packs.unpack(target, tmp_path / "absent.tar.zst")
    assert leftovers(target) == []


def test_a_layer_that_lies_about_its_parent_is_refused(source: Store, target: Store,
                                                       tmp_path: Path) -> None:
    members = real_members(source, tmp_path)

    def other_parent_hash(d: dict[str, Any]) -> None:
        d["snapshots"][1]["meta"]["content_hash"] = "blake2b-256:" + "0" * 64

    evil = write_pack(tmp_path / "evil.tar.zst", with_manifest(members, other_parent_hash))
    with pytest.raises(Exception, match="content hash"):
        packs.unpack(target, evil)
    assert leftovers(target) == []


def test_pack_refuses_a_chain_whose_files_changed(source: Store, tmp_path: Path) -> None:
    layer = source.get("numpy").path / "layer.bin"
    with open(layer, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x07")
    with pytest.raises(PackError, match="vmfork verify numpy"):
        packs.pack(source, "pandas", tmp_path / "p.tar.zst", with_image=False)
    assert list(tmp_path.glob("*.tar.zst")) == [] and list(tmp_path.glob(".*.tmp")) == []


def test_a_root_without_a_content_hash_round_trips(target: Store, tmp_path: Path) -> None:
    """Parents made by `vmfork snapshot` before every publish recorded a content hash
    have none (made here as an unpack of such a snapshot makes it); their links' hashes
    are derived from none, and must come out the same after unpack (twice)."""
    source = Store.open(tmp_path / "plain")
    with source.begin("plain") as pending:
        pending.state_path.write_bytes(b"STATE")
        with open(pending.memory_path, "wb") as f:
            f.truncate(4 << 20)
            f.write(b"root page")
        pending.publish(SnapshotMeta(tag="plain", image="default", mem_mib=4, vcpus=1),
                        recorded_content_hash=None)
    assert source.get("plain").meta.content_hash is None
    make_link(source, "plain", "child", {5: b"child"})
    out = packs.pack(source, "child", tmp_path / "c.tar.zst", with_image=False).path
    assert packs.unpack(target, out).stored == ["plain", "child"]
    assert target.get("child").meta.content_hash == source.get("child").meta.content_hash
    assert packs.unpack(target, out).present == ["plain", "child"]


# -- crashes: a SIGKILLed unpack or compaction leaves the store as it was -------------------

def big_root(store: Store, tag: str, mib: int) -> None:
    with store.begin(tag) as pending:
        pending.state_path.write_bytes(b"STATE")
        with open(pending.memory_path, "wb") as f:
            # Incompressible, so that unpacking it is slow enough to interrupt.
            f.writelines(os.urandom(1 << 20) for _ in range(mib))
        pending.publish(SnapshotMeta(tag=tag, image="default", mem_mib=mib, vcpus=1))


def kill_when(proc: subprocess.Popen[str], ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, f"finished before the crash point: {proc.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def in_child(body: str) -> subprocess.Popen[str]:
    code = f"import sys\nsys.path.insert(0, {SRC!r})\n" + body
    return subprocess.Popen([sys.executable, "-c", code], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("operation", ["unpack", "compact"])
def test_a_crash_mid_operation_leaves_the_store_consistent(operation: str, target: Store,
                                                           tmp_path: Path) -> None:
    source = Store.open(tmp_path / "big")
    big_root(source, "big", 96)
    if operation == "unpack":
        out = packs.pack(source, "big", tmp_path / "big.tar.zst", with_image=False).path
        proc = in_child(f"from vmfork.store import Store, packs\n"
                        f"packs.unpack(Store.open({str(target.root)!r}), "
                        f"__import__('pathlib').Path({str(out)!r}))\n")
        store = target
    else:
        proc = in_child(f"from vmfork.store import Store, chains\n"
                        f"chains.compact(Store.open({str(source.root)!r}), 'big', 'flat')\n")
        store = source

    def writing_memory() -> bool:
        return any(p.stat().st_size > 0 for p in
                   store.snapshots_dir.glob(".pending-*/**/memory.bin"))

    kill_when(proc, writing_memory)
    reopened = Store.open(store.root)               # clears the dead writer's pending files
    assert [e for e in os.listdir(reopened.snapshots_dir) if e.startswith(".")] == []
    assert [s.tag for s in reopened.list()] == (["big"] if operation == "compact" else [])
    assert {c.status for c in chains.verify(reopened)} <= {"ok"}


# -- issue 16, item 4: packs that cannot poison anything --------------------------------


def test_a_pack_reusing_a_local_recipe_key_cannot_become_that_cache_entry(
        source: Store, target: Store, tmp_path: Path, image_cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack's record names kernel key 'aaaaaaaaaaaa' (as a local recipe would); on a
    host that has not built that recipe yet, the pack's kernel must not be stored there
    (a later `vmfork image build` would find it in the cache and boot it)."""
    out = tmp_path / "p.tar.zst"
    packs.pack(source, "pandas", out)
    fresh = tmp_path / "fresh-cache"
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(fresh))
    assert packs.unpack(target, out).image == "default"
    assert not (fresh / "kernel" / "aaaaaaaaaaaa").exists()
    assert not (fresh / "initramfs" / "bbbbbbbbbbbb").exists()
    installed = find_image("default")
    import hashlib
    assert installed.kernel_key == hashlib.sha256(b"KERNEL" * 100).hexdigest()
    assert installed.initramfs_key == hashlib.sha256(b"CPIO" * 100).hexdigest()
    assert installed.kernel.read_bytes() == b"KERNEL" * 100   # and its snapshots still boot


def _pax_bomb(path: Path, claimed: int) -> Path:
    """A tar whose first header is a pax extended header claiming ``claimed`` bytes,
    then that many bytes (zeros: they compress to almost nothing)."""
    header = tarfile.TarInfo("././@PaxHeader")
    header.type = tarfile.XHDTYPE
    header.size = claimed
    raw = header.tobuf(format=tarfile.USTAR_FORMAT)
    zstd = subprocess.Popen(["zstd", "-q", "-c", "-1", "-o", str(path)],
                            stdin=subprocess.PIPE)
    assert zstd.stdin is not None
    zstd.stdin.write(raw)
    chunk = b"\0" * (1 << 20)
    for _ in range(claimed >> 20):
        zstd.stdin.write(chunk)
    zstd.stdin.write(b"\0" * 1024)
    zstd.stdin.close()
    assert zstd.wait() == 0
    return path






def test_a_huge_pax_header_is_refused_with_bounded_memory(target: Store,
                                                          tmp_path: Path) -> None:
    bomb = _pax_bomb(tmp_path / "bomb.tar.zst", 300 << 20)
    assert bomb.stat().st_size < 64 << 10
    before = reset_peak()
    with pytest.raises(PackError, match="over the cap"):
        packs.unpack(target, bomb)
    grown_mib = (status_kib("VmHWM") - before) / 1024
    assert grown_mib < 32, f"a {bomb.stat().st_size}-byte pack took {grown_mib:.0f} MiB"
    assert leftovers(target) == []
