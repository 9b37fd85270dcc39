"""The snapshot store: tagged snapshot directories, published atomically.

Layout under the root (``$VMFORK_HOME``, else ``$XDG_DATA_HOME/vmfork``, else
``~/.local/share/vmfork``)::

    snapshots/<tag>/                    a ready snapshot (nothing else is listed)
        state.bin                       vCPU/device state (vmfork.ondisk.stateformat)
        memory.bin                      guest RAM, usually sparse
        meta.json                       SnapshotMeta (vmfork.store.meta)
    snapshots/.pending-<tag>-<hex16>/   being written (private, mode 0700)
    snapshots/.deleting-<tag>-<hex16>/  being removed
    locks/<tag>.lock                    flock held while a tag is written or deleted

Why this shape (DESIGN.md decision 8, "partial results are never registered as
ready"): the only way a directory gets a tag's name is a ``rename(2)`` of a
pending directory whose files and entries were all fsynced first, so after a
crash at any instant a tag either names a complete snapshot or does not exist.
Deletion is the mirror image: the tag disappears with one rename, and the slow
removal happens under a dot-name that ``list`` never shows. Leftovers of a
crashed writer or deleter are removed by ``cleanup_stale`` — only once the tag's
lock is free, which is the kernel's word that their owner is gone (see locks.py).

One publish path: every snapshot enters the store through
``PendingSnapshot.publish`` -- a capture, a BRANCH, a compaction, an unpack, a pull
-- a root, or a link with ``parent=``, so every one has the same guarantees: its
files hashed and its content hash recorded, everything fsynced, one rename, a link
checked against its parent under the chains lock. The files' formats and the
durable-write helpers are ``vmfork.ondisk``'s.

Chains (issue 6): a diff snapshot names its parent (``meta.parent_tag`` and the
parent's content hash) and carries its own ``layer.bin`` and a ``memory.plan``
computed once at publish (``vmfork.store.layers``, ``vmfork.ondisk.memplan``): which
file of its chain -- the base's ``memory.bin`` or an ancestor's ``layer.bin`` --
holds each range of its RAM. So a snapshot's memory lives in its ancestors'
directories too, and the store keeps every file a plan maps for as long as the
plan exists. The links between snapshots change under one store-wide lock
(``locks.ChainsLock``): ``publish`` of a link checks its parent is still there and
every file its plan maps is present with the size it recorded, and ``delete``
checks for dependents, so a child can never be published onto a parent being
deleted. ``delete`` refuses a snapshot with dependents unless told to
``cascade`` (remove the subtree, deepest first, so a crash leaves no child
without its parent) or ``force`` (each direct dependent is first made
standalone: its chain is materialised into its own ``memory.bin`` and its
meta.json rewritten atomically; then the plans of everything built on those are
recomputed over the new base). Before any snapshot is removed, ``delete`` checks
that no remaining snapshot's plan maps one of its files -- the plans themselves
are the reference count, so there is no counter to get out of step after a crash.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import errno
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from vmfork.ondisk import layerfile, memplan
from vmfork.ondisk.decoded import DecodedFiles
from vmfork.ondisk.durable import (
    fsync_dir,
    fsync_tree,
    rename_into_place,
    temp_name,
    write_file_atomic,
)
from vmfork.ondisk.errors import OnDiskError
from vmfork.store.errors import (
    HasDependents,
    ParentGone,
    SnapshotCorrupt,
    SnapshotNotFound,
    StoreError,
    TagExists,
)
from vmfork.store.layers import (
    LAYER_FILE,
    PLAN_FILE,
    PlanInput,
    build_plan,
    hash_file,
    materialise,
    snapshot_content_hash,
    write_plan,
)
from vmfork.store.layers import hash_memory as hash_memory_file
from vmfork.store.locks import ChainsLock, TagLock
from vmfork.store.meta import (
    MEMORY_SOURCE_FILE,
    MEMORY_SOURCE_PLAN,
    META_FORMAT_VERSION,
    META_FORMAT_VERSION_PLAN,
    STATUS_READY,
    LayerRef,
    MetaError,
    SnapshotMeta,
    SnapshotSizes,
    decode_meta,
    encode_meta,
)
from vmfork.store.tags import is_valid_tag, validate_tag

STATE_FILE = "state.bin"
MEMORY_FILE = "memory.bin"
META_FILE = "meta.json"
_REQUIRED_FILES = (STATE_FILE, MEMORY_FILE)

# `.pending-<tag>-<hex16>` / `.deleting-<tag>-<hex16>`. Tags may contain '-', so the
# fixed-width suffix is what makes the split unambiguous.
_WORK_DIR = re.compile(r"\.(pending|deleting)-([A-Za-z0-9_-]{1,64})-([0-9a-f]{16})")


class _Derive(enum.Enum):
    """``PendingSnapshot.publish``'s default: derive the content hash from the files."""

    DERIVE = "derive"


DERIVE = _Derive.DERIVE


def default_root() -> Path:
    """The store root: ``$VMFORK_HOME``, else ``$XDG_DATA_HOME/vmfork``, else
    ``~/.local/share/vmfork``."""
    override = os.environ.get("VMFORK_HOME")
    if override:
        return Path(os.path.abspath(override))
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share")
    return Path(os.path.abspath(data_home)) / "vmfork"


