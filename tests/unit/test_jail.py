"""The jail, from inside jailed children of a real zygote (issue 16, item 1).

A zygote started as for the daemon, with this directory's ``test_zygote_entries``
registered (for tests only); children are spawned with a ``jail`` and probe what a
compromised VMM would reach. Needs root (namespaces, mounts, another uid) and
``/dev/kvm`` (a jailed child must still open it and talk to KVM).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.ondisk import decoded as decoded_files
from vmfork.ondisk.decoded import DecodedFiles
from vmfork.runtime import jail
from vmfork.runtime.zygote_client import ZygoteClient, ZygoteError, ZygoteProcess, start_zygote
from vmfork.runtime.zygote_protocol import SpawnItem

HERE = Path(__file__).resolve().parent
E = "test_zygote_entries:"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/kvm") or bool(jail.problems()),
    reason="needs root, /dev/kvm and a host that can build a jail")


def vid() -> str:
    return "j-" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    # Not under pytest's tmp_path: that is below /tmp/pytest-of-root, and the jail must
    # not be the test's whole temporary tree.
    root = Path(tempfile.mkdtemp(prefix="vmfj-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def zygote(base: Path) -> Iterator[ZygoteProcess]:
    z = start_zygote(base / "zygote.sock", env=dict(os.environ, PYTHONPATH=str(HERE)),
                     entries_modules=["test_zygote_entries"])
    yield z
    z.close()


@pytest.fixture
def client(zygote: ZygoteProcess) -> ZygoteClient:
    return zygote.client()


def _jail(uid: int, *read_only: str) -> dict[str, object]:
    return {"uid": uid, "gid": uid, "read_only": list(read_only), "devices": ["/dev/kvm"]}


def test_a_jailed_child_reaches_kvm_and_nothing_of_the_host(client: ZygoteClient,
                                                              base: Path) -> None:
    snapshot = base / "snapshots" / "s1"
    snapshot.mkdir(parents=True)
    (snapshot / "state.bin").write_bytes(b"snapshot state")
    # World-writable on the host, so only the jail's read-only bind can refuse a write.
    (snapshot / "state.bin").chmod(0o666)
    # Like a snapshot's memory.bin: 0600, the daemon's; readable only if pre-opened.
    (snapshot / "memory.bin").write_bytes(b"guest memory")
    (snapshot / "memory.bin").chmod(0o600)
    peer_dir = base / "run" / vid()
    peer = client.spawn(E + "listen_and_sleep", {"run_dir": str(peer_dir)}, vm_id=vid(),
                        jail=_jail(71002))
    for _ in range(200):
        if (peer_dir / "control.sock").exists():
            break
        time.sleep(0.02)
    assert (peer_dir / "control.sock").exists()
    log = base / "probe.log"
    run_dir = base / "run" / vid()
    child = client.spawn(E + "jail_probe", {
        "run_dir": str(run_dir), "log_path": str(log), "peer_socket": str(peer_dir / "control.sock"),
        "peer_pid": peer.pid, "snapshot_file": str(snapshot / "state.bin"),
        "private_file": str(snapshot / "memory.bin")},
        vm_id=vid(), jail={**_jail(71001, str(snapshot)),
                           "preopen": [str(snapshot / "memory.bin")]})
    event = client.wait(child.vm_id)
    assert event.exit_code == 0, log.read_text()
    report = json.loads(log.read_text().splitlines()[-1])
    client.kill_and_wait(peer.vm_id)

    assert (report["uid"], report["gid"], report["groups"]) == (71001, 71001, [])
    assert report["cap_eff"] == report["cap_bnd"] == "0000000000000000"
    # Nothing of the zygote's environment but where vmfork's cache is.
    assert report["no_new_privs"] == "1" and set(report["env"]) == {"VMFORK_CACHE_DIR"}
    assert "etc" not in report["root"] and "home" not in report["root"]
    assert report["shadow"].startswith("refused: FileNotFoundError")
    assert report["peer_socket"].startswith("refused: FileNotFoundError")
    assert report["peer_mem"].startswith("refused: FileNotFoundError")   # hidepid
    assert report["zygote_environ"].startswith("refused: FileNotFoundError")
    # A PID namespace of its own: it is pid 1, sees no other process, and cannot
    # signal its sibling sandbox or the zygote (ESRCH: they have no pid there).
    assert (report["pid"], report["ppid"], report["procs"]) == (1, 0, ["1"])
    assert report["peer_signal"] == "refused: ProcessLookupError 3"
    assert report["zygote_signal"] == "refused: ProcessLookupError 3"
    assert report["kvm_api"] == 12
    assert report["dev_node"].startswith("refused: FileNotFoundError")
    assert report["late_import"] == "fresh allowed"
    # Python's paths show through one link each at the shallowest directory that holds
    # nothing else of the jail's (here each path's first one: the run directory and the
    # snapshot are under /tmp), not a directory made per level on every child's root.
    tops = {"/" + Path(p).parts[1] for p in jail.python_paths()} - {"/tmp"}
    assert {top: report["root_links"].get(top[1:]) for top in tops} == {
        top: jail.SHARED_AT + top for top in tops}
    assert report["source_write"].startswith("refused: OSError 30")     # EROFS
    assert report["shared_write"].startswith("refused: OSError 30")
    # Not the host's network: the zygote's empty namespace, a loopback and nothing else.
    assert report["netns"] != os.readlink("/proc/self/ns/net")
    assert report["interfaces"] == ["lo"]
    assert report["run_dir_write"] == "allowed"
    assert report["snapshot_write"].startswith("refused: OSError 30")    # EROFS
    assert report["snapshot_read"] == "snapshot state"
    assert report["private_open"].startswith("refused: PermissionError")
    assert report["private_preopened"] == "guest memory"


def _neighbours(client: ZygoteClient, base: Path, parent: Path, fifo: str, uid: int,
                *read_only: str) -> dict[str, dict[str, object]]:
    """Two jailed children of one batch, their run directories side by side in
    ``parent`` with the spawner's FIFO ``fifo`` beside them: each one's report
    (``jail_neighbours``), by name."""
    names = [vid(), vid()]
    for name in names:
        (parent / name).mkdir(parents=True)
        (parent / name / f"secret-{name}").write_text(name)
    os.mkfifo(parent / fifo, 0o666)
    items = [SpawnItem(name, {
        "run_dir": str(parent / name), "log_path": str(base / f"{name}.log"),
        "host_dir": str(parent.parent), "sibling_dir": str(parent / other),
        "sibling_file": str(parent / other / f"secret-{other}"),
        "fifo": str(parent / fifo), **({"state": read_only[0]} if read_only else {})},
        jail=_jail(uid + i, str(parent / fifo), *read_only))
        for i, (name, other) in enumerate(zip(names, reversed(names)))]
    result = client.spawn_many(E + "jail_neighbours", items)
    assert not result.failed and len(result.children) == 2
    reports = {}
    for name in names:
        event = client.wait(name)
        log = (base / f"{name}.log").read_text()
        assert event.exit_code == 0, log
        reports[name] = json.loads(log.splitlines()[-1])
    return reports


def _bases(client: ZygoteClient) -> tuple[int, int]:
    """The zygote's jail bases: how many it keeps, and how many it built so far."""
    bases = client.ping()["jail_bases"]
    return bases["kept"], bases["built"]


