"""The daemon's registry: sandboxes and in-flight snapshots, in SQLite.

Why SQLite and not a JSON file (forkd keeps its state in memory and loses its
in-flight snapshots on restart): every change is one transaction, so a crash
mid-write leaves the previous state, never a half-written file; WAL mode lets
request threads read while another thread writes. One connection is shared
behind a lock: the daemon's writes are tiny and rare next to VM work, and a
single connection keeps transactions strictly ordered.

The schema carries its version in ``schema_version``; ``_MIGRATIONS[i]`` takes a
database from version ``i`` to ``i + 1``, so an older database is upgraded in
place and a newer one is refused (an older daemon must not misread it).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 6

_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        snapshot_tag TEXT NOT NULL,
        pid INTEGER NOT NULL,
        run_dir TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at REAL NOT NULL,
        memory_limit_mib INTEGER,
        branch_count INTEGER NOT NULL DEFAULT 0,
        last_branch_memory_path TEXT,
        exit_reason TEXT,
        exit_description TEXT,
        ended_at REAL
    );
    CREATE TABLE snapshot_jobs (
        tag TEXT PRIMARY KEY,
        status TEXT NOT NULL,
        started_at REAL NOT NULL,
        finished_at REAL,
        error TEXT,
        daemon_pid INTEGER NOT NULL
    );
    """,
    """
    CREATE TABLE workspaces (
        name TEXT PRIMARY KEY,
        snapshot_tag TEXT NOT NULL,
        sandbox_id TEXT,
        suspended_tag TEXT,
        memory_limit_mib INTEGER,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    """,
    # A sandbox's own network (per_child_netns): what a restarted daemon needs to
    # re-adopt it or, if the sandbox is gone, to know it must be removed. A table of
    # its own, so that sandboxes without networking carry nothing.
    """
    CREATE TABLE sandbox_networks (
        sandbox_id TEXT PRIMARY KEY,
        network TEXT NOT NULL
    );
    """,
    # Read-write volumes and who holds each (a sandbox, a workspace, or a spawn in
    # progress): one holder per file, so a second attach is refused (409).
    """
    CREATE TABLE volume_holds (
        key TEXT PRIMARY KEY,
        path TEXT NOT NULL,
        guest_path TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        holder TEXT NOT NULL,
        since REAL NOT NULL
    );
    """,
    # Lifecycle (issue 15): a sandbox's timeout (``end_at``, moved by set_timeout, and
    # what happens then: kill or pause), its metadata and sandbox-wide environment (JSON
    # string maps), while it is paused the snapshot it resumes from, and the volumes it
    # was spawned with (JSON, as SandboxInfo lists them).
    """
    ALTER TABLE sandboxes ADD COLUMN timeout_secs REAL;
    ALTER TABLE sandboxes ADD COLUMN end_at REAL;
    ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'kill';
    ALTER TABLE sandboxes ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE sandboxes ADD COLUMN envs TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE sandboxes ADD COLUMN paused_tag TEXT;
    ALTER TABLE sandboxes ADD COLUMN paused_at REAL;
    ALTER TABLE sandboxes ADD COLUMN volumes TEXT NOT NULL DEFAULT '[]';
    """,
    # Push and pull jobs (server/transfers.py): each job as its JSON, with the daemon
    # that ran it (``owner``), so that a restarted daemon reports the ones its
    # predecessor left running as failed instead of forgetting them. IF NOT EXISTS: a
    # migration re-run over a database that has the table is harmless.
    """
    CREATE TABLE IF NOT EXISTS transfer_jobs (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        started_at REAL NOT NULL,
        job TEXT NOT NULL
    );
    """,
)

# Sandbox states. ``running``: its VMM process is alive as far as the daemon knows;
# ``exited``: it died (the reason says how: exited, killed, oom-killed, crashed);
# ``lost``: the daemon restarted and could not re-adopt it; ``paused``: its VMM is
# stopped and its state is in a snapshot (``paused_tag``) it resumes from, same id.
RUNNING = "running"
PAUSED = "paused"
EXITED = "exited"
LOST = "lost"

# Snapshot job states, as forkd's SnapshotInfo ``status``.
WRITING = "writing"
FAILED = "failed"


_ORPHANED_JOB = ("the daemon stopped while this snapshot was being written; its partial "
                 "files were removed. Create it again.")


