"""TLS on the daemon's TCP listener (issue 17, item 3): certificates made at test
time, the real daemon (API only: no spawner), the real SDK and stdlib clients."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_http_front import _closed_by_server
from test_server_http import TOKEN, _serve

from tests.tls_certs import Pair, make_ca, make_server
from vmfork.cli.doctor import tls_check
from vmfork.client import Controller, ControllerError
from vmfork.server.daemon import Daemon, DaemonConfig
from vmfork.server.http import FrontLimits, HttpFront, ServerContext
from vmfork.server.tls import TlsConfigError, server_context

SECRET = "0123456789abcdef0123"


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Pair]:
    ca_pair, ca, ca_key = make_ca(tmp_path)
    other_pair, other, other_key = make_ca(tmp_path, "other-ca")
    return {
        "ca": ca_pair,
        "other-ca": other_pair,
        "server": make_server(tmp_path, ca, ca_key),
        "wrong-host": make_server(tmp_path, ca, ca_key, "wrong-host", hosts=("elsewhere.test",)),
        "expired": make_server(tmp_path, ca, ca_key, "expired", days=1, start_days_ago=3),
        "by-other": make_server(tmp_path, other, other_key, "by-other"),
    }


def _daemon(tmp_path: Path, cert: Pair) -> Iterator[tuple[Daemon, str]]:
    (tmp_path / "tok").write_text(SECRET)
    daemon = Daemon(DaemonConfig(state_dir=tmp_path / "s", socket_path=None,
                                 bind="127.0.0.1:0", snapshot_root=tmp_path / "h",
                                 token_file=tmp_path / "tok", spawner=False,
                                 tls_cert=cert.cert, tls_key=cert.key))
    daemon.start()
    try:
        (url,) = daemon.addresses()
        yield daemon, url
    finally:
        daemon.stop()


@pytest.fixture
def served(tmp_path: Path, certs: dict[str, Pair]) -> Iterator[tuple[Daemon, str]]:
    yield from _daemon(tmp_path, certs["server"])


def test_the_sdk_verifies_the_daemon_against_the_given_ca(
        served: tuple[Daemon, str], certs: dict[str, Pair],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = served
    assert url.startswith("https://127.0.0.1:")
    ctl = Controller(url, token=SECRET, timeout=5, ca_file=str(certs["ca"].cert))
    assert ctl.version()["api"] == "v1"
    assert ctl.list_sandboxes() == []
    # The same CA from the environment, as the CLI and scripts pass it.
    monkeypatch.setenv("VMFORK_CA_FILE", str(certs["ca"].cert))
    assert Controller(url, token=SECRET, timeout=5).healthz()["ok"] is True


@pytest.mark.parametrize("ca", [None, "other-ca"])
def test_an_untrusted_certificate_is_refused_with_the_way_out(
        served: tuple[Daemon, str], certs: dict[str, Pair], ca: str | None) -> None:
    _, url = served
    ctl = Controller(url, token=SECRET, timeout=5,
                     ca_file=None if ca is None else str(certs[ca].cert))
    with pytest.raises(ControllerError, match="does not trust.*VMFORK_CA_FILE") as err:
        ctl.healthz()
    assert err.value.status == 0


def test_a_certificate_for_another_host_is_refused(tmp_path: Path,
                                                   certs: dict[str, Pair]) -> None:
    for _, url in _daemon(tmp_path, certs["wrong-host"]):
        with pytest.raises(ControllerError, match="does not trust.*mismatch"):
            Controller(url, token=SECRET, timeout=5, ca_file=str(certs["ca"].cert)).healthz()


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated")
def test_plain_http_and_old_tls_get_nothing_and_the_daemon_serves_on(
        served: tuple[Daemon, str], certs: dict[str, Pair]) -> None:
    _, url = served
    port = int(url.rsplit(":", 1)[1])
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        plain.request("GET", "/healthz")
        plain.getresponse()
    plain.close()
    old = ssl.create_default_context(cafile=str(certs["ca"].cert))
    old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    old.maximum_version = ssl.TLSVersion.TLSv1_1
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            pytest.raises(ssl.SSLError):
        old.wrap_socket(raw, server_hostname="127.0.0.1")
    # TLS 1.2 exactly is still accepted, and the refusals cost the daemon nothing.
    tls12 = ssl.create_default_context(cafile=str(certs["ca"].cert))
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=tls12)
    conn.request("GET", "/healthz")
    response = conn.getresponse()
    assert response.status == 200
    assert conn.sock.version() == "TLSv1.2"
    conn.close()
    ctl = Controller(url, token=SECRET, timeout=5, ca_file=str(certs["ca"].cert))
    assert ctl.healthz()["ok"] is True


def test_a_stalled_handshake_is_cut_within_the_header_timeout(
        tmp_path: Path, certs: dict[str, Pair]) -> None:
    limits = FrontLimits(header_timeout=1.0, idle_timeout=1.0, max_connections=8,
                         max_header_bytes=16 << 10)
    context = server_context(certs["server"].cert, certs["server"].key)
    for served in _serve(tmp_path, TOKEN):
        server = HttpFront(ServerContext(served.controller, TOKEN), limits)
        port = server.listen_tcp("127.0.0.1:0", tls=context).port
        server.start()
        try:
            # Twelve clients connect and never start TLS: a handshake holds a slot from
            # accept, so the four oldest are cut at once, past the cap of eight, not
            # when their deadline passes ...
            stalled = [socket.create_connection(("127.0.0.1", port), timeout=5)
                       for _ in range(12)]
            assert all(_closed_by_server(sock, within=0.5) for sock in stalled[:4])
            # ... a real client still gets in (evicting the oldest one waiting) ...
            good = ssl.create_default_context(cafile=str(certs["ca"].cert))
            conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=good)
            conn.request("GET", "/healthz")
            assert conn.getresponse().status == 200
            conn.close()
            # ... and the rest are closed once their header deadline passes.
            started = time.monotonic()
            assert all(_closed_by_server(sock, within=5) for sock in stalled)
            assert time.monotonic() - started < 4
            for sock in stalled:
                sock.close()
            deadline = time.monotonic() + 5
            while server.active_connections and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.active_connections == 0
        finally:
            server.stop()


def test_bad_tls_configuration_stops_the_daemon_naming_the_file(
        tmp_path: Path, certs: dict[str, Pair]) -> None:
    def config(cert: Path | None, key: Path | None, bind: str | None = "127.0.0.1:0"
               ) -> DaemonConfig:
        return DaemonConfig(state_dir=tmp_path / "s", socket_path=tmp_path / "api.sock",
                            bind=bind, snapshot_root=tmp_path / "h", spawner=False,
                            tls_cert=cert, tls_key=key)
    server, other = certs["server"], certs["by-other"]
    cases = [
        (config(server.cert, None), "go together"),
        (config(server.cert, server.key, bind=None), "add --bind"),
        (config(server.cert, other.key), f"{other.key} is not the key of"),
        (config(certs["expired"].cert, certs["expired"].key), "expired on"),
        (config(server.key, server.key), "not a PEM certificate"),
        (config(server.cert, server.cert), "not a usable PEM private key"),
        (config(tmp_path / "missing.pem", server.key), "missing.pem: cannot read"),
    ]
    for cfg, message in cases:
        with pytest.raises(TlsConfigError, match=message):
            Daemon(cfg)
    assert not (tmp_path / "api.sock").exists()


def test_serve_and_doctor_report_tls_problems(tmp_path: Path, certs: dict[str, Pair]) -> None:
    proc = subprocess.run([sys.executable, "-m", "vmfork.cli.serve", "--state",
                           str(tmp_path / "s"), "--no-socket", "--bind", "127.0.0.1:0",
                           "--tls-cert", str(certs["server"].cert), "--tls-key",
                           str(certs["by-other"].key)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "is not the key of" in proc.stderr
    ok = tls_check(str(certs["server"].cert), str(certs["server"].key))
    assert ok.status == "PASS" and "127.0.0.1" in ok.finding and "TLS 1.2" in ok.finding
    assert tls_check(str(certs["server"].cert), None).status == "FAIL"
    assert tls_check(str(certs["expired"].cert), str(certs["expired"].key)).status == "FAIL"
    no_names = make_server(tmp_path, *make_ca(tmp_path, "ca3")[1:], "bare", hosts=())
    assert tls_check(str(no_names.cert), str(no_names.key)).status == "WARN"