def test_jailed_siblings_of_one_batch_see_neither_each_other_nor_the_host(
        client: ZygoteClient, zygote: ZygoteProcess, base: Path) -> None:
    """Two jailed children of one batch, their run directories side by side: each sees
    its own directory and files alone in their parent (not the sibling's, nor its name),
    nothing of the host directory above but the way down to it, the batch's FIFO
    read-only, and no mount point but its root, the shared tree, its run directory (and
    the tmpfs above it), the FIFO and /proc."""
    parent = base / "siblings" / vid()
    (base / "siblings").mkdir(exist_ok=True)
    (base / "siblings" / "host-file").write_text("the host's")
    reports = _neighbours(client, base, parent, ".batch-fifo", 71010)
    for name, report in reports.items():
        assert report["parent"] == [".batch-fifo", name]
        assert report["fifo"] == "fifo" and "ro" in report["fifo_options"]
        assert report["own"] == [f"secret-{name}"]
        assert report["host"] == [parent.name]
        assert report["sibling_file"].startswith("refused: FileNotFoundError")
        assert report["sibling_dir"].startswith("refused: FileNotFoundError")
        mounts = {m for m in report["mounts"] if not m.startswith(jail.SHARED_AT)}
        assert mounts <= {"/", "/proc", str(parent), str(parent / name),
                          str(parent / ".batch-fifo")}, mounts
        assert {"/", "/proc", str(parent / name), str(parent / ".batch-fifo")} <= mounts


