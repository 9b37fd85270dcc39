"""A REST spawn's own share: the daemon's time around a spawn, beside the same spawn
driven directly.

One daemon in this process (its real zygote, real VMs, children that run no Python)
boots and warms a ``--mem-mib`` guest as ``base``. Then ``--spawns`` rounds, each two
single-sandbox spawns of it in alternating order:

* **rest** -- ``POST /v1/sandboxes`` through the Python SDK: the HTTP front, the
  controller's checks (the snapshot, its plan, admission, volumes), the spawner, and
  after the children are ready the registry and the answer;
* **direct** -- the daemon's own spawner called in this process
  (``Spawner.spawn``: ``fork_children`` on the same zygote), which is what
  ``bench/spawn.py`` measures.

Each child records its phases (``VMFORK_SPAWN_PROFILE``), so per spawn: from the
call to the zygote's fork of the child (**to fork**), to the child's restored report
(**to restored**), and to the caller holding the answer (**answered**, after every
agent answered). rest - direct is the daemon's own share: what an SDK's or an E2B
client's spawn pays beyond the spawn itself. Medians; in the emulated test host only
the difference and ratios within the run mean anything.

    python bench/rest_spawn.py [--spawns 12] [--mem-mib 256]

Writes ``bench/results/rest_spawn.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ensure_kvm_host, local_daemon, write_results

SIDES = ("rest", "direct")
COLUMNS = (("to_fork_ms", "to fork"), ("to_restored_ms", "to restored"),
           ("answered_ms", "answered"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spawns", type=int, default=12,
                        help="rounds; each spawns once by REST and once directly")
    parser.add_argument("--mem-mib", type=int, default=256)
    parser.add_argument("--host-mem-mib", type=int, default=6144)
    parser.add_argument("--host-timeout", type=float, default=3600.0)
    args = parser.parse_args()
    if args.spawns < 1:
        parser.error("--spawns must be at least 1")
    return args


def child_marks(run_dir: Path, timeout: float = 10.0) -> dict[str, int]:
    """The child's phase marks (monotonic ns by phase); it writes them just after
    ready. Raises if it wrote none."""
    import json

    from vmfork.runtime import spawnprofile
    deadline = time.monotonic() + timeout
    while True:
        try:
            record = json.loads((run_dir / spawnprofile.PROFILE_FILE).read_text())
            return {m["phase"]: int(m["mono_ns"]) for m in record["marks"]}
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{run_dir}: the child recorded no phases") from None
            time.sleep(0.05)


def measure(spawn: Callable[[], tuple[str, Path]], kill: Callable[[str], None]
            ) -> dict[str, float]:
    called = time.monotonic()
    sandbox, run_dir = spawn()
    answered = time.monotonic()
    try:
        marks = child_marks(run_dir)
    finally:
        kill(sandbox)
    called_ns = int(called * 1e9)
    return {"to_fork_ms": (marks["fork"] - called_ns) / 1e6,
            "to_restored_ms": (marks["restored_report"] - called_ns) / 1e6,
            "answered_ms": (answered - called) * 1000}


def main() -> int:
    args = parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=args.host_mem_mib,
                    timeout=args.host_timeout)
    from vmfork.runtime import spawnprofile
    from vmfork.store import Store

    os.environ[spawnprofile.ENV] = "1"   # read once, by the zygote
    work = Path(tempfile.mkdtemp(prefix="vmfork-bench-rest-spawn-"))
    home = work / "home"
    daemon, ctl = local_daemon(work, home, networking=False)
    samples: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    try:
        ctl.create_snapshot("base", mem_mib=args.mem_mib, warm_code="import json, os, sys")
        snap = Store.open(home).get("base")
        spawner = daemon.controller.core.require_spawner()

        def rest() -> tuple[str, Path]:
            sandbox = ctl.spawn_sandboxes("base", 1)[0]["id"]
            return sandbox, Path(daemon.controller.sandbox_run_dir(sandbox))

        def direct() -> tuple[str, Path]:
            child = spawner.spawn(snap, 1, None).children[0]
            return child.vm_id, Path(child.run_dir)

        sides = {"rest": (rest, ctl.kill_sandbox), "direct": (direct, spawner.kill)}
        for side in SIDES:   # unmeasured: the first spawn maps the snapshot
            measure(*sides[side])
        for round_ in range(args.spawns):
            for side in SIDES[round_ % 2:] + SIDES[:round_ % 2]:
                samples[side].append(measure(*sides[side]))
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    medians = {side: {key: statistics.median(s[key] for s in samples[side])
                      for key, _ in COLUMNS} for side in SIDES}
    share = {key: medians["rest"][key] - medians["direct"][key] for key, _ in COLUMNS}
    lines = [f"# A REST spawn's own share ({args.spawns} spawns a side, alternated; "
             f"{args.mem_mib} MiB guest, native children)", "",
             "| median ms from the call | " + " | ".join(t for _, t in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for side in SIDES:
        lines.append(f"| {side} | " + " | ".join(f"{medians[side][k]:.1f}"
                                               for k, _ in COLUMNS) + " |")
    lines.append("| rest - direct (the daemon's own) | "
                 + " | ".join(f"{share[k]:+.1f}" for k, _ in COLUMNS) + " |")
    lines += ["", "*to fork*: the call to the zygote's fork of the child; *to restored*: "
              "to the child's restored report; *answered*: to the caller holding the "
              "answer, every agent having answered."]
    data: dict[str, Any] = {"spawns": args.spawns, "mem_mib": args.mem_mib,
                            "medians_ms": medians, "daemon_share_ms": share,
                            "samples": samples}
    write_results("rest_spawn", data, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
