"""OCI images as input: find an image, verify it, and apply its layers to a directory.

What a REF may be:

* ``oci:DIR[:TAG]``: an OCI image layout (``oci-layout``, ``index.json``,
  ``blobs/sha256/…``), as skopeo, umoci or buildah write it; a plain existing
  directory is taken as one too. TAG is the ``org.opencontainers.image.ref.name``
  annotation; without one, the layout must hold one image.
* ``oci-archive:TAR[:TAG]``: a tar of such a layout.
* ``docker-archive:TAR[:NAME]``: ``docker save`` output (``manifest.json``, a
  config JSON and layer tars); NAME picks one of its ``RepoTags``.
* ``HOST[:PORT]/REPO[:TAG|@sha256:HEX]``: pulled over the distribution API
  (``registry.py``); ``docker://`` may lead, as skopeo writes it.

How an image is found: the reference names an index (OCI index or Docker
manifest list) or a manifest. From an index we take the linux/amd64 entry (the
only platform vmfork guests run), nesting at most ``_MAX_NESTING`` indexes; an
index without one is an error that lists what it has. The manifest names the
config and the layers. Its digest is ``OciImageConfig.manifest_digest``, the
content address of the import (``resolve`` returns it without fetching layers,
so the builder can key its cache on it). A docker-archive has no manifest; its
config digest (Docker's image ID) stands in, as the config pins every layer
through ``rootfs.diff_ids``.

What is verified, before use: every document and blob fetched by digest is
hashed and compared with its digest and its descriptor's size, whether it comes
from a registry, a layout or an archive; each layer's decompressed stream is
compared with the config's diff_id as it is applied (``layers.py``), so a layer
that decompresses to something else fails the import. A manifest reached by tag
is hashed to give its digest (a registry's ``Docker-Content-Digest`` is not
trusted). The caller's ``root`` is expected to be discarded on error, as
``cache.cached_entry`` discards a failed build.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

from vmfork.image import tarstream
from vmfork.image.errors import ImageBuildError
from vmfork.image.layers import DEFAULT_LIMITS, LayerApplier, LayerRefused, Limits, decompressed
from vmfork.image.registry import (
    RegistryClient,
    RegistryError,
    RegistryRef,
    blob_cache_dir,
    cached_blob,
    normalized_name,
    parse_registry_ref,
)

__all__ = [
    "DEFAULT_LIMITS",
    "LayerRefused",
    "Limits",
    "OciImageConfig",
    "RegistryError",
    "import_image",
    "resolve",
]

Progress = Callable[[str, int, int | None], None]

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
CONFIG_TYPES = ("application/vnd.oci.image.config.v1+json",
                "application/vnd.docker.container.image.v1+json")
_LAYER_TYPE = re.compile(r"application/vnd\.(?:oci\.image\.layer\.(?:nondistributable\.)?v1\.tar"
                         r"(?:\+gzip|\+zstd)?|docker\.image\.rootfs\.(?:foreign\.)?diff\.tar"
                         r"(?:\.gzip)?)")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
REF_NAME = "org.opencontainers.image.ref.name"
_MAX_NESTING = 4
_ARCHIVE_LINK_HOPS = 8


@dataclass(frozen=True)
class OciImageConfig:
    """What an import made, and the image config the guest should honour."""

    ref: str  # what was asked for
    manifest_digest: str  # "sha256:<hex>" of the manifest used (content address of the import)
    layer_digests: list[str]  # compressed-blob digests, in order
    env: list[str]  # config.Env ("K=V")
    working_dir: str | None
    user: str | None
    entrypoint: list[str] | None
    cmd: list[str] | None
    unpacked_bytes: int  # regular-file bytes written over all layers


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a manifest or index says about a blob."""

    media_type: str
    digest: str
    size: int
    platform: str | None = None  # "os/arch[/variant]"
    ref_name: str | None = None

    @classmethod
    def parse(cls, raw: Any, where: str) -> Descriptor:
        if not isinstance(raw, dict):
            raise ImageBuildError("oci-manifest", f"{where}: a descriptor is not an object")
        digest, size = raw.get("digest"), raw.get("size")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            algorithm = digest.split(":")[0] if isinstance(digest, str) else digest
            raise ImageBuildError("oci-manifest", f"{where}: digest {digest!r} is not a sha256 "
                                  f"digest (algorithm {algorithm!r} is not supported)")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ImageBuildError("oci-manifest", f"{where}: descriptor of {digest} has no "
                                  "valid size")
        platform = raw.get("platform")
        plat = None
        if isinstance(platform, dict):
            plat = f"{platform.get('os', '?')}/{platform.get('architecture', '?')}"
            if platform.get("variant"):
                plat += f"/{platform['variant']}"
        annotations = raw.get("annotations")
        ref_name = annotations.get(REF_NAME) if isinstance(annotations, dict) else None
        media_type = raw.get("mediaType")
        return cls(media_type=media_type if isinstance(media_type, str) else "",
                   digest=digest, size=size, platform=plat,
                   ref_name=ref_name if isinstance(ref_name, str) else None)


