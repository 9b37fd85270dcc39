"""forkd's README chain, as written (with ``--network``): build time, layer size, spawn time.

A package index (``tests/pip_index.py``, the pinned wheels the set-up fetched) is served
in a network namespace standing for the internet; a daemon (in this process, with host
networks) takes the CLI's requests. Then, through ``vmfork`` on the command line:

    vmfork snapshot --tag py-base --network --mem-mib 1024 --warm-cmd '<pip.conf: the index>'
    vmfork snapshot-diff --from py-base  --tag py-numpy  --network --exec "pip install numpy==2.0.2"
    vmfork snapshot-diff --from py-numpy --tag py-pandas --network --exec "pip install pandas==2.2.3"

(the base's ``/etc/pip.conf`` names the index, as a mirror would, turns pip's wheel
cache off, since a cache in a snapshot is never read again, and gives a read 300 s
instead of 15: a guest's network in the loaded emulated host stalls for longer). Reported, from one run: each
link's build time (the CLI command, spawn + pip + BRANCH), its layer (``changed_bytes``)
against what pip installed (every file of the distributions' RECORDs, measured in a
child of the head, both in apparent bytes and in the bytes the guest's tmpfs allocated
for them -- the issue's measure, ``du``'s), what the layer's pages are now (a child of
the link reads ``/proc/kpageflags`` for them), and ``--spawns`` single-sandbox spawns of
the head against the base (request to agent ready), alternating. Writes
``bench/results/pip-chain.{json,md}`` (``pip-chain-no-balloon.*`` with ``--no-balloon``).
``--compare`` runs it with and without the balloon alternately, ``--rounds`` pairs (each
a process of its own), and writes ``pip-chain-compare.*``; ``--links 1`` builds numpy
alone.

Where a layer's pages are: a child of every snapshot reads ``/proc/meminfo``, and each
link is reported as the change from its parent (memory in use, tmpfs -- which holds
what pip installed, the root being a RAM overlay --, page cache, anonymous, slab), with
what the VMM's balloon dropped before the capture (free page reporting,
``vmm/devices/virtio/balloon.py``; ``--no-balloon`` boots the base without one, the
"before" of the same run conditions). Inside the emulated test host only the ratios
within the run mean anything.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ensure_kvm_host, write_results

LINKS = (("py-base", "py-numpy", "pip install numpy==2.0.2", ("numpy",)),
         ("py-numpy", "py-pandas", "pip install pandas==2.2.3",
          ("pandas", "python-dateutil", "pytz", "tzdata", "six")))
MIB = 1 << 20
MEMINFO = ("MemFree", "Shmem", "Cached", "AnonPages", "Slab", "PageTables")
# What a child of the head checks, by how many links were built.
CHECK = {1: "import numpy; print(numpy.__version__, int(numpy.arange(10).sum()))",
         2: ("import numpy, pandas; print(numpy.__version__, pandas.__version__, "
             "int(pandas.Series(numpy.arange(10)).sum()))")}
CHECK_OUT = {1: "2.0.2 45", 2: "2.0.2 2.2.3 45"}
# What each page of a layer is now, read in a child of the link from /proc/kpageflags
# (the child's memory is the link's, give or take what this script itself allocates):
# argv[1] is the layer's extents as zlib'd JSON [[first pfn, pages], ...], base64.
# Bits: include/uapi/linux/kernel-page-flags.h (PG_reported shares PG_uptodate's bit).
PAGE_KINDS = r"""
import base64, json, struct, sys, zlib
runs = json.loads(zlib.decompress(base64.b64decode(sys.argv[1])))
def kind(f):
    bit = lambda n: f >> n & 1
    if bit(32): return "reserved (kernel image, struct page array)"
    if bit(10): return "free, reported" if bit(3) else "free, not reported"
    if bit(26): return "page table"
    if bit(7): return "slab"
    if bit(12): return "anonymous"
    if bit(14): return "tmpfs"
    if bit(5): return "page cache"
    if bit(15) or bit(16): return "compound, other"
    if f == 0: return "no flags (tail of a free block, or kernel)"
    return "other"
kinds = {}
with open("/proc/kpageflags", "rb") as f:
    for first, pages in runs:
        f.seek(first * 8)
        for (flags,) in struct.iter_unpack("<Q", f.read(pages * 8)):
            k = kind(flags)
            kinds[k] = kinds.get(k, 0) + 1
