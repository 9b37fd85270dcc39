"""Records of ``/v1/images``: ``ImageInfo`` (an image, or its build in flight or
failed) and the lines of its build's progress.

Typed, unlike the forkd-shaped dicts of the snapshot and sandbox calls: images are
vmfork's own surface, so nothing constrains their shape to forkd's SDK. ``raw``
keeps the whole JSON record for fields a newer daemon adds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

BUILDING = "building"
READY = "ready"
FAILED = "failed"


@dataclass(frozen=True)
class ImageProgress:
    """One line the builder reported: its step (``base``, ``apt``, ``pip``, ``copy``,
    ``disk``, ...), what it did, and when (unix seconds)."""

    step: str
    message: str
    at: float


@dataclass(frozen=True)
class ImageInfo:
    """A guest image (``status`` ``ready``) or its build or import (``building``, or
    ``failed`` with ``error``). Sizes in bytes; paths are on the daemon's host."""

    name: str
    status: str
    size: int | None = None
    root: str | None = None                 # initramfs | disk
    disk: str | None = None
    disk_format: str | None = None
    built_from: str | None = None           # the base image, or an OCI reference
    definition: Mapping[str, Any] = field(default_factory=dict)
    created: str | None = None              # ISO 8601, UTC
    env: tuple[str, ...] = ()
    workdir: str | None = None
    user: str | None = None
    progress: tuple[ImageProgress, ...] = ()   # a job's last lines (at most 200)
    error: str | None = None
    previous: ImageInfo | None = None       # the image that keeps the name meanwhile
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ready(self) -> bool:
        return self.status == READY

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ImageInfo:
        previous = data.get("previous")
        return cls(
            name=str(data["name"]), status=str(data["status"]), size=data.get("size"),
            root=data.get("root"), disk=data.get("disk"), disk_format=data.get("disk_format"),
            built_from=data.get("built_from") or data.get("from"),
            definition=dict(data.get("definition") or {}), created=data.get("created"),
            env=tuple(data.get("env") or ()), workdir=data.get("workdir"),
            user=data.get("user"),
            progress=tuple(ImageProgress(str(p["step"]), str(p["message"]), float(p["at"]))
                           for p in data.get("progress") or ()),
            error=data.get("error"),
            previous=cls.from_json(previous) if isinstance(previous, Mapping) else None,
            raw=dict(data))
