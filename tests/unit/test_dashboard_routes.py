"""The dashboard's files (``/ui``) and the console-tail route it reads, on the real
daemon front (test_server_http's fake spawner). The page itself is tested in a real
browser by tests/ui (scripts/test's dashboard tier)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from test_server_http import TOKEN, FakeSpawner, _serve

from vmfork.server.console import MAX_TAIL, ConsoleUnavailable, console_tail
from vmfork.server.spawner import Spawned, SpawnOutcome
from vmfork.store import Snapshot


class RunDirSpawner(FakeSpawner):
    """Sandboxes whose run directories exist, under ``base``."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def spawn(self, snapshot: Snapshot, n: int, memory_limit_mib: int | None) -> SpawnOutcome:
        children = []
        for _ in range(n):
            self.count += 1
            vm_id = f"vm-{self.count:012x}"
            run_dir = self.base / vm_id
            run_dir.mkdir(parents=True)
            self.live.add(vm_id)
            self.run_dirs[vm_id] = str(run_dir)
            children.append(Spawned(vm_id, 4000 + self.count, str(run_dir)))
        return SpawnOutcome(children, [], 0.01, 0.02, 0.03)


def test_the_dashboard_files_need_no_token_and_carry_a_strict_policy(tmp_path: Path) -> None:
    for served in _serve(tmp_path, TOKEN):
        status, body, response = served.request("GET", "/ui", token=None)
        assert status == 200
        assert response.getheader("Content-Type") == "text/html; charset=utf-8"
        assert b'<script type="module" src="/ui/app.js">' in body
        policy = response.getheader("Content-Security-Policy")
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
        assert response.getheader("X-Content-Type-Options") == "nosniff"
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            status, body, response = served.request("GET", f"/ui/{name}", token=None)
            assert status == 200 and response.getheader("Content-Type").startswith(kind)
            assert len(body) > 500
        # Only the three files: no other name, no way out of the package.
        for path in ("/ui/secret.txt", "/ui/..%2f..%2fetc%2fpasswd", "/ui/__init__.py"):
            assert served.request("GET", path, token=None)[0] == 404
        assert served.request("GET", "/ui/../v1/sandboxes", token=None)[0] in (401, 404)
        # Their openness lends nothing to the API.
        assert served.request("GET", "/v1/sandboxes", token=None)[0] == 401
        assert served.request("GET", "/ui/app.js/../../v1/sandboxes", token=None)[0] in (401, 404)


def test_the_console_route_serves_a_bounded_tail(tmp_path: Path) -> None:
    spawner = RunDirSpawner(tmp_path / "runs")
    for served in _serve(tmp_path, TOKEN, spawner=spawner):
        status, body, _ = served.request("POST", "/v1/snapshots",
                                         {"tag": "base", "warm_cmd": "ok"})
        assert status in (200, 201), body
        status, body, _ = served.request("POST", "/v1/sandboxes", {"snapshot_tag": "base"})
        assert status in (200, 201), body
        sandbox_id = body[0]["id"] if isinstance(body, list) else body["sandboxes"][0]["id"]
        status, body, _ = served.request("GET", f"/v1/sandboxes/{sandbox_id}/console")
        assert status == 404 and "does not exist" in body["error"]
        log = Path(spawner.run_dirs[sandbox_id]) / "console.log"
        log.write_bytes(b"".join(b"line %d\n" % i for i in range(10000)))
        status, body, response = served.request("GET", f"/v1/sandboxes/{sandbox_id}/console",
                                                raw=None)
        assert status == 200 and response.getheader("Content-Type").startswith("text/plain")
        status, body, response = served.request(
            "GET", f"/v1/sandboxes/{sandbox_id}/console?tail=40")
        assert body == b"line 9996\nline 9997\nline 9998\nline 9999\n"
        for bad in ("0", str(MAX_TAIL + 1), "x"):
            status, body, _ = served.request("GET",
                                             f"/v1/sandboxes/{sandbox_id}/console?tail={bad}")
            assert status == 400 and "tail" in body["error"]
        assert served.request("GET", f"/v1/sandboxes/{sandbox_id}/console",
                              token=None)[0] == 401
        assert served.request("GET", "/v1/sandboxes/vm-000000000999/console")[0] == 404


def test_a_console_log_the_vmm_replaced_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host secret\n")
    run = tmp_path / "run"
    run.mkdir()
    log = run / "console.log"
    cases: list[tuple[Any, str]] = [
        (lambda: log.symlink_to(secret), "cannot be opened"),
        (lambda: os.link(secret, log), "not a plain file"),
        (lambda: os.mkfifo(log), "not a plain file"),
        (lambda: log.mkdir(), "not a plain file"),
    ]
    for make, message in cases:
        make()
        with pytest.raises(ConsoleUnavailable, match=message):
            console_tail(run, 1024)
        if log.is_dir() and not log.is_symlink():
            log.rmdir()
        else:
            log.unlink()
    log.write_bytes(b"x" * (MAX_TAIL * 4))
    assert len(console_tail(run, MAX_TAIL * 4)) == MAX_TAIL


def test_a_pack_downloads_and_leaves_no_file(tmp_path: Path) -> None:
    for served in _serve(tmp_path, TOKEN):
        status, body, _ = served.request("POST", "/v1/snapshots", {"tag": "base", "warm_cmd": "ok"})
        assert status in (200, 201), body
        status, body, response = served.request("GET", "/v1/snapshots/base/pack?image=false")
        assert status == 200, body
        assert body[:4] == b"\x28\xb5\x2f\xfd"   # zstd's magic
        assert response.getheader("Content-Disposition") == 'attachment; filename="base.tar.zst"'
        assert list((served.store.root / "pack-downloads").iterdir()) == []
        assert served.request("GET", "/v1/snapshots/nope/pack")[0] == 404
        assert served.request("GET", "/v1/snapshots/base/pack?image=maybe")[0] == 400
        assert served.request("GET", "/v1/snapshots/base/pack", token=None)[0] == 401