def test_a_jail_base_serves_the_next_batches_until_what_it_binds_changes(
        client: ZygoteClient, zygote: ZygoteProcess, base: Path) -> None:
    """The zygote keeps a batch's jail base (``jail.KeptBases``): the next batch of the
    same jail joins it, and sees its own FIFO, not the one before it (a spawn's files
    are never in a base). A read-only path published again (a new inode) gets a new
    base, which shows the new file; the old one is let go of."""
    parent = base / "kept" / vid()
    snapshot = base / "kept-snapshot"
    snapshot.mkdir()
    (snapshot / "state.bin").write_text("first")
    first = _neighbours(client, base, parent, ".notify-a", 71020, str(snapshot / "state.bin"))
    kept, built = _bases(client)
    (parent / ".notify-a").unlink()      # as the spawner does once its batch is spawned
    again = _neighbours(client, base, parent, ".notify-b", 71020, str(snapshot / "state.bin"))
    assert _bases(client) == (kept, built)
    for name, report in again.items():
        assert report["parent"] == [".notify-b", name]
        assert report["fifo"] == "fifo" and "ro" in report["fifo_options"]
    assert {r["state"] for r in [*first.values(), *again.values()]} == {"first"}
    (snapshot / "state.tmp").write_text("second")
    os.replace(snapshot / "state.tmp", snapshot / "state.bin")
    (parent / ".notify-b").unlink()
    after = _neighbours(client, base, parent, ".notify-c", 71020, str(snapshot / "state.bin"))
    assert {r["state"] for r in after.values()} == {"second"}
    assert _bases(client) == (kept, built + 1)
    # The zygote's descriptors of them: a namespace's and its root's each.
    fds = f"/proc/{zygote.proc.pid}/fd"
    assert len([fd for fd in os.listdir(fds) if os.readlink(f"{fds}/{fd}").startswith("mnt:")
                ]) == kept


def test_spawns_in_directories_of_their_own_share_the_base_of_their_runs_in(
        client: ZygoteClient, base: Path) -> None:
    """The daemon gives each spawn a directory of its own in ``run/`` and names ``run/``
    the jails' ``runs_in``: every spawn joins one base, and each child sees the way
    down to its own run directory and its batch's FIFO, nothing of another spawn's. A
    run directory outside ``runs_in``, or a read-only path inside it that is not
    beside the run directory, is refused with the reason."""
    runs_in = base / "daemon-run"
    batches = [runs_in / f"spawn-{i}" for i in range(2)]
    for batch in batches:
        batch.mkdir(parents=True)
        os.mkfifo(batch / ".notify-x", 0o666)
    built = None
    for batch in batches:
        name = vid()
        (batch / name).mkdir()
        child = client.spawn(E + "jail_neighbours", {
            "run_dir": str(batch / name), "log_path": str(base / f"{name}.log"),
            "host_dir": str(runs_in), "sibling_dir": str(batches[0]),
            "sibling_file": str(batches[0] / "no-file"), "fifo": str(batch / ".notify-x"),
            "linger": 0}, vm_id=name,
            jail={**_jail(71040, str(batch / ".notify-x")), "runs_in": str(runs_in)})
        event = client.wait(child.vm_id)
        log = (base / f"{name}.log").read_text()
        assert event.exit_code == 0, log
        report = json.loads(log.splitlines()[-1])
        assert report["host"] == [batch.name]
        assert report["parent"] == [".notify-x", name]
        assert "ro" in report["fifo_options"]
        if batch is batches[1]:   # the first batch's directory is not in the second's jail
            assert report["sibling_dir"].startswith("refused: FileNotFoundError")
        assert built is None or _bases(client)[1] == built
        built = _bases(client)[1]
    with pytest.raises(ZygoteError, match="is not under jail.runs_in"):
        client.spawn(E + "sleep", {"run_dir": str(base / "outside" / vid())}, vm_id=vid(),
                     jail={**_jail(71041), "runs_in": str(runs_in)})
    with pytest.raises(ZygoteError, match="where a jail base holds each child's run"):
        client.spawn(E + "sleep", {"run_dir": str(batches[0] / vid())}, vm_id=vid(),
                     jail={**_jail(71041, str(runs_in / "elsewhere" / "file")),
                           "runs_in": str(runs_in)})
    with pytest.raises(ZygoteError, match="jail.runs_in must be an absolute path"):
        client.spawn(E + "sleep", {"run_dir": str(batches[0] / vid())}, vm_id=vid(),
                     jail={**_jail(71041), "runs_in": "relative/run"})


