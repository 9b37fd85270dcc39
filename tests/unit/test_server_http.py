"""The daemon's HTTP API without KVM: a real store, registry and HTTP server on a
Unix socket, with a fake spawner whose "sandboxes" answer like agents.

Covers routing (404/405), strict validation, path-traversal attempts, auth, the
OpenAPI contract (every route documented and vice versa), metrics and the audit
log (including reopen after rotation), and the sandbox routes end to end.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.unix_http import UnixHTTPConnection
from vmfork.agent.client import (
    AgentError,
    AgentTimeout,
    EvalResult,
    ExecResult,
    FileInfo,
    Listing,
    PingResult,
)
from vmfork.client import Controller, ControllerError, Sandbox
from vmfork.ondisk import layerfile
from vmfork.runtime.branch import BranchFailed, BranchResult
from vmfork.server import api, auth
from vmfork.server.audit import AuditLog
from vmfork.server.controller import Controller as Ctl
from vmfork.server.controller import Limits
from vmfork.server.errors import BadGateway
from vmfork.server.http import HttpFront, ServerContext
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.registry import Registry
from vmfork.server.requests import SnapshotCreate
from vmfork.server.spawner import ExitNotice, Spawned, SpawnOutcome
from vmfork.store import PendingSnapshot, Snapshot, SnapshotMeta, SnapshotTimings, Store
from vmfork.vmm.memory import GuestMemory

TOKEN = b"0123456789abcdef-secret"


class FakeAgent:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def ping(self) -> PingResult:
        return PingResult(pid=1, version="test", protocol=1, uptime=1.0, boot_id="b")

    def exec(self, argv: list[str], *, env: Any = None, cwd: Any = None, stdin: Any = None,
             timeout: float | None = None, on_stdout: Any = None,
             on_stderr: Any = None, capture: bool = True,
             max_output: int | None = None) -> ExecResult:
        if argv[0] == "sleep":
            raise AgentTimeout("timed out", op="exec", timeout=timeout, stdout=b"partial")
        if argv[0] == "missing":
            raise AgentError("not_found", "no such program: missing", op="exec")
        out = json.dumps({"argv": argv, "env": env, "cwd": cwd, "stdin": stdin}).encode()
        if on_stdout is not None:
            on_stdout(b"chunk1 ")
            on_stdout(b"chunk2")
        return ExecResult(stdout=out, stderr=b"err", exit_code=3, signal=None, pid=9,
                          duration=0.5)

    def eval(self, code: str, *, timeout: float | None = None) -> EvalResult:
        return EvalResult(value=repr(eval(code)), stdout="", stderr="", exception=None)

    def stat(self, path: str) -> FileInfo:
        if path not in self.files:
            raise AgentError("not_found", f"{path}: no such file", op="stat")
        # A /proc file says it has no bytes, whatever a read of it returns.
        size = 0 if path.startswith("/proc/") else len(self.files[path])
        info = FileInfo(name=path.rsplit("/", 1)[1], type="file", size=size,
                        mode=0o644, mtime=0.0, path=path)
        if path.endswith(".log"):
            self.files[path] += b" and more"   # a file the guest goes on writing
        return info

    def read_file_to(self, path: str, fileobj: Any, *, offset: int = 0,
                     length: int | None = None) -> int:
        data = self.files[path][offset:]
        data = data if length is None else data[:length]
        for i in range(0, len(data), 1000):
            fileobj.write(data[i:i + 1000])
        return len(data)

    def write_file(self, path: str, data: Any, *, mode: int = 0o644,
                   make_parents: bool = False) -> int:
        self.files[path] = b"".join(data)
        return len(self.files[path])

    def list_dir(self, path: str) -> list[FileInfo]:
        return [self.stat(p) for p in sorted(self.files)]

    def list_dir_bounded(self, path: str, max_entries: int | None = None) -> Listing:
        entries = self.list_dir(path)
        return Listing(entries[:max_entries], max_entries is not None
                       and len(entries) > max_entries)

    def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False) -> None:
        if path not in self.files and not missing_ok:
            raise AgentError("not_found", f"{path}: no such file", op="remove")
        self.files.pop(path, None)


class FakeSpawner:
    """Sandboxes that are names with agents that answer from memory. ``branch`` writes
    and publishes a snapshot as ``runtime.branch`` would (the real one is tested with
    real VMs in tests/kvm/test_branch_store.py and tests/e2e), or raises
    ``branch_failure`` when set."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.run_dirs: dict[str, str] = {}
        self.branch_requests: list[dict[str, Any]] = []
        self.branch_failure: Exception | None = None
        self.control_gate = threading.Event()
        self.control_gate.set()
        self.pending_exits: list[ExitNotice] = []
        self.files: dict[str, bytes] = {}
        self.count = 0
        self.spawned_from: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def spawn(self, snapshot: Snapshot, n: int, memory_limit_mib: int | None, *,
              vm_ids: list[str] | None = None, networks: Any = None) -> SpawnOutcome:
        self.gate.wait(10)
        self.spawned_from.append(snapshot.tag)
        children = []
        for index in range(n):
            self.count += 1
            vm_id = vm_ids[index] if vm_ids else f"vm-{self.count:012x}"
            assert vm_id not in self.live, "a live id spawned again"
            self.live.add(vm_id)
            self.run_dirs[vm_id] = f"/nonexistent/{vm_id}"
            children.append(Spawned(vm_id, 4000 + self.count, f"/nonexistent/{vm_id}"))
        return SpawnOutcome(children, [], 0.01, 0.02, 0.03)

    def kill(self, vm_id: str) -> None:
        self.live.discard(vm_id)

    def exits(self) -> list[ExitNotice]:
        out, self.pending_exits = self.pending_exits, []
        return out

    def agent(self, run_dir: str) -> Any:
        return FakeAgent(self.files)

    def revive(self) -> None:
        self.live.clear()

    def children(self) -> list[Spawned]:
        return [Spawned(v, 1, self.run_dirs[v]) for v in sorted(self.live)]

    def exit_descriptions(self) -> dict[str, str]:
        return {}

    def clean_run_dirs(self, keep: set[str]) -> list[str]:
        return []

    def branch(self, run_dir: str, store: Store, pending: PendingSnapshot, mode: str, *,
               parent_tag: str | None, sandbox_id: str,
               settle_free_pages: bool = False) -> BranchResult:
        self.control_gate.wait(10)
        self.branch_requests.append({"run_dir": run_dir, "mode": mode,
                                     "parent_tag": parent_tag, "sandbox_id": sandbox_id})
        if self.branch_failure is not None:
            Path(pending.state_path).write_bytes(b"half-written")  # must not survive
            raise self.branch_failure
        pending.state_path.write_bytes(b"branched-state")
        meta = SnapshotMeta(tag=pending.tag, image="default", mem_mib=64, vcpus=1,
                            timings=SnapshotTimings(pause_ms=4.0), branch_mode=mode,
                            branched_from=sandbox_id)
        if mode == "diff" and parent_tag is not None:
            # A link, published as runtime.branch publishes one: its changed pages (a
            # real layer file) over its parent's RAM.
            parent = store.get(parent_tag)
            ram = GuestMemory.anonymous(os.stat(parent.memory_path).st_size)
            ram.write(0, b"\1" * 4096)
            fd = os.open(pending.layer_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                layerfile.write_layer(fd, ram, [(0, 4096)])
            finally:
                os.close(fd)
            snap = pending.publish(meta, parent=parent)
        else:
            pending.memory_path.write_bytes(b"\1" * 8192)
            snap = pending.publish(meta)
        return BranchResult(snapshot=snap, mode=mode, pause_ms=4.0, total_ms=9.0,
                            memory_bytes=8192, dirty_pages=2 if mode == "diff" else None,
                            base_tag=snap.meta.parent_tag)

    def close(self, kill_sandboxes: bool = False) -> None:
        if kill_sandboxes:
            self.live.clear()


def _fake_snapshot(store: Store, request: SnapshotCreate) -> Snapshot:
    if request.warm_cmd == "fail":
        raise RuntimeError("warm-up failed on purpose")
    with store.begin(request.tag) as pending:
        pending.state_path.write_bytes(b"state")
        pending.memory_path.write_bytes(b"\0" * 4096)
        return pending.publish(SnapshotMeta(tag=request.tag, image="test", mem_mib=64, vcpus=1,
                                            timings=SnapshotTimings(pause_ms=1.5)))


@dataclass
class Served:
    url: str
    socket: Path
    spawner: FakeSpawner
    controller: Ctl
    audit_path: Path
    audit: AuditLog
    store: Store

    def request(self, method: str, path: str, body: Any = None, token: bytes | None = TOKEN,
                headers: dict[str, str] | None = None, raw: bytes | None = None
                ) -> tuple[int, Any, http.client.HTTPResponse]:
        conn = UnixHTTPConnection(str(self.socket), timeout=10)
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = "Bearer " + token.decode()
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=h)
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        ctype = resp.getheader("Content-Type") or ""
        decoded = json.loads(payload) if "json" in ctype and payload else payload
        return resp.status, decoded, resp


