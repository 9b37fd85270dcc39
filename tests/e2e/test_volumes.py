"""Volumes with real VMs, through the daemon and the SDK (issue 14, item 4).

* A snapshot with a read-only volume (a directory holding a 50 MiB file) and 20
  children of it, each also given a read-only volume at spawn (attached after the
  restore, into a slot the parent reserved): every child reads the same bytes from
  both, and cannot write either.
* A read-write volume (an ext4 image) in a workspace: private to it (a second attach
  is 409, from a spawn and from another workspace, also while it is suspended), a
  BRANCH of its sandbox is refused with the reason, its data persists across a
  suspend and resume, and it is free again once the workspace is deleted.
* Bad requests are 4xx naming what to fix, and leave nothing held.

One daemon for the module; every boot costs tens of seconds in the emulated host.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import test_daemon
from tests.e2e.test_daemon import Daemon, Home
from vmfork.client import Controller, ControllerError

pytestmark = pytest.mark.e2e
home = test_daemon.home   # the daemons' home directory, as test_daemon's

BIG_BYTES = 50 << 20
CHILDREN = 20
RW_IMAGE_BYTES = 16 << 20


@pytest.fixture(scope="module")
def daemon(home: Home) -> Iterator[Daemon]:
    d = home.start("volumes", "--kill-sandboxes-on-exit")
    yield d
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(120)


@pytest.fixture(scope="module")
def data_dir(home: Home) -> tuple[Path, str]:
    """A directory with a 50 MiB file of random bytes (incompressible: the image holds
    all of it) and a small one; and the big file's SHA-256."""
    root = home.root / "data"
    (root / "sub").mkdir(parents=True)
    big = os.urandom(BIG_BYTES)
    (root / "big.bin").write_bytes(big)
    (root / "sub" / "hello.txt").write_text("hello from the host\n")
    return root, hashlib.sha256(big).hexdigest()


def _run(ctl: Controller, sandbox_id: str, script: str) -> dict[str, Any]:
    return ctl.exec_command(sandbox_id, ["/bin/sh", "-c", script], timeout_secs=600)


def test_twenty_children_read_the_same_read_only_volumes(home: Home, daemon: Daemon,
                                                         data_dir: tuple[Path, str]) -> None:
    ctl = daemon.ctl
    data, digest = data_dir
    extra = home.root / "extra"
    extra.mkdir()
    (extra / "note.txt").write_text("attached at spawn\n")

    info = ctl.create_snapshot("vols", mem_mib=256, volumes=[f"{data}:/data:ro"], timeout=1800,
                               warm_code="import hashlib")
    assert info["status"] == "ready" and info["volume_slots"] == 5
    assert [v["guest_path"] for v in info["volumes"]] == ["/data"]

    children = ctl.spawn_sandboxes("vols", n=CHILDREN, volumes=[f"{extra}:/mnt/extra"])
    assert len(children) == CHILDREN
    for child in children:
        r = _run(ctl, child["id"], "sha256sum /data/big.bin; cat /data/sub/hello.txt "
                                   "/mnt/extra/note.txt; grep -E ' /(data|mnt/extra) ' "
                                   "/proc/mounts | cut -d' ' -f2-4")
        assert r["exit_code"] == 0, r
        lines = str(r["stdout"]).splitlines()
        assert lines[0].split()[0] == digest, child["id"]
        assert lines[1:3] == ["hello from the host", "attached at spawn"]
        mounts = sorted(lines[3:])
        assert mounts[0].startswith("/data erofs ro") and \
            mounts[1].startswith("/mnt/extra erofs ro"), mounts
        # Read-only for the guest's kernel, and refused by the device below it.
        w = _run(ctl, child["id"], "echo x > /data/new; echo $?; "
                                   "dd if=/dev/zero of=$(grep ' /data ' /proc/mounts | "
                                   "cut -d' ' -f1) bs=512 count=1 conv=fsync 2>&1; echo $?")
        status = str(w["stdout"]).split()
        assert status[0] != "0" and status[-1] != "0", w
    for child in children:
        ctl.kill_sandbox(child["id"])


