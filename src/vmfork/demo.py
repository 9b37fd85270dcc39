"""The main job behind ``scripts/demo``: boot and warm a parent, snapshot it, fork
children, run code in each, and report what happened and how long it took.

Run it where KVM can run unmodified guests (``scripts/demo`` routes it through
``vmfork testhost`` when this host's KVM cannot; figures taken there are only
meaningful relative to each other).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from vmfork.image import find_image
from vmfork.runtime.parent import snapshot_parent
from vmfork.runtime.spawn import fork_children
from vmfork.runtime.zygote_client import start_zygote
from vmfork.store import Store

WARM_UP = "import json, hashlib, random, statistics\nwarm = sum(range(10**6))"
EVAL = "warm + random.randrange(1000)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:9.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmfork.demo", description=__doc__)
    parser.add_argument("-n", type=int, default=4, help="children to fork (default 4)")
    parser.add_argument("--mem-mib", type=int, default=256)
    parser.add_argument("--image", default="default",
                        help="the guest image (`vmfork image build NAME ...` makes yours)")
    parser.add_argument("--warm", default=WARM_UP, help="warm-up code run in the parent")
    parser.add_argument("--eval", default=EVAL, help="code each child evaluates")
    args = parser.parse_args(argv)

    image = find_image(args.image)
    root = (f"{image.disk_format} root disk {image.disk_size >> 20} MiB "
            f"({image.built_from}; " + " ".join(image.definition.get("apt", [])
                                               + image.definition.get("pip", [])) + ")"
            if image.disk_key else f"initramfs {image.initrd_size >> 20} MiB")
    print(f"guest image {image.name!r}: kernel {image.kernel_size >> 20} MiB, {root}")
    with tempfile.TemporaryDirectory(prefix="vmfork-demo-") as tmp:
        store = Store.open(Path(tmp) / "store")
        t0 = time.monotonic()
        report = snapshot_parent(store, "demo", image, mem_mib=args.mem_mib,
                                 warm_code=args.warm)
        print(f"1. booted a {args.mem_mib} MiB parent to a ready agent  {_ms(report.boot_s)}")
        print(f"2. warmed it (imports in the warm interpreter)      {_ms(report.warm_s)}")
        print(f"3. snapshotted it: paused {report.pause_ms:.1f} ms, "
              f"{report.memory_bytes / (1 << 20):.0f} MiB of touched memory written")

        zygote = start_zygote(str(Path(tmp) / "zygote.sock"))
        try:
            client = zygote.client()
            fork = fork_children(client, report.snapshot, args.n, Path(tmp) / "vms")
            print(f"4. forked {len(fork.children)} children: restored {_ms(fork.restored_s)}, "
                  f"all agents answered (reseeded, clock set) {_ms(fork.ready_s)}")
            for vm_id, reason in fork.failed:
                print(f"   {vm_id} FAILED: {reason}")
            print("5. ran code in each child:")
            for child in fork.children:
                agent = child.agent
                started = time.monotonic()
                value = agent.eval(args.eval).value
                evaled = time.monotonic()
                out = agent.exec(["sh", "-c", "head -c 4 /dev/urandom | od -An -tx1"]).stdout
                done = time.monotonic()
                print(f"   {child.vm_id}: eval (warm interpreter) {value} in "
                      f"{(evaled - started) * 1000:.0f} ms; exec urandom{out.decode().strip()!s:>14}"
                      f" in {(done - evaled) * 1000:.0f} ms")
            for child in fork.children:
                client.kill(child.vm_id)
            for child in fork.children:
                client.wait(child.vm_id)
            print(f"6. killed every child; whole run {_ms(time.monotonic() - t0)}")
        finally:
            zygote.close()
    return 0 if not fork.failed else 1


if __name__ == "__main__":
    sys.exit(main())
