"""A pack carries its snapshot's read-only volumes (issue 14): a parent with a
directory volume and an image-file volume is packed, unpacked into a fresh store with
a fresh cache (another host: nothing of the volumes is there), and a child spawned by
a zygote of that cache reads both volumes as the parent's children do."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.image import find_image
from vmfork.runtime.parent import snapshot_parent
from vmfork.runtime.spawn import fork_children
from vmfork.runtime.volumes import VolumeSpec, prepare, volume_image_path
from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote
from vmfork.store import Store, packs

pytestmark = pytest.mark.e2e


@pytest.fixture
def fresh_zygote(tmp_path: Path) -> Iterator[tuple[ZygoteProcess, Path]]:
    cache = tmp_path / "other-host-cache"
    proc = start_zygote(str(tmp_path / "z.sock"), timeout=180.0,
                        env=dict(os.environ, VMFORK_CACHE_DIR=str(cache)))
    yield proc, cache
    proc.close()


def test_unpacked_elsewhere_the_volumes_attach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               fresh_zygote: tuple[ZygoteProcess, Path]) -> None:
    data = tmp_path / "corpus"
    data.mkdir()
    blob = os.urandom(3 << 20)
    (data / "blob.bin").write_bytes(blob)
    image_file = tmp_path / "small.img"
    # An ext4 image file made by mkfs.ext4 -d, read-only: named by its bytes.
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "hello").write_text("from an image file\n")
    with open(image_file, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-d", str(seed), str(image_file)], check=True)
    volumes = (prepare(VolumeSpec(str(data), "/data", True)),
               prepare(VolumeSpec(str(image_file), "/img", True)))
    source = Store.open(tmp_path / "source")
    snapshot_parent(source, "vols", find_image("default"), mem_mib=256, volumes=volumes)
    out = tmp_path / "vols.tar.zst"
    packs.pack(source, "vols", out)

    zygote, cache = fresh_zygote
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(cache))
    assert not any(volume_image_path(v.key).exists() for v in volumes)
    target = Store.open(tmp_path / "target")
    report = packs.unpack(target, out)
    assert report.stored == ["vols"]
    assert all(volume_image_path(v.key).is_file() for v in volumes)
    client = zygote.client()
    fork = fork_children(client, target.get("vols"), 1, tmp_path / "vms")
    assert not fork.failed, fork.failed
    child = fork.children[0]
    try:
        done = child.agent.exec("sha256sum /data/blob.bin && cat /img/hello")
        assert done.exit_code == 0, done.stderr
        lines = done.stdout.decode().splitlines()
        assert lines[0].split()[0] == hashlib.sha256(blob).hexdigest()
        assert lines[1] == "from an image file"
    finally:
        client.kill_and_wait(child.vm_id)
