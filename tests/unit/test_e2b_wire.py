"""E2B's wire on the daemon: the real E2B SDK (its own venv) drives a real daemon on
TCP, whose sandboxes have a real agent server behind them (on this host: only the VM
is left out; tests/e2e/test_e2b_sdk.py runs the same program against real guests).
Plus the protocol's edges with raw HTTP: tokens, Connect errors, chunked bodies."""

from __future__ import annotations

import base64
import http.client
import json
import pwd
import socket
import ssl
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2b_sdk import (
    check_signed_urls,
    check_signed_urls_js,
    check_snapshots,
    check_tour,
    check_users,
    e2b_env,
    run_js_program,
    run_program,
    sdk_python,
)
from tests.tls_certs import make_ca, make_server
from tests.unit.agent_support import running_agent
from tests.unit.test_server_http import TOKEN, _fake_snapshot
from tests.unit.test_server_processes import AgentBackedSpawner
from vmfork.server.audit import AuditLog
from vmfork.server.controller import Controller as Ctl
from vmfork.server.controller import Limits
from vmfork.server.http import HttpFront, ServerContext
from vmfork.server.metrics import DaemonMetrics
from vmfork.server.registry import Registry
from vmfork.server.requests import SnapshotCreate
from vmfork.server.tls import server_context
from vmfork.store import Store


@dataclass
class Daemon:
    url: str
    port: int
    ctl: Ctl


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    yield from _daemon(tmp_path)


def _daemon(tmp_path: Path, tls: ssl.SSLContext | None = None) -> Iterator[Daemon]:
    with running_agent() as agent:
        store = Store.open(tmp_path / "home")
        registry = Registry(tmp_path / "registry.db")
        ctl = Ctl(store, registry, AgentBackedSpawner(agent), DaemonMetrics("test"),
                  make_snapshot=_fake_snapshot, limits=Limits(heavy_concurrency=4))
        ctl.start()
        front = HttpFront(ServerContext(ctl, TOKEN, AuditLog(tmp_path / "audit.log")))
        port = front.listen_tcp("127.0.0.1:0", tls=tls).port
        front.start()
        _fake_snapshot(store, SnapshotCreate(tag="base"))
        try:
            yield Daemon(f"{'https' if tls else 'http'}://127.0.0.1:{port}", port, ctl)
        finally:
            front.stop()
            ctl.stop()
            registry.close()


@pytest.mark.parametrize("sdk", ["python", "javascript"])
def test_the_e2b_sdk_tour(daemon: Daemon, tmp_path: Path, sdk: str) -> None:
    work = str(tmp_path / "work")
    env = e2b_env(daemon.url, TOKEN.decode())
    if sdk == "python":
        seen = run_program(sdk_python(), "tour", ["base", work], env)
    else:
        seen = run_js_program("tour", ["base", work], env)
    check_tour(seen, work)


@pytest.mark.parametrize("sdk", ["python", "javascript"])
def test_the_e2b_sdk_tour_over_tls(tmp_path: Path, sdk: str) -> None:
    """``--tls-cert/--tls-key``: the SDKs verify the daemon with a CA given the way
    each runtime takes one (SSL_CERT_FILE, NODE_EXTRA_CA_CERTS), and speak HTTP/1.1
    over it (the daemon's TLS offers no HTTP/2)."""
    (tmp_path / "certs").mkdir()
    ca, ca_cert, ca_key = make_ca(tmp_path / "certs")
    pair = make_server(tmp_path / "certs", ca_cert, ca_key)
    for d in _daemon(tmp_path, server_context(pair.cert, pair.key)):
        env = e2b_env(d.url, TOKEN.decode(), ca_file=str(ca.cert))
        work = str(tmp_path / "work")
        if sdk == "python":
            seen = run_program(sdk_python(), "tour", ["base", work], env)
        else:
            seen = run_js_program("tour", ["base", work], env)
        check_tour(seen, work)


