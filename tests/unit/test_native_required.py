"""A machine needs the native core (its vCPU loop and console have no Python twin):
without it, ``Machine`` and ``vmfork doctor`` say so and name the set-up to run,
before anything touches /dev/kvm."""

from __future__ import annotations

import pytest

from vmfork.cli import doctor
from vmfork.vmm import native
from vmfork.vmm.errors import HostError
from vmfork.vmm.machine import Machine, MachineConfig


def test_built_here() -> None:
    # The test command's set-up builds it; a run without it would test nothing of KVM.
    assert native.CORE_BUILT
    native.require_core()
    assert doctor._native_core().status == "PASS"


def test_without_the_core_a_machine_is_refused_with_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "CORE_BUILT", False)
    with pytest.raises(native.CoreMissing, match=r"setup_native|pip install \.") as refused:
        Machine(MachineConfig(payload=b"\xf4", mem_mib=32, rng=False))
    assert isinstance(refused.value, HostError)
    check = doctor._native_core()
    assert check.status == "FAIL" and "pip install ." in check.fix