def test_the_zygote_keeps_a_bounded_number_of_jail_bases(client: ZygoteClient,
                                                         base: Path) -> None:
    """One base per jail request and run directories' parent, at most
    ``jail.KEPT_BASES`` of them: the least recently used one goes first."""
    for i in range(jail.KEPT_BASES + 2):
        parent = base / "many" / vid()
        parent.mkdir(parents=True)
        child = client.spawn(E + "sleep", {"run_dir": str(parent / vid())}, vm_id=vid(),
                             jail=_jail(71030, str(base / "many" / f"path-{i}")))
        client.kill_and_wait(child.vm_id)
    kept, built = _bases(client)
    assert kept == jail.KEPT_BASES and built >= jail.KEPT_BASES + 2


@pytest.mark.parametrize("call", ["execve", "socket_inet", "ptrace"])
def test_forbidden_calls_in_a_jailed_child_die_with_sigsys(client: ZygoteClient, base: Path,
                                                           call: str) -> None:
    child = client.spawn(E + "jail_forbidden", {"run_dir": str(base / "run" / vid()),
                                                "call": call},
                         vm_id=vid(), jail=_jail(71003))
    event = client.wait(child.vm_id)
    assert (event.reason, event.signal) == ("crashed", signal.SIGSYS), event.description


def test_a_jail_as_root_or_without_a_run_dir_is_refused(client: ZygoteClient,
                                                        base: Path) -> None:
    with pytest.raises(ZygoteError, match="never runs as root"):
        client.spawn(E + "sleep", {"run_dir": str(base / "run" / vid())}, vm_id=vid(),
                     jail=_jail(0))
    with pytest.raises(ZygoteError, match="needs args.run_dir"):
        client.spawn(E + "sleep", vm_id=vid(), jail=_jail(71004))


def test_a_failed_jail_step_exits_71_with_the_step_and_errno_in_the_log(
        client: ZygoteClient, base: Path) -> None:
    """A "device" that is a regular file: the jail refuses it before it drops anything,
    and the child's log (opened by the set-up, before the jail) names the step."""
    run_dir = base / "run" / vid()
    log = base / f"{vid()}.log"
    child = client.spawn(E + "sleep", {"run_dir": str(run_dir), "log_path": str(log)},
                         vm_id=vid(), jail={**_jail(71005), "devices": ["/etc/hostname"]})
    event = client.wait(child.vm_id)
    assert (event.reason, event.exit_code) == ("exited", 71), event
    assert log.read_text().splitlines()[-1] == (
        f"vmfork child: [Errno {errno.ENODEV}] jail: open device /etc/hostname: "
        f"{os.strerror(errno.ENODEV)}")


