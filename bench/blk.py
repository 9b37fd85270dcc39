"""virtio-blk throughput through its one request path (native/src/blk.rs).

One guest (the default image, 256 MiB) boots with a free volume slot; a read-write ext4
volume is attached (``Machine.attach_volume``: the native transport's
``insert_media``) and mounted at ``/v``. The guest writes ``--mib`` MiB to ``/v/big``
with ``dd oflag=direct`` (O_DIRECT: every block goes to the device, none stays in the
guest's page cache) and reads it back with ``dd iflag=direct``, ``--reps`` times each,
served by the device's native transport on the loop's ioeventfd without the GIL. The
per-notification peer that earlier runs compared it with (one call into ``blk.rs``
entered from Python) went with ``VirtioBlk`` (one implementation per device, issue
19); its figures are in docs/design-notes.md. For every run: MiB/s from the host's
wall clock around the guest command, and the CPU time the VMM process and its I/O
thread (where the device serves requests) spent meanwhile.

Writes ``bench/results/blk.{json,md}``. On a host whose KVM cannot run unmodified
guests it re-runs itself inside the emulated test host (only ratios between the two
paths of one run mean anything there).

``--driver`` measures the request path alone instead, without a guest
(``bench/results/blk-driver.{json,md}``): a queue on real guest memory is filled with
requests laid out as Linux lays them out (a header, the data in
``--segment-kib`` segments, a status byte; ``--request-kib`` per request, 64 per
notification) and served by one call into the request path (``GuestRam.serve_blk``) over a ``--mib``
MiB file in the page cache: MiB/s and CPU time of the serving call alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_kvm_host, summary, where, write_results

VOLUME_KEY = "b1c0ffee" * 4


def io_thread_id(name: str) -> int:
    """The native id of this process's thread ``name`` (the native loop's thread is not
    a ``threading.Thread``; the kernel keeps 15 characters of a thread's name)."""
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() == name[:15]:
            return int(task.name)
    raise SystemExit(f"no thread named {name!r} in this process")


