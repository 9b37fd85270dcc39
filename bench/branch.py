"""BRANCH benchmark: how long a running sandbox is paused, per mode, over repeated branches.

For each guest size (``--mem-mib``, default 256 and 1024) a warm parent is
snapshotted and one sandbox is forked from it (the source). For each dirtying
level (``--dirty-mib``, default 0 = idle and 100) and each mode (full, diff,
live), the source is branched ``--branches`` times in a row (default 10) with
``runtime.branch.branch_sandbox``, exactly as the daemon's branch route does;
before every branch the guest rewrites ``dirty`` MiB of a buffer, so each branch
has that much changed since the previous one. ``--children python native`` runs a Python child's source and a native child's (its
BRANCH through the machine's Python view, ``vmm/native_view.py``) side by side, their
branches taking turns (``run_series``: back to back, the host's drift over a series
was larger than the difference between them); ``native_b`` adds a third source, a
native child from a zygote with ``--b-env``'s environment (a knob's A/B in one run).
Each source's process is described before and after (``process_facts``: its page
tables, mappings, threads and seccomp filters, what a pause's kernel work walks). Reported per mode:

* **pause** -- the source's vCPUs were stopped (VMM-measured, ``pause_s``):
  p50, p95, max, and the 2nd vs the 10th branch (forkd's 6th once took 2.7 s);
  its host-side parts (vCPU state, device state, fork, scan, write, clear);
* **round trip** -- ``branch_sandbox`` call to published snapshot (``wait=True``),
  and for live also to return with ``wait=False``;
* **bytes written** by the VMM (the layer's data for diff).

The **QEMU peer** (``--qemu``, same run, same kernel and initramfs, idle guest of
each size): ``stop`` + ``migrate`` to a file + ``cont`` (what ``savevm`` does: the
pause covers the whole write), and a live ``migrate`` to a file, whose pause is
QEMU's reported ``downtime`` plus the ``cont`` that resumes the source after it.

The **floor** of a pause on this host: the control socket's ``pause`` +
``resume`` round trip with nothing captured, measured in the same run (inside the
emulated test host, kicking vCPUs and KVM's page-table work are far slower than
on hardware; compare ratios against it). forkd's published numbers
(REFERENCE-forkd.md; bare metal, 1.5 GiB source) are quoted for reference:
full ~13.5 s, diff 202 ms, live 56 ms p50 pause, ``wait:false`` 69 ms.

Writes ``bench/results/branch.{json,md}`` (``--name`` to change). On a host whose KVM cannot run
unmodified guests it re-runs itself inside the emulated test host, where only
ratios within the run mean anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ensure_kvm_host, write_results

MODES = ("full", "diff", "live")
CHILDREN = ("python", "native", "native_b")
FORKD = {"full": 13500.0, "diff": 202.0, "live": 56.0}
FORKD_WAIT_FALSE_MS = 69.0
WARM = "import json, os, sys\nwarm = bytes(range(256)) * 4096\n"
DIRTY = """
try:
    dirty_buf
except NameError:
    dirty_buf = bytearray({mib} << 20)
    dirty_round = 0
dirty_round = (dirty_round + 1) % 256
for _i in range(0, len(dirty_buf), 4096):
    dirty_buf[_i] = dirty_round
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mem-mib", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--dirty-mib", type=int, nargs="+", default=[0, 100])
    p.add_argument("--branches", type=int, default=10)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--children", nargs="+", default=["python"], choices=CHILDREN,
                   help="the source's VMM: a Python child, or a native one that runs no "
                        "Python (VMFORK_NATIVE_CHILD=1 or 0), each from a zygote of its own; "
                        "given both, their series alternate in one run")
    p.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                   help="the native_b child's zygote's environment beside native's (a "
                        "knob's before and after in one run; repeatable)")
    p.add_argument("--qemu", action="store_true",
                   help="also measure QEMU's stop+migrate-to-file and live-migrate pauses")
    p.add_argument("--name", default="branch",
                   help="results go to bench/results/<name>.{json,md}")
    p.add_argument("--host-mem-mib", type=int, default=6144)
    p.add_argument("--host-timeout", type=float, default=3600)
    args = p.parse_args()
    if ("native_b" in args.children) != bool(args.b_env):
        p.error("--b-env goes with the native_b child, and the native_b child with it")
    args.b_env = dict(item.split("=", 1) for item in args.b_env)
    return args


