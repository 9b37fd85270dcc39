"""virtio-rng per notification, in process: the two serving paths side by side.

A driver (tests/unit's ``GuestDriver``, over real guest memory, a real transport and
the queue's real ioeventfd) posts ``--batch`` requests of ``--bytes`` bytes, writes the
ioeventfd as KVM would on the guest's QueueNotify, and waits for the interrupt's
eventfd (as the guest waits for its interrupt) until the used ring holds them all; ``--rounds`` such rounds per run. Paths, alternated run by run:

* ``native+py``: the native epoll loop calling the ioeventfd's Python callback, which
  enters ``serve_rng`` (Rust) from Python (a transport without an irqfd);
* ``native+serve``: the native loop serving the queue itself, no GIL (``_core.RngQueue``).

``--busy`` adds a Python thread that spins meanwhile: the paths that run a Python
callback then wait for the GIL (up to the 5 ms switch interval), the native one does not.

No KVM: only the VMM side of a notification (wake-up, serving, used ring, interrupt
eventfd) is measured; the guest's exit and interrupt are not. Writes
``bench/results/rng_notify.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import summary, write_results

PATHS = ("native+py", "native+serve")


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def run(path: str, rounds: int, batch: int, size: int, busy: bool) -> float:
    """Seconds per round (one notification serving ``batch`` requests), from the
    ioeventfd write to the last used element seen."""
    from test_virtio_harness import MEM_SIZE, GuestDriver

    from vmfork.vmm.devices.virtio import mmio
    from vmfork.vmm.devices.virtio.rng import VirtioRng
    from vmfork.vmm.eventloop import NativeEventLoop
    from vmfork.vmm.irq import IrqLine
    from vmfork.vmm.memory import GuestMemory

    memory = GuestMemory.anonymous(MEM_SIZE)
    loop = NativeEventLoop("bench-io")
    loop.start()
    irq = IrqLine(gsi=5)
    fds: list[int] = []
    rng = VirtioRng(loop, native_serve=path == "native+serve")
    t = mmio.MmioTransport(rng, memory, irq, loop,
                           register_ioeventfd=lambda off, dm, fd: fds.append(fd))
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
    try:
        (q,) = GuestDriver(t, memory).start([(256, size)])
        deadline = time.monotonic() + 5
        while not rng.active and time.monotonic() < deadline:
            time.sleep(0.001)
        assert rng.serving_natively == (path == "native+serve"), path
        if busy:
            spinner.start()
        target = 0
        spent = 0.0
        for _ in range(rounds):
            for _ in range(batch):
                q.post(writable=[size])
            target = (target + batch) & 0xFFFF
            t0 = time.perf_counter()  # the driver's posting is not timed
            os.eventfd_write(fds[0], 1)
            # Wait as a guest does, for the interrupt (the irqfd), with the GIL
            # released: a waiter spinning in Python would hold the GIL the
            # Python-callback paths need.
            while q.used_idx() != target:
                select.select([irq.fd], [], [], 1.0)
                try:
                    os.eventfd_read(irq.fd)
                except BlockingIOError:
                    pass
            spent += time.perf_counter() - t0
            q.take_used()
        return spent / rounds
    finally:
        stop.set()
        if spinner.is_alive():
            spinner.join()
        t.close()
        loop.stop()
        irq.close()
        memory.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=1, help="requests per notification")
    parser.add_argument("--bytes", type=int, default=64, help="bytes per request")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--busy", action="store_true",
                        help="a Python thread spins meanwhile (the GIL is contended, as "
                             "in a VMM whose Python is busy with a control request)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for _ in range(args.reps):
        for p in PATHS:
            times[p].append(run(p, args.rounds, args.batch, args.bytes, args.busy))
    base = statistics.median(times["native+py"])
    rows = [f"| {p} | {statistics.median(v) * 1e6:.1f} | "
            f"{args.batch / statistics.median(v):,.0f} | "
            f"{statistics.median(v) / base:.2f}× |" for p, v in times.items()]
    md = "\n".join([
        f"# virtio-rng per notification (in process, {args.batch} request(s) of "
        f"{args.bytes} B per notification, {args.rounds} rounds × {args.reps} runs"
        f"{', a Python thread spinning' if args.busy else ''})", "",
        "| path | µs per notification (median) | requests/s | vs native+py |",
        "|---|---|---|---|", *rows, ""])
    write_results("rng_notify", {"args": vars(args),
                                 "seconds_per_round": {p: summary(v) for p, v in times.items()}},
                  md)


if __name__ == "__main__":
    main()
