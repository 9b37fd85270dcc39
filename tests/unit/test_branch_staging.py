"""What the daemon takes from a jailed VMM's run directory into the store at BRANCH
(``runtime/branch._take_from_run_dir``): the VMM chose the names' contents, so only its
own regular files, of a size its guest can have, are copied, and as the daemon's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmfork.runtime.branch import BranchFailed, _take_from_run_dir

JAIL_UID = 1_000_123


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "vm-1"
    d.mkdir()
    if os.geteuid() == 0:
        os.chown(d, JAIL_UID, JAIL_UID)   # as the jail leaves it
    return d


def _jails(path: Path) -> Path:
    if os.geteuid() == 0:
        os.chown(path, JAIL_UID, JAIL_UID, follow_symlinks=False)
    return path


def test_a_sparse_image_is_copied_whole_holes_kept_and_private(run_dir: Path,
                                                               tmp_path: Path) -> None:
    src = run_dir / ".branch-x.memory"
    with open(src, "wb") as f:
        f.truncate(64 << 20)
        f.seek(32 << 20)
        f.write(b"guest" * 1000)
    _jails(src)
    out = tmp_path / "memory.bin"
    _take_from_run_dir(str(src), str(out), 64 << 20)
    assert out.read_bytes() == src.read_bytes()
    st = out.stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    assert st.st_blocks * 512 < 1 << 20, "holes stayed holes"


def test_links_fifos_and_oversized_files_are_refused(run_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_text("root:secret")
    link = run_dir / ".branch-l.memory"
    link.symlink_to(secret)
    _jails(link)
    big = run_dir / ".branch-b.memory"
    with open(big, "wb") as f:
        f.truncate(2 << 20)
    _jails(big)
    fifo = run_dir / ".branch-f.memory"
    os.mkfifo(fifo)
    _jails(fifo)
    for source, why in ((link, "cannot be opened"), (fifo, "other than a file"),
                        (big, "more than a capture")):
        target = tmp_path / f"out-{source.name}"
        with pytest.raises(BranchFailed, match=why):
            _take_from_run_dir(str(source), str(target), 1 << 20)
        assert not target.exists(), "nothing was written for a refused file"


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another owner needs root")
def test_a_file_the_jail_does_not_own_is_refused(run_dir: Path, tmp_path: Path) -> None:
    # A hard link the VMM made to a file it could read but does not own (the kernel's
    # protected_hardlinks forbids worse), or one left by someone else: not its capture.
    foreign = run_dir / ".branch-o.state"
    foreign.write_bytes(b"state")
    with pytest.raises(BranchFailed, match="other than a file of its own"):
        _take_from_run_dir(str(foreign), str(tmp_path / "state.bin"), 1 << 20)
    linked = tmp_path / "own"
    linked.write_bytes(b"x")
    _jails(linked)
    os.link(linked, run_dir / ".branch-two.state")
    with pytest.raises(BranchFailed, match="other than a file of its own"):
        _take_from_run_dir(str(run_dir / ".branch-two.state"), str(tmp_path / "s2"), 1 << 20)
