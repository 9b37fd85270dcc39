"""forkd's kernel + rootfs (``vmfork.image.foreign``): which kernels are refused and
why, the rootfs's type from its superblock, and the import into the cache by content.
Kernels here are real ELF executables made by gcc with chosen symbols, vmfork's own
vmlinux and Debian's bzImage; root file systems are made by mkfs.ext4, mkfs.erofs and
mksquashfs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vmfork.image import find_image, record_path
from vmfork.image.foreign import (
    _FS_NEEDS,
    _KERNEL_NEEDS,
    ForeignImageRefused,
    check_kernel,
    import_kernel_rootfs,
    rootfs_type,
)

ALL_SYMBOLS = [need.symbols[0] for need in (*_KERNEL_NEEDS, *_FS_NEEDS.values())]


def _elf_with(tmp_path: Path, symbols: list[str], *, strip: bool = False) -> Path:
    """A static x86-64 ET_EXEC with a function for each of ``symbols``."""
    source = tmp_path / "k.c"
    source.write_text("".join(f"void {s}(void) {{}}\n" for s in symbols)
                      + "void _start(void) { for (;;) ; }\n")
    out = tmp_path / ("stripped" if strip else "vmlinux")
    subprocess.run(["gcc", "-nostdlib", "-static", "-no-pie", "-O0", "-o", str(out),
                    str(source)], check=True)
    if strip:
        subprocess.run(["strip", "--strip-all", str(out)], check=True)
    return out


def test_a_kernel_with_everything_is_accepted(tmp_path: Path) -> None:
    check_kernel(_elf_with(tmp_path, ALL_SYMBOLS), "ext4")


def test_a_kernel_lacking_options_is_refused_naming_each(tmp_path: Path) -> None:
    kernel = _elf_with(tmp_path, [s for s in ALL_SYMBOLS
                                  if s not in ("vm_cmdline_set", "virtio_vsock_probe")])
    with pytest.raises(ForeignImageRefused) as err:
        check_kernel(kernel, "ext4")
    message = str(err.value)
    assert "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES" in message
    assert "CONFIG_VIRTIO_VSOCKETS" in message
    assert "CONFIG_VIRTIO_BLK" not in message.split(". vmfork boots")[0]


def test_the_rootfs_file_system_is_required(tmp_path: Path) -> None:
    kernel = _elf_with(tmp_path, [s for s in ALL_SYMBOLS if s != "erofs_fc_fill_super"])
    check_kernel(kernel, "ext4")
    with pytest.raises(ForeignImageRefused, match="CONFIG_EROFS_FS"):
        check_kernel(kernel, "erofs")


def test_a_stripped_kernel_cannot_be_checked_and_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ForeignImageRefused, match="no symbol table"):
        check_kernel(_elf_with(tmp_path, ALL_SYMBOLS, strip=True), "ext4")


def test_bzimage_and_non_elf_are_refused(tmp_path: Path) -> None:
    vmlinuz = sorted(Path("/boot").glob("vmlinuz-*"))
    if vmlinuz and os.access(vmlinuz[0], os.R_OK):
        with pytest.raises(ForeignImageRefused, match="bzImage"):
            check_kernel(vmlinuz[0], "ext4")
    junk = tmp_path / "junk"
    junk.write_bytes(b"\0" * 4096)
    with pytest.raises(ForeignImageRefused, match="not an ELF"):
        check_kernel(junk, "ext4")
    with pytest.raises(ForeignImageRefused, match="No such file"):
        check_kernel(tmp_path / "missing", "ext4")


def test_vmforks_own_kernel_is_accepted() -> None:
    check_kernel(find_image("default").kernel, "erofs")


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc/hello").write_text("hi\n")
    return tree


def test_rootfs_type_from_the_superblock(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    ext4, erofs, squash = tmp_path / "r.ext4", tmp_path / "r.erofs", tmp_path / "r.sqfs"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(ext4), "8M"], check=True)
    subprocess.run(["mkfs.erofs", str(erofs), str(tree)], check=True,
                   capture_output=True)
    subprocess.run(["mksquashfs", str(tree), str(squash), "-quiet", "-no-progress"],
                   check=True)
    for path in (erofs, squash):   # whole sectors, as virtio-blk serves them
        with open(path, "ab") as f:
            f.write(b"\0" * (-path.stat().st_size % 512))
    assert (rootfs_type(ext4), rootfs_type(erofs), rootfs_type(squash)) == \
        ("ext4", "erofs", "squashfs")
    junk = tmp_path / "junk.img"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(ForeignImageRefused, match="not an ext4, squashfs or erofs"):
        rootfs_type(junk)
    odd = tmp_path / "odd.img"
    odd.write_bytes(ext4.read_bytes()[:4096] + b"x")
    with pytest.raises(ForeignImageRefused, match="512-byte sectors"):
        rootfs_type(odd)


def test_import_copies_by_content_and_is_stable(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    (tree / "etc/token").write_bytes(os.urandom(16))   # a pair of this run's own
    rootfs = tmp_path / "rootfs.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(rootfs), "8M"], check=True)
    kernel = str(find_image("default").kernel)
    image = import_kernel_rootfs(kernel, str(rootfs))
    try:
        assert image.name.startswith("forkd-") and image.disk_format == "ext4"
        assert "vmfork.rootfs=ext4" in image.cmdline
        assert image.disk is not None and image.disk.read_bytes() == rootfs.read_bytes()
        assert not os.path.samefile(image.disk, rootfs)   # a copy: the user's file may change
        assert find_image(image.name).disk_key == image.disk_key
        assert import_kernel_rootfs(kernel, str(rootfs)).name == image.name
        with pytest.raises(ForeignImageRefused, match="absolute"):
            import_kernel_rootfs("vmlinux", str(rootfs))
    finally:
        record_path(image.name).unlink()
