"""virtio-blk throughput: the native request path (native/src/blk.rs) against Python.

One guest (the default image, 256 MiB) boots with a free volume slot; a read-write ext4
volume is attached and mounted at ``/v``. Then, alternating the device's request path
between native and Python (``VirtioBlk.native_requests``, so both peers run in the same
guest on the same file in one run), the guest writes ``--mib`` MiB to ``/v/big`` with
``dd oflag=direct`` (O_DIRECT: every block goes to the device, none stays in the guest's
page cache) and reads it back with ``dd iflag=direct``, ``--reps`` times each. For every
run: MiB/s from the host's wall clock around the guest command, and the CPU time the
VMM process and its I/O thread (where the device serves requests) spent meanwhile.

Writes ``bench/results/blk.{json,md}``. On a host whose KVM cannot run unmodified
guests it re-runs itself inside the emulated test host (only ratios between the two
paths of one run mean anything there).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_kvm_host, summary, where, write_results

VOLUME_KEY = "b1c0ffee" * 4


def thread_cpu_s(native_id: int) -> float:
    """utime + stime of one thread of this process, in seconds."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB per dd run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block-kib", type=int, default=1024, help="dd block size")
    args = parser.parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=3072, timeout=3600)

    from vmfork.image import find_image
    from vmfork.runtime.guest import BootedGuest
    from vmfork.vmm.machine import VolumeMedia

    image = find_image()
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        volume = Path(tmp) / "volume.img"
        with open(volume, "wb") as f:
            f.truncate((args.mib + 64) << 20)
        subprocess.run([shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4", "-q", "-F", "-E",
                        "lazy_itable_init=0,lazy_journal_init=0", str(volume)],
                       check=True, capture_output=True)
        with BootedGuest(image, mem_mib=256, free_volume_slots=1) as guest:
            machine, agent = guest.machine, guest.agent
            assert machine is not None
            machine.attach_volume(VolumeMedia(0, str(volume), VOLUME_KEY, False, "/v"))
            agent.mount_volume(machine.volume_devices[0], "/v", read_only=False,
                               sectors=volume.stat().st_size // 512)
            device = machine.volume_slots[0]
            io_thread = next(t for t in threading.enumerate()
                             if t.name == f"vmm-io-{machine.vm_id}")
            assert io_thread.native_id is not None
            count = args.mib * 1024 // args.block_kib
            commands = {
                "write": f"dd if=/dev/zero of=/v/big bs={args.block_kib}k count={count} "
                         "oflag=direct conv=fsync",
                "read": f"dd if=/v/big of=/dev/null bs={args.block_kib}k count={count} "
                        "iflag=direct",
            }
            for rep in range(args.reps):
                for path in ("python", "native"):
                    device.native_requests = path == "native"
                    for direction in ("write", "read"):
                        cpu0, io0 = time.process_time(), thread_cpu_s(io_thread.native_id)
                        t0 = time.perf_counter()
                        done = agent.exec(commands[direction], timeout=1800)
                        wall = time.perf_counter() - t0
                        cpu = time.process_time() - cpu0
                        io = thread_cpu_s(io_thread.native_id) - io0
                        if done.exit_code != 0:
                            raise SystemExit(f"{direction} on the {path} path failed: "
                                             f"{done.stderr.decode(errors='replace')}")
                        runs.append({"rep": rep, "path": path, "direction": direction,
                                     "seconds": wall, "mib_s": args.mib / wall,
                                     "vmm_cpu_s": cpu, "io_thread_cpu_s": io})
                        print(f"rep {rep + 1}/{args.reps} {path:6} {direction:5}: "
                              f"{args.mib / wall:7.1f} MiB/s, VMM CPU {cpu:.2f} s, "
                              f"I/O thread {io:.2f} s", file=sys.stderr)
            counters = device.counters
    rows = {}
    for path in ("python", "native"):
        for direction in ("write", "read"):
            mine = [r for r in runs if r["path"] == path and r["direction"] == direction]
            rows[f"{path} {direction}"] = {
                key: summary([float(r[key]) for r in mine])  # type: ignore[arg-type]
                for key in ("mib_s", "vmm_cpu_s", "io_thread_cpu_s")}
    ratios = {direction: rows[f"native {direction}"]["mib_s"]["median"]
              / rows[f"python {direction}"]["mib_s"]["median"]
              for direction in ("write", "read")}
    io_cpu = {direction: rows[f"python {direction}"]["io_thread_cpu_s"]["median"]
              / max(rows[f"native {direction}"]["io_thread_cpu_s"]["median"], 1e-9)
              for direction in ("write", "read")}
    md = (f"# virtio-blk: native request path against Python\n\n{where()}; default image, "
          f"256 MiB guest, ext4 read-write volume, dd of {args.mib} MiB in "
          f"{args.block_kib} KiB blocks with O_DIRECT, {args.reps} runs per row, the two "
          "paths alternating in one guest.\n\n"
          "| path | direction | MiB/s (median) | min | max | VMM CPU s | I/O thread CPU s |\n"
          "|---|---|---|---|---|---|---|\n"
          + "".join(f"| {name.split()[0]} | {name.split()[1]} | {r['mib_s']['median']:.1f} | "
                    f"{r['mib_s']['min']:.1f} | {r['mib_s']['max']:.1f} | "
                    f"{r['vmm_cpu_s']['median']:.2f} | {r['io_thread_cpu_s']['median']:.2f} |\n"
                    for name, r in rows.items())
          + f"\nnative / Python throughput (median): write {ratios['write']:.2f}x, read "
            f"{ratios['read']:.2f}x; Python / native I/O-thread CPU: write "
            f"{io_cpu['write']:.2f}x, read {io_cpu['read']:.2f}x\n")
    write_results("blk", {"mib": args.mib, "block_kib": args.block_kib, "reps": args.reps,
                          "runs": runs, "rows": rows, "native_over_python": ratios,
                          "io_thread_cpu_python_over_native": io_cpu,
                          "device_counters": vars(counters)}, md)


if __name__ == "__main__":
    main()
