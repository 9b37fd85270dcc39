"""The users' image builder: its definition, its content key, and real builds.

The real builds use the machine's apt metadata, the cached Debian packages and the
cached kernel (the set-up builds them); they take tens of seconds each, so there are
few of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from vmfork import image as images
from vmfork.image import builder, debian, initramfs
from vmfork.image.errors import ImageBuildError, ImageMissing
from vmfork.image.kernel import kernel_key
from vmfork.image.spec import CopySpec, ImageSpec, SpecError, parse_copy, spec_from_toml

REAL_CACHE = Path(os.environ.get("VMFORK_CACHE_DIR") or Path.home() / ".cache/vmfork")


def _pkg(name: str, version: str = "1", sha: str = "a" * 64) -> debian.DebPackage:
    return debian.DebPackage(name, version, "amd64", f"pool/{name}.deb", sha, 1)


def _plan(spec: ImageSpec, **kw: object) -> builder._Plan:
    plan = builder._Plan(spec, ["base default", "libc6=2.36 amd64 sha256:" + "0" * 64])
    for k, v in kw.items():
        setattr(plan, k, v)
    return plan


# -- the definition --------------------------------------------------------------------


def test_toml_definition_with_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "reqs.txt").write_text("six==1.16.0\n")
    (tmp_path / "image.toml").write_text(
        'from = "default"\napt = ["curl"]\npip = ["numpy==2.0.2"]\n'
        'requirements = "reqs.txt"\ncopy = ["app:/app"]\nenv = { A = "1", B = "x=y" }\n'
        'workdir = "/app"\nuser = "1000:1000"\n')
    spec = spec_from_toml(tmp_path / "image.toml")
    assert spec.apt == ("curl",) and spec.pip == ("numpy==2.0.2",)
    assert spec.requirements == (tmp_path / "reqs.txt").resolve()
    assert spec.copy == (CopySpec((tmp_path / "app").resolve(), "/app"),)
    assert spec.env == (("A", "1"), ("B", "x=y"))
    assert spec.workdir == "/app" and spec.user == "1000:1000"
    assert not spec.is_default


@pytest.mark.parametrize("text, field", [
    ('apt = "curl"\nnonsense = 1\n', "unknown keys nonsense"),
    ('pip = ["--index-url=http://evil"]\n', "pip options are not accepted"),
    ('copy = ["missing:/x"]\n', "does not exist"),
    ('copy = ["."]\n', "is not SRC:DST"),
    ('workdir = "relative"\n', "workdir"),
    ('env = ["NOEQUALS"]\n', "is not K=V"),
    ('env = { "1BAD" = "x" }\n', "not a variable name"),
    ('disk_format = "ext4"\n', "disk_format"),
    ('user = "a b"\n', "user"),
    ('apt = [1]\n', "list of strings"),
    ('this is not toml', "not valid TOML"),
])
def test_bad_definitions_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    (tmp_path / "image.toml").write_text(text)
    with pytest.raises(SpecError, match=field):
        spec_from_toml(tmp_path / "image.toml")


def test_copy_destination_must_be_absolute_without_dotdot(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="absolute guest path"):
        parse_copy(f"{tmp_path}:/a/../../etc")
    assert parse_copy(f"{tmp_path}:/x").dest == "/x"


def test_apt_words_are_checked_before_apt_sees_them() -> None:
    with pytest.raises(ImageBuildError, match="not a Debian package name"):
        debian.validate_package_args(["-o=APT::Foo=1"])
    assert debian.validate_package_args(["curl", "python3-numpy=1:1.24.2-1"])


# -- the content key -------------------------------------------------------------------


def test_every_input_is_in_the_key(tmp_path: Path) -> None:
    wheel = tmp_path / "a-1-py3-none-any.whl"
    wheel.write_bytes(b"one")
    src = tmp_path / "f"
    src.write_text("x")
    spec = ImageSpec(copy=(CopySpec(src, "/f"),), env=(("A", "1"),))
    base = _plan(spec, apt=[_pkg("curl")], wheels=[wheel],
                 copies=builder._hash_copies(spec)).key()
    assert base == _plan(spec, apt=[_pkg("curl")], wheels=[wheel],
                         copies=builder._hash_copies(spec)).key()
    variants = [
        _plan(spec, apt=[_pkg("curl", version="2")], wheels=[wheel],
              copies=builder._hash_copies(spec)),
        _plan(spec, apt=[_pkg("curl", sha="b" * 64)], wheels=[wheel],
              copies=builder._hash_copies(spec)),
        _plan(ImageSpec(copy=spec.copy, env=(("A", "2"),)), apt=[_pkg("curl")],
              wheels=[wheel], copies=builder._hash_copies(spec)),
        _plan(ImageSpec(copy=spec.copy, env=spec.env, workdir="/w"), apt=[_pkg("curl")],
              wheels=[wheel], copies=builder._hash_copies(spec)),
        _plan(ImageSpec(copy=spec.copy, env=spec.env, disk_format="squashfs"),
              apt=[_pkg("curl")], wheels=[wheel], copies=builder._hash_copies(spec)),
        _plan(spec, apt=[_pkg("curl")], wheels=[wheel], copies=builder._hash_copies(spec),
              npm_manifest=b"{}", npm_lock=b"{}"),
    ]
    keys = {v.key() for v in variants}
    assert base not in keys and len(keys) == len(variants)
    wheel.write_bytes(b"two")   # same wheel name, other bytes
    assert _plan(spec, apt=[_pkg("curl")], wheels=[wheel],
                 copies=builder._hash_copies(spec)).key() != base
    src.write_text("y")         # a copied file's content
    wheel.write_bytes(b"one")
    assert _plan(spec, apt=[_pkg("curl")], wheels=[wheel],
                 copies=builder._hash_copies(spec)).key() != base
    src.chmod(0o700)            # ... and its mode
    src.write_text("x")
    assert _plan(spec, apt=[_pkg("curl")], wheels=[wheel],
                 copies=builder._hash_copies(spec)).key() != base


# -- the pieces ------------------------------------------------------------------------


def test_simulated_install_lines() -> None:
    text = ("NOTE: simulation\nInst libblas3 (3.11.0-2 Debian:12.8/stable [amd64])\n"
            "Inst python3-numpy [1:1.24.1] (1:1.24.2-1+deb12u1 Debian:12.8/stable [amd64])\n"
            "Conf libblas3 (3.11.0-2 Debian:12.8/stable [amd64])\n")
    assert debian.parse_simulated_install(text) == [("libblas3", "3.11.0-2"),
                                                     ("python3-numpy", "1:1.24.2-1+deb12u1")]


def test_find_python_reads_files_and_never_runs_them(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/lib/python3.8").mkdir(parents=True)
    (root / "usr/bin/python3.8").write_text("not a program")
    (root / "usr/lib/python3.8/os.py").write_text("")
    assert builder.find_python(root) is None          # too old for the agent
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "usr/local/lib/python3.12").mkdir(parents=True)
    (root / "usr/local/bin/python3.12").write_text("#!/bin/false\n")
    (root / "usr/local/lib/python3.12/os.py").write_text("")
    assert builder.find_python(root) == ("/usr/local/bin/python3.12", (3, 12))
    (root / "usr/local/lib/python3.12/os.py").unlink()  # a binary without its stdlib
    assert builder.find_python(root) is None


def test_alternatives_take_the_highest_priority(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for rel in ("usr/lib/x86_64-linux-gnu/blas/libblas.so.3",
                "usr/lib/x86_64-linux-gnu/openblas/libblas.so.3"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\x7fELF")
    debs = []
    for name, target, prio in (("libblas3", "blas", 10), ("libopenblas0", "openblas", 100)):
        pkg = tmp_path / name
        (pkg / "DEBIAN").mkdir(parents=True)
        (pkg / "DEBIAN/control").write_text(
            f"Package: {name}\nVersion: 1\nArchitecture: amd64\nMaintainer: t <t@t>\n"
            "Description: t\n")
        (pkg / "DEBIAN/postinst").write_text(
            "#!/bin/sh\nupdate-alternatives --install /usr/lib/x86_64-linux-gnu/libblas.so.3 "
            f"libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/{target}/libblas.so.3 "
            f"{prio}\n")
        (pkg / "DEBIAN/postinst").chmod(0o755)
        subprocess.run(["dpkg-deb", "-b", str(pkg), str(tmp_path / f"{name}.deb")],
                       check=True, capture_output=True)
        debs.append(tmp_path / f"{name}.deb")
    assert debian.install_alternatives(root, debs) == 1
    link = root / "usr/lib/x86_64-linux-gnu/libblas.so.3"
    assert os.readlink(link) == "/usr/lib/x86_64-linux-gnu/openblas/libblas.so.3"


# -- real builds -----------------------------------------------------------------------


@pytest.fixture
def real_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The machine's cache (kernel, .debs) with image records written to a scratch copy
    of its images directory, so tests never replace a user's image."""
    if not (REAL_CACHE / "kernel" / kernel_key()).is_dir():
        pytest.fail(f"the guest kernel is not built in {REAL_CACHE}: run the set-up "
                    "(./scripts/test builds it)")
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(REAL_CACHE))
    return REAL_CACHE


