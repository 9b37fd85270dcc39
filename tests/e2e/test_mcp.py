"""``vmfork mcp`` with real sandboxes: an MCP client session over stdio (the MCP
SDK's own client) spawns, drives, branches and kills sandboxes of a real
daemon. One daemon, one snapshot, one session: each costs seconds in the
emulated test host (the MCP SDK alone takes a while to import there)."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Iterator

import pytest

from tests.mcp_support import RunningDaemon, ToolFailed, mcp_session, running_daemon

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with running_daemon(tmp_path_factory.mktemp("mcp-e2e")) as d:
        info = d.controller.create_snapshot("mcp-warm", mem_mib=256, warm_code="answer = 41")
        assert info["status"] == "ready"
        yield d
        for sandbox in d.controller.list_sandboxes():
            d.controller.kill_sandbox(sandbox["id"])


def test_mcp_session_spawns_drives_branches_and_kills(daemon: RunningDaemon) -> None:
    async def session() -> None:
        async with mcp_session(daemon.url) as mcp:
            snapshots = await mcp.call("list_snapshots")
            assert [s["tag"] for s in snapshots] == ["mcp-warm"]
            details = await mcp.call("snapshot_info", {"tag": "mcp-warm"})
            assert details["memory_logical_bytes"] > 0

            spawned = await mcp.call("spawn_sandboxes", {"snapshot_tag": "mcp-warm", "n": 2})
            ids = [s["id"] for s in spawned]
            assert len(ids) == 2
            listed = {s["id"] for s in await mcp.call("list_sandboxes")}
            assert set(ids) <= listed
            first, second = ids
            assert (await mcp.call("get_sandbox", {"sandbox_id": first}))["status"] == "running"
            assert (await mcp.call("ping_sandbox", {"sandbox_id": first}))["pong"] is True

            r = await mcp.call("exec_command", {
                "sandbox_id": first, "args": ["/bin/sh", "-c", "echo out; echo err >&2; exit 3"]})
            assert (r["stdout"], r["stderr"], r["exit_code"]) == ("out\n", "err\n", 3)
            r = await mcp.call("exec_command", {"sandbox_id": first, "args": ["pwd"],
                                                "cwd": "/tmp", "env": {"X": "1"}})
            assert r["stdout"] == "/tmp\n"
            with pytest.raises(ToolFailed, match=r"HTTP 504(.|\n)*stdout so far:\nbefore"):
                await mcp.call("exec_command", {
                    "sandbox_id": first, "args": ["/bin/sh", "-c", "echo before; sleep 30"],
                    "timeout_secs": 1})

            assert (await mcp.call("eval_code", {"sandbox_id": first,
                                                 "code": "answer + 1"}))["result"] == "42"
            await mcp.call("eval_code", {"sandbox_id": first, "code": "answer = 0"})
            assert (await mcp.call("eval_code", {"sandbox_id": second,
                                                 "code": "answer"}))["result"] == "41"
            failed = await mcp.call("eval_code", {"sandbox_id": first, "code": "1/0"})
            assert "ZeroDivisionError" in (failed["error"] or "")

            # Files: text, binary (base64), listing, and a bounded read.
            written = await mcp.call("write_file", {"sandbox_id": first, "path": "/tmp/w/a.txt",
                                                    "content": "héllo\n", "make_parents": True,
                                                    "mode": "600"})
            assert written["size"] == len("héllo\n".encode())
            got = await mcp.call("read_file", {"sandbox_id": first, "path": "/tmp/w/a.txt"})
            assert (got["content"], got["encoding"], got["truncated"]) == ("héllo\n", "utf-8", False)
            blob = os.urandom(5000)
            await mcp.call("write_file", {"sandbox_id": first, "path": "/tmp/w/b.bin",
                                          "content": base64.b64encode(blob).decode(),
                                          "encoding": "base64"})
            got = await mcp.call("read_file", {"sandbox_id": first, "path": "/tmp/w/b.bin"})
            assert got["encoding"] == "base64" and base64.b64decode(got["content"]) == blob
            head = await mcp.call("read_file", {"sandbox_id": first, "path": "/tmp/w/b.bin",
                                                "max_bytes": 100})
            assert head["truncated"] is True and base64.b64decode(head["content"]) == blob[:100]
            entries = await mcp.call("list_files", {"sandbox_id": first, "path": "/tmp/w"})
            assert sorted(e["name"] for e in entries) == ["a.txt", "b.bin"]
            mode = await mcp.call("exec_command", {"sandbox_id": first,
                                                   "args": ["stat", "-c", "%a", "/tmp/w/a.txt"]})
            assert mode["stdout"].strip() == "600"

            # wait_for_text: a file that is not there yet, then one with the marker. The
            # path is an argument, never shell text.
            log_path = "/tmp/w/job.log; touch pwned-by-wait"
            waited = await mcp.call("wait_for_text", {
                "sandbox_id": first, "path": log_path, "marker": "READY",
                "timeout_secs": 1, "poll_interval_ms": 100})
            assert waited["found"] is False
            await mcp.call("write_file", {"sandbox_id": first, "path": log_path,
                                          "content": "starting\nREADY\n"})
            waited = await mcp.call("wait_for_text", {
                "sandbox_id": first, "path": log_path, "marker": "READY", "timeout_secs": 30})
            assert waited["found"] is True and "READY" in waited["last_excerpt"]
            # Had a shell seen the path, `touch` would have run in the agent's directory.
            listing = await mcp.call("exec_command", {"sandbox_id": first,
                                                      "args": ["/bin/sh", "-c", "ls -a . / /tmp"]})
            assert "pwned-by-wait" not in listing["stdout"]

            # branch: the second sandbox's state becomes a snapshot to spawn from.
            await mcp.call("eval_code", {"sandbox_id": second, "code": "answer = 7"})
            branched = await mcp.call("branch_sandbox", {"sandbox_id": second,
                                                         "tag": "mcp-branch", "mode": "full"})
            assert branched["tag"] == "mcp-branch" and branched["status"] == "ready"
            [child] = await mcp.call("spawn_sandboxes", {"snapshot_tag": "mcp-branch"})
            assert (await mcp.call("eval_code", {"sandbox_id": child["id"],
                                                 "code": "answer"}))["result"] == "7"
            with pytest.raises(ToolFailed, match="HTTP 409"):
                await mcp.call("branch_sandbox", {"sandbox_id": second, "tag": "mcp-branch"})
            flat = await mcp.call("compact_snapshot", {"tag": "mcp-branch", "to": "mcp-flat"})
            assert flat["tag"] == "mcp-flat" and flat["branched_from"] == "compact:mcp-branch"
            assert (await mcp.call("snapshot_info", {"tag": "mcp-flat"}))["chain_depth"] == 0
            [flat_child] = await mcp.call("spawn_sandboxes", {"snapshot_tag": "mcp-flat"})
            assert (await mcp.call("eval_code", {"sandbox_id": flat_child["id"],
                                                 "code": "answer"}))["result"] == "7"
            ids.append(flat_child["id"])

            for sandbox_id in [*ids, child["id"]]:
                assert await mcp.call("kill_sandbox", {"sandbox_id": sandbox_id}) == {
                    "id": sandbox_id, "killed": True}
            assert await mcp.call("list_sandboxes") == []
            with pytest.raises(ToolFailed, match="HTTP 404"):
                await mcp.call("ping_sandbox", {"sandbox_id": first})

    asyncio.run(session())