@dataclass(frozen=True)
class Snapshot:
    """A ready snapshot: its tag, where its files are, and its metadata."""

    tag: str
    path: Path
    meta: SnapshotMeta

    @property
    def state_path(self) -> Path:
        return self.path / STATE_FILE

    @property
    def memory_path(self) -> Path:
        """This snapshot's own memory image, ``memory.bin``: what a child maps for a
        flat snapshot. A layered one (``is_layered``) has none: its ``plan_path``
        says which files of its chain a child maps."""
        return self.path / MEMORY_FILE

    @property
    def is_layered(self) -> bool:
        """Whether a child maps this snapshot's chain through ``memory.plan``."""
        return self.meta.memory_source == MEMORY_SOURCE_PLAN

    @property
    def plan_path(self) -> Path:
        return self.path / PLAN_FILE

    @property
    def meta_path(self) -> Path:
        return self.path / META_FILE

    @property
    def layer_path(self) -> Path | None:
        """This snapshot's own memory layer (a diff snapshot), else ``None``."""
        if self.meta.memory_layers and self.meta.memory_layers[-1].tag == self.tag:
            return self.path / LAYER_FILE
        return None


@dataclass(frozen=True)
class FileUsage:
    name: str
    logical_bytes: int   # st_size
    physical_bytes: int  # st_blocks * 512: what the file occupies, holes excluded


@dataclass(frozen=True)
class DiskUsage:
    logical_bytes: int
    physical_bytes: int
    files: tuple[FileUsage, ...]


def disk_usage(snapshot: Snapshot) -> DiskUsage:
    """Logical and physical bytes of a snapshot's files (physical counts only
    allocated blocks, so a sparse memory file counts what the guest touched)."""
    files = []
    for entry in _walk_files(snapshot.path):
        st = entry.stat(follow_symlinks=False)
        files.append(FileUsage(os.path.relpath(entry.path, snapshot.path), st.st_size,
                               st.st_blocks * 512))
    files.sort(key=lambda f: f.name)
    return DiskUsage(sum(f.logical_bytes for f in files), sum(f.physical_bytes for f in files),
                     tuple(files))


def _read_meta(path: str) -> SnapshotMeta:
    with open(path, "rb") as f:
        return decode_meta(f.read())


