"""Machine's check of /dev/kvm (API version, capabilities): once per process."""

from __future__ import annotations

import pytest

from vmfork.kvm import api
from vmfork.vmm import machine
from vmfork.vmm.errors import HostError


def _machine() -> machine.Machine:
    m = object.__new__(machine.Machine)   # the check alone, no VM
    m.kvm_fd, m.vm_id = -1, "test"
    return m


def _fake_kvm(monkeypatch: pytest.MonkeyPatch, missing: int | None = None) -> list[object]:
    calls: list[object] = []

    def version(fd: int) -> int:
        calls.append("version")
        return api.KVM_API_VERSION

    def extension(fd: int, cap: int) -> int:
        calls.append(cap)
        return 0 if cap == missing else 1

    monkeypatch.setattr(api, "get_api_version", version)
    monkeypatch.setattr(api, "check_extension", extension)
    return calls


def test_kvm_is_checked_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "_kvm_checked", False)
    calls = _fake_kvm(monkeypatch)
    _machine()._check_kvm()
    assert calls == ["version", *api.REQUIRED_CAPS]
    _machine()._check_kvm()   # a second machine (a zygote's child): no ioctl
    assert len(calls) == 1 + len(api.REQUIRED_CAPS)


def test_a_missing_capability_is_refused_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "_kvm_checked", False)
    calls = _fake_kvm(monkeypatch, missing=api.CAP_IRQFD)
    for attempt in (1, 2):
        with pytest.raises(HostError, match=api.REQUIRED_CAPS[api.CAP_IRQFD]):
            _machine()._check_kvm()
        assert len(calls) == attempt * (1 + len(api.REQUIRED_CAPS))
    assert machine._kvm_checked is False