def _serve(tmp_path: Path, token: bytes | None, heavy: int = 4,
           spawner: FakeSpawner | None = None, **limits: Any) -> Iterator[Served]:
    store = Store.open(tmp_path / "home")
    registry = Registry(tmp_path / "registry.db")
    spawner = spawner or FakeSpawner()
    metrics = DaemonMetrics("test")
    ctl = Ctl(store, registry, spawner, metrics, make_snapshot=_fake_snapshot,
              limits=Limits(heavy_concurrency=heavy, retry_after_s=3, **limits))
    ctl.start()
    audit = AuditLog(tmp_path / "audit.log")
    front = HttpFront(ServerContext(ctl, token, audit))
    front.listen_unix(tmp_path / "api.sock")
    front.start()
    try:
        yield Served(f"unix://{tmp_path / 'api.sock'}", tmp_path / "api.sock", spawner, ctl,
                     tmp_path / "audit.log", audit, store)
    finally:
        front.stop()
        ctl.stop()
        registry.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from _serve(tmp_path, TOKEN)


@pytest.fixture
def ctl(served: Served) -> Controller:
    return Controller(served.url, token=TOKEN.decode(), timeout=10)


# -- service routes and auth ------------------------------------------------------------


def test_healthz_needs_no_token_and_version_does(served: Served) -> None:
    assert served.request("GET", "/healthz", token=None)[:2] == (200, {"ok": True})
    assert served.request("GET", "/healthz/", token=None)[0] == 200
    status, body, resp = served.request("GET", "/version", token=None)
    assert (status, body) == (401, {"error": auth.MISSING})
    assert resp.getheader("WWW-Authenticate", "").startswith("Bearer")
    assert served.request("GET", "/version", token=b"x" * 20)[:2] == (
        401, {"error": auth.INVALID})
    assert served.request("GET", "/version", token=None,
                          headers={"Authorization": "Basic abc"})[:2] == (
        401, {"error": auth.MISSING})
    status, body, _ = served.request("GET", "/version")
    assert status == 200 and body["api"] == "v1" and body["version"]


