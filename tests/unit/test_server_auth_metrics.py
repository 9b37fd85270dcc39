"""Token rules, bind refusal, the daemon's start-up checks, and the metric instruments."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from vmfork.client import Controller
from vmfork.server import auth
from vmfork.server.daemon import Daemon, DaemonConfig
from vmfork.server.http import parse_bind
from vmfork.server.metrics import Counter, Gauge, Histogram, MetricsRegistry


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
    reg = MetricsRegistry()
    c = reg.add(Counter("c_total", "a counter", ("route",), aliases=("old_c_total",)))
    g = reg.add(Gauge("g", "a gauge"))
    h = reg.add(Histogram("h_seconds", "a histogram", buckets=(0.1, 1.0)))
    c.inc(route='/a"b')
    c.inc(2, route='/a"b')
    g.set(1.5)
    for v in (0.05, 0.1, 0.5, 5.0):
        h.observe(v)
    text = reg.render()
    assert 'c_total{route="/a\\"b"} 3' in text and 'old_c_total{route="/a\\"b"} 3' in text
    assert "# TYPE c_total counter" in text and "# TYPE old_c_total counter" in text
    assert "g 1.5" in text
    assert 'h_seconds_bucket{le="0.1"} 2' in text
    assert 'h_seconds_bucket{le="1"} 3' in text
    assert 'h_seconds_bucket{le="+Inf"} 4' in text
    assert "h_seconds_count 4" in text and "h_seconds_sum 5.65" in text
    assert h.count() == 4 and c.value(route='/a"b') == 3
    with pytest.raises(ValueError):
        c.inc(-1, route="x")
    with pytest.raises(ValueError):
        c.inc(wrong="x")
    assert not math.isnan(h.count())


def test_one_daemon_per_state_directory(tmp_path: Path) -> None:
    from vmfork.server.daemon import lock_state_dir
    fd = lock_state_dir(tmp_path)
    try:
        with pytest.raises(OSError, match=f"another daemon \\(pid {os.getpid()}\\)"):
            lock_state_dir(tmp_path)
    finally:
        os.close(fd)
    os.close(lock_state_dir(tmp_path))  # free again once the holder is gone