def test_build_copy_env_workdir_then_cached_then_changed(real_cache: Path,
                                                         tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "pkg").mkdir(parents=True)
    (app / "pkg/mod.py").write_text("VALUE = 41\n")
    # Content-addressed: a token of this run's own, so the first build is not a cache hit
    # of an earlier run's identical tree.
    (app / "token").write_text(uuid.uuid4().hex)
    (app / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (app / "run.sh").chmod(0o750)
    os.symlink("run.sh", app / "link")
    name = f"unit-build-{os.getpid()}"
    spec = ImageSpec(copy=(CopySpec(app, "/app"),), env=(("GREETING", "hello"),),
                     workdir="/app").validate()
    steps: list[str] = []
    try:
        img = builder.build(name, spec, progress=lambda step, msg: steps.append(step))
        assert img.disk is not None and img.disk.is_file()
        assert img.disk_key == builder.disk_content_key(img.disk)
        assert img.disk_build_seconds is not None and "disk" in steps
        assert "GREETING=hello" in img.env and img.workdir == "/app"
        assert img.agent_python == "/usr/bin/python3.11 -I"
        assert img.disk_format == "erofs"
        out = tmp_path / "x"
        out.mkdir()
        builder._extract_disk(img.disk, img.disk_format, out)
        assert (out / "app/pkg/mod.py").read_text() == "VALUE = 41\n"
        assert (out / "usr/bin/python3.11").is_file()
        assert os.readlink(out / "app/link") == "run.sh"
        st = os.stat(out / "app/run.sh")
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o750, 0, 0)
        meta = json.loads((out / ".vmfork/image.json").read_text())
        assert meta["workdir"] == "/app" and "GREETING=hello" in meta["env"]
        assert (out / initramfs.AGENT_PYTHON_FILE).read_text().strip() == img.agent_python
        assert not (out / "usr/lib/python3.11/EXTERNALLY-MANAGED").exists()
        assert b"BEGIN CERTIFICATE" in (out / "etc/ssl/certs/ca-certificates.crt").read_bytes()
        assert images.find_image(name).disk_key == img.disk_key

        again = builder.build(name, spec)
        assert again.disk_key == img.disk_key and again.disk_build_seconds is None

        (app / "pkg/mod.py").write_text("VALUE = 42\n")
        changed = builder.build(name, spec)
        assert changed.disk_key != img.disk_key
    finally:
        images.record_path(name).unlink(missing_ok=True)