class Store:
    """A snapshot store rooted at ``root``. ``Store.open()`` is the usual way in."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.snapshots_dir = self.root / "snapshots"
        self.locks_dir = self.root / "locks"
        # Every spawn loads its snapshot, and admission every running one's: each
        # meta.json decoded once while it is the same file (a rewrite replaces it).
        # A loaded meta is shared: replace it (dataclasses.replace), never change it.
        self._metas = DecodedFiles(_read_meta, kept=256)

    @classmethod
    def open(cls, root: str | os.PathLike[str] | None = None) -> Store:
        """Create the store's directories if needed and clear a crashed process's leftovers."""
        store = cls(root)
        store._ensure_dirs()
        store.cleanup_stale()
        return store

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # -- writing -------------------------------------------------------------------
    def begin(self, tag: str) -> PendingSnapshot:
        """Claim ``tag`` and create a private directory to write the snapshot's files into.

        Raises ``InvalidTag``, ``TagExists`` if the tag is taken, ``TagBusy`` if another
        pending snapshot or a delete holds it.
        """
        tag = validate_tag(tag)
        self._ensure_dirs()
        lock = TagLock.acquire(self.locks_dir, tag, "writing a snapshot")
        try:
            target = self.snapshots_dir / tag
            if os.path.lexists(target):
                raise TagExists(tag, target)
            # Our own crashed predecessors' leftovers; nobody else can own them now.
            for work_dir, _kind, work_tag in self._work_dirs():
                if work_tag == tag:
                    _remove_tree(work_dir)
            path = self.snapshots_dir / f".pending-{tag}-{secrets.token_hex(8)}"
            try:
                path.mkdir(mode=0o700)
            except OSError as err:
                raise StoreError(f"cannot create {path}: {err.strerror}; check free space and "
                                 f"permissions of {self.snapshots_dir}", tag=tag,
                                 path=path) from err
        except BaseException:
            lock.release()
            raise
        return PendingSnapshot(self, tag, path, lock)

    def delete(self, tag: str, *, cascade: bool = False,
               force: bool = False) -> builtins.list[str]:
        """Remove a snapshot. The tag disappears atomically; the files follow.
        Returns the deleted tags, in the order they were removed.

        A snapshot other snapshots are built on is refused with ``HasDependents``
        (naming them) unless ``cascade`` (delete them too, deepest first) or
        ``force`` (re-root each direct dependent as a standalone snapshot that keeps
        all its memory, then delete this one). Raises ``InvalidTag``,
        ``SnapshotNotFound``, or ``TagBusy`` while any tag involved is being written
        or deleted. Works on corrupt snapshots too (the remedy ``SnapshotCorrupt``
        suggests).
        """
        tag = validate_tag(tag)
        if cascade and force:
            raise StoreError("give cascade or force, not both: cascade deletes the snapshots "
                             "built on this one, force keeps them as standalone snapshots",
                             tag=tag)
        self._ensure_dirs()
        with contextlib.ExitStack() as held:
            with ChainsLock(self.locks_dir):
                lock = TagLock.acquire(self.locks_dir, tag, "deleting a snapshot")
                held.callback(lock.release)
                if not os.path.lexists(self.snapshots_dir / tag):
                    raise SnapshotNotFound(tag, self.snapshots_dir, self.tag_names())
                children = self.dependents_map()
                direct = children.get(tag, [])
                if direct and not (cascade or force):
                    raise HasDependents(tag, direct)
                doomed = _subtree_deepest_first(tag, children) if cascade else [tag]
                # force: the direct dependents become standalone and everything built
                # on them gets a new plan; top-down, so each one's base is ready first.
                rebased = ([t for child in direct
                            for t in reversed(_subtree_deepest_first(child, children))]
                           if force else [])
                for t in [*doomed, *rebased]:
                    if t != tag:
                        lock = TagLock.acquire(self.locks_dir, t, "deleting a snapshot")
                        held.callback(lock.release)
                if force:
                    for t in rebased:
                        if t in direct:
                            make_standalone(self, t, tag)
                        else:
                            replan(self, t)
                self._check_unreferenced(doomed)
                tombs = [self._rename_to_tomb(t) for t in doomed]
            for tomb in tombs:
                _remove_tree(tomb)
        return doomed

    def dependents_map(self) -> dict[str, builtins.list[str]]:
        """Parent tag -> the tags of the snapshots built directly on it (sorted). A
        snapshot whose recorded parent hash differs from the snapshot now under its
        parent's tag is not that snapshot's dependent (its parent was replaced)."""
        metas = {}
        for t in self.tag_names():
            try:
                metas[t] = self._load(t, self.snapshots_dir / t).meta
            except SnapshotCorrupt:
                continue
        children: dict[str, builtins.list[str]] = {}
        for t, meta in metas.items():
            parent = metas.get(meta.parent_tag) if meta.parent_tag else None
            if parent is None or not _same_parent(meta, parent):
                continue
            children.setdefault(parent.tag, []).append(t)
        return {p: sorted(c) for p, c in children.items()}

    def rewrite_meta(self, snapshot: Snapshot, meta: SnapshotMeta) -> Snapshot:
        """Replace a published snapshot's meta.json atomically (temp file, fsync, rename).
        The caller holds the tag's lock; only chain bookkeeping changes this way, never
        what the snapshot's files hold."""
        if meta.tag != snapshot.tag:
            raise StoreError(f"rewrite of {snapshot.tag!r} with the meta of {meta.tag!r}",
                             tag=snapshot.tag)
        try:
            write_file_atomic(snapshot.meta_path, encode_meta(meta))
        except OnDiskError as err:
            raise StoreError(f"cannot rewrite {snapshot.meta_path}: {err}", tag=snapshot.tag,
                             path=snapshot.path) from err
        return Snapshot(snapshot.tag, snapshot.path, meta)

    def plan_references(self) -> dict[str, builtins.list[str]]:
        """Snapshot tag -> the other snapshots whose memory plans map one of its files
        (sorted). Read from the plans themselves: they are the reference count."""
        refs: dict[str, set[str]] = {}
        for t in self.tag_names():
            try:
                snap = self._load(t, self.snapshots_dir / t)
                if not snap.is_layered:
                    continue
                plan = memplan.read_plan(str(snap.plan_path))
            except (SnapshotCorrupt, memplan.PlanError):
                continue
            for source in plan.sources:
                if source.owner_tag != t:
                    refs.setdefault(source.owner_tag, set()).add(t)
        return {owner: sorted(users) for owner, users in refs.items()}

    def _check_unreferenced(self, doomed: builtins.list[str]) -> None:
        """Refuse to delete files that a snapshot staying behind still maps."""
        refs = self.plan_references()
        for t in doomed:
            users = [u for u in refs.get(t, []) if u not in doomed]
            if users:
                raise StoreError(f"cannot delete snapshot {t!r}: the memory of "
                                 f"{', '.join(map(repr, users))} maps its files; delete those "
                                 "first, or compact them", tag=t)

    def _rename_to_tomb(self, tag: str) -> Path:
        path = self.snapshots_dir / tag
        tomb = self.snapshots_dir / f".deleting-{tag}-{secrets.token_hex(8)}"
        try:
            os.rename(path, tomb)
            fsync_dir(self.snapshots_dir)
        except OSError as err:
            raise StoreError(f"cannot delete snapshot {tag!r}: rename to {tomb.name} "
                             f"failed: {err.strerror}", tag=tag, path=path) from err
        return tomb

    def cleanup_stale(self) -> builtins.list[Path]:
        """Remove pending and deleting directories whose owner process is gone.

        A directory is stale when its tag's lock is free (its owner would hold it).
        Live operations are never touched. Returns the removed paths.
        """
        removed = []
        for work_dir, _kind, tag in self._work_dirs():
            lock = TagLock.try_acquire(self.locks_dir, tag, "removing stale leftovers")
            if lock is None:
                continue  # a live process is writing or deleting this tag
            try:
                if os.path.lexists(work_dir):
                    _remove_tree(work_dir)
                    removed.append(work_dir)
            finally:
                lock.release()
        return removed

    # -- reading -------------------------------------------------------------------
    def get(self, tag: str) -> Snapshot:
        """The ready snapshot ``tag``: ``SnapshotNotFound`` if there is none,
        ``SnapshotCorrupt`` if its files are damaged."""
        tag = validate_tag(tag)
        path = self.snapshots_dir / tag
        if not path.is_dir():
            raise SnapshotNotFound(tag, self.snapshots_dir, self.tag_names())
        return self._load(tag, path)

    def exists(self, tag: str) -> bool:
        return (self.snapshots_dir / validate_tag(tag)).is_dir()

    def list(self) -> list[Snapshot]:
        """Every ready snapshot, sorted by tag. Damaged ones are left out
        (``list_corrupt`` reports them)."""
        self.cleanup_stale()
        out = []
        for tag in self.tag_names():
            try:
                out.append(self._load(tag, self.snapshots_dir / tag))
            except SnapshotCorrupt:
                continue
        return out

    def list_corrupt(self) -> builtins.list[SnapshotCorrupt]:
        """One error per tagged directory that is not a usable snapshot, sorted by tag."""
        problems = []
        for tag in self.tag_names():
            try:
                self._load(tag, self.snapshots_dir / tag)
            except SnapshotCorrupt as err:
                problems.append(err)
        return problems

    # -- internals -----------------------------------------------------------------
    def _ensure_dirs(self) -> None:
        for d in (self.snapshots_dir, self.locks_dir):
            try:
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as err:
                raise StoreError(f"cannot create the store directory {d}: {err.strerror}; set "
                                 "VMFORK_HOME to a writable directory", path=d) from err

    def tag_names(self) -> builtins.list[str]:
        """Names of tagged directories, sorted, none of them loaded (a name may be a
        damaged snapshot's); dot-entries and foreign names are not snapshots."""
        try:
            entries = list(os.scandir(self.snapshots_dir))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries
                      if is_valid_tag(e.name) and e.is_dir(follow_symlinks=False))

    def _work_dirs(self) -> Iterator[tuple[Path, str, str]]:
        try:
            entries = list(os.scandir(self.snapshots_dir))
        except FileNotFoundError:
            return
        for e in entries:
            m = _WORK_DIR.fullmatch(e.name)
            if m:
                yield Path(e.path), m.group(1), m.group(2)

    def _load(self, tag: str, path: Path) -> Snapshot:
        try:
            meta = self._metas.get(str(path / META_FILE))
        except FileNotFoundError:
            raise SnapshotCorrupt(tag, path, f"{META_FILE} is missing") from None
        except OSError as err:
            raise SnapshotCorrupt(tag, path, f"{META_FILE} cannot be read ({err.strerror})",
                                  remedy="check the permissions of the store") from err
        except MetaError as err:
            remedy = "upgrade vmfork to use it" if err.newer else None
            raise SnapshotCorrupt(tag, path, str(err), remedy=remedy) from None
        if meta.tag != tag:
            raise SnapshotCorrupt(tag, path, f"{META_FILE} says it is {meta.tag!r} (was the "
                                  "directory renamed by hand?)",
                                  remedy=f"rename it back to {meta.tag!r} or delete it")
        expected: dict[str, int | None] = {STATE_FILE: meta.sizes.state_bytes}
        if meta.memory_source == MEMORY_SOURCE_PLAN:
            expected[PLAN_FILE] = None
        else:
            expected[MEMORY_FILE] = meta.sizes.memory_logical_bytes
        for name, size in expected.items():
            # A stat, not a read or a hash: nothing here may grow with guest memory.
            try:
                st = os.stat(path / name)
            except FileNotFoundError:
                raise SnapshotCorrupt(tag, path, f"{name} is missing") from None
            except OSError as err:
                raise SnapshotCorrupt(tag, path, f"{name} cannot be read ({err.strerror})",
                                      remedy="check the permissions of the store") from err
            if not stat.S_ISREG(st.st_mode):
                raise SnapshotCorrupt(tag, path, f"{name} is not a regular file")
            if size is not None and st.st_size != size:
                raise SnapshotCorrupt(tag, path, f"{name} is {st.st_size} bytes, {META_FILE} "
                                      f"recorded {size} (truncated or replaced)")
        snapshot = Snapshot(tag, path, meta)
        layer = snapshot.layer_path
        if layer is not None and not os.path.isfile(layer):
            raise SnapshotCorrupt(tag, path, f"{LAYER_FILE} is missing (its meta.json lists it)")
        return snapshot


