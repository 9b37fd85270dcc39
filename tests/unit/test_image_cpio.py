"""The newc writer: what it writes parses back, is deterministic, and cpio(1) agrees."""

from __future__ import annotations

import io
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from vmfork.image import cpio


def _sample(tmp_path: Path) -> list[cpio.CpioEntry]:
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * 1001)  # not a multiple of 4
    return [
        cpio.symlink("bin/sh", "/bin/busybox"),
        cpio.regular_file("etc/hostname", b"vmfork\n"),
        cpio.directory("etc"),
        cpio.directory("bin"),
        cpio.directory("dev"),
        cpio.char_device("dev/console", 5, 1),
        cpio.CpioEntry("bin/big", stat.S_IFREG | 0o755, source=big),
        cpio.regular_file("init", b"#!/bin/sh\n", perm=0o755),
        cpio.directory("tmp", 0o1777),
        cpio.regular_file("empty", b""),
    ]


def _write(entries: list[cpio.CpioEntry]) -> bytes:
    out = io.BytesIO()
    n = cpio.write_cpio(out, entries)
    data = out.getvalue()
    assert n == len(data)
    return data


def test_round_trip(tmp_path: Path) -> None:
    entries = _sample(tmp_path)
    back = {e.path: e for e in cpio.read_cpio(_write(entries))}
    assert set(back) == {e.path for e in entries}
    for e in entries:
        got = back[e.path]
        assert got.mode == e.mode, e.path
        assert got.rdev == e.rdev, e.path
        expected = e.source.read_bytes() if e.source else e.data
        assert got.data == (b"" if stat.S_ISDIR(e.mode) or stat.S_ISCHR(e.mode) else expected)
    assert back["dev/console"].rdev == (5, 1)
    assert stat.S_ISCHR(back["dev/console"].mode)
    assert back["tmp"].mode == stat.S_IFDIR | 0o1777


def test_parents_precede_children_and_order_is_canonical(tmp_path: Path) -> None:
    entries = _sample(tmp_path)
    data = _write(entries)
    assert _write(list(reversed(entries))) == data  # input order does not matter
    paths = [e.path for e in cpio.read_cpio(data)]
    for i, p in enumerate(paths):
        if "/" in p:
            assert p.rsplit("/", 1)[0] in paths[:i], f"{p} precedes its directory"


def test_layout_is_aligned_and_deterministic(tmp_path: Path) -> None:
    data = _write(_sample(tmp_path))
    assert len(data) % 4 == 0
    assert b"TRAILER!!!\0" in data[-16:]
    pos = 0
    while True:  # every header starts on a 4-byte boundary with uid/gid/mtime 0
        assert pos % 4 == 0
        assert data[pos : pos + 6] == cpio.MAGIC
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        uid, gid, mtime = fields[2], fields[3], fields[5]
        assert (uid, gid, mtime) == (0, 0, 0)
        namesize, size = fields[11], fields[6]
        name = data[pos + 110 : pos + 110 + namesize - 1]
        if name == b"TRAILER!!!":
            break
        pos += 110 + namesize
        pos += -pos % 4
        pos += size + (-size % 4)


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a"])
def test_bad_paths_are_refused(bad: str) -> None:
    with pytest.raises(cpio.CpioError):
        _write([cpio.regular_file(bad, b"x")])


def test_duplicates_and_unsupported_types_are_refused() -> None:
    with pytest.raises(cpio.CpioError, match="duplicate"):
        _write([cpio.regular_file("a", b"1"), cpio.regular_file("a", b"2")])
    with pytest.raises(cpio.CpioError, match="unsupported"):
        _write([cpio.CpioEntry("fifo", stat.S_IFIFO | 0o644)])


def test_entries_from_tree(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/tool").write_bytes(b"\x7fELF...")
    (root / "usr/bin/tool").chmod(0o755)
    (root / "usr/bin/alias").symlink_to("tool")
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "etc/passwd").chmod(0o644)
    back = {e.path: e for e in cpio.read_cpio(_write(list(cpio.entries_from_tree(root))))}
    assert sorted(back) == ["etc", "etc/passwd", "usr", "usr/bin", "usr/bin/alias", "usr/bin/tool"]
    assert back["usr/bin/tool"].mode == stat.S_IFREG | 0o755
    assert back["usr/bin/tool"].data == b"\x7fELF..."
    assert stat.S_ISLNK(back["usr/bin/alias"].mode)
    assert back["usr/bin/alias"].data == b"tool"


@pytest.mark.skipif(shutil.which("cpio") is None, reason="cpio(1) not installed")
def test_gnu_cpio_reads_our_archive(tmp_path: Path) -> None:
    entries = _sample(tmp_path)
    archive = tmp_path / "a.cpio"
    archive.write_bytes(_write(entries))
    listing = subprocess.run(["cpio", "-it", "--quiet"], stdin=archive.open("rb"),
                             capture_output=True, text=True, check=True).stdout.split()
    assert listing == [e.path for e in cpio.read_cpio(archive.read_bytes())]
    verbose = subprocess.run(["cpio", "-itv", "--quiet"], stdin=archive.open("rb"),
                             capture_output=True, text=True, check=True).stdout
    console = next(line for line in verbose.splitlines() if line.endswith("dev/console"))
    assert console.startswith("crw-------") and "5," in console and " 1 " in console
    big = next(line for line in verbose.splitlines() if line.endswith("bin/big"))
    assert " 256256 " in big
