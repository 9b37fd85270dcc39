"""OCI images as input: the layer applier against hostile and tricky layers, every
REF form, verification, and pulls from a real registry (Debian's docker-registry,
pushed to with skopeo) in its anonymous, htpasswd and token-auth modes.

Layers are real tar bytes built here (tarfile writes them; the reader under test
is ours). The registry tests need docker-registry, skopeo, htpasswd (apache2-utils)
and openssl, which scripts/lib.sh installs; a machine without them fails these
tests with the command that installs them rather than skipping.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.oci_support import (
    add_image,
    add_index,
    make_oci_layout,
    tar_of_tree,
    write_index,
)
from vmfork.image import oci
from vmfork.image.errors import ImageBuildError
from vmfork.image.layers import LayerApplier, LayerRefused, Limits, decompressed
from vmfork.image.registry import parse_registry_ref, read_credentials

MTIME = 1_600_000_000


# Building layers -------------------------------------------------------------

def _info(name: str, kind: bytes, **kw: Any) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = kw.get("mode", 0o755 if kind == tarfile.DIRTYPE else 0o644)
    info.uid = kw.get("uid", 0)
    info.gid = kw.get("gid", 0)
    info.mtime = kw.get("mtime", MTIME)
    info.linkname = kw.get("link", "")
    info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in kw.get("xattrs", {}).items()}
    return info


def f(name: str, data: bytes = b"", **kw: Any) -> tuple[tarfile.TarInfo, bytes | None]:
    info = _info(name, tarfile.REGTYPE, **kw)
    info.size = len(data)
    return info, data


def d(name: str, **kw: Any) -> tuple[tarfile.TarInfo, bytes | None]:
    return _info(name, tarfile.DIRTYPE, **kw), None


def sym(name: str, target: str, **kw: Any) -> tuple[tarfile.TarInfo, bytes | None]:
    return _info(name, tarfile.SYMTYPE, link=target, **kw), None


def hard(name: str, target: str) -> tuple[tarfile.TarInfo, bytes | None]:
    return _info(name, tarfile.LNKTYPE, link=target), None


def special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes | None]:
    info = _info(name, kind)
    info.devmajor, info.devminor = 1, 3
    return info, None


def layer(*members: tuple[tarfile.TarInfo, bytes | None],
          fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def apply(root: Path, *layers: bytes, limits: Limits | None = None) -> LayerApplier:
    with LayerApplier(root, limits or Limits()) as applier:
        for i, data in enumerate(layers):
            applier.apply(io.BytesIO(data), f"layer {i + 1}")
    return applier


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(cache))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    return cache


# The applier -----------------------------------------------------------------

def test_whiteouts_delete_from_lower_layers(root: Path) -> None:
    apply(root,
          layer(d("a"), f("a/x", b"x"), f("a/y", b"y"), d("b"), f("b/z", b"z"), f("keep", b"k")),
          layer(f("a/.wh.x"), f(".wh.b"), f(".wh.never-existed")))
    assert sorted(os.listdir(root)) == ["a", "keep"]
    assert os.listdir(root / "a") == ["y"]
    assert not any(name.startswith(".wh.") for _, _, names in os.walk(root) for name in names)


def test_opaque_directory_hides_lower_layers_but_keeps_this_layers_entries(root: Path) -> None:
    apply(root,
          layer(d("d"), f("d/old", b"old"), d("d/sub"), f("d/sub/deep", b"deep"), f("other")),
          # new1 comes before the marker, new2 after; d/sub/fresh has no d/sub entry
          layer(d("d"), f("d/new1", b"1"), f("d/.wh..wh..opq"), f("d/new2", b"2"),
                f("d/sub/fresh", b"f")))
    assert sorted(os.listdir(root / "d")) == ["new1", "new2", "sub"]
    assert os.listdir(root / "d" / "sub") == ["fresh"]
    assert (root / "other").exists()


def test_regular_files_modes_owners_mtimes_and_xattrs(root: Path) -> None:
    cap = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)  # cap_net_bind_service=+ep
    apply(root, layer(
        d(".", mode=0o755),
        d("bin"), f("bin/su", b"#!/bin/sh\n", mode=0o4755),
        f("bin/ping", b"ping", mode=0o755, xattrs={"security.capability": cap.decode("latin-1")}),
        d("home/u", uid=1000, gid=1000, mode=0o750),
        f("home/u/notes", b"hello", uid=1000, gid=1000, mode=0o640, mtime=1234567890,
          xattrs={"user.origin": "layer", "trusted.t": "x", "system.ignored": "y"}),
        d("tmp", mode=0o1777),
        sym("home/u/link", "notes", uid=1000, gid=1000),
        special("run/fifo", tarfile.FIFOTYPE),
        d("dated", mtime=1_000_000_000), f("dated/child", b"c")))
    su = (root / "bin/su").stat()
    assert stat.S_IMODE(su.st_mode) == 0o4755  # chmod after chown keeps setuid
    notes = (root / "home/u/notes").stat()
    assert (notes.st_uid, notes.st_gid, stat.S_IMODE(notes.st_mode)) == (1000, 1000, 0o640)
    assert notes.st_mtime == 1234567890
    assert (root / "home/u/notes").read_bytes() == b"hello"
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    assert stat.S_IMODE((root / "home/u").stat().st_mode) == 0o750
    link = (root / "home/u/link").lstat()
    assert os.readlink(root / "home/u/link") == "notes" and link.st_uid == 1000
    assert stat.S_ISFIFO((root / "run/fifo").lstat().st_mode)
    # A directory's time is set after its children are written.
    assert (root / "dated").stat().st_mtime == 1_000_000_000
    # The test's tmp is ext4, which keeps these (root may set trusted.* and capabilities).
    assert os.getxattr(root / "home/u/notes", "user.origin") == b"layer"
    assert os.getxattr(root / "home/u/notes", "trusted.t") == b"x"
    assert "system.ignored" not in os.listxattr(root / "home/u/notes")
    assert os.getxattr(root / "bin/ping", "security.capability") == cap


def test_replacing_entries_across_layers(root: Path) -> None:
    apply(root,
          layer(d("x"), f("x/inner"), f("y", b"file"), d("m"), f("m/1", b"1"),
                sym("s", "/nowhere")),
          layer(f("x", b"now a file"), d("y"), f("y/inner", b"i"), d("m", mode=0o700),
                f("m/2", b"2"), f("s", b"was a symlink")))
    assert (root / "x").read_bytes() == b"now a file"
    assert (root / "y/inner").read_bytes() == b"i"
    assert sorted(os.listdir(root / "m")) == ["1", "2"]  # directories merge
    assert stat.S_IMODE((root / "m").stat().st_mode) == 0o700
    assert not (root / "s").is_symlink() and (root / "s").read_bytes() == b"was a symlink"


def test_hard_links_within_and_across_layers(root: Path) -> None:
    apply(root,
          layer(d("usr/bin"), f("usr/bin/python3", b"py"), hard("usr/bin/py", "usr/bin/python3"),
                sym("usr/bin/sl", "python3")),
          layer(hard("usr/bin/python", "/usr/bin/python3"),  # absolute: inside the root
                hard("usr/bin/sl2", "usr/bin/sl")))  # to a symlink: links the symlink
    inode = (root / "usr/bin/python3").stat().st_ino
    assert (root / "usr/bin/py").stat().st_ino == inode
    assert (root / "usr/bin/python").stat().st_ino == inode
    assert (root / "usr/bin/python3").stat().st_nlink == 3
    assert os.readlink(root / "usr/bin/sl2") == "python3"
    assert (root / "usr/bin/sl2").lstat().st_ino == (root / "usr/bin/sl").lstat().st_ino


@pytest.mark.parametrize(("members", "fragment"), [
    ((hard("h", "missing"),), "which no earlier member made"),
    ((hard("h", "../../../etc/passwd"),), "which leaves the root"),
    ((hard("h", "/etc/passwd"),), "which no earlier member made"),  # the root's, absent
    ((sym("l", "/etc"), hard("h", "l/passwd")), "which no earlier member made"),
    ((d("dir"), hard("h", "dir")), "a directory"),
])
def test_hard_links_to_outside_or_missing_targets_are_refused(
        root: Path, members: tuple[tuple[tarfile.TarInfo, bytes | None], ...],
        fragment: str) -> None:
    host_links = os.stat("/etc/passwd").st_nlink
    with pytest.raises(LayerRefused, match=fragment) as err:
        apply(root, layer(*members))
    assert err.value.member == "h"
    assert os.stat("/etc/passwd").st_nlink == host_links
    assert not (root / "h").exists()


def test_member_names_with_dotdot_are_refused_and_absolute_ones_stay_inside(root: Path,
                                                                           tmp_path: Path) -> None:
    for name in ("../escape", "a/../../escape", "a/b/../../../escape"):
        with pytest.raises(LayerRefused, match=r"'\.\.' component") as err:
            apply(root, layer(f(name, b"out")))
        assert err.value.member == name
    assert not (tmp_path / "escape").exists()
    marker = f"vmfork-oci-test-{os.getpid()}"
    apply(root, layer(f(f"/tmp/{marker}", b"in"), f("./etc//x", b"dots")))
    assert (root / "tmp" / marker).read_bytes() == b"in"
    assert not Path("/tmp", marker).exists()
    assert (root / "etc/x").read_bytes() == b"dots"


def test_writing_through_symlinks_stays_inside_the_root(root: Path) -> None:
    before = Path("/etc/passwd").read_bytes(), Path("/etc/hostname").read_bytes()
    apply(root,
          layer(sym("a", "/etc"), f("a/passwd", b"root's own"),
                sym("b", "../../../../etc"), f("b/group", b"relative"),
                d("etc"), sym("etc/hostname", "/etc/hostname")),
          layer(f("etc/hostname", b"replaced, not followed"),
                sym("c", "a/../a"), f("c/shadow", b"via .. in a target")))
    assert (Path("/etc/passwd").read_bytes(), Path("/etc/hostname").read_bytes()) == before
    assert (root / "etc/passwd").read_bytes() == b"root's own"
    assert (root / "etc/group").read_bytes() == b"relative"
    assert not (root / "etc/hostname").is_symlink()
    assert (root / "etc/hostname").read_bytes() == b"replaced, not followed"
    assert (root / "etc/shadow").read_bytes() == b"via .. in a target"
    assert os.readlink(root / "a") == "/etc"  # the symlink itself is kept as it was


def test_symlink_loops_are_kept_and_never_followed(root: Path) -> None:
    apply(root, layer(sym("a", "b"), sym("b", "a"), sym("self", "self"), sym("up", "../up")))
    assert os.readlink(root / "a") == "b" and os.readlink(root / "self") == "self"
    for name in ("a/file", "self/file", "up/x"):
        with pytest.raises(LayerRefused, match="symlink loop"):
            apply(root, layer(f(name, b"x")))
    with pytest.raises(LayerRefused, match="not a directory"):
        apply(root, layer(f("plain", b"p"), f("plain/child", b"c")))


@pytest.mark.parametrize(("kind", "word"), [(tarfile.CHRTYPE, "character"),
                                            (tarfile.BLKTYPE, "block")])
def test_device_nodes_are_refused(root: Path, kind: bytes, word: str) -> None:
    with pytest.raises(LayerRefused, match=f"{word} device") as err:
        apply(root, layer(f("ok", b"ok"), special("dev/null", kind)))
    assert err.value.member == "dev/null"
    assert not (root / "dev/null").exists()


def test_a_decompression_bomb_stops_at_the_total_cap_while_streaming(root: Path) -> None:
    limits = Limits(max_total_bytes=4 << 20)
    zeros = bytes(32 << 20)
    bomb = gzip.compress(layer(f("big", zeros)), compresslevel=9)
    assert len(bomb) * 200 < len(zeros)  # a bomb: 200 times its size, at least
    with (pytest.raises(LayerRefused, match="max_total_bytes"), LayerApplier(root, limits) as a,
          decompressed(io.BytesIO(bomb), "bomb") as s):
        a.apply(s, "bomb")
    assert (root / "big").stat().st_size <= 4 << 20
    # Bytes after the end-of-archive marker count too (they are read for the diff_id).
    trailing = gzip.compress(layer(f("small", b"s")) + zeros, compresslevel=9)
    with (pytest.raises(LayerRefused, match="max_total_bytes"), LayerApplier(root, limits) as a,
          decompressed(io.BytesIO(trailing), "trailing") as s):
        a.apply(s, "trailing")


def test_per_file_member_count_and_name_caps(root: Path) -> None:
    with pytest.raises(LayerRefused, match="max_file_bytes"):
        apply(root, layer(f("big", bytes(2 << 20))), limits=Limits(max_file_bytes=1 << 20))
    assert not (root / "big").exists()  # refused at the header, before a byte is written
    many = layer(*(f(f"f{i}") for i in range(60)))
    with pytest.raises(LayerRefused, match="max_members"):
        apply(root, many, limits=Limits(max_members=50))
    with pytest.raises(LayerRefused, match="GNU long name of 5001 bytes is over the cap"):
        apply(root, layer(f("n" * 5000), fmt=tarfile.GNU_FORMAT))
    with pytest.raises(LayerRefused, match="name is 5000 bytes, over the cap"):
        apply(root, layer(f("n" * 5000)))  # pax path record, under the header cap
    with pytest.raises(LayerRefused, match="longer than 255 bytes"):
        apply(root, layer(f("x" * 300)))


def test_a_pax_header_claiming_a_gigabyte_is_refused_before_it_is_read(root: Path) -> None:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 1 << 30
    # Only a few KiB follow: a reader that believed the size would fail on truncation
    # (or allocate 1 GiB), not on the cap.
    data = info.tobuf(format=tarfile.USTAR_FORMAT) + b"30 path=" + b"a" * 4096
    with pytest.raises(LayerRefused, match="pax extended header of 1073741824 bytes is over the "
                                           "cap of 1048576"):
        apply(root, data)


def test_damaged_streams_are_refused(root: Path) -> None:
    good = layer(f("a", b"a" * 2000))
    with pytest.raises(LayerRefused, match="truncated"):
        apply(root, good[:1024])
    broken = bytearray(good)
    broken[0] ^= 0xFF
    with pytest.raises(LayerRefused, match="bad checksum"):
        apply(root, bytes(broken))
    with (pytest.raises(ImageBuildError, match="damaged or truncated"), LayerApplier(root) as a,
          decompressed(io.BytesIO(gzip.compress(good)[:40]), "gzip") as s):
        a.apply(s, "gzip")


# REF forms ---------------------------------------------------------------------

def busybox_tree(path: Path) -> Path:
    """A small real root: static busybox, symlinks, a hard link, setuid, a sticky /tmp."""
    (path / "bin").mkdir(parents=True)
    (path / "etc").mkdir()
    (path / "tmp").mkdir(mode=0o1777)
    os.chmod(path / "tmp", 0o1777)
    shutil.copy2("/bin/busybox", path / "bin/busybox")
    for applet in ("sh", "cat", "ls"):
        os.symlink("busybox", path / "bin" / applet)
    os.link(path / "bin/busybox", path / "bin/busybox-hard")
    (path / "etc/os-release").write_text("ID=vmfork-test\n")
    (path / "bin/su").write_text("#!/bin/sh\n")
    os.chmod(path / "bin/su", 0o4755)
    return path


def check_busybox_root(root: Path) -> None:
    assert (root / "bin/busybox").read_bytes() == Path("/bin/busybox").read_bytes()
    assert os.readlink(root / "bin/sh") == "busybox"
    assert (root / "bin/busybox-hard").stat().st_ino == (root / "bin/busybox").stat().st_ino
    assert stat.S_IMODE((root / "bin/su").stat().st_mode) == 0o4755
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    out = subprocess.run(["chroot", str(root), "/bin/sh", "-c", "cat /etc/os-release"],
                         check=False, capture_output=True, text=True, timeout=30)
    assert out.stdout == "ID=vmfork-test\n", out.stderr


def test_make_oci_layout_imports_by_oci_ref_and_plain_directory(tmp_path: Path) -> None:
    tree = busybox_tree(tmp_path / "tree")
    ref = make_oci_layout(tree, tmp_path / "layout", tag="v1", env=["A=1", "PATH=/bin"],
                          workdir="/tmp", user="1000:1000")
    assert ref == f"oci:{tmp_path / 'layout'}:v1"
    (tmp_path / "r1").mkdir()
    cfg = oci.import_image(ref, tmp_path / "r1")
    check_busybox_root(tmp_path / "r1")
    assert (cfg.env, cfg.working_dir, cfg.user) == (["A=1", "PATH=/bin"], "/tmp", "1000:1000")
    assert cfg.entrypoint is None and cfg.cmd is None
    assert cfg.manifest_digest == oci.resolve(ref)
    index = json.loads((tmp_path / "layout/index.json").read_text())
    assert cfg.manifest_digest == index["manifests"][0]["digest"]
    assert cfg.unpacked_bytes >= Path("/bin/busybox").stat().st_size
    (tmp_path / "r2").mkdir()
    assert oci.import_image(str(tmp_path / "layout"), tmp_path / "r2") == \
        oci.OciImageConfig(**{**cfg.__dict__, "ref": str(tmp_path / "layout")})
    with pytest.raises(ImageBuildError, match=r"no image tagged 'v2' \(its tags: v1\)"):
        oci.resolve(f"oci:{tmp_path / 'layout'}:v2")
    with pytest.raises(ImageBuildError, match="is not empty"):
        oci.import_image(ref, tmp_path / "r1")


def test_layers_gzip_zstd_and_plain_with_whiteouts_across_them(tmp_path: Path,
                                                               root: Path) -> None:
    out = tmp_path / "layout"
    lower = layer(d("etc"), f("etc/a", b"a"), f("etc/b", b"b"))
    upper = layer(f("etc/.wh.a"), f("etc/c", b"c"))
    descs = {}
    for compression in (None, "gzip", "zstd"):
        descs[str(compression)] = add_image(out, [lower, upper], compression=compression,
                                            cmd=["/bin/sh"], entrypoint=["/init"])
    write_index(out, descs)
    for tag in descs:
        target = tmp_path / f"root-{tag}"
        target.mkdir()
        cfg = oci.import_image(f"oci:{out}:{tag}", target)
        assert sorted(os.listdir(target / "etc")) == ["b", "c"]
        assert (cfg.cmd, cfg.entrypoint) == (["/bin/sh"], ["/init"])
        assert cfg.layer_digests == [x["digest"] for x in json.loads(
            (out / "blobs/sha256" / descs[tag]["digest"][7:]).read_text())["layers"]]


def test_a_corrupt_blob_is_refused_before_use(tmp_path: Path, root: Path) -> None:
    ref = make_oci_layout(busybox_tree(tmp_path / "tree"), tmp_path / "layout")
    cfg = oci.import_image(ref, root)
    blob = tmp_path / "layout/blobs/sha256" / cfg.layer_digests[0][7:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    (tmp_path / "again").mkdir()
    with pytest.raises(ImageBuildError, match="digest mismatch") as err:
        oci.import_image(ref, tmp_path / "again")
    assert err.value.step == "oci-verify"
    assert os.listdir(tmp_path / "again") == []  # nothing was applied
    blob.write_bytes(bytes(data) + b"x")
    with pytest.raises(ImageBuildError, match="larger than the .* bytes its descriptor says"):
        oci.import_image(ref, tmp_path / "again")


def test_a_layer_that_is_not_its_diff_id_is_refused(tmp_path: Path, root: Path) -> None:
    out = tmp_path / "layout"
    write_index(out, {"latest": add_image(out, [layer(f("a", b"a"))],
                                          diff_ids=["sha256:" + "0" * 64])})
    with pytest.raises(ImageBuildError, match="diff_id is sha256:0000"):
        oci.import_image(f"oci:{out}", root)


def test_a_multi_platform_index_yields_linux_amd64(tmp_path: Path, root: Path) -> None:
    out = tmp_path / "layout"

    def image(arch: str, variant: str | None = None) -> dict[str, Any]:
        return add_image(out, [layer(f("arch", arch.encode()))], arch=arch, variant=variant)

    multi = add_index(out, [image("arm64", "v8"), image("amd64"), image("s390x")])
    none = add_index(out, [image("arm64", "v8"), image("s390x")])
    write_index(out, {"multi": multi, "none": none})
    cfg = oci.import_image(f"oci:{out}:multi", root)
    assert (root / "arch").read_text() == "amd64"
    assert cfg.manifest_digest == oci.resolve(f"oci:{out}:multi")
    assert cfg.manifest_digest == json.loads(
        (out / "blobs/sha256" / multi["digest"][7:]).read_text())["manifests"][1]["digest"]
    with pytest.raises(ImageBuildError, match=r"no linux/amd64 image \(it has linux/arm64/v8, "
                                              r"linux/s390x\)"):
        oci.resolve(f"oci:{out}:none")
    # A single-platform image of the wrong architecture is refused by its config.
    write_index(out, {"arm": image("arm64")})
    (tmp_path / "r2").mkdir()
    with pytest.raises(ImageBuildError, match="is a linux/arm64 image"):
        oci.import_image(f"oci:{out}:arm", tmp_path / "r2")


def skopeo(*args: str) -> None:
    result = subprocess.run(["skopeo", "--insecure-policy", *args], check=False,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"skopeo {' '.join(args)}: {result.stderr}"


def need_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: scripts/lib.sh's setup installs them "
                    "(apt-get install docker-registry skopeo apache2-utils openssl)")


def test_archives_written_by_skopeo(tmp_path: Path) -> None:
    need_tools("skopeo")
    ref = make_oci_layout(busybox_tree(tmp_path / "tree"), tmp_path / "layout", tag="t1",
                          env=["X=1"])
    skopeo("copy", ref, f"oci-archive:{tmp_path / 'image.tar'}:t1")
    skopeo("copy", ref, f"docker-archive:{tmp_path / 'docker.tar'}:example/bb:t1")
    (tmp_path / "oa").mkdir()
    cfg = oci.import_image(f"oci-archive:{tmp_path / 'image.tar'}:t1", tmp_path / "oa")
    check_busybox_root(tmp_path / "oa")
    assert cfg.env == ["X=1"] and cfg.manifest_digest == oci.resolve(ref)
    for docker_ref in (f"docker-archive:{tmp_path / 'docker.tar'}",
                       f"docker-archive:{tmp_path / 'docker.tar'}:example/bb:t1"):
        target = tmp_path / f"da-{len(docker_ref)}"
        target.mkdir()
        dcfg = oci.import_image(docker_ref, target)
        check_busybox_root(target)
        assert dcfg.env == ["X=1"]
        # No manifest in a docker-archive: the config digest (the image ID) stands in.
        with tarfile.open(tmp_path / "docker.tar") as tar:
            manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
            config = tar.extractfile(manifest[0]["Config"]).read()  # type: ignore[union-attr]
        assert dcfg.manifest_digest == "sha256:" + hashlib.sha256(config).hexdigest()
        assert oci.resolve(docker_ref) == dcfg.manifest_digest
    with pytest.raises(ImageBuildError, match=r"no image named 'other:1'.*docker.io/example/bb:t1"):
        oci.resolve(f"docker-archive:{tmp_path / 'docker.tar'}:other:1")


def test_a_plain_tar_of_a_layout_and_bad_refs(tmp_path: Path) -> None:
    make_oci_layout(busybox_tree(tmp_path / "tree"), tmp_path / "layout")
    with tarfile.open(tmp_path / "layout.tar", "w") as tar:
        tar.add(tmp_path / "layout", arcname=".")
    (tmp_path / "r").mkdir()
    oci.import_image(f"oci-archive:{tmp_path / 'layout.tar'}", tmp_path / "r")
    check_busybox_root(tmp_path / "r")
    with pytest.raises(ImageBuildError, match="no such file"):
        oci.resolve(f"oci:{tmp_path / 'absent'}:latest")
    with pytest.raises(ImageBuildError, match="no oci-layout file"):
        oci.resolve(f"oci:{tmp_path / 'tree'}")
    with pytest.raises(ImageBuildError, match="names no registry host"):
        oci.resolve("busybox:latest")


def test_registry_reference_parsing() -> None:
    r = parse_registry_ref("127.0.0.1:5000/team/app:v1.2")
    assert (r.host, r.repository, r.tag, r.digest) == ("127.0.0.1:5000", "team/app", "v1.2", None)
    digest = "sha256:" + "ab" * 32
    r = parse_registry_ref(f"docker://docker.io/debian:12@{digest}")
    assert (r.api_host, r.repository, r.reference) == ("registry-1.docker.io", "library/debian",
                                                        digest)
    r = parse_registry_ref("[::1]:5000/x")
    assert (r.host, r.reference) == ("[::1]:5000", "latest")
    for bad, why in (("ubuntu/app:1", "no registry host"), ("h.io/App:1", "repository name"),
                     ("h.io/a@sha256:12", "64 lowercase hex"), ("h.io/a:b/c", "repository"),
                     ("h.io/a@sha512:" + "0" * 128, "only sha256")):
        with pytest.raises(ImageBuildError, match=why):
            parse_registry_ref(bad)


def test_credentials_from_a_docker_config(tmp_path: Path) -> None:
    def auth(user: str, password: str) -> dict[str, str]:
        return {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {
        "https://index.docker.io/v1/": auth("hub", "h:p"),
        "registry.example:5000": auth("me", "secret"),
        "http://other.example/v2/": {"username": "u", "password": "p"}}}))
    assert read_credentials("registry.example:5000", config) == ("me", "secret")
    assert read_credentials("docker.io", config) == ("hub", "h:p")
    assert read_credentials("other.example", config) == ("u", "p")
    assert read_credentials("unknown.example", config) is None
    with pytest.raises(ImageBuildError, match="does not exist"):
        read_credentials("x", tmp_path / "absent.json")


def credential_helper(bin_dir: Path, name: str, script: str) -> None:
    """A real ``docker-credential-<name>`` on PATH (a shell script speaking Docker's
    helper protocol: the server on stdin, JSON or an error on stdout)."""
    bin_dir.mkdir(exist_ok=True)
    helper = bin_dir / f"docker-credential-{name}"
    helper.write_text("#!/bin/sh\n" + script)
    helper.chmod(0o755)


def test_credentials_from_credential_helpers(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    # One helper answers for two servers and prints what it was asked.
    credential_helper(bin_dir, "vault", """[ "$1" = get ] || exit 2
