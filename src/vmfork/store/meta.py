"""``meta.json``: what a snapshot is, in a form people and newer vmforks can read.

It is JSON (not the binary state format) because it is small, read on every
``list``, and read by people and scripts (``jq``). It uses the same field-named
codec as the machine state (``vmfork.ondisk.stateformat.to_json_value`` /
``from_json_value``), so the same evolution rules hold: a reader ignores fields
it does not know and defaults fields the file lacks. ``format_version`` changes
only for a change an older reader must not misread; issue 6 (layers, chains)
added fields (a layer list, the parent's content hash) without bumping it. A
diff snapshot mapped through a memory plan (``memory_source`` is
``memory.plan``) has no ``memory.bin``, which an older reader would need: its
meta.json is written as version 2 (flat snapshots stay version 1), so such a
reader says "upgrade vmfork" instead of "memory.bin is missing".
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from vmfork.ondisk.stateformat import StateFormatError, from_json_value, to_json_value

META_FORMAT_VERSION = 1
# A snapshot whose memory is a plan over its chain's files (no memory.bin).
META_FORMAT_VERSION_PLAN = 2
SUPPORTED_META_VERSIONS: tuple[int, ...] = (1, 2)

MEMORY_SOURCE_FILE = "memory.bin"
MEMORY_SOURCE_PLAN = "memory.plan"

STATUS_READY = "ready"


@dataclass(frozen=True)
class SnapshotTimings:
    """How long each stage of taking the snapshot took, in milliseconds (None: not measured).

    ``pause_ms`` is the time the source's vCPUs were stopped; ``capture_ms`` the
    part of it spent reading vCPU/device state; ``write_ms`` writing the files.
    """

    boot_ms: float | None = None
    warm_ms: float | None = None
    pause_ms: float | None = None
    capture_ms: float | None = None
    write_ms: float | None = None


@dataclass(frozen=True)
class SnapshotSizes:
    """File sizes in bytes, measured by the store at publish time (callers leave them 0).

    ``memory_physical_bytes`` is what the (usually sparse) memory file occupies on
    disk; ``memory_logical_bytes`` is its length, the guest RAM size.
    """

    memory_logical_bytes: int = 0
    memory_physical_bytes: int = 0
    state_bytes: int = 0


@dataclass(frozen=True)
class LayerRef:
    """One memory layer of a diff chain: the pages snapshot ``tag`` changed over its
    parent, stored as ``snapshots/<tag>/layer.bin`` (``vmfork.ondisk.layerfile``).

    ``content_hash`` is ``blake2b-256:<hex>`` of the whole layer file, computed when
    it entered the store.
    """

    tag: str
    content_hash: str
    data_bytes: int
    pages: int


@dataclass(frozen=True)
class SnapshotMeta:
    """Everything about a snapshot except its contents. ``tag`` must equal the store tag."""

    tag: str
    image: str
    mem_mib: int
    vcpus: int
    created_at_unix: float = field(default_factory=time.time)
    status: str = STATUS_READY
    parent_tag: str | None = None
    warm_up: str | None = None
    timings: SnapshotTimings = field(default_factory=SnapshotTimings)
    sizes: SnapshotSizes = field(default_factory=SnapshotSizes)
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = META_FORMAT_VERSION
    # Branches and diff chains (issues 5 and 6). A flat snapshot has no layers. A
    # diff snapshot's memory.bin is its chain materialised once at publish time
    # (root's memory.bin + every layer), so a child maps one file at any depth;
    # ``memory_layers`` lists the chain's layers root to head (the last one is its own)
    # and ``root_tag`` the flat snapshot below them.
    branch_mode: str | None = None          # full | diff | live, for a branch
    branched_from: str | None = None        # the sandbox it was branched from
    branched_from_tag: str | None = None    # the snapshot that sandbox was restored from
    root_tag: str | None = None
    memory_layers: list[LayerRef] = field(default_factory=list)
    content_hash: str | None = None         # of this snapshot's state and memory layers
    parent_content_hash: str | None = None
    # Issue 6: ``blake2b-256:<hex>`` of the files that entered the store, by file name,
    # filled by ``PendingSnapshot.publish`` (state.bin and layer.bin always; memory.bin
    # when the writer asked for it, with ``layers.hash_memory``); ``vmfork verify``
    # re-checks them. Absent for snapshots written before it existed.
    file_hashes: dict[str, str] = field(default_factory=dict)
    # Which file a restore maps: memory.bin, or memory.plan (see above).
    memory_source: str = MEMORY_SOURCE_FILE


class MetaError(Exception):
    """``meta.json`` cannot be read; the store turns it into ``SnapshotCorrupt``."""

    def __init__(self, problem: str, *, newer: bool = False) -> None:
        super().__init__(problem)
        self.newer = newer


def encode_meta(meta: SnapshotMeta) -> bytes:
    return (json.dumps(to_json_value(meta), indent=2, ensure_ascii=False, allow_nan=False)
            + "\n").encode("utf-8")


def decode_meta(data: bytes) -> SnapshotMeta:
    try:
        tree = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise MetaError(f"meta.json is not valid JSON ({str(err)[:120]})") from None
    if not isinstance(tree, dict):
        raise MetaError("meta.json is not a JSON object")
    version = tree.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise MetaError(f"meta.json format_version is {version!r}, not an integer")
    if version not in SUPPORTED_META_VERSIONS:
        supported = ", ".join(map(str, SUPPORTED_META_VERSIONS))
        raise MetaError(f"meta.json format_version {version} is not one this vmfork reads "
                        f"({supported})", newer=version > META_FORMAT_VERSION)
    try:
        return from_json_value(tree, SnapshotMeta)
    except StateFormatError as err:
        raise MetaError(f"meta.json: {err}") from None
