"""A snapshot of a booted Linux guest restored and run by the native assembly alone
(``_core.NativeMachine``, native/src/machine.rs): no Python ``Machine``, no Python
device, bus or loop behind it.

The machine has COM1, the i8042, rng and the balloon; vsock has no native plan yet
(docs/native.md), so the guest's agent gets no connection and its window reads as
unclaimed: the guest is checked to run on (no exit, no panic, vCPUs in the guest,
pause and resume), and its rng and balloon windows to answer as the driver left them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vmfork import _core
from vmfork.image import find_image
from vmfork.runtime.guest import BootedGuest
from vmfork.vmm import vmstate
from vmfork.vmm.devices import serial
from vmfork.vmm.devices.manager import BALLOON, RNG, SERIAL, VSOCK
from vmfork.vmm.devices.plan import NATIVE_KINDS, device_plan

VIRTIO_MAGIC = 0x7472_6976
STATUS_DRIVER_OK = 4
RUN_SECONDS = 3.0


@dataclass(frozen=True)
class Snapshot:
    state: vmstate.MachineState
    memory: Path


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Snapshot]:
    memory = tmp_path_factory.mktemp("native-machine") / "memory"
    with BootedGuest(find_image(), mem_mib=256, vcpus=2, balloon=True) as parent:
        assert parent.machine is not None
        state, _ = parent.machine.snapshot(str(memory), resume=False)
    yield Snapshot(state, memory)


def restore(snap: Snapshot, console_log: Path,
            prepared: vmstate.PreparedRestore | None = None) -> _core.NativeMachine:
    """``snap`` as a native machine, its console logged to ``console_log``; with the
    restore buffers ``prepared`` if given (built here if not)."""
    state = snap.state
    saved_serial = state.device(SERIAL)
    assert saved_serial is not None
    devices = [(d.slot, d.irq, device_plan(d)) for d in state.devices
               if d.kind in NATIVE_KINDS and d.slot is not None]
    prepared = prepared or vmstate.prepare_restore(state)
    assert prepared.native is not None
    kvm_fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    memory_fd = os.open(snap.memory, os.O_RDONLY | os.O_CLOEXEC)
    log_fd = os.open(console_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        return _core.NativeMachine(
            kvm_fd, memory_fd, state.mem_size, prepared.native, devices=devices,
            serial=(saved_serial.dll, saved_serial.dlm, saved_serial.ier, saved_serial.lcr,
                    saved_serial.mcr, saved_serial.scr, saved_serial.thre_pending,
                    bytes(saved_serial.rx)),
            console_log_fd=log_fd, log_burst=serial.CONSOLE_BURST,
            log_per_second=serial.CONSOLE_LINES_PER_S,
            log_total_bytes=serial.CONSOLE_LOG_BYTES)
    finally:
        for fd in (kvm_fd, memory_fd, log_fd):
            os.close(fd)


def wait_for(states: list[str], machine: _core.NativeMachine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while machine.vcpu_states() != states and time.monotonic() < deadline:
        time.sleep(0.01)
    assert machine.vcpu_states() == states


def test_a_snapshot_of_a_linux_guest_runs_on_in_the_native_machine(
        snapshot: Snapshot, tmp_path: Path) -> None:
    state = snapshot.state
    assert state.device(RNG) is not None and state.device(BALLOON) is not None
    assert state.device(VSOCK) is not None   # there, but not restored: no native plan yet
    console_log = tmp_path / "console.log"
    machine = restore(snapshot, console_log)
    try:
        vcpus = len(state.vcpus)
        assert machine.vcpu_states() == ["created"] * vcpus
        machine.start(paused=True)
        assert machine.pause(10.0)
        assert machine.vcpu_states() == ["paused"] * vcpus

        machine.resume()
        wait_for(["running"] * vcpus, machine)
        time.sleep(RUN_SECONDS)
        assert machine.exit is None, (machine.exit, machine.console_tail())
        assert machine.vcpu_states() == ["running"] * vcpus

        # A pause has to kick each vCPU out of KVM_RUN: each was in the guest.
        kicks_before = machine.exits().get("intr", 0)
        assert machine.pause(10.0)
        assert machine.vcpu_states() == ["paused"] * vcpus
        assert machine.exits().get("intr", 0) >= kicks_before + vcpus
        machine.resume()
        wait_for(["running"] * vcpus, machine)
        time.sleep(RUN_SECONDS)
        assert machine.exit is None, (machine.exit, machine.console_tail())

        tail = machine.console_tail()
        for sign in ("Kernel panic", "BUG:", "Oops", "general protection"):
            assert sign not in tail, tail

        # The rng and balloon windows answer as the driver left them: the magic, the
        # device id, DRIVER_OK, a running server.
        answers = {slot: (irq, magic, device_id, status, active)
                   for slot, irq, magic, device_id, status, active in machine.devices()}
        for device in state.devices:
            if device.kind not in NATIVE_KINDS:
                continue
            assert device.slot is not None and device.transport is not None
            irq, magic, device_id, status, active = answers[device.slot]
            assert (irq, magic, device_id) == (device.irq, VIRTIO_MAGIC,
                                               device.transport.device_type)
            assert status == device.transport.status
            assert status & STATUS_DRIVER_OK and active
        assert len(answers) == 2
    finally:
        machine.stop()
    assert machine.vcpu_states() == ["stopped"] * vcpus
    assert machine.exit_fd == -1 and machine.vm_fd is None
    assert console_log.exists()