def test_unknown_route_and_wrong_method(served: Served) -> None:
    status, body, _ = served.request("GET", "/v2/nothing")
    assert status == 404 and "no route" in body["error"]
    status, body, resp = served.request("PUT", "/v1/sandboxes")
    assert status == 405 and resp.getheader("Allow") == "GET, POST"


@pytest.mark.parametrize("path", [
    "/v1/snapshots/..%2F..%2Fetc/info", "/v1/snapshots/%2e%2e/info",
    "/v1/snapshots/a.b/info", "/v1/sandboxes/..%2Fx", "/v1/sandboxes/%00",
    "/v1/sandboxes/" + "a" * 65, "/v1/snapshots/%ff/info", "/v1/workspaces/..%2F..",
    "/v1/workspaces/%2e%2e/resume", "/v1/sandboxes/..%2F../branch",
    "/v1/snapshots/" + "..%2F" * 3 + "etc"])
def test_path_traversal_is_refused_before_lookup(served: Served, path: str) -> None:
    method = ("POST" if path.endswith(("/resume", "/branch")) else
              "DELETE" if path.startswith("/v1/snapshots/") and path.count("/") == 3 else "GET")
    status, body, _ = served.request(method, path)
    assert status == 400, body
    assert "invalid" in body["error"] or "UTF-8" in body["error"]


def test_body_validation_names_the_field(served: Served) -> None:
    cases = [
        ({"snapshot_tag": "x", "nn": 1}, "unknown field 'nn'"),
        ({"snapshot_tag": "x", "n": 0}, "'n' must be between 1 and 1000"),
        ({"snapshot_tag": "x", "n": 1001}, "'n' must be between 1 and 1000"),
        ({"snapshot_tag": "x", "n": True}, "'n' must be an integer"),
        ({"snapshot_tag": "../x"}, "'snapshot_tag' is not a valid tag"),
        ({}, "missing required field 'snapshot_tag'"),
    ]
    for body, expected in cases:
        status, reply, _ = served.request("POST", "/v1/sandboxes", body)
        assert status == 400 and expected in reply["error"], (body, reply)
    status, reply, _ = served.request("POST", "/v1/sandboxes", raw=b"[1,2]")
    assert status == 400 and "JSON object" in reply["error"]
    status, reply, _ = served.request("POST", "/v1/sandboxes", raw=b"{nope")
    assert status == 400 and "not valid JSON" in reply["error"]
    status, reply, _ = served.request("GET", "/v1/sandboxes?x=1")
    assert status == 400 and "unknown query parameter 'x'" in reply["error"]


def test_openapi_documents_exactly_the_routes(served: Served) -> None:
    status, doc, _ = served.request("GET", "/openapi.json")
    assert status == 200
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    served_routes = {(r.method, r.template) for r in api.ROUTES}
    assert documented == served_routes
    for schema_name, spec in (("SandboxCreate", api.SANDBOX_CREATE), ("ExecRequest", api.EXEC),
                              ("EvalRequest", api.EVAL),
                              ("SnapshotCreate", api.SNAPSHOT_CREATE),
                              ("BranchRequest", api.BRANCH),
                              ("ImageBuild", api.IMAGE_BUILD),
                              ("ImageImport", api.IMAGE_IMPORT)):
        assert set(doc["components"]["schemas"][schema_name]["properties"]) == set(spec)


# -- snapshots ------------------------------------------------------------------------