def _ext4_image(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(RW_IMAGE_BYTES)
    subprocess.run([shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                    str(path)], check=True, capture_output=True)


def test_read_write_volume_is_private_and_survives_suspend(home: Home, daemon: Daemon) -> None:
    ctl = daemon.ctl
    if "plain" not in {s["tag"] for s in ctl.list_snapshots()}:
        ctl.create_snapshot("plain", mem_mib=256, timeout=1800)
    image = home.root / "work.img"
    _ext4_image(image)
    volume = f"{image}:/work:rw"

    ws = ctl.create_workspace("w1", "plain", volumes=[volume])
    assert ws["volumes"] == [{"source": str(image), "guest_path": "/work", "mode": "rw"}]
    sid = ws["sandbox_id"]
    r = _run(ctl, sid, "grep ' /work ' /proc/mounts | cut -d' ' -f3,4; "
                       "echo first > /work/note && sync && cat /work/note")
    assert r["exit_code"] == 0, r
    assert str(r["stdout"]).splitlines()[0].startswith("ext4 rw")
    assert "first" in str(r["stdout"])

    # A second attach while the workspace holds it: 409, naming the holder.
    for attempt in (lambda: ctl.spawn_sandboxes("plain", volumes=[f"{image}:/other:rw"]),
                    lambda: ctl.create_workspace("w2", "plain", volumes=[volume])):
        with pytest.raises(ControllerError) as exc:
            attempt()
        assert exc.value.status == 409 and "workspace w1" in exc.value.message
    assert "w2" not in {w["name"] for w in ctl.list_workspaces()}
    # A BRANCH of it is refused with the reason (the volume is not guest memory).
    with pytest.raises(ControllerError) as exc:
        ctl.branch_sandbox(sid, tag="rw-branch")
    assert exc.value.status == 409 and "read-write volume" in exc.value.message
    assert "rw-branch" not in {s["tag"] for s in ctl.list_snapshots()}

    suspended = ctl.suspend_workspace("w1")
    assert suspended["state"] == "suspended"
    # The suspension snapshot names the workspace's disk: nobody else may spawn it,
    # and the file stays held while the workspace sleeps.
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes(suspended["suspended_snapshot"])
    assert exc.value.status == 409 and "resume" in exc.value.message
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("plain", volumes=[volume])
    assert exc.value.status == 409

    resumed = ctl.resume_workspace("w1")
    assert resumed["state"] == "running"
    r = _run(ctl, resumed["sandbox_id"], "cat /work/note && echo second >> /work/note && "
                                         "sync && cat /work/note")
    assert r["exit_code"] == 0 and str(r["stdout"]) == "first\nfirst\nsecond\n", r
    ctl.delete_workspace("w1")
    # Free again: a sandbox of a parent that never saw the disk attaches it and reads
    # the workspace's writes, so they are in the file, not only in a guest's cache.
    again = ctl.spawn_sandboxes("plain", volumes=[volume])[0]
    assert str(_run(ctl, again["id"], "cat /work/note")["stdout"]) == "first\nsecond\n"
    ctl.kill_sandbox(again["id"])


def test_bad_volume_requests_are_refused_and_leave_nothing(home: Home, daemon: Daemon,
                                                           data_dir: tuple[Path, str]) -> None:
    ctl = daemon.ctl
    if "plain" not in {s["tag"] for s in ctl.list_snapshots()}:
        ctl.create_snapshot("plain", mem_mib=256, timeout=1800)
    data, _ = data_dir
    image = home.root / "bad.img"
    _ext4_image(image)
    cases: list[tuple[list[str], int, str]] = [
        ([f"{home.root}/missing:/x"], 400, "missing"),
        ([f"{data}:data"], 400, "relative"),
        ([f"{data}:/"], 400, "cannot be mounted on /"),
        ([f"{data}:/a/../b"], 400, "'..'"),
        ([f"{data}:/proc/x"], 400, "/proc"),
        ([f"{data}:/usr"], 400, "hide"),
        ([f"{data}:/a", f"{data}:/a/b"], 400, "nested"),
        ([f"{data}:/a:rx"], 400, "neither ro nor rw"),
        ([f"{data}:/v{i}" for i in range(25)], 400, "at most 24"),
        ([f"{data}:/v{i}" for i in range(5)], 409, "empty volume slots"),
        ([f"{data}:/rw:rw"], 400, "read-only image"),
        ([f"{image}:/a:rw", f"{image}:/b:rw"], 400, "twice"),
    ]
    for items, status, words in cases:
        with pytest.raises(ControllerError) as exc:
            ctl.spawn_sandboxes("plain", volumes=items)
        assert exc.value.status == status and words in exc.value.message, (items, exc.value)
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("plain", n=2, volumes=[f"{image}:/a:rw"])
    assert exc.value.status == 409 and "n=1" in exc.value.message
    with pytest.raises(ControllerError) as exc:
        ctl.create_snapshot("rw-snap", volumes=[f"{image}:/a:rw"])
    assert exc.value.status == 400 and "read-only" in exc.value.message
    assert "rw-snap" not in {s["tag"] for s in ctl.list_snapshots()}
    assert ctl.list_sandboxes() == []
    # Nothing was left held: the image attaches now.
    ok = ctl.spawn_sandboxes("plain", volumes=[f"{image}:/a:rw"])[0]
    ctl.kill_sandbox(ok["id"])
