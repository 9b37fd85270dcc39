"""One virtio device's restore, in process: the Python transport against the native one.

A snapshot of a live virtio-rng (tests/unit's ``GuestDriver`` brings it up on a real
``MmioTransport`` over real guest memory and has one request served) is restored
``--restores`` times per run, each restore then torn down, by two paths alternated run
by run:

* ``python``: what ``DeviceManager.restore`` does for the device today:
  ``device.restore`` and ``transport.restore`` on a ``VirtioRng`` and its
  ``MmioTransport`` (built untimed, as the machine builds them before the restore), and
  the activation the transport queues on the loop (waited for: the server runs);
* ``native``: ``_core.NativeDevice.restore`` from the plan (``devices/plan.py``), built
  once beforehand as the zygote would build it once per snapshot; the register file's
  construction and the activation are part of the call.

Tear-down is untimed on both paths.

Also the plan's own build from the decoded record (``plan``), once per snapshot. Each
restore's device gets the queue's ioeventfd and the irqfd as the machine's would; no
KVM, no guest: only the VMM side of a restore. Writes
``bench/results/device_restore.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import summary, write_results

PATHS = ("python", "native")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restores", type=int, default=500, help="restores per run")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    from test_virtio_harness import MEM_SIZE, GuestDriver, wait_until

    from vmfork import _core
    from vmfork.vmm.devices.manager import DeviceState
    from vmfork.vmm.devices.plan import device_plan
    from vmfork.vmm.devices.virtio import mmio
    from vmfork.vmm.devices.virtio.device import run_on_loop
    from vmfork.vmm.devices.virtio.rng import VirtioRng
    from vmfork.vmm.eventloop import NativeEventLoop
    from vmfork.vmm.irq import IrqLine
    from vmfork.vmm.memory import GuestMemory

    memory = GuestMemory.anonymous(MEM_SIZE)
    ram = memory.native
    assert ram is not None
    loop = NativeEventLoop("bench-io")
    loop.start()
    line = IrqLine(gsi=5)
    device = VirtioRng(loop)
    transport = mmio.MmioTransport(device, memory, line, loop)
    driver = GuestDriver(transport, memory)
    [queue] = driver.start([(16, 64)])
    queue.post(writable=[64])
    driver.notify(0)
    wait_until(lambda: queue.used_idx() == 1, what="the snapshot's request served")
    saved = DeviceState("rng", 1, 0, 5, device.save(), run_on_loop(loop, transport.save))
    assert saved.transport is not None
    plan = device_plan(saved)
    notify = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def register_ioeventfd(offset: int, datamatch: int, fd: int) -> None:
        """The machine's KVM_IOEVENTFD; here the test writes the eventfd itself."""

    def python_restore() -> float:
        rng = VirtioRng(loop)
        t = mmio.MmioTransport(rng, memory, line, loop, register_ioeventfd)
        start = time.perf_counter()
        rng.restore(saved.state)   # type: ignore[arg-type]  # an RngState (DeviceState)
        t.restore(saved.transport)   # type: ignore[arg-type]  # checked above
        # The activation was queued on the loop first: a call queued after it returns
        # once the server runs.
        run_on_loop(loop, lambda: None)
        took = time.perf_counter() - start
        assert rng.active
        run_on_loop(loop, rng.reset)
        t.close()
        rng.close()
        return took

    def native_restore() -> float:
        start = time.perf_counter()
        restored = _core.NativeDevice.restore(plan, ram, loop._native, line.fd,
                                              [notify])
        took = time.perf_counter() - start
        assert restored.active
        del restored   # its readers leave the loop with the device
        return took

    restores = {"python": python_restore, "native": native_restore}
    per_restore: dict[str, list[float]] = {p: [] for p in PATHS}
    for _ in range(args.reps):
        for path in PATHS:
            took = sum(restores[path]() for _ in range(args.restores))
            per_restore[path].append(took / args.restores)
    plan_s = []
    for _ in range(args.reps):
        start = time.perf_counter()
        for _ in range(args.restores):
            device_plan(saved)
        plan_s.append((time.perf_counter() - start) / args.restores)
    loop.stop()
    line.close()
    os.close(notify)
    memory.close()

    rows = {**{p: summary(v) for p, v in per_restore.items()}, "plan": summary(plan_s)}
    md = ["# One device's restore (virtio-rng, live, ioeventfd + irqfd)", "",
          f"{args.restores} restores per run, {args.reps} runs, paths alternated.", "",
          "| path | median µs | min µs | max µs |", "|---|---|---|---|"]
    for path, s in rows.items():
        md.append(f"| {path} | {s['median'] * 1e6:.1f} | {s['min'] * 1e6:.1f} | "
                  f"{s['max'] * 1e6:.1f} |")
    write_results("device_restore", {"args": vars(args), "seconds_per_restore": rows},
                  "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
