"""``vmfork testhost -- <command>``: run a command where ``/dev/kvm`` can run real guests.

A thin shell over ``vmfork.testhost.run_in_testhost``: parse, run, and turn the test
host's failures into a message and the documented exit status (see
``vmfork.testhost.errors``): the command's own status, 124 timeout, 125 the test host
failed (with the console tail), 130/143 interrupted by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from vmfork.cli import CliError, command_words
from vmfork.testhost import (
    DEFAULT_CPUS,
    DEFAULT_MEM_MIB,
    MODE_ENV,
    STATUS_SIGINT,
    STATUS_SIGTERM,
    TesthostError,
    run_in_testhost,
)
from vmfork.testhost.initscript import CGROUP_LAYOUTS

CONSOLE_TAIL_LINES = 100

_EPILOG = f"""\
The command sees this machine's / read-only with writes kept in RAM, the --rw
directories (default: the current one) writable, /dev/kvm, a fresh /tmp, and the
caller's PATH, HOME, LANG/LC_*, TERM, TZ, TMPDIR, CI, PYTHON*, PYENV*, PYTEST_*,
VMFORK_* and XDG_*_HOME variables (add more with --env); VMFORK_IN_TESTHOST=1.
stdin is /dev/null. Where KVM runs guests natively ({MODE_ENV}=auto|always|never,
default auto), or inside the test host, the command runs directly.
Exit status: the command's; 124 timeout; 125 the test host failed; 130/143 on
SIGINT/SIGTERM."""


class _Terminated(Exception):
    """SIGTERM arrived; raised from the handler so ``finally`` blocks stop QEMU."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "testhost", help="run a command in the emulated KVM test host",
        description="Run a command inside a QEMU-emulated x86 host with a working, "
                    "nested /dev/kvm (for machines whose own KVM cannot run guests).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="vmfork testhost [options] -- COMMAND [ARG...]")
    parser.add_argument("--mem-mib", type=_positive_int, default=DEFAULT_MEM_MIB,
                        metavar="M", help=f"test host memory in MiB (default {DEFAULT_MEM_MIB})")
    parser.add_argument("--cpus", type=_positive_int, default=DEFAULT_CPUS, metavar="N",
                        help=f"test host vCPUs (default {DEFAULT_CPUS})")
    parser.add_argument("--rw", action="append", default=None, metavar="PATH",
                        help="a directory the command may change on this machine; repeatable "
                             "(default: the current directory)")
    parser.add_argument("--timeout", type=_positive_float, default=None, metavar="S",
                        help="kill the test host after S seconds, boot included (exit 124)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="pass one more variable (NAME) or set one (NAME=VALUE); repeatable")
    parser.add_argument("--cgroup", choices=CGROUP_LAYOUTS, default="hybrid",
                        help="cgroup layout inside: hybrid (v1 memory + v2 unified, like the "
                             "dev machines; default) or v2")
    parser.add_argument("--mode", choices=("auto", "always", "never"), default=None,
                        help=f"where to run; overrides ${MODE_ENV} (default auto)")
    parser.add_argument("--console", action="store_true",
                        help="show the test host's kernel console and QEMU messages on stderr")
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = command_words(args.command, "vmfork testhost [options] -- COMMAND [ARG...]")
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run_in_testhost(
            command, mem_mib=args.mem_mib, cpus=args.cpus, rw_paths=args.rw,
            timeout=args.timeout, pass_env=args.env, cgroup=args.cgroup, mode=args.mode,
            show_console=args.console)
    except ValueError as err:  # a bad --env
        raise CliError(str(err)) from err
    except TesthostError as err:
        print(f"vmfork testhost: {err}", file=sys.stderr)
        if err.console_tail and not args.console:
            lines = err.console_tail.rstrip().splitlines()[-CONSOLE_TAIL_LINES:]
            print("--- last lines of the test host console ---", file=sys.stderr)
            print("\n".join(lines), file=sys.stderr)
        return err.status
    except KeyboardInterrupt:
        return STATUS_SIGINT
    except _Terminated:
        return STATUS_SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