@dataclass(frozen=True)
class _Image:
    manifest_digest: str
    config: bytes
    layers: list[Descriptor]


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as err:
        raise ImageBuildError("oci-manifest", f"{what} is not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ImageBuildError("oci-manifest", f"{what} is not a JSON object")
    return doc


def _verify_stream(f: IO[bytes], desc: Descriptor, where: str) -> None:
    """Hash ``f`` from its start and compare with ``desc``; leave it at its start."""
    h = hashlib.sha256()
    got = 0
    f.seek(0)
    while block := f.read(1 << 20):
        got += len(block)
        if got > desc.size:
            break
        h.update(block)
    f.seek(0)
    if got != desc.size:
        raise ImageBuildError("oci-verify", f"{where}: blob {desc.digest} is "
                              f"{'larger than' if got > desc.size else f'{got} bytes, not'} the "
                              f"{desc.size} bytes its descriptor says; the image is damaged")
    if "sha256:" + h.hexdigest() != desc.digest:
        raise ImageBuildError("oci-verify", f"{where}: blob {desc.digest} has digest "
                              f"sha256:{h.hexdigest()} (digest mismatch): the image is damaged "
                              "or was tampered with; it was not used")


class _Source:
    """Where an image's documents and blobs come from. Subclasses give ``top``,
    ``_choose_entry`` and ``_open_blob`` (or their own ``document`` and ``layer``);
    finding the linux/amd64 manifest through indexes is shared."""

    where: str

    def top(self, limits: Limits) -> tuple[list[Descriptor] | None, bytes | None, str]:
        """What the reference names: descriptors to choose among (a layout's index.json),
        or a document (its bytes and media type)."""
        raise NotImplementedError

    def document(self, desc: Descriptor, limits: Limits) -> bytes:
        """A verified manifest, index or config."""
        if desc.size > limits.max_document_bytes:
            raise ImageBuildError("oci-manifest", f"{self.where}: {desc.digest} is {desc.size} "
                                  f"bytes, over the cap of {limits.max_document_bytes} for a "
                                  "manifest or config (Limits.max_document_bytes)")
        with self.layer(desc, None) as f:
            return f.read()

    @contextmanager
    def layer(self, desc: Descriptor, progress: Callable[[int], None] | None
              ) -> Iterator[BinaryIO]:
        """A blob, verified, open at its start."""
        with self._open_blob(desc) as f:
            _verify_stream(f, desc, self.where)
            yield f

    def _open_blob(self, desc: Descriptor) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def find(self, limits: Limits) -> tuple[str, bytes | None, Descriptor | None]:
        """The digest of the linux/amd64 manifest: its bytes if already fetched, else
        the descriptor to fetch it by."""
        entries, body, media_type = self.top(limits)
        if entries is not None:
            desc = self._choose_entry(entries)
            body, media_type, digest = None, desc.media_type, desc.digest
        else:
            assert body is not None
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            desc = None
        for _ in range(_MAX_NESTING + 1):
            if body is None and media_type in MANIFEST_TYPES:
                return digest, None, desc  # named by a descriptor: resolve need not fetch it
            if body is None:
                assert desc is not None
                body = self.document(desc, limits)
            doc = _json(body, f"{self.where}: {digest}")
            # The document's own mediaType first; then the descriptor's or the HTTP
            # Content-Type if it is one we know (some registries send application/json);
            # else its shape, as OCI 1.0 made mediaType optional.
            declared = doc.get("mediaType")
            kind = (declared if isinstance(declared, str) and declared else
                    media_type if media_type in INDEX_TYPES + MANIFEST_TYPES else "")
            if doc.get("schemaVersion") == 1:
                raise ImageBuildError("oci-manifest", f"{self.where}: {digest} is a Docker "
                                      "schema 1 manifest, which is deprecated and not supported; "
                                      "push the image again with a current client")
            if kind in INDEX_TYPES or (not kind and "manifests" in doc):
                manifests = doc.get("manifests")
                if not isinstance(manifests, list):
                    raise ImageBuildError("oci-manifest", f"{self.where}: index {digest} has no "
                                          "manifests list")
                desc = _choose_platform([Descriptor.parse(m, f"{self.where}: index {digest}")
                                         for m in manifests], f"{self.where}: index {digest}")
                body, media_type, digest = None, desc.media_type, desc.digest
                continue
            if kind in MANIFEST_TYPES or (not kind and "layers" in doc):
                return digest, body, desc
            raise ImageBuildError("oci-manifest", f"{self.where}: {digest} has media type "
                                  f"{kind!r}, not an image manifest or index")
        raise ImageBuildError("oci-manifest", f"{self.where}: indexes nest more than "
                              f"{_MAX_NESTING} deep")

    def _choose_entry(self, entries: list[Descriptor]) -> Descriptor:
        raise NotImplementedError

    def image(self, limits: Limits) -> _Image:
        digest, body, desc = self.find(limits)
        if body is None:
            assert desc is not None
            body = self.document(desc, limits)
        manifest = _json(body, f"{self.where}: manifest {digest}")
        where = f"{self.where}: manifest {digest}"
        config = Descriptor.parse(manifest.get("config"), where)
        if config.media_type and config.media_type not in CONFIG_TYPES:
            raise ImageBuildError("oci-manifest", f"{where}: its config has media type "
                                  f"{config.media_type!r}: this is not a container image "
                                  "(an artifact such as a chart or signature?)")
        raw_layers = manifest.get("layers")
        if not isinstance(raw_layers, list):
            raise ImageBuildError("oci-manifest", f"{where}: it has no layers list")
        layers = [Descriptor.parse(x, where) for x in raw_layers]
        for i, layer in enumerate(layers):
            if layer.media_type and not _LAYER_TYPE.fullmatch(layer.media_type):
                raise ImageBuildError("oci-manifest", f"{where}: layer {i + 1} has media type "
                                      f"{layer.media_type!r}, which is not a file system layer")
        return _Image(digest, self.document(config, limits), layers)


def _choose_platform(entries: list[Descriptor], where: str) -> Descriptor:
    """The linux/amd64 entry of an index (a variant-less one first)."""
    amd64 = [d for d in entries if d.platform is not None
             and d.platform.split("/")[:2] == ["linux", "amd64"]]
    if amd64:
        return min(amd64, key=lambda d: d.platform != "linux/amd64")
    if len(entries) == 1 and entries[0].platform is None:
        return entries[0]  # one unlabelled image; its config's platform is checked later
    have = ", ".join(sorted({d.platform or "unlabelled" for d in entries})) or "nothing"
    raise ImageBuildError("oci-platform", f"{where} has no linux/amd64 image (it has {have}); "
                          "vmfork guests are linux/amd64: use an image built for it")


class _LayoutSource(_Source):
    """An OCI image layout: a directory, or (subclass) a tar of one."""

    def __init__(self, where: str, tag: str | None) -> None:
        self.where = where
        self.tag = tag

    def _read_top_file(self, name: str, cap: int) -> bytes:
        raise NotImplementedError

    def top(self, limits: Limits) -> tuple[list[Descriptor] | None, bytes | None, str]:
        try:
            layout = _json(self._read_top_file("oci-layout", 4096), f"{self.where}: oci-layout")
        except FileNotFoundError:
            raise ImageBuildError("oci-ref", f"{self.where} is not an OCI image layout (it has "
                                  "no oci-layout file)") from None
        if layout.get("imageLayoutVersion") != "1.0.0":
            raise ImageBuildError("oci-ref", f"{self.where}: image layout version "
                                  f"{layout.get('imageLayoutVersion')!r} is not 1.0.0")
        try:
            index = _json(self._read_top_file("index.json", limits.max_document_bytes),
                          f"{self.where}: index.json")
        except FileNotFoundError:
            raise ImageBuildError("oci-ref", f"{self.where} has no index.json") from None
        manifests = index.get("manifests")
        if not isinstance(manifests, list):
            raise ImageBuildError("oci-manifest", f"{self.where}: index.json has no manifests")
        entries = [Descriptor.parse(m, f"{self.where}: index.json") for m in manifests]
        return entries, None, OCI_INDEX

    def _choose_entry(self, entries: list[Descriptor]) -> Descriptor:
        chosen = [d for d in entries if d.ref_name == self.tag] if self.tag else entries
        tags = sorted({d.ref_name for d in entries if d.ref_name})
        if not chosen:
            raise ImageBuildError("oci-ref", f"{self.where} has no image tagged {self.tag!r} "
                                  f"(its tags: {', '.join(tags) or 'none'})")
        if len(chosen) == 1:
            return chosen[0]
        if all(d.platform for d in chosen):
            return _choose_platform(chosen, self.where)
        raise ImageBuildError("oci-ref", f"{self.where} holds {len(chosen)} images: name one "
                              f"with :TAG (its tags: {', '.join(tags) or 'none'})")


class _LayoutDir(_LayoutSource):
    def __init__(self, path: Path, tag: str | None, ref: str) -> None:
        super().__init__(ref, tag)
        self.path = path

    def _read_top_file(self, name: str, cap: int) -> bytes:
        with open(self.path / name, "rb") as f:
            data = f.read(cap + 1)
        if len(data) > cap:
            raise ImageBuildError("oci-manifest", f"{self.where}: {name} is over {cap} bytes")
        return data

    def _open_blob(self, desc: Descriptor) -> Any:
        path = self.path / "blobs" / "sha256" / desc.digest.removeprefix("sha256:")
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise ImageBuildError("oci-verify", f"{self.where}: blob {desc.digest} is missing "
                                  f"({path}): the layout is incomplete") from None


class _Section(io.RawIOBase):
    """A read-only window ``[offset, offset + size)`` of an open file (by pread)."""

    def __init__(self, fd: int, offset: int, size: int) -> None:
        super().__init__()
        self._fd, self._offset, self._size, self._pos = fd, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        data = os.pread(self._fd, want, self._offset + self._pos)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)


