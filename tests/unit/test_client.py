"""The SDK without a daemon: URLs, environment defaults, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmfork.client import Controller, ControllerError, default_url
from vmfork.client.transport import Endpoint


def test_endpoint_parsing() -> None:
    e = Endpoint.parse("unix:///run/vmfork/api.sock")
    assert e.socket_path == "/run/vmfork/api.sock" and e.prefix == ""
    e = Endpoint.parse("http://127.0.0.1:8889/base/")
    assert (e.host, e.port, e.prefix) == ("127.0.0.1", 8889, "/base")
    for bad in ("ftp://x", "unix://relative.sock", "127.0.0.1:8889"):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)


def test_environment_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("VMFORK_URL", "FORKD_URL", "VMFORK_TOKEN", "FORKD_TOKEN", "VMFORK_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_url() == f"unix://{tmp_path}/vmfork/api.sock"
    monkeypatch.setenv("FORKD_URL", "http://127.0.0.1:8889")
    monkeypatch.setenv("FORKD_TOKEN", "forkd-token")
    c = Controller()
    assert c.base_url == "http://127.0.0.1:8889" and c.token == "forkd-token"
    monkeypatch.setenv("VMFORK_URL", "unix:///x.sock")
    monkeypatch.setenv("VMFORK_TOKEN", "vmfork-token")
    c = Controller()
    assert c.base_url == "unix:///x.sock" and c.token == "vmfork-token"
    assert Controller("http://h:1", token="explicit").token == "explicit"


def test_unreachable_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    c = Controller(f"unix://{tmp_path}/none.sock", timeout=1)
    with pytest.raises(ControllerError) as exc:
        c.list_sandboxes()
    assert exc.value.status == 0 and "vmfork serve" in str(exc.value)
    assert exc.value.url.endswith("/v1/sandboxes")
