"""Where a spawned VMM child's time goes, phase by phase and function by function.

The zygote runs with ``VMFORK_SPAWN_PROFILE`` (``runtime/spawnprofile.py``): each child
records, at each phase from ``fork()`` to ready, the wall clock, its main thread's CPU
time and the process's, and (``--cprofile``) runs its main thread under cProfile. This
script makes the same warm parent as ``bench/spawn.py`` (our kernel and initramfs,
256 MiB, 1 vCPU), spawns N jailed children of its snapshot ``--reps`` times per N (after
one first spawn that warms the zygote up, as ``bench/spawn.py`` does), and prints per N
the median of each phase over all children, then the functions that took the most of
the children's main-thread time (all children of an N summed: ``pstats``).

Per N it also gives the batch's timeline, which medians hide: from the spawn request,
when the last child was forked, prepared (restored, at the start gate), released by the
gate, restored (vCPU started) and ready, each from the children's own clocks, beside
when the spawner saw every child restored and ready. The gaps between them say where
a large batch's time goes: the serial forks and restores before the gate, the wait for
the gate, the children's steps after it (competing with the guests already running),
and the spawner's view.

Writes ``bench/results/spawn-profile.{json,md}`` (and the merged statistics,
``spawn-profile-n<N>.pstats``). Runs inside the emulated test host where this host's KVM
cannot run unmodified guests: compare runs made in the same host only; cProfile slows
Python calls, so compare phase times of runs made with the same flags.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, ensure_kvm_host, where, write_results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=lambda s: [int(x) for x in s.split(",")], default=[1, 10])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--mem-mib", type=int, default=256)
    parser.add_argument("--warm", default="import json, random")
    parser.add_argument("--cprofile", action="store_true",
                        help="also per-function times of each child's main thread")
    parser.add_argument("--top", type=int, default=30, help="functions listed per table")
    parser.add_argument("--no-jail", action="store_true", help="spawn unjailed children")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--host-mem-mib", type=int, default=6144)
    parser.add_argument("--host-timeout", type=float, default=3600.0)
    return parser.parse_args()


def wait_for_file(path: Path, deadline: float) -> bool:
    """A child writes its profile right after it reported ready."""
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# The batch's milestones (``timeline``): a child's mark, and what the batch waits for.
MILESTONES = (("forked", "forked"), ("prepared", "prepared_report"),
              ("released by the gate", "start_gate"), ("restored", "restored_report"),
              ("ready", "ready_report"))


def timeline(requested_ns: int, marks: list[list[dict[str, Any]]],
             seen: dict[str, float]) -> dict[str, Any]:
    """One batch's critical path, in seconds from the spawn request (``requested_ns``,
    this process's monotonic clock, the children's too): per milestone, when the first
    and the last child reached it (``MILESTONES``; a milestone a child never marked is
    left out), and ``seen``, when the spawner saw the batch restored and ready."""
    out: dict[str, Any] = {}
    for name, phase in MILESTONES:
        times = [(int(m["mono_ns"]) - requested_ns) / 1e9
                 for child in marks for m in child if m["phase"] == phase]
        if times:
            out[name] = {"first_s": min(times), "last_s": max(times)}
    out["spawner saw"] = seen
    return out


def timeline_table(batches: list[dict[str, Any]]) -> list[str]:
    """The median over reps of each milestone's first and last child."""
    md = ["| milestone | first child s | last child s |", "|---|---|---|"]
    for name, _ in MILESTONES:
        got = [b[name] for b in batches if name in b]
        if got:
            md.append(f"| {name} | {statistics.median(g['first_s'] for g in got):.3f} | "
                      f"{statistics.median(g['last_s'] for g in got):.3f} |")
    for what in ("restored_s", "ready_s"):
        md.append(f"| the spawner saw every child {what[:-2]} | | "
                  f"{statistics.median(b['spawner saw'][what] for b in batches):.3f} |")
    return md


