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


def test_devices_without_a_python_path_refuse_memory_without_its_native_view() -> None:
    """The virtqueues are served only natively (no device has a Python half left):
    guest memory without its native view is a host error there, not a queue that
    silently serves nothing."""
    from vmfork.vmm.devices.virtio.queue import Virtqueue
    from vmfork.vmm.memory import GuestMemory

    memory = GuestMemory.anonymous(1 << 20)
    assert memory.native is not None
    memory.native.close()
    memory.native = None
    try:
        queue = Virtqueue(16)
        for ask in (lambda: queue.validate(memory), lambda: queue.needs_interrupt(memory, 1)):
            with pytest.raises(HostError, match="only natively"):
                ask()
    finally:
        memory.close()


def test_without_the_core_there_is_no_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The I/O loop has no Python twin: asked for without the core, it names the set-up
    to run (``CoreMissing``)."""
    from vmfork.vmm import eventloop

    monkeypatch.setattr(native, "CORE_BUILT", False)
    with pytest.raises(native.CoreMissing, match=r"setup_native"):
        eventloop.new_event_loop("unused")
