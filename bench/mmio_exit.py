"""Per-MMIO-exit cost: the native virtio-mmio register file against the Python one.

The tiny script guest (tests/kvm/tinyguest.py) writes the virtio-rng transport's
InterruptACK register ``--writes`` times (what a driver's interrupt handler does once
per interrupt), then ends the VM through the i8042. Both runs use the native vCPU
loop; only the register file differs: native (``_core.MmioRegisters``, served on the
vCPU thread without the GIL) or ``PyRegisters`` (each exit takes the GIL and goes
through ``Bus.write`` and ``MmioTransport.write``). A run with no writes is
subtracted, so the figure is the cost of one exit, guest to guest. Runs alternate.

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

from _common import ensure_kvm_host, native_vs_python, where, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=20000, help="MMIO writes per run")
    parser.add_argument("--reps", type=int, default=5, help="runs per register file")
    args = parser.parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=2048, timeout=1800)

    from tests.kvm.tinyguest import Script, script_machine
    from vmfork.vmm import vmstate
    from vmfork.vmm.devices.virtio import mmio
    from vmfork.vmm.x86.layout import VIRTIO_MMIO_BASE

    if not vmstate.NATIVE:
        sys.exit("bench/mmio_exit.py: the native core is not built (scripts/lib.sh "
                 "setup_native) or VMFORK_NATIVE=0")

    def run(native: bool, writes: int) -> float:
        mmio.NATIVE = native   # what a transport built without ``native=`` picks
        try:
            script = Script()
            for _ in range(writes):
                script.write32(VIRTIO_MMIO_BASE + mmio.REG_INTERRUPT_ACK, 0)
            machine, _ = script_machine(script, rng=True, mem_mib=64)
        finally:
            mmio.NATIVE = vmstate.NATIVE
        with machine:
            windows = machine.mmio_bus.windows
            assert windows is not None and (len(windows) > 0) == native
            started = time.perf_counter()
            machine.start()
            exit_ = machine.wait(600)
            took = time.perf_counter() - started
            assert exit_ is not None and exit_.reason == "reset", exit_
        return took

    per_exit: dict[str, list[float]] = {"native": [], "python": []}
    for rep in range(args.reps * 2):
        native = rep % 2 == 0
        base = run(native, 0)
        full = run(native, args.writes)
        per_exit["native" if native else "python"].append((full - base) / args.writes)

    us, ratio, table = native_vs_python(per_exit, "median µs/exit (register file)", 1)
    md = (f"# MMIO exit: native register file vs Python\n\n{where()}; "
          f"{args.writes} InterruptACK writes per run, {args.reps} runs per path, "
          "alternating; a run without writes subtracted.\n\n" + table)
    write_results("mmio_exit", {"writes": args.writes, "reps": args.reps, "us": us,
                                "python_over_native": ratio}, md)


if __name__ == "__main__":
    main()
