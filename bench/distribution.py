"""Distribution benchmark: a numpy snapshot chain through a real OCI registry on loopback,
against ``vmfork pack`` + copy + ``unpack`` of the same chains, in the same run.

A guest image with Debian's numpy (``bench-numpy``: the default image plus
``python3-numpy`` on a disk root, built by the image builder, cached by content) gives
the base: a ``--mem-mib`` guest (default 512) warmed with ``import numpy``. On it two
chains of two diff links each are built as ``bench/chain.py`` builds links (spawn from
the parent, change the guest, BRANCH diff, kill): each link keeps a ``--link-mib`` MiB
numpy array of random floats in the warm interpreter (incompressible, like a link's
real data), so a child of the head sees both arrays:

    chain A: np-base -> features-a -> model-a
    chain B: np-base -> features-b -> model-b   (the same base)

Debian's ``docker-registry`` is started on 127.0.0.1 (as the tests start it,
``tests.unit.test_image_oci.start_registry``), and the store's public functions do the
work (``distribution.push``/``pull``, ``packs.pack``/``unpack``; what ``vmfork
push``/``pull``/``pack``/``unpack`` call, without the CLI's start-up). Measured, each once:

* **push A**, the first push (nothing in the registry), then **push B** (its base is
  there: only its two links and its config go up); both ``--no-image`` (the puller has
  the image), and then A again *with* the guest image into a second repository of the
  same registry (its snapshots are mounted across repositories, the image goes up);
* **pull A** into an empty store, **pull B** into another empty store, and **pull B**
  into the store that already holds A (only B's links come down);
* **pack + copy + unpack** of A and of B without the image: pack, copy the file
  (``shutil.copyfile``: the transfer a pack needs, here between two directories of one
  machine), unpack into an empty store; and B's pack unpacked into the store holding A.

Bytes are counted on both sides: the client's counters (``bytes_uploaded``,
``bytes_downloaded``: compressed blob bytes sent or received, without HTTP framing) and
the registry's: for a push, the bytes of the blobs that appeared in its storage
directory (including the config and the manifest, which it stores as blobs); for a pull,
the ``http.response.written`` bytes of its access log's GET answers (manifest, config,
blobs). A pack moves the whole pack file every time. Finally a daemon on the store that
pulled A then B spawns ``model-b`` once and checks, in the child, numpy's version and the
sums of both of B's arrays against the values taken where they were made.

Inside the emulated test host only the ratios within the run mean anything.
Writes ``bench/results/distribution.{json,md}``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.unit's registry
from _common import ensure_kvm_host, local_daemon, write_results

IMAGE = "bench-numpy"
BASE = "np-base"
CHAINS = {"A": ("features-a", "model-a"), "B": ("features-b", "model-b")}
MIB = 1 << 20
# The registry's combined access log: `"GET /v2/... HTTP/1.1" 200 815308`.
GET_LINE = re.compile(r'"GET /v2/\S+ HTTP/1\.1" (?:200|206) (\d+)')


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mem-mib", type=int, default=512, help="the base's guest memory")
    p.add_argument("--link-mib", type=int, default=16,
                   help="the numpy array (random float64s) each link keeps, in MiB")
    p.add_argument("--host-mem-mib", type=int, default=8192)
    p.add_argument("--host-timeout", type=float, default=3600)
    return p.parse_args()


def array_name(tag: str) -> str:
    return tag.replace("-", "_")


class RegistrySide:
    """What the registry itself saw: blobs that appeared in its storage and the bytes its
    access log says it answered GETs with, between two marks."""

    def __init__(self, storage: Path, log: Path) -> None:
        self.blobs, self.log = storage / "docker/registry/v2/blobs", log

    def mark(self) -> tuple[set[Path], int]:
        stored = set(self.blobs.glob("sha256/*/*/data")) if self.blobs.is_dir() else set()
        return stored, self.log.stat().st_size

    def since(self, mark: tuple[set[Path], int]) -> dict[str, int]:
        stored, offset = mark
        new = set(self.blobs.glob("sha256/*/*/data")) - stored
        with self.log.open("rb") as f:
            f.seek(offset)
            tail = f.read().decode(errors="replace")
        return {"registry_new_blobs": len(new),
                "registry_stored_bytes": sum(p.stat().st_size for p in new),
                "registry_get_bytes": sum(int(n) for n in GET_LINE.findall(tail))}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    out = fn()
    return out, time.monotonic() - started


def build_chains(ctl: Any, link_mib: int) -> dict[str, dict[str, Any]]:
    """Each link as bench/chain.py builds one: spawn from the parent, change the guest
    (here: a named numpy array in the warm interpreter), BRANCH diff, kill. Returns
    each link's build time and the sum of its array, to check in a pulled child."""
    floats = link_mib * MIB // 8
    links: dict[str, dict[str, Any]] = {}
    for seed, tags in enumerate(CHAINS.values(), start=1):
        parent = BASE
        for depth, tag in enumerate(tags, start=1):
            started = time.monotonic()
            sandbox = ctl.spawn_sandboxes(parent, 1)[0]["id"]
            name = array_name(tag)
            made = ctl.eval_code(sandbox, (
                f"{name} = numpy.random.default_rng({seed * 10 + depth}).random({floats}); "
                f"float({name}.sum())"), timeout_secs=600)
            assert made["error"] is None, made
            ctl.branch_sandbox(sandbox, tag=tag, mode="diff", parent_tag=parent)
            ctl.kill_sandbox(sandbox)
            links[tag] = {"parent": parent, "array": name, "sum": made["result"],
                          "build_s": time.monotonic() - started,
                          "changed_bytes": ctl.snapshot_info(tag)["changed_bytes"]}
            parent = tag
    return links


