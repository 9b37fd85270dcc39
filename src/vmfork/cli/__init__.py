"""The ``vmfork`` command line: one module per verb group.

Each module exposes ``register(subparsers)``, which adds its verbs and sets
``func`` on each parser; ``func(args)`` returns the process exit status. Errors
meant for the user raise ``CliError`` with a message that names what to fix.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from vmfork import __version__

# The verb groups, in the order ``vmfork --help`` lists them.
_MODULES = ["run", "snapshots", "distribution", "sandboxes", "serve", "mcp", "image", "doctor", "testhost"]


VOLUME_HELP = ("SRC:GUEST_PATH[:ro|:rw]: mount SRC (a host directory, made a read-only "
               "image, or an image file) at GUEST_PATH in the guest; read-only unless :rw "
               "(an image file of its own, one sandbox at a time); repeat for more (at "
               "most 24)")


def volume_args(values: list[str] | None) -> list[str]:
    """``--volume`` values checked here (exit 2 naming what to fix) and with SRC made
    absolute, since the daemon resolves paths from its own directory."""
    import os

    from vmfork.runtime.volumes import VolumeError, VolumeSpec, parse_volume
    out = []
    for value in values or []:
        try:
            spec = parse_volume(value)
        except VolumeError as err:
            raise CliError(f"--volume {value}: {err}") from err
        out.append(VolumeSpec(os.path.abspath(spec.source), spec.guest_path,
                              spec.read_only).as_text())
    return out


class CliError(Exception):
    """A user-facing error: printed as ``vmfork: <message>``, exit status 2 by default."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def command_words(words: list[str], usage: str) -> list[str]:
    """The command after an optional ``--`` (argparse REMAINDER keeps it); ``usage``
    says how to give one when there is none."""
    command = list(words)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError(f"no command given: {usage}")
    return command


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` options as a mapping."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmfork", description="fork(2) for microVMs")
    parser.add_argument("--version", action="version", version=f"vmfork {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in _MODULES:
        importlib.import_module(f"vmfork.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except CliError as err:
        print(f"vmfork: {err}", file=sys.stderr)
        return err.status
    except KeyboardInterrupt:
        return 130
