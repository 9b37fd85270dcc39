"""The daemon's SQLite registry: schema versioning, sandboxes, snapshot jobs, restart."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from vmfork.server.registry import (
    EXITED,
    FAILED,
    LOST,
    RUNNING,
    SCHEMA_VERSION,
    WRITING,
    Registry,
    RegistryError,
    SandboxRecord,
)


def _record(i: int, status: str = RUNNING) -> SandboxRecord:
    return SandboxRecord(id=f"vm-{i:012x}", snapshot_tag="base", pid=1000 + i,
                         run_dir=f"/run/x/vm-{i}", status=status, created_at=100.0 + i,
                         memory_limit_mib=128)


def test_schema_version_and_wal(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    assert reg.schema_version() == SCHEMA_VERSION
    reg.close()
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    Registry(tmp_path / "r.db").close()  # reopening an up-to-date database is a no-op


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    Registry(tmp_path / "r.db").close()
    db = sqlite3.connect(tmp_path / "r.db")
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(RegistryError, match="newer"):
        Registry(tmp_path / "r.db")


def test_sandbox_lifecycle(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    reg.add_sandboxes([_record(1), _record(2)])
    assert [r.id for r in reg.list_sandboxes()] == [_record(1).id, _record(2).id]
    assert reg.get_sandbox(_record(1).id) == _record(1)
    assert reg.get_sandbox("vm-nope") is None
    assert reg.count_sandboxes() == 2
    assert reg.mark_ended(_record(1).id, EXITED, "killed", "killed by signal 9")
    assert not reg.mark_ended(_record(1).id, EXITED, "killed", "twice")  # already ended
    ended = reg.get_sandbox(_record(1).id)
    assert ended is not None and ended.status == EXITED and ended.exit_reason == "killed"
    assert ended.ended_at is not None
    assert [r.id for r in reg.list_sandboxes(RUNNING)] == [_record(2).id]
    assert reg.remove_sandbox(_record(1).id)
    assert not reg.remove_sandbox(_record(1).id)


def test_running_sandboxes_counted_by_snapshot(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    assert reg.running_by_snapshot() == {}
    other = [SandboxRecord(id=f"vm-other-{i}", snapshot_tag="other", pid=2000 + i,
                           run_dir=f"/run/x/o-{i}", status=RUNNING, created_at=200.0)
             for i in range(3)]
    reg.add_sandboxes([_record(1), _record(2), _record(3), *other])
    assert reg.mark_ended(_record(2).id, EXITED, "killed", "killed by signal 9")
    assert reg.mark_ended(other[0].id, EXITED, "exited", "exited 0")
    assert reg.running_by_snapshot() == {"base": 2, "other": 2}
    assert sum(reg.running_by_snapshot().values()) == reg.count_sandboxes()


def test_duplicate_id_rolls_back_the_whole_batch(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    reg.add_sandboxes([_record(1)])
    with pytest.raises(sqlite3.IntegrityError):
        reg.add_sandboxes([_record(2), _record(1)])
    assert [r.id for r in reg.list_sandboxes()] == [_record(1).id]


def test_restart_marks_running_sandboxes_lost_and_orphaned_jobs_failed(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    reg.add_sandboxes([_record(1), _record(2, EXITED)])
    assert reg.begin_snapshot_job("half", daemon_pid=1)
    reg.close()
    reg = Registry(tmp_path / "r.db")
    assert reg.mark_all_running_lost("daemon-restart", "gone") == [_record(1).id]
    lost = reg.get_sandbox(_record(1).id)
    assert lost is not None and lost.status == LOST
    other = reg.get_sandbox(_record(2).id)
    assert other is not None and other.status == EXITED
    assert reg.fail_orphaned_snapshot_jobs(daemon_pid=2) == ["half"]
    job = reg.get_snapshot_job("half")
    assert job is not None and job.status == FAILED and job.error and "Create it again" in job.error


def test_snapshot_jobs(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")
    assert reg.begin_snapshot_job("a", 7)
    assert not reg.begin_snapshot_job("a", 7)  # in flight
    job = reg.get_snapshot_job("a")
    assert job is not None and job.status == WRITING
    assert not reg.forget_snapshot_job("a")  # a writing job cannot be forgotten
    reg.finish_snapshot_job("a", "boot failed")
    assert reg.begin_snapshot_job("a", 7)  # a failed one can be retried
    reg.finish_snapshot_job("a", None)
    assert reg.get_snapshot_job("a") is None
    reg.begin_snapshot_job("b", 7)
    reg.finish_snapshot_job("b", "x")
    assert [j.tag for j in reg.list_snapshot_jobs()] == ["b"]
    assert reg.forget_snapshot_job("b")


def test_concurrent_writers(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db")

    def add(base: int) -> None:
        for i in range(50):
            reg.add_sandboxes([_record(base + i)])

    threads = [threading.Thread(target=add, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reg.count_sandboxes() == 200
