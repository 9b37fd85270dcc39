"""Users' images end to end (issue 13): their packages warm in a parent, in every child.

The images are built by the set-up (``scripts/lib.sh`` ``setup_test_images``, from
``tests/images``), natively, where the registries are reachable; here they boot in
the emulated test host.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.image import find_image
from vmfork.runtime.guest import BootedGuest
from vmfork.runtime.parent import ParentFailed, ParentRequest, boot_parent, snapshot_parent
from vmfork.runtime.spawn import fork_children
from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote
from vmfork.store import Store, packs

pytestmark = pytest.mark.e2e

SCI_WARM = "import numpy, pandas"
COMPUTE = ("frame = pandas.DataFrame({'x': numpy.arange(10) * {n}}); "
           "int(frame['x'].sum()), numpy.__version__, pandas.__version__")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store.open(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteProcess]:
    proc = start_zygote(str(tmp_path_factory.mktemp("zygote") / "z.sock"), timeout=180.0)
    yield proc
    proc.close()


def _exec(guest: BootedGuest, cmd: str) -> str:
    done = guest.agent.exec(cmd)
    assert done.exit_code == 0, (cmd, done.stderr.decode(errors="replace"))
    return done.stdout.decode()


def test_disk_root_is_read_only_under_a_ram_overlay() -> None:
    image = find_image("t-sci-deb")
    with BootedGuest(image, mem_mib=384) as guest:
        mounts = _exec(guest, "cat /proc/mounts")
        root = next(line for line in mounts.splitlines() if line.split()[1] == "/")
        assert root.startswith("overlay / overlay"), mounts
        assert _exec(guest, "cat /sys/block/vda/ro").strip() == "1"
        # Writes land in guest RAM: allowed, and the disk never changes.
        _exec(guest, "echo changed > /usr/share/new-file && rm /etc/debian_version")
        assert "changed" in _exec(guest, "cat /usr/share/new-file")
        fail = guest.agent.exec("dd if=/dev/zero of=/dev/vda bs=512 count=1 conv=notrunc")
        assert fail.exit_code != 0
        # The image's env and the base's tools: bash, CA bundle, pip, libstdc++.
        env = _exec(guest, "env")
        assert "VMFORK_TEST_IMAGE=sci-deb" in env
        assert _exec(guest, "bash -c 'echo $BASH_VERSION'").startswith("5.")
        assert "pip" in _exec(guest, "python3 -m pip --version")
        _exec(guest, "test -s /etc/ssl/certs/ca-certificates.crt")
        _exec(guest, "ls /usr/lib/x86_64-linux-gnu/libstdc++.so.6")
        # The agent runs on the image's interpreter with its site-packages.
        result = guest.agent.eval("import numpy, sys; (numpy.__version__, sys.executable)")
        assert result.exception is None, result.exception
        assert "/usr/bin/python3" in str(result.value)
    # Nothing the guest wrote reached the file.
    assert image.disk is not None
    from vmfork.image.builder import disk_content_key
    assert disk_content_key(image.disk) == image.disk_key


@pytest.mark.parametrize("image_name", ["t-sci-deb", "t-sci-pip"])
def test_numpy_pandas_warm_in_ten_children(store: Store, zygote: ZygoteProcess,
                                           tmp_path: Path, image_name: str) -> None:
    image = find_image(image_name)
    # The way the CLI and the daemon make it: a jailed parent VMM (docs/security.md).
    boot_parent(ParentRequest(tag=image_name, image=image_name, mem_mib=384,
                              warm_code=SCI_WARM, store_root=str(store.root)), jail=True)
    snap = store.get(image_name)
    assert snap.meta.image == image_name and snap.meta.extra["image_disk"] == image.disk_key
    client = zygote.client()
    fork = fork_children(client, snap, 10, tmp_path / "vms")
    assert not fork.failed, fork.failed
    try:
        for n, child in enumerate(fork.children):
            # numpy and pandas are already imported: eval sees the parent's modules.
            result = child.agent.eval(COMPUTE.replace("{n}", str(n + 1)))
            assert result.exception is None, result.exception
            assert result.value is not None
            total, np_version, _pd_version = ast.literal_eval(result.value)
            assert total == 45 * (n + 1)
            assert np_version.startswith("2.0" if image_name == "t-sci-pip" else "1.")
        if image_name == "t-sci-pip":
            cwd = fork.children[0].agent.exec("pwd")
            assert cwd.stdout.decode().strip() == "/work"   # the image's workdir
    finally:
        for child in fork.children:
            client.kill_and_wait(child.vm_id)


def test_node_image_runs_its_own_programs() -> None:
    with BootedGuest(find_image("t-node"), mem_mib=384) as guest:
        out = _exec(guest, "node -e 'console.log([1, 2, 3].map(x => x * 2).join(\",\"))'")
        assert out.strip() == "2,4,6"


def test_warm_up_out_of_memory_says_so(store: Store) -> None:
    with pytest.raises(ParentFailed, match="ran out of memory.*--mem-mib") as caught:
        boot_parent(ParentRequest(tag="oom", image="t-sci-deb", mem_mib=128,
                                  warm_cmd="python3 -c 'b = bytearray(512 << 20)'",
                                  store_root=str(store.root)), jail=True)
    assert caught.value.kind == "warm_up"
    assert not store.exists("oom")


def test_pack_of_a_custom_image_spawns_in_a_fresh_store(store: Store, zygote: ZygoteProcess,
                                                        tmp_path: Path) -> None:
    image = find_image("t-sci-deb")
    if not store.exists("packed"):
        snapshot_parent(store, "packed", image, mem_mib=384, warm_code=SCI_WARM)
    out = tmp_path / "packed.tar.zst"
    report = packs.pack(store, "packed", out)
    assert report.image == "t-sci-deb"
    fresh = Store.open(tmp_path / "fresh")
    unpacked = packs.unpack(fresh, out)
    assert unpacked.tags == ["packed"], unpacked
    client = zygote.client()
    fork = fork_children(client, fresh.get("packed"), 1, tmp_path / "vms")
    assert not fork.failed, fork.failed
    try:
        result = fork.children[0].agent.eval("int(numpy.arange(4).sum())")
        assert result.exception is None and result.value == "6"
    finally:
        client.kill_and_wait(fork.children[0].vm_id)


def test_a_1_gib_image_boots_without_1_gib_of_ram() -> None:
    image = find_image("t-big")
    assert image.disk is not None and image.disk_size > 1 << 30
    with BootedGuest(image, mem_mib=256) as guest:
        assert _exec(guest, "stat -c %s /data/big.bin").strip() == str(1 << 30)
        # A slice from the end of the file reads back what the host wrote.
        out = _exec(guest, "dd if=/data/big.bin bs=1M skip=1020 count=2 2>/dev/null "
                           "| sha256sum").split()[0]
        meminfo = dict(line.split(":", 1) for line in
                       _exec(guest, "cat /proc/meminfo").splitlines())
    import hashlib

    from tests.images.prepare import big_file
    with open(big_file(), "rb") as f:
        f.seek(1020 << 20)
        assert out == hashlib.sha256(f.read(2 << 20)).hexdigest()
    total_kib = int(meminfo["MemTotal"].split()[0])
    assert total_kib < 256 << 10   # the guest never had room for the disk's bytes


def test_oci_image_python_runs_the_agent_with_its_config() -> None:
    image = find_image("t-oci-python")
    assert image.built_from.startswith("oci:") and image.agent_python == "/usr/bin/python3.11 -I"
    with BootedGuest(image, mem_mib=256) as guest:
        # The image's Env, WorkingDir and User are exec's defaults.
        assert _exec(guest, "echo $APP_MODE; pwd; id -u").split() == ["oci", "/srv", "65534"]
        result = guest.agent.eval("import sys; sys.executable")
        assert result.exception is None and result.value == repr("/usr/bin/python3.11")


def test_oci_node_image_without_python_gets_the_bundled_agent() -> None:
    image = find_image("t-oci-node")
    assert image.agent_python is not None and "/opt/vmfork/python" in image.agent_python
    with BootedGuest(image, mem_mib=256) as guest:
        assert _exec(guest, "node -e 'console.log(6 * 7)'").strip() == "42"
        # The bundled interpreter is kept apart: the image has no python of its own.
        assert guest.agent.exec("command -v python3").exit_code != 0
        result = guest.agent.eval("import sys; sys.prefix")
        assert result.exception is None and result.value == repr("/opt/vmfork/python/usr")
