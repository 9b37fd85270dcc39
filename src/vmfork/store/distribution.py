"""Snapshots over the OCI distribution API: ``vmfork push`` and ``vmfork pull``.

A chain travels as an OCI artifact (see docs/distribution.md for the whole format):

* one blob per store object: each snapshot's ``state.bin``, the root's ``memory.bin``,
  each link's ``layer.bin``, and the guest image's ``vmlinux``, ``initramfs.cpio``
  (and ``root.img``), each compressed by ``zstd``, with media types of our own
  (``application/vnd.vmfork.<object>.v1+zstd``) and its store path as its
  ``org.opencontainers.image.title`` annotation. A memory plan is not sent: the
  puller computes it over the pulled chain, as an unpacked link does;
* a config blob (``application/vnd.vmfork.chain.v1+json``): exactly a pack's
  ``manifest.json`` (``packs.chain_manifest``: tags, parents, metas, the hash and
  size of every uncompressed file), so a pull is checked by the same code as an
  unpack;
* an image manifest (``artifactType application/vnd.vmfork.snapshot.v1``) listing
  them, with the chain's structure (``root <- ... <- head``, one entry per snapshot
  naming its blobs) in its ``dev.vmfork.chain`` annotation.

Blobs are content addressed, so what a registry has is not sent twice: a push HEADs
each blob first, tries a cross-repository mount from a repository of the same
registry this store pushed it to before, and only then uploads it in chunks (PATCH
with ``Content-Range``, then PUT ``?digest=``). A blob's digest is that of its
compressed bytes; the store remembers which compressed digest each file hash gave
(``<store>/distribution/digests.json``), so a chain whose base went up before is
not even compressed again to find out. The record is only a hint: a wrong one gives
a manifest whose pull fails its hashes, never a snapshot with other content.

A pull trusts nothing the registry says. The manifest and config are size-capped,
the manifest is hashed (and compared with the ``@sha256:`` asked for, or with the
signature's), every blob is capped by the size its uncompressed file may have and
streamed into the store's pending directory, resumed with ``Range`` requests after
a dropped connection, and checked against its digest; it is then decompressed and
checked against the config's hash of the file. Snapshots already in the store with
the same content are neither downloaded nor stored again. Nothing is published until
every file of the chain was verified, and a failed pull removes everything it wrote.

Signing: ``push --sign KEY`` (an Ed25519 private key, PEM) signs
``"vmfork-snapshot-signature-v1\\n" + <manifest digest>`` and pushes the signature
as a small artifact (``application/vnd.vmfork.signature.v1``) under the tag
``sha256-<hex>.sig``, the convention cosign made common (registries without the
referrers API serve it). ``pull --verify-key KEY`` (the public key, PEM) fetches it
and refuses an unsigned snapshot, or one signed by another key, saying which.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmfork.image.errors import ImageBuildError
from vmfork.image.registry import RegistryClient, RegistryError, RegistryRef, parse_registry_ref
from vmfork.image.tarstream import TarFormatError
from vmfork.ondisk.durable import write_file_atomic
from vmfork.store import packs
from vmfork.store.errors import StoreError
from vmfork.store.layers import LAYER_FILE
from vmfork.store.store import MEMORY_FILE, STATE_FILE, Store
from vmfork.store.tags import validate_tag

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.vmfork.snapshot.v1"
CONFIG_TYPE = "application/vnd.vmfork.chain.v1+json"
SIGNATURE_TYPE = "application/vnd.vmfork.signature.v1"
SIGNATURE_BLOB_TYPE = "application/vnd.vmfork.signature.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
TITLE = "org.opencontainers.image.title"
CHAIN_ANNOTATION = "dev.vmfork.chain"
SIGNED_PREFIX = b"vmfork-snapshot-signature-v1\n"
OBJECT_TYPES = {
    STATE_FILE: "application/vnd.vmfork.snapshot.state.v1+zstd",
    MEMORY_FILE: "application/vnd.vmfork.snapshot.memory.v1+zstd",
    LAYER_FILE: "application/vnd.vmfork.snapshot.layer.v1+zstd",
    packs.KERNEL_FILE: "application/vnd.vmfork.image.kernel.v1+zstd",
    packs.INITRD_FILE: "application/vnd.vmfork.image.initramfs.v1+zstd",
    packs.DISK_FILE: "application/vnd.vmfork.image.disk.v1+zstd",
}

MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = packs.MAX_MANIFEST_BYTES
MAX_SIGNATURE_BYTES = 64 << 10
CHUNK_BYTES = 16 << 20           # per PATCH of an upload
ZSTD_LEVEL = "-3"


class DistributionError(StoreError):
    """A push or pull failed or was refused; for a pull, nothing was stored."""


Progress = Callable[[str, int, int], None]   # (what, bytes done, bytes total)


@dataclass
class PushReport:
    ref: str                          # HOST/REPO:TAG as pushed
    digest: str                       # the manifest's
    tags: list[str]                   # the chain, root to head
    uploaded: list[str] = field(default_factory=list)   # blob digests sent
    mounted: list[str] = field(default_factory=list)    # mounted from another repository
    present: list[str] = field(default_factory=list)    # the registry had them
    bytes_uploaded: int = 0
    signature: str | None = None      # the signature's tag, if signed


@dataclass
class PullReport:
    ref: str
    digest: str
    tags: list[str] = field(default_factory=list)
    stored: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)  # blob digests fetched
    skipped: list[str] = field(default_factory=list)     # blobs of what the store holds
    bytes_downloaded: int = 0
    resumed: int = 0                                     # downloads continued by Range
    image: str | None = None
    image_note: str | None = None
    signed_by: str | None = None                         # the verifying key's fingerprint


def parse_ref(ref: str) -> RegistryRef:
    try:
        return parse_registry_ref(ref)
    except ImageBuildError as err:
        why = str(err).removeprefix("step oci-ref: ").split(": write ")[0]
        raise DistributionError(f"{why}: a snapshot's REF is HOST[:PORT]/REPO[:TAG|"
                                "@sha256:HEX], for example 127.0.0.1:5000/team/snaps:v1"
                                ) from None


def _client(ref: RegistryRef, auth_file: Path | None, insecure: bool,
            actions: str) -> RegistryClient:
    return RegistryClient(ref, auth_file=auth_file, insecure=insecure, actions=actions)


# -- the digest record ------------------------------------------------------------------

class _DigestRecord:
    """``{file hash: {"digest", "size", "repos": [host/repo, ...]}}`` for this store's
    pushes: which compressed blob a file became and where it went."""

    _lock = threading.Lock()

    def __init__(self, store: Store) -> None:
        self.path = store.root / "distribution" / "digests.json"

    def load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_bytes())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def update(self, file_hash: str, digest: str, size: int, repo: str) -> None:
        with self._lock:
            data = self.load()
            entry = data.get(file_hash)
            if not isinstance(entry, dict) or entry.get("digest") != digest:
                entry = {"digest": digest, "size": size, "repos": []}
            repos = [r for r in entry.get("repos", []) if isinstance(r, str) and r != repo]
            entry["repos"] = (repos + [repo])[-16:]
            data[file_hash] = entry
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomic(self.path, json.dumps(data).encode())


# -- push -------------------------------------------------------------------------------

def _compress(path: Path, scratch: Path) -> tuple[Path, str, int]:
    """``path`` compressed into ``scratch``: the file, its sha256 digest and size."""
    out = scratch / f"blob-{secrets.token_hex(8)}"
    with open(out, "xb") as sink:
        done = subprocess.run(["zstd", "-q", "-c", "-T0", ZSTD_LEVEL, str(path)], stdout=sink,
                              stderr=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise DistributionError(f"zstd failed on {path}: "
                                f"{done.stderr.decode(errors='replace')[:300]}")
    h = hashlib.sha256()
    with open(out, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return out, "sha256:" + h.hexdigest(), out.stat().st_size


def push(store: Store, tag: str, ref: str, *, sign_key: Path | None = None,
         auth_file: Path | None = None, insecure: bool = False, with_image: bool = True,
         chunk_bytes: int = CHUNK_BYTES, progress: Progress | None = None) -> PushReport:
    """Push the chain ending at ``tag`` to ``ref`` (``HOST[:PORT]/REPO[:TAG]``; the
    registry tag defaults to the snapshot's)."""
    target = parse_ref(ref)
    if target.digest is not None:
        raise DistributionError(f"{ref!r}: a push names a tag, not a digest (the digest is "
                                "what the push makes)")
    signer = _load_private_key(sign_key) if sign_key is not None else None
    registry_tag = target.tag or validate_tag(tag)
    target = RegistryRef(target.host, target.repository, registry_tag, None)
    try:
        manifest, entries = packs.chain_manifest(store, tag, with_image=with_image)
    except packs.PackError as err:
        raise DistributionError(str(err).replace("pack", "push")) from None
    if manifest.get("volumes"):
        # A pack carries them (checked on unpack); a registry artifact has no media type
        # or pull-side check for them yet, and a child must never run without one.
        raise DistributionError(f"snapshot {tag!r} attaches read-only volumes, which a push "
                                "does not carry yet; move it with `vmfork pack` / `vmfork "
                                "unpack`, which do")
    hashes = _entry_hashes(manifest)
    client = _client(target, auth_file, insecure, "pull,push")
    record = _DigestRecord(store)
    known = record.load()
    repo_name = f"{target.host}/{target.repository}"
    report = PushReport(str(target), "", [s["tag"] for s in manifest["snapshots"]])
    total = sum(size for _n, _p, size in entries)
    done_bytes = 0
    layers: list[dict[str, Any]] = []
    with contextlib.ExitStack() as cleanup:
        # Compressed blobs wait in a pending directory of the store (never published):
        # the store's own stale cleanup removes it after a crash.
        scratch = cleanup.enter_context(store.begin(f"push-{secrets.token_hex(8)}")).path
        for name, path, size in entries:
            file_hash = hashes[name]
            kind = name.rsplit("/", 1)[-1]
            hint = known.get(file_hash)
            digest: str | None = None
            blob_size: int | None = None
            hinted: str | None = None
            location = None            # an upload a refused mount started
            if isinstance(hint, dict) and isinstance(hint.get("digest"), str) \
                    and isinstance(hint.get("size"), int):
                # Known from an earlier push: here already, or mounted from where it went,
                # without compressing the file again.
                digest, blob_size = hint["digest"], hint["size"]
                if client.has_blob(digest) == blob_size:
                    report.present.append(digest)
                else:
                    mounted, location = _mount(client, digest, hint, repo_name)
                    if mounted:
                        report.mounted.append(digest)
                    else:
                        hinted, digest = digest, None
            if digest is None:
                blob, digest, blob_size = _compress(path, scratch)
                if location is not None and digest != hinted:
                    location = None            # zstd changed: that upload was for another
                if client.has_blob(digest) == blob_size:
                    report.present.append(digest)
                else:
                    mounted = False
                    if location is None:
                        mounted, location = _mount(client, digest, hint, repo_name)
                    if mounted:
                        report.mounted.append(digest)
                    else:
                        _upload(client, blob, digest, blob_size, location, chunk_bytes,
                                report, progress, name)
                blob.unlink()
            assert isinstance(blob_size, int)
            record.update(file_hash, digest, blob_size, repo_name)
            layers.append({"mediaType": OBJECT_TYPES[kind], "digest": digest,
                           "size": blob_size, "annotations": {TITLE: name}})
            done_bytes += size
            if progress is not None:
                progress(f"{len(layers)}/{len(entries)} blobs", done_bytes, total)
        config = json.dumps(manifest, indent=1, sort_keys=True).encode()
        config_desc = _put_small_blob(client, config, CONFIG_TYPE)
        by_name = {layer["annotations"][TITLE]: layer["digest"] for layer in layers}
        chain = [{"tag": s["tag"], "parent_tag": s["parent_tag"],
                  "content_hash": s["content_hash"],
                  "blobs": {f: by_name[f"snapshots/{s['tag']}/{f}"] for f in s["files"]}}
                 for s in manifest["snapshots"]]
        body = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
            "config": config_desc, "layers": layers,
            "annotations": {CHAIN_ANNOTATION: json.dumps({"head": manifest["head"],
                                                          "snapshots": chain}),
                            "dev.vmfork.head": manifest["head"]},
        }, sort_keys=True).encode()
        report.digest = client.put_manifest(registry_tag, body, OCI_MANIFEST)
        if signer is not None:
            report.signature = _push_signature(client, signer, report.digest)
    return report


