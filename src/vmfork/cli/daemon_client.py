"""What the daemon-backed verbs share: finding the daemon, turning its errors into
``CliError``, ``--json`` output, and a progress line for long requests.

Every sandbox verb goes through the daemon (DESIGN.md decision 6), so a sandbox
spawned by ``vmfork spawn`` can be branched from the SDK and killed with curl.
The daemon is found as the SDK finds it: ``--url``, else ``$VMFORK_URL`` /
``$FORKD_URL``, else the Unix socket ``vmfork serve`` listens on by default; the
token comes from ``--token-file``, else ``$VMFORK_TOKEN`` / ``$FORKD_TOKEN``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from vmfork.cli import CliError
from vmfork.client.errors import ControllerError

if TYPE_CHECKING:
    from vmfork.client.controller import Controller

T = TypeVar("T")


def add_daemon_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, metavar="URL",
                   help="the daemon (default $VMFORK_URL, $FORKD_URL, else the Unix socket of "
                        "`vmfork serve`)")
    p.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                   help="bearer token for the daemon (default $VMFORK_TOKEN / $FORKD_TOKEN)")
    p.add_argument("--ca-file", default=None, metavar="FILE",
                   help="PEM CA certificate an https:// daemon is verified against "
                        "(default $VMFORK_CA_FILE, else the system's roots)")


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def controller(args: argparse.Namespace, timeout: float = 60) -> Controller:
    token = None
    if getattr(args, "token_file", None) is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as err:
            raise CliError(f"cannot read --token-file {args.token_file}: {err.strerror}",
                           1) from err
    from vmfork.client.controller import Controller  # httpx: only for a daemon's commands

    ca_file = getattr(args, "ca_file", None)
    try:
        return Controller(getattr(args, "url", None), token=token, timeout=timeout,
                          ca_file=ca_file)
    except ValueError as err:
        raise CliError(str(err)) from err
    except OSError as err:   # an unreadable or non-PEM --ca-file / VMFORK_CA_FILE
        raise CliError(f"cannot use the CA file {ca_file or '$VMFORK_CA_FILE'}: {err}",
                       1) from err


def daemon_answers(ctl: Controller) -> bool:
    try:
        ctl.healthz()
    except ControllerError:
        return False
    return True


def call(ctl: Controller, fn: Callable[[], T]) -> T:
    """Run one SDK call; a daemon error becomes a ``CliError`` that says what to fix."""
    try:
        return fn()
    except ControllerError as err:
        raise CliError(describe(ctl, err), 1) from err


def describe(ctl: Controller, err: ControllerError) -> str:
    if err.status == 0:
        return (f"no daemon at {ctl.base_url}; start one with `vmfork serve` (or point "
                "--url / VMFORK_URL at a running one)")
    if err.status == 401:
        return (f"the daemon at {ctl.base_url} refused the token ({err.message}); pass "
                "--token-file or set VMFORK_TOKEN")
    return err.message


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def when(unix: float | None) -> str:
    return "-" if not unix else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


@contextmanager
def progress(what: str) -> Iterator[None]:
    """``what… 12 s`` on stderr while the block runs (only on a terminal): the daemon
    answers long requests (boots, spawns of many, BRANCH) only when they are done."""
    if not sys.stderr.isatty():
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        frames = "|/-\\"
        n = 0
        while not done.wait(0.2):
            n += 1
            sys.stderr.write(f"\r{frames[n % 4]} {what} {time.monotonic() - started:.0f} s ")
            sys.stderr.flush()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        sys.stderr.write(f"\r{' ' * (len(what) + 12)}\r")
        sys.stderr.flush()
