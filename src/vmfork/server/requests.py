"""The controller's inputs, typed: one frozen dataclass per request body a route
hands to the controller.

A route checks a body against its ``Field`` spec (``validation.validate_fields``,
which words every 4xx message) and turns the checked dict into its request with
``of``; the controller then reads attributes, never string keys, so a field that a
spec and the controller spell differently fails the type check (and
``tests/unit/test_requests.py``, which holds each class to its spec) instead of a
request. Internal callers (a workspace's spawn, a pause's BRANCH, the E2B
translator) build the same classes, with the same defaults as the specs.

Nested values the controller passes on unread stay as given: ``egress`` (checked by
``networking.egress_policy``) and ``volumes`` (by ``volumes.parse_request``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self


class _Request:
    @classmethod
    def of(cls, checked: Mapping[str, Any]) -> Self:
        """The request of a body its spec has checked (every field present, with its
        default where the body had none)."""
        return cls(**checked)

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class SnapshotCreate(_Request):
    """``POST /v1/snapshots``: boot, warm and snapshot a parent."""

    tag: str
    image: str = "default"
    mem_mib: int = 256
    vcpus: int = 1
    warm_code: str | None = None
    warm_cmd: str | None = None
    kernel: str | None = None
    rootfs: str | None = None
    rw: bool = False
    tap: str | None = None
    boot_wait_secs: float = 10
    network: bool = False
    egress: dict[str, Any] | None = None
    volumes: list[Any] | None = None
    volume_slots: int | None = None


@dataclass(frozen=True)
class SandboxCreate(_Request):
    """``POST /v1/sandboxes``: ``n`` sandboxes of a snapshot."""

    snapshot_tag: str
    n: int = 1
    per_child_netns: bool = False
    egress: dict[str, Any] | None = None
    memory_limit_mib: int | None = None
    prewarm: bool = False
    live_fork: bool = False
    hugepages: bool = False
    volumes: list[Any] | None = None
    timeout_secs: float | None = None
    on_timeout: str = "kill"
    metadata: dict[str, str] | None = None
    envs: dict[str, str] | None = None


@dataclass(frozen=True)
class Branch(_Request):
    """``POST /v1/sandboxes/{id}/branch``: capture a running sandbox as a snapshot."""

    tag: str | None = None
    mode: str | None = None
    wait: bool = True
    measure_diff: bool = False
    parent_tag: str | None = None
    settle_free_pages: bool = False
    diff: bool = False     # forkd's legacy spelling of mode
    live: bool = False


@dataclass(frozen=True)
class Exec(_Request):
    """``POST /v1/sandboxes/{id}/exec`` (and its stream)."""

    args: list[str]
    timeout_secs: float = 30
    env: dict[str, str | None] | None = None
    cwd: str | None = None
    stdin: str | None = None


@dataclass(frozen=True)
class Eval(_Request):
    """``POST /v1/sandboxes/{id}/eval``: Python in the warm interpreter."""

    code: str
    timeout_secs: float | None = None


@dataclass(frozen=True)
class RemoveFile(_Request):
    """``DELETE /v1/sandboxes/{id}/files`` (its query)."""

    path: str
    recursive: bool = False
    missing_ok: bool = False


@dataclass(frozen=True)
class PortExpose(_Request):
    """``POST /v1/sandboxes/{id}/ports``: publish a guest port on the host."""

    guest_port: int
    host_port: int = 0
    protocol: str = "tcp"


@dataclass(frozen=True)
class Egress(_Request):
    """``PUT /v1/sandboxes/{id}/egress``: a networked sandbox's outbound policy."""

    mode: str
    cidrs: list[str] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)
    reach_host: bool = False

    def as_policy_spec(self) -> dict[str, Any]:
        """The form ``networking.egress_policy`` reads (as a spawn's ``egress``)."""
        return {"mode": self.mode, "cidrs": list(self.cidrs), "domains": list(self.domains),
                "reach_host": self.reach_host}


@dataclass(frozen=True)
class WorkspaceCreate(_Request):
    """``POST /v1/workspaces``: a named sandbox that can be suspended and resumed."""

    name: str
    snapshot_tag: str
    per_child_netns: bool = False
    memory_limit_mib: int | None = None
    volumes: list[Any] | None = None
