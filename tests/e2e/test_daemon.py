"""``vmfork serve`` with real VMs, through the SDK.

* One daemon: snapshot over REST, spawn, drive (exec, eval, streaming, files), BRANCH
  a sandbox and spawn from the branch, delete, stop with ``--kill-sandboxes-on-exit``
  and check nothing is left.
* The SDK, sync and async: streamed output as it is written, a background command,
  several sandboxes from one event loop, and a 100 MiB file through the daemon and
  back.
* Restart: 10 live sandboxes, the daemon SIGKILLed, a new daemon on the same state
  re-adopts all 10 (each still has its own state and answers exec/eval); then the
  daemon stops keeping them and the zygote's lease kills them.

Kept to one snapshot for the module (every boot costs tens of seconds in the
emulated host); children dirty only a few MiB each.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vmfork.client import AsyncSandbox, Controller, ControllerError, Sandbox
from vmfork.runtime import cgroups
from vmfork.runtime.zygote_child import VMM_NICE
from vmfork.runtime.zygote_client import ZygoteClient
from vmfork.runtime.zygote_protocol import ZygoteError
from vmfork.server.spawner import default_memory_limit_mib

pytestmark = pytest.mark.e2e

GUEST_MEM_MIB = 256


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone for us
    except FileNotFoundError:
        return False


def _until_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if _alive(p)]}"
        time.sleep(0.1)


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    ctl: Controller
    state: Path
    socket: Path


@dataclass
class Home:
    root: Path   # store and state directories: sockets need a local file system (tmpfs)
    logs: Path   # daemon output, under pytest's basetemp (point it at a shared directory
                 # to watch a run inside the test host)
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, *flags: str) -> Daemon:
        state = self.root / name
        sock = self.root / f"{name}.sock"
        log_path = self.logs / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the daemon writes it
        proc = subprocess.Popen([sys.executable, "-m", "vmfork.cli.serve", "--state",
                                 str(state), "--socket", str(sock), *flags],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(proc)
        ctl = Controller(f"unix://{sock}", timeout=1800)
        deadline = time.monotonic() + 300
        while True:
            try:
                ctl.healthz()
                return Daemon(proc, ctl, state, sock)
            except ControllerError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise AssertionError("the daemon did not start:\n" + log_path.read_text()
                                         + _zygote_log(state)) from None
                time.sleep(0.1)


def _zygote_log(state: Path) -> str:
    try:
        return "\nzygote.log:\n" + (state / "zygote.log").read_text()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    logs = tmp_path_factory.mktemp("daemon")
    root = Path(tempfile.mkdtemp(prefix="vmfork-e2e-daemon-"))
    env = dict(os.environ, VMFORK_HOME=str(root / "home"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    home = Home(root, logs, env)
    yield home
    for proc in home.procs:   # daemons a failed test left running
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for sock in root.glob("*/zygote.sock"):  # whatever a failed test left running
        try:
            with ZygoteClient(sock, timeout=30) as z:
                z.shutdown()
        except ZygoteError:
            pass
    for state in root.iterdir():
        if (state / "zygote.log").exists():
            shutil.copy(state / "zygote.log", logs / f"{state.name}-zygote.log")
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def snapshot(home: Home) -> str:
    d = home.start("maker", "--kill-sandboxes-on-exit")
    try:
        info = d.ctl.create_snapshot("warm", mem_mib=GUEST_MEM_MIB, warm_code="answer = 41")
        assert info["status"] == "ready" and info["bootable"] is True
    finally:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(60)
    return "warm"


def _assert_contained(pids: list[int], guest_mib: int) -> None:
    """A daemon's VMMs run jailed (a uid of their own each, no capabilities, seccomp
    filtering), first in line for the OOM killer, in a memory cgroup with the default
    limit (none was asked for)."""
    uids = set()
    for pid in pids:
        status = dict(line.split(":\t", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
        uid = int(status["Uid"].split()[0])
        assert uid >= 1_000_000 and int(status["CapEff"], 16) == 0, status
        assert status["Seccomp"].strip() == "2" and status["NoNewPrivs"].strip() == "1"
        uids.add(uid)
        assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "1000"
        # Every thread of the VMM (main, I/O, vCPU, control) yields to the control plane.
        nices = {os.getpriority(os.PRIO_PROCESS, int(tid))
                 for tid in os.listdir(f"/proc/{pid}/task")}
        assert nices == {VMM_NICE}, nices
        h = cgroups.detect()
        assert h is not None
        line = next(x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                    if (h.version == 2 and x.startswith("0::")) or
                    (h.version == 1 and "memory" in x.split(":")[1].split(",")))
        group = h.root / line.split(":", 2)[2].lstrip("/")
        assert group.parent.name == cgroups.DEFAULT_PARENT, line
        limit = int((group / h.limit_file).read_text())
        assert limit == default_memory_limit_mib(guest_mib) << 20
    assert len(uids) == len(pids), "one uid per sandbox"


def test_daemon_spawn_drive_branch_delete(home: Home, snapshot: str) -> None:
    d = home.start("one", "--kill-sandboxes-on-exit")
    ctl = d.ctl
    assert [s["tag"] for s in ctl.list_snapshots()] == [snapshot]
    infos = ctl.spawn_sandboxes(snapshot, n=2)
    pids = [i["pid"] for i in infos]
    assert all(_alive(pid) for pid in pids)
    _assert_contained(pids, GUEST_MEM_MIB)
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

    # BRANCH (full) a sandbox mid-work; a child of the branch starts from its state,
    # and the source keeps running.
    branch = ctl.branch_sandbox(infos[0]["id"], tag="branched")
    assert branch["status"] == "ready" and branch["pause_ms"] > 0
    assert branch["branched_from"] == infos[0]["id"]
    assert ctl.eval_code(infos[0]["id"], "answer")["result"] == "0"
    child = ctl.spawn_sandboxes("branched")[0]
    assert ctl.eval_code(child["id"], "answer")["result"] == "0"
    assert ctl.exec_command(child["id"], ["cat", "/tmp/payload"])["exit_code"] == 0
    assert 'vmfork_branch_pause_seconds_count{mode="full"} 1' in ctl.metrics()
    ctl.kill_sandbox(child["id"])
    # diff (a layer over the sandbox's own snapshot, resolved into a spawnable head) and
    # live (wait:false: 202 writing, then ready), each spawned and checked.
    ctl.eval_code(infos[0]["id"], "answer = 7")
    diff = ctl.branch_sandbox(infos[0]["id"], tag="branched-diff", mode="diff",
                              measure_diff=True)
    assert diff["status"] == "ready" and diff["parent_tag"] in (snapshot, "branched")
    assert 0 < diff["diff_logical_bytes"] < 256 << 20
    live = ctl.branch_sandbox(infos[0]["id"], tag="branched-live", mode="live", wait=False)
    assert live["status"] in ("writing", "ready")
    deadline = time.monotonic() + 300
    while {s["tag"]: s["status"] for s in ctl.list_snapshots()}["branched-live"] != "ready":
        assert time.monotonic() < deadline, ctl.list_snapshots()
        time.sleep(0.2)
    for tag in ("branched-diff", "branched-live"):
        child = ctl.spawn_sandboxes(tag)[0]
        assert ctl.eval_code(child["id"], "answer")["result"] == "7", tag
        ctl.kill_sandbox(child["id"])

    for i in infos:
        ctl.kill_sandbox(i["id"])
    assert ctl.list_sandboxes() == []
    assert not any(_alive(pid) for pid in pids)
    metrics = ctl.metrics()
    assert "vmfork_sandboxes_active 0" in metrics

    # --kill-sandboxes-on-exit: the daemon stops its sandboxes and its zygote.
    last = ctl.spawn_sandboxes(snapshot)[0]
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 0
    _until_gone([last["pid"]], 10)
    assert not d.socket.exists() and not (d.state / "zygote.sock").exists()
    assert list((d.state / "run").iterdir()) == []
    audit = (d.state / "audit.log").read_text().splitlines()
    assert any('"/v1/sandboxes"' in line and '"status":201' in line for line in audit)


def test_restart_readopts_10_live_sandboxes(home: Home, snapshot: str) -> None:
    # A long lease: a daemon start in a loaded emulated host can take a minute.
    d = home.start("restart", "--zygote-lease", "900")
    # Two at a time: ten guests restoring at once starve each other in a loaded
    # emulated host (their agents miss the ready timeout).
    infos = [info for _ in range(5) for info in d.ctl.spawn_sandboxes(snapshot, n=2)]
    ids = [i["id"] for i in infos]
    pids = [i["pid"] for i in infos]
    for n, sandbox in enumerate(ids):
        d.ctl.eval_code(sandbox, f"mark = {n}")
    with ZygoteClient(d.state / "zygote.sock") as z:
        zygote_pid = int(z.ping()["pid"])

    d.proc.kill()  # a crash: no shutdown code runs
    d.proc.wait()
    assert all(_alive(p) for p in pids) and _alive(zygote_pid)

    # The new daemon shortens the lease so the end of this test can watch it expire.
    again = home.start("restart", "--zygote-lease", "5")
    listed = {s["id"]: s for s in again.ctl.list_sandboxes()}
    assert sorted(listed) == sorted(ids)
    assert all(s["status"] == "running" for s in listed.values())
    for n, sandbox in enumerate(ids):
        assert again.ctl.ping_sandbox(sandbox)["pong"] is True
        assert again.ctl.eval_code(sandbox, "mark")["result"] == str(n)
        r = again.ctl.exec_command(sandbox, ["/bin/sh", "-c", f"echo {n}"])
        assert r["stdout"] == f"{n}\n"
    assert "vmfork_sandboxes_active 10" in again.ctl.metrics()
    # Sandboxes spawned before and after the restart compose.
    extra = again.ctl.spawn_sandboxes(snapshot)[0]
    again.ctl.kill_sandbox(ids[0])
    assert not _alive(pids[0])

    # A clean stop keeps the sandboxes; with no daemon back within the lease the
    # zygote kills them and exits.
    again.proc.send_signal(signal.SIGTERM)
    assert again.proc.wait(60) == 0
    assert all(_alive(p) for p in pids[1:])
    _until_gone([zygote_pid, extra["pid"], *pids[1:]], 5 + 30)
    assert not (again.state / "zygote.sock").exists()


def test_sdk_sync_and_async_streaming_and_a_100_mib_file(home: Home, snapshot: str,
                                                         tmp_path: Path) -> None:
    d = home.start("sdk", "--kill-sandboxes-on-exit")
    try:
        # Sync: output streams while the command runs. The command waits for a file
        # that is written only once its first line has arrived, so the test proves
        # streaming without timing anything.
        with Sandbox.create(snapshot, controller=d.ctl) as sb:
            seen: list[str] = []
            handle = sb.commands.run(
                "echo one; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo two >&2; exit 7",
                background=True, on_stdout=seen.append, timeout=600)
            deadline = time.monotonic() + 600
            while handle.stdout != "one\n":
                assert not handle.done and time.monotonic() < deadline, handle.stdout
                time.sleep(0.05)
            assert seen == ["one\n"]
            sb.files.write("/tmp/go", "")
            done = handle.wait(600)
            assert (done.exit_code, done.stdout, done.stderr) == (7, "one\n", "two\n")
            chunks: list[str] = []
            result = sb.commands.run("echo a; echo b >&2", on_stdout=chunks.append,
                                     on_stderr=chunks.append)
            assert result.stdout == "a\n" and result.stderr == "b\n"
            assert sorted(chunks) == ["a\n", "b\n"]

            # 100 MiB through the daemon and back, streamed from and into files.
            source = tmp_path / "source.bin"
            with source.open("wb") as f:
                for _ in range(100):
                    f.write(os.urandom(1 << 20))
            with source.open("rb") as f:
                assert sb.files.write("/tmp/big.bin", f) == 100 << 20
            assert sb.files.stat("/tmp/big.bin")["size"] == 100 << 20
            copy = tmp_path / "copy.bin"
            with copy.open("wb") as f:
                assert sb.files.read_to("/tmp/big.bin", f) == 100 << 20
            assert _same_file(source, copy)
            digest = sb.commands.run("sha256sum /tmp/big.bin").stdout.split()[0]
            assert digest == hashlib.sha256(source.read_bytes()).hexdigest()
            sb.files.remove("/tmp/big.bin")

        # Async: several sandboxes driven concurrently from one event loop.
        async def one(n: int) -> str:
            async with await AsyncSandbox.create(snapshot, controller=d.ctl) as asb:
                chunks: list[str] = []
                r = await asb.commands.run(f"echo {n}", on_stdout=chunks.append)
                assert chunks == [f"{n}\n"] and r.exit_code == 0
                assert (await asb.eval(f"answer + {n}")).result == str(41 + n)
                await asb.files.write("/tmp/n", str(n))
                return (await asb.files.read("/tmp/n")).decode()

        async def main() -> list[str]:
            return await asyncio.gather(*(one(n) for n in range(3)))

        assert asyncio.run(main()) == ["0", "1", "2"]
        assert d.ctl.list_sandboxes() == []
    finally:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(60)


def _same_file(a: Path, b: Path) -> bool:
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def _cli(home: Home, *argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(home.env, VMFORK_STATE_DIR=str(home.root / "cli-state"))  # no daemon there
    env.pop("VMFORK_URL", None)
    return subprocess.run([sys.executable, "-m", "vmfork", *argv], env=env, text=True,
                          capture_output=True, timeout=900, check=False)


def test_cli_fork_embedded_and_verbs_through_a_daemon(home: Home, snapshot: str) -> None:
    # No daemon answers: `fork` runs an embedded one for the command and tears down.
    done = _cli(home, "fork", "--tag", snapshot, "-n", "2", "--exec", "echo hi")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"forked 2 children of {snapshot}")
    assert done.stdout.count(": hi") == 2 and "embedded" in done.stderr
    done = _cli(home, "ls")
    assert done.returncode == 1 and "no daemon at unix://" in done.stderr

    d = home.start("cli", "--kill-sandboxes-on-exit")
    try:
        url = ("--url", f"unix://{d.socket}")
        spawned = _cli(home, "spawn", "--tag", snapshot, *url)
        sandbox = spawned.stdout.strip()
        assert spawned.returncode == 0 and sandbox.startswith("vm-"), spawned.stderr
        done = _cli(home, "exec", *url, sandbox, "--", "/bin/sh", "-c", "echo out; exit 5")
        assert (done.returncode, done.stdout) == (5, "out\n")
        assert _cli(home, "eval", *url, sandbox, "answer").stdout == "41\n"
        listed = _cli(home, "ls", "--json", *url)
        assert [s["id"] for s in json.loads(listed.stdout)] == [sandbox]
        assert _cli(home, "kill", "--all", *url).returncode == 0
        assert d.ctl.list_sandboxes() == []
    finally:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(60)
