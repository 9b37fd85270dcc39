"""The run directory is vmfork's alone (issue 16, item 6): sockets and consoles never go
into a directory another user made, owns, or can write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from vmfork.paths import UnsafeDirectory, private_dir, run_dir


def test_a_missing_run_dir_is_made_private(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMFORK_RUN_DIR", str(tmp_path / "a" / "run"))
    path = run_dir()
    assert path == tmp_path / "a" / "run"
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_a_run_dir_owned_by_another_user_is_refused(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    squatted = tmp_path / "vmfork-0"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 12345, 12345)   # as if another user had made it first
    monkeypatch.setenv("VMFORK_RUN_DIR", str(squatted))
    with pytest.raises(UnsafeDirectory, match="belongs to uid 12345"):
        run_dir()


def test_a_symlinked_or_shared_run_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        private_dir(tmp_path / "link")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="writable by other users"):
        private_dir(shared)
