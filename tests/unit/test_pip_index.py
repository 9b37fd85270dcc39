"""The test package index (``tests/pip_index.py``) answers real pip: it installs the
pinned wheels from it, and pip's hash check passes (natively, over loopback)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pip_index import build_tree, wheel_dir

pytestmark = pytest.mark.skipif(not any(wheel_dir().glob("six-*.whl")),
                                reason="the set-up fetches the test wheels (setup_test_wheels)")


@pytest.fixture
def index() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tests.pip_index", "127.0.0.1", str(port)],
                            stdout=subprocess.PIPE, cwd=Path(__file__).parents[2])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield f"http://127.0.0.1:{port}/simple"
    finally:
        proc.kill()
        proc.wait()


def test_tree_lists_every_project(tmp_path: Path) -> None:
    projects = build_tree(wheel_dir(), tmp_path)
    assert {"six", "idna", "numpy"} <= set(projects)
    page = (tmp_path / "simple" / "six" / "index.html").read_text()
    assert "six-1.16.0-py2.py3-none-any.whl#sha256=" in page


def test_pip_installs_from_it(index: str, tmp_path: Path) -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                           "--no-cache-dir", "--index-url", index, "--target", str(tmp_path),
                           "six==1.16.0"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "six.py").is_file()
    assert time.monotonic() - started < 120


def test_unknown_project_is_refused(index: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                           "--no-cache-dir", "--index-url", index, "--target", str(tmp_path),
                           "no-such-project-here"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode != 0
    assert "No matching distribution" in done.stderr
