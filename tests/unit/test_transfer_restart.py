"""A daemon restart keeps its push and pull jobs (server/transfers.py): the registry
records each when it starts and when it ends, so the next daemon lists a finished job
as it ended and reports one its predecessor left running as failed, saying why, instead
of forgetting it. Real daemons (the HTTP server and controller of test_server_http, on
one state directory), real registry databases, and real loopback sockets standing for
the registries: one that refuses connections and one that accepts and never answers."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server_http import TOKEN, _serve

from vmfork.client import Controller
from vmfork.server.registry import Registry
from vmfork.server.transfers import INTERRUPTED, MAX_KEPT, Transfers


class StalledRegistry:
    """Accepts connections on loopback and never answers: a pull against it stays
    running until the connection is closed."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.connected = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)
            self.connected.set()

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def stalled() -> Iterator[StalledRegistry]:
    server = StalledRegistry()
    yield server
    server.close()


def refused_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return int(sock.getsockname()[1])


def wait_for(ctl: Controller, job_id: str, status: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = ctl.get_transfer(job_id)
        if job["status"] == status or time.monotonic() > deadline:
            return job
        time.sleep(0.05)


def test_a_restart_reports_the_jobs_it_cut_short_as_failed(tmp_path: Path,
                                                           stalled: StalledRegistry) -> None:
    first = _serve(tmp_path, TOKEN)
    served = next(first)
    try:
        ctl = Controller(served.url, token=TOKEN.decode(), timeout=10)
        quick = ctl.pull_snapshot(f"127.0.0.1:{refused_port()}/team/snaps:x")["id"]
        ended = ctl.wait_transfer(quick, timeout=60)
        assert ended["status"] == "failed" and ended["error"]
        cut = ctl.pull_snapshot(f"127.0.0.1:{stalled.port}/team/snaps:y", tag="y")["id"]
        assert stalled.connected.wait(30)
        assert ctl.get_transfer(cut)["status"] == "running"
    finally:
        first.close()   # the daemon stops with the pull in flight

    second = _serve(tmp_path, TOKEN)
    served = next(second)
    try:
        ctl = Controller(served.url, token=TOKEN.decode(), timeout=10)
        jobs = {j["id"]: j for j in ctl.list_transfers()}
        assert set(jobs) == {quick, cut}
        assert jobs[quick] == ended          # listed again exactly as it ended
        interrupted = ctl.get_transfer(cut)
        assert interrupted["status"] == "failed" and interrupted["error"] == INTERRUPTED
        assert interrupted["kind"] == "pull" and interrupted["tag"] == "y"
        assert interrupted["finished_at_unix"] >= interrupted["started_at_unix"]
        # The restarted daemon runs and records jobs of its own.
        again = ctl.pull_snapshot(f"127.0.0.1:{refused_port()}/team/snaps:z")["id"]
        assert wait_for(ctl, again, "failed")["status"] == "failed"
    finally:
        second.close()

    # A third daemon sees the same three, the interrupted one not failed anew.
    third = _serve(tmp_path, TOKEN)
    served = next(third)
    try:
        ctl = Controller(served.url, token=TOKEN.decode(), timeout=10)
        jobs = {j["id"]: j for j in ctl.list_transfers()}
        assert set(jobs) == {quick, cut, again}
        assert jobs[cut] == interrupted
    finally:
        third.close()


def test_the_registry_keeps_at_most_max_kept_and_skips_unreadable_rows(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry.db")
    try:
        for n in range(MAX_KEPT + 5):
            job = {"id": f"job{n:03d}", "kind": "push", "ref": "h/r:t", "tag": "t",
                   "status": "done", "started_at_unix": 1000.0 + n,
                   "progress": {"what": "", "bytes_done": 1, "bytes_total": 1},
                   "finished_at_unix": 1000.5 + n, "result": {"n": n}}
            registry.save_transfer_job(job["id"], "gone", job["started_at_unix"],
                                       json.dumps(job))
        registry.save_transfer_job("broken", "gone", 5000.0, "{not json")
        listed = Transfers(None, registry).list()
        # The newest MAX_KEPT readable ones; the oldest and the unreadable row are gone.
        assert [j["id"] for j in listed] == [f"job{n:03d}" for n in range(5, MAX_KEPT + 5)]
        assert [row[0] for row in registry.list_transfer_jobs()] == [j["id"] for j in listed]
    finally:
        registry.close()
