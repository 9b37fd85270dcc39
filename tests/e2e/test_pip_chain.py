"""forkd's pip chain, for real (issue 14 items 1-2), through ``vmfork serve`` and the CLI.

A package index (``tests/pip_index.py``: the pinned wheels the set-up fetched, as a
PEP 503 repository over HTTP) runs "on the internet": a namespace routed from the
host, as PyPI would be. Then, as forkd's README does it (with ``--network``):

    snapshot --tag py-base --network --warm-cmd 'pip install idna'     (a warm-up that downloads)
    snapshot-diff --from py-base  --tag py-numpy --network --exec 'pip install numpy==2.0.2'
    snapshot-diff --from py-numpy --tag py-pandas --network --exec 'pip install pandas==2.2.3'

A child of the head imports them all; ``snapshot-info`` shows the chain; the head's
layers against what pip installed, counted as the file system counts an installed size
(allocated blocks, ``du``; ``tests/pip_index.py`` INSTALLED), are printed (the issue's
1.2x is measured by ``bench/pip_chain.py``) and held under 1.5x here, which only a
build whose freed pages were dropped meets; a build
under ``--egress deny`` is refused with the reason and builds nothing; the head compacts
and packs. The numbers (build time, layer size against both the apparent and the
allocated installed size, spawn time of head against base) are printed for the closing
note.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_daemon import Daemon, Home
from tests.pip_index import INSTALLED, index_on_the_internet, wheel_dir
from vmfork.client import ControllerError
from vmfork.runtime import network
from vmfork.store import Store

pytestmark = pytest.mark.e2e

PREFIX = "vmfc"
INET_NS = "vmfc-inet"
INET_HOST_SIDE = "198.51.100.1"
INDEX_ADDR, INDEX_PORT = "198.51.100.10", 8000
INDEX = f"http://{INDEX_ADDR}:{INDEX_PORT}/simple"
PIP = ("python3 -m pip install --disable-pip-version-check --no-cache-dir --retries 0 "
       f"--timeout 30 --index-url {INDEX} --trusted-host {INDEX_ADDR}")
REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def index() -> Iterator[str]:
    """The index in a namespace standing for the internet, routed from the host."""
    if not any(wheel_dir().glob("numpy-*.whl")):
        pytest.fail(f"no test wheels in {wheel_dir()}: the set-up fetches them "
                    "(scripts/lib.sh setup_test_wheels)")
    with index_on_the_internet(INET_NS, host_side=INET_HOST_SIDE, address=INDEX_ADDR,
                               port=INDEX_PORT) as url:
        assert url == INDEX
        with urllib.request.urlopen(f"{INDEX}/numpy/", timeout=30) as r:
            assert b"numpy-2.0.2" in r.read()
        yield INDEX


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    logs = tmp_path_factory.mktemp("pip-chain")
    root = Path(tempfile.mkdtemp(prefix="vmfork-e2e-pip-"))
    env = dict(os.environ, VMFORK_HOME=str(root / "home"),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))
    yield Home(root, logs, env)
    network.cleanup_stale(PREFIX)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(home: Home, index: str) -> Iterator[Daemon]:
    d = home.start("chain", "--kill-sandboxes-on-exit", "--network-prefix", PREFIX)
    yield d
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(300)
    left = network.leftovers(PREFIX)
    assert left.namespaces == [] and left.links == [], left


def _cli(home: Home, d: Daemon, *args: str, timeout: float = 1800) -> tuple[int, str, str, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "vmfork", *args, "--url", f"unix://{d.socket}"],
                          env=home.env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


def _exec(d: Daemon, sandbox: str, script: str, *argv: str) -> str:
    r = d.ctl.exec_command(sandbox, ["python3", "-c", script, *argv], timeout_secs=600)
    assert r["exit_code"] == 0, r
    return str(r["stdout"]).strip()


NUMBERS: dict[str, object] = {}


@pytest.fixture(scope="module")
def base(daemon: Daemon) -> str:
    started = time.monotonic()
    info = daemon.ctl.create_snapshot("py-base", mem_mib=768, network=True,
                                      warm_cmd=f"{PIP} idna==3.7", timeout=1800)
    NUMBERS["base_build_s"] = round(time.monotonic() - started, 1)
    assert info["status"] == "ready" and info["network"] is True
    return "py-base"


def test_warm_up_downloaded_and_children_are_unique(daemon: Daemon, base: str) -> None:
    kids = daemon.ctl.spawn_sandboxes(base, 2, per_child_netns=True)
    try:
        got = [_exec(daemon, k["id"], "import idna, random, time; "
                     "print(idna.__version__, random.random(), int(time.time()))")
               for k in kids]
        versions = {g.split()[0] for g in got}
        assert versions == {"3.7"}
        assert got[0].split()[1] != got[1].split()[1]          # RNG made unique
        assert abs(int(got[0].split()[2]) - time.time()) < 120  # clock set after the fork
    finally:
        for k in kids:
            daemon.ctl.kill_sandbox(k["id"])


def test_the_chain(home: Home, daemon: Daemon, base: str, tmp_path: Path) -> None:
    for parent, tag, req in (("py-base", "py-numpy", "numpy==2.0.2"),
                             ("py-numpy", "py-pandas", "pandas==2.2.3")):
        code, out, err, seconds = _cli(home, daemon, "snapshot-diff", "--from", parent,
                                       "--tag", tag, "--network", "--exec", f"{PIP} {req}",
                                       # the default 600 s is short for a 19.5 MB download
                                       # in a loaded emulated host (70 kB/s was seen)
                                       "--timeout", "1800")
        assert code == 0, f"{out}\n{err}"
        NUMBERS[f"{tag}_build_s"] = round(seconds, 1)

    code, out, err, _ = _cli(home, daemon, "snapshot-info", "py-pandas", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["chain_depth"] == 2, info
    assert set(info["ancestors"]) == {"py-numpy", "py-base"}, info

    links = {"py-numpy": ("numpy",),
             "py-pandas": ("pandas", "python-dateutil", "pytz", "tzdata", "six")}
    layers = {t: daemon.ctl.snapshot_info(t)["changed_bytes"] for t in links}
    child = daemon.ctl.spawn_sandboxes("py-pandas", 1)[0]
    try:
        assert _exec(daemon, child["id"], "import numpy, pandas, idna; "
                     "print(numpy.__version__, pandas.__version__, "
                     "int(pandas.Series(numpy.arange(10)).sum()))") == "2.0.2 2.2.3 45"
        # (apparent bytes, allocated bytes) of every file pip wrote for the link
        installed = {t: tuple(int(n) for n in _exec(daemon, child["id"], INSTALLED,
                                                     *names).split())
                     for t, names in links.items()}
    finally:
        daemon.ctl.kill_sandbox(child["id"])
    for tag, layer in layers.items():
        apparent, allocated = installed[tag]
        NUMBERS[f"{tag}_layer_MiB"] = round(layer / 2**20, 1)
        NUMBERS[f"{tag}_installed_MiB"] = round(apparent / 2**20, 2)
        NUMBERS[f"{tag}_installed_allocated_MiB"] = round(allocated / 2**20, 2)
        NUMBERS[f"{tag}_over_installed"] = round(layer / apparent, 2)
        NUMBERS[f"{tag}_over_allocated"] = round(layer / allocated, 2)
    base_mem = daemon.ctl.snapshot_info("py-base")["memory_logical_bytes"]
    # What the guest freed during the build (pip's heap, the wheel it deleted) was
    # reported by the guest's free page reporting and dropped by the VMM's balloon
    # before the capture (docs/chains.md), and the BRANCH waited for it, boundedly.
    store = Store(home.root / "home")   # read only: the daemon owns it
    for tag in layers:
        fpr = store.get(tag).meta.extra.get("free_page_reporting")
        assert fpr and fpr["active"] and fpr["reports"] > 0, (tag, fpr)
        assert fpr["bytes_discarded"] > 0 and fpr["discard_errors"] == 0, (tag, fpr)
        assert fpr["settle_s"] <= 25, (tag, fpr)
        NUMBERS[f"{tag}_balloon_dropped_MiB"] = round(fpr["bytes_discarded"] / 2**20, 1)
    # The measure: the head's layers against what pip installed, counted as an
    # installed size is counted on any file system (allocated blocks, du). Counted in
    # apparent bytes it could not be met by any capture of guest pages: the guest's
    # root is tmpfs, which holds each file in whole pages, and pandas's thousands of
    # small files take 1.21x their apparent size (docs/chains.md). Each layer also
    # holds at least the files' bytes, and neither is anywhere near the base.
    head = sum(layers.values())
    NUMBERS["head_over_installed"] = round(head / sum(a for a, _ in installed.values()), 2)
    head_over_allocated = head / sum(b for _, b in installed.values())
    NUMBERS["head_over_allocated"] = round(head_over_allocated, 2)
    for tag, layer in layers.items():
        assert installed[tag][0] <= layer < base_mem / 2, (tag, NUMBERS)

    # Spawn time of the head against the base (request to agent ready), alternating.
    spawns: dict[str, list[float]] = {"py-base": [], "py-pandas": []}
    for _ in range(3):
        for tag, values in spawns.items():
            kid = daemon.ctl.spawn_sandboxes(tag, 1)[0]
            values.append(kid["timings"]["ready_ms"])
            daemon.ctl.kill_sandbox(kid["id"])
    for tag, values in spawns.items():
        NUMBERS[f"{tag}_spawn_ready_ms_p50"] = sorted(values)[1]
    print("pip chain numbers (before compaction and packs):", json.dumps(NUMBERS))

    # Compaction and packs work on the chain.
    flat = daemon.ctl.compact_snapshot("py-pandas", "py-flat")
    assert flat["tag"] == "py-flat"
    kid = daemon.ctl.spawn_sandboxes("py-flat", 1)[0]
    try:
        assert _exec(daemon, kid["id"], "import numpy, pandas; print('ok')") == "ok"
    finally:
        daemon.ctl.kill_sandbox(kid["id"])
    pack = tmp_path / "py-pandas.tar.zst"
    done = subprocess.run([sys.executable, "-m", "vmfork", "pack", "--tag", "py-pandas", "-o",
                           str(pack)], env=home.env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr
    fresh = dict(home.env, VMFORK_HOME=str(home.root / "fresh"))
    done = subprocess.run([sys.executable, "-m", "vmfork", "unpack", str(pack), "--json"],
                          env=fresh, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tags"] == ["py-base", "py-numpy", "py-pandas"]
    NUMBERS["pack_MiB"] = round(pack.stat().st_size / 2**20, 1)
    print("pip chain numbers:", json.dumps(NUMBERS))
    (home.logs / "numbers.json").write_text(json.dumps(NUMBERS))
    out_dir = os.environ.get("VMFORK_NUMBERS_DIR")
    if out_dir:
        Path(out_dir, "pip-chain.json").write_text(json.dumps(NUMBERS, indent=1))
    # Last, so that a miss still leaves every number printed and the rest checked. The
    # issue's 1.2x is a memory goal: `bench/pip_chain.py` measures and reports it (runs
    # give 1.19-1.24x, docs/chains.md says where the rest is). What this test holds is
    # that the guest's garbage is dropped at all: without free page reporting a link
    # carries every page pip's build freed (2.25x measured).
    assert head_over_allocated <= 1.5, NUMBERS


def test_egress_deny_refuses_the_download(home: Home, daemon: Daemon, base: str) -> None:
    code, out, err, _ = _cli(home, daemon, "snapshot-diff", "--from", base, "--tag",
                             "py-denied", "--network", "--egress", "deny", "--exec",
                             f"{PIP} six==1.16.0", timeout=900)
    assert code == 1, f"{out}\n{err}"
    assert "egress policy is deny" in err and "nothing was built" in err, err
    with pytest.raises(ControllerError) as caught:
        daemon.ctl.snapshot_info("py-denied")
    assert caught.value.status == 404


def test_warm_up_under_egress_deny_is_refused_with_the_reason(daemon: Daemon) -> None:
    """A parent's warm-up that downloads, under deny: 422 with what the policy refused,
    and no snapshot (the allowed warm-up that downloads is ``base`` above)."""
    with pytest.raises(ControllerError) as caught:
        daemon.ctl.create_snapshot("py-deny-warm", mem_mib=512, network=True, egress="deny",
                                   warm_cmd=f"{PIP} six==1.16.0", timeout=1800)
    assert caught.value.status == 422, caught.value
    assert "egress policy is deny" in str(caught.value) and "exited" in str(caught.value)
    assert "py-deny-warm" not in [s["tag"] for s in daemon.ctl.list_snapshots()
                                  if s["status"] == "ready"]