def chain_bytes(store: Any, tags: list[str]) -> dict[str, int]:
    from vmfork.store import disk_usage
    usages = [disk_usage(store.get(tag)) for tag in tags]
    return {"logical_bytes": sum(u.logical_bytes for u in usages),
            "physical_bytes": sum(u.physical_bytes for u in usages)}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from vmfork.image.builder import build
    from vmfork.image.spec import ImageSpec
    from vmfork.store import Store

    image, image_build_s = timed(lambda: build(IMAGE, ImageSpec(apt=("python3-numpy",))
                                               .validate()))
    home = work / "home"
    daemon, ctl = local_daemon(work, home, networking=False)
    try:
        _, base_s = timed(lambda: ctl.create_snapshot(BASE, image=IMAGE, mem_mib=args.mem_mib,
                                                      warm_code="import numpy"))
        links = build_chains(ctl, args.link_mib)
    finally:
        daemon.stop()

    source = Store.open(home)
    # The base, and each chain's links without it.
    sizes = {"base": chain_bytes(source, [BASE]),
             **{name: chain_bytes(source, list(tags)) for name, tags in CHAINS.items()}}
    rows = measure_transfers(source, work)
    spawn = spawn_check(work / "pulled-A", work, links)
    return {"image": {"name": IMAGE, "disk_bytes": image.disk_size, "build_s": image_build_s},
            "base_snapshot_s": base_s, "links": links, "chain_sizes": sizes,
            "steps": rows, "spawn_check": spawn}


