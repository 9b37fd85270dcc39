"""What empty volume slots cost: boot, snapshot state and restore, by slot count.

For each count of empty slots (default 0, 4 and 24) the default image is booted with
that many, snapshotted (``state.bin`` size), and restored in this process a few times
(``Machine`` construction, the restore's share of a spawn). With the most slots the
last slot -- one whose IOAPIC pin is shared with another slot once the 24 pins run
out -- is given a disk after the restore and the guest agent mounts it and reads a
file from it, so the figures are of slots that work.

Writes ``bench/results/volume_slots.{json,md}``. On a host whose KVM cannot run
unmodified guests it re-runs itself inside the emulated test host (only ratios between
rows mean anything there).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_kvm_host, summary, where, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[0, 4, 24])
    parser.add_argument("--restores", type=int, default=5)
    args = parser.parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=3072, timeout=3600)

    from vmfork.agent.client import AgentClient, vsock_uds_connector
    from vmfork.agent.protocol import AGENT_PORT
    from vmfork.image import find_image
    from vmfork.image.builder import make_disk
    from vmfork.ondisk.stateformat import write_state_file
    from vmfork.runtime.guest import BootedGuest
    from vmfork.vmm.machine import Machine, MachineConfig, VolumeMedia

    image = find_image()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        payload = os.urandom(1 << 20)
        (tree / "payload.bin").write_bytes(payload)
        disk = Path(tmp) / "volume.img"
        make_disk(tree, disk, "erofs")
        key = hashlib.sha256(disk.read_bytes()).hexdigest()[:32]
        for slots in args.slots:
            memory = Path(tmp) / f"memory-{slots}.bin"
            with BootedGuest(image, mem_mib=256, free_volume_slots=slots) as guest:
                assert guest.machine is not None
                boot = guest.timings
                state, _ = guest.machine.snapshot(str(memory), resume=False)
            state_bytes = write_state_file(str(Path(tmp) / f"state-{slots}.bin"), state)
            setups = []
            mounted = None
            for rep in range(args.restores):
                run = Path(tempfile.mkdtemp(dir=tmp))
                started = time.perf_counter()
                machine = Machine(MachineConfig(
                    restore_state=state, memory_file=str(memory), mem_mib=256,
                    vcpus=len(state.vcpus), vsock_uds=str(run / "vsock.sock"),
                    guest_cid=state.guest_cid, memfd=False))
                setups.append(time.perf_counter() - started)
                with machine:
                    if rep == 0 and slots:
                        machine.start()
                        agent = AgentClient(vsock_uds_connector(str(run / "vsock.sock"),
                                                                AGENT_PORT, timeout=20))
                        agent.wait_until_ready(120)
                        last = slots - 1
                        machine.attach_volume(VolumeMedia(last, str(disk), key, True, "/v"))
                        agent.mount_volume(machine.volume_devices[last], "/v", read_only=True,
                                           sectors=disk.stat().st_size // 512)
                        done = agent.exec(["sha256sum", "/v/payload.bin"])
                        mounted = done.stdout.split()[0].decode() == \
                            hashlib.sha256(payload).hexdigest()
            rows.append({"slots": slots, "boot_total_s": boot.total,
                         "kernel_to_init_s": boot.kernel_to_init,
                         "state_bytes": state_bytes,
                         "restore_setup_ms": summary([s * 1000 for s in setups]),
                         "cmdline_bytes": len(state.cmdline),
                         "last_slot_mounted_and_read": mounted})
    md = (f"# Empty volume slots: what they cost\n\n{where()}; default image, 256 MiB, "
          f"{args.restores} in-process restores per row.\n\n"
          "| empty slots | boot to ready s | kernel to init s | state.bin bytes | "
          "restore set-up ms (median) | kernel command line bytes | last slot works |\n"
          "|---|---|---|---|---|---|---|\n"
          + "".join(f"| {r['slots']} | {r['boot_total_s']:.2f} | "
                    f"{r['kernel_to_init_s'] or 0:.2f} | {r['state_bytes']} | "
                    f"{r['restore_setup_ms']['median']:.1f} | {r['cmdline_bytes']} | "
                    f"{r['last_slot_mounted_and_read']} |\n" for r in rows))
    write_results("volume_slots", {"rows": rows}, md)


if __name__ == "__main__":
    main()
