"""E2B's wire on the daemon: the real E2B SDK (its own venv) drives a real daemon on
TCP, whose sandboxes have a real agent server behind them (on this host: only the VM
is left out; tests/e2e/test_e2b_sdk.py runs the same program against real guests).
Plus the protocol's edges with raw HTTP: tokens, Connect errors, chunked bodies."""

from __future__ import annotations

import http.client
import json
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2b_sdk import e2b_env, run_program, sdk_python
from tests.unit.agent_support import running_agent
from tests.unit.test_server_http import TOKEN, _fake_snapshot
from tests.unit.test_server_processes import AgentBackedSpawner
from vmfork.server.audit import AuditLog
from vmfork.server.controller import Controller as Ctl
from vmfork.server.controller import Limits
from vmfork.server.http import ServerContext, handler_for, tcp_server
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.registry import Registry
from vmfork.store import Store


@dataclass
class Daemon:
    url: str
    port: int
    ctl: Ctl


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with running_agent() as agent:
        store = Store.open(tmp_path / "home")
        registry = Registry(tmp_path / "registry.db")
        ctl = Ctl(store, registry, AgentBackedSpawner(agent), DaemonMetrics("test"),
                  make_snapshot=_fake_snapshot, limits=Limits(heavy_concurrency=4))
        ctl.start()
        server = tcp_server("127.0.0.1:0", handler_for(
            ServerContext(ctl, TOKEN, AuditLog(tmp_path / "audit.log"))))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        _fake_snapshot(store, {"tag": "base", "warm_cmd": None})
        port = server.server_address[1]
        try:
            yield Daemon(f"http://127.0.0.1:{port}", port, ctl)
        finally:
            server.shutdown()
            server.server_close()
            ctl.stop()
            registry.close()


def test_the_e2b_sdk_tour(daemon: Daemon) -> None:
    python = sdk_python()
    if python is None:
        pytest.skip("the E2B SDK venv is not set up (scripts/setup.sh makes it)")
    work = tempfile.mkdtemp(prefix="e2b-tour-")
    seen = run_program(python, "tour", ["base", work], e2b_env(daemon.url, TOKEN.decode()))
    assert seen["run"]["stdout"] == "hello\nhi-env" and seen["run"]["stderr"] == "oops\n"
    assert seen["run"]["exit_code"] == 0 and "".join(seen["run"]["chunks"]) == "hello\nhi-env"
    assert seen["pwd"] == work + "\n"
    assert seen["exit3"] == 3
    assert seen["listed_cat"] is True and seen["killed"] is True
    assert seen["cat_end"]["stdout"] == "from stdin\n"
    assert seen["reconnected"] == "woke\n"
    assert seen["read"] == "alpha" and bytes(seen["read_bytes"]) == b"alpha"
    assert seen["exists"] == [True, False]
    assert seen["made"] == [True, False]
    assert seen["renamed"] == f"{work}/sub/b.txt"
    assert seen["list"] == [["b.txt", False], ["deeper", True]]
    assert seen["info_size"] == 5 and seen["removed"] is True and seen["big"] is True
    assert ["watched.txt", "CREATE"] in seen["watch"] or ["watched.txt", "WRITE"] in seen["watch"]
    assert "30 100" in seen["pty"]
    assert seen["listed"] is True and seen["running"] is True
    assert seen["connected_run"] == "again\n"
    assert seen["kill"] is True and seen["listed_after_kill"] is False