# What a pause's kernel work walks (fork and clear_refs: the page tables and mappings;
# every system call: the seccomp filters), read from the source's /proc.
PROCESS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmPTE", "Threads", "Seccomp_filters")


def process_facts(pid: int) -> dict[str, int]:
    """``PROCESS_FIELDS`` of ``pid`` (kB for sizes) and its count of mappings."""
    facts: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in PROCESS_FIELDS:
            facts[name] = int(value.split()[0])
    with open(f"/proc/{pid}/maps") as maps:
        facts["mappings"] = sum(1 for _ in maps)
    return facts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def stats(values: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(values), "p95": percentile(values, 0.95),
            "max": max(values), "min": min(values), "n": len(values)}


def pause_floor_ms(control: str, reps: int = 10) -> list[float]:
    """The control socket's pause + resume round trip: the floor of any pause here."""
    from vmfork.runtime.control import ControlClient, Pause, Resume
    out = []
    with ControlClient.connect(control, timeout=60) as client:
        for _ in range(reps):
            started = time.monotonic()
            client.call(Pause(), timeout=60)
            client.call(Resume(), timeout=60)
            out.append((time.monotonic() - started) * 1000)
            time.sleep(0.05)
    return out


def branch_once(store: Any, source: Any, mode: str, dirty_mib: int, tag: str,
                log: Any) -> dict[str, Any]:
    """One BRANCH of ``source`` as ``tag``, after its guest dirtied ``dirty_mib`` MiB."""
    from vmfork.runtime.branch import branch_sandbox
    control = str(source.run_dir / "control.sock")
    if dirty_mib:
        source.agent.exec(["python3", "-c", "pass"])   # keep the agent warm
        source.agent.eval(DIRTY.format(mib=dirty_mib))
    started = time.monotonic()
    job = branch_sandbox(store, control, tag, mode, sandbox_id=source.vm_id)
    result = job.result()
    # Keep the store small (the test host's disk is RAM). Diffs stay until the
    # series ends: each is a layer mapped over its parents (they are its memory),
    # and only the pages it changed.
    if mode != "diff":
        store.delete(tag)
    log(f"{tag}: pause {result.pause_ms:.1f} ms, round trip {result.total_ms:.0f} ms, "
        f"{result.memory_bytes >> 20} MiB written")
    return {"pause_ms": result.pause_ms, "round_trip_ms": result.total_ms,
            "memory_bytes": result.memory_bytes, "dirty_pages": result.dirty_pages,
            "base_tag": result.base_tag,
            "vmm_ms": {k: v * 1000 for k, v in result.vmm_timings.items()},
            "call_ms": (time.monotonic() - started) * 1000}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A series' stats: its pauses, round trips, bytes and each host-side part's p50."""
    out: dict[str, Any] = {"rows": rows,
                           "pause_ms": stats([r["pause_ms"] for r in rows]),
                           "round_trip_ms": stats([r["round_trip_ms"] for r in rows]),
                           "memory_mib": stats([r["memory_bytes"] / 2**20 for r in rows])}
    parts: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r["vmm_ms"].items():
            parts.setdefault(k, []).append(v)
    out["vmm_parts_p50_ms"] = {k: statistics.median(v) for k, v in parts.items()}
    if len(rows) >= 10:
        out["pause_2nd_ms"], out["pause_10th_ms"] = rows[1]["pause_ms"], rows[9]["pause_ms"]
    return out


def wait_false_ms(store: Any, source: Any, label: str) -> list[float]:
    """A live BRANCH's call to return with ``wait=False``, three times."""
    from vmfork.runtime.branch import branch_sandbox
    control = str(source.run_dir / "control.sock")
    trips = []
    for n in range(3):
        tag = f"{label}-nowait-{n}"
        started = time.monotonic()
        job = branch_sandbox(store, control, tag, "live", wait=False)
        trips.append((time.monotonic() - started) * 1000)
        job.result()
        store.delete(tag)
    return trips


