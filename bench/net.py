"""virtio-net throughput: the native frame paths (native/src/net.rs) against Python.

One guest (the default image, 256 MiB) boots with a virtio-net device on a tap in a
network namespace of this process's own (the tap at 10.123.0.1/30, the guest at
10.123.0.2). Then, alternating the device's frame paths between native and Python
(``VirtioNet.native_frames``, so both peers run in the same guest on the same tap in
one run), the guest sends ``--mib`` MiB over one TCP connection to a socket of this
process (guest -> host: the device's tx path) and receives as much from it (host ->
guest: the rx path), ``--reps`` times each. For every run: MiB/s from this process's
clock (accept to end of stream, so the guest command's start-up is not in it), and the
CPU time the VMM's I/O thread (where the device moves frames) and the whole process
(the host-side peer included) spent meanwhile.

Writes ``bench/results/net.{json,md}``. On a host whose KVM cannot run unmodified
guests it re-runs itself inside the emulated test host (only ratios between the two
paths of one run mean anything there).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_kvm_host, summary, where, write_results

TAP = "vmfbench0"
HOST_IP, GUEST_IP = "10.123.0.1", "10.123.0.2"
PORT = 5201
CHUNK = 1 << 16
CLONE_NEWNET = 0x40000000

# What the guest runs (in the agent's interpreter), per direction.
GUEST_SEND = """
import socket
_s = socket.create_connection(({host!r}, {port}))
_b = b"x" * {chunk}
for _ in range({count}):
    _s.sendall(_b)
_s.close()
"""
GUEST_RECEIVE = """
import socket
_s = socket.create_connection(({host!r}, {port}))
_n = 0
while True:
    _d = _s.recv(1 << 18)
    if not _d:
        break
    _n += len(_d)