def test_failed_build_leaves_no_image(real_cache: Path, tmp_path: Path) -> None:
    name = f"unit-fail-{os.getpid()}"
    before = set((real_cache / "disk-builds").glob("*"))
    with pytest.raises(ImageBuildError, match="resolve-packages"):
        builder.build(name, ImageSpec(apt=("vmfork-no-such-package",)).validate())
    with pytest.raises(ImageMissing):
        images.read_record(name)
    assert set((real_cache / "disk-builds").glob("*")) == before


def test_remove_refuses_while_snapshots_use_the_image(real_cache: Path) -> None:
    with pytest.raises(builder.ImageInUse, match="py-a, py-b"):
        builder.remove_image("default", ["py-a", "py-b"])


def test_an_imported_oci_image_is_the_base_of_a_build(real_cache: Path, tmp_path: Path) -> None:
    try:
        base = images.find_image("t-oci-python")   # made by the set-up (tests/images)
    except ImageMissing as err:
        pytest.fail(f"{err} (the set-up, scripts/test, imports it)")
    (tmp_path / "tool.py").write_text(f"print({uuid.uuid4().hex!r})\n")
    name = f"unit-on-oci-{os.getpid()}"
    try:
        img = builder.build(name, ImageSpec(base="t-oci-python",
                                            copy=(CopySpec(tmp_path / "tool.py", "/srv/tool.py"),),
                                            env=(("EXTRA", "1"),)).validate())
        assert img.built_from == "t-oci-python"
        # The OCI config's defaults carry over; the build's own env is added to them.
        assert "APP_MODE=oci" in img.env and "EXTRA=1" in img.env
        assert img.workdir == base.workdir == "/srv" and img.user == "nobody"
        assert img.agent_python == base.agent_python
        assert img.disk is not None
        out = tmp_path / "x"
        out.mkdir()
        builder._extract_disk(img.disk, img.disk_format, out)
        assert (out / "srv/tool.py").is_file() and (out / "usr/bin/python3.11").is_file()
    finally:
        images.record_path(name).unlink(missing_ok=True)


@pytest.mark.parametrize("fmt", ["erofs", "erofs-plain"])
def test_erofs_disks_compress_only_when_asked(tmp_path: Path, fmt: str) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "zeros").write_bytes(bytes(4 << 20))   # compresses to almost nothing
    out = tmp_path / "root.img"
    builder.make_disk(tree, out, fmt)
    size = out.stat().st_size
    assert size % 512 == 0 and builder.mount_type(fmt) == "erofs"
    if fmt == "erofs":
        assert size < 1 << 20
    else:
        assert size > 4 << 20   # every byte stored as it is
    extracted = tmp_path / "back"
    extracted.mkdir()
    builder._extract_disk(out, fmt, extracted)
    assert (extracted / "zeros").read_bytes() == bytes(4 << 20)
