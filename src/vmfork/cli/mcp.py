"""``vmfork mcp``: the MCP server (stdio by default; ``--http`` for streamable HTTP).

The verb parses flags and reports problems as ``CliError``; the tools live in
``vmfork.mcp``. With stdio, standard output belongs to the protocol: nothing
else may print there (logging goes to standard error).
"""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any

from vmfork.cli import CliError


def register(sub: Any) -> None:
    p = sub.add_parser("mcp", help="serve the daemon's sandboxes as MCP tools (stdio or HTTP)")
    p.add_argument("--url", default=None, metavar="URL",
                   help="daemon URL (default $VMFORK_URL, $FORKD_URL, else the local "
                        "daemon's Unix socket)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="bearer token for the daemon (default $VMFORK_TOKEN or $FORKD_TOKEN)")
    p.add_argument("--http", nargs="?", const="127.0.0.1:8890", default=None,
                   metavar="HOST:PORT",
                   help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio "
                        "(bare --http: 127.0.0.1:8890)")
    p.set_defaults(func=cmd_mcp)


def cmd_mcp(args: argparse.Namespace) -> int:
    from vmfork.client import Controller
    from vmfork.mcp import build_server

    token = None
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as err:
            raise CliError(f"--token-file: {err}") from err
    try:
        controller = Controller(args.url, token=token)
    except ValueError as err:
        raise CliError(f"--url: {err}") from err
    server = build_server(controller)
    if args.http is None:
        server.run("stdio")
        return 0
    host, sep, port = args.http.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(f"--http {args.http!r}: give HOST:PORT, e.g. 127.0.0.1:8890")
    host = host.strip("[]")
    if not _is_loopback(host):
        raise CliError(f"--http {args.http!r}: the MCP endpoint has no authentication of its "
                       "own, so it listens on loopback only (127.0.0.1 or ::1)")
    server.run("streamable-http", host=host, port=int(port))
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
