"""The audit log: one JSON object per request, appended to a file.

Fields are forkd's (``ts, method, path, status, latency_us, ua``) plus ``remote``
and the ids a request touched (``sandbox_ids``, ``snapshot_tag``, ``image``), so "who
killed this sandbox" is a grep. Each line is written with one ``write`` to a file opened
``O_APPEND``, so concurrent request threads never interleave within a line.

Log rotation: ``logrotate`` renames the file and sends SIGHUP. The signal handler
only calls ``request_reopen`` (sets a flag); the next write reopens the path.
Reopening inside the handler could deadlock, because the handler runs in the
main thread between bytecodes, possibly while that thread holds the write lock.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class AuditEntry:
    method: str
    path: str
    status: int
    latency_us: int
    ua: str
    remote: str
    sandbox_ids: list[str] = field(default_factory=list)
    snapshot_tag: str | None = None
    image: str | None = None
    ts: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.ts))
            + f".{int(self.ts % 1 * 1e6):06d}Z",
            "method": self.method, "path": self.path, "status": self.status,
            "latency_us": self.latency_us, "ua": self.ua, "remote": self.remote}
        if self.sandbox_ids:
            out["sandbox_ids"] = self.sandbox_ids
        if self.snapshot_tag is not None:
            out["snapshot_tag"] = self.snapshot_tag
        if self.image is not None:
            out["image"] = self.image
        return out


class AuditLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._reopen = False
        self._fd = self._open()

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                           0o600)
        except OSError as err:
            raise OSError(err.errno, f"cannot open the audit log {self.path}: {err.strerror}; "
                          "choose a writable --audit-log path") from err

    def request_reopen(self) -> None:
        """Async-signal-safe: the next ``write`` reopens the file (after rotation)."""
        self._reopen = True

    def write(self, entry: AuditEntry) -> None:
        line = (json.dumps(entry.to_json(), separators=(",", ":"), ensure_ascii=False)
                + "\n").encode("utf-8")
        with self._lock:
            if self._reopen:
                self._reopen = False
                new_fd = self._open()
                os.close(self._fd)
                self._fd = new_fd
            os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
