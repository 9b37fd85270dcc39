"""``vmfork run -- cmd…``: boot a microVM, run one command in it, stream its
output, exit with its status, and tear everything down."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from vmfork.cli import CliError, command_words, parse_env


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="boot a microVM, run a command in it, exit with its status",
                       description=__doc__)
    p.add_argument("--image", default="default", help="guest image name (default: default)")
    p.add_argument("--mem-mib", type=int, default=256, help="guest memory in MiB (default 256)")
    p.add_argument("--vcpus", type=int, default=1, help="number of vCPUs (default 1)")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill the command after this many seconds")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the command (repeatable)")
    p.add_argument("--cwd", default=None, help="working directory in the guest")
    p.add_argument("--timings", action="store_true",
                   help="print the boot breakdown and VM exit profile to stderr")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = command_words(args.command, "vmfork run [options] -- COMMAND [ARG...], "
                                          "e.g. vmfork run -- uname -a")
    env = parse_env(args.env)

    from vmfork.agent.client import AgentError, AgentTimeout
    from vmfork.image import ImageError, find_image
    from vmfork.kvm.api import KvmError
    from vmfork.runtime.guest import BootedGuest, GuestBootError
    from vmfork.vmm.errors import VmmError

    try:
        image = find_image(args.image)
    except ImageError as err:
        raise CliError(str(err)) from err
    stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer
    out, err_out = sys.stdout.buffer, sys.stderr.buffer

    def write_out(chunk: bytes) -> None:
        out.write(chunk)
        out.flush()

    def write_err(chunk: bytes) -> None:
        err_out.write(chunk)
        err_out.flush()

    started = time.monotonic()
    try:
        with BootedGuest(image, mem_mib=args.mem_mib, vcpus=args.vcpus) as guest:
            booted = time.monotonic()
            try:
                result = guest.agent.exec(command, env=env or None, cwd=args.cwd, stdin=stdin,
                                          timeout=args.timeout, on_stdout=write_out,
                                          on_stderr=write_err)
                status = result.exit_code
            except AgentTimeout:
                print(f"vmfork: command timed out after {args.timeout} s "
                      f"(raise --timeout to allow longer)", file=sys.stderr)
                status = 124
            except AgentError as err:
                raise CliError(f"the guest could not run {command[0]!r}: {err}", 127) from err
            if args.timings:
                _print_timings(guest, started, booted)
    except GuestBootError as err:
        raise CliError(str(err), 1) from err
    except (KvmError, VmmError, ValueError) as err:
        raise CliError(f"could not start the microVM: {err}", 1) from err
    # Signal deaths come back as negative codes (the agent's convention); map
    # them to the shell's 128+N like a local process would.
    return 128 - status if status < 0 else status


def _print_timings(guest: Any, started: float, booted: float) -> None:
    t = guest.timings
    lines = [f"boot: vmm setup {t.vmm_setup * 1000:.1f} ms"]
    if t.kernel_to_init is not None:
        lines.append(f"kernel→init {t.kernel_to_init * 1000:.0f} ms")
    if t.init_to_ready is not None:
        lines.append(f"init→agent ready {t.init_to_ready * 1000:.0f} ms")
    lines.append(f"total {(booted - started) * 1000:.0f} ms")
    print("vmfork: " + ", ".join(lines), file=sys.stderr)
    profile = guest.machine.exit_profile() if guest.machine else {}
    print(f"vmfork: exits {profile.get('by_reason')}", file=sys.stderr)