def spawn_once(zygote: Any, snapshot: Any, n: int, run_root: Path, timeout: float,
               jail: bool, stats_out: list[str], keep: Path,
               batches: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """N children to ready; each one's phases (``spawnprofile.phases``); the batch's
    ``timeline`` appended to ``batches``."""
    from vmfork.runtime import spawnprofile
    from vmfork.runtime.spawn import fork_children
    client = zygote.client(timeout=max(120.0, timeout))
    try:
        requested_ns = time.monotonic_ns()
        report = fork_children(client, snapshot, n, run_root, timeout=timeout, jail=jail)
        if report.failed:
            raise RuntimeError(f"children failed: {report.failed[:3]}")
        out = []
        marks = []
        deadline = time.monotonic() + 60
        for child in report.children:
            profile = child.run_dir / spawnprofile.PROFILE_FILE
            if not wait_for_file(profile, deadline):
                raise RuntimeError(f"{child.vm_id} wrote no {profile.name}")
            marks.append(json.loads(profile.read_text())["marks"])
            out.append(spawnprofile.phases(marks[-1]))
            stats = child.run_dir / spawnprofile.STATS_FILE
            if stats.exists():
                kept = keep / f"{child.vm_id}.pstats"
                shutil.copyfile(stats, kept)
                stats_out.append(str(kept))
        # fork_children's figures count from its own start, a moment after ours.
        batches.append(timeline(requested_ns, marks, {"restored_s": report.restored_s,
                                                      "ready_s": report.ready_s}))
        return out
    finally:
        for child in client.list():
            client.kill(child.vm_id)
        for child in client.list():
            client.wait(child.vm_id, timeout=60.0)
        client.close()


def phase_table(children: list[list[dict[str, Any]]]) -> tuple[list[str], dict[str, Any]]:
    order: list[str] = []
    by_phase: dict[str, dict[str, list[float]]] = {}
    for phases in children:
        for p in phases:
            name = str(p["phase"])
            if name not in by_phase:
                order.append(name)
                by_phase[name] = {"wall_s": [], "thread_cpu_s": [], "process_cpu_s": []}
            for key in ("wall_s", "thread_cpu_s", "process_cpu_s"):
                by_phase[name][key].append(float(p[key]))
    md = ["| phase (ends at) | wall ms | main-thread CPU ms | process CPU ms |",
          "|---|---|---|---|"]
    medians: dict[str, Any] = {}
    totals = {"wall_s": 0.0, "thread_cpu_s": 0.0, "process_cpu_s": 0.0}
    for name in order:
        m = {k: statistics.median(v) for k, v in by_phase[name].items()}
        medians[name] = m
        md.append(f"| {name} | {m['wall_s'] * 1e3:.1f} | {m['thread_cpu_s'] * 1e3:.1f} | "
                  f"{m['process_cpu_s'] * 1e3:.1f} |")
        for k in totals:
            totals[k] += m[k]
    md.append(f"| (sum of medians) | {totals['wall_s'] * 1e3:.1f} | "
              f"{totals['thread_cpu_s'] * 1e3:.1f} | {totals['process_cpu_s'] * 1e3:.1f} |")
    return md, medians


def top_functions(files: list[str], sort: str, top: int, save: Path) -> str:
    stats = pstats.Stats(files[0], stream=io.StringIO())
    for f in files[1:]:
        stats.add(f)
    stats.dump_stats(str(save))
    buf = io.StringIO()
    stats.stream = buf   # type: ignore[attr-defined]
    stats.strip_dirs().sort_stats(sort).print_stats(top)
    return buf.getvalue()


def main() -> int:
    args = parse_args()
    if args.cprofile:
        os.environ["VMFORK_SPAWN_PROFILE"] = "cprofile"
    else:
        os.environ["VMFORK_SPAWN_PROFILE"] = "1"
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=args.host_mem_mib,
                    timeout=args.host_timeout)
    from vmfork.image import find_image
    from vmfork.runtime.parent import snapshot_parent
    from vmfork.runtime.spawn import fork_children
    from vmfork.runtime.zygote_client import start_zygote
    from vmfork.store import Store

    workdir = Path(tempfile.mkdtemp(prefix="vmfork-bench-spawn-profile-"))
    os.environ["VMFORK_HOME"] = str(workdir / "home")
    (workdir / "home").mkdir()
    keep = workdir / "pstats"
    keep.mkdir()
    results: dict[str, Any] = {}
    md = ["# Where a spawned child's time goes (`bench/spawn_profile.py`)", "",
          f"{where()}; {'jailed' if not args.no_jail else 'unjailed'} children, "
          f"{'with' if args.cprofile else 'without'} cProfile, reps {args.reps}; medians "
          "over every child of every rep. Each phase runs from the previous mark to its "
          "own; `fork` is the zygote's clock before `os.fork()` to the child's first "
          "instruction.", ""]
    try:
        report = snapshot_parent(Store.open(workdir / "home"), "bench-spawn-profile",
                                 find_image(), mem_mib=args.mem_mib, warm_code=args.warm)
        snapshot = report.snapshot
        with open(workdir / "zygote.log", "wb") as zlog:
            zygote = start_zygote(str(workdir / "zygote.sock"), stderr=zlog, timeout=300.0)
        try:
            client = zygote.client(timeout=300.0)
            try:   # the first spawn: the zygote decodes the snapshot and warms up
                fork_children(client, snapshot, 1, workdir / "first", timeout=args.timeout,
                              wait_for="ready", jail=not args.no_jail)
            finally:
                for child in client.list():
                    client.kill(child.vm_id)
                    client.wait(child.vm_id, timeout=60.0)
                client.close()
            for n in args.n:
                children: list[list[dict[str, Any]]] = []
                batches: list[dict[str, Any]] = []
                stats_files: list[str] = []
                for rep in range(args.reps):
                    print(f"spawn_profile: N={n} rep {rep + 1}", file=sys.stderr, flush=True)
                    children += spawn_once(zygote, snapshot, n, workdir / f"vms-{n}-{rep}",
                                           args.timeout, not args.no_jail, stats_files, keep,
                                           batches)
                table, medians = phase_table(children)
                results[str(n)] = {"phases": medians, "children": children,
                                   "timelines": batches}
                md += [f"## N = {n} ({len(children)} children)", "", *table, "",
                       f"### N = {n}: the batch's timeline (seconds from the spawn request; "
                       f"median over {len(batches)} reps)", "", *timeline_table(batches), ""]
                if stats_files:
                    RESULTS.mkdir(exist_ok=True)
                    save = RESULTS / f"spawn-profile-n{n}.pstats"
                    for sort in ("tottime", "cumulative"):
                        md += [f"### N = {n}: top {args.top} by {sort} (all children summed)",
                               "", "```",
                               top_functions(stats_files, sort, args.top, save).strip(),
                               "```", ""]
        finally:
            zygote.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    write_results("spawn-profile", {"n": args.n, "reps": args.reps, "cprofile": args.cprofile,
                                    "jail": not args.no_jail, "results": results},
                  "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