def run_series(store: Any, sources: dict[str, Any], mode: str, dirty_mib: int,
               branches: int, labels: dict[str, str], log: Any) -> dict[str, dict[str, Any]]:
    """``branches`` BRANCHes of each source in ``mode``, the sources taking turns (the
    first one first in even rounds, last in odd ones), so that the host's drift over the
    series, which on a shared machine is larger than the difference measured, hits
    every source alike; each source's series summarized."""
    rows: dict[str, list[dict[str, Any]]] = {child: [] for child in sources}
    order = list(sources)
    for n in range(branches):
        for child in (order if n % 2 == 0 else order[::-1]):
            rows[child].append(branch_once(store, sources[child], mode, dirty_mib,
                                           f"{labels[child]}-{mode}-{n}", log))
    out = {}
    for child in sources:
        if mode == "diff":
            store.delete(f"{labels[child]}-{mode}-0", cascade=True)
        out[child] = summarize(rows[child])
    if mode == "live":
        trips: dict[str, list[float]] = {child: [] for child in sources}
        for child in order:
            trips[child] = wait_false_ms(store, sources[child], labels[child])
        for child in sources:
            out[child]["wait_false_ms"] = stats(trips[child])
    return out


def qemu_pauses(image: Any, mem_mib: int, workdir: Path, reps: int, log: Any) -> dict[str, Any]:
    """QEMU's pauses for a snapshot of a running idle guest (see the module notes)."""
    from spawn import QemuFleet, Qmp, wait_agent

    fleet = QemuFleet(image, mem_mib, workdir / f"qemu-{mem_mib}",
                      os.path.exists("/dev/vhost-vsock"))
    try:
        vm = fleet.start("source", 40)
        deadline = time.monotonic() + 900
        wait_agent(vm, fleet.vsock, deadline)
        qmp = Qmp(vm.qmp_path, deadline, vm.proc)
        target = workdir / f"qemu-{mem_mib}.state"

        def migrate() -> dict[str, Any]:
            qmp.execute("migrate", uri=f"exec:cat > {target}")
            while True:
                info: dict[str, Any] = qmp.execute("query-migrate")
                if info.get("status") == "completed":
                    return info
                if info.get("status") in ("failed", "cancelled"):
                    raise RuntimeError(f"QEMU migration {info.get('status')}: {info}")
                time.sleep(0.002)

        stop_copy, live = [], []
        for _ in range(reps):
            started = time.monotonic()
            qmp.execute("stop")
            migrate()
            qmp.execute("cont")
            stop_copy.append((time.monotonic() - started) * 1000)
            target.unlink()
        for _ in range(reps):
            info = migrate()
            resumed = time.monotonic()
            qmp.execute("cont")      # a completed migration leaves the source paused
            live.append(float(info.get("downtime", 0.0)) + (time.monotonic() - resumed) * 1000)
            target.unlink()
        qmp.close()
        log(f"qemu {mem_mib} MiB: stop+migrate p50 {statistics.median(stop_copy):.0f} ms, "
            f"live downtime p50 {statistics.median(live):.0f} ms")
        return {"stop_migrate_cont_ms": stats(stop_copy), "live_migrate_pause_ms": stats(live)}
    finally:
        fleet.kill_all()


