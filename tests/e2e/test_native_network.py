"""A native child (``VMFORK_NATIVE_CHILD=1``) of a networked parent: its virtio-net is
the native transport's (``DeviceKind::Net``), on the tap its jail opened in the child's
own network namespace, or, unjailed, the tap it opened there itself after its set-up
joined the namespace (``ChildMachinePlan.build``). The topology, the parent and its
guest's HTTP server are test_network.py's; the zygote's children run no Python.

The child reaches ready, its guest reaches "the internet" over its tap, and the host
reaches the guest's server at the child's address: frames both ways through the
native transport. That it is a native child is checked by what only one refuses
(``snapshot``, a hand-over it has no Python view for)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.e2e.test_native_spawn import thread_names
from tests.e2e.test_network import (
    GUEST_PORT,
    SERVER_A,
    Spawner,
    _fetch,
    _get,
    hostnet,
    internet,
    run_root,
    snapshot,
    spawner,
    store,
)
from vmfork.runtime.zygote_child import NATIVE_CHILD_ENV
from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote

# test_network.py's fixtures, used here by name (its `spawner` takes this module's
# `zygote`, whose children run no Python).
__all__ = ["hostnet", "internet", "run_root", "snapshot", "spawner", "store"]


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteProcess]:
    path = tmp_path_factory.mktemp("zygote") / "z.sock"
    # As test_network's: the imports over the test host's 9p take long.
    proc = start_zygote(str(path), timeout=300.0, env={**os.environ, NATIVE_CHILD_ENV: "1"})
    yield proc
    proc.close()


@pytest.mark.parametrize("jail", [True, False], ids=["jailed", "unjailed"])
def test_a_native_child_of_a_networked_parent_reaches_the_network_both_ways(
        spawner: Spawner, jail: bool) -> None:
    (child,) = spawner.fork(1, jail=jail)
    assert child.network is not None
    status = child.read_status()
    assert status["state"] == "ready", status
    # Out: the guest's fetch from "the internet", through its tap and the host's routing.
    assert _fetch(child, SERVER_A) == f"ok:{SERVER_A}"
    # In: the host connects to the guest's server (the parent's listening socket).
    child.agent.eval(f"IDENT = {child.vm_id!r}")
    assert _get(f"http://{child.network.address}:{GUEST_PORT}/") == child.vm_id
    # The guest was told it was forked (its connections to the parent's peers dropped).
    refreshed = child.read_status().get("net_refresh")
    assert isinstance(refreshed, dict), child.read_status()
    # A native child: its I/O loop is NativeMachine's ("vmm-io").
    assert "vmm-io" in thread_names(child.pid)