def test_snapshot_create_list_info_delete(served: Served, ctl: Controller) -> None:
    info = ctl.create_snapshot("base", warm_code="import json")
    assert info["tag"] == "base" and info["status"] == "ready" and info["bootable"] is True
    assert info["pause_ms"] == 1.5
    with pytest.raises(ControllerError) as exc:
        ctl.create_snapshot("base")
    assert exc.value.status == 400 and "already exists" in exc.value.message
    with pytest.raises(ControllerError) as exc:
        ctl.create_snapshot("bad", warm_cmd="fail")
    assert exc.value.status == 502
    listed = {s["tag"]: s for s in ctl.list_snapshots()}
    assert listed["base"]["bootable"] and listed["bad"]["status"] == "failed"
    assert not listed["bad"]["bootable"] and "on purpose" in listed["bad"]["error"]
    details = ctl.snapshot_info("base")
    assert details["memory_logical_bytes"] == 4096 and details["vmstate_bytes"] == 5
    assert details["chain_depth"] == 0 and details["dependents"] == []
    status, body, _ = served.request("DELETE", "/v1/snapshots/base?cascade=true&force=true")
    assert status == 400 and "not both" in body["error"]
    status, body, _ = served.request("DELETE", "/v1/snapshots/base?cascade=maybe")
    assert status == 400
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("bad")
    assert exc.value.status == 409 and "not bootable" in exc.value.message
    ctl.delete_snapshot("base")
    ctl.delete_snapshot("bad")
    assert ctl.list_snapshots() == []
    with pytest.raises(ControllerError) as exc:
        ctl.delete_snapshot("base")
    assert exc.value.status == 404
    # forkd's body: kernel and rootfs go together, not with an image; a host tap is
    # refused for vmfork's own networks (the daemon's ParentMaker checks the files,
    # tests/unit/test_image_foreign.py and tests/e2e/test_forkd_mcp.py).
    status, body, _ = served.request("POST", "/v1/snapshots", {"tag": "fc", "kernel": "/vmlinux"})
    assert status == 400 and "go together" in body["error"]
    status, body, _ = served.request("POST", "/v1/snapshots", {
        "tag": "fc", "kernel": "/vmlinux", "rootfs": "/r.ext4", "image": "sci"})
    assert status == 400 and "not both" in body["error"]
    status, body, _ = served.request("POST", "/v1/snapshots", {
        "tag": "fc", "kernel": "/vmlinux", "rootfs": "/r.ext4", "tap": "tap0"})
    assert status == 400 and "network" in body["error"]
    status, body, _ = served.request("POST", "/v1/snapshots", {
        "tag": "fc", "kernel": "vmlinux", "rootfs": "/r.ext4"})
    assert status == 400 and "absolute" in body["error"]


def test_writing_snapshot_is_not_spawnable(served: Served, ctl: Controller) -> None:
    served.controller.registry.begin_snapshot_job("inflight", 1)
    listed = ctl.list_snapshots()
    assert listed == [{"tag": "inflight", "dir": listed[0]["dir"],
                       "created_at_unix": listed[0]["created_at_unix"], "status": "writing",
                       "bootable": False}]
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("inflight")
    assert exc.value.status == 409 and "still being written" in exc.value.message


def test_a_snapshot_finishing_while_the_list_is_read_is_listed(served: Served,
                                                                ctl: Controller) -> None:
    """A job publishes its snapshot, then its row goes. Whichever of the list's two
    reads (jobs, store) comes first, a job finishing right after it must still show."""
    registry, store = served.controller.registry, served.controller.store
    registry.begin_snapshot_job("racing", 1)
    pending = store.begin("racing")
    pending.state_path.write_bytes(b"state")
    pending.memory_path.write_bytes(b"\0" * 4096)
    first_read: list[str] = []

    def finish_after(name: str, read: Any) -> Any:
        def wrapped() -> Any:
            result = read()
            if not first_read:
                first_read.append(name)
                pending.publish(SnapshotMeta(tag="racing", image="test", mem_mib=64,
                                             vcpus=1, timings=SnapshotTimings()))
                registry.finish_snapshot_job("racing", None)
            return result
        return wrapped

    served.controller.registry.list_snapshot_jobs = finish_after(  # type: ignore[method-assign]
        "jobs", registry.list_snapshot_jobs)
    served.controller.store.list = finish_after("store", store.list)  # type: ignore[method-assign]
    listed = {s["tag"]: s["status"] for s in ctl.list_snapshots()}
    assert first_read and listed == {"racing": "ready"}, (first_read, listed)


# -- sandboxes ------------------------------------------------------------------------


