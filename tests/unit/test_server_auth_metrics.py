"""Token rules, bind refusal, the daemon's start-up checks, and the metric instruments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmfork.client import Controller
from vmfork.server import auth
from vmfork.server.daemon import Daemon, DaemonConfig
from vmfork.server.http import parse_bind
from vmfork.server.metrics import DaemonMetrics


@pytest.mark.parametrize("token, problem", [
    (b"short", "at least 16"),
    (b"REPLACE_ME_with_a_long_secret", "placeholder"),
    (b"change_me-0123456789abcdef", "placeholder"),
])
def test_bad_tokens_are_refused(tmp_path: Path, token: bytes, problem: str) -> None:
    (tmp_path / "t").write_bytes(token + b"\n")
    with pytest.raises(auth.AuthConfigError, match=problem):
        auth.load_token(tmp_path / "t")


def test_token_file_is_stripped_and_compared(tmp_path: Path) -> None:
    (tmp_path / "t").write_bytes(b"  0123456789abcdef0123\n")
    token = auth.load_token(tmp_path / "t")
    assert token == b"0123456789abcdef0123"
    assert auth.authorize("Bearer 0123456789abcdef0123", token) is None
    assert auth.authorize("bearer 0123456789abcdef0123", token) is None
    assert auth.authorize(None, token) == auth.MISSING
    assert auth.authorize("Bearer ", token) == auth.MISSING
    assert auth.authorize("Bearer 0123456789abcdef0124", token) == auth.INVALID
    assert auth.authorize("Bearer \udcff", token) == auth.INVALID
    with pytest.raises(auth.AuthConfigError, match="cannot read"):
        auth.load_token(tmp_path / "missing")


@pytest.mark.parametrize("host, ok", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                      ("127.5.0.1", True), ("0.0.0.0", False),
                                      ("10.0.0.1", False), ("example.com", False)])
def test_non_loopback_bind_needs_a_token(host: str, ok: bool) -> None:
    if ok:
        auth.check_bind(host, None)
    else:
        with pytest.raises(auth.AuthConfigError, match="without a token"):
            auth.check_bind(host, None)
    auth.check_bind(host, b"x" * 16)


def test_parse_bind() -> None:
    assert parse_bind("127.0.0.1:8889") == ("127.0.0.1", 8889)
    assert parse_bind("[::1]:80") == ("::1", 80)
    for bad in ("nohost", ":80", "h:x", "h:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_bind(bad)


def test_daemon_refuses_open_bind_and_serves_api_only(tmp_path: Path) -> None:
    with pytest.raises(auth.AuthConfigError):
        Daemon(DaemonConfig(state_dir=tmp_path / "s", socket_path=None, bind="0.0.0.0:0",
                            snapshot_root=tmp_path / "h", spawner=False))
    (tmp_path / "tok").write_text("0123456789abcdef0123")
    daemon = Daemon(DaemonConfig(state_dir=tmp_path / "s", socket_path=tmp_path / "api.sock",
                                 bind="127.0.0.1:0", snapshot_root=tmp_path / "h",
                                 token_file=tmp_path / "tok", spawner=False))
    daemon.start()
    try:
        unix_url, tcp_url = daemon.addresses()
        for url in (unix_url, tcp_url):
            ctl = Controller(url, token="0123456789abcdef0123", timeout=5)
            assert ctl.version()["api"] == "v1"
            assert ctl.list_sandboxes() == []
    finally:
        daemon.stop()
    assert not (tmp_path / "api.sock").exists()


def test_instruments_render_prometheus_text() -> None:
    metrics = DaemonMetrics("9.9", branch_concurrency_cap=3)
    metrics.set_sources(lambda: 2, lambda: {"ready": 4, "failed": 1}, lambda: 1)
    metrics.requests.inc(method="GET", route='/a"b', status="200")
    metrics.requests.inc(2, method="GET", route='/a"b', status="200")
    for v in (0.0004, 0.0005, 0.03, 50.0):
        metrics.branch_pause_seconds.observe(v, mode="diff")
    text = metrics.render()
    assert 'vmfork_http_requests_total{method="GET",route="/a\\"b",status="200"} 3' in text
    assert "# TYPE vmfork_http_requests_total counter" in text
    assert "_created" not in text
    # Scraped gauges, under forkd's names too.
    assert 'vmfork_build_info{version="9.9"} 1' in text and 'forkd_build_info{version="9.9"} 1' in text
    assert "vmfork_sandboxes_active 2" in text and "forkd_sandboxes_active 2" in text
    assert 'vmfork_snapshots{status="failed"} 1' in text and "forkd_snapshots_total 5" in text
    assert "forkd_branch_concurrency_cap 3" in text and "forkd_branches_in_flight 1" in text
    assert 'vmfork_branch_pause_seconds_bucket{le="0.0005",mode="diff"} 2' in text
    assert 'vmfork_branch_pause_seconds_bucket{le="+Inf",mode="diff"} 4' in text
    assert 'vmfork_branch_pause_seconds_count{mode="diff"} 4' in text
    assert metrics.branch_pause_seconds.count(mode="diff") == 4
    assert metrics.branch_pause_seconds.count(mode="full") == 0
    assert metrics.requests.value(method="GET", route='/a"b', status="200") == 3
    with pytest.raises(ValueError):
        metrics.sandboxes_spawned.inc(-1)
    with pytest.raises(ValueError):
        metrics.sandbox_exits.inc(wrong="x")
    with pytest.raises(ValueError):
        metrics.heavy_rejected.inc(wrong="x")
    # Two daemons in one process keep their own samples.
    other = DaemonMetrics("9.9")
    assert other.requests.value(method="GET", route='/a"b', status="200") == 0


def test_one_daemon_per_state_directory(tmp_path: Path) -> None:
    from vmfork.server.daemon import lock_state_dir
    fd = lock_state_dir(tmp_path)
    try:
        with pytest.raises(OSError, match=f"another daemon \\(pid {os.getpid()}\\)"):
            lock_state_dir(tmp_path)
    finally:
        os.close(fd)
    os.close(lock_state_dir(tmp_path))  # free again once the holder is gone
