"""An unjailed child's set-up (``_core.ChildPlan.set_up``, native/src/child.rs, built by
``zygote_child.plan``) joins the sandbox network namespace its spawn names, as a jailed
child's does: its VMM, a Python one (``Machine``) or a native one
(``ChildMachinePlan``), then attaches to the tap there. Without one the child stays in
the zygote's namespace.

The forking process is a subprocess: set-up runs in a child forked by a process of one
thread, as in the zygote."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from vmfork.runtime import jail, zygote_child
from vmfork.vmm.native import CORE_BUILT

pytestmark = pytest.mark.skipif(
    not CORE_BUILT or os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs the native core, root and ip(8)")

# The forker: the plan as the zygote builds it for an unjailed spawn, a fork, the
# set-up in the child, and the child's network namespace on its stdout (which the
# set-up keeps: no log is given).
FORKER = """
import os, sys
from vmfork.runtime import zygote_child
plan = zygote_child.plan(os.getpid(), None, None, None, netns=sys.argv[1] or None)
pid = os.fork()
if pid == 0:
    plan.set_up()
    os.write(1, os.readlink("/proc/self/ns/net").encode())
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.fixture
def sandbox_netns() -> Iterator[str]:
    name = f"vmft-{os.getpid() % 1_000_000}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _child_netns(netns: str | None) -> str:
    done = subprocess.run([sys.executable, "-c", FORKER, netns or ""], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_unjailed_childs_set_up_joins_its_sandbox_namespace(sandbox_netns: str) -> None:
    sandbox = os.stat(f"/run/netns/{sandbox_netns}").st_ino
    assert _child_netns(sandbox_netns) == f"net:[{sandbox}]"


def test_an_unjailed_child_without_one_stays_in_the_zygotes() -> None:
    assert _child_netns(None) == os.readlink("/proc/self/ns/net")


@pytest.mark.parametrize("name", ["../etc", "UPPER-1", "", 7])
def test_a_name_no_sandbox_namespace_has_is_refused_before_the_fork(name: object) -> None:
    with pytest.raises(jail.JailError, match="network namespace"):
        zygote_child.plan(os.getpid(), None, None, None, netns=name)