def _entry_hashes(manifest: dict[str, Any]) -> dict[str, str]:
    """Each file's hash (of its uncompressed bytes) by its store path."""
    out = {f"snapshots/{s['tag']}/{name}": spec["hash"]
           for s in manifest["snapshots"] for name, spec in s["files"].items()}
    if manifest.get("image"):
        out.update({f"image/{name}": spec["hash"]
                    for name, spec in manifest["image"]["files"].items()})
    return out


def _mount(client: RegistryClient, digest: str, hint: Any,
           repo_name: str) -> tuple[bool, str | None]:
    """Try a cross-repository mount of ``digest`` from a repository of this registry the
    store pushed it to: ``(True, None)`` if mounted; ``(False, location)`` with the
    upload the registry started instead, or ``(False, None)`` with nowhere to mount
    from."""
    host = client.ref.host + "/"
    repos = hint.get("repos", []) if isinstance(hint, dict) else []
    sources = [r.removeprefix(host) for r in repos
               if isinstance(r, str) and r.startswith(host) and r != repo_name]
    if not sources:
        return False, None
    location = client.mount_blob(digest, sources[-1])    # the latest push first
    return location is None, location


def _upload(client: RegistryClient, blob: Path, digest: str, size: int,
            location: str | None, chunk_bytes: int, report: PushReport,
            progress: Progress | None, name: str) -> None:
    def sent(n: int) -> None:
        if progress is not None:
            progress(f"uploading {name}", n, size)

    with open(blob, "rb") as source_file:
        client.upload_blob(location or client.start_upload(), source_file, size, digest,
                           chunk_bytes, sent)
    report.uploaded.append(digest)
    report.bytes_uploaded += size