def _column_exists(db: sqlite3.Connection, statement: str) -> bool:
    """Whether ``statement`` is an ``ALTER TABLE t ADD COLUMN c`` whose column is there
    already (SQLite has no ``IF NOT EXISTS`` for columns): a migration is re-run safely
    on a database that got the column but not the version bump."""
    words = statement.split()
    if [w.upper() for w in words[:2]] != ["ALTER", "TABLE"] or len(words) < 6 or \
            [w.upper() for w in words[3:5]] != ["ADD", "COLUMN"]:
        return False
    columns = {row[1] for row in db.execute(f"PRAGMA table_info({words[2]})")}
    return words[5] in columns


class RegistryError(Exception):
    """The registry database cannot be opened or is from a newer vmfork."""


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    snapshot_tag: str
    pid: int
    run_dir: str
    status: str
    created_at: float
    memory_limit_mib: int | None = None
    branch_count: int = 0
    last_branch_memory_path: str | None = None
    exit_reason: str | None = None
    exit_description: str | None = None
    ended_at: float | None = None
    timeout_secs: float | None = None    # the lifetime last set (a resume renews it)
    end_at: float | None = None          # when the reaper ends it (None: never)
    on_timeout: str = "kill"             # what it does then: kill or pause
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    paused_tag: str | None = None
    paused_at: float | None = None
    volumes: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> SandboxRecord:
        values = list(row)
        values[15] = json.loads(values[15])
        values[16] = json.loads(values[16])
        values[19] = json.loads(values[19])
        return cls(*values)

    def to_row(self) -> tuple[Any, ...]:
        return (self.id, self.snapshot_tag, self.pid, self.run_dir, self.status,
                self.created_at, self.memory_limit_mib, self.branch_count,
                self.last_branch_memory_path, self.exit_reason, self.exit_description,
                self.ended_at, self.timeout_secs, self.end_at, self.on_timeout,
                json.dumps(self.metadata, sort_keys=True),
                json.dumps(self.envs, sort_keys=True), self.paused_tag, self.paused_at,
                json.dumps(self.volumes))


@dataclass(frozen=True)
class SnapshotJob:
    tag: str
    status: str
    started_at: float
    finished_at: float | None
    error: str | None
    daemon_pid: int


@dataclass(frozen=True)
class WorkspaceRecord:
    """A named, long-lived sandbox: running (``sandbox_id``) or suspended to a snapshot
    (``suspended_tag``), never both."""

    name: str
    snapshot_tag: str
    sandbox_id: str | None
    suspended_tag: str | None
    memory_limit_mib: int | None
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class VolumeHold:
    """A read-write volume's file and who holds it: ``sandbox:<id>``,
    ``workspace:<name>`` (kept while the workspace is suspended) or ``spawn:<token>``
    (a spawn that has not finished)."""

    key: str
    path: str
    guest_path: str
    size_bytes: int
    holder: str
    since: float


_WORKSPACE_COLUMNS = ("name, snapshot_tag, sandbox_id, suspended_tag, memory_limit_mib, "
                      "created_at, updated_at")

_SANDBOX_COLUMNS = ("id, snapshot_tag, pid, run_dir, status, created_at, memory_limit_mib, "
                    "branch_count, last_branch_memory_path, exit_reason, exit_description, "
                    "ended_at, timeout_secs, end_at, on_timeout, metadata, envs, paused_tag, paused_at, volumes")


