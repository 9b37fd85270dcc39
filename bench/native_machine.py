"""A Linux guest's snapshot restored by the Python ``Machine`` and by the native assembly.

A parent (the guest image, 256 MiB, one vCPU, with rng, the balloon and vsock) is
booted and snapshot once; the snapshot is then restored ``--reps`` times by each path,
alternated restore by restore, each machine torn down (untimed) before the next:

* ``python``: ``Machine(MachineConfig(restore_state=..., memory_file=...))`` with the
  restore buffers built beforehand (as the zygote builds them once per snapshot): guest
  RAM, the VM core, the Python devices and transports, vsock (its listener bound), the
  vCPU loops;
* ``native``: ``_core.NativeMachine`` (native/src/machine.rs) from the same buffers and
  the machine's device plans (``plan.machine_plan``): guest RAM, the VM core, the
  console, rng, the balloon and vsock (its listener bound), the vCPUs.

Two times per restore: the restore alone (nothing started), and from the restore's
start to the guest agent's first answer (the machine started, a ``ping`` through the
vsock socket, retried every millisecond until it answers). Writes
``bench/results/native_machine.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_kvm_host, native_vs_python, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=4096)

    from test_native_machine import AGENT_GUARD_S, Snapshot, restore

    from vmfork.agent.client import AgentClient, vsock_uds_connector
    from vmfork.image import find_image
    from vmfork.runtime.guest import BootedGuest
    from vmfork.vmm import vmstate
    from vmfork.vmm.machine import Machine, MachineConfig

    work = Path(tempfile.mkdtemp(prefix="native-machine-"))
    memory = work / "memory"
    with BootedGuest(find_image(), mem_mib=256, vcpus=1, balloon=True) as parent:
        assert parent.machine is not None
        boot_id = parent.agent.ping().boot_id
        state, _ = parent.machine.snapshot(str(memory), resume=False)
    snap = Snapshot(state, memory, boot_id)
    prepared = vmstate.prepare_restore(state)

    def first_answer(uds: Path) -> None:
        ping = AgentClient(vsock_uds_connector(str(uds))).wait_until_ready(
            AGENT_GUARD_S, interval=0.001)
        assert ping.boot_id == boot_id

    restored: dict[str, list[float]] = {"python": [], "native": []}
    answered: dict[str, list[float]] = {"python": [], "native": []}
    for rep in range(args.reps):
        uds = work / f"python-{rep}.sock"
        started = time.perf_counter()
        python = Machine(MachineConfig(restore_state=state, restore_prepared=prepared,
                                       memory_file=str(memory), mem_mib=state.mem_size >> 20,
                                       vcpus=len(state.vcpus), vsock_uds=str(uds),
                                       console_log=str(work / "python.log")))
        restored["python"].append(time.perf_counter() - started)
        python.start()
        first_answer(uds)
        answered["python"].append(time.perf_counter() - started)
        python.close()
        uds = work / f"native-{rep}.sock"
        started = time.perf_counter()
        native = restore(snap, work / "native.log", uds, prepared)
        restored["native"].append(time.perf_counter() - started)
        native.start()
        first_answer(uds)
        answered["native"].append(time.perf_counter() - started)
        native.stop()

    restore_us, restore_ratio, restore_table = native_vs_python(restored, "restore, µs (median)")
    answer_us, answer_ratio, answer_table = native_vs_python(
        answered, "restore to the agent's first answer, µs (median)")
    markdown = ("# A Linux guest's snapshot restored: Python `Machine` vs native assembly\n\n"
                f"{args.reps} restores per path, alternated; 256 MiB, 1 vCPU.\n\n"
                + restore_table + "\n" + answer_table)
    write_results("native_machine", {
        "reps": args.reps, "us": restore_us, "ratio": restore_ratio,
        "first_answer_us": answer_us, "first_answer_ratio": answer_ratio}, markdown)


if __name__ == "__main__":
    main()
