"""A snapshot of a booted Linux guest restored and run by the native assembly alone
(``_core.NativeMachine``, native/src/machine.rs): no Python ``Machine``, no Python
device, bus or loop behind it.

The machine has COM1, the i8042, rng, the balloon and vsock (the whole snapshot's
device list, ``plan.machine_plan``): the guest is checked to run on (no exit, no panic,
vCPUs in the guest, pause and resume), its virtio windows to answer as the driver left
them, and the guest's own agent to answer over the native vsock's socket.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vmfork import _core
from vmfork.agent.client import AgentClient, vsock_uds_connector
from vmfork.image import find_image
from vmfork.runtime.guest import BootedGuest
from vmfork.vmm import vmstate
from vmfork.vmm.devices import serial
from vmfork.vmm.devices.manager import BALLOON, RNG, SERIAL, VSOCK
from vmfork.vmm.devices.plan import machine_plan

VIRTIO_MAGIC = 0x7472_6976
STATUS_DRIVER_OK = 4
RUN_SECONDS = 3.0
# How long the restored guest's agent may take to answer before the test calls it hung
# (a guard, not a measurement: the bench measures it).
AGENT_GUARD_S = 60.0


@dataclass(frozen=True)
class Snapshot:
    state: vmstate.MachineState
    memory: Path
    boot_id: str | None   # the parent guest's, which its restored copies keep


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Snapshot]:
    memory = tmp_path_factory.mktemp("native-machine") / "memory"
    with BootedGuest(find_image(), mem_mib=256, vcpus=2, balloon=True) as parent:
        assert parent.machine is not None
        boot_id = parent.agent.ping().boot_id
        state, _ = parent.machine.snapshot(str(memory), resume=False)
    yield Snapshot(state, memory, boot_id)


def restore(snap: Snapshot, console_log: Path, vsock_uds: Path,
            prepared: vmstate.PreparedRestore | None = None) -> _core.NativeMachine:
    """``snap`` as a native machine, its console logged to ``console_log``, its vsock's
    host side bound at ``vsock_uds``; with the restore buffers ``prepared`` if given
    (built here if not)."""
    state = snap.state
    saved_serial = state.device(SERIAL)
    assert saved_serial is not None
    devices = machine_plan(state)
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
            log_total_bytes=serial.CONSOLE_LOG_BYTES,
            vsock_listener=(str(vsock_uds), None))
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
    assert all(state.device(kind) is not None for kind in (RNG, BALLOON, VSOCK))
    console_log = tmp_path / "console.log"
    machine = restore(snapshot, console_log, tmp_path / "vsock.sock")
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

        # The virtio windows answer as the driver left them: the magic, the device id,
        # DRIVER_OK, a running server.
        answers = {slot: (irq, magic, device_id, status, active)
                   for slot, irq, magic, device_id, status, active in machine.devices()}
        for device in state.devices:
            if device.slot is None:
                continue
            assert device.transport is not None
            irq, magic, device_id, status, active = answers[device.slot]
            assert (irq, magic, device_id) == (device.irq, VIRTIO_MAGIC,
                                               device.transport.device_type)
            assert status == device.transport.status
            assert status & STATUS_DRIVER_OK and active
        assert len(answers) == 3
    finally:
        machine.stop()
    assert machine.vcpu_states() == ["stopped"] * vcpus
    assert machine.exit_fd == -1 and machine.vm_fd is None
    assert console_log.exists()


def test_the_guests_agent_answers_over_the_native_vsock(snapshot: Snapshot,
                                                        tmp_path: Path) -> None:
    """The restored guest is the parent's (its boot id) and its agent runs a command
    through the native vsock's socket; stopping the machine closes every descriptor it
    opened and removes the socket it bound."""
    fds_before = set(os.listdir("/proc/self/fd"))
    uds = tmp_path / "vsock.sock"
    machine = restore(snapshot, tmp_path / "console.log", uds)
    try:
        machine.start()
        agent = AgentClient(vsock_uds_connector(str(uds)))
        ping = agent.wait_until_ready(AGENT_GUARD_S)
        assert ping.boot_id == snapshot.boot_id
        result = agent.exec(["sh", "-c", "echo native-$((6 * 7)); echo err >&2; exit 3"],
                            timeout=AGENT_GUARD_S)
        assert (result.stdout, result.stderr, result.exit_code) == (b"native-42\n", b"err\n", 3)
        assert machine.exit is None, (machine.exit, machine.console_tail())
    finally:
        machine.stop()
    assert machine.vcpu_states() == ["stopped"] * len(snapshot.state.vcpus)
    assert not uds.exists()
    assert set(os.listdir("/proc/self/fd")) == fds_before