class _Archive:
    """A tar file's members by name, indexed in one pass over its headers."""

    def __init__(self, path: Path, where: str, limits: Limits) -> None:
        self.where = where
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - held until close()
        except OSError as err:
            raise ImageBuildError("oci-ref", f"cannot open {path}: {err.strerror}") from None
        self.files: dict[str, tuple[int, int]] = {}
        self.links: dict[str, tuple[str, bool]] = {}  # name -> (target, is symlink)
        try:
            tar = tarstream.TarStream(self._file, max_header_bytes=limits.max_header_bytes,
                                      max_name_bytes=limits.max_name_bytes)
            count = 0
            while (m := tar.next()) is not None:
                count += 1
                if count > limits.max_members:
                    raise ImageBuildError("oci-ref", f"{where}: more than {limits.max_members} "
                                          "members")
                name = posixpath.normpath("/" + m.name).lstrip("/")
                if m.kind == tarstream.FILE:
                    self.files[name] = (tar.data_offset, m.size)
                elif m.kind in (tarstream.SYMLINK, tarstream.HARDLINK):
                    self.links[name] = (m.linkname, m.kind == tarstream.SYMLINK)
        except tarstream.TarFormatError as err:
            self._file.close()
            raise ImageBuildError("oci-ref", f"{where}: not a readable tar archive ({err})") from None
        except BaseException:
            self._file.close()
            raise

    def lookup(self, name: str) -> tuple[int, int]:
        """``(offset, size)`` of member ``name``, following links inside the archive."""
        name = posixpath.normpath("/" + name).lstrip("/")
        for _ in range(_ARCHIVE_LINK_HOPS):
            if name in self.files:
                return self.files[name]
            if name not in self.links:
                raise FileNotFoundError(name)
            target, symlink = self.links[name]
            joined = posixpath.join(posixpath.dirname(name), target) if symlink else target
            if target.startswith("/") or posixpath.normpath(joined).startswith(".."):
                raise ImageBuildError("oci-ref", f"{self.where}: member {name!r} links outside "
                                      "the archive")
            name = posixpath.normpath(joined)
        raise ImageBuildError("oci-ref", f"{self.where}: member {name!r}: too many links")

    def open(self, name: str) -> BinaryIO:
        offset, size = self.lookup(name)
        return cast(BinaryIO, io.BufferedReader(_Section(self._file.fileno(), offset, size),
                                                 1 << 20))

    def read(self, name: str, cap: int) -> bytes:
        _, size = self.lookup(name)
        if size > cap:
            raise ImageBuildError("oci-manifest", f"{self.where}: {name} is {size} bytes, over "
                                  f"the cap of {cap}")
        with self.open(name) as f:
            return f.read()

    def close(self) -> None:
        self._file.close()


