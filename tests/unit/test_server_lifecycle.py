"""Sandbox lifecycle through the daemon (issue 15): timeouts and the reaper,
set_timeout, metadata and list filters, sandbox-wide envs, pause/resume into the same
id, metrics, volumes in SandboxInfo. The real HTTP server, controller and registry,
the Python SDK as the client; the VM is left out (``FakeSpawner``; envs and metrics
use a real agent server on this host, as tests/unit/test_server_processes.py does).
The real-guest side is tests/e2e/test_lifecycle.py."""

from __future__ import annotations

import os
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.agent_support import running_agent
from tests.unit.test_server_http import TOKEN, FakeSpawner, Served, _fake_snapshot, _serve
from tests.unit.test_server_processes import AgentBackedSpawner
from vmfork.client import Controller, ControllerError, Sandbox
from vmfork.server.controller import reconcile as controller_module
from vmfork.server.registry import SCHEMA_VERSION, Registry
from vmfork.server.requests import SnapshotCreate


@pytest.fixture(autouse=True)
def fast_reaper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "REAPER_INTERVAL_S", 0.1)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from _serve(tmp_path, TOKEN)


@pytest.fixture
def ctl(served: Served) -> Controller:
    _fake_snapshot(served.store, SnapshotCreate(tag="base"))
    return Controller(served.url, token=TOKEN.decode(), timeout=10)


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


# -- timeouts ---------------------------------------------------------------------------


def test_no_timeout_by_default_and_forkd_fields_unchanged(ctl: Controller) -> None:
    [info] = ctl.spawn_sandboxes("base")
    assert info["timeout_secs"] is None and info["end_at_unix"] is None
    assert info["metadata"] == {} and info["status"] == "running"


def test_an_expired_sandbox_is_killed_by_the_reaper(served: Served, ctl: Controller) -> None:
    started = time.time()
    [info] = ctl.spawn_sandboxes("base", timeout_secs=1)
    assert started + 0.9 <= info["end_at_unix"] <= time.time() + 1.1
    _wait_for(lambda: ctl.get_sandbox(info["id"])["status"] != "running")
    ended = ctl.get_sandbox(info["id"])
    assert ended["status"] == "exited" and ended["exit_reason"] == "timeout"
    assert info["id"] not in served.spawner.live
    assert time.time() - started >= 1.0


def test_set_timeout_extends_and_clears(served: Served, ctl: Controller) -> None:
    [info] = ctl.spawn_sandboxes("base", timeout_secs=1)
    extended = ctl.set_timeout(info["id"], 60)
    assert extended["end_at_unix"] > time.time() + 50
    time.sleep(1.5)
    assert ctl.get_sandbox(info["id"])["status"] == "running"
    assert ctl.set_timeout(info["id"], None)["end_at_unix"] is None
    with pytest.raises(ControllerError) as err:
        ctl.set_timeout(info["id"], 0)
    assert err.value.status == 400 and "timeout_secs" in err.value.message