def markdown(results: dict[str, Any], setup: dict[str, Any]) -> str:
    children = setup["children"]
    lines = ["# BRANCH: pause of a running sandbox", "",
             (f"Where: {setup['where']}. Guest image {setup['image']}; each series branches one "
              f"source {setup['branches']} times in a row (`runtime.branch.branch_sandbox`, "
              "what the REST route calls). Pause = the source's vCPUs stopped (VMM-measured). "
              "`floor` = control-socket pause+resume with nothing captured, same run."),
             f"Dirty tracking on this host: {setup['tracking']}.", "",
             ("| guest | dirtied/branch | child | mode | pause p50 | p95 | max | 2nd -> 10th "
              "| floor p50 | pause/floor | round trip p50 | written p50 | forkd pause |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, series in results.items():
        mem, dirty, child = key.split("/")
        floor = series["floor_ms"]["p50"]
        for mode in MODES:
            r = series.get(mode)
            if r is None:
                continue
            p = r["pause_ms"]
            trend = (f"{r['pause_2nd_ms']:.1f} -> {r['pause_10th_ms']:.1f}"
                     if "pause_10th_ms" in r else "-")
            lines.append(
                f"| {mem} MiB | {dirty} MiB | {child} | {mode} | {p['p50']:.1f} ms | "
                f"{p['p95']:.1f} | "
                f"{p['max']:.1f} | {trend} | {floor:.1f} ms | {p['p50'] / floor:.1f}x | "
                f"{r['round_trip_ms']['p50']:.0f} ms | {r['memory_mib']['p50']:.1f} MiB | "
                f"{FORKD[mode]:.0f} ms (1.5 GiB, bare metal) |")
    ratios = [f"{key} MiB: {s['diff']['pause_ms']['p50'] / s['live']['pause_ms']['p50']:.2f}x"
              for key, s in results.items() if "diff" in s and "live" in s]
    if ratios:
        lines += ["", "diff pause / live pause (p50, same source): " + ", ".join(ratios)
                  + " (issue 19's target: within 1.5x)."]
    lines += ["", "Host-side parts of the pause (p50, ms):", ""]
    for key, series in results.items():
        for mode in MODES:
            r = series.get(mode)
            if r is None:
                continue
            vmm = r["vmm_parts_p50_ms"]
            # A forked writer (live; diff of a sandbox) writes memory after the resume.
            after = ("total_s", "state_write_s") + (("memory_write_s",) if "fork_s" in vmm
                                                    else ())
            parts = ", ".join(f"{k.removesuffix('_s')} {v:.2f}"
                              for k, v in vmm.items() if k not in after)
            lines.append(f"- {key} MiB {mode}: {parts}")
    lines += ["", "The source's process before / after its series (sizes kB, from /proc):", ""]
    for key, series in results.items():
        before, after = series.get("process_before", {}), series.get("process_after", {})
        lines.append(f"- {key}: " + ", ".join(f"{k} {before.get(k)} / {after.get(k)}"
                                              for k in (*PROCESS_FIELDS, "mappings")))
    lives = [(k, s["live"]["wait_false_ms"]["p50"]) for k, s in results.items()
             if "live" in s and "wait_false_ms" in s["live"]]
    if lives:
        lines += ["", "`wait=False` live branch, call to return (p50): " + ", ".join(
            f"{k} MiB: {v:.1f} ms" for k, v in lives) + f" (forkd {FORKD_WAIT_FALSE_MS:.0f} ms)."]
    qemu = setup.get("qemu") or {}
    if qemu:
        def ours(mem: str, mode: str) -> float:
            series = results.get(f"{mem}/0/{children[0]}", {}).get(mode)
            return float(series["pause_ms"]["p50"]) if series else float("nan")

        lines += ["", "QEMU, same run, idle guest (pause p50):", ""]
        for mem, q in qemu.items():
            lines.append(f"- {mem} MiB: stop + migrate to a file + cont "
                         f"{q['stop_migrate_cont_ms']['p50']:.0f} ms (vmfork full "
                         f"{ours(mem, 'full'):.0f} ms); live migrate, downtime + cont "
                         f"{q['live_migrate_pause_ms']['p50']:.0f} ms (vmfork live "
                         f"{ours(mem, 'live'):.0f} ms)")
    lines += ["", ("forkd (REFERENCE-forkd.md): full ~13.5 s, diff 202 ms, live 56 ms p50 pause "
                   "on a 1.5 GiB source, bare metal; its 6th branch once paused 2.7 s. Figures "
                   "from the emulated test host are comparable as ratios (pause/floor) only."),
              ""]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=args.host_mem_mib,
                    timeout=args.host_timeout)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from _common import where

    from vmfork.image import find_image
    from vmfork.runtime.parent import snapshot_parent
    from vmfork.runtime.spawn import fork_children
    from vmfork.runtime.zygote_child import NATIVE_CHILD_ENV
    from vmfork.runtime.zygote_client import start_zygote
    from vmfork.store import Store
    from vmfork.vmm import dirty

    def log(msg: str) -> None:
        print(f"branch: {msg}", file=sys.stderr, flush=True)

    image = find_image()
    setup: dict[str, Any] = {"image": image.name, "branches": args.branches,
                             "children": args.children,
                             "where": where(),
                             "tracking": "soft-dirty" if dirty.soft_dirty_supported()
                             else "restore base only (no soft-dirty in this kernel)"}
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="vmfork-bench-branch-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        store = Store.open(workdir / "home")
        clients = {}
        for child in args.children:
            env = {**os.environ, NATIVE_CHILD_ENV: "0" if child == "python" else "1",
                   **(args.b_env if child == "native_b" else {})}
            with open(workdir / f"zygote-{child}.log", "wb") as zlog:
                zygote = start_zygote(str(workdir / f"zygote-{child}.sock"), stderr=zlog,
                                      timeout=300.0, env=env)
            stack.callback(zygote.close)
            clients[child] = zygote.client()
        for mem in args.mem_mib:
            log(f"snapshotting a {mem} MiB parent")
            parent = snapshot_parent(store, f"parent-{mem}", image, mem_mib=mem,
                                     warm_code=WARM).snapshot
            for dirty_mib in args.dirty_mib:
                sources: dict[str, Any] = {}
                try:
                    # Every kind's source runs at once, and each step takes turns
                    # between them (run_series says why).
                    for child in args.children:
                        report = fork_children(clients[child], parent, 1, workdir / "vms",
                                               timeout=600)
                        if report.failed:
                            raise RuntimeError(f"source did not start: {report.failed}")
                        sources[child] = report.children[0]
                    series: dict[str, dict[str, Any]] = {child: {} for child in sources}
                    floors: dict[str, list[float]] = {child: [] for child in sources}
                    for _ in range(2):
                        for child, source in sources.items():
                            floors[child] += pause_floor_ms(
                                str(source.run_dir / "control.sock"), reps=5)
                    for child, source in sources.items():
                        series[child]["floor_ms"] = stats(floors[child])
                        series[child]["process_before"] = process_facts(source.pid)
                    labels = {child: f"m{mem}-d{dirty_mib}-{child}" for child in sources}
                    for mode in args.modes:
                        for child, out in run_series(store, sources, mode, dirty_mib,
                                                     args.branches, labels, log).items():
                            series[child][mode] = out
                    for child, source in sources.items():
                        series[child]["process_after"] = process_facts(source.pid)
                        log(f"{child} source: {series[child]['process_before']} before, "
                            f"{series[child]['process_after']} after")
                        results[f"{mem}/{dirty_mib}/{child}"] = series[child]
                finally:
                    for child, source in sources.items():
                        clients[child].kill_and_wait(source.vm_id)
                for snap in sorted(store.list(), key=lambda s: -s.meta.created_at_unix):
                    if snap.tag != parent.tag:
                        store.delete(snap.tag)
            if args.qemu:
                try:
                    setup.setdefault("qemu", {})[str(mem)] = qemu_pauses(
                        image, mem, workdir, args.branches, log)
                except Exception as err:  # noqa: BLE001 -- the peer is optional; say why
                    setup.setdefault("qemu_errors", {})[str(mem)] = repr(err)
                    log(f"qemu {mem} MiB failed: {err!r}")
    write_results(args.name, {"setup": setup, "results": results}, markdown(results, setup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
