"""Root file systems as forkd users bring them: an ext4 image of a Linux tree with a
python3, made at test time with ``mkfs.ext4 -d`` (e2fsprogs) from the default image's
tree with vmfork's own agent taken out, so nothing of vmfork is on it."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from vmfork.image import find_image


def make_ext4_rootfs(out: Path, *, marker: str, with_python: bool = True) -> Path:
    """An ext4 image at ``out`` whose ``/etc/forkd-rootfs-marker`` holds ``marker``;
    ``with_python=False`` removes every Python from it (a rootfs the agent cannot run
    on)."""
    tree = Path(tempfile.mkdtemp(prefix="rootfs-", dir=out.parent))
    try:
        with open(find_image("default").initrd, "rb") as archive:
            subprocess.run(["cpio", "-idm", "--quiet"], stdin=archive, cwd=tree, check=True)
        (tree / "init").unlink()                 # vmfork's agent as PID 1
        shutil.rmtree(tree / "opt/vmfork")       # and its package
        (tree / "etc/forkd-rootfs-marker").write_text(marker)
        if not with_python:
            for python in (tree / "usr/bin").glob("python3*"):
                python.unlink()
        size_mib = sum(p.lstat().st_size for p in tree.rglob("*")) // (1 << 20) * 3 // 2 + 32
        subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), "-L", "rootfs", str(out),
                        f"{size_mib}M"], check=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return out
