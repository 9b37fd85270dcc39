"""The ctypes mirror of the KVM ABI against the kernel headers.

``kvm_abi_expected.txt`` is the output of ``kvm_abi_dump.c`` (ioctl numbers,
struct sizes, field offsets). Every line is checked against ``vmfork.kvm``; when
a C compiler and ``linux/kvm.h`` are present, the dump is also rebuilt and must
equal the committed file, so neither side can drift.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from vmfork.kvm import ioctls, structs

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "kvm_abi_expected.txt"

# Fields that the kernel declares inside an anonymous union or as a flexible
# array: where our mirror keeps them.
_UNION_MEMBERS = {"io", "mmio", "internal", "system_event"}
_FLEXIBLE = {("kvm_msrs", "entries"), ("kvm_msr_list", "indices"), ("kvm_cpuid2", "entries")}


def _expected() -> list[tuple[str, int]]:
    rows = []
    for line in EXPECTED.read_text().splitlines():
        name, value = line.split()
        rows.append((name, int(value)))
    return rows


def _ours(name: str) -> int:
    if name.startswith("sizeof:"):
        return ctypes.sizeof(getattr(structs, name.removeprefix("sizeof:")))
    if name.startswith("offsetof:"):
        struct_name, field = name.removeprefix("offsetof:").split(".")
        struct = getattr(structs, struct_name)
        if (struct_name, field) in _FLEXIBLE:
            return ctypes.sizeof(struct)
        if struct_name == "kvm_run" and field in _UNION_MEMBERS:
            return int(structs.kvm_run.exit.offset)
        return int(getattr(struct, field).offset)
    return int(getattr(ioctls, name))


@pytest.mark.parametrize("name,value", _expected(), ids=[n for n, _ in _expected()])
def test_matches_kernel_headers(name: str, value: int) -> None:
    assert _ours(name) == value


def test_every_ioctl_we_define_is_checked() -> None:
    checked = {name for name, _ in _expected() if name.startswith("KVM_")}
    assert set(ioctls.ALL) <= checked


def test_ioc_encoding_known_values() -> None:
    # Two values quoted in Documentation/virt/kvm/api.rst examples and kvm.h.
    assert ioctls.KVM_GET_API_VERSION == 0xAE00
    assert ioctls.KVM_RUN == 0xAE80
    assert ioctls._IOC(2, 0xAE, 0x81, 144) == 0x8090AE81


def test_dump_is_current_with_headers(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not Path("/usr/include/linux/kvm.h").exists():
        pytest.skip("no C compiler or no linux/kvm.h: checked against the committed dump only")
    exe = tmp_path / "dump"
    subprocess.run([cc, "-o", str(exe), str(HERE / "kvm_abi_dump.c")], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out == EXPECTED.read_text()
