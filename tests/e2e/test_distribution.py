"""A snapshot chain pushed to a real registry and pulled into a second, empty store,
whose child spawns with the parent's warm interpreter state and the link's files
(issue 17). Push and pull go through the CLI; the spawn through a zygote, as a
daemon would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_image_oci import Registry, start_registry
from vmfork.image import find_image
from vmfork.runtime.parent import snapshot_parent
from vmfork.runtime.spawn import fork_children
from vmfork.runtime.zygote_client import start_zygote
from vmfork.store import Store

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"), None)


def cli(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, VMFORK_HOME=str(home),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    env.pop("VMFORK_URL", None)
    return subprocess.run([sys.executable, "-m", "vmfork", *argv], env=env, text=True,
                          capture_output=True, timeout=1200, check=False)


def test_a_pulled_chain_spawns_with_the_parents_warm_state(registry: Registry,
                                                          tmp_path: Path) -> None:
    home, fresh_home = tmp_path / "home", tmp_path / "fresh"
    store = Store.open(home)
    snapshot_parent(store, "warm", find_image("default"), mem_mib=256,
                    warm_code="WARM = 6 * 7")
    done = cli(home, "snapshot-diff", "--from", "warm", "--tag", "linked", "--exec",
               "echo from-the-link > /tmp/linked")
    assert done.returncode == 0, done.stderr
    ref = f"{registry.host}/e2e/snaps:linked"
    done = cli(home, "push", "linked", ref, "--json")
    assert done.returncode == 0, done.stderr
    pushed = json.loads(done.stdout)
    assert pushed["tags"] == ["warm", "linked"] and len(pushed["uploaded"]) == 6

    done = cli(fresh_home, "pull", ref, "--json")
    assert done.returncode == 0, done.stderr
    pulled = json.loads(done.stdout)
    assert pulled["digest"] == pushed["digest"] and pulled["stored"] == ["warm", "linked"]
    # The guest image is this host's own: its blobs are not downloaded.
    assert pulled["image"] == "default" and len(pulled["skipped"]) == 2
    fresh = Store.open(fresh_home)
    assert fresh.get("linked").is_layered

    zygote = start_zygote(str(tmp_path / "z.sock"), timeout=180.0)
    try:
        client = zygote.client()
        fork = fork_children(client, fresh.get("linked"), 1, tmp_path / "vms")
        assert not fork.failed, fork.failed
        child = fork.children[0]
        try:
            result = child.agent.eval("WARM")
            assert result.exception is None and result.value == "42"
            seen = child.agent.exec("cat /tmp/linked")
            assert seen.exit_code == 0 and seen.stdout.decode().strip() == "from-the-link"
        finally:
            client.kill_and_wait(child.vm_id)
    finally:
        zygote.close()
