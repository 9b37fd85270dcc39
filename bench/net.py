"""virtio-net throughput: the device as every machine serves it (its native transport,
native/src/transport.rs, native/src/net_serve.rs on the native loop, its one frame path
native/src/net.rs).

One guest (the default image, 256 MiB) boots with a virtio-net device on a tap in a
network namespace of this process's own (the tap at 10.123.0.1/30, the guest at
10.123.0.2). The guest sends ``--mib`` MiB over one TCP connection to a socket of this
process (guest -> host: the device's tx path) and receives as much from it (host ->
guest: the rx path), ``--reps`` times each, the directions alternating. For every run:
MiB/s from this process's clock (accept to end of stream, so the guest command's
start-up is not in it), and the CPU time the VMM's I/O thread (where the device moves
frames; found by its name in ``/proc/self/task``, as the native loop's thread is not a
Python one) and the whole process (the host-side peer included) spent meanwhile, also
per MiB.

Writes ``bench/results/net.{json,md}``. On a host whose KVM cannot run unmodified
guests it re-runs itself inside the emulated test host (only ratios between runs of one
host mean anything there). The Python frame paths and the Python wake these were
measured against are gone (one implementation per device, issue 19); their
before/after figures are in docs/design-notes.md.

``--driver`` measures the device alone instead, natively and without a guest
(``bench/results/net-driver.{json,md}``): one ``_core.NativeDevice`` on real guest
memory, its tap an AF_UNIX datagram socket pair (a frame per datagram, as on a tap),
128 chains per turn laid out as Linux lays them out (tx: the vnet header and the frame
apart; rx: the header and ``--frame-bytes`` of room), each turn one QueueNotify write
served on the writing thread (as a transport without ioeventfds serves it) timed alone
(the peer's sends and reads are not), frames/s and MiB/s.
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


def thread_named(name: str) -> int:
    """The id of this process's one thread called ``name`` (as the kernel keeps it: at
    most 15 bytes), Python's or native."""
    found = [int(task.name) for task in Path("/proc/self/task").iterdir()
             if (task / "comm").read_text().rstrip("\n") == name[:15]]
    if len(found) != 1:
        raise SystemExit(f"{len(found)} threads named {name[:15]!r}")
    return found[0]


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
    parser.add_argument("--driver", action="store_true",
                        help="move frames from a simulated driver, no guest")
    parser.add_argument("--frame-bytes", type=int, default=1514,
                        help="--driver: Ethernet frame size (a GSO frame: up to 65550)")
    parser.add_argument("--turns", type=int, default=400, help="--driver: turns per run")
    args = parser.parse_args()
    if args.driver:
        driver_bench(args)
        return
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=3072, timeout=3600)
    own_network()

    from vmfork.image import find_image
    from vmfork.runtime.guest import BootedGuest
    from vmfork.runtime.network import GuestNetwork
    from vmfork.vmm.devices.virtio.net import F_EVENT_IDX, NetCounters

    image = find_image()
    size = args.mib << 20
    count = size // CHUNK
    runs: list[dict[str, object]] = []
    network = GuestNetwork(address=GUEST_IP, gateway=HOST_IP, prefix_len=30)
    directions = ("guest->host", "host->guest")
    with socket.create_server((HOST_IP, PORT)) as listener, \
            BootedGuest(image, mem_mib=256, network=network, net_tap=TAP) as guest:
        machine, agent = guest.machine, guest.agent
        assert machine is not None and machine.net is not None
        device = machine.net.device

        def counted() -> NetCounters:
            return NetCounters(**dict(device.net_counters()))

        io_thread = thread_named(machine.loop.name)
        code = {"guest->host": GUEST_SEND.format(host=HOST_IP, port=PORT, chunk=CHUNK,
                                                 count=count),
                "host->guest": GUEST_RECEIVE.format(host=HOST_IP, port=PORT)}
        for rep in range(args.reps):
            for direction in directions:
                peer = HostPeer(listener, direction, size)
                frames0, irqs0 = counted(), device.interrupts
                cpu0, io0 = time.process_time(), thread_cpu_s(io_thread)
                done = agent.eval(code[direction], timeout=1800)
                peer.thread.join(60)
                cpu = time.process_time() - cpu0
                io = thread_cpu_s(io_thread) - io0
                frames1 = counted()
                frames = (frames1.tx_frames - frames0.tx_frames, frames1.rx_frames
                          - frames0.rx_frames)
                irqs = device.interrupts - irqs0
                if not done.ok or peer.error is not None or peer.thread.is_alive():
                    raise SystemExit(f"{direction} failed: {done.exception} {peer.error}")
                if peer.moved != size or (direction == "host->guest"
                                          and done.value != str(size)):
                    raise SystemExit(f"{direction} moved {peer.moved} bytes "
                                     f"(guest: {done.value})")
                mib_s = args.mib / peer.seconds
                runs.append({"rep": rep, "direction": direction, "seconds": peer.seconds,
                             "mib_s": mib_s, "vmm_cpu_s": cpu, "io_thread_cpu_s": io,
                             "tx_frames": frames[0], "rx_frames": frames[1],
                             "interrupts": irqs})
                print(f"rep {rep + 1}/{args.reps} {direction}: {mib_s:7.1f} MiB/s, "
                      f"process CPU {cpu:.2f} s, I/O thread {io:.2f} s, frames tx "
                      f"{frames[0]} rx {frames[1]}, interrupts {irqs}", file=sys.stderr)
        counters = vars(counted())
        event_idx = bool(device.acked_features & F_EVENT_IDX)
    rows = {}
    for direction in directions:
        mine = [r for r in runs if r["direction"] == direction]
        rows[direction] = {
            key: summary([float(r[key]) for r in mine])  # type: ignore[arg-type]
            for key in ("mib_s", "vmm_cpu_s", "io_thread_cpu_s", "tx_frames", "rx_frames",
                        "interrupts")}
    md = (f"# virtio-net\n\n{where()}; default image, "
          f"256 MiB guest, one TCP stream of {args.mib} MiB each way between the guest "
          f"and this process over a tap, {args.reps} runs per row, the directions "
          f"alternating in one guest; the driver "
          f"{'acked' if event_idx else 'did not ack'} VIRTIO_RING_F_EVENT_IDX.\n\n"
          "| direction | MiB/s (median) | min | max | process CPU s | "
          "I/O thread CPU s | I/O thread CPU ms/MiB | tx frames | rx frames | interrupts |\n"
          "|---|---|---|---|---|---|---|---|---|---|\n"
          + "".join(f"| {name} | {r['mib_s']['median']:.1f} | "
                    f"{r['mib_s']['min']:.1f} | {r['mib_s']['max']:.1f} | "
                    f"{r['vmm_cpu_s']['median']:.2f} | {r['io_thread_cpu_s']['median']:.2f} | "
                    f"{1000 * r['io_thread_cpu_s']['median'] / args.mib:.2f} | "
                    f"{r['tx_frames']['median']:.0f} | {r['rx_frames']['median']:.0f} | "
                    f"{r['interrupts']['median']:.0f} |\n"
                    for name, r in rows.items()))
    write_results("net", {"mib": args.mib, "reps": args.reps, "runs": runs, "rows": rows,
                          "device_counters": counters, "event_idx": event_idx}, md)


