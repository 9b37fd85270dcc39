"""The snapshot store: tagged, atomically published snapshots of warm microVMs.

Start with ``Store.open()``; write a snapshot with ``store.begin(tag)`` →
``PendingSnapshot`` → ``publish(meta)``; read one with ``store.get(tag)``.
See ``vmfork.store.store`` for the on-disk layout and why it is crash-safe.
"""

from vmfork.store.errors import (
    InvalidTag,
    SnapshotCorrupt,
    SnapshotNotFound,
    StoreError,
    TagBusy,
    TagExists,
)
from vmfork.store.meta import (
    META_FORMAT_VERSION,
    SnapshotMeta,
    SnapshotSizes,
    SnapshotTimings,
)
from vmfork.store.store import (
    MEMORY_FILE,
    META_FILE,
    STATE_FILE,
    DiskUsage,
    FileUsage,
    PendingSnapshot,
    Snapshot,
    Store,
    default_root,
    disk_usage,
)
from vmfork.store.tags import TAG_RULE, is_valid_tag, validate_tag

__all__ = [
    "MEMORY_FILE", "META_FILE", "META_FORMAT_VERSION", "STATE_FILE", "TAG_RULE",
    "DiskUsage", "FileUsage", "InvalidTag", "PendingSnapshot", "Snapshot", "SnapshotCorrupt",
    "SnapshotMeta", "SnapshotNotFound", "SnapshotSizes", "SnapshotTimings", "Store",
    "StoreError", "TagBusy", "TagExists", "default_root", "disk_usage", "is_valid_tag",
    "validate_tag",
]
