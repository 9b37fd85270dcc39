"""A content-addressed build cache.

An entry lives at ``<cache>/<kind>/<key>/`` where ``key`` is a hash of every
input that shaped it. An entry is built in a temporary sibling directory and
published by ``rename``, so a crashed or interrupted build never leaves a
half-written entry that a later run would trust. A lock file serialises
builders of the same kind, so two processes asking for the same entry build it
once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vmfork.paths import cache_dir


def hash_inputs(parts: Iterable[bytes | str | Path]) -> str:
    """A short stable key over strings, bytes and file contents (in order)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            h.update(b"file:" + str(part.name).encode() + b"\0")
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        elif isinstance(part, str):
            h.update(b"str:" + part.encode() + b"\0")
        else:
            h.update(b"bytes:" + part + b"\0")
    return h.hexdigest()[:24]


@contextmanager
def _locked(kind_dir: Path) -> Iterator[None]:
    kind_dir.mkdir(parents=True, exist_ok=True)
    with open(kind_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_entry(kind: str, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Return ``(path, built_now)`` of the entry ``kind/key``, building it if absent.

    ``build(tmpdir)`` fills a fresh directory; it is renamed into place only if
    ``build`` returns normally.
    """
    kind_dir = cache_dir() / kind
    final = kind_dir / key
    if final.is_dir():
        return final, False
    with _locked(kind_dir):
        if final.is_dir():
            return final, False
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=kind_dir))
        try:
            build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, True
