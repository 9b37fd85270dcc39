"""Restore-ioctl benchmark: the native core's restore against the Python one.

A tiny guest (a 2-byte loop, 1 or more vCPUs) runs briefly and is snapshotted;
then, alternating between the two paths, each repetition makes a fresh VM the
way ``Machine`` does (irqchip, PIT, vCPUs) and times only
``vmstate.apply_restore``: every SET ioctl of the VM and vCPU state, from buffers
prepared once (``prepare_restore``), as a forked child issues them. Native is
``vmfork._core.restore`` (one call, GIL released); Python is
``vmstate.apply_vm``/``apply_vcpu`` over ctypes.

Writes ``bench/results/restore.{json,md}``. On a host whose KVM cannot run
unmodified guests it re-runs itself inside the emulated test host (only the
ratio means anything there).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_kvm_host, native_vs_python, where, write_results

LOOP = b"\xeb\xfe"   # jmp .


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300, help="restores per path")
    parser.add_argument("--vcpus", type=int, default=1)
    args = parser.parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=2048, timeout=1800)

    from vmfork.kvm import api
    from vmfork.vmm import vmstate
    from vmfork.vmm.machine import Machine, MachineConfig
    from vmfork.vmm.x86 import layout as L

    if not vmstate.NATIVE:
        sys.exit("bench/restore.py: the native core is not built (scripts/lib.sh setup_native)")
    config = MachineConfig(payload=LOOP, mem_mib=32, vcpus=args.vcpus, rng=False, memfd=True)
    with tempfile.TemporaryDirectory() as tmp, Machine(config) as parent:
        parent.start()
        time.sleep(0.2)
        state, _ = parent.snapshot(os.path.join(tmp, "memory.bin"), resume=False)
        parent.stop()
    prepared = {"native": vmstate.prepare_restore(state, native=True),
                "python": vmstate.prepare_restore(state, native=False)}

    kvm = api.open_kvm()
    times: dict[str, list[float]] = {"native": [], "python": []}
    for rep in range(args.reps * 2):
        path = "native" if rep % 2 == 0 else "python"
        vm = api.create_vm(kvm)
        fds = [vm]
        try:
            api.set_tss_addr(vm, L.TSS_ADDR)
            api.create_irqchip(vm)
            api.create_pit2(vm)
            vcpus = [api.create_vcpu(vm, v.index) for v in state.vcpus]
            fds.extend(vcpus)
            started = time.perf_counter()
            vmstate.apply_restore(kvm, vm, vcpus, prepared[path])
            times[path].append(time.perf_counter() - started)
        finally:
            for fd in reversed(fds):
                os.close(fd)
    os.close(kvm)

    us, ratio, table = native_vs_python(times, "median µs")
    md = (f"# Restore ioctls: native core vs Python\n\n{where()}; {args.vcpus} vCPU(s), "
          f"{args.reps} restores per path, alternating.\n\n" + table)
    write_results("restore", {"vcpus": args.vcpus, "reps": args.reps, "us": us,
                              "python_over_native": ratio}, md)


if __name__ == "__main__":
    main()
