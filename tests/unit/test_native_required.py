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
    """rng and the virtqueues are served only natively (the balloon, vsock, blk and net
    have no Python device left): guest memory without its native view, or a loop that
    is not the native one, is a host error there, not a device that silently serves
    nothing."""
    from vmfork.vmm.devices.virtio import rng
    from vmfork.vmm.devices.virtio.queue import Virtqueue
    from vmfork.vmm.eventloop import EventLoop
    from vmfork.vmm.memory import GuestMemory

    class Line:
        failed = False

    memory = GuestMemory.anonymous(1 << 20)
    assert memory.native is not None
    memory.native.close()
    memory.native = None
    try:
        for device in (rng.VirtioRng(EventLoop("unused"), native_serve=False),):
            device.memory, device.queues = memory, [Virtqueue(16)]
            device.interrupt = Line()  # type: ignore[assignment]
            with pytest.raises(HostError, match="only natively"):
                device.queue_notify(0)
        queue = Virtqueue(16)
        for ask in (lambda: queue.validate(memory), lambda: queue.needs_interrupt(memory, 1)):
            with pytest.raises(HostError, match="only natively"):
                ask()
    finally:
        memory.close()


def test_without_the_core_there_is_no_loop_nor_register_file(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The I/O loop and the virtio-mmio register file have no Python twin: asked for
    without the core, each names the set-up to run (``CoreMissing``)."""
    from vmfork.vmm import eventloop
    from vmfork.vmm.devices.virtio import mmio, rng
    from vmfork.vmm.eventloop import EventLoop
    from vmfork.vmm.memory import GuestMemory

    monkeypatch.setattr(native, "CORE_BUILT", False)
    with pytest.raises(native.CoreMissing, match=r"setup_native"):
        eventloop.new_event_loop("unused")
    memory = GuestMemory.anonymous(1 << 20)
    try:
        with pytest.raises(native.CoreMissing, match=r"setup_native"):
            mmio.MmioTransport(rng.VirtioRng(EventLoop("unused")), memory,
                               None, EventLoop("unused"))  # type: ignore[arg-type]
    finally:
        memory.close()
