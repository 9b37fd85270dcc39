"""Snapshots pushed to and pulled from a real registry (Debian's docker-registry, started
per module as the OCI import tests start it), between two real stores: content-addressed
dedupe both ways, a tampered blob refused with nothing stored, a dropped connection
resumed through a real TCP proxy, auth from the Docker config file (Basic and bearer
tokens), and Ed25519 signatures with both refusals."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_chains import image, make_link, make_root, page
from test_image_oci import Registry, credential_helper, start_registry
from test_packs import image_cache  # noqa: F401 - the fake image 'default', a fixture

from vmfork.store import Store, chains
from vmfork.store.distribution import DistributionError, pull, push


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"), None, log_level="info")


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry-basic"), "htpasswd")


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry-token"), "token")


@pytest.fixture
def source(tmp_path: Path) -> Store:
    store = Store.open(tmp_path / "source")
    # Random pages, so the base's memory blob is big enough to cut mid-download.
    make_root(store, "base", {n: os.urandom(4096) for n in range(1, 200)} | {700: b"base-700"})
    make_link(store, "base", "numpy", {2: b"numpy-2"})
    make_link(store, "numpy", "pandas", {3: b"pandas-3"})
    make_link(store, "base", "other", {5: b"other-5"})
    return store


@pytest.fixture
def target(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "target")


def leftovers(store: Store) -> list[str]:
    return sorted(os.listdir(store.snapshots_dir))


def uploads(reg: Registry) -> list[str]:
    """The blob uploads the registry completed (PUT …/blobs/uploads/…?digest=), from its
    own access log."""
    log = (reg.storage.parent / "registry.log").read_text(errors="replace")
    found = re.findall(r'http\.request\.method=PUT http\.request\.remoteaddr=\S+ '
                       r'http\.request\.uri="[^"]*/blobs/uploads/[^"]*digest=(sha256%3A|sha256:)'
                       r'([0-9a-f]{64})', log)
    return [f"sha256:{hexdigest}" for _sep, hexdigest in found]


def patches(reg: Registry) -> int:
    """Upload chunks the registry accepted (its combined access log)."""
    log = (reg.storage.parent / "registry.log").read_text(errors="replace")
    return len(re.findall(r'"PATCH /v2/[^ ]*/blobs/uploads/[^ ]* HTTP/1\.1" 202', log))


def blob_data(reg: Registry, digest: str) -> Path:
    hexdigest = digest.removeprefix("sha256:")
    return reg.storage / f"docker/registry/v2/blobs/sha256/{hexdigest[:2]}/{hexdigest}/data"


def test_push_pull_round_trip_with_dedupe_both_ways(registry: Registry, source: Store,
                                                    target: Store, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ref = f"{registry.host}/team/snaps:numpy"
    before, chunks_before = uploads(registry), patches(registry)
    first = push(source, "numpy", ref, chunk_bytes=64 << 10)
    # Chunked: the base's memory (800 KiB of random pages, compressed) alone is 13 chunks.
    assert patches(registry) - chunks_before >= 13 + 5
    assert first.tags == ["base", "numpy"] and first.present == []
    # state + memory, state + layer, kernel + initramfs: six blobs, each sent once.
    assert len(first.uploaded) == 6 == len(set(first.uploaded))
    sent = uploads(registry)[len(before):]
    assert set(first.uploaded) <= set(sent)

    # A second chain on the same base sends only its new link (and its config): of its
    # eight blobs, six are in the registry already.
    mark = len(uploads(registry))
    second = push(source, "pandas", f"{registry.host}/team/snaps:pandas")
    assert len(second.uploaded) == 2 and len(second.present) == 6
    new = uploads(registry)[mark:]
    assert set(second.uploaded) <= set(new) and not set(new) & set(first.uploaded)
    # Another repository of the registry gets the known blobs by cross-repo mount.
    third = push(source, "numpy", f"{registry.host}/other/repo")
    assert third.ref.endswith("other/repo:numpy")
    assert set(third.mounted) == set(first.uploaded) and third.uploaded == []

    # Pull into an empty store, with a fresh image cache: everything comes down.
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(tmp_path / "fresh-cache"))
    got = pull(target, ref)
    assert got.digest == first.digest and got.stored == ["base", "numpy"]
    assert got.image == "default" and len(got.downloaded) == 6
    for tag in ("base", "numpy"):
        assert image(target, tag) == image(source, tag)
        assert target.get(tag).meta.content_hash == source.get(tag).meta.content_hash
    assert target.get("numpy").is_layered and page(target, "numpy", 700) == b"base-700"
    assert {c.status for c in chains.verify(target)} <= {"ok", "unhashed"}
    # The deeper chain: only pandas' blobs are fetched; base, numpy and the image are here.
    deeper = pull(target, f"{registry.host}/team/snaps:pandas", head_tag="pandas-copy")
    assert deeper.present == ["base", "numpy"] and deeper.stored == ["pandas-copy"]
    assert len(deeper.downloaded) == 2 and len(deeper.skipped) == 6
    assert page(target, "pandas-copy", 3) == b"pandas-3"
    # By digest, again: nothing to fetch, nothing stored.
    again = pull(target, f"{registry.host}/team/snaps@{first.digest}")
    assert again.downloaded == [] and again.stored == [] and again.present == ["base", "numpy"]
    assert leftovers(target) == ["base", "numpy", "pandas-copy"]


def test_a_tampered_blob_is_refused_and_nothing_is_stored(registry: Registry, source: Store,
                                                          target: Store) -> None:
    report = push(source, "other", f"{registry.host}/tamper/snaps:other", with_image=False)
    manifest = json.loads(subprocess.run(
        ["curl", "-sf", "-H", "Accept: application/vnd.oci.image.manifest.v1+json",
         f"http://{registry.host}/v2/tamper/snaps/manifests/other"],
        check=True, capture_output=True).stdout)
    layer = next(d for d in manifest["layers"]
                 if d["annotations"]["org.opencontainers.image.title"].endswith("layer.bin"))
    data = blob_data(registry, layer["digest"])
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(DistributionError, match="arrived with digest"):
        pull(target, f"{registry.host}/tamper/snaps:other")
    assert leftovers(target) == []           # not even the verified base
    # A digest the registry does not have: refused by it, nothing stored either.
    with pytest.raises(Exception, match="not found"):
        pull(target, f"{registry.host}/tamper/snaps@sha256:{report.digest[7:][::-1]}")
    assert leftovers(target) == []


class CuttingProxy:
    """A real TCP proxy in front of the registry that drops the first connection serving
    a blob (no Range asked) after ``cut_after`` bytes of its answer; with ``always``,
    every blob connection, ranged or not."""

    def __init__(self, upstream: str, cut_after: int, always: bool = False) -> None:
        self.always = always
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.cut_after = cut_after
        self.cuts = 0
        self.ranges: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        head = client.recv(65536)
        text = head.decode(errors="replace")
        for line in text.split("\r\n"):
            if line.lower().startswith("range:"):
                self.ranges.append(line.split(":", 1)[1].strip())
        blob_get = text.startswith("GET ") and "/blobs/sha256:" in text.split("\r\n", 1)[0]
        cut = blob_get and (self.always or (self.cuts == 0 and "range:" not in text.lower()))
        upstream.sendall(head)

        def up() -> None:
            try:
                while data := client.recv(65536):
                    upstream.sendall(data)
            except OSError:
                pass

        threading.Thread(target=up, daemon=True).start()
        sent = 0
        try:
            while data := upstream.recv(65536):
                if cut and sent + len(data) > self.cut_after:
                    client.sendall(data[:self.cut_after - sent])
                    self.cuts += 1
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.sock.close()


def test_a_dropped_connection_mid_blob_resumes_with_a_range(registry: Registry, source: Store,
                                                            target: Store) -> None:
    push(source, "base", f"{registry.host}/resume/snaps:base", with_image=False)
    proxy = CuttingProxy(registry.host, cut_after=200 << 10)
    try:
        report = pull(target, f"{proxy.host}/resume/snaps:base")
    finally:
        proxy.close()
    assert proxy.cuts == 1 and report.resumed == 1
    assert any(re.fullmatch(r"bytes=\d+-", r) and r != "bytes=0-" for r in proxy.ranges)
    assert report.stored == ["base"] and image(target, "base") == image(source, "base")


def test_a_download_that_keeps_breaking_fails_and_leaves_nothing(
        registry: Registry, source: Store, target: Store) -> None:
    push(source, "base", f"{registry.host}/broken/snaps:base", with_image=False)
    proxy = CuttingProxy(registry.host, cut_after=2 << 10, always=True)
    try:
        with pytest.raises(Exception, match="the download broke"):
            pull(target, f"{proxy.host}/broken/snaps:base", retries=2)
    finally:
        proxy.close()
    assert proxy.cuts >= 3 and leftovers(target) == []


def test_basic_auth_from_the_docker_config(basic_registry: Registry, source: Store,
                                           target: Store, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ref = f"{basic_registry.host}/private/snaps:numpy"
    with pytest.raises(Exception, match="needs a user name and password"):
        push(source, "numpy", ref, with_image=False)
    docker_config = tmp_path / "docker"
    docker_config.mkdir()
    (docker_config / "config.json").write_bytes(basic_registry.auth_file(tmp_path).read_bytes())
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config))
    push(source, "numpy", ref, with_image=False)
    assert pull(target, ref).stored == ["base", "numpy"]


def test_basic_auth_from_a_credential_helper(basic_registry: Registry, source: Store,
                                            target: Store, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``credsStore``: the password lives in a helper, not in the config file."""
    assert basic_registry.creds is not None
    user, password = basic_registry.creds
    answer = json.dumps({"ServerURL": basic_registry.host, "Username": user, "Secret": password})
    bin_dir = tmp_path / "bin"
    credential_helper(bin_dir, "vmfork-test", f"""read server
[ "$1" = get ] && [ "$server" = "{basic_registry.host}" ] || {{ echo "credentials not found"; exit 1; }}
echo '{answer}'
""")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    docker_config = tmp_path / "docker"
    docker_config.mkdir()
    (docker_config / "config.json").write_text(json.dumps({"credsStore": "vmfork-test"}))
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config))
    ref = f"{basic_registry.host}/private/helper:numpy"
    push(source, "numpy", ref, with_image=False)
    assert pull(target, ref).stored == ["base", "numpy"]