_s.close()
_n
"""


def thread_cpu_s(native_id: int) -> float:
    """utime + stime of one thread of this process, in seconds."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_network() -> None:
    """This process in a network namespace of its own, with the tap in it (before any
    thread exists, so the VMM's threads are in it too)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise SystemExit(f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())} "
                         "(the benchmark needs root)")
    for cmd in (["ip", "link", "set", "lo", "up"],
                ["ip", "tuntap", "add", "dev", TAP, "mode", "tap", "vnet_hdr"],
                ["ip", "addr", "add", f"{HOST_IP}/30", "dev", TAP],
                ["ip", "link", "set", TAP, "up"]):
        subprocess.run(cmd, check=True, capture_output=True)


class HostPeer:
    """The host's end of one run: accepts the guest's connection on ``listener`` and
    either reads ``size`` bytes to the end of the stream or sends them and waits for
    the guest to close; the seconds from accept to the end."""

    def __init__(self, listener: socket.socket, direction: str, size: int) -> None:
        self.listener, self.direction, self.size = listener, direction, size
        self.seconds = 0.0
        self.moved = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="bench-peer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                t0 = time.perf_counter()
                if self.direction == "guest->host":
                    while data := conn.recv(1 << 18):
                        self.moved += len(data)
                else:
                    block = b"y" * CHUNK
                    for _ in range(self.size // CHUNK):
                        conn.sendall(block)
                        self.moved += CHUNK
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(1 << 16):
                        pass
                self.seconds = time.perf_counter() - t0
        except BaseException as err:  # noqa: BLE001 -- reported by the main thread
            self.error = err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB per run and direction")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=3072, timeout=3600)
    own_network()

    from vmfork.image import find_image
    from vmfork.runtime.guest import BootedGuest
    from vmfork.runtime.network import GuestNetwork

    image = find_image()
    size = args.mib << 20
    count = size // CHUNK
    runs: list[dict[str, object]] = []
    network = GuestNetwork(address=GUEST_IP, gateway=HOST_IP, prefix_len=30)
    with socket.create_server((HOST_IP, PORT)) as listener, \
            BootedGuest(image, mem_mib=256, network=network, net_tap=TAP) as guest:
        machine, agent = guest.machine, guest.agent
        assert machine is not None and machine.net is not None
        device = machine.net
        io_thread = next(t for t in threading.enumerate()
                         if t.name == f"vmm-io-{machine.vm_id}")
        assert io_thread.native_id is not None
        code = {"guest->host": GUEST_SEND.format(host=HOST_IP, port=PORT, chunk=CHUNK,
                                                 count=count),
                "host->guest": GUEST_RECEIVE.format(host=HOST_IP, port=PORT)}
        for rep in range(args.reps):
            for path in ("python", "native"):
                device.native_frames = path == "native"
                for direction in ("guest->host", "host->guest"):
                    peer = HostPeer(listener, direction, size)
                    cpu0, io0 = time.process_time(), thread_cpu_s(io_thread.native_id)
                    done = agent.eval(code[direction], timeout=1800)
                    peer.thread.join(60)
                    cpu = time.process_time() - cpu0
                    io = thread_cpu_s(io_thread.native_id) - io0
                    if not done.ok or peer.error is not None or peer.thread.is_alive():
                        raise SystemExit(f"{direction} on the {path} path failed: "
                                         f"{done.exception} {peer.error}")
                    if peer.moved != size or (direction == "host->guest"
                                              and done.value != str(size)):
                        raise SystemExit(f"{direction} on the {path} path moved "
                                         f"{peer.moved} bytes (guest: {done.value})")
                    mib_s = args.mib / peer.seconds
                    runs.append({"rep": rep, "path": path, "direction": direction,
                                 "seconds": peer.seconds, "mib_s": mib_s,
                                 "vmm_cpu_s": cpu, "io_thread_cpu_s": io})
                    print(f"rep {rep + 1}/{args.reps} {path:6} {direction}: "
                          f"{mib_s:7.1f} MiB/s, process CPU {cpu:.2f} s, "
                          f"I/O thread {io:.2f} s", file=sys.stderr)
        counters = vars(device.counters)
    directions = ("guest->host", "host->guest")
    rows = {}
    for path in ("python", "native"):
        for direction in directions:
            mine = [r for r in runs if r["path"] == path and r["direction"] == direction]
            rows[f"{path} {direction}"] = {
                key: summary([float(r[key]) for r in mine])  # type: ignore[arg-type]
                for key in ("mib_s", "vmm_cpu_s", "io_thread_cpu_s")}
    ratios = {d: rows[f"native {d}"]["mib_s"]["median"] / rows[f"python {d}"]["mib_s"]["median"]
              for d in directions}
    io_cpu = {d: rows[f"python {d}"]["io_thread_cpu_s"]["median"]
              / max(rows[f"native {d}"]["io_thread_cpu_s"]["median"], 1e-9)
              for d in directions}
    md = (f"# virtio-net: native frame paths against Python\n\n{where()}; default image, "
          f"256 MiB guest, one TCP stream of {args.mib} MiB each way between the guest "
          f"and this process over a tap, {args.reps} runs per row, the two paths "
          "alternating in one guest.\n\n"
          "| path | direction | MiB/s (median) | min | max | process CPU s | "
          "I/O thread CPU s |\n|---|---|---|---|---|---|---|\n"
          + "".join(f"| {name.split()[0]} | {name.split()[1]} | {r['mib_s']['median']:.1f} | "
                    f"{r['mib_s']['min']:.1f} | {r['mib_s']['max']:.1f} | "
                    f"{r['vmm_cpu_s']['median']:.2f} | {r['io_thread_cpu_s']['median']:.2f} |\n"
                    for name, r in rows.items())
          + "\nnative / Python throughput (median): "
          + ", ".join(f"{d} {ratios[d]:.2f}x" for d in directions)
          + "; Python / native I/O-thread CPU: "
          + ", ".join(f"{d} {io_cpu[d]:.2f}x" for d in directions) + "\n")
    write_results("net", {"mib": args.mib, "reps": args.reps, "runs": runs, "rows": rows,
                          "native_over_python": ratios,
                          "io_thread_cpu_python_over_native": io_cpu,
                          "device_counters": counters}, md)


if __name__ == "__main__":
    main()