class _LayoutArchive(_LayoutSource):
    def __init__(self, path: Path, tag: str | None, ref: str, limits: Limits) -> None:
        super().__init__(ref, tag)
        self.archive = _Archive(path, ref, limits)

    def _read_top_file(self, name: str, cap: int) -> bytes:
        return self.archive.read(name, cap)

    def _open_blob(self, desc: Descriptor) -> Any:
        try:
            return self.archive.open("blobs/sha256/" + desc.digest.removeprefix("sha256:"))
        except FileNotFoundError:
            raise ImageBuildError("oci-verify", f"{self.where}: blob {desc.digest} is missing "
                                  "from the archive") from None

    def close(self) -> None:
        self.archive.close()


class _RegistrySource(_Source):
    def __init__(self, ref: RegistryRef, auth_file: Path | None, insecure: bool) -> None:
        self.where = str(ref)
        self.ref = ref
        self.client = RegistryClient(ref, auth_file=auth_file, insecure=insecure)

    def top(self, limits: Limits) -> tuple[list[Descriptor] | None, bytes | None, str]:
        body, media_type = self.client.manifest(self.ref.reference, limits.max_document_bytes)
        if self.ref.digest:
            got = "sha256:" + hashlib.sha256(body).hexdigest()
            if got != self.ref.digest:
                raise ImageBuildError("oci-verify", f"{self.where}: the registry sent a manifest "
                                      f"with digest {got} (digest mismatch); it was not used")
        return None, body, media_type

    def document(self, desc: Descriptor, limits: Limits) -> bytes:
        if desc.size > limits.max_document_bytes:
            return super().document(desc, limits)  # the cap's error
        if desc.media_type in INDEX_TYPES + MANIFEST_TYPES:
            return self._manifest(desc.digest, limits, desc.size)
        return super().document(desc, limits)

    def _manifest(self, digest: str, limits: Limits, size: int) -> bytes:
        """A manifest by digest: from the blob cache, or fetched, verified and cached."""
        path = blob_cache_dir() / digest.removeprefix("sha256:")
        try:
            body = path.read_bytes()
            if len(body) == size:
                return body
        except FileNotFoundError:
            pass
        body, _ = self.client.manifest(digest, limits.max_document_bytes)
        got = "sha256:" + hashlib.sha256(body).hexdigest()
        if got != digest or len(body) != size:
            raise ImageBuildError("oci-verify", f"{self.where}: manifest {digest} arrived with "
                                  f"digest {got} and {len(body)} bytes (digest mismatch); it was "
                                  "not used")
        _store(path, body)
        return body

    @contextmanager
    def layer(self, desc: Descriptor, progress: Callable[[int], None] | None
              ) -> Iterator[BinaryIO]:
        # cached_blob verified the digest as the bytes arrived; a cached blob was
        # verified when it entered the cache.
        with open(cached_blob(self.client, desc.digest, desc.size, progress), "rb") as f:
            yield f