print(json.dumps(kinds))
"""
READ_MEMINFO = ("import json; print(json.dumps({l.split(':')[0]: int(l.split()[1]) * 1024 "
                "for l in open('/proc/meminfo')}))")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mem-mib", type=int, default=1024)
    p.add_argument("--spawns", type=int, default=5, help="spawns of head and of base each")
    p.add_argument("--host-mem-mib", type=int, default=4096)
    p.add_argument("--host-timeout", type=float, default=3600)
    p.add_argument("--no-balloon", action="store_true",
                   help="boot the base without the free-page-reporting balloon (VMFORK_BALLOON=0)")
    p.add_argument("--links", type=int, choices=(1, 2), default=2,
                   help="build the first N links (1: numpy only)")
    p.add_argument("--compare", action="store_true",
                   help="in one test host: the chain with the balloon and without it, "
                        "alternating, --rounds times")
    p.add_argument("--rounds", type=int, default=2, help="with --compare: with/without pairs")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=args.host_mem_mib,
                    timeout=args.host_timeout)
    if args.compare:
        return compare(args)
    sys.path.insert(0, str(REPO))
    from tests.pip_index import INSTALLED, index_on_the_internet
    from vmfork.client import Controller
    from vmfork.runtime import network
    from vmfork.server.daemon import Daemon, DaemonConfig

    if args.no_balloon:
        os.environ["VMFORK_BALLOON"] = "0"    # the daemon boots the base in this process tree
    from vmfork.store import Store

    work = Path(tempfile.mkdtemp(prefix="vmfork-bench-pip-chain-"))
    sock = work / "api.sock"
    env = dict(os.environ, VMFORK_HOME=str(work / "home"),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))

    def cli(*argv: str) -> float:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "vmfork", *argv, "--url", f"unix://{sock}"],
                              env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"vmfork {' '.join(argv)} failed ({done.returncode}):\n"
                             f"{done.stdout}\n{done.stderr}")
        return time.monotonic() - started

    with index_on_the_internet("vmfb-inet", link="bpinet") as index:
        daemon = Daemon(DaemonConfig(state_dir=work / "state", socket_path=sock, bind=None,
                                     snapshot_root=work / "home", network_prefix="vmfb",
                                     network_subnet="10.202.0.0/16",
                                     kill_sandboxes_on_exit=True))
        daemon.start()
        try:
            ctl = Controller(f"unix://{sock}", timeout=3600)
            host = index.split("/")[2].split(":")[0]
            pip_conf = (f"printf '[global]\\nindex-url = {index}\\ntrusted-host = {host}\\n"
                        "no-cache-dir = true\\ndisable-pip-version-check = true\\n"
                        "timeout = 300\\n' "
                        "> /etc/pip.conf")
            base_s = cli("snapshot", "--tag", "py-base", "--network", "--mem-mib",
                         str(args.mem_mib), "--warm-cmd", pip_conf)
            links: list[dict[str, Any]] = []
            for parent, tag, command, _ in LINKS[:args.links]:
                # --timeout: pip under TCG emulation can take longer than the default 600 s.
                seconds = cli("snapshot-diff", "--from", parent, "--tag", tag, "--network",
                              "--exec", command, "--timeout", "3000")
                links.append({"tag": tag, "from": parent, "exec": command,
                              "build_s": round(seconds, 1),
                              "layer_bytes": ctl.snapshot_info(tag)["changed_bytes"]})
            head = links[-1]["tag"]
            child = ctl.spawn_sandboxes(head, 1)[0]["id"]
            try:
                check = ctl.exec_command(child, ["python3", "-c", CHECK[args.links]],
                                         timeout_secs=900)
                assert check["stdout"].strip() == CHECK_OUT[args.links], check
                for link, (_, _, _, names) in zip(links, LINKS, strict=False):
                    out = ctl.exec_command(child, ["python3", "-c", INSTALLED, *names],
                                           timeout_secs=900)
                    apparent, allocated = (int(n) for n in out["stdout"].split())
                    link["installed_bytes"] = apparent
                    link["installed_allocated_bytes"] = allocated
                    link["layer_over_installed"] = round(link["layer_bytes"] / apparent, 2)
                    link["layer_over_allocated"] = round(link["layer_bytes"] / allocated, 2)
            finally:
                ctl.kill_sandbox(child)
            meminfo: dict[str, dict[str, int]] = {}
            for tag in ("py-base", *(link["tag"] for link in links)):
                kid = ctl.spawn_sandboxes(tag, 1)[0]["id"]
                try:
                    meminfo[tag] = json.loads(ctl.exec_command(
                        kid, ["python3", "-c", READ_MEMINFO], timeout_secs=300)["stdout"])
                finally:
                    ctl.kill_sandbox(kid)
            store = Store(work / "home")   # read only: the daemon owns it
            for link in links:
                link["layer_page_kinds_mib"] = _layer_page_kinds(ctl, store, link["tag"])
            for link in links:
                before, after = meminfo[link["from"]], meminfo[link["tag"]]
                link["meminfo_delta_bytes"] = {k: after.get(k, 0) - before.get(k, 0)
                                               for k in MEMINFO}
                link["in_use_delta_bytes"] = before["MemFree"] - after["MemFree"]
                link["free_page_reporting"] = store.get(link["tag"]).meta.extra.get(
                    "free_page_reporting")
                if not args.no_balloon and not link["free_page_reporting"]:
                    # The device is there but the guest never drove it: a kernel without
                    # CONFIG_VIRTIO_BALLOON (an image built before it); not a balloon run.
                    raise SystemExit(f"{link['tag']}: the balloon was not active; rebuild "
                                     "the image (vmfork image build) with this kernel")
            spawns: dict[str, list[float]] = {"py-base": [], head: []}
            for _ in range(args.spawns):
                for tag, values in spawns.items():
                    kid = ctl.spawn_sandboxes(tag, 1)[0]
                    values.append(kid["timings"]["ready_ms"])
                    ctl.kill_sandbox(kid["id"])
            info = ctl.snapshot_info(head)
        finally:
            daemon.stop()
            network.cleanup_stale("vmfb")
    p50 = {tag: statistics.median(values) for tag, values in spawns.items()}
    layers = sum(link["layer_bytes"] for link in links)
    installed = sum(link["installed_bytes"] for link in links)
    allocated = sum(link["installed_allocated_bytes"] for link in links)
    head_ratio = round(layers / installed, 2)
    head_ratio_allocated = round(layers / allocated, 2)
    data: dict[str, Any] = {
            "balloon": not args.no_balloon,
            "base_build_s": round(base_s, 1), "links": links,
            "head": {"tag": head, "chain_depth": info["chain_depth"],
                     "ancestors": info["ancestors"], "layers_over_installed": head_ratio,
                     "layers_over_allocated": head_ratio_allocated},
            "spawn_ready_ms": spawns, "spawn_ready_ms_p50": p50,
            "head_over_base_spawn": round(p50[head] / p50["py-base"], 2)}
    rows = "\n".join(
        f"| `{link['tag']}` | `{link['exec']}` | {link['build_s']} s | "
        f"{link['layer_bytes'] / MIB:.1f} MiB | {link['installed_bytes'] / MIB:.1f} MiB | "
        f"{link['installed_allocated_bytes'] / MIB:.1f} MiB | {link['layer_over_installed']}x | "
        f"**{link['layer_over_allocated']}x** | {link['in_use_delta_bytes'] / MIB:.1f} MiB | "
        f"{_dropped(link)} |" for link in links)
    markdown = (
        "# forkd's README chain (`python bench/pip_chain.py`)\n\n"
        f"Base `py-base` (`vmfork snapshot --network`, {args.mem_mib} MiB): "
        f"{data['base_build_s']} s.\n\n"
        "| link | `--exec` | build | layer | pip installed (apparent) | (allocated) "
        "| layer / apparent | layer / allocated "
        "| guest memory in use, change | balloon dropped before the capture |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" + rows + "\n\n"
        f"Head `{head}` (depth {info['chain_depth']}): layers {layers / MIB:.1f} MiB for "
        f"{installed / MIB:.1f} MiB installed, {allocated / MIB:.1f} MiB allocated "
        f"({head_ratio}x, {head_ratio_allocated}x).\n\n"
        + "".join(f"`{link['tag']}`'s layer, by what its pages are in a child of the link: "
                  f"{_kinds(link)}.\n\n" for link in links)
        + f"Spawn to ready, median of {args.spawns} (alternating): base "
        f"{p50['py-base']:.0f} ms, head {p50[head]:.0f} ms "
        f"({data['head_over_base_spawn']}x).\n")
    write_results("pip-chain-no-balloon" if args.no_balloon else "pip-chain", data, markdown)
    print(json.dumps(data))
    return 0


def compare(args: argparse.Namespace) -> int:
    """With and without the balloon, alternating (with, without, with, ...) in this one
    test host, so that the balloon's cost shows apart from the host's load, which drifts
    over minutes. Each run is this script as a process of its own (a fresh daemon and
    store; VMFORK_BALLOON is read when a machine is configured)."""
    runs: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for balloon in (True, False):
            argv = [sys.executable, __file__, "--mem-mib", str(args.mem_mib), "--spawns",
                    str(args.spawns), "--links", str(args.links),
                    *(() if balloon else ("--no-balloon",))]
            done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
            sys.stdout.write(done.stdout)
            if done.returncode != 0:
                return done.returncode
            runs.append({"round": round_, **json.loads(done.stdout.strip().splitlines()[-1])})
    rows = []
    for run in runs:
        p50 = run["spawn_ready_ms_p50"]
        for link in run["links"]:
            rows.append(
                f"| {run['round']} | {'with' if run['balloon'] else 'without'} | "
                f"{run['base_build_s']} s | `{link['tag']}` | {link['build_s']} s | "
                f"{link['layer_bytes'] / MIB:.1f} MiB | {link['installed_bytes'] / MIB:.1f} MiB | "
                f"{link['installed_allocated_bytes'] / MIB:.1f} MiB | "
                f"{link['layer_over_installed']}x | {link['layer_over_allocated']}x | "
                f"{_dropped(link)} | {p50['py-base']:.0f} ms | {p50[run['head']['tag']]:.0f} ms |")
    markdown = (
        "# forkd's chain with and without the balloon, alternating "
        f"(`python bench/pip_chain.py --compare --links {args.links} --rounds {args.rounds}`)"
        "\n\n| round | balloon | base build | link | build | layer | installed (apparent) "
        "| (allocated) | layer / apparent | layer / allocated | balloon dropped "
        f"| base spawn p50 of {args.spawns} | head spawn p50 |\n"
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|\n"
        + "\n".join(rows) + "\n\nWhat each layer's pages are, in a child of the link "
        "(MiB, /proc/kpageflags):\n\n"
        + "\n".join(f"- round {run['round']}, {'with' if run['balloon'] else 'without'}, "
                     f"`{link['tag']}`: {_kinds(link)}"
                     for run in runs for link in run["links"]) + "\n")
    write_results("pip-chain-compare", {"links": args.links, "rounds": args.rounds,
                                        "runs": runs}, markdown)
    return 0


def _layer_page_kinds(ctl: Any, store: Any, tag: str) -> dict[str, float]:
    """MiB of the link's layer by what each page is in a child of the link."""
    from vmfork.ondisk.layerfile import read_layer_index
    layer = store.get(tag).layer_path
    with open(layer, "rb", buffering=0) as f:
        index = read_layer_index(f.fileno())
    # 1 GiB of RAM or less sits below the MMIO hole: file offset == guest physical.
    runs = [[offset // 4096, length // 4096] for offset, length in index.extents]
    arg = base64.b64encode(zlib.compress(json.dumps(runs).encode(), 9)).decode()
    kid = ctl.spawn_sandboxes(tag, 1)[0]["id"]
    try:
        out = ctl.exec_command(kid, ["python3", "-c", PAGE_KINDS, arg], timeout_secs=300)
    finally:
        ctl.kill_sandbox(kid)
    if out.get("exit_code") != 0:
        return {"error": str(out.get("stderr"))[-300:]}  # type: ignore[dict-item]
    return {k: round(v * 4096 / MIB, 1)
            for k, v in sorted(json.loads(out["stdout"]).items(), key=lambda kv: -kv[1])}


def _kinds(link: dict[str, Any]) -> str:
    return ", ".join(f"{kind} {mib}" for kind, mib in link["layer_page_kinds_mib"].items())


def _dropped(link: dict[str, Any]) -> str:
    fpr = link.get("free_page_reporting")
    if not fpr:
        return "no balloon"
    return (f"{fpr['bytes_discarded'] / MIB:.1f} MiB in {fpr['reports']} reports "
            f"(waited {fpr['settle_s']} s; last report "
            f"{fpr.get('report_age_at_start_s')} s before the BRANCH)")


if __name__ == "__main__":
    sys.exit(main())
