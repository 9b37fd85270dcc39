"""What `vmfork serve` refuses at start-up, run as the real command: a host where it
cannot jail VMMs (unless told --insecure-no-jail), and a state directory that is not
its user's alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="runs the daemon as another user (root, setpriv)")


def _serve(state: Path, *flags: str, as_nobody: bool = False,
           wait_for: str | None = None) -> tuple[int | None, str]:
    """Start the daemon; its exit status and stderr, or (None, stderr so far) once
    ``wait_for`` appears in its stderr (it is then stopped)."""
    cmd = [sys.executable, "-m", "vmfork", "serve", "--state", str(state), "--no-network",
           "--snapshot-root", str(state / "snapshots"), *flags]
    if as_nobody:
        # Nobody, with one capability: reading any file (CAP_DAC_READ_SEARCH), because
        # the interpreter and its packages are often root's alone (a venv under /root).
        # It grants nothing a jail needs (setuid, namespaces, cgroups, mounts).
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
               "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", *cmd]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    env.pop("VMFORK_JAIL", None)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                            text=True)
    assert proc.stderr is not None
    err = ""
    try:
        if wait_for is None:
            _, err = proc.communicate(timeout=120)
            return proc.returncode, err
        deadline = time.monotonic() + 120
        for line in proc.stderr:
            err += line
            if wait_for in line:
                return None, err
            assert time.monotonic() < deadline, err
        proc.wait(timeout=30)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


@pytest.fixture
def nobodys_state() -> Iterator[Path]:
    """A state directory of nobody's, in a directory nobody can reach (pytest's
    temporary directories are root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="vmfork-startup-"))
    try:
        os.chmod(base, 0o755)
        state = base / "state"
        state.mkdir(mode=0o700)
        os.chown(state, NOBODY, NOBODY)
        yield state
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_root
def test_a_daemon_that_cannot_jail_refuses_to_start_unless_told(nobodys_state: Path) -> None:
    state = nobodys_state
    status, err = _serve(state, as_nobody=True)
    assert status == 1, err
    assert "cannot jail sandbox VMMs" in err and "--insecure-no-jail" in err, err
    assert not (state / "registry.db").exists(), "it refused before touching its state"
    # Told, it goes on: it opens its registry and starts its zygote (which, as nobody,
    # may fail on this host for its own reasons: the interpreter can be root's alone).
    status, err = _serve(state, "--insecure-no-jail", as_nobody=True,
                         wait_for="listening on")
    assert "cannot jail" not in err and (state / "registry.db").exists(), err
    if status is None:   # it listens: and says how exposed it is
        assert "WARNING: --insecure-no-jail" in err, err


@needs_root
def test_a_state_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    status, err = _serve(state)
    assert status == 1 and f"belongs to uid {NOBODY}" in err and "--state" in err, err
    os.chown(state, 0, 0)
    os.chmod(state, 0o777)
    status, err = _serve(state)
    assert status == 1 and "writable by other users" in err, err