def _put_small_blob(client: RegistryClient, data: bytes, media_type: str) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if client.has_blob(digest) != len(data):
        location = client.start_upload()
        client.upload_blob(location, io.BytesIO(data), len(data), digest, CHUNK_BYTES)
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


# -- signatures -------------------------------------------------------------------------

def _load_private_key(path: Path) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    try:
        key = load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise DistributionError(f"cannot read the signing key {path}: {err} (an unencrypted "
                                "Ed25519 private key in PEM, as `openssl genpkey -algorithm "
                                "ed25519` writes)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise DistributionError(f"the signing key {path} is not an Ed25519 key")
    return key


def _load_public_key(path: Path) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    try:
        key = load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as err:
        raise DistributionError(f"cannot read the verifying key {path}: {err} (an Ed25519 "
                                "public key in PEM, as `openssl pkey -pubout` writes)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise DistributionError(f"the verifying key {path} is not an Ed25519 key")
    return key


def _raw_public(key: Any) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    return bytes(key.public_bytes(Encoding.Raw, PublicFormat.Raw))


def key_fingerprint(public_key: Any) -> str:
    return "sha256:" + hashlib.sha256(_raw_public(public_key)).hexdigest()[:32]


def signature_tag(digest: str) -> str:
    return digest.replace(":", "-") + ".sig"


def _push_signature(client: RegistryClient, signer: Any, digest: str) -> str:
    signature = signer.sign(SIGNED_PREFIX + digest.encode())
    public = signer.public_key()
    doc = json.dumps({"manifest_digest": digest, "algorithm": "ed25519",
                      "key": key_fingerprint(public),
                      "signature": base64.b64encode(signature).decode()}).encode()
    layer = _put_small_blob(client, doc, SIGNATURE_BLOB_TYPE)
    empty = _put_small_blob(client, b"{}", EMPTY_TYPE)
    body = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                       "artifactType": SIGNATURE_TYPE, "config": empty, "layers": [layer],
                       "annotations": {"dev.vmfork.signed-manifest": digest}},
                      sort_keys=True).encode()
    tag = signature_tag(digest)
    client.put_manifest(tag, body, OCI_MANIFEST)
    return tag


