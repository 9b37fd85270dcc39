"""The daemon's HTTP front alone: ``GET /v1/snapshots`` through the Python SDK against a
real daemon in this process (no spawner: nothing boots, the store is empty), on its Unix
socket and on TCP. Prints p50 and p99 of the call and the CPU time per call (client and
daemon together: they share this process), which a loaded machine inflates less than
latency.

    PYTHONPATH=src python bench/http_front.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    from vmfork.client import Controller
    from vmfork.server.daemon import Daemon, DaemonConfig

    root = Path(tempfile.mkdtemp(prefix="http-front-bench-"))
    os.environ["VMFORK_HOME"] = str(root / "home")
    daemon = Daemon(DaemonConfig(state_dir=root / "state", socket_path=root / "api.sock",
                                 bind="127.0.0.1:0", spawner=False, networking=False))
    daemon.start()
    try:
        for url in daemon.addresses():
            ctl = Controller(url, timeout=10)
            for _ in range(200):   # warm: connections pooled, code paths hot
                ctl.list_snapshots()
            times = []
            cpu = time.process_time()
            for _ in range(args.calls):
                started = time.perf_counter()
                ctl.list_snapshots()
                times.append(time.perf_counter() - started)
            cpu = (time.process_time() - cpu) / args.calls
            times.sort()
            print(f"{url.split(':')[0]:5} p50 {statistics.median(times) * 1e6:7.0f} us  "
                  f"p99 {times[int(len(times) * 0.99)] * 1e6:7.0f} us  "
                  f"CPU {cpu * 1e6:6.0f} us/call  ({args.calls} calls)")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
