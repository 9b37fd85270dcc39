"""One microVM: guest memory, vCPUs, interrupt controllers, buses and devices.

``Machine`` is the VMM as a library. It is built from a frozen
``MachineConfig``, driven through a handful of methods (``start``, ``pause``,
``resume``, ``stop``, ``wait``) and owns every live resource it creates (fds,
mappings, threads, sockets); ``close`` releases all of them.

Construction is a fixed recipe:

1. open ``/dev/kvm``, check the API version and the capabilities we need;
2. map guest memory;
3. build the VM core in one native call (``_core.VmCore``, ``native/src/vm.rs``):
   the VM, the memory slots, the TSS and identity-map pages, the in-kernel irqchip
   (PIC + IOAPIC + LAPICs) and PIT, the vCPUs, and for a restore every SET ioctl
   of the snapshot's VM and vCPU state;
4. build the buses and the devices (``devices.manager`` holds them, gives each
   virtio device its slot and pin, and saves, restores and closes them all): COM1
   and the i8042, then the virtio-mmio devices, each with an irqfd line, announced
   to the kernel on its command line (``virtio_mmio.device=4K@<base>:<irq>``);
5. make a run loop per vCPU (its thread starts with ``start``), and load Linux
   (``x86.boot``) and set the vCPUs up, or restore the devices.

The machine ends when the guest resets (Linux ``reboot=k`` pulses the i8042
reset line: that is both "reboot" and "power off" for a microVM, and what a
kernel panic with ``panic=1`` leads to), on a triple fault, on a KVM error, or
when the host stops it.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from vmfork.kvm import api
from vmfork.kvm.structs import kvm_cpuid_entry2
from vmfork.ondisk.memplan import MemoryPlan
from vmfork.vmm import openfiles, vmstate
from vmfork.vmm.bus import Bus
from vmfork.vmm.devices.manager import (
    BALLOON,
    BLK,
    NET,
    RNG,
    SERIAL,
    VOLUME,
    VSOCK,
    DeviceKind,
    DeviceManager,
    DeviceState,
    VolumeSlotState,
)
from vmfork.vmm.devices.plan import (
    DISK_KINDS,
    NATIVE_KINDS,
    NativeVirtio,
    Plan,
    balloon_advice,
    boot_plan,
    device_plan,
    empty_slot,
    wants_ioeventfds,
)
from vmfork.vmm.devices.serial import Serial
from vmfork.vmm.devices.virtio.blk import BlkState, open_disk, validate_disk_key
from vmfork.vmm.devices.virtio.device import run_on_loop
from vmfork.vmm.devices.virtio.mmio import REG_QUEUE_NOTIFY
from vmfork.vmm.devices.virtio.net import open_tap, parse_mac
from vmfork.vmm.errors import HostError, StateError
from vmfork.vmm.eventloop import EventLoop, NativeEventLoop, new_event_loop
from vmfork.vmm.irq import IrqLine
from vmfork.vmm.memory import GuestMemory, PremappedRam
from vmfork.vmm.native import CORE_BUILT, require_core
from vmfork.vmm.vcpu import Vcpu, VcpuExitEvent, VcpuRunState
from vmfork.vmm.vmstate import MachineState
from vmfork.vmm.x86 import boot
from vmfork.vmm.x86 import layout as L

if CORE_BUILT:   # else no machine is made (Machine calls require_core first)
    from vmfork import _core

log = logging.getLogger(__name__)
T = TypeVar("T")

# Console on COM1; reboot (and so power-off and panic) through the i8042 reset
# line; no port-0x80 delays (each would be an exit); no PCI, ACPI or modules.
# No RCU stall warnings: a sandbox's vCPU is paused (BRANCH) and descheduled (many
# children on few cores) as a matter of course, and the warning it then prints goes
# out a character per VM exit, which on a busy host kept a guest busy for minutes.
BASE_CMDLINE = ("console=ttyS0 reboot=k panic=1 io_delay=none quiet nomodule "
                "rcupdate.rcu_cpu_stall_suppress=1")
# With the balloon: report free blocks of every order, not only of pageblock_order
# (4 MiB here): what a build frees is interleaved with what it keeps, so few whole
# 4 MiB blocks come free (our kernel patch makes the driver honour this).
BALLOON_CMDLINE = "page_reporting.page_reporting_order=0"
MAX_VCPUS = 16
_kvm_checked = False
"""This process (or the zygote it was forked from, whose warm-up restore built a
Machine) found /dev/kvm's API version and capabilities right: they are the host's, so
later machines skip the ~17 ioctls of the check (``Machine._check_kvm``)."""
MAX_VOLUME_SLOTS = 24   # forkd's cap on volumes per sandbox


@dataclass(frozen=True)
class VolumeMedia:
    """A disk for a volume slot: the host file, its key (a content key for read-only
    media, the volume's id for a read-write one), and where the guest mounts it."""

    slot: int
    path: str
    key: str
    read_only: bool
    guest_path: str

    def validate(self) -> None:
        if not 0 <= self.slot < MAX_VOLUME_SLOTS:
            raise ValueError(f"volume slot {self.slot} is not 0..{MAX_VOLUME_SLOTS - 1}")
        validate_disk_key(self.key)
        if not self.guest_path.startswith("/"):
            raise ValueError(f"volume guest path {self.guest_path!r} is not absolute")


@dataclass(frozen=True)
class OpenedDisk:
    """A root disk's or a filled volume slot's disk, opened by the machine for its
    native device (which keeps a duplicate of ``fd``): the record a boot writes
    (``record``), the guest path (a volume's, "" for the root disk) and the host path
    (for errors)."""

    record: BlkState
    guest_path: str
    path: str
    fd: int

    def check_restores(self, saved: DeviceState, vm_id: str) -> None:
        """A restore must be given the snapshot's very disk: its key, its size (which
        the native device checks again on the file it takes) and its mode.
        ``HostError`` naming both if not."""
        state = saved.state
        disk = state.disk if isinstance(state, VolumeSlotState) else state
        assert isinstance(disk, BlkState)   # a disk kind's record
        if disk.disk_key != self.record.disk_key:
            raise HostError(f"the snapshot's disk is {disk.disk_key}, but this machine "
                            f"was given {self.record.disk_key} ({self.path})", vm_id=vm_id,
                            op="restore")
        if disk.capacity_bytes != self.record.capacity_bytes:
            raise HostError(f"the snapshot's disk {disk.disk_key} had {disk.capacity_bytes} "
                            f"bytes, but {self.path} has {self.record.capacity_bytes}: not "
                            "the same disk", vm_id=vm_id, op="restore")
        if disk.read_only != self.record.read_only:
            want = "read-only" if disk.read_only else "read-write"
            raise HostError(f"the snapshot's disk {disk.disk_key} was {want}, and "
                            f"{self.path} is not given {want}", vm_id=vm_id, op="restore")


@dataclass(frozen=True)
class MachineConfig:
    kernel: str | None = None
    initrd: str | None = None
    payload: bytes | None = None      # a flat 64-bit test guest instead of a kernel
    restore_state: MachineState | None = None   # restore instead of boot ...
    memory_file: str | None = None              # ... mapping this file MAP_PRIVATE
    # ... and a diff chain's layers over it (memory_file is then the plan's base)
    memory_plan: MemoryPlan | None = None
    # ... already mapped by the process this one was forked from, and inherited
    # (a zygote's prefork, ``memory.PremappedRam``): adopted if it maps that plan.
    memory_premapped: PremappedRam | None = None
    # restore_state's ioctl buffers, built beforehand (vmstate.prepare_restore) so a
    # forked child only issues ioctls; built from restore_state when not given.
    restore_prepared: vmstate.PreparedRestore | None = None
    # restore_state's natively served devices' plans by slot (``plan.restore_plans``),
    # built beforehand with the balloon dropping pages by MADV_DONTNEED (guest RAM
    # mapped private, as a forked child's is), so a forked child does not build them;
    # built from restore_state when not given or when its RAM drops pages otherwise.
    restore_plans: Mapping[int, Plan] | None = None
    cmdline_extra: str = ""
    mem_mib: int = 256
    vcpus: int = 1
    console_log: str | None = None
    vsock_uds: str | None = None
    guest_cid: int = 3
    rng: bool = True   # for a booted machine; a restored one has it when its snapshot had
    # virtio-balloon with free page reporting only (devices/virtio/balloon.py), for a
    # booted machine; a restored one has it exactly when its snapshot had it.
    # VMFORK_BALLOON=0 leaves it out (a measurement switch: bench/pip_chain.py --no-balloon).
    balloon: bool = field(default_factory=lambda: os.environ.get("VMFORK_BALLOON", "1") != "0")
    memfd: bool = True
    vm_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # virtio-net: present when booted with a ``guest_mac`` or restored from a snapshot
    # that had one (the MAC then comes from the snapshot); ``net_tap`` names the tap
    # to attach to, in this thread's network namespace (None: no cable plugged in).
    guest_mac: str | None = None
    net_tap: str | None = None
    # virtio-blk, read-only: the host path of a disk image and its content key (the
    # disk's name in snapshots; the guest sees its first 20 characters as the disk's
    # serial). A restore must be given the snapshot's disk, the same key and size.
    root_disk: str | None = None
    root_disk_key: str | None = None
    # Volume slots (virtio-blk, after every other device so that older snapshots keep
    # their slots): how many a booted machine gets (a restored one has its
    # snapshot's), and the disks in them from the start -- for a boot, the snapshot
    # volumes; for a restore, every disk the snapshot's slots held, by slot. Disks
    # for a restored machine's empty slots come later (``Machine.attach_volume``).
    volume_slots: int = 0
    volumes: tuple[VolumeMedia, ...] = ()

    def validate(self) -> None:
        sources = [self.kernel is not None, self.payload is not None,
                   self.restore_state is not None]
        if sum(sources) != 1:
            raise ValueError("give exactly one of kernel (a vmlinux), payload (a test guest) "
                             "and restore_state (a snapshot)")
        if (self.restore_state is None) != (self.memory_file is None):
            raise ValueError("restore_state and memory_file go together")
        if self.memory_plan is not None and self.memory_file is None:
            raise ValueError("memory_plan needs memory_file (its base)")
        if self.memory_premapped is not None and self.memory_plan is None:
            raise ValueError("memory_premapped needs memory_plan (what it maps)")
        if self.restore_state is not None:
            if self.restore_state.mem_size != self.mem_mib << 20:
                raise ValueError(f"the snapshot has {self.restore_state.mem_size >> 20} MiB of "
                                 f"memory, the config {self.mem_mib} MiB")
            if len(self.restore_state.vcpus) != self.vcpus:
                raise ValueError(f"the snapshot has {len(self.restore_state.vcpus)} vCPUs, "
                                 f"the config {self.vcpus}")
        elif self.restore_prepared is not None or self.restore_plans is not None:
            raise ValueError("restore_prepared and restore_plans need restore_state")
        if not 1 <= self.vcpus <= MAX_VCPUS:
            raise ValueError(f"vcpus must be 1..{MAX_VCPUS}, not {self.vcpus}")
        if not 32 <= self.mem_mib <= 64 * 1024:
            raise ValueError(f"mem_mib must be 32..65536, not {self.mem_mib}")
        if not 3 <= self.guest_cid < 0xFFFF_FFFF:
            raise ValueError(f"guest_cid must be >= 3, not {self.guest_cid}")
        if self.guest_mac is not None:
            parse_mac(self.guest_mac)
        if self.net_tap is not None and self.net_mac is None:
            raise ValueError("net_tap needs a network device: boot with guest_mac, or restore "
                             "a snapshot whose parent had one")
        self._validate_root_disk()
        self._validate_volumes()

    def _validate_volumes(self) -> None:
        saved = (self.restore_state.devices_of(VOLUME)
                 if self.restore_state is not None else None)
        slots = len(saved) if saved is not None else self.volume_slots
        if not 0 <= slots <= MAX_VOLUME_SLOTS:
            raise ValueError(f"volume_slots must be 0..{MAX_VOLUME_SLOTS}, not {slots}")
        taken: set[int] = set()
        for media in self.volumes:
            media.validate()
            if media.slot >= slots:
                raise ValueError(f"volume slot {media.slot}: the machine has {slots} slots")
            if media.slot in taken:
                raise ValueError(f"volume slot {media.slot} is given two disks")
            taken.add(media.slot)
        if saved is None:
            return
        filled = {i for i, v in enumerate(saved) if v.disk.disk_key}
        if filled != taken:
            raise ValueError(f"the snapshot's volume slots {sorted(filled)} hold disks; "
                             f"give exactly those (given: {sorted(taken)})")

    def _validate_root_disk(self) -> None:
        if (self.root_disk is None) != (self.root_disk_key is None):
            # Without its key a disk could not be named in a snapshot, and a key
            # without a disk names nothing.
            raise ValueError("root_disk and root_disk_key go together (the disk image and "
                             "its content key)")
        if self.root_disk_key is not None:
            validate_disk_key(self.root_disk_key)
        if self.restore_state is None:
            return
        blk = self.restore_state.device(BLK)
        if blk is not None and self.root_disk is None:
            raise ValueError(f"the snapshot's guest has root disk {blk.disk_key}: give "
                             "root_disk (its image) and root_disk_key")
        if blk is None and self.root_disk is not None:
            raise ValueError(f"the snapshot's guest has no root disk; a restored guest cannot "
                             f"be given one ({self.root_disk})")

    @property
    def net_mac(self) -> str | None:
        """The MAC of the virtio-net device, None if the machine has none."""
        if self.restore_state is not None:
            net = self.restore_state.device(NET)
            return net.mac if net is not None else None
        return self.guest_mac


@dataclass(frozen=True)
class MachineExit:
    reason: str            # reset | shutdown | internal_error | fail_entry | vmm_error | stopped
    detail: str
    console_tail: str

    @property
    def panicked(self) -> bool:
        return "Kernel panic" in self.console_tail

    @property
    def clean(self) -> bool:
        return self.reason in ("reset", "stopped") and not self.panicked


class Machine:
    def __init__(self, config: MachineConfig) -> None:
        config.validate()
        require_core()
        self.config = config
        self.vm_id = config.vm_id
        self._closers: list[Any] = []     # callables, run in reverse on close
        self._exit: MachineExit | None = None
        self._exit_lock = threading.Lock()
        self._exited = threading.Event()
        # (read end, write end) of a pipe written once the machine ends: made on first
        # ask (exit_fd), so a waiter can block on it beside other fds, without polling.
        self._exit_pipe: tuple[int, int] | None = None
        # Told the exit's reason once it happens (on_exit): the native control
        # server answers status from what it was told.
        self._exit_listeners: list[Callable[[str], None]] = []
        self.timings: dict[str, float] = {}
        self.restore_refused_msrs: list[list[int]] = []
        started = time.monotonic()
        try:
            self._create(config)
        except BaseException:
            self.close()
            raise
        self.timings["setup"] = time.monotonic() - started

    # -- construction -------------------------------------------------------------------
    def _check_kvm(self) -> None:
        """The KVM API version and every capability this VMM needs (once per process,
        and not again in the children of a zygote that checked: ``_kvm_checked``)."""
        global _kvm_checked
        if _kvm_checked:
            return
        version = api.get_api_version(self.kvm_fd)
        if version != api.KVM_API_VERSION:
            raise HostError(f"KVM API version {version}, expected {api.KVM_API_VERSION}",
                            vm_id=self.vm_id, op="KVM_GET_API_VERSION")
        missing = [what for cap, what in api.REQUIRED_CAPS.items()
                   if not api.check_extension(self.kvm_fd, cap)]
        if missing:
            raise HostError("this host's KVM lacks: " + "; ".join(missing),
                            vm_id=self.vm_id, op="KVM_CHECK_EXTENSION")
        _kvm_checked = True

    def _fd(self, fd: int) -> int:
        self._closers.append(lambda: os.close(fd))
        return fd

    def _create(self, config: MachineConfig) -> None:
        # 1. KVM and its capabilities
        # A jailed VMM has no /dev/kvm node: its jail opened one before the drop.
        preopened = openfiles.open_device(api.KVM_PATH)
        self.kvm_fd = self._fd(preopened if preopened is not None else api.open_kvm())
        self._check_kvm()

        # 2. guest memory
        mem_size = config.mem_mib << 20
        if config.memory_file is not None:
            self.memory = GuestMemory.from_file_private(config.memory_file, mem_size,
                                                        config.memory_plan,
                                                        config.memory_premapped)
        elif config.memfd:
            self.memory = GuestMemory.memfd(mem_size, f"vmfork-{self.vm_id}")
        else:
            self.memory = GuestMemory.anonymous(mem_size)
        self._closers.append(self.memory.close)

        # 3. the VM core, in one native call (native/src/vm.rs): the VM, a memory slot
        # per region, the real-mode helper pages, the irqchip and PIT, the vCPUs and,
        # for a restore, the snapshot's VM and vCPU state (restore.rs).
        prepared: vmstate.PreparedRestore | None = None
        if config.restore_state is not None:
            prepared = config.restore_prepared or vmstate.prepare_restore(config.restore_state)
            indices = [v.index for v in prepared.vcpus]
        else:
            indices = list(range(config.vcpus))
        started = time.monotonic()
        try:
            self.core = _core.VmCore(
                self.kvm_fd, [(r.guest_phys, r.size, r.host_addr) for r in self.memory.regions],
                tss_addr=L.TSS_ADDR, identity_map_addr=L.IDENTITY_MAP_ADDR, vcpus=indices,
                prepared=prepared.native if prepared is not None else None)
        except _core.IoctlError as err:
            raise vmstate.kvm_error(err) from err
        # After the memory's closer, so run before it: KVM's slots name the mappings.
        # The core's descriptors stay open until the last vCPU thread ends.
        self._closers.append(self.core.close)
        self.vm_fd = self.core.vm_fd
        if prepared is not None:
            report = self.core.restore_report
            if report is None:   # buffers without the native half: the reference path
                self.restore_refused_msrs = vmstate.apply_restore(
                    self.kvm_fd, self.vm_fd, [self.core.vcpu_fd(i) for i in range(len(indices))],
                    prepared)
            else:
                self.restore_refused_msrs = vmstate.report_native_restore(prepared, *report)
        self.timings["vm_core"] = time.monotonic() - started

        self.vcpus: list[Vcpu] = []
        self._msr_candidates: list[int] | None = None

        # 4. buses and devices (the vCPUs exist: their loops are made after the buses)
        self.pio_bus = Bus("pio")
        self.mmio_bus = Bus("mmio")
        self.loop = new_event_loop(f"vmm-io-{self.vm_id}")
        self._closers.append(self.loop.stop)
        self.loop.start()
        self._irq_lines: list[IrqLine] = []
        self._lines_by_gsi: dict[int, IrqLine] = {}
        self._cmdline_devices: list[str] = []
        self.devices = DeviceManager(vm_id=self.vm_id)
        self._closers.append(self.devices.close)
        console_log = None
        if config.console_log:
            console_log = open(config.console_log, "ab", buffering=0)
            self._closers.append(console_log.close)
        # The vCPU loop serves COM1 and the i8042 itself (a reset ends the vCPU that
        # saw it, reported as "reset"); they are not on pio_bus.
        self.serial = Serial(self._irq_line(L.COM1_IRQ), log=console_log)
        self.devices.attach_legacy(SERIAL, self.serial, L.COM1_IRQ)
        # Every virtio device is served by its native transport (devices/plan.py).
        self.vsock: NativeVirtio | None = None
        self.rng: NativeVirtio | None = None
        self.net: NativeVirtio | None = None
        self.blk: NativeVirtio | None = None
        self.balloon: NativeVirtio | None = None
        self.volumes: list[NativeVirtio] = []
        # Per volume slot, its place among the virtio-mmio devices (the N of the guest's
        # virtio-mmio.N platform device, which the agent finds its disk by).
        self.volume_devices: list[int] = []
        self._add_virtio_devices(config)

        # 5. the vCPU loops, and Linux (or a test payload), or the snapshot's devices
        cmdline = " ".join(p for p in (BASE_CMDLINE, *self._cmdline_devices,
                                       config.cmdline_extra) if p)
        self.cmdline = cmdline
        for position, index in enumerate(indices):
            self._new_vcpu(position, index)
        if config.restore_state is not None:
            self._restore(config.restore_state)
            return
        if config.kernel is not None:
            self.boot_info = boot.load_linux(self.memory, config.kernel, config.initrd, cmdline,
                                             config.vcpus)
        else:
            assert config.payload is not None
            self.boot_info = boot.load_flat_payload(self.memory, config.payload)
        supported = api.get_supported_cpuid(self.kvm_fd)
        for vcpu in self.vcpus:
            self._setup_vcpu(vcpu, supported, vcpu.index)

    def _new_vcpu(self, position: int, index: int) -> Vcpu:
        vcpu = Vcpu(index, self.core, position, self.pio_bus, self.mmio_bus, self._vcpu_exited,
                    console=self.serial.console)
        self._closers.append(vcpu.close)
        self.vcpus.append(vcpu)
        return vcpu

    def _restore(self, state: MachineState) -> None:
        """Restore order: the vCPUs were created and the VM state (PIT, clock,
        irqchips) and vCPU state set with the VM core (step 3); then the devices
        (``DeviceManager.restore``: each virtio device before its transport, whose
        restore re-activates the device); vsock then posts TRANSPORT_RESET so the guest
        drops the parent's connections and accepts new ones."""
        started = time.monotonic()
        self.devices.restore(state.devices)
        self.timings["restore_state"] = self.timings["vm_core"] + time.monotonic() - started

    @property
    def balloon_device(self) -> _core.NativeDevice | None:
        """The balloon's native device (a capture holds its reported pages), if any."""
        return None if self.balloon is None else self.balloon.device

    def with_devices_still(self, fn: Callable[[], T], timeout: float) -> T:
        """``fn()`` on the I/O thread, where the devices touch guest RAM: nothing else
        runs there meanwhile (``capture.CapturedMachine``)."""
        result: T = run_on_loop(self.loop, fn, timeout=timeout)
        return result
    def free_page_reporting(self) -> dict[str, Any] | None:
        """What the balloon did (devices/virtio/balloon.py), None without one: whether
        the guest's driver runs it, its counters, and seconds since the last report."""
        if self.balloon is None:
            return None
        device = self.balloon.device
        reports, discarded, errors, _, _, age = device.balloon_stats()
        return {"active": device.active, "reports": reports, "bytes_discarded": discarded,
                "discard_errors": errors, "last_report_age_s": age}

    # -- snapshots ----------------------------------------------------------------------------
    def snapshot(self, memory_path: str, *, resume: bool = True) -> tuple[MachineState,
                                                                          dict[str, float]]:
        """Capture the machine, pause-consistent, and write guest RAM to ``memory_path``.

        The vCPUs are paused for the whole capture (this is the "full" mode).
        Device state and memory are captured inside one callback on the I/O
        thread, so no device can touch guest memory or change its own state
        between the two. Returns the state and timings in seconds. The other
        capture modes (diff layers, live) are in ``vmfork.vmm.capture``.
        """
        timings: dict[str, float] = {}
        started = time.monotonic()
        self.pause()
        paused_at = time.monotonic()
        timings["pause"] = paused_at - started
        try:
            vm, vcpus = self.save_cpu_state()
            timings["vcpu_state"] = time.monotonic() - paused_at

            def devices_and_memory() -> MachineState:
                state = self.save_device_state(vm, vcpus)
                mem_started = time.monotonic()
                timings["memory_bytes"] = float(self.memory.dump(memory_path))
                timings["memory_write"] = time.monotonic() - mem_started
                return state

            state: MachineState = run_on_loop(self.loop, devices_and_memory, timeout=3600)
        finally:
            timings["paused"] = time.monotonic() - started
            if resume:
                self.resume()
        return state, timings

    def save_cpu_state(self) -> tuple[vmstate.VmState, list[vmstate.VcpuState]]:
        """VM-wide (PIT, clock, irqchips) and per-vCPU state. The vCPUs must be paused."""
        if not self.paused:
            raise StateError("save the vCPU state only while the vCPUs are paused",
                             vm_id=self.vm_id, op="save_cpu_state")
        if self._msr_candidates is None:
            self._msr_candidates = api.get_msr_index_list(self.kvm_fd)
        vm = vmstate.save_vm(self.vm_fd)
        vcpus = [vmstate.save_vcpu(v.index, v.fd, self._msr_candidates) for v in self.vcpus]
        return vm, vcpus

    def save_device_state(self, vm: vmstate.VmState,
                          vcpus: list[vmstate.VcpuState]) -> MachineState:
        """The whole machine state around ``vm`` and ``vcpus``. Call it on the I/O
        thread (``run_on_loop``), in the same callback that captures guest memory:
        devices touch guest memory only on that thread, so the two agree."""
        if not self.loop.in_loop_thread():
            raise StateError("device state must be saved on the I/O thread",
                             vm_id=self.vm_id, op="save_device_state")
        return MachineState(mem_size=self.memory.size, vcpus=vcpus, vm=vm,
                            devices=self.devices.save(), cmdline=self.cmdline)

    def _setup_vcpu(self, vcpu: Vcpu, supported: list[kvm_cpuid_entry2],
                    index: int) -> None:
        boot.setup_vcpu_cpuid_msrs(vcpu.fd, supported, index, self.config.vcpus)
        if index == 0:
            boot.setup_boot_cpu_registers(vcpu.fd, self.boot_info.entry)

    def _irq_line(self, gsi: int) -> IrqLine:
        """The line (an irqfd) of IOAPIC pin ``gsi``; devices that share a pin share
        its line."""
        line = self._lines_by_gsi.get(gsi)
        if line is not None:
            return line
        line = IrqLine(gsi, connect=lambda fd: api.irqfd(self.vm_fd, fd, gsi))
        self._closers.append(line.close)
        self._irq_lines.append(line)
        self._lines_by_gsi[gsi] = line
        return line

    def _add_virtio_devices(self, config: MachineConfig) -> None:
        """Create the virtio devices this config (or, for a restore, its snapshot) asks
        for: vsock (the agent channel) first, so that it is always ``virtio-mmio.0``,
        then the entropy source, the network device, the root disk, the balloon and
        the volume slots. The order is the guest's view (each device's window and IRQ
        follow from its slot, ``devices.manager``), so a new device goes last but
        before the volume slots (which share the pins left): snapshots taken before it
        existed keep their slots. This is the one place that knows where each device
        comes from; saving, restoring and closing them is the manager's."""
        saved = config.restore_state
        if saved is not None:   # a restored machine has the devices its snapshot had
            rng, balloon = (saved.device(RNG) is not None,
                            saved.device(BALLOON) is not None)
            volume_slots = len(saved.devices_of(VOLUME))
        else:
            rng, balloon, volume_slots = config.rng, config.balloon, config.volume_slots
        if config.vsock_uds is not None:
            self.vsock = self.devices.attach_native(VSOCK, partial(self._native_device, VSOCK))
        if rng:
            self.rng = self.devices.attach_native(RNG, partial(self._native_device, RNG))
        if config.net_mac is not None:
            self.net = self.devices.attach_native(NET, partial(self._native_device, NET))
        if config.root_disk is not None:
            assert config.root_disk_key is not None   # validate()
            self.blk = self.devices.attach_native(BLK, partial(
                self._native_disk, BLK, config.root_disk, config.root_disk_key, True, ""))
        if balloon:
            self.balloon = self.devices.attach_native(BALLOON,
                                                      partial(self._native_device, BALLOON))
            self._cmdline_devices.append(BALLOON_CMDLINE)
        media = {m.slot: m for m in config.volumes}
        for index in range(volume_slots):
            self.volume_devices.append(self.devices.next_slot)
            given = media.get(index)
            self.volumes.append(self.devices.attach_native(
                VOLUME, partial(self._native_disk, VOLUME, given.path, given.key,
                                given.read_only, given.guest_path) if given is not None
                else partial(self._native_device, VOLUME)))

    def _native_disk(self, kind: DeviceKind[Any], path: str, key: str, read_only: bool,
                     guest_path: str, slot: int, irq: int) -> NativeVirtio:
        """The root disk (``kind`` BLK, at no ``guest_path``) or a filled volume slot,
        on the file at ``path`` named ``key``: opened here (read-only unless not
        ``read_only``), handed to the device, which keeps a duplicate, and closed; a
        restore's must be the snapshot's disk (``OpenedDisk.check_restores``)."""
        what = "root disk" if kind is BLK else "volume"
        fd, size = open_disk(path, writable=not read_only, what=what)
        try:
            disk = OpenedDisk(BlkState(acked_features=0, disk_key=key, capacity_bytes=size,
                                       read_only=read_only, volume_slot=kind is VOLUME),
                              guest_path, path, fd)
            return self._native_device(kind, slot, irq, disk)
        finally:
            os.close(fd)

    def attach_volume(self, media: VolumeMedia) -> None:
        """Put ``media`` into an empty volume slot of a running machine and tell the
        guest (a configuration-change interrupt); the guest agent mounts it after
        (``AgentClient.mount_volume``). The slot's queue gets its ioeventfd now (an
        empty slot had none). Raises ``HostError`` if the slot is missing or full, or
        the disk cannot be opened; nothing changes then."""
        media.validate()
        if media.slot >= len(self.volumes):
            raise HostError(f"volume slot {media.slot}: this machine has "
                            f"{len(self.volumes)} slots", vm_id=self.vm_id,
                            op="attach_volume")
        slot = self.volumes[media.slot]
        held = slot.disk.disk_key
        if held:
            raise HostError(f"volume slot {media.slot} already holds {held}",
                            vm_id=self.vm_id, op="attach_volume")
        fd, size = open_disk(media.path, writable=not media.read_only, what="volume")
        notify_at = (L.VIRTIO_MMIO_BASE + self.volume_devices[media.slot] * L.VIRTIO_MMIO_SIZE
                     + REG_QUEUE_NOTIFY)
        notify = -1
        try:
            notify = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            api.ioeventfd(self.vm_fd, notify, notify_at, 4, datamatch=0)
            try:
                slot.device.insert_media(fd, media.key, size, media.read_only,
                                         media.guest_path, notify)
            except ValueError as err:
                api.ioeventfd(self.vm_fd, notify, notify_at, 4, datamatch=0, deassign=True)
                raise HostError(f"volume slot {media.slot}: {err}", vm_id=self.vm_id,
                                op="attach_volume") from err
            slot.device.config_changed()
        finally:
            os.close(fd)   # the device and KVM hold their own references
            if notify >= 0:
                os.close(notify)

    def _native_device(self, kind: DeviceKind[Any], slot: int, irq: int,
                       disk: OpenedDisk | None = None) -> NativeVirtio:
        """The manager's builder for a device its native transport serves (a kind in
        ``plan.NATIVE_KINDS``): restored, in one call, from the plan of the snapshot's
        record, or from a fresh plan for a boot; on the MMIO window of ``slot`` and the
        line of pin ``irq``, each queue's ioeventfd registered with KVM and handed to
        it (the native loop serves them, and the device keeps its own copies; an empty
        volume slot gets none, ``plan.wants_ioeventfds``). A disk's ``disk`` (None for
        an empty volume slot) is its file and the record a boot would write. vsock
        binds its listener at ``config.vsock_uds`` itself (and unlinks it at its
        close); net is given the tap ``config.net_tap`` names, opened here (the device
        keeps a duplicate; none: a NIC with its cable pulled)."""
        if kind.name not in NATIVE_KINDS:
            raise ValueError(f"{kind.name} has no native transport")
        base = L.VIRTIO_MMIO_BASE + slot * L.VIRTIO_MMIO_SIZE
        advice = balloon_advice(self.memory)
        config = self.config
        saved = config.restore_state
        record = None if saved is None else next(d for d in saved.devices
                                                 if d.kind == kind.name and d.slot == slot)
        prebuilt = config.restore_plans if advice == mmap.MADV_DONTNEED else None
        if record is None and kind.name in DISK_KINDS:
            plan = boot_plan(kind.name, advice, empty_slot() if disk is None else disk.record,
                             "" if disk is None else disk.guest_path)
        elif record is None:
            plan = boot_plan(kind.name, advice, guest_cid=config.guest_cid,
                             mac=config.guest_mac)
        elif prebuilt is not None and slot in prebuilt:
            plan = prebuilt[slot]
        else:
            plan = device_plan(record, advice)
        if record is not None and disk is not None:
            disk.check_restores(record, self.vm_id)
        assert isinstance(self.loop, NativeEventLoop) and self.memory.native is not None
        listener = (config.vsock_uds, None) if kind is VSOCK and config.vsock_uds else None
        notify: list[int] = []
        tap: int | None = None
        try:
            if kind is NET and config.net_tap is not None:
                tap = open_tap(config.net_tap)
            for index in range(len(plan[2]) if wants_ioeventfds(plan) else 0):
                notify.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
                api.ioeventfd(self.vm_fd, notify[-1], base + REG_QUEUE_NOTIFY, 4,
                              datamatch=index)
            line = self._irq_line(irq)
            device = _core.NativeDevice.restore(
                plan, self.memory.native, self.loop.native_loop, line.fd,
                [*notify] if notify else [None] * len(plan[2]),
                vsock_listener=listener, disk_file=None if disk is None else disk.fd,
                tap_fd=tap)
        except (OSError, ValueError) as err:
            raise HostError(f"{kind.name} at virtio-mmio.{slot}: {err}", vm_id=self.vm_id,
                            op="add_native") from err
        finally:
            # KVM and the device hold their own references
            for fd in (*notify, *([] if tap is None else [tap])):
                os.close(fd)
        handle = NativeVirtio(device, record)
        try:
            assert self.mmio_bus.windows is not None
            self.mmio_bus.windows.add_native(base, device)
        except BaseException:
            handle.close()
            raise
        line.add_native_counter(lambda: device.interrupts)
        self._cmdline_devices.append(f"virtio_mmio.device=4K@{base:#x}:{irq}")
        return handle

    # -- running ----------------------------------------------------------------------------
    def start(self, paused: bool = False) -> None:
        """Start the vCPU threads; ``paused``: each parks before its first guest
        instruction, until ``resume`` (what is left to do when the guest may run is
        then a wake-up per vCPU, not a thread start)."""
        self.timings["started_at"] = time.monotonic()
        for vcpu in self.vcpus:
            vcpu.start(paused)

    def pause(self) -> None:
        for vcpu in self.vcpus:
            vcpu.pause()

    def resume(self) -> None:
        for vcpu in self.vcpus:
            vcpu.resume()

    @property
    def paused(self) -> bool:
        return all(v.state == VcpuRunState.PAUSED for v in self.vcpus)

    def _vcpu_exited(self, event: VcpuExitEvent) -> None:
        with self._exit_lock:
            if self._exit is not None:
                return
            self._exit = MachineExit(event.reason, event.detail, self.serial.tail_text())
            self._signal_exit_pipe()
            listeners = list(self._exit_listeners)
        for listener in listeners:
            listener(event.reason)
        log.info("vm %s: %s (%s)", self.vm_id, event.reason, event.detail)
        self._exited.set()
        # Stopping the other vCPUs must not happen on a vCPU thread that then
        # waits for itself; hand it to a helper thread.
        threading.Thread(target=self._stop_vcpus, name=f"stop-{self.vm_id}", daemon=True).start()

    def _stop_vcpus(self) -> None:
        for vcpu in self.vcpus:
            vcpu.stop()

    def on_exit(self, listener: Callable[[str], None]) -> None:
        """Call ``listener`` with the exit's reason once the machine has ended (now,
        if it has), on the thread that ended it."""
        with self._exit_lock:
            exit_ = self._exit
            if exit_ is None:
                self._exit_listeners.append(listener)
        if exit_ is not None:
            listener(exit_.reason)

    def exit_fd(self) -> int:
        """A file descriptor that becomes readable once the machine has ended (and
        stays readable), for a caller that waits on it beside others with ``poll``
        instead of waking to look. Owned by the machine, closed with it."""
        with self._exit_lock:
            if self._exit_pipe is None:
                self._exit_pipe = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                # First in the list, so closed last: after the vCPUs that may end it.
                self._closers.insert(0, self._close_exit_pipe)
                if self._exit is not None:
                    self._signal_exit_pipe()
            return self._exit_pipe[0]

    def _signal_exit_pipe(self) -> None:
        # Under _exit_lock, which _close_exit_pipe takes too: a write never reaches
        # a descriptor number that was closed and handed to another file.
        if self._exit_pipe is not None:
            try:
                os.write(self._exit_pipe[1], b"x")
            except BlockingIOError:
                pass  # full: readable already

    def _close_exit_pipe(self) -> None:
        with self._exit_lock:
            pipe, self._exit_pipe = self._exit_pipe, None
        if pipe is not None:
            os.close(pipe[0])
            os.close(pipe[1])

    def wait(self, timeout: float | None = None) -> MachineExit | None:
        """Wait for the machine to end; ``None`` if it is still running after ``timeout``."""
        if not self._exited.wait(timeout):
            return None
        for vcpu in self.vcpus:
            vcpu.join(5.0)
        return self._exit

    def stop(self) -> MachineExit:
        self._vcpu_exited(VcpuExitEvent(-1, "stopped", "stopped by the host"))
        self._stop_vcpus()
        exit_ = self._exit
        if exit_ is None:
            raise StateError("machine did not record an exit", vm_id=self.vm_id)
        return exit_

    @property
    def exit(self) -> MachineExit | None:
        return self._exit

    def exit_profile(self) -> dict[str, Any]:
        """VM exits by reason (all vCPUs) and the busiest I/O addresses, unmapped
        accesses and interrupts by line (``exit_profile_of``)."""
        by_reason: collections.Counter[str] = collections.Counter()
        by_address: collections.Counter[tuple[str, int]] = collections.Counter()
        for vcpu in self.vcpus:
            by_reason.update(vcpu.exits)
            by_address.update(vcpu.io_exits)
        return exit_profile_of(by_reason, by_address, *self.exit_counters())

    def exit_counters(self) -> tuple[tuple[int, int, int, int], list[tuple[int, int]]]:
        """The counters of ``exit_profile`` that are not the vCPU loops': unmapped
        (port reads, port writes, MMIO reads, MMIO writes) and (GSI, interrupts) per
        line. The native control server asks for them to answer ``exits``."""
        unmapped = (self.pio_bus.unmapped_reads, self.pio_bus.unmapped_writes,
                    self.mmio_bus.unmapped_reads, self.mmio_bus.unmapped_writes)
        return unmapped, [(line.gsi, line.count) for line in self._irq_lines]

        # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the vCPUs and release every resource. Idempotent."""
        vcpus = getattr(self, "vcpus", [])
        for vcpu in vcpus:
            vcpu.stop()
        loop: EventLoop | None = getattr(self, "loop", None)
        if self._closers and loop is not None and loop.running and not loop.in_loop_thread():
            # A barrier: work queued on the I/O thread before now (a restore queues each
            # device's activation, which raises interrupts) finishes before the closers
            # below take its irq eventfds away.
            try:
                run_on_loop(loop, lambda: None)
            except Exception:
                log.exception("vm %s: the I/O thread did not drain before close", self.vm_id)
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception:
                log.exception("vm %s: close step %r failed", self.vm_id, closer)

    def __enter__(self) -> Machine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TOP_IO = 10   # the busiest I/O addresses an exit profile lists (control_serve.rs)


def exit_profile_of(by_reason: Mapping[str, int], by_address: Mapping[tuple[str, int], int],
                    unmapped: tuple[int, int, int, int],
                    irqs: Iterable[tuple[int, int]]) -> dict[str, Any]:
    """An exit profile's dict (the ``exits`` op's ``profile``) from its counters, each
    listed by count, most first, ties by key, so that the native control server, which
    writes the same reply from the same counters (``control_serve.rs``), writes the
    same bytes."""
    def busiest(counts: Mapping[Any, int]) -> list[tuple[Any, int]]:
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))

    pio_reads, pio_writes, mmio_reads, mmio_writes = unmapped
    return {
        "by_reason": dict(busiest(by_reason)),
        "top_io": [{"bus": bus, "address": hex(addr), "count": n}
                   for (bus, addr), n in busiest(by_address)[:TOP_IO]],
        "unmapped": {"pio_reads": pio_reads, "pio_writes": pio_writes,
                     "mmio_reads": mmio_reads, "mmio_writes": mmio_writes},
        "irqs": dict(irqs),
    }


def console_log_path(run_dir: Path, vm_id: str) -> Path:
    return run_dir / f"{vm_id}.console.log"