class Registry:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(self.path), isolation_level=None,
                                       check_same_thread=False, timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._migrate()
        except sqlite3.Error as err:
            raise RegistryError(f"cannot open the registry database {self.path}: {err}; "
                                "check the --state directory's permissions and free "
                                "space") from err

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _migrate(self) -> None:
        with self._transaction() as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            version = 0 if row is None else int(row[0])
            if version > SCHEMA_VERSION:
                raise RegistryError(f"the registry {self.path} has schema version {version}, "
                                    f"newer than this vmfork's {SCHEMA_VERSION}; run a newer "
                                    "vmfork or give this one another --state directory")
            for script in _MIGRATIONS[version:]:
                for statement in script.split(";"):
                    if statement.strip() and not _column_exists(db, statement):
                        db.execute(statement)
            if row is None:
                db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            else:
                db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))

    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT version FROM schema_version").fetchone()[0])

    # -- sandboxes ----------------------------------------------------------------

    def add_sandboxes(self, records: list[SandboxRecord]) -> None:
        with self._transaction() as db:
            db.executemany(
                f"INSERT INTO sandboxes ({_SANDBOX_COLUMNS}) VALUES "
                f"({', '.join('?' * 20)})", [r.to_row() for r in records])

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_SANDBOX_COLUMNS} FROM sandboxes WHERE id = ?",
                                   (sandbox_id,)).fetchone()
        return None if row is None else SandboxRecord.from_row(row)

    def list_sandboxes(self, status: str | None = None) -> list[SandboxRecord]:
        query = f"SELECT {_SANDBOX_COLUMNS} FROM sandboxes"
        params: tuple[str, ...] = ()
        if status is not None:
            query += " WHERE status = ?"
            params = (status,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_at, id", params).fetchall()
        return [SandboxRecord.from_row(row) for row in rows]

    def running_by_snapshot(self) -> dict[str, int]:
        """How many sandboxes run from each snapshot, by tag: what admission weighs,
        counted by SQLite (a record decoded per running sandbox made every spawn's
        admission grow with them: 14 ms at 1,000 natively, under the admission lock)."""
        with self._lock:
            rows = self._db.execute("SELECT snapshot_tag, COUNT(*) FROM sandboxes "
                                    "WHERE status = ? GROUP BY snapshot_tag",
                                    (RUNNING,)).fetchall()
        return {str(tag): int(count) for tag, count in rows}

    def count_sandboxes(self, status: str = RUNNING) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM sandboxes WHERE status = ?",
                                        (status,)).fetchone()[0])

    def mark_ended(self, sandbox_id: str, status: str, reason: str, description: str) -> bool:
        """Record that a running sandbox ended; False if it was not running (or unknown)."""
        with self._transaction() as db:
            cur = db.execute(
                "UPDATE sandboxes SET status = ?, exit_reason = ?, exit_description = ?, "
                "ended_at = ? WHERE id = ? AND status = ?",
                (status, reason, description, time.time(), sandbox_id, RUNNING))
            return cur.rowcount == 1

    def mark_all_running_lost(self, reason: str, description: str) -> list[str]:
        """At start-up: every sandbox still marked running belonged to a previous daemon."""
        with self._transaction() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM sandboxes WHERE status = ?",
                                            (RUNNING,))]
            db.execute("UPDATE sandboxes SET status = ?, exit_reason = ?, exit_description = ?, "
                       "ended_at = ? WHERE status = ?",
                       (LOST, reason, description, time.time(), RUNNING))
        return ids

    def record_branch(self, sandbox_id: str, memory_path: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE sandboxes SET branch_count = branch_count + 1, "
                       "last_branch_memory_path = ? WHERE id = ?", (memory_path, sandbox_id))

    def remove_sandbox(self, sandbox_id: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,)).rowcount == 1

    # -- lifecycle (timeouts, pause/resume) ---------------------------------------

    def set_timeout(self, sandbox_id: str, timeout_secs: float | None,
                    end_at: float | None) -> bool:
        """Set a running sandbox's lifetime and deadline; False if it is not running."""
        with self._transaction() as db:
            return db.execute("UPDATE sandboxes SET timeout_secs = ?, end_at = ? WHERE id = ? "
                              "AND status = ?",
                              (timeout_secs, end_at, sandbox_id, RUNNING)).rowcount == 1

    def expired(self, now: float) -> list[SandboxRecord]:
        """Running sandboxes whose deadline has passed (paused ones wait for a resume)."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_SANDBOX_COLUMNS} FROM sandboxes WHERE status "
                                    "= ? AND end_at IS NOT NULL AND end_at <= ? ORDER BY "
                                    "end_at", (RUNNING, now)).fetchall()
        return [SandboxRecord.from_row(row) for row in rows]

    def claim_expired(self, sandbox_id: str, end_at: float) -> bool:
        """The reaper's compare-and-set: True (and the deadline cleared, so no one else
        acts on it) only if the sandbox still runs with the deadline the reaper read. A
        ``set_timeout`` that moved it in the meantime wins."""
        with self._transaction() as db:
            return db.execute("UPDATE sandboxes SET end_at = NULL WHERE id = ? AND status = ? "
                              "AND end_at = ?", (sandbox_id, RUNNING, end_at)).rowcount == 1

    def mark_paused(self, sandbox_id: str, paused_tag: str) -> bool:
        """A running sandbox was captured into ``paused_tag`` and its VMM is being
        stopped. A paused sandbox has no deadline: it waits for a resume or a delete."""
        with self._transaction() as db:
            return db.execute(
                "UPDATE sandboxes SET status = ?, paused_tag = ?, paused_at = ?, end_at = NULL "
                "WHERE id = ? AND status = ?",
                (PAUSED, paused_tag, time.time(), sandbox_id, RUNNING)).rowcount == 1

    def mark_resumed(self, sandbox_id: str, pid: int, run_dir: str,
                     timeout_secs: float | None, end_at: float | None) -> bool:
        """A paused sandbox runs again, same id, in a new VMM. ``paused_tag`` stays: the
        new VMM maps its memory from that snapshot, so it lives as long as the sandbox."""
        with self._transaction() as db:
            return db.execute(
                "UPDATE sandboxes SET status = ?, pid = ?, run_dir = ?, paused_at = NULL, "
                "timeout_secs = ?, end_at = ? WHERE id = ? AND status = ?",
                (RUNNING, pid, run_dir, timeout_secs, end_at, sandbox_id,
                 PAUSED)).rowcount == 1

    # -- sandbox networks ---------------------------------------------------------

    def put_network(self, sandbox_id: str, network_json: str) -> None:
        """Record (or replace) the network of a sandbox, as ``ChildNetwork.to_record`` JSON."""
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO sandbox_networks (sandbox_id, network) "
                       "VALUES (?, ?)", (sandbox_id, network_json))

    def get_network(self, sandbox_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT network FROM sandbox_networks WHERE sandbox_id = ?",
                                   (sandbox_id,)).fetchone()
        return None if row is None else str(row[0])

    def list_networks(self) -> dict[str, str]:
        with self._lock:
            rows = self._db.execute("SELECT sandbox_id, network FROM sandbox_networks "
                                    "ORDER BY sandbox_id").fetchall()
        return {str(r[0]): str(r[1]) for r in rows}

    def remove_network(self, sandbox_id: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM sandbox_networks WHERE sandbox_id = ?",
                              (sandbox_id,)).rowcount == 1

    # -- read-write volume holds ----------------------------------------------------

    def hold_volumes(self, holds: list[VolumeHold]) -> VolumeHold | None:
        """Record every hold, or none: the hold already on a key if one is taken."""
        with self._transaction() as db:
            for hold in holds:
                row = db.execute("SELECT key, path, guest_path, size_bytes, holder, since "
                                 "FROM volume_holds WHERE key = ?", (hold.key,)).fetchone()
                if row is not None:
                    return VolumeHold(*row)
            db.executemany("INSERT INTO volume_holds (key, path, guest_path, size_bytes, "
                           "holder, since) VALUES (?, ?, ?, ?, ?, ?)",
                           [(h.key, h.path, h.guest_path, h.size_bytes, h.holder, h.since)
                            for h in holds])
        return None

    def volumes_held_by(self, holder: str) -> list[VolumeHold]:
        with self._lock:
            rows = self._db.execute("SELECT key, path, guest_path, size_bytes, holder, since "
                                    "FROM volume_holds WHERE holder = ? ORDER BY guest_path",
                                    (holder,)).fetchall()
        return [VolumeHold(*row) for row in rows]

    def list_volume_holds(self) -> list[VolumeHold]:
        with self._lock:
            rows = self._db.execute("SELECT key, path, guest_path, size_bytes, holder, since "
                                    "FROM volume_holds ORDER BY holder, guest_path").fetchall()
        return [VolumeHold(*row) for row in rows]

    def move_volume_holds(self, holder: str, new_holder: str) -> int:
        with self._transaction() as db:
            return db.execute("UPDATE volume_holds SET holder = ? WHERE holder = ?",
                              (new_holder, holder)).rowcount

    def release_volumes_of_unfinished_spawns(self) -> int:
        with self._transaction() as db:
            return db.execute("DELETE FROM volume_holds WHERE holder LIKE 'spawn:%'").rowcount

    def release_volumes(self, holder: str) -> int:
        with self._transaction() as db:
            return db.execute("DELETE FROM volume_holds WHERE holder = ?",
                              (holder,)).rowcount

    # -- workspaces ---------------------------------------------------------------

    def add_workspace(self, record: WorkspaceRecord) -> bool:
        """False if the name is taken."""
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM workspaces WHERE name = ?",
                          (record.name,)).fetchone():
                return False
            db.execute(f"INSERT INTO workspaces ({_WORKSPACE_COLUMNS}) VALUES "
                       "(?, ?, ?, ?, ?, ?, ?)",
                       (record.name, record.snapshot_tag, record.sandbox_id,
                        record.suspended_tag, record.memory_limit_mib, record.created_at,
                        record.updated_at))
            return True

    def get_workspace(self, name: str) -> WorkspaceRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_WORKSPACE_COLUMNS} FROM workspaces WHERE "
                                   "name = ?", (name,)).fetchone()
        return None if row is None else WorkspaceRecord(*row)

    def list_workspaces(self) -> list[WorkspaceRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_WORKSPACE_COLUMNS} FROM workspaces "
                                    "ORDER BY name").fetchall()
        return [WorkspaceRecord(*row) for row in rows]

    def set_workspace(self, name: str, sandbox_id: str | None,
                      suspended_tag: str | None) -> None:
        with self._transaction() as db:
            db.execute("UPDATE workspaces SET sandbox_id = ?, suspended_tag = ?, "
                       "updated_at = ? WHERE name = ?",
                       (sandbox_id, suspended_tag, time.time(), name))

    def remove_workspace(self, name: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM workspaces WHERE name = ?",
                              (name,)).rowcount == 1

    # -- snapshot jobs ------------------------------------------------------------

    def begin_snapshot_job(self, tag: str, daemon_pid: int) -> bool:
        """Claim ``tag`` for a snapshot being written; False if a job is already writing it.

        A finished (failed) job's row is replaced: the failure was reported already.
        """
        with self._transaction() as db:
            row = db.execute("SELECT status FROM snapshot_jobs WHERE tag = ?",
                             (tag,)).fetchone()
            if row is not None and row[0] == WRITING:
                return False
            db.execute("INSERT OR REPLACE INTO snapshot_jobs (tag, status, started_at, "
                       "finished_at, error, daemon_pid) VALUES (?, ?, ?, NULL, NULL, ?)",
                       (tag, WRITING, time.time(), daemon_pid))
            return True

    def finish_snapshot_job(self, tag: str, error: str | None) -> None:
        """A job succeeded (its row goes: the store now lists the tag) or failed (kept)."""
        with self._transaction() as db:
            if error is None:
                db.execute("DELETE FROM snapshot_jobs WHERE tag = ?", (tag,))
            else:
                db.execute("UPDATE snapshot_jobs SET status = ?, finished_at = ?, error = ? "
                           "WHERE tag = ?", (FAILED, time.time(), error, tag))

    def forget_snapshot_job(self, tag: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM snapshot_jobs WHERE tag = ? AND status != ?",
                              (tag, WRITING)).rowcount == 1

    def get_snapshot_job(self, tag: str) -> SnapshotJob | None:
        with self._lock:
            row = self._db.execute("SELECT tag, status, started_at, finished_at, error, "
                                   "daemon_pid FROM snapshot_jobs WHERE tag = ?",
                                   (tag,)).fetchone()
        return None if row is None else SnapshotJob(*row)

    def list_snapshot_jobs(self) -> list[SnapshotJob]:
        with self._lock:
            rows = self._db.execute("SELECT tag, status, started_at, finished_at, error, "
                                    "daemon_pid FROM snapshot_jobs ORDER BY tag").fetchall()
        return [SnapshotJob(*row) for row in rows]

    def fail_orphaned_snapshot_jobs(self, daemon_pid: int) -> list[str]:
        """At start-up: jobs a previous daemon left ``writing`` can never finish (the store
        removes their pending directories); they become ``failed`` with that reason."""
        with self._transaction() as db:
            tags = [r[0] for r in db.execute(
                "SELECT tag FROM snapshot_jobs WHERE status = ? AND daemon_pid != ?",
                (WRITING, daemon_pid))]
            db.execute("UPDATE snapshot_jobs SET status = ?, finished_at = ?, error = ? "
                       "WHERE status = ? AND daemon_pid != ?",
                       (FAILED, time.time(), _ORPHANED_JOB, WRITING, daemon_pid))
        return tags

    # -- transfer jobs (server/transfers.py) ----------------------------------------

    def save_transfer_job(self, job_id: str, owner: str, started_at: float,
                          job_json: str) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO transfer_jobs (id, owner, started_at, job) "
                       "VALUES (?, ?, ?, ?)", (job_id, owner, started_at, job_json))

    def list_transfer_jobs(self) -> list[tuple[str, str, str]]:
        """``(id, owner, job JSON)``, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT id, owner, job FROM transfer_jobs "
                                    "ORDER BY started_at, id").fetchall()
        return [(str(a), str(b), str(c)) for a, b, c in rows]

    def forget_transfer_jobs(self, job_ids: list[str]) -> None:
        with self._transaction() as db:
            db.executemany("DELETE FROM transfer_jobs WHERE id = ?", [(i,) for i in job_ids])
