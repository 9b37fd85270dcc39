"""The initramfs recipe's host-side steps, on small fake trees (no apt, no network)."""

from __future__ import annotations

import importlib.util
import marshal
import shutil
from pathlib import Path

import pytest

from vmfork.image import elf, initramfs
from vmfork.image.debian import DebPackage
from vmfork.image.errors import ImageBuildError

HOST_BINARY = Path("/bin/ls")
needs_host_elf = pytest.mark.skipif(
    not HOST_BINARY.is_file() or not elf.is_elf(HOST_BINARY), reason="no dynamic /bin/ls"
)


def test_resolve_in_root_never_leaves_the_root(tmp_path: Path) -> None:
    (tmp_path / "lib/x86_64-linux-gnu").mkdir(parents=True)
    (tmp_path / "lib/x86_64-linux-gnu/ld.so").write_bytes(b"")
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64/ld.so").symlink_to("/lib/x86_64-linux-gnu/ld.so")  # absolute
    (tmp_path / "lib64/rel").symlink_to("../lib/x86_64-linux-gnu/ld.so")
    (tmp_path / "lib64/host").symlink_to("/etc/hostname")  # exists on the host only
    (tmp_path / "loop").symlink_to("loop")
    real = tmp_path / "lib/x86_64-linux-gnu/ld.so"
    assert initramfs.resolve_in_root(tmp_path, "/lib64/ld.so") == real
    assert initramfs.resolve_in_root(tmp_path, "lib64/rel") == real
    assert initramfs.resolve_in_root(tmp_path, "/lib64/host") is None
    assert initramfs.resolve_in_root(tmp_path, "/loop") is None
    assert initramfs.resolve_in_root(tmp_path, "/../../lib64/ld.so") == real


@needs_host_elf
def test_read_deps_of_a_host_binary() -> None:
    deps = elf.read_deps(HOST_BINARY)
    assert deps.interpreter == "/lib64/ld-linux-x86-64.so.2"
    assert "libc.so.6" in deps.needed


@needs_host_elf
def test_check_libraries_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    shutil.copy(HOST_BINARY, tmp_path / "bin/ls")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/readme").write_text("not ELF")
    with pytest.raises(ImageBuildError, match=r"/bin/ls: needs libc\.so\.6") as err:
        initramfs.check_libraries(tmp_path)
    assert err.value.step == "check-libraries"
    assert "ld-linux-x86-64.so.2 is missing" in str(err.value)
    libdir = tmp_path / "lib/x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    for soname in elf.read_deps(HOST_BINARY).needed:
        (libdir / soname).write_bytes(b"stub")
    (libdir / "ld-linux-x86-64.so.2").write_bytes(b"stub")
    (tmp_path / "lib64").mkdir()
    loader = "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    (tmp_path / "lib64/ld-linux-x86-64.so.2").symlink_to(loader)
    initramfs.check_libraries(tmp_path)


def _touch(root: Path, rel: str, text: str = "") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_prune(tmp_path: Path) -> None:
    lib = initramfs.GUEST_STDLIB
    ext = "cpython-311-x86_64-linux-gnu.so"
    for rel in ["usr/share/doc/libc6/copyright", "usr/share/man/man1/x.1",
                f"{lib}/test/support/__init__.py", f"{lib}/email/tests/t.py",
                f"{lib}/json/__pycache__/x.pyc", f"{lib}/lib-dynload/_dbm.{ext}",
                f"{lib}/lib-dynload/_testcapi.{ext}", f"{lib}/json/__init__.py",
                f"{lib}/lib-dynload/_ssl.{ext}", f"{lib}/contest.py",
                "usr/lib/x86_64-linux-gnu/gconv/UTF-16.so"]:
        _touch(tmp_path, rel)
    initramfs.prune(tmp_path)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == [f"{lib}/contest.py", f"{lib}/json/__init__.py", f"{lib}/lib-dynload/_ssl.{ext}"]


def test_prune_requires_a_stdlib(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match="step prune"):
        initramfs.prune(tmp_path)


def _guest_importlib(root: Path, magic: bytes) -> None:
    number = int.from_bytes(magic[:2], "little")
    _touch(root, f"{initramfs.GUEST_STDLIB}/importlib/_bootstrap_external.py",
           f"MAGIC_NUMBER = ({number}).to_bytes(2, 'little') + b'\\r\\n'\n")