def _verify_signature(client: RegistryClient, digest: str, key_path: Path, key: Any) -> str:
    """The verifying key's fingerprint, if a signature by it over ``digest`` is in the
    registry; raises saying whether the snapshot is unsigned or signed otherwise."""
    from cryptography.exceptions import InvalidSignature
    tag = signature_tag(digest)
    try:
        body, _ = client.manifest(tag, MAX_SIGNATURE_BYTES)
    except RegistryError as err:
        if err.status == 404:
            raise DistributionError(f"refusing {client.ref}: it is not signed (no signature "
                                    f"{tag} in {client.ref.repository}); nothing was "
                                    "stored") from None
        raise
    try:
        doc = json.loads(body)
        layer = doc["layers"][0]
        sig_digest, sig_size = layer["digest"], layer["size"]
        if not isinstance(sig_size, int) or not 0 < sig_size <= MAX_SIGNATURE_BYTES:
            raise ValueError("oversized")
    except (ValueError, KeyError, IndexError, TypeError):
        raise DistributionError(f"refusing {client.ref}: its signature {tag} is malformed; "
                                "nothing was stored") from None
    with tempfile.TemporaryFile() as f:
        got = client.resume_blob_to(sig_digest, sig_size, f)
        f.seek(0)
        raw = f.read()
    if "sha256:" + got != sig_digest:
        raise DistributionError(f"refusing {client.ref}: its signature blob does not match its "
                                "digest; nothing was stored")
    try:
        sig = json.loads(raw)
        signed = sig["manifest_digest"]
        signature = base64.b64decode(sig["signature"], validate=True)
    except (ValueError, KeyError, TypeError):
        raise DistributionError(f"refusing {client.ref}: its signature {tag} is malformed; "
                                "nothing was stored") from None
    if signed != digest:
        raise DistributionError(f"refusing {client.ref}: its signature is for {signed}, not "
                                f"{digest}; nothing was stored")
    try:
        key.verify(signature, SIGNED_PREFIX + digest.encode())
    except InvalidSignature:
        raise DistributionError(
            f"refusing {client.ref}: it is signed, but not by the key {key_path} "
            f"({key_fingerprint(key)}; the signature names {sig.get('key')!r}); nothing was "
            "stored") from None
    return key_fingerprint(key)


