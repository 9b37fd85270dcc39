"""Where an idle native child's own memory goes, mapping by mapping, per build.

A child that runs no Python (``VMFORK_NATIVE_CHILD=1``) writes no memory-phase records
(``runtime/memphases.py`` records from Python), so this reads it from outside: N
children of one warm snapshot are spawned, left idle ``--settle`` seconds, and each
one's ``/proc/<pid>/smaps`` is classified by ``memphases.mappings`` (guest RAM apart,
as ``bench/spawn.py`` counts "own": every Private_Dirty page but the guest RAM
mapping's). Each thread's stack is named by the thread whose stack pointer
(``/proc/<pid>/task/<tid>/syscall``, the thread blocked in a syscall) lies in it.

``--tree NAME=SRC`` (repeatable) measures the children of several builds in one run,
alternated per repetition, so drift on a shared machine hits each alike: ``SRC`` is a
``src`` directory with its own ``vmfork/_core.abi3.so`` (e.g. a copy of main's, taken
before a change), whose zygote forks the children; the snapshot is made once, by this
tree. Without it, this tree alone. Runs in the emulated test host when this host's
KVM cannot run guests. Writes ``bench/results/native-child-memory.{json,md}``.

    VMFORK_NATIVE_CHILD=1 python bench/native_child_memory.py --n 1,10 --reps 2 \\
        --tree before=~/.cache/before/src --tree after=src --host-mem-mib 6144
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _common import REPO, ensure_kvm_host, write_results

MEM_MIB = 256
WARM = "import json, hashlib\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=lambda s: [int(x) for x in s.split(",")], default=[1, 10],
                        help="children per spawn, comma-separated")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds idle after every agent answered")
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=SRC: a build's src directory (repeatable; default: this tree)")
    parser.add_argument("--host-mem-mib", type=int, default=6144)
    parser.add_argument("--host-timeout", type=float, default=3600.0)
    parser.add_argument("--worker", nargs=4, metavar=("HOME", "TAG", "N", "OUT"),
                        help=argparse.SUPPRESS)
    return parser.parse_args()


def stack_owners(pid: int) -> dict[int, str]:
    """Each blocked thread's stack pointer -> its name (``comm``)."""
    owners: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "syscall").read_text().split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        if len(fields) >= 3 and fields[0] != "running":
            owners[int(fields[-2], 16)] = f"{name}:{task.name}"
    return owners


def worker(home: str, tag: str, n: int, out: str, settle: float) -> None:
    """In the build under test (its ``vmfork`` on ``PYTHONPATH``): spawn, idle, dump."""
    from vmfork.runtime.spawn import fork_children
    from vmfork.runtime.zygote_child import NATIVE_CHILD_ENV
    from vmfork.runtime.zygote_client import start_zygote
    from vmfork.store import Store

    snapshot = Store.open(home).get(tag)
    runs = Path(tempfile.mkdtemp(prefix="vmfork-nmem-"))
    zygote = start_zygote(str(runs / "z.sock"), timeout=300.0,
                          env={**os.environ, NATIVE_CHILD_ENV: "1"})
    try:
        report = fork_children(zygote.client(timeout=300.0), snapshot, n, runs / "vms",
                               timeout=600.0)
        if report.failed:
            raise SystemExit(f"children failed: {report.failed}")
        time.sleep(settle)
        dumps = [{"pid": c.pid, "smaps": Path(f"/proc/{c.pid}/smaps").read_text(),
                  "stacks": {str(sp): who for sp, who in stack_owners(c.pid).items()}}
                 for c in report.children]
        Path(out).write_text(json.dumps({"memory_path": str(snapshot.memory_path),
                                         "children": dumps}))
    finally:
        zygote.close()


def breakdown(dump: dict[str, Any], memory_path: str) -> dict[str, int]:
    """One child's own Private_Dirty (KiB) by class, each thread's stack apart."""
    from vmfork.runtime import memphases
    is_ram = memphases.guest_ram_paths([memory_path], MEM_MIB << 20)
    stacks = {int(sp): who.split(":")[0] for sp, who in dump["stacks"].items()}
    out: Counter[str] = Counter()
    for m in memphases.mappings(dump["smaps"].encode(), is_ram):
        if m.cls == "guest_ram":
            continue
        key = m.cls
        if m.cls == "thread_stacks":
            names = sorted(who for sp, who in stacks.items() if m.start <= sp < m.end)
            key = f"stack: {names[0] if names else 'exited thread'}"
        elif m.cls in ("python_binary", "core_so", "other_libraries") and m.path:
            key = f"{m.cls}: {os.path.basename(m.path)}"
        out[key] += m.private_dirty_kib
    out["own total"] = sum(v for k, v in out.items())
    return dict(out)


def main() -> int:
    args = parse_args()
    if args.worker:
        home, tag, n, out = args.worker
        worker(home, tag, int(n), out, args.settle)
        return 0
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=args.host_mem_mib,
                    timeout=args.host_timeout)
    from vmfork.image import find_image
    from vmfork.runtime.parent import snapshot_parent
    from vmfork.store import Store

    trees = dict(t.split("=", 1) for t in args.tree) or {"this tree": str(REPO / "src")}
    work = Path(tempfile.mkdtemp(prefix="vmfork-nmem-"))
    home = work / "home"
    print("snapshotting the parent", file=sys.stderr, flush=True)
    snapshot_parent(Store.open(home), "nmem", find_image(), mem_mib=MEM_MIB, warm_code=WARM)
    per: dict[str, dict[int, list[dict[str, int]]]] = {t: {} for t in trees}
    for rep in range(args.reps):
        for n in args.n:
            for name, src in trees.items():
                print(f"{name} N={n} run {rep + 1}", file=sys.stderr, flush=True)
                out = work / f"{name}-{n}-{rep}.json".replace(" ", "_")
                env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
                subprocess.run([sys.executable, __file__, "--settle", str(args.settle),
                                "--worker", str(home), "nmem", str(n), str(out)],
                               env=env, check=True)
                got = json.loads(out.read_text())
                per[name].setdefault(n, []).extend(
                    breakdown(c, got["memory_path"]) for c in got["children"])
    md = render(per, args)
    write_results("native-child-memory", {"n": args.n, "reps": args.reps, "trees": trees,
                                          "children": {t: {str(n): v for n, v in by.items()}
                                                       for t, by in per.items()}}, md)
    return 0


def render(per: dict[str, dict[int, list[dict[str, int]]]], args: argparse.Namespace) -> str:
    """Median KiB per class over every child, per tree and N."""
    columns = [(t, n) for n in args.n for t in per if per[t].get(n)]
    keys = sorted({k for t, n in columns for c in per[t][n] for k in c},
                  key=lambda k: (k == "own total", k))
    md = ["# An idle native child's own Private_Dirty, KiB (median over children)", "",
          f"`{' '.join(sys.argv)}`; {args.reps} runs alternated, settle {args.settle} s.", "",
          "| mapping | " + " | ".join(f"{t} N = {n}" for t, n in columns) + " |",
          "|---|" + "---|" * len(columns)]
    for key in keys:
        cells = [statistics.median(c.get(key, 0) for c in per[t][n]) for t, n in columns]
        if any(cells):
            md.append(f"| {key} | " + " | ".join(f"{v:.0f}" for v in cells) + " |")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    sys.exit(main())