def measure_transfers(source: Any, work: Path) -> list[dict[str, Any]]:
    """Push, pull, and pack + copy + unpack of both chains, in that order (see the module
    docstring); one row per step."""
    from tests.unit.test_image_oci import start_registry
    from vmfork.store import Store, distribution, packs

    rows: list[dict[str, Any]] = []

    def row(step: str, how: str, seconds: float, client_bytes: int, **extra: Any) -> None:
        rows.append({"step": step, "how": how, "seconds": seconds,
                     "client_bytes": client_bytes, **extra})

    registries: Iterator[Any] = start_registry(work / "registry", None, log_level="info")
    registry = next(registries)
    try:
        side = RegistrySide(registry.storage, work / "registry" / "registry.log")
        refs = {name: f"{registry.host}/bench/numpy:{tags[-1]}" for name, tags in CHAINS.items()}
        for name, tags in CHAINS.items():
            mark = side.mark()
            pushed, seconds = timed(lambda tags=tags, name=name: distribution.push(
                source, tags[-1], refs[name], with_image=False))
            row(f"push {name}" + (" (first)" if name == "A" else " (base in the registry)"),
                "registry", seconds, pushed.bytes_uploaded, **side.since(mark),
                uploaded=len(pushed.uploaded), present=len(pushed.present),
                mounted=len(pushed.mounted))
        mark = side.mark()
        with_image, seconds = timed(lambda: distribution.push(
            source, CHAINS["A"][-1], f"{registry.host}/bench/with-image:{CHAINS['A'][-1]}"))
        row("push A with its image, to a second repository", "registry", seconds,
            with_image.bytes_uploaded, **side.since(mark), uploaded=len(with_image.uploaded),
            present=len(with_image.present), mounted=len(with_image.mounted))

        stores = {"pulled-A": Store.open(work / "pulled-A"),
                  "pulled-B": Store.open(work / "pulled-B")}
        for step, store, name in (("pull A into an empty store", stores["pulled-A"], "A"),
                                  ("pull B into an empty store", stores["pulled-B"], "B"),
                                  ("pull B into the store holding A", stores["pulled-A"], "B")):
            mark = side.mark()
            pulled, seconds = timed(lambda store=store, name=name: distribution.pull(
                store, refs[name]))
            row(step, "registry", seconds, pulled.bytes_downloaded, **side.since(mark),
                downloaded=len(pulled.downloaded), skipped=len(pulled.skipped),
                stored=pulled.stored)
    finally:
        for _ in registries:
            pass

    (work / "packs").mkdir()
    (work / "copied").mkdir()
    unpacked = {"unpacked-A": Store.open(work / "unpacked-A"),
                "unpacked-B": Store.open(work / "unpacked-B")}
    for name, tags in CHAINS.items():
        out, copied = work / "packs" / f"{name}.tar.zst", work / "copied" / f"{name}.tar.zst"
        packed, pack_s = timed(lambda tags=tags, out=out: packs.pack(source, tags[-1], out,
                                                                    with_image=False))
        _, copy_s = timed(lambda out=out, copied=copied: shutil.copyfile(out, copied))
        targets = [("into an empty store", unpacked[f"unpacked-{name}"])]
        if name == "B":
            targets.append(("into the store holding A", unpacked["unpacked-A"]))
        for where_to, store in targets:
            done, unpack_s = timed(lambda store=store, copied=copied: packs.unpack(store,
                                                                                  copied))
            row(f"pack + copy + unpack {name} {where_to}", "pack", pack_s + copy_s + unpack_s,
                packed.bytes, pack_s=pack_s, copy_s=copy_s, unpack_s=unpack_s,
                stored=done.stored)

    return rows


