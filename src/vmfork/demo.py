"""The main job behind ``scripts/demo``: boot a microVM, run code in it, report.

Prints each step with how long it took. Run it where KVM can run unmodified
guests (``scripts/demo`` routes it through ``vmfork testhost`` when needed).
"""

from __future__ import annotations

import argparse
import sys
import time

from vmfork.image import find_image
from vmfork.runtime.guest import BootedGuest


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmfork.demo", description=__doc__)
    parser.add_argument("--mem-mib", type=int, default=256)
    parser.add_argument("--vcpus", type=int, default=1)
    args = parser.parse_args(argv)

    image = find_image()
    print(f"guest image: kernel {image.kernel_size >> 20} MiB, "
          f"initramfs {image.initrd_size >> 20} MiB")
    t0 = time.monotonic()
    with BootedGuest(image, mem_mib=args.mem_mib, vcpus=args.vcpus) as guest:
        t = guest.timings
        print(f"booted a {args.mem_mib} MiB, {args.vcpus}-vCPU microVM to a ready agent "
              f"in {_ms(time.monotonic() - t0)}")
        print(f"  vmm setup        {_ms(t.vmm_setup)}")
        if t.kernel_to_init is not None and t.init_to_ready is not None:
            print(f"  kernel -> init   {_ms(t.kernel_to_init)}")
            print(f"  init -> ready    {_ms(t.init_to_ready)}")
        steps: list[tuple[str, object]] = [
            ("ping", lambda: guest.agent.ping()),
            ("exec uname -a", lambda: guest.agent.exec(["uname", "-a"])),
            ("exec python3 -c", lambda: guest.agent.exec(
                ["python3", "-c", "import sys; print('hello from', sys.version.split()[0])"])),
            ("eval (warm PID 1)", lambda: guest.agent.eval("sum(range(1000))")),
        ]
        for label, step in steps:
            started = time.monotonic()
            result = step()  # type: ignore[operator]
            elapsed = time.monotonic() - started
            shown = getattr(result, "stdout", None)
            if isinstance(shown, bytes):
                shown = shown.decode(errors="replace").strip()
            elif hasattr(result, "value"):
                shown = getattr(result, "value")
            print(f"{label:20} {_ms(elapsed)}  {shown if shown is not None else result}")
        profile = guest.machine.exit_profile() if guest.machine else {}
        print(f"VM exits by reason: {profile.get('by_reason')}")
    print(f"torn down; whole run {_ms(time.monotonic() - t0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