def _store(path: Path, data: bytes) -> None:
    """Write a verified blob into the cache atomically (write, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".store-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class _DockerArchive(_Source):
    """``docker save`` output: manifest.json lists configs and layer tars by path."""

    def __init__(self, path: Path, name: str | None, ref: str, limits: Limits) -> None:
        self.where = ref
        self.name = name
        self.archive = _Archive(path, ref, limits)
        self._digests: dict[str, str] = {}  # layer digest -> member name

    def close(self) -> None:
        self.archive.close()

    def _entry(self, limits: Limits) -> dict[str, Any]:
        try:
            raw = self.archive.read("manifest.json", limits.max_document_bytes)
        except FileNotFoundError:
            raise ImageBuildError("oci-ref", f"{self.where} is not a docker-archive (no "
                                  "manifest.json)") from None
        try:
            entries = json.loads(raw)
        except ValueError as err:
            raise ImageBuildError("oci-manifest", f"{self.where}: manifest.json is not JSON "
                                  f"({err})") from None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ImageBuildError("oci-manifest", f"{self.where}: manifest.json is not a list of "
                                  "images")
        names = [t for e in entries for t in (e.get("RepoTags") or []) if isinstance(t, str)]
        if self.name is not None:
            wanted = normalized_name(self.name)
            chosen = [e for e in entries if wanted in
                      {normalized_name(t) for t in e.get("RepoTags") or [] if isinstance(t, str)}]
        else:
            chosen = entries
        if len(chosen) != 1:
            what = "no image named " + repr(self.name) if self.name else f"{len(chosen)} images"
            raise ImageBuildError("oci-ref", f"{self.where} has {what}: name one as "
                                  f"docker-archive:TAR:NAME (its names: "
                                  f"{', '.join(names) or 'none'})")
        return cast(dict[str, Any], chosen[0])

    def find(self, limits: Limits) -> tuple[str, bytes | None, Descriptor | None]:
        config = self._entry(limits).get("Config")
        if not isinstance(config, str):
            raise ImageBuildError("oci-manifest", f"{self.where}: manifest.json names no Config")
        body = self._member(config, limits.max_document_bytes)
        return "sha256:" + hashlib.sha256(body).hexdigest(), None, None

    def _member(self, name: str, cap: int) -> bytes:
        try:
            return self.archive.read(name, cap)
        except FileNotFoundError:
            raise ImageBuildError("oci-manifest", f"{self.where}: {name} is named by "
                                  "manifest.json but missing from the archive") from None

    def image(self, limits: Limits) -> _Image:
        entry = self._entry(limits)
        config_name, layer_names = entry.get("Config"), entry.get("Layers")
        if not isinstance(config_name, str) or not isinstance(layer_names, list):
            raise ImageBuildError("oci-manifest", f"{self.where}: manifest.json lacks Config or "
                                  "Layers")
        config = self._member(config_name, limits.max_document_bytes)
        layers = []
        for name in layer_names:
            if not isinstance(name, str):
                raise ImageBuildError("oci-manifest", f"{self.where}: a layer name is not text")
            try:
                with self.archive.open(name) as f:
                    h = hashlib.sha256()
                    size = 0
                    while block := f.read(1 << 20):
                        h.update(block)
                        size += len(block)
            except FileNotFoundError:
                raise ImageBuildError("oci-manifest", f"{self.where}: layer {name} is named by "
                                      "manifest.json but missing from the archive") from None
            digest = "sha256:" + h.hexdigest()
            self._digests[digest] = name
            layers.append(Descriptor("", digest, size))
        return _Image("sha256:" + hashlib.sha256(config).hexdigest(), config, layers)

    def _open_blob(self, desc: Descriptor) -> Any:
        return self.archive.open(self._digests[desc.digest])


@dataclass(frozen=True)
class _Config:
    env: list[str]
    working_dir: str | None
    user: str | None
    entrypoint: list[str] | None
    cmd: list[str] | None
    diff_ids: list[str]


def _parse_config(raw: bytes, where: str) -> _Config:
    doc = _json(raw, f"{where}: image config")
    os_name, arch = doc.get("os"), doc.get("architecture")
    if (os_name, arch) != ("linux", "amd64") and (os_name or arch):
        raise ImageBuildError("oci-platform", f"{where} is a {os_name}/{arch} image; vmfork "
                              "guests are linux/amd64: use an image built for it")
    cfg = doc.get("config") or {}
    if not isinstance(cfg, dict):
        raise ImageBuildError("oci-manifest", f"{where}: image config's config is not an object")

    def strings(key: str) -> list[str] | None:
        value = cfg.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ImageBuildError("oci-manifest", f"{where}: config.{key} is not a list of "
                                  "strings")
        return value

    def text(key: str) -> str | None:
        value = cfg.get(key)
        if value in (None, ""):
            return None
        if not isinstance(value, str):
            raise ImageBuildError("oci-manifest", f"{where}: config.{key} is not a string")
        return value

    rootfs = doc.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) and _DIGEST.fullmatch(d)
                                                 for d in diff_ids):
        raise ImageBuildError("oci-manifest", f"{where}: image config has no rootfs.diff_ids "
                              "(sha256 digests)")
    return _Config(env=strings("Env") or [], working_dir=text("WorkingDir"), user=text("User"),
                   entrypoint=strings("Entrypoint"), cmd=strings("Cmd"), diff_ids=diff_ids)


def _split_path(rest: str, kind: str) -> tuple[Path, str | None]:
    """``PATH[:SUFFIX]``, where PATH must exist: the whole string if it names something,
    else the shortest prefix before a ':' that does (so a path may contain ':')."""
    if not rest:
        raise ImageBuildError("oci-ref", f"{kind}: needs a path")
    if os.path.lexists(rest):
        return Path(rest), None
    for i, ch in enumerate(rest):
        if ch == ":" and i and os.path.lexists(rest[:i]):
            suffix = rest[i + 1:]
            if not suffix:
                raise ImageBuildError("oci-ref", f"{kind}{rest}: empty name after ':'")
            return Path(rest[:i]), suffix
    raise ImageBuildError("oci-ref", f"{kind}{rest}: no such file or directory "
                          f"{rest.split(':')[0]!r}")


def _open_source(ref: str, *, auth_file: Path | None, insecure: bool, limits: Limits) -> _Source:
    if ref.startswith("oci:"):
        path, tag = _split_path(ref[len("oci:"):], "oci:")
        if not path.is_dir():
            raise ImageBuildError("oci-ref", f"{ref}: {path} is not a directory (an OCI layout "
                                  "is one; a tar of one is oci-archive:)")
        return _LayoutDir(path, tag, ref)
    if ref.startswith("oci-archive:"):
        path, tag = _split_path(ref[len("oci-archive:"):], "oci-archive:")
        return _LayoutArchive(path, tag, ref, limits)
    if ref.startswith("docker-archive:"):
        path, name = _split_path(ref[len("docker-archive:"):], "docker-archive:")
        return _DockerArchive(path, name, ref, limits)
    if os.path.isdir(ref):
        return _LayoutDir(Path(ref), None, ref)
    if ref.startswith(("/", "./", "../")):
        raise ImageBuildError("oci-ref", f"{ref!r}: no such directory")
    return _RegistrySource(parse_registry_ref(ref), auth_file, insecure)


def _reporter(progress: Progress | None, stage: str, total: int | None, start: int
              ) -> Callable[[int], None] | None:
    if progress is None:
        return None
    report = progress
    return lambda done: report(stage, done - start, total)


def resolve(ref: str, *, auth_file: Path | None = None, insecure: bool = False) -> str:
    """The manifest digest REF names now (for the builder's cache key), without fetching layers."""
    source = _open_source(ref, auth_file=auth_file, insecure=insecure, limits=DEFAULT_LIMITS)
    try:
        return source.find(DEFAULT_LIMITS)[0]
    finally:
        source.close()


def import_image(ref: str, root: Path, *, progress: Progress | None = None,
                 auth_file: Path | None = None, insecure: bool = False,
                 limits: Limits = DEFAULT_LIMITS) -> OciImageConfig:
    """Fetch (or read), verify and apply REF's linux/amd64 image into the empty directory `root`.

    ``progress(stage, done, total)`` reports bytes: stage ``"fetch layer I/N"`` while
    a layer downloads (total is its size) and ``"apply layer I/N"`` while it is
    applied (done counts file bytes written in that layer; total is None).
    """
    try:
        with os.scandir(root) as entries:
            empty = next(entries, None) is None
    except (FileNotFoundError, NotADirectoryError):
        raise ImageBuildError("oci-import", f"{root} is not a directory: make it first") from None
    if not empty:
        raise ImageBuildError("oci-import", f"{root} is not empty: import into an empty "
                              "directory")
    with ExitStack() as stack:
        source = _open_source(ref, auth_file=auth_file, insecure=insecure, limits=limits)
        stack.callback(source.close)
        image = source.image(limits)
        config = _parse_config(image.config, source.where)
        if len(image.layers) > limits.max_layers:
            raise ImageBuildError("oci-manifest", f"{source.where} has {len(image.layers)} "
                                  f"layers, over the cap of {limits.max_layers}")
        if len(config.diff_ids) != len(image.layers):
            raise ImageBuildError("oci-manifest", f"{source.where}: the manifest has "
                                  f"{len(image.layers)} layers but the config "
                                  f"{len(config.diff_ids)} diff_ids")
        applier = stack.enter_context(LayerApplier(root, limits))
        count = len(image.layers)
        for i, (layer, diff_id) in enumerate(zip(image.layers, config.diff_ids, strict=True)):
            label = f"{source.where} layer {i + 1}/{count} ({layer.digest[:19]}…)"
            fetch_stage, apply_stage = f"fetch layer {i + 1}/{count}", f"apply layer {i + 1}/{count}"
            on_fetch = _reporter(progress, fetch_stage, layer.size, 0)
            on_apply = _reporter(progress, apply_stage, None, applier.unpacked_bytes)
            with source.layer(layer, on_fetch) as raw, decompressed(raw, label) as stream:
                got = applier.apply(stream, label, on_apply)
            if got != diff_id:
                raise ImageBuildError("oci-verify", f"{label} decompresses to {got}, but the "
                                      f"config's diff_id is {diff_id} (digest mismatch): the "
                                      "image is damaged")
        return OciImageConfig(ref=ref, manifest_digest=image.manifest_digest,
                              layer_digests=[x.digest for x in image.layers], env=config.env,
                              working_dir=config.working_dir, user=config.user,
                              entrypoint=config.entrypoint, cmd=config.cmd,
                              unpacked_bytes=applier.unpacked_bytes)
    raise AssertionError("unreachable")