def spawn_check(home: Path, work: Path, links: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Spawn B's head once from the store that pulled A and then B (base and A from the
    first pull, B's links from the second): the child must see numpy and both of B's
    arrays with the sums they had where they were made."""
    check_daemon, ctl = local_daemon(work, home, name="api2", networking=False)
    try:
        head = CHAINS["B"][-1]
        kid = ctl.spawn_sandboxes(head, 1)[0]
        arrays = [links[tag]["array"] for tag in CHAINS["B"]]
        seen = ctl.eval_code(kid["id"], "(numpy.__version__, " + ", ".join(
            f"float({a}.sum())" for a in arrays) + ")", timeout_secs=600)
        ctl.kill_sandbox(kid["id"])
    finally:
        check_daemon.stop()
    expected = [links[tag]["sum"] for tag in CHAINS["B"]]
    assert seen["error"] is None, seen
    found = seen["result"]
    assert all(s in found for s in expected), (found, expected)
    return {"tag": head, "store": home.name, "ready_ms": kid["timings"]["ready_ms"],
            "child_saw": found}


def markdown(args: argparse.Namespace, data: dict[str, Any]) -> str:
    sizes, rows = data["chain_sizes"], data["steps"]
    by_step = {r["step"]: r for r in rows}
    push_a, push_b = by_step["push A (first)"], by_step["push B (base in the registry)"]
    pack_a = by_step["pack + copy + unpack A into an empty store"]
    pull_a = by_step["pull A into an empty store"]
    pack_b = by_step["pack + copy + unpack B into the store holding A"]
    pull_b = by_step["pull B into the store holding A"]

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / MIB:.1f}"

    lines = [
        f"# Distribution benchmark (`python bench/distribution.py --mem-mib {args.mem_mib} "
        f"--link-mib {args.link_mib}`)", "",
        (f"Base `{BASE}`: image `{IMAGE}` (numpy, disk root {mib(data['image']['disk_bytes'])} "
         f"MiB), {args.mem_mib} MiB guest warmed with `import numpy`; "
         f"{sizes['base']['physical_bytes'] / MIB:.1f} MiB on disk. Each chain adds two "
         f"links, each holding a {args.link_mib} MiB numpy array of random floats "
         f"(A's two links on disk {mib(sizes['A']['physical_bytes'])} MiB, B's "
         f"{mib(sizes['B']['physical_bytes'])} MiB)."), "",
        ("| step | time s | client bytes MiB | registry: stored MiB (push) / GET answered "
         "MiB (pull) | blobs |"), "|---|---:|---:|---:|---|"]
    for r in rows:
        if r["how"] == "registry":
            registry = (mib(r["registry_stored_bytes"]) if r["step"].startswith("push")
                        else mib(r["registry_get_bytes"]))
            if "uploaded" in r:
                blobs = f"{r['uploaded']} up, {r['present']} present, {r['mounted']} mounted"
            else:
                blobs = f"{r['downloaded']} down, {r['skipped']} skipped"
        else:
            registry = "-"
            blobs = (f"pack {r['pack_s']:.1f} s + copy {r['copy_s']:.1f} s + unpack "
                     f"{r['unpack_s']:.1f} s")
        lines.append(f"| {r['step']} | {r['seconds']:.1f} | {mib(r['client_bytes'])} | "
                     f"{registry} | {blobs} |")
    spawn = data["spawn_check"]
    lines += ["", (
        f"A chain on a base the registry holds sends {mib(push_b['client_bytes'])} MiB "
        f"against {mib(push_a['client_bytes'])} MiB for the first "
        f"({push_b['client_bytes'] / max(1, push_a['client_bytes']):.2f}x); its pack moves "
        f"{mib(pack_b['client_bytes'])} MiB every time. Into the store that holds A, pulling "
        f"B fetches {mib(pull_b['client_bytes'])} MiB in {pull_b['seconds']:.1f} s against "
        f"{pack_b['seconds']:.1f} s for pack + copy + unpack of B; into an empty store, "
        f"pulling A takes {pull_a['seconds']:.1f} s (push {push_a['seconds']:.1f} s) against "
        f"{pack_a['seconds']:.1f} s for pack + copy + unpack."), "",
        ("Client bytes: the compressed blob bytes push sent / pull received "
         "(`bytes_uploaded`, `bytes_downloaded`), or the pack file's size. Registry "
         "bytes: the blobs that appeared in its storage during the push (config and "
         "manifest included), or the bytes its access log says it answered the pull's "
         "GETs with."), "",
        (f"Spawn check: `{spawn['tag']}` pulled into the store that held A (base and A "
         f"from the first pull, B's links from the second) spawned in "
         f"{spawn['ready_ms']:.0f} ms; the child saw numpy and both arrays' sums as made: "
         f"`{spawn['child_saw']}`."), ""]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=args.host_mem_mib,
                    timeout=args.host_timeout)
    work = Path(tempfile.mkdtemp(prefix="vmfork-bench-distribution-"))
    try:
        data = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results("distribution", {"mem_mib": args.mem_mib, "link_mib": args.link_mib,
                                   **data}, markdown(args, data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