read server
case "$server" in
  registry.example:5000) echo '{"ServerURL":"registry.example:5000","Username":"me","Secret":"s3"}' ;;
  https://index.docker.io/v1/) echo '{"Username":"hub","Secret":"tok"}' ;;
  *) echo "credentials not found in native keychain"; exit 1 ;;
esac
""")
    credential_helper(bin_dir, "broken", "echo 'keychain locked'; exit 3\n")
    credential_helper(bin_dir, "garbage", "echo 'not json'\n")
    credential_helper(bin_dir, "flood", "yes x | head -c 200000\n")
    credential_helper(bin_dir, "slow", "sleep 20\n")
    credential_helper(bin_dir, "oauth", "echo '{\"Username\":\"<token>\",\"Secret\":\"r\"}'\n")
    config = tmp_path / "config.json"

    def write(**fields: Any) -> Path:
        config.write_text(json.dumps(fields))
        return config

    write(credsStore="vault", auths={"inline.example": {"username": "u", "password": "p"}})
    assert read_credentials("registry.example:5000", config) == ("me", "s3")
    assert read_credentials("docker.io", config) == ("hub", "tok")
    assert read_credentials("inline.example", config) == ("u", "p")  # auths before the store
    assert read_credentials("unknown.example", config) is None  # "not found": anonymous
    # credHelpers wins for its host, over auths and the store.
    write(credsStore="broken", credHelpers={"registry.example:5000": "vault"},
          auths={"registry.example:5000": {"username": "x", "password": "y"}})
    assert read_credentials("registry.example:5000", config) == ("me", "s3")
    with pytest.raises(ImageBuildError, match=r"docker-credential-broken get failed \(exit 3\)"
                                              ": keychain locked"):
        read_credentials("other.example", config)
    for store, why in (("garbage", "other than {Username, Secret} JSON"),
                       ("flood", "at most 65536 bytes"), ("oauth", "identity token"),
                       ("absent", "docker-credential-absent is not on PATH"),
                       ("../../bin/sh", "not a credential helper name")):
        write(credsStore=store)
        with pytest.raises(ImageBuildError, match=re.escape(why)):
            read_credentials("other.example", config)
    monkeypatch.setattr("vmfork.image.registry.HELPER_TIMEOUT", 1.0)
    write(credsStore="slow")
    started = time.monotonic()
    with pytest.raises(ImageBuildError, match="did not answer within 1 s"):
        read_credentials("other.example", config)
    assert time.monotonic() - started < 10


# A real registry ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Registry:
    host: str  # "127.0.0.1:PORT"
    storage: Path
    proc: subprocess.Popen[bytes]
    creds: tuple[str, str] | None = None
    token_requests: list[str] = field(default_factory=list)  # Authorization headers seen

    def auth_file(self, tmp: Path, password: str | None = None) -> Path:
        assert self.creds is not None
        user, real = self.creds
        raw = base64.b64encode(f"{user}:{password or real}".encode()).decode()
        path = tmp / f"auth-{password or 'ok'}.json"
        path.write_text(json.dumps({"auths": {self.host: {"auth": raw}}}))
        return path

    def push(self, src: str, repo: str, *flags: str) -> str:
        creds = ["--dest-creds", ":".join(self.creds)] if self.creds else []
        skopeo("copy", "--dest-tls-verify=false", *creds, *flags, src,
               f"docker://{self.host}/{repo}")
        return f"{self.host}/{repo}"


class TokenServer(http.server.ThreadingHTTPServer):
    """A bearer-token service as registries use: Basic credentials in, a signed JWT out."""

    def __init__(self, workdir: Path, creds: tuple[str, str], seen: list[str]) -> None:
        super().__init__(("127.0.0.1", 0), _TokenHandler)
        self.key = workdir / "token.key"
        self.cert = workdir / "token.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=vmfork-test-token", "-keyout", str(self.key),
                        "-out", str(self.cert)], check=True, capture_output=True, timeout=60)
        self.der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
                                  check=True, capture_output=True, timeout=60).stdout
        self.creds = creds
        self.seen = seen

    def sign(self, claims: dict[str, Any]) -> str:
        def b64(raw: bytes) -> str:
            return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(self.der).decode()]}
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)],
                                   input=signing_input.encode(), check=True,
                                   capture_output=True, timeout=60).stdout
        return f"{signing_input}.{b64(signature)}"


class _TokenHandler(http.server.BaseHTTPRequestHandler):
    server: TokenServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        authorization = self.headers.get("Authorization") or ""
        self.server.seen.append(authorization)
        expected = "Basic " + base64.b64encode(":".join(self.server.creds).encode()).decode()
        if authorization != expected:
            self.send_response(401)
            self.end_headers()
            return
        access = []
        for scope in query.get("scope", []):
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        token = self.server.sign({"iss": "vmfork-test-issuer", "sub": self.server.creds[0],
                                  "aud": query.get("service", [""])[0], "exp": now + 600,
                                  "nbf": now - 60, "iat": now, "jti": os.urandom(8).hex(),
                                  "access": access})
        body = json.dumps({"token": token, "expires_in": 600}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def start_registry(workdir: Path, auth: str | None, log_level: str = "warn"
                   ) -> Iterator[Registry]:
    need_tools("docker-registry", "skopeo", "htpasswd", "openssl")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config: dict[str, Any] = {
        "version": "0.1", "log": {"level": log_level},
        "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": "vmfork-test"},
    }
    creds = ("tester", "s3cret pass")
    seen: list[str] = []
    token_server = None
    if auth == "htpasswd":
        hashed = subprocess.run(["htpasswd", "-Bbn", *creds], check=True, capture_output=True,
                                text=True, timeout=60).stdout
        (workdir / "htpasswd").write_text(hashed)
        config["auth"] = {"htpasswd": {"realm": "vmfork-test",
                                       "path": str(workdir / "htpasswd")}}
    elif auth == "token":
        token_server = TokenServer(workdir, creds, seen)
        threading.Thread(target=token_server.serve_forever, daemon=True).start()
        config["auth"] = {"token": {
            "realm": f"http://127.0.0.1:{token_server.server_address[1]}/token",
            "service": "vmfork-test-registry", "issuer": "vmfork-test-issuer",
            "rootcertbundle": str(token_server.cert)}}
    # JSON is YAML: the registry reads it as its config file.
    (workdir / "config.yml").write_text(json.dumps(config))
    log = open(workdir / "registry.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(["docker-registry", "serve", str(workdir / "config.yml")],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"docker-registry exited: {(workdir / 'registry.log').read_text()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # 401: up, and asking for auth
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("docker-registry did not listen within 30 s")
                time.sleep(0.1)
        yield Registry(f"127.0.0.1:{port}", workdir / "storage", proc,
                       creds if auth else None, seen)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        if token_server is not None:
            token_server.shutdown()
            token_server.server_close()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"), None)


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry-basic"), "htpasswd")


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry-token"), "token")


def two_layer_layout(out: Path, tree: Path) -> str:
    """busybox plus a second layer that deletes a file and adds one."""
    upper = layer(f("etc/.wh.os-release"), f("etc/added", b"second layer"))
    write_index(out, {"v1": add_image(out, [tar_of_tree(tree), upper], env=["K=V"],
                                      workdir="/tmp")})
    return f"oci:{out}:v1"


def test_pull_by_tag_and_digest_from_a_registry(registry: Registry, tmp_path: Path,
                                                _private_cache: Path) -> None:
    src = two_layer_layout(tmp_path / "layout", busybox_tree(tmp_path / "tree"))
    name = registry.push(src, "vmfork/busybox:v1")
    digest = oci.resolve(name)
    assert digest == oci.resolve(src)  # skopeo pushed the manifest unchanged
    blobs = _private_cache / "oci/blobs/sha256"
    layer_hexes = [x["digest"][7:] for x in json.loads(
        (tmp_path / "layout/blobs/sha256" / digest[7:]).read_text())["layers"]]
    assert not any((blobs / h).exists() for h in layer_hexes)  # resolve fetched no layer
    calls: list[tuple[str, int, int | None]] = []
    for i, ref in enumerate((name, f"{registry.host}/vmfork/busybox@{digest}")):
        target = tmp_path / f"pulled-{i}"
        target.mkdir()
        cfg = oci.import_image(ref, target, progress=lambda *a: calls.append(a))
        assert cfg.manifest_digest == digest and cfg.ref == ref
        assert (cfg.env, cfg.working_dir) == (["K=V"], "/tmp")
        assert not (target / "etc/os-release").exists()
        assert (target / "etc/added").read_bytes() == b"second layer"
        (target / "etc/os-release").write_text("ID=vmfork-test\n")
        check_busybox_root(target)
    assert all((blobs / h).exists() for h in layer_hexes)  # cached, content-addressed
    sizes = {x["digest"][7:]: x["size"] for x in json.loads(
        (tmp_path / "layout/blobs/sha256" / digest[7:]).read_text())["layers"]}
    fetched = [c for c in calls if c[0].startswith("fetch")]
    assert fetched[-1] == ("fetch layer 2/2", sizes[layer_hexes[1]], sizes[layer_hexes[1]])
    # The second import came from the cache: one fetch series per layer in all.
    assert {c[0] for c in fetched} == {"fetch layer 1/2", "fetch layer 2/2"}
    assert any(c[0] == "apply layer 1/2" and c[2] is None for c in calls)
    with pytest.raises(ImageBuildError, match="not found in vmfork/busybox"):
        oci.resolve(f"{registry.host}/vmfork/busybox:nope")


def test_a_registry_serving_a_corrupt_blob_is_refused(registry: Registry, tmp_path: Path,
                                                      _private_cache: Path) -> None:
    src = make_oci_layout(busybox_tree(tmp_path / "tree"), tmp_path / "layout")
    name = registry.push(src, "vmfork/corrupt:latest")
    manifest = json.loads((tmp_path / "layout/blobs/sha256" / oci.resolve(name)[7:]).read_text())
    hexdigest = manifest["layers"][0]["digest"][7:]
    data = registry.storage / f"docker/registry/v2/blobs/sha256/{hexdigest[:2]}/{hexdigest}/data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(ImageBuildError, match="arrived with digest") as err:
        oci.import_image(name, target)
    assert err.value.step == "oci-pull"
    assert os.listdir(target) == []
    assert not (_private_cache / "oci/blobs/sha256" / hexdigest).exists()
    assert not [p for p in (_private_cache / "oci/blobs/sha256").iterdir()
                if p.name.startswith(".")]  # no temporary file left behind


def test_a_multi_platform_image_from_a_registry(registry: Registry, tmp_path: Path) -> None:
    out = tmp_path / "layout"
    images = [add_image(out, [layer(f("arch", arch.encode()))], arch=arch)
              for arch in ("arm64", "amd64")]
    write_index(out, {"multi": add_index(out, images)})
    name = registry.push(f"oci:{out}:multi", "vmfork/multi:1", "--all")
    target = tmp_path / "target"
    target.mkdir()
    cfg = oci.import_image(name, target)
    assert (target / "arch").read_text() == "amd64"
    assert cfg.manifest_digest == images[1]["digest"]
    assert oci.resolve(name) == images[1]["digest"]
    # The same converted by skopeo to Docker's types: a manifest list of schema 2 manifests.
    docker_name = registry.push(f"oci:{out}:multi", "vmfork/multi-docker:1", "--all",
                                "--format", "v2s2")
    request = urllib.request.Request(
        f"http://{registry.host}/v2/vmfork/multi-docker/manifests/1",
        headers={"Accept": "application/vnd.docker.distribution.manifest.list.v2+json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        listing = json.load(response)
    assert listing["mediaType"] == "application/vnd.docker.distribution.manifest.list.v2+json"
    amd64 = [m for m in listing["manifests"] if m["platform"]["architecture"] == "amd64"]
    (tmp_path / "docker").mkdir()
    dcfg = oci.import_image(docker_name, tmp_path / "docker")
    assert (tmp_path / "docker/arch").read_text() == "amd64"
    assert dcfg.manifest_digest == amd64[0]["digest"] != images[1]["digest"]


def test_pull_with_basic_auth(basic_registry: Registry, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_oci_layout(busybox_tree(tmp_path / "tree"), tmp_path / "layout")
    name = basic_registry.push(src, "private/bb:1")
    with pytest.raises(ImageBuildError, match="needs a user name and password"):
        oci.resolve(name)
    with pytest.raises(ImageBuildError, match="refused the credentials"):
        oci.resolve(name, auth_file=basic_registry.auth_file(tmp_path, "wrong"))
    target = tmp_path / "target"
    target.mkdir()
    oci.import_image(name, target, auth_file=basic_registry.auth_file(tmp_path))
    check_busybox_root(target)
    # The default place: $DOCKER_CONFIG/config.json.
    docker_config = tmp_path / "docker"
    docker_config.mkdir()
    shutil.copy(basic_registry.auth_file(tmp_path), docker_config / "config.json")
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config))
    assert oci.resolve(name) == oci.resolve(src)


def test_pull_with_bearer_tokens(token_registry: Registry, tmp_path: Path) -> None:
    src = make_oci_layout(busybox_tree(tmp_path / "tree"), tmp_path / "layout")
    name = token_registry.push(src, "private/tok:1")
    token_registry.token_requests.clear()
    with pytest.raises(ImageBuildError, match="token service refused anonymous access"):
        oci.resolve(name)
    with pytest.raises(ImageBuildError, match="token service refused the credentials"):
        oci.resolve(name, auth_file=token_registry.auth_file(tmp_path, "wrong"))
    target = tmp_path / "target"
    target.mkdir()
    cfg = oci.import_image(name, target, auth_file=token_registry.auth_file(tmp_path))
    check_busybox_root(target)
    assert cfg.manifest_digest == oci.resolve(src)
    user, password = token_registry.creds or ("", "")
    good = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    assert token_registry.token_requests[0] == ""  # anonymous first
    # One token served the whole import: it is kept between requests.
    assert token_registry.token_requests[2:] == [good]


class MisbehavingRegistry(http.server.ThreadingHTTPServer):
    """A registry that lies: what ``mode`` says goes wrong. Not a stand-in for a real
    registry (those tests use docker-registry); it is the hostile one real ones are not.

    It asks for Basic auth on manifests, redirects the config blob to another host
    name (``localhost`` instead of ``127.0.0.1``), and records each request's
    ``Authorization`` by path.
    """

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _MisbehavingHandler)
        self.mode = "ok"
        self.seen: dict[str, str | None] = {}
        self.layer = gzip.compress(layer(f("hello", b"hi")), mtime=0)
        diff_id = "sha256:" + hashlib.sha256(gzip.decompress(self.layer)).hexdigest()
        self.config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                                  "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Hanging up on a stalled or oversized answer is what the client should do.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def manifest(self) -> bytes:
        def desc(media_type: str, data: bytes) -> dict[str, Any]:
            return {"mediaType": media_type, "size": len(data),
                    "digest": "sha256:" + hashlib.sha256(data).hexdigest()}

        return json.dumps({"schemaVersion": 2, "mediaType": oci.OCI_MANIFEST,
                           "config": desc(oci.CONFIG_TYPES[0], self.config),
                           "layers": [desc("application/vnd.oci.image.layer.v1.tar+gzip",
                                           self.layer)]}).encode()


class _MisbehavingHandler(http.server.BaseHTTPRequestHandler):
    server: MisbehavingRegistry

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
              length: int | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        srv = self.server
        srv.seen[self.path] = self.headers.get("Authorization")
        port = srv.server_address[1]
        config_path = "/v2/r/blobs/sha256:" + hashlib.sha256(srv.config).hexdigest()
        if self.path == "/v2/r/manifests/latest":
            if self.headers.get("Authorization") is None:
                self._send(401, b"{}", {"WWW-Authenticate": 'Basic realm="test"'})
            elif srv.mode == "stall":
                time.sleep(3)
                self._send(200, srv.manifest())
            elif srv.mode == "huge-manifest":
                self._send(200, b"{" + b" " * (64 << 10) + b"}",
                           {"Content-Type": oci.OCI_MANIFEST})
            else:
                self._send(200, srv.manifest(), {"Content-Type": oci.OCI_MANIFEST})
        elif self.path == config_path:
            self._send(307, b"", {"Location": f"http://localhost:{port}/storage/config"})
        elif self.path == "/storage/config":
            self._send(200, srv.config)
        elif self.path.startswith("/v2/r/blobs/"):
            if srv.mode == "big-blob":  # no Content-Length: the excess shows only as it streams
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(srv.layer + bytes(1 << 16))
                self.close_connection = True
            else:
                self._send(200, srv.layer)
        else:
            self._send(404, b'{"errors": [{"code": "NAME_UNKNOWN", "message": "no"}]}')


@pytest.fixture
def misbehaving(tmp_path: Path) -> Iterator[tuple[MisbehavingRegistry, Path]]:
    server = MisbehavingRegistry()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    auth = tmp_path / "auth.json"
    host = f"127.0.0.1:{server.server_address[1]}"
    auth.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(b"u:p").decode()}}}))
    try:
        yield server, auth
    finally:
        server.shutdown()
        server.server_close()


def test_a_misbehaving_registry_is_caught(misbehaving: tuple[MisbehavingRegistry, Path],
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    server, auth = misbehaving
    ref = f"127.0.0.1:{server.server_address[1]}/r:latest"
    target = tmp_path / "target"
    target.mkdir()
    cfg = oci.import_image(ref, target, auth_file=auth)
    assert (target / "hello").read_bytes() == b"hi" and cfg.layer_digests
    # Basic credentials went to the registry, but not with the redirect to another host.
    assert server.seen["/v2/r/manifests/latest"] == "Basic " + base64.b64encode(b"u:p").decode()
    assert server.seen["/storage/config"] is None
    shutil.rmtree(tmp_path / "cache")  # so the blobs are fetched again
    server.mode = "big-blob"
    (tmp_path / "t2").mkdir()
    with pytest.raises(ImageBuildError, match="larger than its descriptor"):
        oci.import_image(ref, tmp_path / "t2", auth_file=auth)
    server.mode = "huge-manifest"
    with pytest.raises(ImageBuildError, match="over the cap of 4096"):
        oci.import_image(ref, tmp_path / "t2", auth_file=auth,
                         limits=Limits(max_document_bytes=4096))
    server.mode = "stall"
    monkeypatch.setattr("vmfork.image.registry.SOCKET_TIMEOUT", 0.5)
    with pytest.raises(ImageBuildError, match="timed out"):
        oci.resolve(ref, auth_file=auth)
    assert os.listdir(tmp_path / "t2") == []