def test_uid_range_gives_each_live_child_its_own_uid(client: ZygoteClient, base: Path) -> None:
    jail_range = {"uid_range": [72000, 2], "read_only": [], "devices": ["/dev/kvm"]}
    a = client.spawn(E + "sleep", {"run_dir": str(base / "run" / vid())}, vm_id=vid(),
                     jail=jail_range)
    b = client.spawn(E + "sleep", {"run_dir": str(base / "run" / vid())}, vm_id=vid(),
                     jail=jail_range)
    try:
        time.sleep(0.3)
        uids = sorted(os.stat(f"/proc/{c.pid}").st_uid for c in (a, b))
        assert uids == [72000, 72001]
        with pytest.raises(ZygoteError, match="held by a live child"):
            client.spawn(E + "sleep", {"run_dir": str(base / "run" / vid())}, vm_id=vid(),
                         jail=jail_range)
    finally:
        client.kill_and_wait(a.vm_id)
    c = client.spawn(E + "sleep", {"run_dir": str(base / "run" / vid())}, vm_id=vid(),
                     jail=jail_range)   # a's uid is free again
    time.sleep(0.3)
    assert os.stat(f"/proc/{c.pid}").st_uid == 72000
    client.kill_and_wait(b.vm_id)
    client.kill_and_wait(c.vm_id)


