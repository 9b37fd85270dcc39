"""Restoring a vCPU whose snapshot holds MSRs this KVM refuses (``vmstate.apply_vcpu``):
KVM_SET_MSRS stops at the first refusal, and the restore must skip exactly the
refused ones and still set every other, in order."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from vmfork.kvm import api
from vmfork.vmm import vmstate

SYSENTER_CS, SYSENTER_ESP, SYSENTER_EIP = 0x174, 0x175, 0x176
BOGUS_A, BOGUS_B = 0x4B56_0F01, 0x4B56_0F02   # in no MSR range KVM emulates


@pytest.fixture
def vcpu_fds() -> Iterator[list[int]]:
    """Two fresh vCPUs, each in its own VM with an in-kernel irqchip (LAPIC state)."""
    kvm = api.open_kvm()
    fds = [kvm]
    vcpus = []
    try:
        supported = api.get_supported_cpuid(kvm)
        for _ in range(2):
            vm = api.create_vm(kvm)
            fds.append(vm)
            api.create_irqchip(vm)
            vcpu = api.create_vcpu(vm, 0)
            fds.append(vcpu)
            api.set_cpuid2(vcpu, supported)
            vcpus.append(vcpu)
        yield vcpus
    finally:
        for fd in reversed(fds):
            os.close(fd)


def test_refused_msrs_are_skipped_and_the_rest_are_set(vcpu_fds: list[int]) -> None:
    source, target = vcpu_fds
    state = vmstate.save_vcpu(0, source, [SYSENTER_CS])
    wanted = {SYSENTER_CS: 0x10, SYSENTER_ESP: 0x2000, SYSENTER_EIP: 0x3000}
    state.msrs = {f"{SYSENTER_CS:#x}": wanted[SYSENTER_CS], f"{BOGUS_A:#x}": 1,
                  f"{SYSENTER_ESP:#x}": wanted[SYSENTER_ESP], f"{BOGUS_B:#x}": 2,
                  f"{SYSENTER_EIP:#x}": wanted[SYSENTER_EIP]}
    prepared = vmstate.prepare_vcpu(state)

    refused = vmstate.apply_vcpu(target, prepared)

    assert refused == [BOGUS_A, BOGUS_B]
    assert api.get_msrs(target, list(wanted)) == wanted
    # The prepared buffer is shared with the zygote in real use: never written.
    assert prepared.msrs.nmsrs == 5  # type: ignore[attr-defined]
    assert [prepared.msrs.entries[i].index for i in range(5)] == [  # type: ignore[attr-defined]
        SYSENTER_CS, BOGUS_A, SYSENTER_ESP, BOGUS_B, SYSENTER_EIP]
