"""The daemon-backed CLI verbs against a real daemon (HTTP server, controller, store,
registry) whose spawner is the fake one of ``test_server_http`` (no KVM)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server_http import Served, _serve

from vmfork.cli import main
from vmfork.server.requests import SnapshotCreate


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from _serve(tmp_path, None)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_sandbox_verbs_compose(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--url", served.url)
    served.controller.create_snapshot(SnapshotCreate(tag="base", mem_mib=64))
    status, out, _ = run(capsys, "spawn", "--tag", "base", "-n", "2", *url)
    ids = out.split()
    assert status == 0 and len(ids) == 2 and all(i.startswith("vm-") for i in ids)
    status, out, _ = run(capsys, "ls", "--json", *url)
    assert [s["id"] for s in json.loads(out)] == ids
    status, out, _ = run(capsys, "ls", *url)
    assert out.splitlines()[0].split()[:3] == ["ID", "SNAPSHOT", "PID"] and ids[0] in out
    # exec streams stdout and exits with the command's status (the fake exits 3).
    status, out, _ = run(capsys, "exec", *url, ids[0], "--", "echo", "hi")
    assert status == 3 and out == "chunk1 chunk2"
    status, out, _ = run(capsys, "exec", "--timeout", "1", *url, ids[0], "--", "sleep", "5")
    assert status == 124
    status, out, _ = run(capsys, "eval", ids[0], "6 * 7", *url)
    assert (status, out) == (0, "42\n")
    status, out, _ = run(capsys, "ping", ids[0], "--json", *url)
    assert status == 0 and json.loads(out)["pong"] is True
    status, out, _ = run(capsys, "branch", ids[0], "--tag", "b1", *url)
    assert status == 0 and "snapshot b1: branched from" in out
    status, out, _ = run(capsys, "snapshot", "--from-sandbox", ids[1], "--tag", "b2",
                         "--json", *url)
    assert status == 0 and json.loads(out)["branched_from"] == ids[1]
    status, out, _ = run(capsys, "images", "--json", *url)
    assert {s["tag"] for s in json.loads(out)} == {"base", "b1", "b2"}
    status, out, _ = run(capsys, "snapshot-info", "b1", "--json", *url)
    assert json.loads(out)["memory_logical_bytes"] == 8192
    status, out, _ = run(capsys, "rmi", "b1", "b2", *url)
    assert status == 0 and out.split() == ["deleted", "b1", "deleted", "b2"]
    status, out, _ = run(capsys, "kill", "--tag", "base", *url)
    assert status == 0 and sorted(out.split()[1::2]) == sorted(ids)
    status, out, _ = run(capsys, "ls", "--json", *url)
    assert json.loads(out) == []


def test_fork_through_a_running_daemon(served: Served,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    served.controller.create_snapshot(SnapshotCreate(tag="base", mem_mib=64))
    status, out, _ = run(capsys, "fork", "--tag", "base", "-n", "3", "--exec", "true",
                         "--url", served.url)
    assert status == 0 and out.startswith("forked 3 children of base")
    assert out.count(" exit 3 in ") == 3
    assert served.controller.list_sandboxes() == []   # torn down again
    status, out, _ = run(capsys, "fork", "--tag", "base", "-n", "2", "--keep",
                         "--url", served.url)
    assert status == 0 and len(served.controller.list_sandboxes()) == 2


def test_errors_name_what_to_fix(served: Served, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    nowhere = ("--url", f"unix://{tmp_path}/none.sock")
    for argv in (["ls", *nowhere], ["spawn", "--tag", "x", *nowhere],
                 ["exec", *nowhere, "vm-1", "--", "true"], ["images", *nowhere]):
        status, _, err = run(capsys, *argv)
        assert status == 1 and "no daemon at unix://" in err and "vmfork serve" in err, argv
    status, _, err = run(capsys, "spawn", "--tag", "missing", "--url", served.url)
    assert status == 1 and "no snapshot tagged 'missing'" in err
    status, _, err = run(capsys, "kill", "--url", served.url)
    assert status == 2 and "IDs, --all, or --tag" in err
    status, _, err = run(capsys, "exec", "--url", served.url, "vm-000000000001")
    assert status == 2 and "no command given" in err


def test_workspace_verbs(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--url", served.url)
    served.controller.create_snapshot(SnapshotCreate(tag="base", mem_mib=64))
    status, out, _ = run(capsys, "workspace", "create", "dev", "--tag", "base", *url)
    assert status == 0 and out.startswith("workspace dev: running (vm-")
    status, out, _ = run(capsys, "workspace", "suspend", "dev", *url)
    assert status == 0 and "suspended (ws-" in out
    status, out, _ = run(capsys, "workspace", "resume", "dev", "--json", *url)
    assert status == 0 and json.loads(out)["state"] == "running"
    status, out, _ = run(capsys, "workspace", "list", *url)
    assert out.splitlines()[1].split()[:2] == ["dev", "running"]
    status, out, _ = run(capsys, "workspace", "delete", "dev", *url)
    assert status == 0 and served.controller.list_workspaces() == []
    status, _, err = run(capsys, "workspace", "resume", "dev", *url)
    assert status == 1 and "no workspace 'dev'" in err


def test_lifecycle_verbs(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--url", served.url)
    served.controller.create_snapshot(SnapshotCreate(tag="base", mem_mib=64))
    status, out, _ = run(capsys, "spawn", "--tag", "base", "--timeout", "600",
                         "--on-timeout", "pause", "--metadata", "team=red",
                         "--env", "A=1", "--json", *url)
    [info] = json.loads(out)
    assert status == 0 and info["metadata"] == {"team": "red"} and info["env_names"] == ["A"]
    assert info["on_timeout"] == "pause" and info["end_at_unix"] is not None
    run(capsys, "spawn", "--tag", "base", "--metadata", "team=blue", *url)
    status, out, _ = run(capsys, "ls", "--metadata", "team=red", "--json", *url)
    assert [s["id"] for s in json.loads(out)] == [info["id"]]
    status, out, _ = run(capsys, "set-timeout", info["id"], "none", *url)
    assert (status, out) == (0, f"{info['id']}: running\n")
    status, out, _ = run(capsys, "pause", info["id"], *url)
    assert (status, out) == (0, f"{info['id']}: paused\n")
    status, out, _ = run(capsys, "ls", "--state", "paused", "--json", *url)
    assert [s["id"] for s in json.loads(out)] == [info["id"]]
    status, out, _ = run(capsys, "resume", info["id"], "--timeout", "60", *url)
    assert status == 0 and out.startswith(f"{info['id']}: running, ends ")
    status, out, _ = run(capsys, "metrics", info["id"], "--json", *url)
    assert status == 0 and json.loads(out)["sandbox_id"] == info["id"]
    status, _, err = run(capsys, "set-timeout", info["id"], "soon", *url)
    assert status != 0 and "give a number of seconds or none" in err
    status, _, err = run(capsys, "spawn", "--tag", "base", "--metadata", "novalue", *url)
    assert status != 0 and "expected KEY=VALUE" in err
