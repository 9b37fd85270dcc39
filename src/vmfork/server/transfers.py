"""Push and pull of snapshots through the daemon, as background jobs with progress.

``POST /v1/snapshots/{tag}/push`` and ``POST /v1/snapshots/pull`` answer ``202`` with
a job (``id``, ``kind``, ``status`` running|done|failed, ``progress`` in bytes and
blobs, then ``result`` or ``error``); ``GET /v1/transfers/{job}`` and ``GET
/v1/transfers`` show them. The work is ``vmfork.store.distribution``'s, run in a
thread of the daemon against its store.

Bounded, since clients drive it: at most ``MAX_RUNNING`` transfers at once (more is
``503`` with ``Retry-After``), and at most ``MAX_KEPT`` finished jobs remembered
(the oldest finished are forgotten first).

Jobs are recorded in the daemon's registry (SQLite, ``transfer_jobs``) when they start
and when they end (progress is kept in memory only), so a restarted daemon still lists
the jobs that finished before it, and reports the ones its predecessor left running as
failed, with the reason (``INTERRUPTED``), instead of forgetting them: their threads
died with the old daemon, and a transfer is not resumed by itself. A pull cut short
left nothing in the store (the store removes its pending directory); a push cut short
tagged nothing in the registry (the manifest goes last).
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmfork.server.errors import BadRequest, Busy, NotFound
from vmfork.server.validation import check_host_path

log = logging.getLogger(__name__)

MAX_RUNNING = 2
MAX_KEPT = 64
PUSH_FIELDS_HELP = "ref, sign_key, auth_file, insecure, with_image"
INTERRUPTED = ("the daemon stopped while this transfer was running, so it never finished; "
               "nothing of it was published (a pull cut short stores nothing, a push cut "
               "short tags nothing): start it again")


@dataclass
class TransferJob:
    id: str
    kind: str                       # "push" | "pull"
    ref: str
    tag: str | None
    status: str = "running"
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    what: str = ""
    bytes_done: int = 0
    bytes_total: int = 0
    result: dict[str, Any] | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "kind": self.kind, "ref": self.ref, "tag": self.tag,
            "status": self.status, "started_at_unix": self.started_at,
            "progress": {"what": self.what, "bytes_done": self.bytes_done,
                         "bytes_total": self.bytes_total}}
        if self.finished_at is not None:
            out["finished_at_unix"] = self.finished_at
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TransferJob:
        """The job ``to_json`` gave (as the registry keeps it)."""
        progress = data["progress"]
        return cls(id=str(data["id"]), kind=str(data["kind"]), ref=str(data["ref"]),
                   tag=data["tag"], status=str(data["status"]),
                   started_at=float(data["started_at_unix"]),
                   finished_at=data.get("finished_at_unix"), what=str(progress["what"]),
                   bytes_done=int(progress["bytes_done"]),
                   bytes_total=int(progress["bytes_total"]), result=data.get("result"),
                   error=data.get("error"))


class Transfers:
    """The jobs of one daemon (one store), recorded in its registry when there is one."""

    def __init__(self, store: Any, registry: Any = None) -> None:
        self.store = store
        self.registry = registry
        self.owner = secrets.token_hex(8)     # this daemon, in the registry's rows
        self._lock = threading.Lock()
        self._jobs: dict[str, TransferJob] = {}
        if registry is not None:
            self._load_previous()

    def _load_previous(self) -> None:
        """The jobs earlier daemons recorded, the newest ``MAX_KEPT``. One still marked
        running was cut short by its daemon's end (no thread of this daemon runs it): it
        becomes failed, saying so, in the registry too."""
        rows = self.registry.list_transfer_jobs()
        unreadable: list[str] = []
        interrupted: list[str] = []
        for job_id, owner, raw in rows:
            try:
                job = TransferJob.from_json(json.loads(raw))
            except (ValueError, KeyError, TypeError, RecursionError):
                unreadable.append(job_id)
                continue
            if job.status == "running" and owner != self.owner:
                job.status, job.error, job.finished_at = "failed", INTERRUPTED, time.time()
                self._save(job)
                interrupted.append(job.id)
            self._jobs[job.id] = job
        excess = list(self._jobs)[:max(0, len(self._jobs) - MAX_KEPT)]
        for job_id in excess:
            del self._jobs[job_id]
        if unreadable or excess:
            self.registry.forget_transfer_jobs(unreadable + excess)
        if interrupted:
            log.warning("transfers a previous daemon left running marked failed: %s",
                        ", ".join(interrupted))

    def _save(self, job: TransferJob) -> None:
        if self.registry is not None:
            self.registry.save_transfer_job(job.id, self.owner, job.started_at,
                                            json.dumps(job.to_json()))

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [j.to_json() for j in self._jobs.values()]

    def get(self, job_id: str) -> dict[str, Any]:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise NotFound(f"no transfer job {job_id!r} (the daemon keeps the last "
                               f"{MAX_KEPT} finished jobs)")
            return job.to_json()

    def start(self, kind: str, ref: str, tag: str | None, work: Any) -> dict[str, Any]:
        with self._lock:
            running = sum(j.status == "running" for j in self._jobs.values())
            if running >= MAX_RUNNING:
                raise Busy(f"{running} transfers are running (at most {MAX_RUNNING}); retry "
                           "when one is done", retry_after=5)
            finished = [j for j in self._jobs.values() if j.status != "running"]
            forgotten = [old.id for old in sorted(finished, key=lambda j: j.started_at)[:max(
                0, len(self._jobs) + 1 - MAX_KEPT)]]
            for old_id in forgotten:
                del self._jobs[old_id]
            job = TransferJob(secrets.token_hex(8), kind, ref, tag)
            # Recorded before it runs: a registry that cannot take it refuses the job.
            self._save(job)
            self._jobs[job.id] = job
        if forgotten and self.registry is not None:
            self.registry.forget_transfer_jobs(forgotten)
        threading.Thread(target=self._run, args=(job, work), name=f"transfer-{job.id}",
                         daemon=True).start()
        return job.to_json()

    def _run(self, job: TransferJob, work: Any) -> None:
        def progress(what: str, done: int, total: int) -> None:
            job.what, job.bytes_done, job.bytes_total = what, done, total

        try:
            report = work(progress)
            result = {k: v for k, v in vars(report).items()}
            with self._lock:
                job.result, job.status = result, "done"
        except Exception as err:   # noqa: BLE001 - the job records any failure
            with self._lock:
                job.error, job.status = str(err) or type(err).__name__, "failed"
        finally:
            job.finished_at = time.time()
        try:
            self._save(job)
        except sqlite3.Error as err:
            # Still reported from memory; a restart would call it interrupted.
            log.warning("could not record the end of transfer %s: %s", job.id, err)


_BY_CONTROLLER: weakref.WeakKeyDictionary[Any, Transfers] = weakref.WeakKeyDictionary()
_BY_CONTROLLER_LOCK = threading.Lock()


def transfers_of(controller: Any) -> Transfers:
    with _BY_CONTROLLER_LOCK:
        found = _BY_CONTROLLER.get(controller)
        if found is None:
            found = _BY_CONTROLLER[controller] = Transfers(controller.store,
                                                           controller.registry)
        return found


def check_ref(value: Any) -> str | None:
    from vmfork.image.errors import ImageBuildError
    from vmfork.image.registry import parse_registry_ref
    if not isinstance(value, str) or len(value) > 512:
        return "must be a string HOST[:PORT]/REPO[:TAG|@sha256:HEX] of at most 512 characters"
    try:
        parse_registry_ref(value)
    except ImageBuildError as err:
        return str(err)
    return None


def optional_path(value: Any) -> Path | None:
    if value is None:
        return None
    problem = check_host_path(value)
    if problem is not None:
        raise BadRequest(f"a key or auth file path {problem}")
    return Path(value)
