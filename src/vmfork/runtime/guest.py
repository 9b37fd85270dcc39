"""Boot a guest image in this process and wait until its agent answers.

``BootedGuest`` is the smallest useful unit above the VMM: a ``Machine`` running
an image, its per-VM runtime directory (vsock socket, console log), and an
``AgentClient`` connected through the vsock back end. It measures the boot as
it goes, from the timestamps the host sees:

* ``vmm_setup``    -- from ``BootedGuest`` construction to the first ``KVM_RUN``
* ``kernel_to_init`` -- first ``KVM_RUN`` to the agent's ``vmfork-agent: init``
  console line (the kernel's boot, as seen from the host)
* ``init_to_ready`` -- that line to the first successful ``ping`` over vsock

If the guest dies before it is ready (a kernel panic, a triple fault) or never
answers, ``GuestBootError`` carries the reason and the console tail.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vmfork.agent.client import AgentClient, AgentUnavailable, vsock_uds_connector
from vmfork.agent.protocol import AGENT_PORT
from vmfork.image import GuestImage
from vmfork.paths import run_dir
from vmfork.runtime.network import GuestNetwork
from vmfork.runtime.volumes import PreparedVolume
from vmfork.vmm.machine import Machine, MachineConfig, MachineExit, VolumeMedia

log = logging.getLogger(__name__)

INIT_MARKER = "vmfork-agent: init"
# Seconds a booting guest's agent has to answer. VMFORK_BOOT_READY_TIMEOUT raises it
# on a host too loaded for the default (an emulated test host shared with others
# boots the default image in ~10 s idle and past 120 s at a load of 10 on 2 cores).
READY_TIMEOUT = float(os.environ.get("VMFORK_BOOT_READY_TIMEOUT", "120"))


class GuestBootError(RuntimeError):
    def __init__(self, message: str, console_tail: str, exit: MachineExit | None = None) -> None:
        tail = "\n".join("    " + line for line in console_tail.splitlines()[-25:])
        super().__init__(f"{message}\n  last console lines:\n{tail}" if tail else message)
        self.console_tail = console_tail
        self.exit = exit


@dataclass
class BootTimings:
    vmm_setup: float = 0.0
    kernel_to_init: float | None = None
    init_to_ready: float | None = None
    total: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float | None]:
        return {"vmm_setup_s": self.vmm_setup, "kernel_to_init_s": self.kernel_to_init,
                "init_to_ready_s": self.init_to_ready, "total_s": self.total}


class BootedGuest:
    """A running guest with a ready agent. Use as a context manager."""

    def __init__(self, image: GuestImage, *, mem_mib: int = 256, vcpus: int = 1,
                 ready_timeout: float = READY_TIMEOUT, keep_run_dir: bool = False,
                 network: GuestNetwork | None = None, net_tap: str | None = None,
                 root_disk: str | None = None, root_disk_key: str | None = None,
                 volumes: tuple[PreparedVolume, ...] = (), free_volume_slots: int = 0,
                 before_start: Callable[[], None] | None = None,
                 balloon: bool | None = None) -> None:
        """``network``: give the guest a virtio-net device configured with it at boot;
        ``net_tap``: the tap (in this thread's network namespace) that cables it.
        ``root_disk``/``root_disk_key``: a read-only disk (virtio-blk) and its content
        key; by default the image's own root disk, if it has one. ``volumes``: disks in
        the first volume slots, mounted by the agent before the guest counts as ready;
        ``free_volume_slots``: empty slots after them, for volumes given at spawn.
        ``before_start``: called once the machine is set up, just before its first
        instruction runs (a jailed parent installs its seccomp filter there).
        ``balloon``: the free-page-reporting device (default: ``MachineConfig``'s, from
        ``$VMFORK_BALLOON``; a jailed process has a clean environment, so its caller
        decides and passes it)."""
        if root_disk is None and image.disk is not None:
            root_disk, root_disk_key = str(image.disk), image.disk_key
        self.created_at = time.monotonic()
        self.image = image
        self.keep_run_dir = keep_run_dir
        base = run_dir()
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir = Path(tempfile.mkdtemp(prefix="vm-", dir=base))
        self.vsock_uds = str(self.dir / "vsock.sock")
        self.console_log = str(self.dir / "console.log")
        self.timings = BootTimings()
        self._init_seen = threading.Event()
        self.machine: Machine | None = None
        try:
            cmdline = image.cmdline
            if network is not None:
                cmdline = f"{cmdline} {network.kernel_cmdline()}"
            config = MachineConfig(
                kernel=str(image.kernel), initrd=str(image.initrd), cmdline_extra=cmdline,
                mem_mib=mem_mib, vcpus=vcpus, console_log=self.console_log,
                vsock_uds=self.vsock_uds, vm_id=self.dir.name,
                guest_mac=network.mac if network is not None else None, net_tap=net_tap,
                root_disk=root_disk, root_disk_key=root_disk_key,
                volume_slots=len(volumes) + free_volume_slots,
                volumes=tuple(VolumeMedia(slot, v.path, v.key, v.read_only, v.guest_path)
                              for slot, v in enumerate(volumes)))
            if balloon is not None:
                config = dataclasses.replace(config, balloon=balloon)
            self.machine = Machine(config)
            self.machine.serial.line_listeners.append(self._on_console_line)
            self.agent = AgentClient(vsock_uds_connector(self.vsock_uds, AGENT_PORT, timeout=5.0))
            self.timings.vmm_setup = time.monotonic() - self.created_at
            if before_start is not None:
                before_start()
            self._started_at = time.monotonic()
            self.machine.start()
            self._wait_ready(ready_timeout)
            for slot, volume in enumerate(volumes):
                self.agent.mount_volume(self.machine.volume_devices[slot], volume.guest_path,
                                        read_only=volume.read_only,
                                        sectors=volume.size_bytes // 512)
        except BaseException:
            self.close()
            raise
        self.timings.total = time.monotonic() - self.created_at

    def _on_console_line(self, line: str) -> None:
        if INIT_MARKER in line and not self._init_seen.is_set():
            self.timings.marks["init"] = time.monotonic()
            self._init_seen.set()

    def _wait_ready(self, timeout: float) -> None:
        assert self.machine is not None
        deadline = time.monotonic() + timeout
        delay = 0.005
        last_error: Exception | None = None
        while True:
            exit_ = self.machine.exit
            if exit_ is not None:
                what = "the guest kernel panicked" if exit_.panicked else \
                    f"the guest stopped ({exit_.reason}: {exit_.detail})"
                raise GuestBootError(f"{what} before its agent was ready", exit_.console_tail,
                                     exit_)
            try:
                self.agent.ping()
                break
            except (AgentUnavailable, OSError) as err:
                last_error = err
            if time.monotonic() > deadline:
                raise GuestBootError(
                    f"the guest agent did not answer within {timeout:.0f} s "
                    f"(last error: {last_error}; a loaded host may need a longer "
                    f"VMFORK_BOOT_READY_TIMEOUT)", self.machine.serial.tail_text())
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        ready = time.monotonic()
        init = self.timings.marks.get("init")
        if init is not None:
            self.timings.kernel_to_init = init - self._started_at
            self.timings.init_to_ready = ready - init

    def console_tail(self) -> str:
        return self.machine.serial.tail_text() if self.machine else ""

    def close(self) -> None:
        if self.machine is not None:
            self.machine.close()
            self.machine = None
        if not self.keep_run_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> BootedGuest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