def test_a_timeout_extended_in_a_race_wins(served: Served, ctl: Controller,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The reaper read the old deadline, then set_timeout moved it: nothing is killed."""
    [info] = ctl.spawn_sandboxes("base", timeout_secs=3600)
    registry = served.controller.registry
    stale = registry.expired(time.time() + 7200)
    assert [r.id for r in stale] == [info["id"]]
    ctl.set_timeout(info["id"], 3000)
    monkeypatch.setattr(registry, "expired", lambda now: stale)
    assert served.controller.reap_expired() == []
    assert ctl.get_sandbox(info["id"])["status"] == "running"
    assert info["id"] in served.spawner.live


def test_a_deadline_survives_a_daemon_restart(tmp_path: Path) -> None:
    spawner = FakeSpawner()
    for served in _serve(tmp_path, None, spawner=spawner):
        _fake_snapshot(served.store, SnapshotCreate(tag="base"))
        ctl = Controller(served.url, timeout=10)
        [info] = ctl.spawn_sandboxes("base", timeout_secs=1)
        served.controller.stop()   # before the deadline: the reaper did nothing
    assert info["id"] in spawner.live
    time.sleep(1.2)
    for served in _serve(tmp_path, None, spawner=spawner):
        ctl = Controller(served.url, timeout=10)
        _wait_for(lambda c=ctl: c.get_sandbox(info["id"])["status"] == "exited")
        assert ctl.get_sandbox(info["id"])["exit_reason"] == "timeout"
        assert info["id"] not in spawner.live


def test_a_paused_sandbox_survives_a_daemon_restart(tmp_path: Path) -> None:
    spawner = FakeSpawner()
    for served in _serve(tmp_path, None, spawner=spawner):
        _fake_snapshot(served.store, SnapshotCreate(tag="base"))
        ctl = Controller(served.url, timeout=10)
        [info] = ctl.spawn_sandboxes("base", metadata={"k": "v"})
        tag = ctl.pause_sandbox(info["id"])["paused_snapshot"]
    for served in _serve(tmp_path, None, spawner=spawner):
        ctl = Controller(served.url, timeout=10)
        assert ctl.get_sandbox(info["id"])["status"] == "paused"
        resumed = ctl.resume_sandbox(info["id"])
        assert resumed["status"] == "running" and resumed["metadata"] == {"k": "v"}
        assert spawner.spawned_from[-1] == tag and info["id"] in spawner.live


def test_on_timeout_pause_pauses_and_resume_keeps_the_id(served: Served,
                                                         ctl: Controller) -> None:
    [info] = ctl.spawn_sandboxes("base", timeout_secs=1, on_timeout="pause",
                                 metadata={"owner": "ann"})
    _wait_for(lambda: ctl.get_sandbox(info["id"])["status"] == "paused")
    paused = ctl.get_sandbox(info["id"])
    assert paused["paused_snapshot"].startswith(f"pause-{info['id']}-")
    assert paused["end_at_unix"] is None   # a paused sandbox waits for its resume
    assert info["id"] not in served.spawner.live
    resumed = ctl.resume_sandbox(info["id"], timeout_secs=120)
    assert resumed["id"] == info["id"] and resumed["status"] == "running"
    assert resumed["metadata"] == {"owner": "ann"} and resumed["end_at_unix"] > time.time()
    assert served.spawner.spawned_from[-1] == paused["paused_snapshot"]
    assert info["id"] in served.spawner.live


# -- pause / resume -------------------------------------------------------------------------


def test_pause_resume_connect_and_delete_leave_nothing(served: Served,
                                                       ctl: Controller) -> None:
    [info] = ctl.spawn_sandboxes("base", timeout_secs=300)
    sid = info["id"]
    paused = ctl.pause_sandbox(sid)
    assert paused["status"] == "paused" and ctl.pause_sandbox(sid)["status"] == "paused"
    tag = paused["paused_snapshot"]
    assert tag in {s["tag"] for s in ctl.list_snapshots()}
    assert [s["id"] for s in ctl.list_sandboxes(state="paused")] == [sid]
    with pytest.raises(ControllerError) as err:
        ctl.exec_command(sid, ["true"])
    assert err.value.status == 409 and "paused" in err.value.message
    with pytest.raises(ControllerError) as err:
        ctl.delete_snapshot(tag)
    assert err.value.status == 409 and sid in err.value.message
    # The exit of the VMM the pause stopped is not recorded as the sandbox's end.
    time.sleep(0.5)
    assert ctl.get_sandbox(sid)["status"] == "paused"
    # connect resumes; its timeout becomes the one it had.
    sandbox = Sandbox.connect(sid, controller=ctl)
    assert sandbox.info["status"] == "running" and sandbox.id == sid
    assert sandbox.info["end_at_unix"] > time.time() + 250
    # A second pause builds on the first; deleting removes both.
    second = ctl.pause_sandbox(sid)["paused_snapshot"]
    assert second != tag
    ctl.kill_sandbox(sid)
    left = {s["tag"] for s in ctl.list_snapshots()}
    assert tag not in left and second not in left and left == {"base"}
    with pytest.raises(ControllerError) as err:
        ctl.resume_sandbox(sid)
    assert err.value.status == 404


def test_the_old_vmms_exit_after_a_resume_is_not_the_sandboxs_end(served: Served,
                                                                  ctl: Controller) -> None:
    from vmfork.server.spawner import ExitNotice
    [info] = ctl.spawn_sandboxes("base")
    ctl.pause_sandbox(info["id"])
    resumed = ctl.resume_sandbox(info["id"])
    assert resumed["pid"] != info["pid"]
    served.spawner.pending_exits.append(ExitNotice(info["id"], "killed", "late",
                                                   info["pid"]))
    time.sleep(0.6)
    assert ctl.get_sandbox(info["id"])["status"] == "running"
    served.spawner.pending_exits.append(ExitNotice(info["id"], "crashed", "now",
                                                   resumed["pid"]))
    _wait_for(lambda: ctl.get_sandbox(info["id"])["status"] == "exited")


def test_resume_of_a_running_sandbox_is_a_no_op_and_of_an_exited_one_409(
        served: Served, ctl: Controller) -> None:
    [info] = ctl.spawn_sandboxes("base")
    assert ctl.resume_sandbox(info["id"])["status"] == "running"
    assert served.spawner.spawned_from == ["base"]
    served.spawner.live.discard(info["id"])
    from vmfork.server.spawner import ExitNotice
    served.spawner.pending_exits.append(ExitNotice(info["id"], "crashed", "boom"))
    _wait_for(lambda: ctl.get_sandbox(info["id"])["status"] == "exited")
    for call in (ctl.resume_sandbox, ctl.pause_sandbox):
        with pytest.raises(ControllerError) as err:
            call(info["id"])
        assert err.value.status == 409


# -- metadata -----------------------------------------------------------------------------


def test_metadata_is_stored_returned_and_filtered(ctl: Controller) -> None:
    a = ctl.spawn_sandboxes("base", metadata={"team": "red", "env": "dev"})[0]["id"]
    b = ctl.spawn_sandboxes("base", metadata={"team": "red", "env": "prod"})[0]["id"]
    c = ctl.spawn_sandboxes("base", metadata={"team": "blue=x&y"})[0]["id"]
    assert ctl.get_sandbox(a)["metadata"] == {"team": "red", "env": "dev"}
    ids = lambda **q: [s["id"] for s in ctl.list_sandboxes(**q)]  # noqa: E731
    assert ids(metadata={"team": "red"}) == [a, b]
    assert ids(metadata={"team": "red", "env": "prod"}) == [b]
    assert ids(metadata={"team": "blue=x&y"}) == [c]
    assert ids(metadata={"team": "green"}) == []
    assert ids(metadata={"team": "red"}, state="paused") == []
    assert Sandbox.list(metadata={"env": "dev"}, controller=ctl)[0]["id"] == a


def test_bad_metadata_envs_and_filters_are_400_naming_the_problem(served: Served,
                                                                  ctl: Controller) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"metadata": {"k": 1}}, "value of 'k' must be a string"),
        ({"metadata": {"": "v"}}, "key '' must be 1-128"),
        ({"metadata": {"k" * 129: "v"}}, "must be 1-128"),
        ({"metadata": {"k": "v" * 1025}}, "at most 1024"),
        ({"metadata": {f"k{i}": "v" for i in range(65)}}, "has 65 entries; at most 64"),
        ({"metadata": ["k"]}, "'metadata' must be an object"),
        ({"envs": {"1X": "v"}}, "invalid variable name '1X'"),
        ({"envs": {"A=B": "v"}}, "invalid variable name"),
        ({"envs": {"A": None}}, "value of 'A' must be a string"),
        ({"envs": {"A": "x" * (65 << 10)}}, "the limit is 65536"),
        ({"envs": {f"V{i}": "" for i in range(257)}}, "at most 256"),
        ({"timeout_secs": 0}, "'timeout_secs' must be between 1"),
        ({"on_timeout": "sleep"}, "'on_timeout' must be one of kill, pause"),
    ]
    for extra, text in cases:
        status, reply, _ = served.request("POST", "/v1/sandboxes",
                                          {"snapshot_tag": "base", **extra})
        assert status == 400 and text in reply["error"], (extra, reply)
    for query, text in (("state=sleeping", "state must be"),
                        ("metadata=" + urllib.parse.quote("novalue"), "metadata must be"),
                        ("metadata=" + urllib.parse.quote("a=1&a=2"), "gives 'a' twice"),
                        ("bogus=1", "unknown query parameter 'bogus'")):
        status, reply, _ = served.request("GET", f"/v1/sandboxes?{query}")
        assert status == 400 and text in reply["error"], (query, reply)
    assert ctl.list_sandboxes() == []   # nothing half-made


# -- envs and metrics, with a real agent server ---------------------------------------------


class MeasuredSpawner(AgentBackedSpawner):
    """Its sandboxes' "VMM" is this test process, so the host-side numbers are real."""

    def spawn(self, *args: Any, **kwargs: Any) -> Any:
        outcome = super().spawn(*args, **kwargs)
        from vmfork.server.spawner import Spawned
        outcome.children[:] = [Spawned(c.vm_id, os.getpid(), c.run_dir)
                               for c in outcome.children]
        return outcome


@pytest.fixture
def agent_served(tmp_path: Path) -> Iterator[Served]:
    with running_agent() as agent:
        yield from _serve(tmp_path, TOKEN, spawner=MeasuredSpawner(agent))


def test_envs_reach_exec_background_processes_and_ptys(agent_served: Served) -> None:
    _fake_snapshot(agent_served.store, SnapshotCreate(tag="base"))
    ctl = Controller(agent_served.url, token=TOKEN.decode(), timeout=30)
    sandbox = Sandbox.create("base", controller=ctl, envs={"SB_A": "one", "SB_B": "two"})
    assert sandbox.info["env_names"] == ["SB_A", "SB_B"]
    assert "'one'" not in str(sandbox.info)   # values are not shown
    result = sandbox.commands.run("echo $SB_A $SB_B", envs={"SB_B": "mine"})
    assert result.stdout == "one mine\n"
    assert ctl.exec_command(sandbox.id, ["sh", "-c", "echo $SB_A"])["stdout"] == "one\n"
    proc = sandbox.commands.start("echo $SB_A-$SB_B")
    assert proc.wait().stdout == "one-two\n"
    term = sandbox.pty.create(24, 80, cmd=["sh", "-c", "echo pty:$SB_A"])
    assert "pty:one" in term.wait().stdout
    # Unset by a command (null), as a command's own env allows.
    assert ctl.exec_command(sandbox.id, ["sh", "-c", "echo ${SB_A-unset}"],
                            env={"SB_A": None})["stdout"] == "unset\n"


def test_metrics_are_measured(agent_served: Served) -> None:
    _fake_snapshot(agent_served.store, SnapshotCreate(tag="base"))
    ctl = Controller(agent_served.url, token=TOKEN.decode(), timeout=30)
    sandbox = Sandbox.create("base", controller=ctl)
    first = sandbox.get_metrics()
    assert first["memory_rss_bytes"] > 1 << 20 and first["cpu_seconds"] > 0
    assert first["disk_total_bytes"] > first["disk_used_bytes"] > 0
    assert first["guest_mem_mib"] == 64
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass   # burn CPU in "the VMM"
    second = sandbox.get_metrics()
    assert second["cpu_seconds"] >= first["cpu_seconds"] + 0.2
    assert second["timestamp_unix"] > first["timestamp_unix"]
    sandbox.pause()
    with pytest.raises(ControllerError) as err:
        sandbox.get_metrics()
    assert err.value.status == 409


# -- the registry's migration ------------------------------------------------------------


def test_a_version_4_registry_is_migrated_keeping_its_sandboxes(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version VALUES (4);
        CREATE TABLE sandboxes (id TEXT PRIMARY KEY, snapshot_tag TEXT NOT NULL,
            pid INTEGER NOT NULL, run_dir TEXT NOT NULL, status TEXT NOT NULL,
            created_at REAL NOT NULL, memory_limit_mib INTEGER,
            branch_count INTEGER NOT NULL DEFAULT 0, last_branch_memory_path TEXT,
            exit_reason TEXT, exit_description TEXT, ended_at REAL);
        INSERT INTO sandboxes (id, snapshot_tag, pid, run_dir, status, created_at)
            VALUES ('vm-000000000001', 'base', 7, '/run/x', 'running', 1.0);
    """)
    db.commit()
    db.close()
    registry = Registry(path)
    assert registry.schema_version() == SCHEMA_VERSION == 6
    record = registry.get_sandbox("vm-000000000001")
    assert record is not None and record.pid == 7
    assert (record.end_at, record.on_timeout, record.metadata, record.envs,
            record.volumes) == (None, "kill", {}, {}, [])
    registry.close()
