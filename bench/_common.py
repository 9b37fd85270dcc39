"""Shared by the benchmarks: where results go, routing into the test host, stats."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vmfork.client import Controller
    from vmfork.server.daemon import Daemon

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"


def ensure_kvm_host(script: str, argv: list[str], *, mem_mib: int = 4096,
                    timeout: float = 3600.0) -> None:
    """Re-run this benchmark inside the emulated KVM test host (``mem_mib`` of memory,
    killed after ``timeout`` s) when this host's KVM cannot run unmodified guests;
    exit with its status."""
    if os.environ.get("VMFORK_IN_TESTHOST") == "1":
        return
    from vmfork.kvm.probe import native_kvm_runs_guests
    if native_kvm_runs_guests():
        return
    from vmfork.testhost import run_in_testhost
    print(f"{script}: this host's KVM cannot run unmodified guests; running inside the "
          f"emulated KVM test host with {mem_mib} MiB (figures are meaningful as ratios "
          "only)", file=sys.stderr)
    sys.exit(run_in_testhost([sys.executable, script, *argv], mem_mib=mem_mib,
                             rw_paths=[str(REPO)], cwd=str(REPO), timeout=timeout))


def native_vs_python(samples_s: dict[str, list[float]], column: str,
                     digits: int = 0) -> tuple[dict[str, dict[str, float]], float, str]:
    """A native-vs-Python benchmark's summary: per path (``native``, ``python``) the
    median/min/max in µs of ``samples_s`` (seconds), the Python / native ratio of the
    medians, and the markdown table of them (``column`` heads the median)."""
    us = {path: summary([t * 1e6 for t in values]) for path, values in samples_s.items()}
    ratio = us["python"]["median"] / us["native"]["median"]
    table = (f"| path | {column} | min | max |\n|---|---|---|---|\n"
             + "".join(f"| {p} | {u['median']:.{digits}f} | {u['min']:.{digits}f} "
                       f"| {u['max']:.{digits}f} |\n" for p, u in us.items())
             + f"\nPython / native (median): {ratio:.2f}x\n")
    return us, ratio, table


def where() -> str:
    if os.environ.get("VMFORK_IN_TESTHOST") == "1":
        return "emulated KVM test host (QEMU TCG, AMD SVM, nested kvm_amd): compare ratios only"
    return f"native KVM on {platform.node()}"


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def write_results(name: str, data: dict[str, Any], markdown: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    data = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "where": where(), **data}
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)
    print(f"results: {RESULTS / (name + '.json')}, {RESULTS / (name + '.md')}")


def local_daemon(work: Path, home: Path, *, name: str = "api",
                 **config: Any) -> tuple[Daemon, Controller]:
    """A daemon started in this process (state in ``work/<name>-state``, its socket
    ``work/<name>.sock``, the store ``home``; sandboxes killed when it stops) and a
    client of it with an hour's timeout. The caller stops it."""
    from vmfork.client import Controller
    from vmfork.server.daemon import Daemon, DaemonConfig

    sock = work / f"{name}.sock"
    config.setdefault("kill_sandboxes_on_exit", True)
    daemon = Daemon(DaemonConfig(state_dir=work / f"{name}-state", socket_path=sock,
                                 bind=None, snapshot_root=home, **config))
    daemon.start()
    return daemon, Controller(f"unix://{sock}", timeout=3600)
