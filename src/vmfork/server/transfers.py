"""Push and pull of snapshots through the daemon, as background jobs with progress.

``POST /v1/snapshots/{tag}/push`` and ``POST /v1/snapshots/pull`` answer ``202`` with
a job (``id``, ``kind``, ``status`` running|done|failed, ``progress`` in bytes and
blobs, then ``result`` or ``error``); ``GET /v1/transfers/{job}`` and ``GET
/v1/transfers`` show them. The work is ``vmfork.store.distribution``'s, run in a
thread of the daemon against its store.

Bounded, since clients drive it: at most ``MAX_RUNNING`` transfers at once (more is
``503`` with ``Retry-After``), and at most ``MAX_KEPT`` finished jobs remembered
(the oldest finished are forgotten first). Jobs live in the daemon's memory only: a
restart forgets them, and a pull cut short by one left nothing in the store (the
store removes its pending directory).
"""

from __future__ import annotations

import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmfork.server.errors import BadRequest, Busy, NotFound
from vmfork.server.validation import check_host_path

MAX_RUNNING = 2
MAX_KEPT = 64
PUSH_FIELDS_HELP = "ref, sign_key, auth_file, insecure, with_image"


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


class Transfers:
    """The jobs of one daemon (one store)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._jobs: dict[str, TransferJob] = {}

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [j.to_json() for j in self._jobs.values()]

    def get(self, job_id: str) -> dict[str, Any]:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise NotFound(f"no transfer job {job_id!r} (jobs are kept in the daemon's "
                               f"memory, the last {MAX_KEPT} finished ones)")
            return job.to_json()

    def start(self, kind: str, ref: str, tag: str | None, work: Any) -> dict[str, Any]:
        with self._lock:
            running = sum(j.status == "running" for j in self._jobs.values())
            if running >= MAX_RUNNING:
                raise Busy(f"{running} transfers are running (at most {MAX_RUNNING}); retry "
                           "when one is done", retry_after=5)
            finished = [j for j in self._jobs.values() if j.status != "running"]
            for old in sorted(finished, key=lambda j: j.started_at)[:max(
                    0, len(self._jobs) + 1 - MAX_KEPT)]:
                del self._jobs[old.id]
            job = TransferJob(secrets.token_hex(8), kind, ref, tag)
            self._jobs[job.id] = job
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


_BY_CONTROLLER: weakref.WeakKeyDictionary[Any, Transfers] = weakref.WeakKeyDictionary()
_BY_CONTROLLER_LOCK = threading.Lock()


def transfers_of(controller: Any) -> Transfers:
    with _BY_CONTROLLER_LOCK:
        found = _BY_CONTROLLER.get(controller)
        if found is None:
            found = _BY_CONTROLLER[controller] = Transfers(controller.store)
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
