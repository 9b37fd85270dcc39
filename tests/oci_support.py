"""Writing real OCI image layouts in tests (no external tool needed).

``make_oci_layout`` turns a directory tree into a single-layer linux/amd64 image
and returns its REF (``oci:<out>:<tag>``). The lower-level helpers build layouts
with several layers, other platforms, indexes and chosen compressions, which the
OCI import tests use for tricky and hostile images.

The layout follows the image-spec (``oci-layout``, ``index.json``,
``blobs/sha256/<hex>``) closely enough that skopeo copies it to a registry.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TYPES = {
    None: "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
REF_NAME = "org.opencontainers.image.ref.name"


def tar_of_tree(tree: Path) -> bytes:
    """An uncompressed pax tar of ``tree``'s contents (sorted, so reproducible).

    Hard links within the tree become tar hard links (tarfile tracks inodes).
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(tree):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = Path(dirpath) / name
                tar.add(path, arcname=str(path.relative_to(tree)), recursive=False)
    return buf.getvalue()


def compress(data: bytes, compression: str | None) -> bytes:
    if compression is None:
        return data
    if compression == "gzip":
        return gzip.compress(data, mtime=0)
    if compression == "zstd":
        return subprocess.run(["zstd", "-q", "-c"], input=data, stdout=subprocess.PIPE,
                              check=True).stdout
    raise ValueError(compression)


def write_blob(out: Path, data: bytes, media_type: str) -> dict[str, Any]:
    """Store ``data`` in the layout's blobs; return its descriptor."""
    digest = hashlib.sha256(data).hexdigest()
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / digest).write_bytes(data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def add_image(out: Path, layers: list[bytes], *, compression: str | None = "gzip",
              env: list[str] | None = None, workdir: str | None = None,
              user: str | None = None, cmd: list[str] | None = None,
              entrypoint: list[str] | None = None, os_name: str = "linux",
              arch: str = "amd64", variant: str | None = None,
              diff_ids: list[str] | None = None) -> dict[str, Any]:
    """Write an image (config, layers, manifest) into the layout ``out``; return the
    manifest's descriptor, with its platform. ``layers`` are uncompressed tars;
    ``diff_ids`` overrides the config's (to make a lying image)."""
    layer_descs = [write_blob(out, compress(layer, compression), LAYER_TYPES[compression])
                   for layer in layers]
    config: dict[str, Any] = {"Env": env if env is not None else ["PATH=/bin:/usr/bin"]}
    if workdir is not None:
        config["WorkingDir"] = workdir
    if user is not None:
        config["User"] = user
    if cmd is not None:
        config["Cmd"] = cmd
    if entrypoint is not None:
        config["Entrypoint"] = entrypoint
    platform = {"architecture": arch, "os": os_name}
    if variant:
        platform["variant"] = variant
    image_config = {
        **platform, "config": config,
        "rootfs": {"type": "layers",
                   "diff_ids": diff_ids if diff_ids is not None else
                   ["sha256:" + hashlib.sha256(x).hexdigest() for x in layers]},
        "history": [{"created_by": "tests/oci_support.py"} for _ in layers],
    }
    config_desc = write_blob(out, json.dumps(image_config).encode(), OCI_CONFIG)
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config_desc,
                "layers": layer_descs}
    desc = write_blob(out, json.dumps(manifest).encode(), OCI_MANIFEST)
    desc["platform"] = platform
    return desc


def add_index(out: Path, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """Write an image index (a multi-platform image) over ``manifests``; its descriptor."""
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}
    return write_blob(out, json.dumps(index).encode(), OCI_INDEX)


def write_index(out: Path, tagged: dict[str, dict[str, Any]]) -> None:
    """Write ``oci-layout`` and ``index.json`` naming ``{tag: descriptor}``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    entries = []
    for tag, desc in tagged.items():
        entry = {k: v for k, v in desc.items() if k != "platform"}
        entry["annotations"] = {REF_NAME: tag}
        entries.append(entry)
    (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX,
                                                "manifests": entries}))


def make_oci_layout(tree: Path, out: Path, tag: str = "latest", env: list[str] | None = None,
                    workdir: str | None = None, user: str | None = None) -> str:
    """Write a single-layer linux/amd64 OCI image layout of ``tree`` at ``out``.

    Returns the REF for ``vmfork.image.oci.import_image``: ``oci:<out>:<tag>``.
    """
    desc = add_image(out, [tar_of_tree(tree)], env=env, workdir=workdir, user=user)
    write_index(out, {tag: desc})
    return f"oci:{out}:{tag}"
