"""Python the host sends to a guest's agent to run (the ``eval`` op), shared by the
runtime (a parent before its snapshot) and the CLI (a build sandbox before its diff).

It lives outside ``vmfork.agent`` on purpose: the agent's files are baked into every
guest image, and these snippets are data the host chooses per request.

``ZERO_FREE_MEMORY``: make the guest's free memory zero before a capture. A page that
a warm-up or a build used and freed (pip's heap, the wheel it downloaded into /tmp
and deleted, the initramfs archive the kernel unpacked) keeps its bytes, so to the
host it is as changed as a page of installed files, and a diff layer would carry
it. The snippet maps almost all free memory anonymously with ``MAP_POPULATE``: the
guest kernel hands out its free pages zero-filled, and gives them back zero when the
mapping is closed. A capture then leaves out the pages that are zero over a zero base
(``vmm.capture.without_zero_over_zero``) and a parent's memory file skips them
(``GuestMemory.dump``). It stops short of the zones' high watermarks (plus a margin),
so the kernel never reclaims page cache or wakes the OOM killer for it. Why not
``init_on_free=1``: Linux 6.1 zeroes *every* page freed into the buddy allocator at
boot as well (``__free_pages_core``), which writes all of guest RAM in every boot.
"""

from __future__ import annotations

ZERO_FREE_MEMORY = '''
def _vmfork_zero_free_memory():
    import mmap
    populate = getattr(mmap, "MAP_POPULATE", 0x8000)
    def free_bytes():
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemFree:"):
                    return int(line.split()[1]) * 1024
        return 0
    with open("/proc/zoneinfo") as f:
        high = sum(int(line.split()[1]) for line in f if line.split()[:1] == ["high"])
    keep = high * 4096 * 2 + (16 << 20)
    chunk, maps, zeroed = 16 << 20, [], 0
    try:
        while free_bytes() > keep + chunk:
            maps.append(mmap.mmap(-1, chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                  | populate))
            zeroed += chunk
    finally:
        for m in maps:
            m.close()
    return zeroed
_vmfork_zero_free_memory()
'''
