"""``vmfork serve``: the controller daemon (REST ``/v1``, forkd-compatible).

The verb only parses flags and reports start-up problems as ``CliError``; the
daemon itself lives in ``vmfork.server.daemon``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from vmfork.cli import CliError


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the controller daemon (REST API, forkd-compatible)")
    p.add_argument("--state", type=Path, default=None, metavar="DIR",
                   help="registry, sandbox run dirs and zygote socket (default "
                        "$VMFORK_STATE_DIR or ~/.local/state/vmfork)")
    p.add_argument("--socket", type=Path, default=None, metavar="PATH",
                   help="Unix socket to listen on (default DIR/api.sock)")
    p.add_argument("--no-socket", action="store_true", help="do not listen on a Unix socket")
    p.add_argument("--bind", nargs="?", const="127.0.0.1:8889", default=None,
                   metavar="HOST:PORT",
                   help="also listen on TCP (bare --bind: 127.0.0.1:8889); a non-loopback "
                        "address needs --token-file")
    p.add_argument("--tls-cert", type=Path, default=None, metavar="FILE",
                   help="serve the --bind listener over TLS (1.2 or later) with this PEM "
                        "certificate (chain); needs --tls-key")
    p.add_argument("--tls-key", type=Path, default=None, metavar="FILE",
                   help="the PEM private key of --tls-cert")
    p.add_argument("--snapshot-root", type=Path, default=None, metavar="DIR",
                   help="snapshot store (default $VMFORK_HOME or ~/.local/share/vmfork)")
    p.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                   help="require 'Authorization: Bearer <token>' with the token in FILE "
                        "(at least 16 bytes)")
    p.add_argument("--audit-log", type=Path, default=None, metavar="FILE",
                   help="JSON-lines audit log (default DIR/audit.log; reopened on SIGHUP)")
    p.add_argument("--max-concurrent-spawns", type=int, default=4, metavar="N",
                   help="heavy operations (sandbox/snapshot create) at once; more get 503 "
                        "(default 4)")
    p.add_argument("--branch-concurrency", type=int, default=2, metavar="N",
                   help="BRANCH operations at once; more get 503 (default 2)")
    p.add_argument("--zygote-lease", type=float, default=60.0, metavar="SECONDS",
                   help="sandboxes outlive the daemon (a restarted daemon re-adopts them); "
                        "if no daemon comes back within SECONDS they are killed (default 60)")
    p.add_argument("--kill-sandboxes-on-exit", action="store_true",
                   help="stop every sandbox when the daemon stops (default: keep them for a "
                        "restart within --zygote-lease)")
    p.add_argument("--no-network", action="store_true",
                   help="give sandboxes no networks of their own (per_child_netns refused)")
    p.add_argument("--network-prefix", default="vmf", metavar="NAME",
                   help="1-6 lowercase letters naming this daemon's network namespaces, "
                        "links and nftables table; another daemon on this host needs "
                        "another (default vmf)")
    p.add_argument("--network-subnet", default="10.200.0.0/16", metavar="CIDR",
                   help="host-side addresses of sandbox networks, a /31 each "
                        "(default 10.200.0.0/16)")
    p.add_argument("--netns-pool", type=_pool_size, default=0, metavar="N",
                   help="keep N sandbox networks made ahead, so that a per_child_netns "
                        "spawn takes one instead of making it; the pool fills on the "
                        "first such spawn (default 0: made per spawn, in parallel)")
    p.add_argument("--max-sandboxes", type=int, default=1000, metavar="N",
                   help="running sandboxes at most; more get 429 (default 1000)")
    p.add_argument("--max-guest-memory-mib", type=int, default=None, metavar="MIB",
                   help="guest RAM committed to running sandboxes at most (each counts its "
                        "snapshot's size); more get 429 (default: 4 x this host's RAM)")
    p.add_argument("--insecure-no-jail", action="store_true",
                   default=os.environ.get("VMFORK_JAIL") == "0",
                   help="run sandbox VMMs without a jail (own uid, namespaces, seccomp): a "
                        "guest that escapes its VMM then holds the daemon's privileges. "
                        "Without it the daemon refuses to start where it cannot build a "
                        "jail (default: off; VMFORK_JAIL=0 turns it on)")
    p.set_defaults(func=cmd_serve)


def _pool_size(text: str) -> int:
    from vmfork.runtime.network import MAX_POOL_SIZE

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_POOL_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pool size from 0 to "
                                         f"{MAX_POOL_SIZE}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from vmfork.runtime.zygote_protocol import ZygoteError
    from vmfork.server.auth import AuthConfigError
    from vmfork.server.daemon import (
        SOCKET_NAME,
        Daemon,
        DaemonConfig,
        JailUnavailable,
        default_state_dir,
    )
    from vmfork.server.registry import RegistryError
    from vmfork.server.tls import TlsConfigError
    from vmfork.store import StoreError

    if args.max_concurrent_spawns < 1:
        raise CliError("--max-concurrent-spawns must be at least 1")
    if args.branch_concurrency < 1:
        raise CliError("--branch-concurrency must be at least 1")
    if not 0 < args.zygote_lease <= 7 * 86400:
        raise CliError("--zygote-lease must be between 0 and 604800 seconds (exclusive of 0)")
    if args.max_sandboxes < 1:
        raise CliError("--max-sandboxes must be at least 1")
    if args.max_guest_memory_mib is not None and args.max_guest_memory_mib < 1:
        raise CliError("--max-guest-memory-mib must be at least 1")
    state = (args.state or default_state_dir()).absolute()
    socket_path = None if args.no_socket else (args.socket or state / SOCKET_NAME).absolute()
    config = DaemonConfig(state_dir=state, socket_path=socket_path, bind=args.bind,
                          snapshot_root=args.snapshot_root, token_file=args.token_file,
                          audit_log=args.audit_log,
                          heavy_concurrency=args.max_concurrent_spawns,
                          branch_concurrency=args.branch_concurrency,
                          zygote_lease_s=args.zygote_lease,
                          kill_sandboxes_on_exit=args.kill_sandboxes_on_exit,
                          networking=not args.no_network,
                          network_prefix=args.network_prefix,
                          network_pool=args.netns_pool,
                          network_subnet=args.network_subnet,
                          jail=not args.insecure_no_jail,
                          max_sandboxes=args.max_sandboxes,
                          max_guest_mib=args.max_guest_memory_mib,
                          tls_cert=args.tls_cert, tls_key=args.tls_key)
    try:
        daemon = Daemon(config)
    except JailUnavailable as err:
        raise CliError(str(err), 1) from err
    except (AuthConfigError, TlsConfigError, RegistryError, StoreError, ZygoteError,
            ValueError, OSError) as err:
        raise CliError(str(err), 1) from err
    if not config.jail:
        print("vmfork serve: WARNING: --insecure-no-jail: sandbox VMMs run uncontained",
              file=sys.stderr, flush=True)
    for address in daemon.addresses():
        print(f"vmfork serve: listening on {address}", file=sys.stderr, flush=True)
    daemon.run_until_signalled()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m vmfork.cli.serve``: the verb on its own (tests; before registration)."""
    from vmfork.cli import _MODULES
    from vmfork.cli import main as cli_main

    if "serve" in _MODULES:
        return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])
    parser = argparse.ArgumentParser(prog="vmfork")
    register(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args))
    except CliError as err:
        print(f"vmfork: {err}", file=sys.stderr)
        return err.status


if __name__ == "__main__":
    sys.exit(main())