def driver_bench(args: argparse.Namespace) -> None:
    import struct

    from vmfork import _core
    from vmfork.vmm.devices.plan import boot_plan
    from vmfork.vmm.devices.virtio import mmio, net
    from vmfork.vmm.devices.virtio.device import (
        STATUS_ACKNOWLEDGE,
        STATUS_DRIVER,
        STATUS_DRIVER_OK,
        STATUS_FEATURES_OK,
        VIRTIO_F_VERSION_1,
    )
    from vmfork.vmm.devices.virtio.queue import VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE
    from vmfork.vmm.eventloop import NativeEventLoop
    from vmfork.vmm.memory import GuestMemory

    per_turn, frame_len = 128, args.frame_bytes
    memory = GuestMemory.anonymous(((2 * per_turn * (frame_len + 4096)) + (8 << 20) + 0xFFF) & ~0xFFF)
    if memory.native is None:
        raise SystemExit("the native core is not built (scripts/lib.sh setup_native)")
    rings = {net.RX_QUEUE: (0x10000, 0x20000, 0x30000), net.TX_QUEUE: (0x40000, 0x50000, 0x60000)}
    data = 1 << 20
    frame = bytes((i * 7) & 0xFF for i in range(frame_len))
    for index in (net.RX_QUEUE, net.TX_QUEUE):
        desc = rings[index][0]
        for k in range(per_turn):
            hdr_at = data + (index * per_turn + k) * (frame_len + 4096)
            flag = VIRTQ_DESC_F_WRITE if index == net.RX_QUEUE else 0
            memory.write(desc + 16 * 2 * k, struct.pack(
                "<QIHH", hdr_at, net.VNET_HDR_SIZE, flag | VIRTQ_DESC_F_NEXT, 2 * k + 1))
            memory.write(desc + 16 * (2 * k + 1), struct.pack(
                "<QIHH", hdr_at + 64, frame_len, flag, 0))
            if index == net.TX_QUEUE:
                memory.write(hdr_at, bytes(net.VNET_HDR_SIZE))
                memory.write(hdr_at + 64, frame)
    offered = [0, 0]   # each queue's avail index, the driver's

    def offer(index: int) -> None:
        avail = rings[index][1]
        for k in range(per_turn):
            memory.write_u16(avail + 4 + 2 * ((offered[index] + k) % 256), 2 * k)
        offered[index] = (offered[index] + per_turn) & 0xFFFF
        memory.write_u16(avail + 2, offered[index])

    dev_sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    for s in (dev_sock, peer):
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, 32, 64 << 20)   # SO_SNDBUFFORCE: a turn's frames
    # A device the driver runs (both queues ready, the features acked without
    # EVENT_IDX, DRIVER_OK), restored live on a loop that never starts: every turn is
    # the QueueNotify write, served on this thread.
    (kind, features, max_sizes, _, indices) = boot_plan("net", mac="52:54:00:12:34:56")
    status = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK
    registers = (status, 0, 0, VIRTIO_F_VERSION_1, False, 0, 0, 0,
                 [(net.QUEUE_SIZE, 256, True, *rings[i]) for i in (net.RX_QUEUE, net.TX_QUEUE)])
    loop = NativeEventLoop("unused")
    irq = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    dev = _core.NativeDevice.restore((kind, features, max_sizes, registers, indices),
                                     memory.native, loop.native_loop, irq, [None, None],
                                     tap_fd=dev_sock.fileno())
    window = 0xD000_0000
    windows = _core.MmioWindows()
    windows.add_native(window, dev)

    def counted() -> net.NetCounters:
        return net.NetCounters(**dict(dev.net_counters()))

    host_frame = bytes(net.VNET_HDR_SIZE) + frame
    runs: list[dict[str, object]] = []
    for rep in range(args.reps):
        for direction in ("tx", "rx"):
            queue = net.TX_QUEUE if direction == "tx" else net.RX_QUEUE
            kick = struct.pack("<I", queue)
            start = counted()
            busy = cpu = 0.0
            for _ in range(args.turns):
                offer(queue)
                if direction == "rx":
                    for _ in range(per_turn):
                        peer.send(host_frame)
                t0, c0 = time.perf_counter(), time.process_time()
                windows.write(window + mmio.REG_QUEUE_NOTIFY, kick)
                busy += time.perf_counter() - t0
                cpu += time.process_time() - c0
                if direction == "tx":
                    for _ in range(per_turn):
                        peer.recv(1 << 17)
            c = counted()
            frames = (c.tx_frames - start.tx_frames if direction == "tx"
                      else c.rx_frames - start.rx_frames)
            assert frames == per_turn * args.turns and not c.tx_dropped \
                and not c.rx_dropped, vars(c)
            moved = (frames * frame_len) >> 20
            runs.append({"rep": rep, "direction": direction, "frames_s": frames / busy,
                         "mib_s": moved / busy, "cpu_s": cpu})
            print(f"rep {rep + 1}/{args.reps} {direction}: {frames / busy:9.0f} frames/s, "
                  f"{moved / busy:7.0f} MiB/s", file=sys.stderr)
    dev.close()
    loop.stop()
    os.close(irq)
    dev_sock.close()
    peer.close()
    memory.close()
    rows = {d: {key: summary([float(r[key]) for r in runs  # type: ignore[arg-type]
                              if r["direction"] == d])
                for key in ("frames_s", "mib_s", "cpu_s")}
            for d in ("tx", "rx")}
    md = (f"# virtio-net's device alone, no guest\n\n"
          f"native, on {os.uname().nodename}; {frame_len}-byte frames, {per_turn} chains per "
          f"turn, {args.turns} turns per run, an AF_UNIX datagram socket pair as the tap, "
          f"{args.reps} runs, directions alternating.\n\n| direction | frames/s (median) | "
          "min | max | MiB/s | CPU s |\n|---|---|---|---|---|---|\n"
          + "".join(f"| {d} | {r['frames_s']['median']:.0f} | "
                    f"{r['frames_s']['min']:.0f} | {r['frames_s']['max']:.0f} | "
                    f"{r['mib_s']['median']:.0f} | {r['cpu_s']['median']:.3f} |\n"
                    for d, r in rows.items()))
    write_results("net-driver", {"frame_bytes": frame_len, "per_turn": per_turn,
                                 "turns": args.turns, "runs": runs, "rows": rows}, md)


if __name__ == "__main__":
    main()
