"""What mapping a chain's RAM in the zygote costs and saves, against its run count.

No VM: a memory plan of ``runs`` one-page runs (every other page, so each run is
its own VMA, the worst case a plan of that many runs makes) over a 512 MiB base, in
real files. Per case, medians of ``REPS``:

* **map in child** -- ``GuestMemory.from_file_private`` with the plan: what every
  child of a diff snapshot did before issue 19 (one mmap per run);
* **adopt in child** -- the same with the premap the zygote made (``PremappedRam``):
  open the sources, check them, one mprotect per region;
* **fork** -- ``fork()`` of a process holding the premap, inherited (the children of
  that snapshot) and DONTFORK (everyone else's), against one holding none: dup_mmap
  walks every VMA either way;
* **madvise** -- the zygote's DOFORK/DONTFORK switch when the batch's snapshot changes.

Needs no KVM; one line per case (``python bench/premap_fork_cost.py``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vmfork.ondisk.memplan import MemoryPlan, PlanRun, PlanSource
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory, PremappedRam

MEM = 512 << 20
REPS = 7


def _median_ms(step: Callable[[], object]) -> float:
    times = []
    for _ in range(REPS):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _fork_ms() -> float:
    def once() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return _median_ms(once)


def _in_child_ms(step: Callable[[], object]) -> float:
    """``step`` timed in a fresh fork each time (as a VMM child runs it)."""
    times = []
    for _ in range(REPS):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            started = time.perf_counter()
            step()
            os.write(w, repr((time.perf_counter() - started) * 1000).encode())
            os._exit(0)
        os.close(w)
        times.append(float(os.read(r, 64)))
        os.close(r)
        os.waitpid(pid, 0)
    return statistics.median(times)


def _vmas() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def case(snaps: Path, runs: int) -> str:
    plan = MemoryPlan(MEM, (PlanSource("base/memory.bin", MEM),
                            PlanSource("link/layer.bin", runs * PAGE_SIZE)),
                      tuple(PlanRun(2 * i * PAGE_SIZE, PAGE_SIZE, 1, i * PAGE_SIZE)
                            for i in range(runs)), str(snaps / "link"))
    with open(snaps / "link" / "layer.bin", "wb") as layer:
        layer.truncate(runs * PAGE_SIZE)
    base = str(snaps / "base" / "memory.bin")
    vmas_before, fork_none = _vmas(), _fork_ms()
    map_child = _in_child_ms(lambda: GuestMemory.from_file_private(base, MEM, plan))
    ram = PremappedRam.map(base, MEM, plan)
    try:
        vmas = _vmas() - vmas_before
        fork_inherited = _fork_ms()
        adopt_child = _in_child_ms(lambda: GuestMemory.from_file_private(base, MEM, plan, ram))
        dontfork = _median_ms(lambda: (ram.set_inherited(False), ram.set_inherited(True))) / 2
        ram.set_inherited(False)
        fork_dontfork = _fork_ms()
    finally:
        ram.release()
    return (f"runs {runs:6d} ({vmas:6d} VMAs): map in child {map_child:7.2f} ms, adopt in "
            f"child {adopt_child:6.2f} ms; fork {fork_none:5.2f} ms without, "
            f"{fork_inherited:6.2f} inherited, {fork_dontfork:6.2f} DONTFORK; "
            f"madvise switch {dontfork:5.2f} ms")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="vmfork-premap-") as tmp:
        snaps = Path(tmp)
        (snaps / "base").mkdir()
        (snaps / "link").mkdir()
        with open(snaps / "base" / "memory.bin", "wb") as f:
            f.truncate(MEM)
        for runs in (0, 800, 4000, 16384):
            print(case(snaps, runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
