"""The zygote's wire protocol: JSON lines over a Unix stream socket.

Each request is one JSON object on one line, ``{"op": ..., ...}``; each reply is one
line, ``{"ok": true, ...}`` or ``{"ok": false, "error": {"type": ..., "message": ...}}``.
A connection may pipeline many requests; replies come back in request order (a
``wait`` reply is held until its child exits, and replies behind it wait too).

Requests (fields marked ? are optional):

* ``spawn {entry: "module:function", vm_id, args?: {...}, memory_limit_mib?,
  cgroup_parent?}`` -> ``{child: ChildInfo}``
* ``spawn_many {entry, items: [{vm_id, args?, memory_limit_mib?, cgroup_parent?}]}``
  -> ``{children: [ChildInfo], failed: [{vm_id, error}], events_next: N}``
  (``events_next``: the ``events`` cursor as the batch was forked, so every exit event
  of its children is newer; a spawner needs no ``events`` round trip of its own)
* ``kill {vm_id, signal?: 9}`` -> ``{sent: true}`` (the exit arrives as an event)
* ``wait {vm_id}`` -> ``{event: ExitEvent}`` once the child is reaped (at once if it
  already was and its event is still kept)
* ``list`` -> ``{children: [ChildInfo]}``
* ``events {since?: 0}`` -> ``{events: [ExitEvent], next: N}`` (pass ``next`` back as
  ``since`` to get only newer events)
* ``ping`` -> ``{pid, preloaded, children, uptime_s, lease_s, lease_holders, jail_bases:
  {kept, built}, forker}`` (the jail bases it keeps, ``jail.KeptBases``, and built so
  far; its forker's ``{pid, snapshot_plans}`` or null, ``runtime.forker``)
* ``lease {seconds?}`` -> ``{lease_s, holders}``: this connection holds the lease while
  it is open; with no holder for ``lease_s`` seconds the zygote kills its children
  and exits (``seconds`` sets ``lease_s``; see ``runtime.zygote``)
* ``shutdown`` -> ``{children_killed: n}``; then the zygote exits.

The records below are the reply shapes; the client decodes into them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

MAX_LINE = 16 * 1024 * 1024

# Exit statuses the child itself uses (sysexits.h): the entry raised, or the child
# could not be set up (cgroup join, log file, prctl) before the entry ran.
EXIT_ENTRY_RAISED = 70
EXIT_SETUP_FAILED = 71


class ZygoteError(Exception):
    """The zygote refused or failed a request. ``type`` is the server-side error class."""

    def __init__(self, message: str, *, op: str, type: str = "ZygoteError") -> None:
        super().__init__(message)
        self.op = op
        self.type = type


class ZygoteUnavailable(ZygoteError):
    """No zygote answers on the socket (not started, died, or the connection broke)."""


@dataclass(frozen=True)
class SpawnItem:
    vm_id: str
    args: dict[str, Any] = field(default_factory=dict)
    memory_limit_mib: int | None = None
    cgroup_parent: str | None = None
    jail: dict[str, Any] | None = None
    """``{uid, gid, read_only, devices}``: build the child a jail (``runtime/jail.py``)."""

    def to_json(self) -> dict[str, Any]:
        # Shallow: the request is encoded at once (``encode``), so nothing needs the deep
        # copy ``dataclasses.asdict`` makes of ``args`` and ``jail`` (per item, it was
        # most of a spawner's CPU between its request and its children's fork).
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        return {name: value for name, value in values if value is not None}


@dataclass(frozen=True)
class ChildInfo:
    vm_id: str
    pid: int
    cgroup: str | None
    entry: str
    started_at: float
    log_path: str | None = None
    run_dir: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChildInfo:
        return cls(vm_id=d["vm_id"], pid=d["pid"], cgroup=d.get("cgroup"), entry=d["entry"],
                   started_at=d["started_at"], log_path=d.get("log_path"),
                   run_dir=d.get("run_dir"))


@dataclass(frozen=True)
class ExitEvent:
    """A reaped child. ``reason`` is one of ``exited``, ``killed``, ``oom-killed``,
    ``crashed``; ``description`` says it in words (e.g. "killed by signal 9 (SIGKILL)")."""

    seq: int
    vm_id: str
    pid: int
    reason: str
    description: str
    exit_code: int | None
    signal: int | None
    core_dumped: bool
    kill_requested: bool
    oom_kills: int | None
    runtime_s: float
    log_tail: list[str]
    cleanup_errors: list[str]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExitEvent:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class SpawnManyResult:
    children: list[ChildInfo]
    failed: list[tuple[str, str]]
    events_next: int | None = None
    """The ``events`` cursor as the batch was forked (None from a zygote older than
    the field)."""


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"
