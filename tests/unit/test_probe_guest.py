"""The probe guest's embedded bytes are what its assembly source builds to."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import vmfork.kvm
from vmfork.kvm.probe import PROBE_GUEST

SOURCE = Path(vmfork.kvm.__file__).parent / "probe_guest.S"


def test_embedded_bytes_match_source(tmp_path: Path) -> None:
    if not (shutil.which("as") and shutil.which("ld")):
        pytest.skip("binutils (as, ld) not installed: cannot rebuild the probe guest")
    obj, binary = tmp_path / "p.o", tmp_path / "p.bin"
    subprocess.run(["as", "-o", str(obj), str(SOURCE)], check=True)
    subprocess.run(["ld", "-Ttext=0x100000", "--oformat", "binary", "-e", "_start",
                    "-o", str(binary), str(obj)], check=True)
    assert binary.read_bytes() == PROBE_GUEST


def test_probe_guest_ends_with_reset_then_halt() -> None:
    # out %al,$0x64 with al=0xfe, then hlt; jmp .-1: the VM always ends.
    assert PROBE_GUEST.endswith(bytes.fromhex("b0fee664f4ebfd"))
