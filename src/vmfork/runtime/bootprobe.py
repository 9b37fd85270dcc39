"""Boot one guest in this (fresh) process and print a JSON report of how long
each stage took; used by ``bench/boot.py``. Times are ``time.monotonic()``
values (system-wide on Linux), so the parent can subtract its own start time."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _seconds_since_process_start() -> float:
    """From exec to now, from /proc (clock ticks since boot, 10 ms resolution)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22, starttime; fields[0] is field 3
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mem-mib", type=int, default=256)
    parser.add_argument("--vcpus", type=int, default=1)
    args = parser.parse_args()
    from vmfork.image import find_image
    from vmfork.runtime.guest import BootedGuest

    interpreter_s = _seconds_since_process_start()

    with BootedGuest(find_image(), mem_mib=args.mem_mib, vcpus=args.vcpus) as guest:
        ready_at = time.monotonic()
        profile = guest.machine.exit_profile() if guest.machine else {}
        report = {"ready_at": ready_at, "interpreter_s": interpreter_s, **guest.timings.as_dict(),
                  "exits": profile.get("by_reason"), "top_io": profile.get("top_io")}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
