"""``vmfork serve`` with real VMs: snapshot over REST, spawn two sandboxes, drive
them through the SDK, delete them, stop the daemon, and check nothing is left.

Kept to one daemon and one snapshot: every VM costs seconds in the emulated host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.client import Controller, ControllerError, Sandbox

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Controller, subprocess.Popen[bytes], Path]]:
    root = tmp_path_factory.mktemp("daemon")
    env = dict(os.environ, VMFORK_HOME=str(root / "home"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    sock = root / "api.sock"
    log = open(root / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "vmfork.cli.serve", "--state",
                             str(root / "state"), "--socket", str(sock)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    ctl = Controller(f"unix://{sock}", timeout=600)
    deadline = time.monotonic() + 60
    while True:
        try:
            ctl.healthz()
            break
        except ControllerError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the daemon did not start:\n"
                                     + (root / "serve.log").read_text()) from None
            time.sleep(0.1)
    yield ctl, proc, root
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def test_daemon_snapshot_spawn_drive_delete(
        daemon: tuple[Controller, subprocess.Popen[bytes], Path]) -> None:
    ctl, proc, root = daemon
    info = ctl.create_snapshot("warm", mem_mib=256, warm_code="answer = 41")
    assert info["status"] == "ready" and info["bootable"] is True
    assert [s["tag"] for s in ctl.list_snapshots()] == ["warm"]

    infos = ctl.spawn_sandboxes("warm", n=2)
    assert len(infos) == 2
    pids = [i["pid"] for i in infos]
    assert all(_alive(pid) for pid in pids)
    for i in infos:
        assert ctl.ping_sandbox(i["id"])["pong"] is True
        r = ctl.exec_command(i["id"], ["/bin/sh", "-c", "echo out; echo err >&2; exit 4"])
        assert (r["stdout"], r["stderr"], r["exit_code"]) == ("out\n", "err\n", 4)
        assert ctl.eval_code(i["id"], "answer + 1")["result"] == "42"
    # The two children are separate machines from here on.
    ctl.eval_code(infos[0]["id"], "answer = 0")
    assert ctl.eval_code(infos[1]["id"], "answer")["result"] == "41"

    sb = Sandbox.connect(infos[0]["id"], controller=ctl)
    assert sb.commands.run("cat", stdin="piped").stdout == "piped"
    assert sb.commands.run("pwd", cwd="/tmp").stdout.strip() == "/tmp"
    assert sb.commands.run("echo $X", envs={"X": "y"}).stdout.strip() == "y"
    chunks: list[str] = []
    streamed = sb.commands.run("echo a; sleep 0.2; echo b", on_stdout=chunks.append)
    assert streamed.stdout == "a\nb\n" and streamed.exit_code == 0 and chunks
    with pytest.raises(ControllerError) as exc:
        sb.commands.run("echo before; sleep 30", timeout=1)
    assert exc.value.status == 504 and "before" in exc.value.body["stdout"]
    payload = os.urandom(300_000)
    sb.files.write("/tmp/payload", payload)
    assert sb.files.read("/tmp/payload") == payload

    for i in infos:
        ctl.kill_sandbox(i["id"])
    assert ctl.list_sandboxes() == []
    assert not any(_alive(pid) for pid in pids)
    metrics = ctl.metrics()
    assert "vmfork_sandboxes_active 0" in metrics
    assert 'vmfork_spawn_seconds_count{outcome="ok"} 1' in metrics

    # Shutdown with one sandbox running: the daemon kills it and leaves nothing behind.
    last = ctl.spawn_sandboxes("warm")[0]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while _alive(last["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(last["pid"])
    assert not (root / "api.sock").exists()
    assert list((root / "state" / "run").iterdir()) == []
    audit = (root / "state" / "audit.log").read_text().splitlines()
    assert any('"/v1/sandboxes"' in line and '"status":201' in line for line in audit)
