"""The host-side floor of a BRANCH pause: fork() and the pagemap scan against RAM size.

No VM: a file mapped ``MAP_PRIVATE`` like a sandbox's RAM, every page read (so it
is present in the page tables), some pages written (private copies, as a guest's
writes make them). Times the ``fork`` a live capture does while paused and the
``/proc/self/pagemap`` scan a diff does. Needs no KVM, so it runs natively; it
prints one line per case (``python bench/branch_fork_cost.py``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from vmfork.vmm import dirty
from vmfork.vmm.memory import PAGE_SIZE, GuestMemory

BASE_DATA_MIB = 100
REPS = 5


def measure(path: str, mem_mib: int, dirty_mib: int) -> tuple[float, float, int]:
    memory = GuestMemory.from_file_private(path, mem_mib << 20)
    try:
        for region in memory.regions:
            view = memoryview(region.mapping)
            for off in range(0, region.size, PAGE_SIZE):
                view[off]   # fault every page in
            view.release()
        for off in range(0, dirty_mib << 20, PAGE_SIZE):
            memory.write(off, b"x")
        forks, scans = [], []
        for _ in range(REPS):
            started = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            forks.append((time.perf_counter() - started) * 1000)
            os.waitpid(pid, 0)
            started = time.perf_counter()
            runs = dirty.changed_private_pages(memory)
            scans.append((time.perf_counter() - started) * 1000)
        return statistics.median(forks), statistics.median(scans), dirty.page_count(runs)
    finally:
        memory.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        for mem_mib in (256, 1536):
            path = os.path.join(workdir, f"memory-{mem_mib}.bin")
            with open(path, "wb") as f:
                f.truncate(mem_mib << 20)
                f.write(b"\1" * (BASE_DATA_MIB << 20))
            for dirty_mib in (0, 100, mem_mib):
                fork_ms, scan_ms, pages = measure(path, mem_mib, dirty_mib)
                print(f"guest {mem_mib} MiB, {dirty_mib} MiB written: fork p50 {fork_ms:.2f} ms, "
                      f"pagemap scan p50 {scan_ms:.2f} ms ({pages} changed pages)")
            os.unlink(path)


if __name__ == "__main__":
    main()