# -- the protocol's edges, with raw HTTP ------------------------------------------------


def _request(d: Daemon, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _create(d: Daemon) -> dict:
    status, _, raw = _request(d, "POST", "/v2/sandboxes", json.dumps(
        {"templateID": "base", "timeout": 300}).encode(),
        {"X-API-KEY": TOKEN.decode(), "Content-Type": "application/json"})
    assert status == 201, raw
    return json.loads(raw)


def _rpc(d: Daemon, sandbox: dict, method: str, message: dict,
         token: str | None = None) -> tuple[int, dict]:
    status, _, raw = _request(d, "POST", f"/{method}", json.dumps(message).encode(), {
        "Content-Type": "application/json", "E2b-Sandbox-Id": sandbox["sandboxID"],
        "X-Access-Token": token or sandbox["envdAccessToken"]})
    return status, json.loads(raw)


def _envelopes(raw: bytes) -> list[tuple[int, dict]]:
    out = []
    while raw:
        flags, length = struct.unpack(">BI", raw[:5])
        out.append((flags, json.loads(raw[5:5 + length])))
        raw = raw[5 + length:]
    return out


def test_the_control_plane_wants_the_daemon_token(daemon: Daemon) -> None:
    for headers in ({}, {"X-API-KEY": "wrong"}, {"Authorization": f"Bearer {TOKEN.decode()}"}):
        status, _, raw = _request(daemon, "GET", "/v2/sandboxes", headers=headers)
        assert status == 401 and json.loads(raw)["code"] == 401
    status, _, raw = _request(daemon, "GET", "/v2/sandboxes",
                              headers={"X-API-KEY": TOKEN.decode()})
    assert status == 200 and json.loads(raw) == []
    # vmfork's own API is untouched: a bearer token, not X-API-KEY.
    assert _request(daemon, "GET", "/v1/sandboxes",
                    headers={"X-API-KEY": TOKEN.decode()})[0] == 401


def test_create_refuses_what_it_cannot_do(daemon: Daemon) -> None:
    key = {"X-API-KEY": TOKEN.decode(), "Content-Type": "application/json"}
    for body, status in (({"templateID": "nope"}, 404), ({"templateID": "../x"}, 400),
                         ({"templateID": "base", "bogus": 1}, 400),
                         ({"templateID": "base", "mcp": {"x": {}}}, 400),
                         ({"templateID": "base", "timeout": -1}, 400),
                         ({"templateID": "base", "metadata": {"k": 1}}, 400)):
        got, _, raw = _request(daemon, "POST", "/v2/sandboxes", json.dumps(body).encode(), key)
        assert got == status, (body, raw)
        assert json.loads(raw)["code"] == status
    assert daemon.ctl.list_sandboxes() == []   # nothing partial was made
    got, headers, _ = _request(daemon, "PUT", "/v2/sandboxes", b"{}", key)
    assert got == 405 and headers["allow"] == "GET, POST"
    assert _request(daemon, "DELETE", "/sandboxes/sb-nope", headers=key)[0] in (400, 404)


def test_envd_tokens_are_per_sandbox(daemon: Daemon) -> None:
    one, two = _create(daemon), _create(daemon)
    assert one["envdAccessToken"] != two["envdAccessToken"]
    status, body = _rpc(daemon, one, "process.Process/List", {}, token=two["envdAccessToken"])
    assert status == 401 and body["code"] == "unauthenticated"
    status, body = _rpc(daemon, one, "process.Process/List", {})
    assert status == 200 and body == {"processes": []}
    # By Host, as behind a TLS proxy for E2B_DOMAIN: 49983-<id>.<domain>.
    status, _, raw = _request(daemon, "POST", "/process.Process/List", b"{}", {
        "Host": f"49983-{one['sandboxID']}.e2b.example", "Content-Type": "application/json",
        "X-Access-Token": one["envdAccessToken"]})
    assert status == 200 and json.loads(raw) == {"processes": []}
    status, _, raw = _request(daemon, "GET", "/health", headers={
        "E2b-Sandbox-Id": "sb-unknown", "X-Access-Token": one["envdAccessToken"]})
    assert status == 401


def test_connect_errors(daemon: Daemon) -> None:
    sb = _create(daemon)
    cases = [
        ("process.Process/SendSignal", {"process": {"pid": 1}, "signal": "SIGNAL_SIGHUP"},
         "invalid_argument"),
        ("process.Process/SendInput", {"process": {"pid": 4000000}, "input": {"stdin": "eA=="}},
         "not_found"),
        ("process.Process/Update", {"process": {"pid": 1}, "pty": {"size": {"rows": 5000,
                                                                             "cols": 80}}},
         "invalid_argument"),
        ("process.Process/StreamInput", {}, "unimplemented"),
        ("filesystem.Filesystem/Stat", {"path": "/definitely/not/here"}, "not_found"),
        ("filesystem.Filesystem/Stat", {"path": "a\u0000b"}, "invalid_argument"),
        ("filesystem.Filesystem/GetWatcherEvents", {"watcherId": "nope"}, "not_found"),
        ("filesystem.Filesystem/ListDir", {"path": "/", "depth": 99}, "invalid_argument"),
    ]
    for method, message, code in cases:
        status, body = _rpc(daemon, sb, method, message)
        assert body["code"] == code, (method, body)
        assert status == {"invalid_argument": 400, "not_found": 404,
                          "unimplemented": 501}[code]
    status, _, raw = _request(daemon, "POST", "/process.Process/List", b"not json", {
        "Content-Type": "application/json", "E2b-Sandbox-Id": sb["sandboxID"],
        "X-Access-Token": sb["envdAccessToken"]})
    assert status == 400 and json.loads(raw)["code"] == "invalid_argument"
    # A stream's error is in its end-of-stream envelope, with status 200.
    message = json.dumps({"process": {"pid": 4000000}}).encode()
    status, headers, raw = _request(daemon, "POST", "/process.Process/Connect",
                                    struct.pack(">BI", 0, len(message)) + message, {
        "Content-Type": "application/connect+json", "E2b-Sandbox-Id": sb["sandboxID"],
        "X-Access-Token": sb["envdAccessToken"]})
    assert status == 200 and headers["content-type"] == "application/connect+json"
    [(flags, end)] = _envelopes(raw)
    assert flags == 2 and end["error"]["code"] == "not_found"


def _raw(d: Daemon, head: str, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", d.port), timeout=30) as sock:
        try:
            sock.sendall(head.encode() + b"\r\n" + body)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass   # answered and closed before all of it was sent
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_chunked_request_bodies(daemon: Daemon, tmp_path: Path) -> None:
    sb = _create(daemon)
    head = (f"POST /filesystem.Filesystem/MakeDir HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nE2b-Sandbox-Id: {sb['sandboxID']}\r\n"
            f"X-Access-Token: {sb['envdAccessToken']}\r\nTransfer-Encoding: chunked\r\n"
            "Connection: close\r\n")
    target = str(tmp_path / "made-from-chunks")
    message = json.dumps({"path": target}).encode()
    half = len(message) // 2
    good = (b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: ignored\r\n\r\n"
            % (half, message[:half], len(message) - half, message[half:]))
    reply = _raw(daemon, head, good)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["entry"]["path"] == target
    for bad in (b"zz\r\n{}\r\n0\r\n\r\n",              # not hexadecimal
                b"2\r\n{}XX0\r\n\r\n",                    # no CRLF after the data
                b"%s\r\n" % (b"1" * 5000),                # a chunk-size line too long
                b"10\r\n{}"):                              # ends inside a chunk
        reply = _raw(daemon, head, bad)
        assert reply.startswith(b"HTTP/1.1 400"), (bad[:40], reply[:300])
    # Over the route's own limit (a JSON message is at most 1 MiB): 413 / resource_exhausted.
    big = b"[" + b"1," * (600 << 10) + b"1]"
    reply = _raw(daemon, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
    assert reply.split(b"\r\n", 1)[0] in (b"HTTP/1.1 413 Payload Too Large",
                                           b"HTTP/1.1 429 Too Many Requests"), reply[:300]
    # vmfork's own routes take chunked bodies too (they were refused before).
    reply = _raw(daemon, "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 f"{TOKEN.decode()}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n",
                 b'1a\r\n{"snapshot_tag": "base"}  \r\n0\r\n\r\n')
    assert reply.startswith(b"HTTP/1.1 201"), reply[:300]


def test_list_pages(daemon: Daemon) -> None:
    made = {_create(daemon)["sandboxID"] for _ in range(3)}
    key = {"X-API-KEY": TOKEN.decode()}
    status, headers, raw = _request(daemon, "GET", "/v2/sandboxes?limit=2", headers=key)
    first = [s["sandboxID"] for s in json.loads(raw)]
    assert status == 200 and len(first) == 2 and headers["x-next-token"]
    status, headers, raw = _request(
        daemon, "GET", f"/v2/sandboxes?limit=2&nextToken={headers['x-next-token']}",
        headers=key)
    second = [s["sandboxID"] for s in json.loads(raw)]
    assert len(second) == 1 and "x-next-token" not in headers
    assert set(first + second) == made
    assert _request(daemon, "GET", "/v2/sandboxes?limit=0", headers=key)[0] == 400
    assert _request(daemon, "GET", "/v2/sandboxes?state=gone", headers=key)[0] == 400


def test_files_multipart_and_octet_stream(daemon: Daemon, tmp_path: Path) -> None:
    sb = _create(daemon)
    envd = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"]}
    one, two = tmp_path / "m" / "one.txt", tmp_path / "m" / "deep" / "two.bin"
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"{one}\"\r\nContent-Type: text/plain\r\n\r\nfirst\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"{two}\"\r\n\r\n").encode() + bytes(range(256)) * 400 + (
            f"\r\n--{boundary}--\r\n").encode()
    status, _, raw = _request(daemon, "POST", "/files", body, {
        **envd, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, raw
    assert [w["path"] for w in json.loads(raw)] == [str(one), str(two)]
    assert one.read_bytes() == b"first" and two.read_bytes() == bytes(range(256)) * 400
    status, _, raw = _request(daemon, "POST", f"/files?path={tmp_path}/o/raw.bin",
                              b"\x00raw\r\n--x", {**envd,
                                                  "Content-Type": "application/octet-stream"})
    assert status == 200 and (tmp_path / "o" / "raw.bin").read_bytes() == b"\x00raw\r\n--x"
    status, _, raw = _request(daemon, "GET", f"/files?path={tmp_path}/o/raw.bin", headers=envd)
    assert status == 200 and raw == b"\x00raw\r\n--x"
    status, _, raw = _request(daemon, "GET", f"/files?path={tmp_path}/nope", headers=envd)
    assert status == 404 and json.loads(raw)["code"] == 404
    for bad_type, bad_body in (("multipart/form-data", b"--x\r\n"),   # no boundary
                               ("multipart/form-data; boundary=x", b"no delimiter here"),
                               ("multipart/form-data; boundary=x",
                                b"--x\r\nContent-Disposition: form-data; name=f; "
                                b"filename=\"%s/cut/t\"\r\n\r\nnever ends" % str(
                                    tmp_path).encode())):
        status, _, raw = _request(daemon, "POST", "/files", bad_body,
                                  {**envd, "Content-Type": bad_type})
        assert status == 400, (bad_type, raw)
    assert not (tmp_path / "cut" / "t").exists()   # a cut upload leaves no file


def test_lifecycle_calls(daemon: Daemon) -> None:
    """With the controller's lifecycles (timeouts, metadata, envs, pause/resume,
    metrics), the SDK's lifecycle program; without them, each call is refused with 501
    rather than half done (the E2B SDK's default timeout alone is accepted)."""
    if hasattr(Ctl, "set_timeout"):
        seen = run_program(sdk_python(), "lifecycle", ["base"],
                           e2b_env(daemon.url, TOKEN.decode()))
        assert seen["env"] == "yes\n" and seen["env_after_resume"] == "yes\n"
        assert 100 < seen["end_in"] <= 120 and 580 < seen["end_in_after"] <= 600
        assert seen["filtered"] == [True] and seen["filtered_none"] == []
        assert seen["states"] == ["paused"] and seen["same_id"] is True
        # The host's samples (every 5 s, the reaper's thread) and one taken now.
        assert 1 <= seen["metrics"] <= 3 and seen["kill"] is True
        return
    key = {"X-API-KEY": TOKEN.decode(), "Content-Type": "application/json"}
    for extra in ({"metadata": {"a": "b"}}, {"envVars": {"A": "b"}}):
        status, _, raw = _request(daemon, "POST", "/v2/sandboxes", json.dumps(
            {"templateID": "base", **extra}).encode(), key)
        assert status == 501, raw
    assert daemon.ctl.list_sandboxes() == []
    sb = _create(daemon)
    for method, path, body in (("POST", "timeout", {"timeout": 60}), ("POST", "pause", {}),
                               ("POST", "resume", {}), ("GET", "metrics", None)):
        status, _, raw = _request(daemon, method, f"/sandboxes/{sb['sandboxID']}/{path}",
                                  None if body is None else json.dumps(body).encode(), key)
        assert status == 501 and "lifecycles" in json.loads(raw)["message"], (path, raw)


@pytest.mark.parametrize("sdk", ["python", "javascript"])
def test_named_snapshots_with_the_sdk(daemon: Daemon, tmp_path: Path, sdk: str) -> None:
    """The SDK's create_snapshot, list_snapshots, delete_snapshot and a sandbox created
    from a snapshot id (a BRANCH of the sandbox, its tag the id)."""
    work = tmp_path / "work"
    work.mkdir()
    env = e2b_env(daemon.url, TOKEN.decode())
    if sdk == "python":
        seen = run_program(sdk_python(), "snapshots", ["base", str(work)], env)
    else:
        seen = run_js_program("snapshots", ["base", str(work)], env)
    check_snapshots(seen, isolated=False)
    assert daemon.ctl.list_sandboxes() == []
    assert [s["tag"] for s in daemon.ctl.list_snapshots()] == ["base"]


def test_named_snapshots_refuse_bad_input(daemon: Daemon) -> None:
    key = {"X-API-KEY": TOKEN.decode(), "Content-Type": "application/json"}
    sb = _create(daemon)
    for body, status in (({"name": "bad tag!"}, 400), ({"nope": 1}, 400),
                         ({"memory": "yes"}, 400)):
        got, _, raw = _request(daemon, "POST", f"/sandboxes/{sb['sandboxID']}/snapshots",
                               json.dumps(body).encode(), key)
        assert got == status, (body, raw)
    got, _, raw = _request(daemon, "POST", "/sandboxes/nosuch/snapshots", b"{}", key)
    assert got == 404 and json.loads(raw)["code"] == 404, raw
    for query in ("limit=0", "nextToken=x", "bogus=1"):
        got, _, raw = _request(daemon, "GET", f"/snapshots?{query}", None, key)
        assert got == 400, (query, raw)
    got, _, raw = _request(daemon, "DELETE", "/templates/bad%20tag", None, key)
    assert got == 400, raw
    got, _, raw = _request(daemon, "GET", "/snapshots", None, {})
    assert got == 401, raw
    # A pause's own snapshots are the sandbox's: not listed as E2B snapshots.
    if hasattr(Ctl, "pause_sandbox"):
        daemon.ctl.pause_sandbox(sb["sandboxID"])
        got, _, raw = _request(daemon, "GET", "/snapshots", None, key)
        assert got == 200 and json.loads(raw) == [], raw
    daemon.ctl.delete_sandbox(sb["sandboxID"])


def test_metrics_are_a_series_of_host_samples(daemon: Daemon) -> None:
    """``GET /sandboxes/{id}/metrics``: the samples the host keeps (a bounded ring per
    running sandbox), filtered by ``start``/``end``, then one taken now."""
    if not hasattr(Ctl, "sandbox_metric_samples"):
        pytest.skip("no lifecycles in this controller")
    import time

    from vmfork.server.controller.usage import MAX_SAMPLES, SAMPLE_INTERVAL_S, cpu_used_pct
    key = {"X-API-KEY": TOKEN.decode()}
    sb = _create(daemon)
    usage = daemon.ctl.usage
    # Sample times of the test's choosing, in the future: the reaper's own sampling
    # (now) counts as too soon after them, so it cannot add to the ring meanwhile.
    base = time.time() + 10**6
    for i in range(MAX_SAMPLES + 5):
        usage.sample_running(now=base + i * SAMPLE_INTERVAL_S)
    usage.sample_running(now=base + (MAX_SAMPLES + 4.5) * SAMPLE_INTERVAL_S)  # too soon
    kept = daemon.ctl.sandbox_metric_samples(sb["sandboxID"])
    assert len(kept) == MAX_SAMPLES, len(kept)
    assert kept[0]["timestamp_unix"] == base + 5 * SAMPLE_INTERVAL_S
    # The fake spawner's pids are not processes: no CPU time, so no percentage.
    assert all(k["cpu_used_pct"] is None for k in kept)
    assert cpu_used_pct({"cpu_seconds": 1.0, "timestamp_unix": 0.0},
                        {"cpu_seconds": 2.0, "timestamp_unix": 10.0}, 2) == 5.0
    assert cpu_used_pct({"cpu_seconds": 0.0, "timestamp_unix": 0.0},
                        {"cpu_seconds": 50.0, "timestamp_unix": 1.0}, 1) == 100.0
    assert cpu_used_pct(None, kept[0], 1) is None
    status, _, raw = _request(daemon, "GET", f"/sandboxes/{sb['sandboxID']}/metrics",
                              None, key)
    series = json.loads(raw)
    assert status == 200 and len(series) == MAX_SAMPLES + 1, raw[:200]
    stamps = [m["timestampUnix"] for m in series]
    # The kept ones in order, then the one taken now (the test's are in the future).
    assert stamps[:-1] == sorted(stamps[:-1]) and series[-1]["diskTotal"] > 0
    assert abs(stamps[-1] - time.time()) < 60
    assert all(0.0 <= m["cpuUsedPct"] <= 100.0 and m["cpuCount"] >= 1 for m in series)
    start = int(base) + 100 * int(SAMPLE_INTERVAL_S)
    end = int(base) + 109 * int(SAMPLE_INTERVAL_S)
    status, _, raw = _request(daemon, "GET", f"/sandboxes/{sb['sandboxID']}/metrics"
                              f"?start={start}&end={end}", None, key)
    assert status == 200 and len(json.loads(raw)) == 10, raw[:300]
    status, _, raw = _request(daemon, "GET", f"/sandboxes/{sb['sandboxID']}/metrics"
                              "?start=soon", None, key)
    assert status == 400, raw
    # A sandbox that is no longer running loses its ring.
    daemon.ctl.delete_sandbox(sb["sandboxID"])
    usage.sample_running(now=base + 10_000 * SAMPLE_INTERVAL_S)
    assert sb["sandboxID"] not in usage._samples


def test_signed_file_urls(daemon: Daemon, tmp_path: Path) -> None:
    """The SDK's ``download_url``/``upload_url``: a URL carries no X-Access-Token, so
    envd checks its signature (sha256 of path, operation, user, the sandbox's token and
    the expiration): a wrong, missing or expired one is a 401 that says which."""
    work = str(tmp_path / "work")
    seen = run_program(sdk_python(), "signed_urls", ["base", work],
                       e2b_env(daemon.url, TOKEN.decode()))
    check_signed_urls(seen)
    seen = run_js_program("signed_urls", ["base", work], e2b_env(daemon.url, TOKEN.decode()))
    check_signed_urls_js(seen)


def test_file_signature_is_the_sdks() -> None:
    """``file_signature`` against the SDK's own ``get_signature`` (in its venv)."""
    from vmfork.server.e2b.envd import file_signature
    code = ("import json; from e2b import get_signature; print(json.dumps(["
            "get_signature('/a b/ü.txt', 'read', None, 'tok'), "
            "get_signature('x', 'write', 'user', 'tok', 60)]))")
    done = subprocess.run([str(sdk_python()), "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    plain, expiring = json.loads(done.stdout)
    assert file_signature("/a b/ü.txt", "read", "", "tok", None) == plain["signature"]
    assert file_signature("x", "write", "user", "tok",
                          expiring["expiration"]) == expiring["signature"]


def test_envd_users(daemon: Daemon, tmp_path: Path) -> None:
    """The SDK's ``user=`` (``Authorization: Basic``, ``?username=``): commands run as
    that user, files and directories it makes are its own; an unknown user is refused
    before anything runs. Here the agent is on this host (as root), whose ``nobody`` is
    the user; tests/e2e/test_e2b_sdk.py runs it in a guest as ``user``."""
    nobody = pwd.getpwnam("nobody")
    work = str(tmp_path / "work")
    seen = run_program(sdk_python(), "users", ["base", work, "nobody"],
                       e2b_env(daemon.url, TOKEN.decode()))
    # No user named: ``user`` if this host has one (as E2B's templates do), else root.
    try:
        default_user = pwd.getpwnam("user")
        default = (default_user.pw_uid, default_user.pw_gid, default_user.pw_dir)
    except KeyError:
        default = (0, 0, "/root")
    check_users(seen, "nobody", nobody.pw_uid, nobody.pw_gid, nobody.pw_dir, home=False,
                default=default)


def test_the_default_user_is_read_from_the_guests_passwd() -> None:
    """Which user a call that names none runs as comes from the guest's /etc/passwd
    (its home too); without ``user`` there, root."""
    from vmfork.server.e2b.envd import DEFAULT_USER, _passwd_home
    passwd = (b"root:x:0:0:root:/root:/bin/bash\nusers:x:9:9::/nope:/bin/sh\n"
              b"user:x:1000:1000:User:/home/user:/bin/bash\n")
    assert DEFAULT_USER == "user" and _passwd_home(passwd, "user") == "/home/user"
    assert _passwd_home(b"user:x:1000:1000::/srv/u:/bin/sh", "user") == "/srv/u"
    assert _passwd_home(b"user:x:1000:1000:::/bin/sh", "user") == "/home/user"
    assert _passwd_home(passwd.replace(b"user:x:1000", b"other:x:1000"), "user") is None
    assert _passwd_home(b"user:broken", "user") is None


def test_envd_user_header_is_checked(daemon: Daemon) -> None:
    sb = _create(daemon)
    envd = {"Content-Type": "application/json", "E2b-Sandbox-Id": sb["sandboxID"],
            "X-Access-Token": sb["envdAccessToken"]}
    for header in ("Bearer abc", "Basic !!!", "Basic " + base64.b64encode(b"nocolon").decode(),
                   "Basic " + base64.b64encode(b"bad/name:").decode()):
        status, _, raw = _request(daemon, "POST", "/filesystem.Filesystem/Stat",
                                  b'{"path": "/"}', {**envd, "Authorization": header})
        assert status == 400 and json.loads(raw)["code"] == "invalid_argument", (header, raw)
    status, _, raw = _request(daemon, "GET", "/files?path=/etc/hostname&username=a%2Fb",
                              headers=envd)
    assert status == 400, raw
