"""The spawner's wait loop (``runtime/spawn.py``): what a child's FIFO line is taken for.

Real FIFOs and real status files; a real zygote and child where the loop talks to them,
no VM (the e2e tier spawns real VMs)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from vmfork.runtime import spawn
from vmfork.runtime.spawn import Child
from vmfork.runtime.zygote_client import ZygoteClient, start_zygote
from vmfork.runtime.zygote_protocol import ExitEvent, SpawnItem, SpawnManyResult
from vmfork.store import Snapshot


def test_lines_give_each_childs_last_state(tmp_path: Path) -> None:
    fifo = spawn._Fifo.create(tmp_path / ".notify")
    try:
        writer = os.open(fifo.path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(writer, b"vm-a prepared\nvm-b prepared\nvm-a restored\nvm-c\n")
        os.close(writer)
        assert spawn._read_notifications(fifo.fd) == {"vm-a": "restored", "vm-b": "prepared",
                                                      "vm-c": ""}
        assert spawn._read_notifications(fifo.fd) == {}
    finally:
        fifo.remove()


def test_a_line_short_of_the_state_waited_for_is_taken_without_reading_the_file(
        tmp_path: Path) -> None:
    """``prepared`` and ``restored`` lines are enough while the spawner waits for
    ``ready``: the child's status.json (here still ``prepared``) is not read. The state
    waited for, a failure, a line of no known state and the full scan (no line) read
    the file, whose content the caller keeps (``Child.status``)."""
    child = Child("vm-a", 1, tmp_path)
    (tmp_path / "status.json").write_text(json.dumps({"state": "prepared", "restore_s": 0.1}))
    assert spawn._state_of(child, "restored", ("ready",)) == "restored"
    assert child.status == {}
    for line, done in (("restored", ("restored", "ready")), ("failed", ("ready",)),
                       ("", ("ready",)), (None, ("ready",))):
        child.status = {}
        assert spawn._state_of(child, line, done) == "prepared"
        assert child.status["restore_s"] == 0.1


class _CountingClient(ZygoteClient):
    """The real client of a real zygote, counting the exit-event requests made once
    the spawn was answered."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(socket_path, timeout=60.0)
        self.spawned = False
        self.events_after_spawn = 0

    def spawn_many(self, entry: str, items: Iterable[SpawnItem],
                   timeout: float | None = None) -> SpawnManyResult:
        result = super().spawn_many(entry, items, timeout)
        self.spawned = True
        return result

    def events(self, since: int = 0) -> tuple[list[ExitEvent], int]:
        self.events_after_spawn += self.spawned
        return super().events(since)


def test_the_first_exit_event_check_waits_its_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spawner asks the zygote for exit events no sooner than ``EVENTS_CHECK_S``
    after the spawn, not right after it (where the round trip ran the zygote and the
    spawner while the children waited for the CPU); a child that fails at once is
    still reported, by its status, or, where the zygote reaped it (removing its run
    directory) before the loop read the status its line announced, by its exit event,
    asked for at once. Its snapshot is damaged: the zygote gives it a Python child,
    which reports the failed restore and exits."""
    monkeypatch.setattr(spawn, "EVENTS_CHECK_S", 60.0)
    snapshot_dir = tmp_path / "snapshot"
    snapshot_dir.mkdir()
    (snapshot_dir / "state.bin").write_bytes(b"not a machine state")
    zygote = start_zygote(tmp_path / "z.sock")
    notify = spawn._Fifo.create(tmp_path / ".notify")
    try:
        client = _CountingClient(zygote.socket_path)
        started = time.monotonic()
        # The loop reads only the snapshot's directory.
        snapshot = cast(Snapshot, SimpleNamespace(path=snapshot_dir))
        report = spawn._fork_and_wait(client, snapshot, 1, tmp_path / "vms", None, 60.0,
                                      ("ready",), None, notify, None, [])
        waited = time.monotonic() - started
        client.close()
    finally:
        notify.remove()
        zygote.close()
    assert waited < 60.0
    ((_, reason),) = report.failed
    if client.events_after_spawn == 0:
        assert reason.startswith("restore: "), reason   # its status said why
    else:
        # The zygote reaped it (removing its run directory, status and all) before this
        # loop read the status its line announced: its exit event, asked for at once.
        assert client.events_after_spawn == 1 and reason, reason