# -- pull -------------------------------------------------------------------------------

def pull(store: Store, ref: str, *, head_tag: str | None = None, force: bool = False,
         verify_key: Path | None = None, auth_file: Path | None = None,
         insecure: bool = False, retries: int = 5,
         progress: Progress | None = None) -> PullReport:
    """Pull the chain ``ref`` names into ``store`` (see the module docstring for what is
    checked); ``head_tag`` renames the chain's head, ``force`` replaces snapshots that
    hold other content under its tags."""
    source = parse_ref(ref)
    if head_tag is not None:
        validate_tag(head_tag)
    key = _load_public_key(verify_key) if verify_key is not None else None
    client = _client(source, auth_file, insecure, "pull")
    body, _media_type = client.manifest(source.reference, MAX_MANIFEST_BYTES)
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    if source.digest is not None and digest != source.digest:
        raise DistributionError(f"refusing {ref}: the registry sent a manifest whose digest is "
                                f"{digest}; nothing was stored")
    report = PullReport(str(source), digest)
    if verify_key is not None:
        report.signed_by = _verify_signature(client, digest, verify_key, key)
    layers, config_desc = _parse_manifest(body, ref)
    config = _fetch_small(client, config_desc, MAX_CONFIG_BYTES, "its config")
    try:
        manifest = json.loads(config)
    except (ValueError, RecursionError):
        raise _refused(ref, "its config is not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != packs.PACK_FORMAT \
            or manifest.get("format_version") != packs.PACK_FORMAT_VERSION:
        raise _refused(ref, "its config is not a vmfork chain this vmfork reads "
                       f"({packs.PACK_FORMAT} version {packs.PACK_FORMAT_VERSION})")
    unpack_report = packs.UnpackReport()
    with contextlib.ExitStack() as cleanup:
        staging = cleanup.enter_context(store.begin(f"pull-{secrets.token_hex(8)}"))
        try:
            plan = packs._plan(store, manifest, head_tag, force, unpack_report)
            image_here = _image_already_here(manifest.get("image"))
            if image_here is not None:
                manifest = {**manifest, "image": None}
            expected = packs._expected_entries(plan, manifest, staging.path)
        except packs.PackError as err:
            raise DistributionError(str(err).replace("refusing pack", f"refusing {ref}")
                                    ) from None
        missing = sorted(set(expected) - set(layers))
        if missing:
            raise _refused(ref, f"its manifest lists no blob for {', '.join(missing)}")
        # The image's blobs are not wanted when this host has that image.
        skippable = {n for n in layers if n.startswith("image/")} if image_here else set()
        extra = set(layers) - set(expected) - skippable
        if extra:
            raise _refused(ref, f"its manifest lists blobs its config does not name: "
                           f"{', '.join(sorted(extra))}")
        blobs = staging.path / "blobs"
        blobs.mkdir()
        wanted = [(n, e) for n, e in expected.items() if e.target is not None]
        report.skipped = sorted({layers[n]["digest"] for n, e in expected.items()
                                 if e.target is None} | {layers[n]["digest"] for n in skippable})
        total = sum(layers[n]["size"] for n, _e in wanted)
        done_before = 0
        for i, (name, want) in enumerate(wanted):
            desc = layers[name]
            limit = want.size + (want.size >> 6) + (1 << 20)
            if desc["size"] > limit:
                raise _refused(ref, f"blob {name} claims {desc['size']} bytes, more than "
                               f"{want.size} bytes compress to")
            blob = blobs / desc["digest"].removeprefix("sha256:")
            base = done_before

            def got(n: int, base: int = base, what: str = f"{i + 1}/{len(wanted)} blobs "
                    f"({name})") -> None:
                if progress is not None:
                    progress(what, base + n, total)

            if not blob.exists():
                resumed = _download(client, desc, blob, retries, got, ref)
                report.resumed += resumed
                report.downloaded.append(desc["digest"])
                report.bytes_downloaded += desc["size"]
            _decompress_into(blob, want, name, ref)
            done_before += desc["size"]
        try:
            packs._check_disk(manifest.get("image"), staging.path / "image")
            # Verified. Only now does anything outside the staging directory change.
            packs._replace_for_force(store, plan)
            packs._publish(store, plan, staging.path, unpack_report)
            if manifest.get("image") is not None:
                unpack_report.image, unpack_report.image_note = packs._install_image(
                    manifest["image"], staging.path / "image")
        except packs.PackError as err:
            raise DistributionError(str(err).replace("refusing pack", f"refusing {ref}")
                                    ) from None
    report.tags, report.stored = unpack_report.tags, unpack_report.stored
    report.present = unpack_report.present
    report.image = unpack_report.image or image_here
    report.image_note = unpack_report.image_note
    return report


def _refused(ref: str, why: str) -> DistributionError:
    return DistributionError(f"refusing {ref}: {why}; nothing was stored")


def _parse_manifest(body: bytes, ref: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise _refused(ref, "its manifest is not JSON") from None
    if not isinstance(doc, dict) or doc.get("artifactType") != ARTIFACT_TYPE \
            and (doc.get("config") or {}).get("mediaType") != CONFIG_TYPE:
        raise _refused(ref, f"it is not a vmfork snapshot (no {ARTIFACT_TYPE} artifact; an "
                       "image to build from is `vmfork image build --from`)")
    config = _descriptor(doc.get("config"), ref, CONFIG_TYPE)
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list) or len(raw_layers) > 3 * (64 + 2):
        raise _refused(ref, "its manifest's layers are not a list of blobs")
    layers: dict[str, dict[str, Any]] = {}
    for raw in raw_layers:
        title = (raw.get("annotations") or {}).get(TITLE) if isinstance(raw, dict) else None
        if not isinstance(title, str) or title in layers:
            raise _refused(ref, "a blob of its manifest has no title, or one another has")
        kind = title.rsplit("/", 1)[-1]
        desc = _descriptor(raw, ref, OBJECT_TYPES.get(kind, "?"))
        layers[title] = desc
    return layers, config


def _descriptor(raw: Any, ref: str, media_type: str) -> dict[str, Any]:
    if not (isinstance(raw, dict) and raw.get("mediaType") == media_type
            and isinstance(raw.get("digest"), str)
            and re.fullmatch(r"sha256:[0-9a-f]{64}", raw["digest"])
            and isinstance(raw.get("size"), int) and raw["size"] >= 0):
        raise _refused(ref, f"a descriptor of its manifest is malformed (wanted a {media_type} "
                       "blob with a sha256 digest and a size)")
    return raw


def _image_already_here(entry: Any) -> str | None:
    """The name of the image the chain needs when this host has it with the same bytes
    (so its blobs are not downloaded)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
            or not isinstance(entry.get("files"), dict):
        return None
    from vmfork.image import ImageError, find_image
    from vmfork.store.layers import hash_file
    try:
        image = find_image(entry["name"])
    except ImageError:
        return None
    local = {packs.KERNEL_FILE: image.kernel, packs.INITRD_FILE: image.initrd}
    if image.disk is not None:
        local[packs.DISK_FILE] = image.disk
    if set(local) != set(entry["files"]):
        return None
    for name, path in local.items():
        spec = entry["files"][name]
        if not isinstance(spec, dict) or not path.is_file() \
                or path.stat().st_size != spec.get("size") or hash_file(path) != spec.get("hash"):
            return None
    return image.name


def _fetch_small(client: RegistryClient, desc: dict[str, Any], cap: int, what: str) -> bytes:
    if desc["size"] > cap:
        raise _refused(str(client.ref), f"{what} claims {desc['size']} bytes (cap {cap})")
    with tempfile.TemporaryFile() as f:
        got = client.resume_blob_to(desc["digest"], desc["size"], f)
        f.seek(0)
        data = f.read()
    if "sha256:" + got != desc["digest"]:
        raise _refused(str(client.ref), f"{what} does not match its digest")
    return data


def _download(client: RegistryClient, desc: dict[str, Any], blob: Path, retries: int,
              progress: Callable[[int], None], ref: str) -> int:
    """Fetch one blob into ``blob`` (a partial file beside it until it is verified);
    returns how many times the download was resumed."""
    partial = blob.with_name(blob.name + ".partial")
    with open(partial, "xb") as out:
        got = client.resume_blob_to(desc["digest"], desc["size"], out, retries=retries,
                                    progress=progress)
        out.flush()
        os.fsync(out.fileno())
    resumed = client.last_resumes
    if "sha256:" + got != desc["digest"]:
        partial.unlink()
        raise _refused(ref, f"blob {desc['digest']} arrived with digest sha256:{got}: a "
                       "corrupt registry or a tampered connection")
    os.rename(partial, blob)
    return resumed


def _decompress_into(blob: Path, want: Any, name: str, ref: str) -> None:
    """Decompress a verified blob into its staging target, checking the file's own
    hash (and that the stream holds exactly the file)."""
    zstd = subprocess.Popen(["zstd", "-q", "-d", "-c", str(blob)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert zstd.stdout is not None
        try:
            digest = packs._copy(zstd.stdout, want)   # type: ignore[arg-type]
        except TarFormatError as err:
            raise _refused(ref, f"{name} decompresses short ({err})") from None
        if zstd.stdout.read(1):
            raise _refused(ref, f"{name} decompresses to more than its {want.size} bytes")
        zstd.stdout.close()
        if zstd.wait() != 0:
            raise _refused(ref, f"{name} is not a valid zstd stream")
    finally:
        packs._reap(zstd)
    if digest != want.digest:
        raise _refused(ref, f"{name} does not match its hash (config {want.digest}, content "
                       f"{digest})")
    want.seen = True
    blob.unlink()