def test_bearer_tokens_for_push_and_pull(token_registry: Registry, source: Store,
                                         target: Store, tmp_path: Path) -> None:
    ref = f"{token_registry.host}/private/tok:numpy"
    with pytest.raises(Exception, match="token service refused anonymous access"):
        push(source, "numpy", ref, with_image=False)
    auth = token_registry.auth_file(tmp_path)
    token_registry.token_requests.clear()
    report = push(source, "numpy", ref, with_image=False, auth_file=auth)
    assert len(report.uploaded) == 4 and token_registry.token_requests
    assert pull(target, ref, auth_file=auth).stored == ["base", "numpy"]


def keypair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    private, public = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(private)],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(private), "-pubout", "-out", str(public)],
                   check=True, capture_output=True)
    return private, public


def test_signing_round_trip_and_both_refusals(registry: Registry, source: Store,
                                              target: Store, tmp_path: Path) -> None:
    mine, mine_pub = keypair(tmp_path, "mine")
    _theirs, theirs_pub = keypair(tmp_path, "theirs")
    signed = push(source, "numpy", f"{registry.host}/signed/snaps:numpy", sign_key=mine,
                  with_image=False)
    assert signed.signature == signed.digest.replace(":", "-") + ".sig"
    push(source, "other", f"{registry.host}/signed/snaps:unsigned", with_image=False)
    with pytest.raises(DistributionError, match="it is not signed"):
        pull(target, f"{registry.host}/signed/snaps:unsigned", verify_key=mine_pub)
    with pytest.raises(DistributionError, match="signed, but not by the key"):
        pull(target, f"{registry.host}/signed/snaps:numpy", verify_key=theirs_pub)
    assert leftovers(target) == []
    report = pull(target, f"{registry.host}/signed/snaps:numpy", verify_key=mine_pub)
    assert report.stored == ["base", "numpy"] and report.signed_by


