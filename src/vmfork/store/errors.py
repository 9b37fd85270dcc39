"""The store's errors, one per thing that can go wrong with a tag or a snapshot.

Each carries the tag (and path where one exists) as data, and its message says
what to do next, because these reach users verbatim through the CLI and as the
``reason`` of a REST 4xx: ``InvalidTag`` → 400, ``SnapshotNotFound`` → 404,
``TagExists``/``TagBusy`` → 409, ``SnapshotCorrupt`` → 409/500 with "delete it".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class StoreError(Exception):
    """Anything the snapshot store refuses or fails to do."""

    def __init__(self, message: str, *, tag: str | None = None, path: Path | None = None) -> None:
        super().__init__(message)
        self.tag = tag
        self.path = path


class InvalidTag(StoreError, ValueError):
    """A tag outside ``[A-Za-z0-9_-]{1,64}``; raised before any path is built from it."""


class SnapshotNotFound(StoreError):
    def __init__(self, tag: str, root: Path, existing: Sequence[str]) -> None:
        if not existing:
            known = "the store has no snapshots yet; create one with `vmfork snapshot --tag T`"
        elif len(existing) <= 10:
            known = "existing tags: " + ", ".join(existing)
        else:
            known = f"{len(existing)} snapshots exist; `vmfork images` lists them"
        super().__init__(f"no snapshot tagged {tag!r} in {root}; {known}", tag=tag,
                         path=root / tag)
        self.existing = list(existing)


class TagExists(StoreError):
    def __init__(self, tag: str, path: Path) -> None:
        super().__init__(f"snapshot tag {tag!r} already exists ({path}); choose another tag or "
                         f"delete it first with `vmfork rmi {tag}`", tag=tag, path=path)


class TagBusy(StoreError):
    """Another process (or another pending snapshot in this one) holds the tag."""

    def __init__(self, tag: str, holder: str | None) -> None:
        who = f" ({holder})" if holder else ""
        super().__init__(f"snapshot tag {tag!r} is being written or deleted by another "
                         f"operation{who}; wait for it to finish or choose another tag",
                         tag=tag)
        self.holder = holder


class SnapshotCorrupt(StoreError):
    """A published snapshot whose files are missing, truncated or unreadable."""

    def __init__(self, tag: str, path: Path, problem: str, *, remedy: str | None = None) -> None:
        todo = remedy or f"delete it with `vmfork rmi {tag}` and take it again"
        super().__init__(f"snapshot {tag!r} at {path} is unusable: {problem}; {todo}",
                         tag=tag, path=path)
        self.problem = problem


class HasDependents(StoreError):
    """A delete refused because other snapshots are built on this one (REST 409)."""

    def __init__(self, tag: str, dependents: Sequence[str]) -> None:
        names = ", ".join(dependents)
        super().__init__(f"snapshot {tag!r} has dependents built on it: {names}; delete them "
                         f"first, or `vmfork rmi --cascade {tag}` to delete them too, or "
                         f"`vmfork rmi --force {tag}` to keep them as standalone snapshots",
                         tag=tag)
        self.dependents = list(dependents)


class ParentGone(StoreError):
    """A chain link's parent was deleted or replaced while the link was being written."""