def test_sandbox_lifecycle_through_the_sdk(served: Served, ctl: Controller) -> None:
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("nope")
    assert exc.value.status == 404 and "no snapshot tagged 'nope'" in exc.value.message
    ctl.create_snapshot("base")
    infos = ctl.spawn_sandboxes("base", n=3, memory_limit_mib=128)
    assert len(infos) == 3
    first = infos[0]
    assert set(first) >= {"id", "snapshot_tag", "netns", "guest_addr", "created_at_unix",
                          "pid", "memory_limit_mib", "has_branched",
                          "last_branch_memory_path", "branch_count"}
    assert first["memory_limit_mib"] == 128 and first["status"] == "running"
    assert [s["id"] for s in ctl.list_sandboxes()] == [i["id"] for i in infos]
    assert ctl.get_sandbox(first["id"])["pid"] == first["pid"]
    assert ctl.ping_sandbox(first["id"])["pong"] is True
    r = ctl.exec_command(first["id"], ["echo", "hi"], timeout_secs=5, env={"A": "1"},
                         cwd="/tmp", stdin="in")
    assert r["exit_code"] == 3 and r["stderr"] == "err"
    assert json.loads(r["stdout"]) == {"argv": ["echo", "hi"], "env": {"A": "1"},
                                       "cwd": "/tmp", "stdin": "in"}
    with pytest.raises(ControllerError) as exc:
        ctl.exec_command(first["id"], ["sleep", "9"], timeout_secs=1)
    assert exc.value.status == 504 and exc.value.body["timed_out"] is True
    assert exc.value.body["stdout"] == "partial" and "timeout_secs" in exc.value.message
    assert ctl.exec_command(first["id"], ["missing"])["exit_code"] == 127
    assert ctl.eval_code(first["id"], "1 + 2") == {
        "result": "3", "error": None, "exit_code": 0, "stdout": "", "stderr": "",
        "traceback": None, "value_truncated": False}
    events = list(ctl.exec_stream(first["id"], ["echo"]))
    assert events[:2] == [("stdout", {"data": "chunk1 "}), ("stdout", {"data": "chunk2"})]
    assert events[-1][0] == "exit" and events[-1][1]["exit_code"] == 3
    ctl.kill_sandbox(first["id"])
    assert first["id"] not in served.spawner.live
    with pytest.raises(ControllerError) as exc:
        ctl.get_sandbox(first["id"])
    assert exc.value.status == 404
    # A sandbox that dies on its own is shown with its reason and refuses exec (409).
    second = infos[1]["id"]
    served.spawner.pending_exits.append(ExitNotice(second, "oom-killed", "killed by OOM"))
    deadline = time.monotonic() + 5
    while ctl.get_sandbox(second)["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    dead = ctl.get_sandbox(second)
    assert dead["status"] == "exited" and dead["exit_reason"] == "oom-killed"
    with pytest.raises(ControllerError) as exc:
        ctl.exec_command(second, ["true"])
    assert exc.value.status == 409 and "not running" in exc.value.message
    ctl.kill_sandbox(second)
    metrics = ctl.metrics()
    assert "vmfork_sandboxes_active 1" in metrics and "forkd_sandboxes_active 1" in metrics
    assert 'vmfork_sandbox_exits_total{reason="oom-killed"} 1' in metrics
    assert 'vmfork_spawn_seconds_count{outcome="ok"} 1' in metrics
    assert 'vmfork_snapshots{status="ready"} 1' in metrics


# -- BRANCH ---------------------------------------------------------------------------


def test_branch_full_publishes_a_spawnable_snapshot(served: Served, ctl: Controller) -> None:
    ctl.create_snapshot("base")
    sandbox = ctl.spawn_sandboxes("base")[0]["id"]
    info = ctl.branch_sandbox(sandbox, tag="b1")
    assert info["tag"] == "b1" and info["status"] == "ready" and info["bootable"] is True
    assert info["pause_ms"] == 4.0 and info["branched_from"] == sandbox
    request = served.spawner.branch_requests[-1]
    assert request["mode"] == "full" and request["sandbox_id"] == sandbox
    details = ctl.snapshot_info("b1")
    assert details["memory_logical_bytes"] == 8192 and details["mem_mib"] == 64
    after = ctl.get_sandbox(sandbox)
    assert after["has_branched"] and after["branch_count"] == 1
    assert after["last_branch_memory_path"].endswith("/b1/memory.bin")
    assert ctl.spawn_sandboxes("b1")[0]["snapshot_tag"] == "b1"
    # A default tag, the legacy flag spelling for full, and the pause histogram.
    auto = ctl.branch_sandbox(sandbox)
    assert auto["tag"].startswith(f"{sandbox}-branch-2-")
    metrics = ctl.metrics()
    assert 'vmfork_branch_pause_seconds_count{mode="full"} 2' in metrics
    assert 'vmfork_branches_total{mode="full"} 2' in metrics
    with pytest.raises(ControllerError) as exc:
        ctl.branch_sandbox(sandbox, tag="b1")
    assert exc.value.status == 409 and "already exists" in exc.value.message


def test_branch_modes_reach_the_spawner_and_measure_diff(served: Served,
                                                         ctl: Controller) -> None:
    ctl.create_snapshot("base")
    sandbox = ctl.spawn_sandboxes("base")[0]["id"]
    for tag, kwargs, mode in (("d1", {"mode": "diff"}, "diff"), ("d2", {"diff": True}, "diff"),
                              ("l1", {"mode": "live"}, "live"), ("l2", {"live": True}, "live")):
        info = ctl.branch_sandbox(sandbox, tag=tag, **kwargs)  # type: ignore[arg-type]
        assert info["status"] == "ready" and info["branch_mode"] == mode
        assert served.spawner.branch_requests[-1]["mode"] == mode
    info = ctl.branch_sandbox(sandbox, tag="d3", mode="diff", parent_tag="base",
                              measure_diff=True)
    assert served.spawner.branch_requests[-1]["parent_tag"] == "base"
    assert info["parent_tag"] == "base" and info["diff_logical_bytes"] == 2 * 4096
    assert info["diff_physical_bytes"] == 8192 and info["diff_ms"] == 9.0
    assert 'vmfork_branches_total{mode="live"} 2' in ctl.metrics()


@pytest.mark.parametrize(("failure", "status"), [
    (BranchFailed("no base to diff against", stage="base"), 409),
    (BranchFailed("the sandbox's VMM is gone", stage="control"), 502),
    (BranchFailed("the sandbox's VMM could not snapshot: disk full", stage="capture"), 502),
])
def test_branch_failure_is_reported_and_leaves_nothing(
        served: Served, ctl: Controller, failure: Exception, status: int) -> None:
    ctl.create_snapshot("base")
    sandbox = ctl.spawn_sandboxes("base")[0]["id"]
    served.spawner.branch_failure = failure
    with pytest.raises(ControllerError) as exc:
        ctl.branch_sandbox(sandbox, tag="d1", mode="diff")
    assert exc.value.status == status and str(failure) in exc.value.message
    listed = {s["tag"]: s for s in ctl.list_snapshots()}
    assert listed["d1"]["status"] == "failed" and not listed["d1"]["bootable"]
    assert str(failure) in listed["d1"]["error"]
    assert not any(p.name.startswith(".pending") for p in served.store.snapshots_dir.iterdir())
    assert not (served.store.snapshots_dir / "d1").exists()


@pytest.mark.parametrize(("body", "expected"), [
    ({"mode": "fast"}, "'mode' must be one of full, diff, live"),
    ({"mode": "full", "diff": True}, "contradicts"),
    ({"parent_tag": "base"}, "parent_tag names the base"),
    ({"tag": "../x"}, "'tag' is not a valid tag"),
    ({"wait": "no"}, "'wait' must be a boolean"),
    ({"bogus": 1}, "unknown field 'bogus'"),
])
def test_branch_bad_combinations_are_400(served: Served, ctl: Controller,
                                         body: dict[str, Any], expected: str) -> None:
    ctl.create_snapshot("base")
    sandbox = ctl.spawn_sandboxes("base")[0]["id"]
    status, reply, _ = served.request("POST", f"/v1/sandboxes/{sandbox}/branch", body)
    assert status == 400 and expected in reply["error"], reply


def test_branch_without_wait_is_202_writing_then_ready(served: Served, ctl: Controller) -> None:
    ctl.create_snapshot("base")
    sandbox = ctl.spawn_sandboxes("base")[0]["id"]
    served.spawner.control_gate.clear()
    status, info, _ = served.request("POST", f"/v1/sandboxes/{sandbox}/branch",
                                     {"tag": "later", "wait": False})
    assert status == 202 and info["status"] == "writing" and info["bootable"] is False
    assert {s["tag"]: s["status"] for s in ctl.list_snapshots()}["later"] == "writing"
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("later")
    assert exc.value.status == 409
    status, reply, _ = served.request("POST", f"/v1/sandboxes/{sandbox}/branch",
                                      {"tag": "later"})
    assert status == 409 and "being written" in reply["error"]
    assert "vmfork_branches_in_flight 1" in ctl.metrics()
    served.spawner.control_gate.set()
    deadline = time.monotonic() + 5
    while {s["tag"]: s["status"] for s in ctl.list_snapshots()}["later"] != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert ctl.spawn_sandboxes("later")
    assert "vmfork_branches_in_flight 0" in ctl.metrics()


def test_branch_of_unknown_or_dead_sandbox(served: Served, ctl: Controller) -> None:
    with pytest.raises(ControllerError) as exc:
        ctl.branch_sandbox("vm-000000000000")
    assert exc.value.status == 404


def test_restart_readopts_running_marks_lost_and_fails_writing(tmp_path: Path) -> None:
    spawner = FakeSpawner()
    for served in _serve(tmp_path, None, spawner=spawner):
        ctl = Controller(served.url, timeout=10)
        ctl.create_snapshot("base")
        ids = [i["id"] for i in ctl.spawn_sandboxes("base", n=3)]
        served.controller.registry.begin_snapshot_job("halfway", 1)
    # The daemon stopped (sandboxes kept); one sandbox died meanwhile.
    assert spawner.live == set(ids)
    spawner.live.discard(ids[0])
    for served in _serve(tmp_path, None, spawner=spawner):
        ctl = Controller(served.url, timeout=10)
        states = {s["id"]: s for s in ctl.list_sandboxes()}
        assert states[ids[0]]["status"] == "lost"
        assert "daemon restarted" in states[ids[0]]["exit_description"] or \
            "was gone" in states[ids[0]]["exit_description"]
        assert [states[i]["status"] for i in ids[1:]] == ["running", "running"]
        assert ctl.ping_sandbox(ids[1])["pong"]
        assert {s["tag"]: s["status"] for s in ctl.list_snapshots()}["halfway"] == "failed"


def test_unsupported_flags_are_refused(served: Served, ctl: Controller) -> None:
    ctl.create_snapshot("base")
    for flag in ("live_fork", "hugepages"):
        status, body, _ = served.request("POST", "/v1/sandboxes",
                                         {"snapshot_tag": "base", flag: True})
        assert status == 400 and flag in body["error"]
    # This daemon has no host networking (tests/unit/test_server_network.py has one).
    status, body, _ = served.request("POST", "/v1/sandboxes",
                                     {"snapshot_tag": "base", "per_child_netns": True})
    assert status == 501 and "per_child_netns" in body["error"]
    status, body, _ = served.request("POST", "/v1/sandboxes",
                                     {"snapshot_tag": "base", "egress": {"mode": "deny"}})
    assert status == 400 and "per_child_netns" in body["error"]


def test_files_round_trip_and_sandbox_facade(served: Served, ctl: Controller) -> None:
    ctl.create_snapshot("base")
    data = bytes(range(256)) * 4000   # ~1 MiB, streamed in both directions
    with Sandbox.create("base", controller=ctl) as sb:
        assert sb.files.write("/tmp/blob", data) == len(data)
        assert sb.files.read("/tmp/blob") == data
        assert [e["path"] for e in sb.files.list("/tmp")] == ["/tmp/blob"]
        sb.files.remove("/tmp/blob")
        with pytest.raises(ControllerError) as exc:
            sb.files.read("/tmp/blob")
        assert exc.value.status == 404
        result = sb.commands.run("echo hi", timeout=5)
        assert json.loads(result.stdout)["argv"] == ["/bin/sh", "-c", "echo hi"]
        seen: list[str] = []
        streamed = sb.commands.run(["x"], on_stdout=seen.append)
        assert seen == ["chunk1 ", "chunk2"] and streamed.stdout == "chunk1 chunk2"
        assert sb.eval("2 * 21").result == "42"
        again = Sandbox.connect(sb.id, controller=ctl)
        assert again.ping()["pong"]
        status, body, _ = served.request("GET", f"/v1/sandboxes/{sb.id}/files?path=rel")
        assert status == 400 and "absolute" in body["error"]
    assert ctl.list_sandboxes() == []


def test_heavy_operations_are_capped_with_retry_after(tmp_path: Path) -> None:
    for served in _serve(tmp_path, None, heavy=1):
        ctl = Controller(served.url, timeout=10)
        ctl.create_snapshot("base")
        served.spawner.gate.clear()
        first = threading.Thread(target=ctl.spawn_sandboxes, args=("base",))
        first.start()
        time.sleep(0.3)
        status, body, resp = served.request("POST", "/v1/sandboxes", {"snapshot_tag": "base"})
        served.spawner.gate.set()
        first.join()
        assert status == 503 and resp.getheader("Retry-After") == "3"
        assert "retry after 3 s" in body["error"]
        assert "vmfork_heavy_operations_rejected_total 1" in ctl.metrics()


def test_daemon_wide_caps_refuse_with_429_and_a_reason(tmp_path: Path) -> None:
    # Snapshots of this fake are 64 MiB guests: 3 sandboxes fit 200 MiB, a fourth not.
    for served in _serve(tmp_path, None, max_sandboxes=5, max_guest_mib=200):
        ctl = Controller(served.url, timeout=10)
        ctl.create_snapshot("base")
        assert len(ctl.spawn_sandboxes("base", n=3)) == 3
        status, body, _ = served.request("POST", "/v1/sandboxes", {"snapshot_tag": "base"})
        assert status == 429 and body["quota"] == "guest_memory_mib", body
        assert (body["in_use"], body["limit"]) == (192, 200)
        assert "--max-guest-memory-mib" in body["error"]
        status, body, _ = served.request("POST", "/v1/sandboxes",
                                         {"snapshot_tag": "base", "n": 3})
        assert status == 429 and body["quota"] == "sandboxes" and "--max-sandboxes" in body[
            "error"]
        assert served.spawner.count == 3, "nothing refused reached the spawner"
        for sandbox in ctl.list_sandboxes():
            ctl.kill_sandbox(sandbox["id"])
        assert len(ctl.spawn_sandboxes("base", n=3)) == 3, "deleted ones free their share"


def test_audit_log_lines_and_reopen(served: Served) -> None:
    served.request("GET", "/version", headers={"User-Agent": "tester/1"})
    served.request("GET", "/v1/snapshots/nope/info")
    served.audit_path.rename(served.audit_path.with_suffix(".1"))
    served.audit.request_reopen()
    served.request("GET", "/healthz", token=None)
    rotated = [json.loads(x) for x in served.audit_path.with_suffix(".1").read_text().splitlines()]
    assert rotated[0]["method"] == "GET" and rotated[0]["path"] == "/version"
    assert rotated[0]["status"] == 200 and rotated[0]["ua"] == "tester/1"
    assert rotated[0]["remote"] == "unix" and isinstance(rotated[0]["latency_us"], int)
    assert rotated[1]["status"] == 404 and rotated[1]["snapshot_tag"] == "nope"
    fresh = [json.loads(x) for x in served.audit_path.read_text().splitlines()]
    assert [e["path"] for e in fresh] == ["/healthz"]


def test_errors_by_route_metric(served: Served) -> None:
    served.request("GET", "/v1/snapshots/nope/info")
    served.request("GET", "/nowhere")
    _, text, _ = served.request("GET", "/metrics")
    text = text.decode()
    assert ('vmfork_http_errors_total{method="GET",route="/v1/snapshots/{tag}/info",'
            'status="404"} 1') in text
    assert 'vmfork_http_errors_total{method="GET",route="unmatched",status="404"} 1' in text
    assert "vmfork_http_request_duration_seconds_bucket" in text


def test_keep_alive_after_an_error(served: Served) -> None:
    conn = UnixHTTPConnection(str(served.socket), timeout=5)
    headers = {"Authorization": "Bearer " + TOKEN.decode()}
    for _ in range(3):
        conn.request("POST", "/v1/sandboxes", body=b'{"bogus": 1}', headers=headers)
        resp = conn.getresponse()
        assert resp.status == 400
        resp.read()
    conn.close()


def test_a_body_refused_unread_is_drained_so_the_connection_lives(served: Served) -> None:
    """A bad path (or a missing token) is refused before the handler reads the body;
    the client may still be sending it, so a small one is read and dropped: the
    client gets its answer and the connection stays usable."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(str(served.socket))
    body = b'{"signal": "SIGTERM"}'
    head = (f"POST /v1/sandboxes/vm-1/processes/not-a-pid/signal HTTP/1.1\r\n"
            f"Host: x\r\nAuthorization: Bearer {TOKEN.decode()}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode())
    time.sleep(0.2)      # the answer is made before the body arrives
    sock.sendall(body)   # would be EPIPE had the daemon closed without reading
    conn = http.client.HTTPResponse(sock)
    conn.begin()
    assert conn.status == 400 and b"invalid process id" in conn.read()
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    again = http.client.HTTPResponse(sock)
    again.begin()
    assert again.status == 200
    sock.close()


def test_internal_errors_are_500_and_serving_continues(served: Served) -> None:
    def boom(*_: Any) -> list[Any]:
        raise BadGateway("zygote gone")

    served.controller.list_sandboxes = boom  # type: ignore[method-assign]
    status, body, _ = served.request("GET", "/v1/sandboxes")
    assert (status, body) == (502, {"error": "zygote gone"})

    def crash(*_: Any) -> list[Any]:
        raise KeyError("bug")

    served.controller.list_sandboxes = crash  # type: ignore[method-assign]
    status, body, _ = served.request("GET", "/v1/sandboxes")
    assert status == 500 and "KeyError" in body["error"]
    assert served.request("GET", "/healthz")[0] == 200


def test_stale_unix_socket_is_replaced_and_live_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    front = HttpFront(ServerContext(None))  # type: ignore[arg-type]
    front.listen_unix(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    try:
        with pytest.raises(OSError, match="another daemon"):
            HttpFront(ServerContext(None)).listen_unix(path)  # type: ignore[arg-type]
    finally:
        front.stop()
    assert not path.exists()


# -- workspaces ----------------------------------------------------------------------


def test_workspace_create_suspend_resume_delete(served: Served, ctl: Controller) -> None:
    ctl.create_snapshot("base")
    info = ctl.create_workspace("dev", "base", memory_limit_mib=64)
    assert info["state"] == "running" and info["sandbox"]["snapshot_tag"] == "base"
    first = info["sandbox_id"]
    with pytest.raises(ControllerError) as exc:
        ctl.create_workspace("dev", "base")
    assert exc.value.status == 409
    with pytest.raises(ControllerError) as exc:
        ctl.resume_workspace("dev")
    assert exc.value.status == 409 and "never suspended" in exc.value.message
    suspended = ctl.suspend_workspace("dev")
    assert suspended["state"] == "suspended" and suspended["sandbox_id"] is None
    tag = suspended["suspended_snapshot"]
    assert first not in served.spawner.live and ctl.snapshot_info(tag)["status"] == "ready"
    resumed = ctl.resume_workspace("dev")
    assert resumed["state"] == "running" and resumed["sandbox"]["snapshot_tag"] == tag
    assert resumed["sandbox"]["memory_limit_mib"] == 64
    again = ctl.suspend_workspace("dev")   # the older suspension snapshot is replaced
    assert {s["tag"] for s in ctl.list_snapshots()} == {"base", again["suspended_snapshot"]}
    assert [w["name"] for w in ctl.list_workspaces()] == ["dev"]
    ctl.delete_workspace("dev")
    assert ctl.list_workspaces() == [] and {s["tag"] for s in ctl.list_snapshots()} == {"base"}
    for bad in ("..%2Fx", "a.b"):
        status, body, _ = served.request("GET", f"/v1/workspaces/{bad}")
        assert status == 400 and "invalid workspace name" in body["error"]
    status, body, _ = served.request("GET", "/v1/workspaces/none")
    assert status == 404


def test_a_file_growing_while_it_is_read_is_read_as_announced(served: Served,
                                                             ctl: Controller) -> None:
    """The body is the X-File-Size bytes the stat saw, not what the file has grown to
    by the read (else every client takes the extra bytes for a broken stream)."""
    ctl.create_snapshot("base")
    sid = ctl.spawn_sandboxes("base", 1)[0]["id"]
    ctl.write_file(sid, "/tmp/app.log", b"first line")
    for seen in (b"first line", b"first line and more"):
        out = io.BytesIO()
        assert ctl.read_file_to(sid, "/tmp/app.log", out) == len(seen)
        assert out.getvalue() == seen


def test_a_file_that_says_it_is_empty_is_read_to_its_end(served: Served,
                                                         ctl: Controller) -> None:
    """A file whose stat says 0 bytes (/proc's, or one being rewritten when it was
    stat'ed) is read to its end, and no size is announced for a client to hold the body
    to: it used to announce 0 and every client took the bytes for a broken stream."""
    ctl.create_snapshot("base")
    sid = ctl.spawn_sandboxes("base", 1)[0]["id"]
    ctl.write_file(sid, "/proc/version", b"Linux version 6.1.0")
    out = io.BytesIO()
    assert ctl.read_file_to(sid, "/proc/version", out) == 19
    assert out.getvalue().startswith(b"Linux version")
    status, _, resp = served.request("GET", f"/v1/sandboxes/{sid}/files?path=/proc/version")
    assert status == 200 and resp.getheader("X-File-Size") is None