def test_push_and_pull_as_daemon_jobs(registry: Registry, tmp_path: Path) -> None:
    from test_server_http import TOKEN, _serve

    from vmfork.client import Controller
    serving = _serve(tmp_path, TOKEN)
    served = next(serving)
    try:
        make_root(served.store, "base", {1: b"daemon-1"})
        make_link(served.store, "base", "linked", {2: b"daemon-2"})
        ctl = Controller(served.url, token=TOKEN.decode(), timeout=10)
        ref = f"{registry.host}/daemon/snaps:linked"
        started = ctl.push_snapshot("linked", ref, with_image=False)
        assert started["kind"] == "push" and started["status"] in ("running", "done")
        pushed = ctl.wait_transfer(started["id"], timeout=120)
        assert pushed["status"] == "done", pushed
        assert pushed["result"]["tags"] == ["base", "linked"]
        assert pushed["progress"]["bytes_done"] == pushed["progress"]["bytes_total"] > 0
        job = ctl.pull_snapshot(ref, tag="copy")
        pulled = ctl.wait_transfer(job["id"], timeout=120)
        assert pulled["status"] == "done", pulled
        assert pulled["result"]["present"] == ["base"] and pulled["result"]["stored"] == ["copy"]
        assert page(served.store, "copy", 2) == b"daemon-2"
        failed = ctl.wait_transfer(ctl.pull_snapshot(f"{registry.host}/daemon/none:x")["id"])
        assert failed["status"] == "failed" and "not found" in failed["error"]
        assert {j["id"] for j in ctl.list_transfers()} >= {started["id"], job["id"]}
        status, body, _ = served.request("POST", "/v1/snapshots/nope/push", {"ref": ref})
        assert status == 404
        status, body, _ = served.request("POST", "/v1/snapshots/pull", {"ref": "no host"})
        assert status == 400 and "ref" in body["error"]
    finally:
        serving.close()


