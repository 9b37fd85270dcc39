"""Diff chains with real VMs, through the CLI and a daemon (forkd's chain workflow).

One flat snapshot, then three ``snapshot-diff`` links, each writing a distinct file
in the guest; every depth is spawned and must see exactly its ancestors' files.
Then: a failing build leaves nothing, the rmi guard, compaction, and a pack
restored into a second store (with a daemon of its own) that spawns the head.
Kept to one daemon, one boot and one test: each CLI start alone takes seconds in
the emulated host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_daemon import Daemon, Home
from vmfork.client import ControllerError

pytestmark = pytest.mark.e2e

GUEST_MEM_MIB = 256
LINKS = [("numpy", "one"), ("pandas", "two"), ("sklearn", "three")]   # tag, file written


def cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmfork", *argv], env=env, text=True,
                          capture_output=True, timeout=900, check=False)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    logs = tmp_path_factory.mktemp("chains")
    root = Path(tempfile.mkdtemp(prefix="vmfork-e2e-chains-"))
    env = dict(os.environ, VMFORK_HOME=str(root / "home"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    env.pop("VMFORK_URL", None)
    home = Home(root, logs, env)
    yield home
    for proc in home.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture(scope="module")
def daemon(home: Home) -> Iterator[Daemon]:
    d = home.start("chains", "--kill-sandboxes-on-exit")
    yield d
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(60)


def files_seen(d: Daemon, tag: str) -> str:
    """What a fresh sandbox of ``tag`` finds in /tmp/chain-* (and that it is warm).
    A diff snapshot's sandbox must have adopted the RAM its zygote mapped ahead
    (issue 19): a native child runs on nothing else (a spawn without a premap gets a
    Python child, whose report says ``native_refused``), a Python child's VMM log says
    it adopted it."""
    sandbox = d.ctl.spawn_sandboxes(tag, 1)[0]["id"]
    try:
        if d.ctl.snapshot_info(tag).get("memory_mapping", {}).get("kind") == "plan":
            seen = [(json.loads((p / "status.json").read_text()),
                     (p / "vmm.log").read_text(errors="replace"))
                    for p in (d.state / "run").glob("spawn-*/*/") if (p / "status.json").exists()]
            assert any((status.get("child") == "native" and "native_refused" not in status)
                       or "adopted the premapped" in log for status, log in seen), seen
        assert d.ctl.eval_code(sandbox, "answer")["result"] == "41"
        done = d.ctl.exec_command(sandbox, ["/bin/sh", "-c",
                                            "cat /tmp/chain-* 2>/dev/null | tr '\\n' ' '"])
        return str(done["stdout"]).strip()
    finally:
        d.ctl.kill_sandbox(sandbox)


def test_chain_build_spawn_compact_pack_unpack(home: Home, daemon: Daemon) -> None:
    url = ("--url", f"unix://{daemon.socket}")
    info = daemon.ctl.create_snapshot("base", mem_mib=GUEST_MEM_MIB, warm_code="answer = 41")
    assert info["status"] == "ready"

    parent = "base"
    for tag, word in LINKS:
        done = cli(home.env, "snapshot-diff", "--from", parent, "--tag", tag, "--exec",
                   f"echo {word} > /tmp/chain-{len(parent)}-{word}; echo built {word}", *url)
        assert done.returncode == 0, done.stderr
        assert f"built {word}" in done.stdout and f"snapshot {tag}: diff on {parent}" \
            in done.stdout
        parent = tag

    info = daemon.ctl.snapshot_info("sklearn")
    assert info["chain_depth"] == 3 and info["ancestors"] == ["base", "numpy", "pandas"]
    assert info["parent_content_hash"] == daemon.ctl.snapshot_info("pandas")["content_hash"]
    # A link stores only what it changed: its layer and a memory plan over its chain,
    # no memory image of its own.
    assert 0 < info["layer_bytes"] < (GUEST_MEM_MIB << 20) // 4
    assert info["layer_bytes"] <= info["changed_bytes"] * 1.1 + (64 << 10)
    assert info["memory_mapping"]["kind"] == "plan" and info["memory_mapping"]["files"] == 4
    assert not (Path(info["dir"]) / "memory.bin").exists()

    expected = {"base": "", "numpy": "one", "pandas": "one two", "sklearn": "one three two"}
    for tag, words in expected.items():
        assert " ".join(sorted(files_seen(daemon, tag).split())) == words, tag

    # A child of a layered snapshot (its RAM mapped from the chain's files) branches in
    # every mode: dirty tracking and the full/live images read guest memory through
    # the layered mapping.
    sandbox = daemon.ctl.spawn_sandboxes("pandas", 1)[0]["id"]
    try:
        done = daemon.ctl.exec_command(sandbox, ["/bin/sh", "-c",
                                                 "echo four > /tmp/chain-9-four"])
        assert done["exit_code"] == 0
        for mode in ("full", "live", "diff"):
            daemon.ctl.branch_sandbox(sandbox, tag=f"pandas-{mode}", mode=mode)
    finally:
        daemon.ctl.kill_sandbox(sandbox)
    for mode in ("diff", "live", "full"):
        assert " ".join(sorted(files_seen(daemon, f"pandas-{mode}").split())) == \
            "four one two", mode
        daemon.ctl.delete_snapshot(f"pandas-{mode}")

    # A failing command builds nothing and leaves no sandbox behind.
    done = cli(home.env, "snapshot-diff", "--from", "sklearn", "--tag", "broken", "--exec",
               "echo trying; exit 7", *url)
    assert done.returncode == 1 and "exited with status 7" in done.stderr
    assert "trying" in done.stdout
    assert "broken" not in {s["tag"] for s in daemon.ctl.list_snapshots()}
    assert daemon.ctl.list_sandboxes() == []

    with pytest.raises(ControllerError) as refused:
        daemon.ctl.delete_snapshot("numpy")
    assert refused.value.status == 409 and "pandas" in refused.value.message

    done = cli(home.env, "snapshot-compact", "--from", "sklearn", "--to", "sklearn-flat", *url)
    assert done.returncode == 0, done.stderr
    assert daemon.ctl.snapshot_info("sklearn-flat")["chain_depth"] == 0
    assert " ".join(sorted(files_seen(daemon, "sklearn-flat").split())) == "one three two"

    pack = home.root / "sklearn.tar.zst"
    # The image is left out: this test host's second store shares the image cache
    # (unit tests cover packing and installing an image).
    done = cli(home.env, "pack", "--tag", "sklearn", "-o", str(pack), "--no-image")
    assert done.returncode == 0, done.stderr
    assert cli(home.env, "verify", "sklearn").returncode == 0

    # A second host: another store and daemon, sharing only the pack file.
    other_env = dict(home.env, VMFORK_HOME=str(home.root / "other-home"))
    done = cli(other_env, "unpack", str(pack), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stored"] == ["base", "numpy", "pandas", "sklearn"]
    other = Home(home.root, home.logs, other_env, home.procs).start("other",
                                                                    "--kill-sandboxes-on-exit")
    try:
        assert other.ctl.snapshot_info("sklearn")["ancestors"] == ["base", "numpy", "pandas"]
        assert " ".join(sorted(files_seen(other, "sklearn").split())) == "one three two"
    finally:
        other.proc.send_signal(signal.SIGTERM)
        other.proc.wait(60)

    done = cli(home.env, "rmi", "--cascade", "base", *url)
    assert done.returncode == 0, done.stderr
    assert {s["tag"] for s in daemon.ctl.list_snapshots()} == {"sklearn-flat"}
