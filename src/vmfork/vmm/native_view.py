"""A Python view of a running ``NativeMachine`` (``native/src/machine.rs``), for a capture.

A native child (``runtime/vmmchild.py``'s ``native_child``) runs its machine with no
Python. Its control server hands a ``snapshot`` line over to Python; the hand-over
builds this view once, at the first such line (an idle native child pays nothing),
and ``vmm/capture.py``'s ``SnapshotTaker`` takes full, diff and live snapshots of it
as of a Python ``Machine``: both satisfy ``capture.CapturedMachine``.

What each part of the capture reads here:

* **the vCPUs**: parked and woken through the machine's ``VcpuControl`` handles (the
  ones its control server's ``pause``/``resume`` use); their state and the VM's read
  with the same GET ioctls as ``Machine.save_cpu_state`` (``vmstate.save_vm`` and
  ``save_vcpu``) on the VM core's descriptors, which the machine owns.
* **the devices**: COM1's registers from the native console, each virtio device's
  record from its native transport's plan (``plan.plan_state``), in the order of the
  snapshot the machine was restored from (the order the Python ``Machine`` attaches
  them in, so both write the same ``state.bin``).
* **"on the I/O thread"**: a Python ``Machine`` runs the device save and the memory's
  fixing on its loop thread, where its devices touch guest RAM. The native loop runs
  no Python; instead it is *held* (``NativeMachine.hold_devices``: the turn in
  progress ends, no later one starts) while the same callback runs on this thread, so
  nothing touches RAM or a device between the two, which is all that callback needs.
* **guest RAM**: the machine's own mappings, borrowed (``GuestMemory.borrowed``): a
  flat snapshot's memory file it mapped ``MAP_PRIVATE``, or a diff snapshot's premap
  it adopted, whose runs are the plan's (the overlays a capture's ``base_sources``
  reads are computed from the plan, through the plan's files opened here).
* **live and diff's writer**: ``os.fork`` from this (the forking) thread, as in a
  Python child: the writer inherits only this thread, and does only ``os`` calls on
  descriptors and RAM views before ``_exit`` (``capture``'s "Fork safety"); the
  native threads (vCPUs, loop, control, vsock) are not in it, and the descriptors it
  inherits (the vsock's listener among them) it never reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from vmfork.kvm import api
from vmfork.vmm import openfiles, vmstate
from vmfork.vmm.devices.manager import BALLOON, SERIAL, DeviceState
from vmfork.vmm.devices.plan import plan_state
from vmfork.vmm.devices.serial import SerialState
from vmfork.vmm.errors import HostError, StateError
from vmfork.vmm.memory import GuestMemory

if TYPE_CHECKING:
    from vmfork import _core
    from vmfork.ondisk.memplan import MemoryPlan

T = TypeVar("T")

# As long as a Python vCPU's pause and the control server's wait for a vCPU to park.
PAUSE_TIMEOUT = 5.0
# How long the device servers' turn in progress may take to end.
HOLD_TIMEOUT = 5.0


class NativeMachineView:
    """``capture.CapturedMachine`` over ``machine`` (``_core.NativeMachine``), restored
    from ``restored`` (its snapshot's decoded state) with RAM from ``memory_file``
    (and ``memory_plan`` for a diff snapshot). Opens ``/dev/kvm`` (the jail's
    descriptor in a jailed child) and the memory files; ``close`` closes them."""

    def __init__(self, machine: _core.NativeMachine, restored: vmstate.MachineState,
                 memory_file: str, memory_plan: MemoryPlan | None) -> None:
        self.machine = machine
        self._restored = restored
        self.memory = GuestMemory.borrowed(machine.ram_regions(), memory_file,
                                           restored.mem_size, memory_plan)
        try:
            preopened = openfiles.open_device(api.KVM_PATH)
            self._kvm_fd = preopened if preopened is not None else api.open_kvm()
        except BaseException:
            self.memory.close()
            raise
        self._msr_candidates: list[int] | None = None
        self._devices_held = False
        balloon = next((d.slot for d in restored.devices if d.kind == BALLOON.name), None)
        self.balloon_device = next((device for slot, _, device in machine.transports()
                                    if slot == balloon), None)

    def close(self) -> None:
        self.memory.close()
        os.close(self._kvm_fd)

    # -- capture.CapturedMachine ---------------------------------------------------------
    def pause(self) -> None:
        if not self.machine.pause(PAUSE_TIMEOUT):
            raise StateError(f"a vCPU did not pause within {PAUSE_TIMEOUT:.1f} s",
                             op="pause")

    def resume(self) -> None:
        self.machine.resume()

    def save_cpu_state(self) -> tuple[vmstate.VmState, list[vmstate.VcpuState]]:
        """As ``Machine.save_cpu_state``: the vCPUs must be paused."""
        if not self.machine.paused:
            raise StateError("save the vCPU state only while the vCPUs are paused",
                             op="save_cpu_state")
        if self._msr_candidates is None:
            self._msr_candidates = api.get_msr_index_list(self._kvm_fd)
        vm_fd = self.machine.vm_fd
        if vm_fd is None:
            raise StateError("the machine is stopped", op="save_cpu_state")
        vm = vmstate.save_vm(vm_fd)
        vcpus = [vmstate.save_vcpu(index, fd, self._msr_candidates)
                 for index, fd in self.machine.vcpu_fds()]
        return vm, vcpus

    def save_device_state(self, vm: vmstate.VmState,
                          vcpus: list[vmstate.VcpuState]) -> vmstate.MachineState:
        """The machine's state around ``vm`` and ``vcpus``, with its devices held
        (``with_devices_still``), listed as the snapshot it was restored from lists
        them."""
        if not self._devices_held:
            raise StateError("device state must be saved with the devices held",
                             op="save_device_state")
        native = {slot: (irq, device) for slot, irq, device in self.machine.transports()}
        devices: list[DeviceState] = []
        for record in self._restored.devices:
            if record.slot is None:
                serial = self.machine.serial()
                if record.kind != SERIAL.name or serial is None:
                    raise StateError(f"no native {record.kind} to save", op="save_device_state")
                dll, dlm, ier, lcr, mcr, scr, thre_pending, rx = serial
                devices.append(DeviceState(SERIAL.name, SERIAL.version, None, record.irq,
                                           SerialState(dll, dlm, ier, lcr, mcr, scr,
                                                       thre_pending, bytes(rx))))
                continue
            irq, device = native[record.slot]
            devices.append(plan_state(device.plan(), record.slot, irq))
        return vmstate.MachineState(mem_size=self.memory.size, vcpus=vcpus, vm=vm,
                                    devices=devices, cmdline=self._restored.cmdline)

    def with_devices_still(self, fn: Callable[[], T], timeout: float) -> T:
        """``fn()`` with the native loop's device servers held (the module notes say
        why that is ``run_on_loop``'s guarantee); ``timeout`` bounds only the wait for
        the loop's turn in progress, as the Python loop's bounds its queue."""
        if not self.machine.hold_devices(min(timeout, HOLD_TIMEOUT)):
            raise HostError("the native I/O loop did not stop serving within "
                            f"{HOLD_TIMEOUT:.0f} s", op="hold_devices")
        self._devices_held = True
        try:
            return fn()
        finally:
            self._devices_held = False
            self.machine.release_devices()