def test_hostile_manifests_are_refused_and_leave_nothing(registry: Registry, source: Store,
                                                         target: Store) -> None:
    from vmfork.image.registry import RegistryClient, parse_registry_ref
    good = push(source, "numpy", f"{registry.host}/hostile/snaps:numpy", with_image=False)
    client = RegistryClient(parse_registry_ref(f"{registry.host}/hostile/snaps"),
                            actions="pull,push")
    body, _ = client.manifest(good.digest, 1 << 20)
    manifest = json.loads(body)

    def put(tag: str, doc: dict[str, object]) -> str:
        client.put_manifest(tag, json.dumps(doc).encode(),
                            "application/vnd.oci.image.manifest.v1+json")
        return f"{registry.host}/hostile/snaps:{tag}"

    # Not a vmfork snapshot at all (a container image's config type).
    image_like = dict(manifest, artifactType=None,
                      config=dict(manifest["config"],
                                  mediaType="application/vnd.oci.image.config.v1+json"))
    with pytest.raises(DistributionError, match="not a vmfork snapshot"):
        pull(target, put("image-like", image_like))
    # A blob the config names is missing from the manifest.
    missing = dict(manifest, layers=[d for d in manifest["layers"]
                                     if not d["annotations"][
                                         "org.opencontainers.image.title"].endswith("layer.bin")])
    with pytest.raises(DistributionError, match="lists no blob for snapshots/numpy/layer.bin"):
        pull(target, put("missing", missing))
    # A descriptor claiming more bytes than its file could compress to.
    layers = [dict(d) for d in manifest["layers"]]
    state = next(d for d in layers
                 if d["annotations"]["org.opencontainers.image.title"].endswith("state.bin"))
    state["size"] = 1 << 40
    with pytest.raises(DistributionError, match="more than"):
        pull(target, put("oversized", dict(manifest, layers=layers)))
    # A blob under a title the config does not name.
    extra = dict(manifest, layers=manifest["layers"] + [
        dict(manifest["layers"][0], annotations={
            "org.opencontainers.image.title": "snapshots/evil/state.bin"})])
    with pytest.raises(DistributionError, match="does not name"):
        pull(target, put("extra", extra))
    assert leftovers(target) == []
