"""Can this host's KVM run an unmodified Linux guest?

Some KVMs answer every ioctl yet cannot: a paravirtual nested hypervisor (such
as ``kvm_pvm``) emulates guest kernel code instruction by instruction and
mishandles ``syscall`` from guest user mode. We find out in a throwaway VM
running a 280-byte guest (``probe_guest.S``) that

1. runs a kernel-mode loop of 2 M instructions between two markers written to
   port 0xE9 -- we time it on the host and derive instructions per second;
2. makes the identity map user-accessible, drops to CPL 3 with ``iretq`` and
   executes ``syscall``; the handler writes its own CPL (``cs & 3``) to port
   0xE9 -- 0 when ``syscall`` works. On a broken KVM the handler runs at CPL 3,
   its ``out`` faults, and with no IDT the VM triple-faults.

The result is cached for the process; ``native_kvm_runs_guests()`` is the one
place that decides whether tests must go through the emulated test host.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

PROBE_PORT = 0xE9
LOOP_INSTRUCTIONS = 2_000_000
# Hardware virtualisation runs this loop at hundreds of millions of instructions
# per second or more; an instruction emulator manages a few million.
MIN_KERNEL_MIPS = 50.0

PROBE_GUEST = bytes.fromhex(
    "b0aae6e9b940420f00ffc975fcb0bbe6e948830c25009000000448830c2500a000000448830c2500b00000"
    "040f20d80f22d848b8ffff000000f3cf00488904252006000048b8ffff000000fbaf004889042528060000"
    "488b0425000500004889042500060000488b0425080500004889042508060000488b04251005000048890425"
    "10060000488b042518050000488904251806000066c70425000700002f0048c7042502070000000600000f01"
    "142500070000b9800000c00f3283c8010f30b9810000c031c0ba080010000f30b9820000c0488d0530000000"
    "4889c248c1ea200f30b9840000c0b80002000031d20f306a2368000008006a026a2b488d0503000000504"
    "8cf0f050f0b668cc82403e6e9b0fee664f4ebfd"
)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    kernel_mips: float | None     # guest kernel-mode speed, millions of instructions/s
    syscall_works: bool
    detail: str


class _Recorder:
    def __init__(self) -> None:
        self.values: list[tuple[int, float]] = []

    def read(self, offset: int, size: int) -> bytes:
        return b"\xff" * size

    def write(self, offset: int, data: bytes) -> None:
        self.values.append((data[0], time.monotonic()))


def run_probe(timeout: float = 30.0) -> ProbeResult:
    from vmfork.vmm.machine import Machine, MachineConfig

    recorder = _Recorder()
    config = MachineConfig(payload=PROBE_GUEST, mem_mib=32, rng=False, memfd=False)
    with Machine(config) as machine:
        machine.pio_bus.register(PROBE_PORT, 1, recorder)
        machine.start()
        exit_ = machine.wait(timeout)
        if exit_ is None:
            machine.stop()
    marks = {value: at for value, at in recorder.values}
    mips = None
    if 0xAA in marks and 0xBB in marks:
        elapsed = max(marks[0xBB] - marks[0xAA], 1e-9)
        mips = LOOP_INSTRUCTIONS / elapsed / 1e6
    cpl = [value for value, _ in recorder.values if value not in (0xAA, 0xBB)]
    syscall_works = cpl == [0]
    fast = mips is not None and mips >= MIN_KERNEL_MIPS
    if exit_ is None:
        detail = f"the probe guest did not finish within {timeout} s"
    elif not syscall_works:
        detail = (f"syscall from user mode did not reach kernel mode "
                  f"(handler CPL {cpl or 'never ran'}; VM ended with {exit_.reason})")
    elif not fast:
        detail = f"guest kernel code runs at {mips or 0:.1f} M instructions/s (emulated)"
    else:
        detail = f"guest kernel code at {mips:.0f} M instructions/s; syscall works"
    return ProbeResult(ok=syscall_works and fast, kernel_mips=mips,
                       syscall_works=syscall_works, detail=detail)


@functools.lru_cache(maxsize=1)
def native_kvm_runs_guests() -> bool:
    """True when this host's own ``/dev/kvm`` can run an unmodified Linux guest."""
    if not os.path.exists("/dev/kvm"):
        return False
    try:
        return run_probe().ok
    except Exception:  # noqa: BLE001 - any failure of the probe VM means "cannot"
        return False
