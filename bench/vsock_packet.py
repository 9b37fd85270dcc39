"""vsock's per-packet parse and write, in process: the native calls against their Python
twins, with the Python records each side builds.

* ``tx classify``: one guest tx chain (a 44-byte header buffer and a 4 KiB payload
  buffer, an RW packet of an established shape) through ``vsock.classify_tx`` (native:
  ``GuestRam.vsock_tx_classify``) and ``vsock.classify_tx_python``;
* ``rx control``: a CREDIT_UPDATE written into a popped rx chain (a header buffer and a
  4 KiB buffer) and put on the used ring, through ``vsock.deliver_rx`` (one native call)
  and ``vsock.deliver_rx_python`` (``pack`` and three calls).

Both paths run over the same native guest memory, so the Python twin's reads and writes
are the native copies (as the device's were before the parse moved): what differs is the
parse and the records. Best of ``--repeat`` timings of ``--calls`` calls, per call. No
KVM, no guest. Writes ``bench/results/vsock_packet.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_results

from vmfork.vmm.devices.virtio import vsock
from vmfork.vmm.devices.virtio.queue import DescriptorChain, Virtqueue
from vmfork.vmm.devices.virtio.vsock import Op, PacketHeader
from vmfork.vmm.memory import GuestMemory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=5, help="timings per path (best kept)")
    args = ap.parse_args()
    memory = GuestMemory.anonymous(1 << 20)
    if memory.native is None:
        print("vsock_packet: the native core is not built (scripts/lib.sh setup_native) "
              "or VMFORK_NATIVE=0", file=sys.stderr)
        return 1
    guest = PacketHeader(3, vsock.HOST_CID, 40000, 5000, 4096, vsock.TYPE_STREAM, Op.RW, 0,
                         vsock.BUF_ALLOC, 0)
    memory.write(0x10000, guest.pack())
    tx = DescriptorChain(0, [(0x10000, vsock.HEADER_SIZE), (0x20000, 4096)])
    queue = Virtqueue(vsock.QUEUE_SIZE)
    queue.size, queue.desc_table, queue.avail_ring, queue.used_ring = 256, 0x1000, 0x3000, 0x4000
    queue.ready = True
    rx = DescriptorChain(0, [], [(0x30000, vsock.HEADER_SIZE), (0x31000, 4096)])
    update = PacketHeader(vsock.HOST_CID, 3, 5000, 40000, 0, vsock.TYPE_STREAM,
                          Op.CREDIT_UPDATE, 0, vsock.BUF_ALLOC, 12345)
    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "tx classify": (lambda: vsock.classify_tx(memory, tx, 3),
                        lambda: vsock.classify_tx_python(memory, tx, 3)),
        "rx control": (lambda: vsock.deliver_rx(memory, queue, rx, update, b""),
                       lambda: vsock.deliver_rx_python(memory, queue, rx, update, b"")),
    }
    results: dict[str, dict[str, float]] = {}
    for name, (native, python) in cases.items():
        results[name] = {}
        for path, fn in (("native", native), ("python", python)):
            best = min(timeit.repeat(fn, number=args.calls, repeat=args.repeat))
            results[name][path] = best / args.calls * 1e6
    memory.close()
    md = ["# vsock per packet, in process (us per call, best of "
          f"{args.repeat} x {args.calls} calls)", "",
          "| | native | Python twin | ratio |", "|---|---|---|---|"]
    md += [f"| {name} | {r['native']:.2f} | {r['python']:.2f} | "
           f"{r['python'] / r['native']:.2f}x |" for name, r in results.items()]
    write_results("vsock_packet", {"calls": args.calls, "repeat": args.repeat,
                                   "us_per_call": results}, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
