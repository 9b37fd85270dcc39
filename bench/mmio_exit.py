"""Per-MMIO-exit cost of the virtio-mmio register file.

The tiny script guest (tests/kvm/tinyguest.py) writes the virtio-rng transport's
InterruptACK register ``--writes`` times (what a driver's interrupt handler does once
per interrupt), then ends the VM through the i8042. The native vCPU loop serves each
write from the register file (``_core.MmioRegisters``) on the vCPU thread without the
GIL. A run with no writes is subtracted, so the figure is the cost of one exit, guest
to guest. (The Python register file it was once compared with is deleted: design
notes, "The last Python twins".)

Writes ``bench/results/mmio_exit.{json,md}``. On a host whose KVM cannot run
unmodified guests it re-runs itself inside the emulated test host (only the ratio
means anything there).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_kvm_host, summary, where, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=20000, help="MMIO writes per run")
    parser.add_argument("--reps", type=int, default=5, help="runs")
    args = parser.parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=2048, timeout=1800)

    from tests.kvm.tinyguest import Script, script_machine
    from vmfork.vmm.devices.virtio import mmio
    from vmfork.vmm.x86.layout import VIRTIO_MMIO_BASE

    def run(writes: int) -> float:
        script = Script()
        for _ in range(writes):
            script.write32(VIRTIO_MMIO_BASE + mmio.REG_INTERRUPT_ACK, 0)
        machine, _ = script_machine(script, rng=True, mem_mib=64)
        with machine:
            windows = machine.mmio_bus.windows
            assert windows is not None and len(windows) > 0
            started = time.perf_counter()
            machine.start()
            exit_ = machine.wait(600)
            took = time.perf_counter() - started
            assert exit_ is not None and exit_.reason == "reset", exit_
        return took

    per_exit = []
    for _ in range(args.reps):
        base = run(0)
        full = run(args.writes)
        per_exit.append((full - base) / args.writes)

    us = summary([t * 1e6 for t in per_exit])
    md = (f"# MMIO exit: the register file\n\n{where()}; "
          f"{args.writes} InterruptACK writes per run, {args.reps} runs; a run without "
          "writes subtracted.\n\n| µs/exit (median) | min | max |\n|---|---|---|\n"
          f"| {us['median']:.1f} | {us['min']:.1f} | {us['max']:.1f} |\n")
    write_results("mmio_exit", {"writes": args.writes, "reps": args.reps, "us": us}, md)

if __name__ == "__main__":
    main()