def thread_cpu_s(native_id: int) -> float:
    """utime + stime of one thread of this process, in seconds."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB per dd run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block-kib", type=int, default=1024, help="dd block size")
    parser.add_argument("--driver", action="store_true",
                        help="serve requests from a simulated driver, no guest")
    parser.add_argument("--request-kib", type=int, default=1024)
    parser.add_argument("--segment-kib", type=int, default=64)
    args = parser.parse_args()
    if args.driver:
        driver_bench(args)
        return
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
            device = machine.volumes[0].device
            io_thread = io_thread_id(f"vmm-io-{machine.vm_id}")
            count = args.mib * 1024 // args.block_kib
            commands = {
                "write": f"dd if=/dev/zero of=/v/big bs={args.block_kib}k count={count} "
                         "oflag=direct conv=fsync",
                "read": f"dd if=/v/big of=/dev/null bs={args.block_kib}k count={count} "
                        "iflag=direct",
            }
            for rep in range(args.reps):
                for direction in ("write", "read"):
                    cpu0, io0 = time.process_time(), thread_cpu_s(io_thread)
                    t0 = time.perf_counter()
                    done = agent.exec(commands[direction], timeout=1800)
                    wall = time.perf_counter() - t0
                    cpu = time.process_time() - cpu0
                    io = thread_cpu_s(io_thread) - io0
                    if done.exit_code != 0:
                        raise SystemExit(f"{direction} failed: "
                                         f"{done.stderr.decode(errors='replace')}")
                    runs.append({"rep": rep, "direction": direction, "seconds": wall,
                                 "mib_s": args.mib / wall, "vmm_cpu_s": cpu,
                                 "io_thread_cpu_s": io})
                    print(f"rep {rep + 1}/{args.reps} {direction:5}: "
                          f"{args.mib / wall:7.1f} MiB/s, VMM CPU {cpu:.2f} s, "
                          f"I/O thread {io:.2f} s", file=sys.stderr)
            counters = dict(device.blk_counters())
    rows = {}
    for direction in ("write", "read"):
        mine = [r for r in runs if r["direction"] == direction]
        rows[direction] = {key: summary([float(r[key]) for r in mine])  # type: ignore[arg-type]
                           for key in ("mib_s", "vmm_cpu_s", "io_thread_cpu_s")}
    md = (f"# virtio-blk: a read-write volume served on the loop\n\n{where()}; "
          f"default image, 256 MiB guest, ext4 read-write volume, dd of {args.mib} MiB in "
          f"{args.block_kib} KiB blocks with O_DIRECT, {args.reps} runs per row.\n\n"
          "| direction | MiB/s (median) | min | max | VMM CPU s | I/O thread CPU s |\n"
          "|---|---|---|---|---|---|\n"
          + "".join(f"| {name} | {r['mib_s']['median']:.1f} | "
                    f"{r['mib_s']['min']:.1f} | {r['mib_s']['max']:.1f} | "
                    f"{r['vmm_cpu_s']['median']:.2f} | {r['io_thread_cpu_s']['median']:.2f} |\n"
                    for name, r in rows.items()))
    write_results("blk", {"mib": args.mib, "block_kib": args.block_kib, "reps": args.reps,
                          "runs": runs, "rows": rows, "device_counters": counters}, md)


def driver_bench(args: argparse.Namespace) -> None:
    import struct

    from vmfork.vmm.devices.virtio import blk
    from vmfork.vmm.devices.virtio.queue import (
        VIRTQ_DESC_F_NEXT,
        VIRTQ_DESC_F_WRITE,
        Virtqueue,
        avail_ring_bytes,
    )
    from vmfork.vmm.memory import GuestMemory

    request, segment = args.request_kib << 10, args.segment_kib << 10
    nseg = request // segment
    per_notify = min(blk.MAX_REQUESTS_PER_NOTIFY, 256 // (nseg + 2))
    memory = GuestMemory.anonymous(per_notify * request + (16 << 20))
    if memory.native is None:
        raise SystemExit("the native core is not built (scripts/lib.sh setup_native)")
    desc, avail, used = 0x10000, 0x20000, 0x30000
    data = 1 << 20
    queue = Virtqueue(256)
    queue.size, queue.desc_table, queue.avail_ring, queue.used_ring = 256, desc, avail, used
    queue.ready = True
    queue.validate(memory)
    assert avail + avail_ring_bytes(256) < used
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        path = Path(tmp) / "disk.img"
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        fd, size = blk.open_disk(str(path), writable=True, what="bench disk")
        disk_id = VOLUME_KEY[:blk.ID_BYTES].encode()
        sectors = size // 512
        native = memory.native

        def offer(kind: int, first_sector: int) -> None:
            """``per_notify`` requests of ``request`` bytes from ``first_sector`` on."""
            index = 0
            for k in range(per_notify):
                head = index
                hdr_at = data + k * 64
                memory.write(hdr_at, struct.pack("<IIQ", kind, 0,
                                                 (first_sector + k * request // 512) % sectors))
                parts = [(hdr_at, 16, 0)]
                buf = data + (1 << 20) + k * request
                flag = VIRTQ_DESC_F_WRITE if kind == blk.T_IN else 0
                parts += [(buf + j * segment, segment, flag) for j in range(nseg)]
                parts.append((hdr_at + 32, 1, VIRTQ_DESC_F_WRITE))
                for j, (addr, length, flags) in enumerate(parts):
                    last = j == len(parts) - 1
                    memory.write(desc + 16 * index, struct.pack(
                        "<QIHH", addr, length, flags | (0 if last else VIRTQ_DESC_F_NEXT),
                        0 if last else index + 1))
                    index += 1
                memory.write_u16(avail + 4 + 2 * ((queue.next_avail + k) % 256), head)
            memory.write_u16(avail + 2, (queue.next_avail + per_notify) & 0xFFFF)

        total = args.mib << 20
        for rep in range(args.reps):
            for kind_name, kind in (("write", blk.T_OUT), ("read", blk.T_IN)):
                moved, errors = 0, 0
                done, busy, cpu, sector = 0, 0.0, 0.0, 0
                while done < total:
                    offer(kind, sector)
                    t0, c0 = time.perf_counter(), time.process_time()
                    (queue.next_avail, queue.next_used, served, _bytes, _more, counted, _, error
                     ) = native.serve_blk(
                        256, desc, avail, used, queue.next_avail, queue.next_used, fd, size,
                        False, disk_id, blk.MAX_REQUESTS_PER_NOTIFY, blk.MAX_BYTES_PER_NOTIFY)
                    busy += time.perf_counter() - t0
                    cpu += time.process_time() - c0
                    assert error is None and served == per_notify, (error, served)
                    counts = dict(counted)
                    moved += counts["bytes_read"] + counts["bytes_written"]
                    errors += counts["read_errors"] + counts["write_errors"]
                    done += per_notify * request
                    sector += per_notify * request // 512
                assert moved == done and errors == 0, (moved, errors)
                runs.append({"rep": rep, "direction": kind_name,
                             "mib_s": (done >> 20) / busy, "cpu_s": cpu})
                print(f"rep {rep + 1}/{args.reps} {kind_name:5}: "
                      f"{(done >> 20) / busy:8.0f} MiB/s, CPU {cpu:.3f} s", file=sys.stderr)
        os.close(fd)
    memory.close()
    rows = {d: {"mib_s": summary([float(r["mib_s"]) for r in runs  # type: ignore[arg-type]
                                  if r["direction"] == d]),
                "cpu_s": summary([float(r["cpu_s"]) for r in runs  # type: ignore[arg-type]
                                  if r["direction"] == d])}
            for d in ("write", "read")}
    md = (f"# virtio-blk request path, no guest\n\n"
          f"native, on {os.uname().nodename}; {args.mib} MiB moved per row and run, "
          f"{args.request_kib} KiB requests in {args.segment_kib} KiB segments, {per_notify} "
          f"per notification, a file in the page cache, {args.reps} runs, reads and "
          "writes alternating.\n\n| direction | MiB/s (median) | min | max | CPU s (median) |\n"
          "|---|---|---|---|---|\n"
          + "".join(f"| {n} | {r['mib_s']['median']:.0f} | "
                    f"{r['mib_s']['min']:.0f} | {r['mib_s']['max']:.0f} | "
                    f"{r['cpu_s']['median']:.3f} |\n" for n, r in rows.items()))
    write_results("blk-driver", {"mib": args.mib, "request_kib": args.request_kib,
                                 "segment_kib": args.segment_kib, "per_notify": per_notify,
                                 "runs": runs, "rows": rows}, md)


if __name__ == "__main__":
    main()