def test_compile_tree_writes_unchecked_hash_pycs_with_guest_paths(tmp_path: Path) -> None:
    _guest_importlib(tmp_path, importlib.util.MAGIC_NUMBER)
    lib = initramfs.GUEST_STDLIB
    _touch(tmp_path, "etc/python3.11/sitecustomize.py", "GUEST = True\n")
    (tmp_path / lib / "sitecustomize.py").symlink_to("/etc/python3.11/sitecustomize.py")
    _touch(tmp_path, "opt/vmfork/vmfork/agent/main.py", "def main() -> int:\n    return 0\n")
    assert initramfs.compile_tree(tmp_path) == 3
    pyc = tmp_path / "opt/vmfork/vmfork/agent/__pycache__/main.cpython-311.pyc"
    data = pyc.read_bytes()
    assert data[:4] == importlib.util.MAGIC_NUMBER
    assert int.from_bytes(data[4:8], "little") == 0b01  # hash-based, source not checked
    assert marshal.loads(data[16:]).co_filename == "/opt/vmfork/vmfork/agent/main.py"
    # The symlinked module is compiled from the guest's file, not the host's.
    site = tmp_path / lib / "__pycache__/sitecustomize.cpython-311.pyc"
    assert "GUEST" in marshal.loads(site.read_bytes()[16:]).co_names


def test_compile_tree_refuses_a_foreign_magic(tmp_path: Path) -> None:
    _guest_importlib(tmp_path, (1234).to_bytes(2, "little") + b"\r\n")
    with pytest.raises(ImageBuildError, match="step compile.*Python 3.11"):
        initramfs.compile_tree(tmp_path)


def test_compile_tree_reports_syntax_errors(tmp_path: Path) -> None:
    _guest_importlib(tmp_path, importlib.util.MAGIC_NUMBER)
    _touch(tmp_path, "opt/vmfork/vmfork/agent/bad.py", "def (:\n")
    with pytest.raises(ImageBuildError, match="agent/bad.py"):
        initramfs.compile_tree(tmp_path)


def _fake_vmfork(root: Path) -> Path:
    _touch(root, "__init__.py", "__version__ = '0'\n")
    _touch(root, "agent/__init__.py")
    _touch(root, "agent/main.py", "def main() -> int:\n    return 0\n")
    _touch(root, "agent/__pycache__/main.cpython-311.pyc", "junk")
    _touch(root, "cli/__init__.py")  # not part of the guest
    return root


def test_agent_files(tmp_path: Path) -> None:
    files = initramfs.agent_files(_fake_vmfork(tmp_path))
    assert [rel for rel, _ in files] == ["__init__.py", "agent/__init__.py", "agent/main.py"]


def test_agent_without_main_is_an_error(tmp_path: Path) -> None:
    _touch(tmp_path, "__init__.py")
    _touch(tmp_path, "agent/protocol.py")
    with pytest.raises(ImageBuildError, match="step agent: .*agent/main.py"):
        initramfs.agent_files(tmp_path)


def test_key_covers_packages_and_agent(tmp_path: Path) -> None:
    src = _fake_vmfork(tmp_path)
    pkg = DebPackage("libc6", "2.36-9", "amd64", "pool/libc6.deb", "ab" * 32, 1)
    key = initramfs.initramfs_key([pkg], initramfs.agent_files(src))
    assert key == initramfs.initramfs_key([pkg], initramfs.agent_files(src))
    newer = DebPackage("libc6", "2.36-10", "amd64", "pool/libc6.deb", "ab" * 32, 1)
    assert initramfs.initramfs_key([newer], initramfs.agent_files(src)) != key
    (src / "agent/main.py").write_text("def main() -> int:\n    return 1\n")
    assert initramfs.initramfs_key([pkg], initramfs.agent_files(src)) != key


def test_init_script_shebang_passes_one_argument() -> None:
    shebang = initramfs.INIT_SCRIPT.splitlines()[0]
    interpreter, *args = shebang[2:].split()
    assert interpreter == "/usr/bin/python3.11"
    assert len(args) == 1 and args[0].startswith("-I"), "Linux passes one shebang argument"
    compile(initramfs.INIT_SCRIPT, "/init", "exec")


def test_base_layout(tmp_path: Path) -> None:
    initramfs.install_base_files(tmp_path)
    initramfs.install_agent(tmp_path, initramfs.agent_files(_fake_vmfork(tmp_path / "src")))
    assert (tmp_path / "tmp").stat().st_mode & 0o7777 == 0o1777
    assert (tmp_path / "usr/bin/python3").readlink() == Path("python3.11")
    assert (tmp_path / "etc/passwd").read_text().startswith("root:x:0:0:")
    assert (tmp_path / "init").stat().st_mode & 0o111
    assert (tmp_path / "opt/vmfork/vmfork/agent/main.py").is_file()
    assert {e.path for e in initramfs.device_entries()} >= {"dev/console"}
