"""Per-sandbox networks through ``vmfork serve`` with real VMs (issue 7 items 2-3).

A daemon with its own network prefix makes a networked snapshot over REST (the
parent serves HTTP on one guest port from its warm-up), spawns two networked
sandboxes from it, each answering on the same guest port with its own identity;
one is published on a host port and fetched through 127.0.0.1, the other is
reached at its own address; a taken host port is refused (409). Killing the
sandboxes and stopping the daemon leaves no namespace, link or table behind.
A daemon SIGKILLed and started again re-adopts a networked sandbox with its
namespace and published port, which still reaches the guest.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_daemon import Home, _alive, _until_gone
from vmfork.client import ControllerError, Sandbox
from vmfork.runtime import network

pytestmark = pytest.mark.e2e

PREFIX = "vmfe"
GUEST_PORT = 8080

WARM = f"""
import http.server, threading
IDENT = 'parent'
class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = IDENT.encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
_server = http.server.ThreadingHTTPServer(('0.0.0.0', {GUEST_PORT}), _Handler)
threading.Thread(target=_server.serve_forever, daemon=True).start()
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    logs = tmp_path_factory.mktemp("daemon-net")
    root = Path(tempfile.mkdtemp(prefix="vmfork-e2e-netd-"))
    env = dict(os.environ, VMFORK_HOME=str(root / "home"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    yield Home(root, logs, env)
    network.cleanup_stale(PREFIX)  # whatever a failed test left
    shutil.rmtree(root, ignore_errors=True)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return str(r.read().decode())


@pytest.fixture(scope="module")
def snapshot(home: Home) -> str:
    d = home.start("maker", "--kill-sandboxes-on-exit", "--network-prefix", PREFIX)
    try:
        info = d.ctl.create_snapshot("netwarm", mem_mib=256, warm_code=WARM, network=True,
                                     timeout=1800)
        assert info["status"] == "ready" and info["network"] is True
    finally:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(120)
    return "netwarm"


def test_networked_sandboxes_through_the_daemon(home: Home, snapshot: str) -> None:
    d = home.start("net", "--kill-sandboxes-on-exit", "--network-prefix", PREFIX)
    ctl = d.ctl
    try:
        with pytest.raises(ControllerError) as refused:
            ctl.spawn_sandboxes(snapshot, per_child_netns=False, egress="deny")
        assert refused.value.status == 400

        a, b = ctl.spawn_sandboxes(snapshot, 2, per_child_netns=True)
        assert a["netns"] != b["netns"] and a["guest_addr"] != b["guest_addr"]
        for s in (a, b):
            ctl.eval_code(s["id"], f"IDENT = {s['id']!r}")
        # Both guests serve the same guest port; each is its own machine.
        assert _get(f"http://{b['guest_addr']}:{GUEST_PORT}/") == b["id"]
        sandbox = Sandbox.connect(a["id"], controller=ctl)
        port = sandbox.expose(GUEST_PORT)
        assert _get(f"http://127.0.0.1:{port}/") == a["id"]
        with pytest.raises(ControllerError) as taken:
            ctl.expose_port(b["id"], GUEST_PORT, host_port=port)
        assert taken.value.status == 409
        assert sandbox.ports() == [{"protocol": "tcp", "host_port": port,
                                    "guest_port": GUEST_PORT}]
        assert sorted(network.leftovers(PREFIX).namespaces) == sorted([a["netns"], b["netns"]])

        pids = [a["pid"], b["pid"]]
        for s in (a, b):
            ctl.kill_sandbox(s["id"])
        _until_gone(pids, 30)
        # The daemon lets a sandbox's network go when it sees the exit, on its own
        # thread, which may be just after the processes are gone.
        deadline = time.monotonic() + 30
        found = network.leftovers(PREFIX)
        while (found.namespaces or found.links) and time.monotonic() < deadline:
            time.sleep(0.1)
            found = network.leftovers(PREFIX)
        assert found.namespaces == [] and found.links == [], found
        with pytest.raises(OSError):
            _get(f"http://127.0.0.1:{port}/")
    finally:
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(120) == 0
    assert network.leftovers(PREFIX).empty, "the daemon removed its host table on exit"
    assert not any(_alive(p) for p in pids)


def test_restarted_daemon_keeps_a_sandboxs_network(home: Home, snapshot: str) -> None:
    # A long lease: the sandbox must outlive the SIGKILLed daemon until the next one.
    d = home.start("restart", "--zygote-lease", "900", "--network-prefix", PREFIX)
    (s,) = d.ctl.spawn_sandboxes(snapshot, per_child_netns=True, egress="deny")
    d.ctl.eval_code(s["id"], f"IDENT = {s['id']!r}")
    port = d.ctl.expose_port(s["id"], GUEST_PORT)["host_port"]
    assert _get(f"http://127.0.0.1:{port}/") == s["id"]
    d.proc.kill()
    d.proc.wait(60)

    again = home.start("restart", "--kill-sandboxes-on-exit", "--network-prefix", PREFIX)
    try:
        info = again.ctl.get_sandbox(s["id"])
        assert info["status"] == "running" and info["netns"] == s["netns"]
        assert info["network"]["egress"] == "deny"
        assert _get(f"http://127.0.0.1:{port}/") == s["id"], "the port is published again"
        assert network.leftovers(PREFIX).namespaces == [s["netns"]]
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(120) == 0
    _until_gone([s["pid"]], 30)
    assert network.leftovers(PREFIX).empty
