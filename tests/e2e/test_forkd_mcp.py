"""forkd's own MCP server (forkd-mcp 0.2.1 from the registry, unchanged) against
``vmfork serve``, through an MCP client session: ``create_snapshot`` sends forkd's
body (``tag, kernel, rootfs, rw, boot_wait_secs``), and vmfork boots that vmlinux with
that ext4 image as the read-only root under a RAM overlay. Children of the snapshot
see the rootfs's files, write their root privately, and the host's image is never
written. Kernels and root file systems vmfork cannot boot are refused with the reason
(400), not left to hang."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.forkd_rootfs import make_ext4_rootfs
from tests.mcp_support import RunningDaemon, ToolFailed, forkd_mcp_session, tcp_daemon
from vmfork.client import ControllerError
from vmfork.image import find_image

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, str]]:
    with tcp_daemon(tmp_path_factory.mktemp("forkd-mcp")) as (d, port):
        yield d, f"http://127.0.0.1:{port}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_forkd_mcp_create_snapshot_boots_kernel_and_rootfs(
        daemon: tuple[RunningDaemon, str], tmp_path: Path) -> None:
    d, url = daemon
    marker = uuid.uuid4().hex
    rootfs = make_ext4_rootfs(tmp_path / "rootfs.ext4", marker=marker)
    before = _sha256(rootfs)
    kernel = str(find_image("default").kernel)   # a vmlinux on the host, as forkd's are

    async def session() -> None:
        async with forkd_mcp_session(url) as mcp:
            info = await mcp.call("create_snapshot", {
                "tag": "forkd-ext4", "kernel": kernel, "rootfs": str(rootfs),
                "rw": True, "boot_wait_secs": 10})
            assert info["tag"] == "forkd-ext4" and info["status"] == "ready"
            assert info["image"].startswith("forkd-")
            assert "forkd-ext4" in [s["tag"] for s in await mcp.call("list_snapshots")]

            ids = [s["id"] for s in await mcp.call("spawn_sandboxes", {
                "snapshot_tag": "forkd-ext4", "n": 2})]
            first, second = ids
            r = await mcp.call("exec_command", {
                "sandbox_id": first, "args": ["cat", "/etc/forkd-rootfs-marker"]})
            assert (r["stdout"], r["exit_code"]) == (marker, 0)
            # The root is writable (in the child's RAM) and private to each child.
            r = await mcp.call("exec_command", {
                "sandbox_id": first,
                "args": ["/bin/sh", "-c", ("echo mine > /etc/forkd-rootfs-marker && "
                                           "cat /etc/forkd-rootfs-marker")]})
            assert (r["stdout"], r["exit_code"]) == ("mine\n", 0)
            r = await mcp.call("exec_command", {
                "sandbox_id": second, "args": ["cat", "/etc/forkd-rootfs-marker"]})
            assert r["stdout"] == marker
            # The agent runs on the rootfs's own interpreter; the root is an overlay on
            # the read-only disk (the disk's mount is in the boot initramfs's tree, which
            # switch_root left, so /proc/mounts shows the overlay only).
            r = await mcp.call("eval_code", {"sandbox_id": second,
                                             "code": "__import__('sys').executable"})
            assert "python3" in r["result"]
            r = await mcp.call("exec_command", {"sandbox_id": second, "args": [
                "/bin/sh", "-c", ("awk '$2 == \"/\" {print $3}' /proc/mounts; "
                                  "cat /sys/block/vda/ro")]})
            assert r["stdout"].split() == ["overlay", "1"], r
            for sandbox_id in ids:
                await mcp.call("kill_sandbox", {"sandbox_id": sandbox_id})

            # A bzImage is not what the VMM loads: refused before anything boots.
            vmlinuz = sorted(Path("/boot").glob("vmlinuz-*"))
            assert vmlinuz, "the test host boots Debian's kernel, so /boot has its vmlinuz"
            with pytest.raises(ToolFailed, match="400"):
                await mcp.call("create_snapshot", {"tag": "forkd-bz", "kernel": str(vmlinuz[0]),
                                                   "rootfs": str(rootfs)})

    asyncio.run(session())
    assert _sha256(rootfs) == before, "the host's rootfs was written"
    assert "forkd-bz" not in [s["tag"] for s in d.controller.list_snapshots()]

    # forkd-mcp's tool error carries only the status; the reason is in the body.
    with pytest.raises(ControllerError) as refused:
        d.controller.create_snapshot("forkd-bz", kernel=str(min(Path("/boot").glob(
            "vmlinuz-*"))), rootfs=str(rootfs))
    assert refused.value.status == 400 and "bzImage" in str(refused.value)
    with pytest.raises(ControllerError) as refused:
        d.controller._call("POST", "/v1/snapshots", {"tag": "forkd-tap", "kernel": kernel,
                                                     "rootfs": str(rootfs), "tap": "tap0"})
    assert refused.value.status == 400 and "network" in str(refused.value)


def test_rootfs_without_python_is_refused_with_the_reason(
        daemon: tuple[RunningDaemon, str], tmp_path: Path) -> None:
    d, _ = daemon
    rootfs = make_ext4_rootfs(tmp_path / "nopython.ext4", marker="x", with_python=False)
    with pytest.raises(ControllerError) as refused:
        d.controller.create_snapshot("forkd-nopy", kernel=str(find_image("default").kernel),
                                     rootfs=str(rootfs))
    assert refused.value.status == 400
    assert "no Python 3.9 or newer" in str(refused.value)
    assert "forkd-nopy" not in [s["tag"] for s in d.controller.list_snapshots()
                                if s["status"] == "ready"]