def test_the_jail_request_of_a_damaged_snapshot_leaves_the_error_to_its_vmm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spawner reads state.bin only to pre-open the root disk; a damaged one must
    fail in the VMM with its usual report (test_fork's damaged-snapshot cases), not in
    the spawner."""
    from types import SimpleNamespace

    from vmfork.runtime.spawn import _jail_request

    monkeypatch.setenv("VMFORK_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "disks").mkdir(parents=True)
    snap = tmp_path / "broken"
    snap.mkdir()
    (snap / "state.bin").write_bytes(b"not a state file")
    (snap / "memory.bin").write_bytes(b"\0" * 4096)
    request = _jail_request(SimpleNamespace(path=snap), [])  # type: ignore[arg-type]
    assert sorted(request["preopen"]) == [str(snap / "memory.bin"), str(snap / "state.bin")]


def test_the_jail_request_decodes_a_snapshots_plan_and_state_once_per_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spawner decodes a diff snapshot's memory.plan (its chain's files) and its
    state.bin (the disks' content keys) once per file, not at every spawn; a file
    published again under the same path (a new inode) is decoded again."""
    from types import SimpleNamespace

    from vmfork.ondisk.memplan import PLAN_FILE, MemoryPlan, PlanRun, PlanSource, encode_plan
    from vmfork.runtime import spawn

    monkeypatch.setenv("VMFORK_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "disks").mkdir(parents=True)
    golden = Path(__file__).parent / "golden" / "state-v1.bin"
    snap = tmp_path / "snapshots" / "head"
    snap.mkdir(parents=True)
    shutil.copyfile(golden, snap / "state.bin")
    (snap / "layer.bin").write_bytes(b"\0" * 4096)

    def publish_plan(*links: str) -> None:
        plan = MemoryPlan(1 << 20, (PlanSource("base/memory.bin", 1 << 20), *(
                              PlanSource(f"{link}/layer.bin", 4096) for link in links)),
                          (PlanRun(0, 4096, len(links), 0),))
        tmp = snap / "plan.tmp"
        tmp.write_bytes(encode_plan(plan))
        os.replace(tmp, snap / PLAN_FILE)   # as the store publishes: a new inode

    decoded: list[str] = []

    def counting(real):  # the real decoder, counted
        def decode(path, *args):
            decoded.append(os.path.basename(str(path)))
            return real(path, *args)
        return decode

    monkeypatch.setattr(spawn, "read_plan", counting(spawn.read_plan))
    monkeypatch.setattr(spawn, "read_state_file", counting(spawn.read_state_file))
    monkeypatch.setattr(decoded_files, "SETTLED_S", 0.0)   # these files are new
    monkeypatch.setattr(spawn, "_state_keys", DecodedFiles(spawn._keys_in_state))
    monkeypatch.setattr(spawn, "_plan_sources", DecodedFiles(spawn._sources_in_plan))
    listed: list[str] = []

    def listing(path: str) -> tuple[str, ...]:
        listed.append(path)
        return spawn._files_in(path)

    monkeypatch.setattr(spawn, "_snapshot_files", DecodedFiles(listing))
    snapshot = SimpleNamespace(path=snap)
    publish_plan("mid", "head")
    first = spawn._jail_request(snapshot, [])  # type: ignore[arg-type]
    again = spawn._jail_request(snapshot, [])  # type: ignore[arg-type]
    assert first == again
    assert sorted(decoded) == [PLAN_FILE, "state.bin"]
    assert listed == [str(snap)]
    sources = [str(tmp_path / "snapshots" / "base" / "memory.bin"),
               *(str(tmp_path / "snapshots" / link / "layer.bin") for link in ("mid", "head"))]
    assert first["preopen"][-len(sources):] == sources   # after the snapshot's own files
    assert first["disk_keys"] == ["a" * 64]
    assert first["volume_keys"] == ["b" * 64]

    publish_plan("other")
    republished = spawn._jail_request(snapshot, [])  # type: ignore[arg-type]
    assert sorted(decoded) == [PLAN_FILE, PLAN_FILE, "state.bin"]
    assert str(tmp_path / "snapshots" / "other" / "layer.bin") in republished["preopen"]
    assert str(tmp_path / "snapshots" / "mid" / "layer.bin") not in republished["preopen"]

    # The snapshot's own files are listed once too, and again once one is added (a
    # diff snapshot materialised): the directory's mtime moved, past the clock's tick.
    assert str(snap / "memory.bin") not in republished["read_only"]
    time.sleep(0.05)
    (snap / "memory.bin").write_bytes(b"\0" * 4096)
    materialised = spawn._jail_request(snapshot, [])  # type: ignore[arg-type]
    assert len(listed) == 3   # the plan's republication changed the directory too
    assert str(snap / "memory.bin") in materialised["read_only"]
    assert str(snap / "memory.bin") in materialised["preopen"]


def test_a_networked_jail_holds_its_tap_and_its_own_tracking_files(client: ZygoteClient,
                                                                   base: Path) -> None:
    """The jail joins the sandbox's namespace and attaches to its tap before the drop;
    inside, the VMM has that descriptor but no /dev/net/tun, and it can still read its
    own pagemap and clear its soft-dirty bits (BRANCH), which its new uid could not open."""
    import subprocess

    ns = f"vmfj-{uuid.uuid4().int % 10**6}"   # named as ours: <prefix>-<slot>
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "tuntap", "add", "tap0", "mode", "tap", "vnet_hdr"],
                       check=True)
        log = base / f"{ns}.log"
        child = client.spawn(E + "jail_net_probe", {
            "run_dir": str(base / "run" / vid()), "log_path": str(log), "netns": ns,
            "net_tap": "tap0"}, vm_id=vid(), jail=_jail(71005))
        event = client.wait(child.vm_id)
        assert event.exit_code == 0, log.read_text()
        report = json.loads(log.read_text().splitlines()[-1])
        assert report["uid"] == 71005 and report["tap"] == "tap0"
        assert report["netns"] == os.stat(f"/run/netns/{ns}").st_ino
        assert report["tun"].startswith("refused: FileNotFoundError")
        assert report["pagemap_bytes"] == 8 and report["clear_refs"] == 1
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def test_the_zygote_still_kills_and_reaps_a_child_in_its_own_pid_namespace(
        client: ZygoteClient, base: Path) -> None:
    """A PID namespace's first process gets only the signals it handles (and SIGKILL
    from the zygote's namespace): SIGKILL, and SIGTERM before its entry handles one,
    both end it, and it is reaped."""
    killed = client.spawn(E + "sleep", {"run_dir": str(base / "run" / vid())}, vm_id=vid(),
                          jail=_jail(71010))
    termed = client.spawn(E + "sleep", {"run_dir": str(base / "run" / vid())}, vm_id=vid(),
                          jail=_jail(71011))
    time.sleep(0.3)
    nspid = next(line for line in Path(f"/proc/{killed.pid}/status").read_text().splitlines()
                 if line.startswith("NSpid:")).split()[1:]
    assert nspid == [str(killed.pid), "1"]
    client.kill(killed.vm_id, signal.SIGKILL)
    client.kill(termed.vm_id, signal.SIGTERM)
    event = client.wait(killed.vm_id)
    assert (event.reason, event.signal) == ("killed", signal.SIGKILL), event.description
    event = client.wait(termed.vm_id)
    assert event.exit_code == 128 + signal.SIGTERM, event.description
    assert not Path(f"/proc/{killed.pid}").exists() and not Path(f"/proc/{termed.pid}").exists()


