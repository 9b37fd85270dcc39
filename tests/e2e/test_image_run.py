"""``vmfork image build --run CMD`` end to end (issue 14): each command runs in a build
VM booted from the image so far, with a network, and what it changed in the file
system becomes the image's next layer.

Three steps on a small image: the first writes files, the second modifies, deletes
(a file of the base disk, a file of the first step, a whole directory made again:
an opaque directory) and links, the third installs a wheel with pip from the test
package index (``tests/pip_index.py``) served "on the internet" as PyPI would be. A
child of a snapshot of the image sees every change. A rebuild with the same steps
reuses every layer and says so; a failing step fails the build with its stderr,
records no image and leaves no VM, network or file behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pip_index import index_on_the_internet, wheel_dir
from vmfork.image import ImageMissing, find_image, read_record
from vmfork.paths import cache_dir, run_dir
from vmfork.runtime import network
from vmfork.runtime.parent import snapshot_parent
from vmfork.runtime.spawn import fork_children
from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote
from vmfork.store import Store

pytestmark = pytest.mark.e2e

REPO = Path(__file__).parents[2]
INET_NS = "vmfr-inet"
INDEX_ADDR, INDEX_PORT = "198.51.100.10", 8000
INDEX = f"http://{INDEX_ADDR}:{INDEX_PORT}/simple"
PIP = ("python3 -m pip install --disable-pip-version-check --no-cache-dir --retries 0 "
       f"--timeout 60 --index-url {INDEX} --trusted-host {INDEX_ADDR} six==1.16.0")
BASE = ["--env", "VMFORK_TEST_IMAGE=run"]     # t-run-base's definition (built natively)
WRITE = ("mkdir -p /srv/app/old && echo v1 > /srv/app/config && echo x > /srv/app/old/f "
         "&& echo bye > /srv/app/gone")
CHANGE = ("echo v2 >> /srv/app/config && chmod 600 /srv/app/config && rm /srv/app/gone "
          "/etc/debian_version && rm -rf /srv/app/old && mkdir /srv/app/old "
          "&& echo new > /srv/app/old/g && ln -s config /srv/app/link "
          "&& ln /srv/app/config /srv/app/hard")
STEPS = ["--run", WRITE, "--run", CHANGE, "--run", PIP]


def _vmfork(*args: str, timeout: float = 3000) -> tuple[int, str, str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "vmfork", "image", "build", *args],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


def _left_behind() -> tuple[list[str], list[str], list[str]]:
    left = network.leftovers("vmfb")
    builds = sorted(p.name for p in run_dir().glob("build-*")
                    if p.is_dir()) if run_dir().is_dir() else []
    return left.namespaces + left.links, left.tables, builds


@pytest.fixture(scope="module")
def index() -> Iterator[str]:
    if not any(wheel_dir().glob("six-*.whl")):
        pytest.fail(f"no test wheels in {wheel_dir()}: the set-up fetches them "
                    "(scripts/lib.sh setup_test_wheels)")
    with index_on_the_internet(INET_NS, address=INDEX_ADDR, port=INDEX_PORT,
                               link="rinet") as url:
        yield url


@pytest.fixture(scope="module")
def built(index: str) -> dict[str, object]:
    code, out, err, seconds = _vmfork("t-run", *BASE, *STEPS)
    assert code == 0, f"{out}\n{err}"
    print(f"\n--run build, three steps: {seconds:.1f} s\n{err}{out}")
    return {"seconds": seconds, "stderr": err, "image": find_image("t-run")}


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteProcess]:
    proc = start_zygote(str(tmp_path_factory.mktemp("zygote") / "z.sock"), timeout=180.0)
    yield proc
    proc.close()


def test_a_child_sees_what_each_step_wrote_changed_and_deleted(
        built: dict[str, object], zygote: ZygoteProcess, tmp_path: Path) -> None:
    image = find_image("t-run")
    layers = image.definition["run_layers"]
    assert [layer["command"] for layer in layers] == [WRITE, CHANGE, PIP]
    assert image.disk is not None and image.disk.is_file()
    store = Store.open(tmp_path / "home")
    snap = snapshot_parent(store, "run", image, mem_mib=384, warm_code="import six").snapshot
    client = zygote.client()
    fork = fork_children(client, snap, 1, tmp_path / "vms")
    assert not fork.failed, fork.failed
    child = fork.children[0]
    try:
        def sh(cmd: str) -> str:
            done = child.agent.exec(cmd)
            assert done.exit_code == 0, (cmd, done.stderr.decode(errors="replace"))
            return done.stdout.decode()

        assert sh("cat /srv/app/config") == "v1\nv2\n"                      # modified
        assert sh("stat -c %a /srv/app/config").strip() == "600"
        assert sh("ls /srv/app/old") == "g\n"                              # opaque dir
        assert sh("cat /srv/app/old/g") == "new\n"
        assert sh("readlink /srv/app/link").strip() == "config"
        assert sh("stat -c %i /srv/app/config") == sh("stat -c %i /srv/app/hard")
        for gone in ("/srv/app/gone", "/srv/app/old/f", "/etc/debian_version"):
            assert child.agent.exec(f"test -e {gone}").exit_code != 0, gone  # deleted
        assert sh("test -f /etc/os-release && echo base kept").strip() == "base kept"
        result = child.agent.eval("six.__version__")                      # pip's step
        assert result.exception is None and result.value == "'1.16.0'", result
        assert sh("echo $VMFORK_TEST_IMAGE").strip() == "run"
        # vmfork's own boot-time writes are not part of the image.
        assert child.agent.exec("test -e /.vmfork-rw").exit_code != 0
    finally:
        client.kill_and_wait(child.vm_id)


def test_a_rebuild_reuses_every_layer_and_says_so(built: dict[str, object]) -> None:
    first = find_image("t-run")
    code, out, err, seconds = _vmfork("t-run", *BASE, *STEPS)
    assert code == 0, f"{out}\n{err}"
    assert err.count("cached, layer") == 3, err
    again = find_image("t-run")
    assert again.disk_key == first.disk_key
    assert all(layer["cached"] for layer in again.definition["run_layers"])
    print(f"\nrebuild: {seconds:.1f} s against {built['seconds']:.1f} s")
    assert seconds < float(str(built["seconds"])) / 2
    # A changed command is a new layer on the same earlier ones.
    assert _left_behind() == ([], [], [])


def test_a_failing_step_fails_the_build_and_leaves_nothing(index: str) -> None:
    entries = set((cache_dir() / "disk-builds").iterdir())
    code, out, err, _ = _vmfork("t-run-bad", *BASE, "--run", WRITE, "--run",
                                "echo this step broke >&2; exit 3")
    assert code == 1, f"{out}\n{err}"
    assert "run #2" in err and "exited 3" in err and "this step broke" in err, err
    with pytest.raises(ImageMissing):
        read_record("t-run-bad")
    # What succeeded is kept (the first step: a fix of the second reuses it); nothing
    # half-built is, and nothing of the failed step.
    new = set((cache_dir() / "disk-builds").iterdir()) - entries
    assert all(not p.name.startswith(".") for p in new), (new, err)
    for entry in new:
        manifest = json.loads((entry / "manifest.json").read_text())
        assert (entry / "root.img").is_file(), (entry, err)
        assert "broke" not in manifest.get("command", ""), (manifest, err)
    assert _left_behind() == ([], [], [])


def test_egress_deny_refuses_the_download_with_the_reason(index: str) -> None:
    code, out, err, _ = _vmfork("t-run-deny", *BASE, "--egress", "deny", "--run", PIP)
    assert code == 1, f"{out}\n{err}"
    assert "egress policy is deny" in err, err
    with pytest.raises(ImageMissing):
        read_record("t-run-deny")
    assert _left_behind() == ([], [], [])
