"""The E2B workload through E2B's own Python SDK against ``vmfork serve``, real guests.

An unmodified ``e2b`` SDK (pinned, its own venv: ``scripts/lib.sh setup_e2b_sdk``),
pointed at the daemon by environment variables only (``E2B_API_KEY``, ``E2B_API_URL``,
``E2B_SANDBOX_URL``), runs the same workload for each of ``--sandboxes`` sandboxes:

    Sandbox.create(template=<snapshot tag>) → commands.run("echo …") →
    files.write(path, 4 KiB) → files.read(path) → kill()

each call timed, and the whole 20-sandbox workload timed end to end (``--concurrency``
sandboxes at once, 1 by default, so each call's latency is its own). Then the fork of a
running sandbox, as the pinned SDK exposes it (``sandbox.fork(count=1)``: the daemon
BRANCHes the sandbox and spawns from the branch), ``--forks`` times, each fork checked
to hold a file its parent wrote and a process its parent started; then ``--pauses``
rounds of ``pause()`` and ``Sandbox.connect(id)`` (resuming into the same id, a file
kept) of that parent, beside E2B's published pause and resume figures. One sandbox is
made and killed first, untimed but reported (the first spawn of a snapshot maps it).

Reports per-call p50/p90 and writes ``bench/results/e2b.{json,md}``, with E2B's own
published figures beside ours, labelled as published and not measured here (E2B's
service cannot be reached from here). On a host whose KVM cannot run unmodified guests
it re-runs itself inside the emulated test host, where only ratios within the run mean
anything.

    python bench/e2b.py [--sandboxes 20] [--forks 5] [--pauses 3] [--concurrency 1]

The same file is the workload itself when run by the SDK's interpreter (``--workload``),
which has the ``e2b`` package and not vmfork.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEMPLATE = "e2b-bench"
TOKEN = "e2b-bench-token-0123456789abcdef"
PAYLOAD = bytes(range(256)) * 16   # 4 KiB, every byte value
CALLS = ("create", "commands.run", "files.write", "files.read", "kill")
FORK_CALLS = ("fork", "fork: child files.read", "pause", "connect (resumes)")

_PERSISTENCE = ("E2B's documentation, \"Sandbox persistence\", section \"Limitations "
                "while in beta\" (the e2b-dev/E2B repository's "
                "`apps/web/src/app/(docs)/docs/sandbox/persistence/page.mdx`)")
PUBLISHED: list[tuple[str, str, str]] = [
    ("pause a sandbox (`pause()`; memory and filesystem saved)",
     "about 4 s per 1 GiB of RAM", _PERSISTENCE),
    ("resume a paused sandbox (`connect()`)", "about 1 s", _PERSISTENCE),
]
"""E2B's own published figures, as E2B's documentation states them: (what, figure,
where). None is measured here. E2B's documentation gives no figure for create,
``commands.run``, file calls, kill or ``fork``; figures for those found elsewhere
(third parties' articles) are not E2B's and are left out."""
NOT_PUBLISHED = ("E2B's documentation publishes no latency for `Sandbox.create`, "
                 "`commands.run`, `files.write`/`files.read`, `kill` or `fork`, so "
                 "nothing stands beside those rows.")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile by the nearest-rank method (no interpolation between runs)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def stats_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "p50": percentile(ms, 0.5), "p90": percentile(ms, 0.9),
            "min": min(ms), "max": max(ms), "mean": sum(ms) / len(ms)}


# -- the workload: run by the E2B SDK's interpreter -------------------------------------

def workload(sandboxes: int, forks: int, pauses: int, concurrency: int) -> dict[str, Any]:
    # This file is bench/e2b.py: its directory must not shadow the SDK's package.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from e2b import Sandbox

    times: dict[str, list[float]] = {name: [] for name in (*CALLS, *FORK_CALLS)}
    lock = threading.Lock()

    def timed(name: str, call: Any) -> Any:
        started = time.perf_counter()
        result = call()
        with lock:
            times[name].append(time.perf_counter() - started)
        return result

    started = time.perf_counter()
    Sandbox.create(template=TEMPLATE).kill()
    first = time.perf_counter() - started

    def one(i: int) -> float:
        began = time.perf_counter()
        sandbox = timed("create", lambda: Sandbox.create(template=TEMPLATE))
        try:
            run = timed("commands.run", lambda: sandbox.commands.run(f"echo sandbox-{i}"))
            if run.stdout != f"sandbox-{i}\n" or run.exit_code != 0:
                raise AssertionError(f"sandbox {i}: commands.run gave {run!r}")
            path = f"/tmp/bench-{i}.bin"
            timed("files.write", lambda: sandbox.files.write(path, PAYLOAD))
            got = timed("files.read", lambda: sandbox.files.read(path, format="bytes"))
            if bytes(got) != PAYLOAD:
                raise AssertionError(f"sandbox {i}: files.read gave {len(got)} other bytes")
        finally:
            timed("kill", sandbox.kill)
        return time.perf_counter() - began

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        per_sandbox = list(pool.map(one, range(sandboxes)))
    total = time.perf_counter() - started

    parent = Sandbox.create(template=TEMPLATE)
    try:
        parent.files.write("/tmp/before-fork.txt", "written before the fork")
        counter = parent.commands.run("i=0; while true; do i=$((i+1)); echo $i > "
                                      "/tmp/counter; sleep 0.2; done", background=True)
        for k in range(forks):
            made = timed("fork", lambda: parent.fork(count=1))
            if len(made) != 1 or isinstance(made[0], Exception):
                raise AssertionError(f"fork {k}: {made!r}")
            child = made[0]
            try:
                kept = timed("fork: child files.read",
                             lambda c=child: c.files.read("/tmp/before-fork.txt"))
                if kept != "written before the fork":
                    raise AssertionError(f"fork {k}: the parent's file reads {kept!r}")
                running = child.commands.run(f"kill -0 {counter.pid} && echo alive").stdout
                if running != "alive\n":
                    raise AssertionError(f"fork {k}: the parent's loop is not running")
                if child.sandbox_id == parent.sandbox_id:
                    raise AssertionError(f"fork {k}: the fork has its parent's id")
            finally:
                child.kill()
        counter.kill()
        for k in range(pauses):
            parent.files.write("/tmp/before-pause.txt", f"pause {k}")
            timed("pause", parent.pause)
            parent = timed("connect (resumes)",
                           lambda same=parent.sandbox_id: Sandbox.connect(same))
            kept = parent.files.read("/tmp/before-pause.txt")
            if kept != f"pause {k}":
                raise AssertionError(f"pause {k}: the resumed sandbox's file reads {kept!r}")
    finally:
        parent.kill()
    return {"first_create_kill_s": first, "total_s": total, "per_sandbox_s": per_sandbox,
            "calls_s": times}


# -- the driver: a daemon, the snapshot, the SDK --------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from _common import REPO
    sys.path.insert(0, str(REPO))
    from tests.e2b_sdk import E2B_SDK_VERSION, e2b_env, sdk_python
    from tests.mcp_support import running_daemon

    python = sdk_python()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="vmfork-e2b-bench-") as tmp, \
            running_daemon(Path(tmp), token=TOKEN, bind=f"127.0.0.1:{port}") as d:
        started = time.perf_counter()
        d.controller.create_snapshot(TEMPLATE, mem_mib=args.mem_mib)
        snapshot_s = time.perf_counter() - started
        done = subprocess.run(
            [str(python), __file__, "--workload", "--sandboxes", str(args.sandboxes),
             "--forks", str(args.forks), "--pauses", str(args.pauses),
             "--concurrency", str(args.concurrency)],
            env=e2b_env(url, TOKEN), capture_output=True, text=True,
            timeout=args.workload_timeout)
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            raise SystemExit(f"the E2B workload exited {done.returncode}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        left = d.controller.list_sandboxes()
        if left:
            raise SystemExit(f"the workload left {len(left)} sandboxes running")
    return {"sdk": f"e2b {E2B_SDK_VERSION} (Python)", "snapshot_s": snapshot_s, **measured}


def markdown(data: dict[str, Any], where_: str) -> str:
    calls = data["calls_ms"]
    rows = "".join(f"| `{name}` | {s['n']} | {s['p50']:.0f} | {s['p90']:.0f} | "
                   f"{s['min']:.0f} | {s['max']:.0f} |\n"
                   for name, s in calls.items())
    per = data["per_sandbox_ms"]
    published = ("".join(f"| {what} | {figure} | {source} |\n"
                         for what, figure, source in PUBLISHED)
                 if PUBLISHED else "| (none found in E2B's documentation) | | |\n")
    return (
        "# E2B's SDK against vmfork: the 20-sandbox workload and fork\n\n"
        f"{where_}; {data['sdk']}, unmodified, against `vmfork serve` (real guests, "
        f"snapshot of {data['mem_mib']} MiB). {data['sandboxes']} sandboxes, "
        f"{data['concurrency']} at a time: create → `commands.run` → `files.write` "
        f"(4 KiB) → `files.read` → `kill`; then {data['forks']} forks of one running "
        f"sandbox (`sandbox.fork(count=1)`), and {data['pauses']} rounds of `pause()` and "
        "`Sandbox.connect(id)` (which resumes it into the same id) of that sandbox.\n\n"
        "| call | n | p50 ms | p90 ms | min ms | max ms |\n|---|---|---|---|---|---|\n"
        f"{rows}"
        f"| one sandbox, create to kill | {per['n']} | {per['p50']:.0f} | "
        f"{per['p90']:.0f} | {per['min']:.0f} | {per['max']:.0f} |\n\n"
        f"The whole {data['sandboxes']}-sandbox workload, end to end: "
        f"**{data['total_s']:.1f} s**. First sandbox of the snapshot (create + kill, "
        f"not in the table): {data['first_create_kill_s']:.2f} s. Making the snapshot: "
        f"{data['snapshot_s']:.1f} s.\n\n"
        "## E2B's published figures (published by E2B, not measured here)\n\n"
        "| what | figure | where |\n|---|---|---|\n" + published
        + f"\n{NOT_PUBLISHED} E2B's `fork` checkpoints the running sandbox in place "
        "(briefly paused, snapshotted with its memory, resumed: its SDKs' release "
        "notes) and starts the forks from that snapshot, so its pause and resume "
        "figures are the nearest published ones to `fork` as well as to the `pause` and "
        "`connect` rows.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--forks", type=int, default=5)
    parser.add_argument("--pauses", type=int, default=3, help="pause + connect rounds")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--mem-mib", type=int, default=256, help="the snapshot's guest RAM")
    parser.add_argument("--workload-timeout", type=float, default=2400)
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not (1 <= args.sandboxes <= 200 and 0 <= args.forks <= 50 and 0 <= args.pauses <= 50
            and 1 <= args.concurrency <= args.sandboxes):
        parser.error("--sandboxes 1-200, --forks 0-50, --pauses 0-50, --concurrency "
                     "1..sandboxes")
    if args.workload:
        print(json.dumps(workload(args.sandboxes, args.forks, args.pauses, args.concurrency)))
        return

    from _common import ensure_kvm_host, where, write_results
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=4096, timeout=args.workload_timeout + 900)
    measured = drive(args)
    data: dict[str, Any] = {
        "sdk": measured["sdk"], "sandboxes": args.sandboxes, "forks": args.forks,
        "pauses": args.pauses,
        "concurrency": args.concurrency, "mem_mib": args.mem_mib,
        "snapshot_s": measured["snapshot_s"], "total_s": measured["total_s"],
        "first_create_kill_s": measured["first_create_kill_s"],
        "per_sandbox_ms": stats_ms(measured["per_sandbox_s"]),
        "calls_ms": {name: stats_ms(values)
                     for name, values in measured["calls_s"].items() if values},
        "published_by_e2b_not_measured": [
            {"what": w, "figure": f, "source": s} for w, f, s in PUBLISHED],
        "not_published_by_e2b": NOT_PUBLISHED,
    }
    write_results("e2b", data, markdown(data, where()))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