def test_the_shared_tree_is_the_zygote_s_alone_and_goes_with_it(base: Path) -> None:
    """The tree of Python's paths every jail binds is mounted in the zygote's own mount
    namespace: the host never sees it, and nothing of it is left once the zygote exits."""
    sock = base / "own" / "zygote.sock"
    sock.parent.mkdir()
    tree = Path(str(sock) + ".jail")
    z = start_zygote(sock, env=dict(os.environ, PYTHONPATH=str(HERE)),
                     entries_modules=["test_zygote_entries"])
    try:
        run_dir = base / "run" / vid()
        child = z.client().spawn(E + "sleep", {"run_dir": str(run_dir), "seconds": 0},
                                 vm_id=vid(), jail=_jail(71005))
        assert z.client().wait(child.vm_id).exit_code == 0
        zygote_mounts = Path(f"/proc/{z.proc.pid}/mountinfo").read_text()
        assert f" {tree} " in zygote_mounts
        assert f" {tree} " not in Path("/proc/self/mountinfo").read_text()
    finally:
        z.close()
    assert not tree.exists()
    assert not Path(str(tree) + "-base").exists()


def test_host_facts_are_read_once_per_process() -> None:
    """The zygote works them out before it forks; its jails (and spawns) reuse them."""
    assert jail.last_capability() == int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    assert jail.python_paths() is jail.python_paths()
    assert jail.python_paths.cache_info().currsize == 1


def test_a_zygote_in_its_own_mount_namespace_sees_the_host_s_later_mounts() -> None:
    """A sandbox's network namespace is a bind mount the host makes after the zygote took
    a mount namespace of its own; where propagation does not reach (a private /run, as
    in the emulated test host), the zygote still finds it through the host's root
    (``jail.host_root``), and a jail lets go of that descriptor. Played out in a forked
    "host" with a private mount namespace of its own, so nothing here touches the
    machine's mounts."""
    ready_r, ready_w = os.pipe()
    mounted_r, mounted_w = os.pipe()
    host = os.fork()
    if host == 0:
        status = 1
        try:
            assert jail._libc.unshare(jail.CLONE_NEWNS) == 0
            jail._mount(None, "/", None, jail.MS_REC | jail.MS_PRIVATE, None, "private /")
            top = tempfile.mkdtemp(prefix="vmfork-hostroot-")
            jail._mount("tmpfs", top, "tmpfs", 0, "size=1m", "tmpfs")   # private: no propagation
            zygote = os.fork()
            if zygote == 0:
                code = 1
                try:
                    os.close(ready_r)
                    os.close(mounted_w)
                    assert jail.own_mount_namespace() and jail.host_root() is not None
                    os.write(ready_w, b"x")
                    assert os.read(mounted_r, 1) == b"x"
                    later = os.path.join(top, "later")
                    here = os.stat(later).st_dev
                    through_host = os.stat(later.lstrip("/"), dir_fd=jail.host_root()).st_dev
                    assert through_host != here, "the host's later mount is not seen"
                    jail._let_go_of_host_root()
                    assert jail.host_root() is None
                    code = 0
                finally:
                    os._exit(code)
            os.close(ready_w)     # the zygote's end alone: its exit is an EOF here
            os.close(mounted_r)
            assert os.read(ready_r, 1) == b"x"
            os.mkdir(os.path.join(top, "later"))
            jail._mount("tmpfs", os.path.join(top, "later"), "tmpfs", 0, "size=1m", "later")
            os.write(mounted_w, b"x")
            _, zstatus = os.waitpid(zygote, 0)
            status = 0 if os.WIFEXITED(zstatus) and os.WEXITSTATUS(zstatus) == 0 else 2
        finally:
            os._exit(status)
    for fd in (ready_r, ready_w, mounted_r, mounted_w):
        os.close(fd)
    _, status = os.waitpid(host, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