class PendingSnapshot:
    """A snapshot being written: files go into ``path``, then ``publish`` or ``abort``.

    Use as a context manager: leaving the block without ``publish`` (normally or by
    an exception) aborts, so an incomplete snapshot never survives its writer.
    """

    def __init__(self, store: Store, tag: str, path: Path, lock: TagLock) -> None:
        self.store = store
        self.tag = tag
        self.path = path
        self._lock = lock
        self._result: Snapshot | None = None
        self._closed = False

    @property
    def state_path(self) -> Path:
        return self.path / STATE_FILE

    @property
    def memory_path(self) -> Path:
        return self.path / MEMORY_FILE

    @property
    def layer_path(self) -> Path:
        """Where a diff snapshot's own layer goes (``vmfork.store.layers``)."""
        return self.path / LAYER_FILE

    @property
    def plan_path(self) -> Path:
        """Where a diff snapshot's memory plan goes (``vmfork.ondisk.memplan``)."""
        return self.path / PLAN_FILE

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._closed:
            self.abort()

    def __repr__(self) -> str:
        state = "published" if self._result else "aborted" if self._closed else "open"
        return f"PendingSnapshot({self.tag!r}, {state})"

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise StoreError(f"cannot {op} pending snapshot {self.tag!r}: it was already "
                             f"{'published' if self._result else 'aborted'}", tag=self.tag)
        if not self._lock.held:
            raise StoreError(f"cannot {op} pending snapshot {self.tag!r} in this process: it "
                             "belongs to the process that began it (this is a forked copy)",
                             tag=self.tag)

    def publish(self, meta: SnapshotMeta, *, parent: Snapshot | None = None,
                recorded_content_hash: str | None | _Derive = DERIVE) -> Snapshot:
        """Make the snapshot durable and visible under its tag, atomically: the one way
        a snapshot enters the store (a capture, a BRANCH, a compact, an unpack, a pull).

        A root (no ``parent``): ``state.bin`` and ``memory.bin`` must be in ``path``. A
        link on ``parent``: ``state.bin`` and ``layer.bin``; its memory plan over the
        parent's chain is computed here (or, over the VMA budget, the chain is
        materialised into its own ``memory.bin``), the layer's index validated on the
        way (a hostile layer cannot map outside guest RAM), and the chain recorded in
        its meta (``ChainTooDeep`` past ``MAX_CHAIN_DEPTH``).

        Every snapshot gets the same guarantees: its files are hashed as published
        (``meta.file_hashes``) and its content hash recorded -- its state, its own
        memory (a root's image, a link's layer) and its parent's content hash, so it
        names the chain below it; every file and directory is fsynced before the one
        rename that makes the tag appear; a link is published only while its parent
        (same content hash) and every file its plan maps are there, under the chains
        lock (``ParentGone``). ``recorded_content_hash``: the hash the snapshot had
        where it came from (an unpacked or pulled one). A link's must come out the
        same (``StoreError`` otherwise: it was built on another parent); a root keeps
        it as recorded, even none, because its dependents' hashes were derived from it.

        The store fills ``meta.sizes``, ``meta.status``, the hashes and, for a link,
        the chain fields. On failure the pending directory is left for ``abort`` (the
        context manager does it): nothing half-written is ever listed.
        """
        self._check_open("publish")
        if meta.tag != self.tag:
            raise StoreError(f"meta.tag {meta.tag!r} does not match the pending snapshot's tag "
                             f"{self.tag!r}; build the meta with tag={self.tag!r}", tag=self.tag)
        if parent is None:
            if meta.memory_source == MEMORY_SOURCE_PLAN:
                raise StoreError(f"cannot publish snapshot {self.tag!r}: a memory plan needs a "
                                 "parent", tag=self.tag)
            self._require(_REQUIRED_FILES)
            final = self._root_meta(meta, recorded_content_hash)
        else:
            self._require((STATE_FILE, LAYER_FILE))
            final = self._link_meta(meta, parent, recorded_content_hash)
        return self._commit(final)

    def _require(self, names: tuple[str, ...]) -> None:
        for name in names:
            try:
                st = os.stat(self.path / name)
            except FileNotFoundError:
                raise StoreError(f"cannot publish snapshot {self.tag!r}: {name} was not written "
                                 f"into {self.path}; write {' and '.join(names)} "
                                 "before publish", tag=self.tag, path=self.path) from None
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(f"cannot publish snapshot {self.tag!r}: {name} is not a regular "
                                 "file", tag=self.tag, path=self.path)

    def _root_meta(self, meta: SnapshotMeta,
                   recorded: str | None | _Derive) -> SnapshotMeta:
        state_hash = hash_file(self.state_path)
        memory_hash = hash_memory_file(self.memory_path)
        content_hash = (snapshot_content_hash(state_hash, memory_hash, None)
                        if isinstance(recorded, _Derive) else recorded)
        return dataclasses.replace(
            meta, parent_tag=None, root_tag=None, memory_layers=[],
            parent_content_hash=None, memory_source=MEMORY_SOURCE_FILE,
            content_hash=content_hash,
            file_hashes={STATE_FILE: state_hash, MEMORY_FILE: memory_hash})

    def _link_meta(self, meta: SnapshotMeta, parent: Snapshot,
                   recorded: str | None | _Derive) -> SnapshotMeta:
        check_depth_for_child(self.store, parent.tag)
        state_hash = hash_file(self.state_path)
        layer_hash = hash_file(self.layer_path)
        content_hash = snapshot_content_hash(state_hash, layer_hash, parent.meta.content_hash)
        if not isinstance(recorded, _Derive) and content_hash != recorded:
            raise StoreError(f"snapshot {self.tag!r}: its content hash {content_hash} is not "
                             f"the recorded {recorded} (its parent {parent.tag!r} is "
                             "not the snapshot it was built on)", tag=self.tag)
        with open(self.layer_path, "rb", buffering=0) as f:
            index = layerfile.read_layer_index(f.fileno())
        links = chain_of(self.store, parent.tag)
        source, mapping = _resolve_memory(
            self.store, self.path, links,
            PlanInput(f"{self.tag}/{LAYER_FILE}", self.layer_path, content_hash, layer_hash))
        ref = LayerRef(self.tag, layer_hash, index.data_bytes, index.pages)
        return dataclasses.replace(
            meta, parent_tag=parent.tag, root_tag=links[0].tag,
            memory_layers=[*parent.meta.memory_layers, ref], memory_source=source,
            parent_content_hash=parent.meta.content_hash, content_hash=content_hash,
            file_hashes={STATE_FILE: state_hash, LAYER_FILE: layer_hash},
            extra={**meta.extra, **mapping})

    def _commit(self, meta: SnapshotMeta) -> Snapshot:
        """Write meta.json, fsync everything, and rename the directory into place
        (under the chains lock for a link, after checking its parent and plan)."""
        layered = meta.memory_source == MEMORY_SOURCE_PLAN
        plan = memplan.read_plan(str(self.plan_path)) if layered else None
        if plan is not None:
            logical, physical = plan.mem_size, 0
        else:
            st = os.stat(self.memory_path)
            logical, physical = st.st_size, st.st_blocks * 512
        final = dataclasses.replace(
            meta, status=STATUS_READY,
            format_version=META_FORMAT_VERSION_PLAN if layered else META_FORMAT_VERSION,
            sizes=SnapshotSizes(memory_logical_bytes=logical, memory_physical_bytes=physical,
                                state_bytes=os.stat(self.state_path).st_size))
        target = self.store.snapshots_dir / self.tag
        stage = f"write {META_FILE}"
        try:
            fd = os.open(self.path / META_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                         | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(encode_meta(final))
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            stage = "fsync the files"
            fsync_tree(self.path)
            # The daemon's alone (0700, its files 0600): a jailed VMM gets the files it
            # maps as descriptors opened before its uid changed, bound one by one.
            stage = "make the directory private"
            os.chmod(self.path, 0o700)
            fsync_dir(self.path)
            links = (ChainsLock(self.store.locks_dir) if final.parent_tag is not None
                     else contextlib.nullcontext())
            with links:
                if final.parent_tag is not None:
                    self._check_parent(final)
                if plan is not None:
                    self._check_plan_sources(plan)
                if os.path.lexists(target):
                    # Only a writer bypassing the tag lock gets here; never replace its work.
                    raise TagExists(self.tag, target)
                stage = "rename into place"
                os.rename(self.path, target)
                stage = "fsync the snapshots directory"
                fsync_dir(self.store.snapshots_dir)
        except OSError as err:
            if stage == "fsync the snapshots directory":
                # Renamed and visible; only the durability of the rename is unknown.
                self._finish(Snapshot(self.tag, target, final))
            raise StoreError(f"cannot publish snapshot {self.tag!r}: {stage} failed: "
                             f"{err.strerror or err}; check free space and the store's file "
                             "system", tag=self.tag, path=self.path) from err
        snapshot = Snapshot(self.tag, target, final)
        self._finish(snapshot)
        return snapshot

    def _check_parent(self, meta: SnapshotMeta) -> None:
        assert meta.parent_tag is not None
        try:
            parent = self.store.get(meta.parent_tag)
        except (SnapshotNotFound, SnapshotCorrupt) as err:
            raise ParentGone(f"cannot publish snapshot {self.tag!r}: its parent "
                             f"{meta.parent_tag!r} was deleted while it was being written "
                             f"({err})", tag=self.tag) from None
        if not _same_parent(meta, parent.meta):
            raise ParentGone(f"cannot publish snapshot {self.tag!r}: its parent "
                             f"{meta.parent_tag!r} was replaced by another snapshot while it "
                             "was being written", tag=self.tag)

    def _check_plan_sources(self, plan: memplan.MemoryPlan) -> None:
        """Every file the plan maps is there with the size it recorded (under the
        chains lock: an ancestor deleted or re-based meanwhile fails the publish)."""
        for source in plan.sources:
            path = (self.path / LAYER_FILE if source.owner_tag == self.tag
                    else self.store.snapshots_dir / source.path)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                size = -1
            if size != source.size:
                raise ParentGone(f"cannot publish snapshot {self.tag!r}: {source.path}, which "
                                 "its memory plan maps, was deleted or replaced while it was "
                                 "being written", tag=self.tag)

    def abort(self) -> None:
        """Discard everything written so far and release the tag. Idempotent."""
        if self._closed:
            return
        if self._lock.held:
            _remove_tree(self.path)
        self._finish(None)

    def _finish(self, result: Snapshot | None) -> None:
        self._result = result
        self._closed = True
        self._lock.release()


def _same_parent(child: SnapshotMeta, parent: SnapshotMeta) -> bool:
    """Whether ``parent`` is the snapshot ``child`` was built on (content hashes agree,
    where both were recorded)."""
    return (child.parent_content_hash is None or parent.content_hash is None
            or child.parent_content_hash == parent.content_hash)


def _subtree_deepest_first(tag: str, children: dict[str, builtins.list[str]]
                           ) -> builtins.list[str]:
    """``tag`` and everything built on it, each snapshot after all its dependents."""
    order: builtins.list[str] = []
    seen: set[str] = set()

    def visit(t: str) -> None:
        if t in seen:       # only a hand-edited store has a cycle; do not loop on it
            return
        seen.add(t)
        for child in children.get(t, []):
            visit(child)
        order.append(t)

    visit(tag)
    return order


# -- chains: what publishing a link and deleting with force need ------------------------
# (``vmfork.store.chains`` builds inspection, verification and compaction on these.)

# Each link adds one resolve at build time and one entry to walk when packing; past
# this, `vmfork snapshot-compact` makes a flat snapshot to build on instead.
MAX_CHAIN_DEPTH = 32


class ChainTooDeep(StoreError):
    def __init__(self, tag: str, depth: int) -> None:
        super().__init__(f"snapshot {tag!r} is already at chain depth {depth} (the limit is "
                         f"{MAX_CHAIN_DEPTH}); compact it first with `vmfork snapshot-compact "
                         f"--from {tag} --to NEW` and build on NEW", tag=tag)
        self.depth = depth


def chain_of(store: Store, tag: str) -> list[Snapshot]:
    """The chain ending at ``tag``, root first. ``SnapshotCorrupt`` if a parent it
    names is missing or was replaced (only a hand-edited store gets there: a parent
    cannot be deleted under its dependents)."""
    head = store.get(tag)
    links = [head]
    seen = {head.tag}
    while links[-1].meta.parent_tag is not None:
        child = links[-1]
        parent_tag = child.meta.parent_tag
        assert parent_tag is not None
        if parent_tag in seen or len(links) > MAX_CHAIN_DEPTH * 4:
            raise SnapshotCorrupt(child.tag, child.path, "its chain of parents loops")
        try:
            parent = store.get(parent_tag)
        except SnapshotNotFound:
            raise SnapshotCorrupt(child.tag, child.path, f"its parent {parent_tag!r} is "
                                  "missing", remedy="compact it or delete it") from None
        if (child.meta.parent_content_hash is not None and parent.meta.content_hash is not None
                and child.meta.parent_content_hash != parent.meta.content_hash):
            raise SnapshotCorrupt(child.tag, child.path, f"the snapshot tagged {parent_tag!r} "
                                  "is not the parent it was built on",
                                  remedy="compact it or delete it")
        seen.add(parent_tag)
        links.append(parent)
    links.reverse()
    return links


def check_depth_for_child(store: Store, parent_tag: str) -> int:
    """The depth a new link on ``parent_tag`` would have; ``ChainTooDeep`` past the limit."""
    depth = len(chain_of(store, parent_tag))
    if depth > MAX_CHAIN_DEPTH:
        raise ChainTooDeep(parent_tag, depth - 1)
    return depth


def _plan_over(links: list[Snapshot], head: PlanInput) -> memplan.MemoryPlan:
    """The plan of ``head`` (a layer) on the chain ``links`` (root to parent): over the
    nearest snapshot of the chain that has a memory.bin, with every layer above it."""
    base_at = max(i for i, link in enumerate(links) if not link.is_layered)
    base = links[base_at]
    layers = []
    for link in links[base_at + 1:]:
        if link.layer_path is None:
            raise SnapshotCorrupt(link.tag, link.path, "it maps its memory through a plan but "
                                  "has no layer of its own", remedy="delete it")
        layers.append(PlanInput(f"{link.tag}/{LAYER_FILE}", link.layer_path,
                                link.meta.content_hash, link.meta.file_hashes.get(LAYER_FILE)))
    return build_plan(PlanInput(f"{base.tag}/{MEMORY_FILE}", base.memory_path,
                                base.meta.content_hash, base.meta.file_hashes.get(MEMORY_FILE)),
                      [*layers, head])


def _source_paths(store: Store, plan: memplan.MemoryPlan, head: PlanInput) -> list[Path]:
    return [head.path if source.path == head.store_path else store.snapshots_dir / source.path
            for source in plan.sources]


def _resolve_memory(store: Store, directory: Path, links: list[Snapshot],
                    head: PlanInput) -> tuple[str, dict[str, Any]]:
    """Write the memory of ``head`` on ``links`` into ``directory`` (a pending snapshot,
    or a published one being re-based): its plan, or -- over the VMA budget -- the
    chain materialised into memory.bin. Returns the meta's memory_source and what
    snapshot-info reports about it. The file is written under a temporary name and
    renamed into place."""
    started = time.monotonic()
    plan = _plan_over(links, head)
    if len(plan.runs) <= memplan.MAX_RUNS:
        temp = temp_name(directory / PLAN_FILE)
        try:
            write_plan(plan, temp)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        rename_into_place(temp, directory / PLAN_FILE)
        return MEMORY_SOURCE_PLAN, {"memory_mapping": {
            "runs": len(plan.runs), "files": len(plan.sources),
            "resolve_ms": (time.monotonic() - started) * 1000}}
    _materialise_into(plan, _source_paths(store, plan, head), directory / MEMORY_FILE)
    return MEMORY_SOURCE_FILE, {"memory_mapping": {
        "runs": len(plan.runs), "files": len(plan.sources),
        "resolve_ms": (time.monotonic() - started) * 1000,
        "materialised": f"its plan needs {len(plan.runs)} mappings, over the budget of "
                        f"{memplan.MAX_RUNS}: its chain was copied into its own memory.bin "
                        "once, at publish"}}


def _materialise_into(plan: memplan.MemoryPlan, sources: list[Path], out: Path) -> None:
    """Write the memory image ``plan`` maps as ``out``: under a temporary name, fsynced,
    renamed into place (nothing is left behind on failure)."""
    temp = temp_name(out)
    try:
        materialise(plan, sources, temp)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    rename_into_place(temp, out)


def make_standalone(store: Store, tag: str, parent_tag: str) -> Snapshot:
    """Turn the link ``tag`` into a flat snapshot (``rmi --force`` of its parent): its
    chain is materialised into its own memory.bin (unless it already has one), then its
    meta.json is rewritten atomically without the parent, then its plan and layer go.
    The caller holds the chains lock and the tag's lock. A crash part-way leaves a
    spawnable snapshot (the plan stays valid until the parent is deleted, after this)."""
    snap = store.get(tag)
    if snap.is_layered:
        plan = memplan.read_plan(str(snap.plan_path))
        _materialise_into(plan, [Path(plan.source_path(i)) for i in range(len(plan.sources))],
                          snap.memory_path)
    memory_hash = snap.meta.file_hashes.get(MEMORY_FILE) or hash_memory_file(snap.memory_path)
    st = os.stat(snap.memory_path)
    meta = snap.meta
    snap = store.rewrite_meta(snap, dataclasses.replace(
        meta, parent_tag=None, root_tag=None, memory_layers=[], parent_content_hash=None,
        memory_source=MEMORY_SOURCE_FILE, format_version=META_FORMAT_VERSION,
        file_hashes={STATE_FILE: meta.file_hashes.get(STATE_FILE) or hash_file(snap.state_path),
                     MEMORY_FILE: memory_hash},
        sizes=SnapshotSizes(memory_logical_bytes=st.st_size,
                            memory_physical_bytes=st.st_blocks * 512,
                            state_bytes=meta.sizes.state_bytes),
        extra={**{k: v for k, v in meta.extra.items() if k != "memory_mapping"},
               "orphaned_from": {"tag": parent_tag, "content_hash": meta.parent_content_hash}}))
    # No longer part of its meta; a crash before these unlinks leaves unlisted files.
    for name in (PLAN_FILE, LAYER_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(snap.path / name)
    return snap


def replan(store: Store, tag: str) -> Snapshot:
    """Recompute the memory of the link ``tag`` over its chain as it is now (after an
    ancestor was made standalone) and trim its meta's chain to match. The caller holds
    the chains lock and the tag's lock. The new plan replaces the old one atomically;
    both are valid until the old ancestor is deleted, after this."""
    links = chain_of(store, tag)
    snap = links[-1]
    meta = snap.meta
    in_chain = {link.tag for link in links[1:]}
    changes: dict[str, Any] = {
        "root_tag": links[0].tag,
        "memory_layers": [r for r in meta.memory_layers if r.tag in in_chain]}
    source = meta.memory_source
    if snap.is_layered:
        own = snap.layer_path
        assert own is not None
        source, mapping = _resolve_memory(store, snap.path, links[:-1], PlanInput(
            f"{tag}/{LAYER_FILE}", own, meta.content_hash, meta.file_hashes.get(LAYER_FILE)))
        changes["extra"] = {**meta.extra, **mapping}
        if source == MEMORY_SOURCE_FILE:     # over the budget now: materialised
            changes.update(memory_source=source, format_version=META_FORMAT_VERSION,
                           sizes=dataclasses.replace(meta.sizes, memory_physical_bytes=os.stat(
                               snap.memory_path).st_blocks * 512))
    snap = store.rewrite_meta(snap, dataclasses.replace(meta, **changes))
    if source == MEMORY_SOURCE_FILE:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(snap.plan_path)
    return snap


# -- file-system helpers --------------------------------------------------------------

def _walk_files(root: Path) -> Iterator[os.DirEntry[str]]:
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            yield from _walk_files(Path(entry.path))
        else:
            yield entry


def _remove_tree(path: Path) -> None:
    """Remove a directory tree; a concurrent remover's deletions are not errors."""
    def on_error(func: object, p: str,
                 exc_info: tuple[type[BaseException], BaseException, object]) -> None:
        exc = exc_info[1]
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            return
        raise StoreError(f"cannot remove {p}: {exc}; remove it by hand", path=Path(p)) from exc

    shutil.rmtree(path, onerror=on_error)
