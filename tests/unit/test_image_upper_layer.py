"""An overlay's upper directory as an OCI layer (``agent/upper.py``), over real
directories: a real overlayfs mount (the kernel makes the whiteouts and opaque
directories) is changed as a ``--run`` step would change it; its upper directory is
converted and the layer applied to a copy of the lower directory by the code that
applies OCI layers (``image/layers.py``); the result must be what the mount showed."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from vmfork.agent.upper import OPAQUE, UpperError, write_layer
from vmfork.image.layers import LayerApplier

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="mounting an overlay needs root and unshare")


def _tree(root: Path) -> dict[str, tuple[str, int, int, int, str]]:
    """Every entry under ``root``: kind, mode, uid, gid, content (or link target)."""
    out: dict[str, tuple[str, int, int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = path.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, st.st_uid, st.st_gid, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, "")
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                            path.read_bytes().hex())
    return out


def _lower(root: Path) -> None:
    (root / "etc").mkdir(parents=True)
    (root / "etc/keep.conf").write_text("kept\n")
    (root / "etc/change.conf").write_text("old\n")
    (root / "etc/gone.conf").write_text("deleted by the step\n")
    (root / "srv/data/sub").mkdir(parents=True)
    (root / "srv/data/a").write_text("hidden once the dir is remade\n")
    (root / "srv/data/sub/b").write_text("also hidden\n")
    (root / "tree/deep").mkdir(parents=True)
    (root / "tree/deep/x").write_text("a whole tree removed\n")
    (root / "bin").mkdir()
    (root / "bin/tool").write_text("#!/bin/sh\n")
    (root / "bin/tool").chmod(0o755)


STEP = """
set -e
cd "$1"
echo new >> etc/change.conf
rm etc/gone.conf
rm -rf tree
rm -rf srv/data && mkdir srv/data && echo fresh > srv/data/only
mkdir -p usr/lib/pkg && echo code > usr/lib/pkg/mod.py && chmod 640 usr/lib/pkg/mod.py
chown 1000:1000 usr/lib/pkg/mod.py
ln -s ../lib/pkg/mod.py usr/lib/link.py
echo shared > usr/lib/pkg/h1 && ln usr/lib/pkg/h1 usr/lib/pkg/h2
chmod 700 bin/tool
mkdir -m 0750 opt && echo agent > opt/skipped
"""


@needs_root
def test_upper_directory_becomes_a_layer_that_reproduces_the_overlay(tmp_path: Path) -> None:
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    _lower(lower)
    seen = tmp_path / "seen"
    script = (f"mount -t overlay overlay -o lowerdir={lower},upperdir={upper},workdir={work} "
              f"{merged} && sh -c '{STEP}' step {merged} && cp -a {merged} {seen}")
    subprocess.run(["unshare", "-m", "sh", "-c", script], check=True)

    # The kernel's own marks: a whiteout device and an opaque directory.
    assert stat.S_ISCHR((upper / "etc/gone.conf").lstat().st_mode)
    assert os.getxattr(upper / "srv/data", "trusted.overlay.opaque") == b"y"

    buf = io.BytesIO()
    counts = write_layer(str(upper), buf, excluded=frozenset({"opt/skipped"}))
    assert counts["whiteouts"] == 2 and counts["opaque_dirs"] == 1, counts
    names = tarfile.open(fileobj=io.BytesIO(buf.getvalue())).getnames()
    assert "etc/.wh.gone.conf" in names and "tree" not in names and ".wh.tree" in names
    assert f"srv/data/{OPAQUE}" in names and "opt/skipped" not in names
    members = {m.name: m for m in tarfile.open(fileobj=io.BytesIO(buf.getvalue()))}
    assert members["usr/lib/pkg/h2"].islnk() and members["usr/lib/pkg/h2"].linkname \
        == "usr/lib/pkg/h1"
    assert members["usr/lib/pkg/mod.py"].uid == 1000

    result = tmp_path / "result"
    shutil.copytree(lower, result, symlinks=True)
    with LayerApplier(result) as applier:
        diff_id = applier.apply(io.BytesIO(buf.getvalue()), "the step's changes")
    assert diff_id.startswith("sha256:")
    expected = _tree(seen)
    expected.pop("opt/skipped")
    assert _tree(result) == expected
    assert (result / "usr/lib/pkg/h1").stat().st_ino == (result / "usr/lib/pkg/h2").stat().st_ino
    # The same changes make the same bytes (the step's cache is by content anyway).
    again = io.BytesIO()
    write_layer(str(upper), again, excluded=frozenset({"opt/skipped"}))
    assert again.getvalue() == buf.getvalue()


def test_caps_and_refusals(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "big").write_bytes(b"x" * 5000)
    with pytest.raises(UpperError, match="more than 4096 bytes"):
        write_layer(str(upper), io.BytesIO(), max_bytes=4096)
    for i in range(5):
        (upper / f"f{i}").write_text("")
    with pytest.raises(UpperError, match="more than 3 entries"):
        write_layer(str(upper), io.BytesIO(), max_members=3)
    os.mkfifo(upper / "fifo")
    write_layer(str(upper), io.BytesIO())     # a fifo is a layer entry
    if os.geteuid() == 0:
        os.mknod(upper / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        with pytest.raises(UpperError, match="device node"):
            write_layer(str(upper), io.BytesIO())
        os.unlink(upper / "dev")
        (upper / "d").mkdir()
        os.setxattr(upper / "d", "trusted.overlay.redirect", b"/elsewhere")
        with pytest.raises(UpperError, match="redirect"):
            write_layer(str(upper), io.BytesIO())


def test_the_export_upper_op_streams_the_layer_and_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The op through the real agent server and client (a Unix socket): refused outside
    a build VM, then the layer in frames whose total the result confirms, and a cap
    the guest is given failing the op with the reason."""
    from tests.unit.agent_support import running_agent
    from vmfork.agent import upper
    from vmfork.agent.client import AgentError

    with running_agent() as agent:
        monkeypatch.setattr(upper, "UPPER_DIR", str(tmp_path / "absent"))
        with pytest.raises(AgentError, match="not booted as a build VM") as err:
            agent.client.export_upper(io.BytesIO(), max_bytes=1 << 20, max_members=100)
        assert err.value.code == "unsupported"
        tree = tmp_path / "upper"
        (tree / "srv").mkdir(parents=True)
        payload = os.urandom(3 << 20)            # several frames
        (tree / "srv/data.bin").write_bytes(payload)
        monkeypatch.setattr(upper, "UPPER_DIR", str(tree))
        out = io.BytesIO()
        result = agent.client.export_upper(out, max_bytes=8 << 20, max_members=100)
        assert result["size"] == len(out.getvalue()) and result["members"] == 2
        member = tarfile.open(fileobj=io.BytesIO(out.getvalue())).extractfile("srv/data.bin")
        assert member is not None and member.read() == payload
        with pytest.raises(AgentError, match="more than 1048576 bytes") as err:
            agent.client.export_upper(io.BytesIO(), max_bytes=1 << 20, max_members=100)
        assert err.value.code == "too_large"
        agent.client.ping()                        # the agent is fine after it
