"""``vmfork mcp`` over stdio (the MCP SDK's own client) against a real ``vmfork
serve`` on routes that spawn nothing: the tool list and its schemas, the
daemon's reasons as tool errors, argument validation, auth pass-through, the
image tools (the daemon's image cache is its own and empty: builds are refused
for want of a kernel, a record written into it is listed and deleted).
Sandboxes themselves are exercised in tests/e2e/test_mcp.py."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from mcp import Client

from tests.mcp_support import (
    SRC,
    McpSession,
    RunningDaemon,
    ToolFailed,
    mcp_session,
    running_daemon,
)
from vmfork.image import GuestImage, initrd_path, kernel_path, write_record

TOKEN = "mcp-test-token-0123456789"
FORKD_TOOLS = {"list_snapshots", "spawn_sandboxes", "branch_sandbox", "create_snapshot",
               "wait_for_text", "list_sandboxes", "get_sandbox", "kill_sandbox",
               "exec_command", "eval_code", "ping_sandbox"}
VMFORK_TOOLS = {"read_file", "write_file", "list_files", "snapshot_info", "compact_snapshot",
                "build_image", "list_images", "get_image", "delete_image", "start_process",
                "list_processes", "read_process_output", "send_process_input", "kill_process",
                "push_snapshot", "pull_snapshot", "transfer_status",
                "set_sandbox_timeout", "pause_sandbox", "resume_sandbox", "sandbox_metrics"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    root = tmp_path_factory.mktemp("mcp")
    with running_daemon(root, token=TOKEN, env={"VMFORK_CACHE_DIR": str(root / "cache")}) as d:
        yield d


def test_tools_schemas_and_errors(daemon: RunningDaemon) -> None:
    async def session() -> None:
        async with mcp_session(daemon.url, token=TOKEN) as mcp:
            listed = (await mcp.client.list_tools()).tools
            tools = {t.name: t for t in listed}
            assert set(tools) == FORKD_TOOLS | VMFORK_TOOLS
            for tool in listed:
                assert tool.description and len(tool.description) > 40, tool.name
            # forkd-mcp's parameter names, unchanged.
            params = {name: set(t.input_schema["properties"]) for name, t in tools.items()}
            assert {"snapshot_tag", "n", "per_child_netns", "memory_limit_mib", "prewarm",
                    "live_fork"} <= params["spawn_sandboxes"]
            assert {"sandbox_id", "tag", "diff", "measure_diff", "mode",
                    "wait"} <= params["branch_sandbox"]
            assert {"tag", "kernel", "rootfs", "rw", "tap",
                    "boot_wait_secs"} <= params["create_snapshot"]
            assert {"sandbox_id", "path", "marker", "timeout_secs",
                    "poll_interval_ms"} <= params["wait_for_text"]
            assert {"sandbox_id", "args", "timeout_secs"} <= params["exec_command"]
            assert tools["exec_command"].input_schema["required"] == ["sandbox_id", "args"]

            assert await mcp.call("list_snapshots") == []
            assert await mcp.call("list_sandboxes") == []
            assert await mcp.call("list_sandboxes", {"metadata": {"team": "red"},
                                                     "state": ["paused"]}) == []
            assert {"timeout_secs", "on_timeout", "metadata",
                    "envs"} <= params["spawn_sandboxes"]
            with pytest.raises(ToolFailed, match=r"HTTP 400.*invalid variable name '1X'"):
                await mcp.call("spawn_sandboxes", {"snapshot_tag": "absent",
                                                   "envs": {"1X": "v"}})
            for tool in ("pause_sandbox", "resume_sandbox", "sandbox_metrics"):
                with pytest.raises(ToolFailed, match=r"HTTP 404.*sb-nope"):
                    await mcp.call(tool, {"sandbox_id": "sb-nope"})
            with pytest.raises(ToolFailed, match=r"HTTP 404.*sb-nope"):
                await mcp.call("set_sandbox_timeout", {"sandbox_id": "sb-nope",
                                                       "timeout_secs": 60})

            # The daemon's reason reaches the model.
            with pytest.raises(ToolFailed, match=r"HTTP 404.*no snapshot tagged 'absent'"):
                await mcp.call("spawn_sandboxes", {"snapshot_tag": "absent"})
            with pytest.raises(ToolFailed, match=r"HTTP 404.*sb-nope"):
                await mcp.call("exec_command", {"sandbox_id": "sb-nope", "args": ["true"]})
            with pytest.raises(ToolFailed, match=r"HTTP 404.*sb-nope"):
                await mcp.call("read_file", {"sandbox_id": "sb-nope", "path": "/etc/hostname"})
            with pytest.raises(ToolFailed, match=r"HTTP 404"):
                await mcp.call("snapshot_info", {"tag": "absent"})
            with pytest.raises(ToolFailed, match=r"HTTP 404.*absent"):
                await mcp.call("compact_snapshot", {"tag": "absent", "to": "flat"})
            with pytest.raises(ToolFailed, match=r"HTTP 400.*live_fork"):
                await mcp.call("spawn_sandboxes", {"snapshot_tag": "absent",
                                                   "live_fork": True})

            # Arguments are checked against the schema before anything is sent.
            with pytest.raises(ToolFailed, match="sandbox_id"):
                await mcp.call("get_sandbox", {"sandbox_id": "../../etc"})
            with pytest.raises(ToolFailed, match="path"):
                await mcp.call("list_files", {"sandbox_id": "sb-x", "path": "relative/dir"})
            with pytest.raises(ToolFailed, match="args"):
                await mcp.call("exec_command", {"sandbox_id": "sb-x", "args": []})
            with pytest.raises(ToolFailed, match="n"):
                await mcp.call("spawn_sandboxes", {"snapshot_tag": "t", "n": 1001})
            with pytest.raises(ToolFailed, match="mode"):
                await mcp.call("write_file", {"sandbox_id": "sb-x", "path": "/tmp/x",
                                              "content": "", "mode": "999"})
            with pytest.raises(ToolFailed, match="base64"):
                await mcp.call("write_file", {"sandbox_id": "sb-x", "path": "/tmp/x",
                                              "content": "not base64!", "encoding": "base64"})
            with pytest.raises(ToolFailed, match="host tap"):
                await mcp.call("create_snapshot", {"tag": "t", "kernel": "/boot/vmlinuz",
                                                   "rootfs": "/rootfs.ext4", "tap": "tap0"})

    asyncio.run(session())


def test_image_tools(daemon: RunningDaemon, tmp_path: Path) -> None:
    payload = tmp_path / "payload"
    payload.write_text("x")
    cache = daemon.root / "cache"
    write_record(GuestImage(
        name="recorded", kernel=kernel_path("a" * 24, cache), initrd=initrd_path("b" * 24, cache),
        kernel_key="a" * 24, initramfs_key="b" * 24, cmdline="rdinit=/init",
        created=datetime.now(UTC).replace(microsecond=0), kernel_size=1, initrd_size=2), cache)

    async def session() -> None:
        async with mcp_session(daemon.url, token=TOKEN) as mcp:
            tools = {t.name: t for t in (await mcp.client.list_tools()).tools}
            assert {"name", "base", "apt", "pip", "requirements", "npm", "copy", "env",
                    "workdir", "user", "run", "egress", "wait"} == set(
                        tools["build_image"].input_schema["properties"])
            assert tools["build_image"].input_schema["required"] == ["name"]

            listed = await mcp.call("list_images")
            assert [(i["name"], i["status"], i["root"]) for i in listed] == [
                ("recorded", "ready", "initramfs")]
            assert (await mcp.call("get_image", {"name": "recorded"}))["size"] == 3

            with pytest.raises(ToolFailed, match=r"HTTP 409.*guest kernel is not built"):
                await mcp.call("build_image", {"name": "mine", "apt": ["curl"],
                                               "copy": [f"{payload}:/opt/payload"],
                                               "env": {"A": "b"}, "wait": False})
            with pytest.raises(ToolFailed, match=r"HTTP 400.*env: '1A' is not a variable"):
                await mcp.call("build_image", {"name": "mine", "env": {"1A": "b"}})
            with pytest.raises(ToolFailed, match=r"HTTP 404.*field 'from'"):
                await mcp.call("build_image", {"name": "mine", "base": "absent",
                                               "env": {"A": "b"}})
            with pytest.raises(ToolFailed, match="not SRC:DST"):
                await mcp.call("build_image", {"name": "mine", "copy": ["no-destination"]})
            with pytest.raises(ToolFailed, match="name"):
                await mcp.call("build_image", {"name": "../escape"})
            with pytest.raises(ToolFailed, match=r"HTTP 404.*no image 'absent'"):
                await mcp.call("get_image", {"name": "absent"})

            assert await mcp.call("delete_image", {"name": "recorded"}) == {
                "name": "recorded", "deleted": True}
            with pytest.raises(ToolFailed, match=r"HTTP 404"):
                await mcp.call("delete_image", {"name": "recorded"})
            assert await mcp.call("list_images") == []

    asyncio.run(session())


def test_a_wrong_token_is_a_tool_error_not_a_crash(daemon: RunningDaemon) -> None:
    async def session() -> None:
        async with mcp_session(daemon.url, token="wrong-token-0123456789") as mcp:
            with pytest.raises(ToolFailed, match="HTTP 401.*invalid bearer token"):
                await mcp.call("list_sandboxes")

    asyncio.run(session())


def test_an_unreachable_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    async def session() -> None:
        async with mcp_session(f"unix://{tmp_path}/absent.sock") as mcp:
            with pytest.raises(ToolFailed, match="unreachable.*vmfork serve"):
                await mcp.call("list_snapshots")

    asyncio.run(session())


def test_streamable_http_transport(daemon: RunningDaemon) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, VMFORK_URL=daemon.url, VMFORK_TOKEN=TOKEN,
               PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "vmfork", "mcp", "--http",
                             f"127.0.0.1:{port}"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                assert proc.stderr is not None
                raise AssertionError("vmfork mcp --http did not listen:\n"
                                     + proc.stderr.read().decode()) from None
            time.sleep(0.2)

    async def session() -> None:
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            mcp = McpSession(client)
            assert {t.name for t in (await client.list_tools()).tools} == FORKD_TOOLS | VMFORK_TOOLS
            assert await mcp.call("list_snapshots") == []
            with pytest.raises(ToolFailed, match="HTTP 404"):
                await mcp.call("get_sandbox", {"sandbox_id": "sb-none"})

    try:
        asyncio.run(session())
    finally:
        proc.terminate()
        proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()
