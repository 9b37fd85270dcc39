"""Sandbox verbs, all through the daemon (forkd's names and flags): ``spawn``, ``ls``,
``kill``, ``exec``, ``eval``, ``ping``, ``branch``, ``workspace``; vmfork's
``ports`` and ``egress`` for sandboxes with networks of their own; and the lifecycle
verbs ``set-timeout``, ``pause``, ``resume`` and ``metrics``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vmfork.cli import VOLUME_HELP, CliError, command_words, parse_env, volume_args
from vmfork.cli.daemon_client import (
    add_daemon_options,
    add_json_option,
    call,
    controller,
    describe,
    print_json,
    print_table,
    progress,
    when,
)
from vmfork.client.errors import ControllerError

EGRESS_HELP = ("allow (default), deny, or an allow-list of CIDRs and domain names separated "
               "by commas, e.g. 10.0.0.0/8,example.com (names are resolved when the policy "
               "is set)")


def register(sub: Any) -> None:
    p = sub.add_parser("spawn", help="spawn sandboxes from a snapshot (through the daemon)")
    p.add_argument("--tag", required=True, help="snapshot to spawn from")
    p.add_argument("-n", type=int, default=1, help="how many (1..1000, default 1)")
    p.add_argument("--memory-limit-mib", type=int, default=None, metavar="M",
                   help="per-sandbox memory limit")
    p.add_argument("--per-child-netns", action="store_true",
                   help="give each sandbox a network of its own (the snapshot must have "
                        "been made with `vmfork snapshot --network`)")
    p.add_argument("--egress", default=None, metavar="POLICY", help=EGRESS_HELP)
    p.add_argument("--volume", action="append", metavar="SRC:GUEST_PATH[:ro|:rw]",
                   help=VOLUME_HELP)
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="the sandboxes' lifetime: then they are killed (or paused, "
                        "--on-timeout pause); default: until killed")
    p.add_argument("--on-timeout", choices=("kill", "pause"), default="kill",
                   help="what the timeout does (default kill)")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="a label to list them by (`vmfork ls --metadata KEY=VALUE`)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable every command in them gets")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_spawn)

    p = sub.add_parser("set-timeout", help="end a sandbox SECONDS from now (or never: none)")
    p.add_argument("id", metavar="ID")
    p.add_argument("seconds", metavar="SECONDS|none")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_set_timeout)

    p = sub.add_parser("pause", help="snapshot a sandbox and stop it, keeping its id")
    p.add_argument("id", metavar="ID")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_pause)

    p = sub.add_parser("resume", help="run a paused sandbox again, same id")
    p.add_argument("id", metavar="ID")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="its lifetime from now (default: the one it had)")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("metrics", help="a sandbox's CPU time, memory and disk use")
    p.add_argument("id", metavar="ID")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_metrics)

    p = sub.add_parser("ports", help="publish a sandbox's guest ports on host ports")
    ports = p.add_subparsers(dest="ports_action", metavar="ACTION", required=True)
    q = ports.add_parser("ls", help="list a sandbox's published ports")
    q.add_argument("id", metavar="ID")
    add_json_option(q)
    add_daemon_options(q)
    q.set_defaults(func=cmd_ports_ls)
    q = ports.add_parser("add", help="publish GUEST_PORT on a host port; prints the host port")
    q.add_argument("id", metavar="ID")
    q.add_argument("guest_port", type=int, metavar="GUEST_PORT")
    q.add_argument("--host-port", type=int, default=0, metavar="N",
                   help="host port (default: a free one)")
    q.add_argument("--udp", action="store_true", help="UDP instead of TCP")
    add_daemon_options(q)
    q.set_defaults(func=cmd_ports_add)
    q = ports.add_parser("rm", help="unpublish a host port")
    q.add_argument("id", metavar="ID")
    q.add_argument("host_port", type=int, metavar="HOST_PORT")
    q.add_argument("--udp", action="store_true", help="UDP instead of TCP")
    add_daemon_options(q)
    q.set_defaults(func=cmd_ports_rm)

    p = sub.add_parser("egress", help="replace the egress policy of a sandbox's network")
    p.add_argument("id", metavar="ID")
    p.add_argument("policy", metavar="POLICY", help=EGRESS_HELP)
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_egress)

    p = sub.add_parser("ls", help="list sandboxes")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="only those with this label (repeat: all of them)")
    p.add_argument("--state", action="append", default=None,
                   choices=("running", "paused", "exited", "lost"),
                   help="only those in this state (repeatable)")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("kill", help="kill sandboxes")
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="every sandbox")
    p.add_argument("--tag", default=None, help="every sandbox of this snapshot")
    add_daemon_options(p)
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser("exec", help="run a command in a sandbox, streaming its output; "
                                    "exits with the command's status")
    p.add_argument("id", metavar="ID")
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="kill the command after this long (default 30)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cwd", default=None, help="working directory in the guest")
    p.add_argument("--json", action="store_true",
                   help="print the result as JSON once the command is done (no streaming)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    add_daemon_options(p)
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("eval", help="evaluate Python in the sandbox's warm interpreter")
    p.add_argument("id", metavar="ID")
    p.add_argument("code", help="Python code; '-' reads it from stdin")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("ping", help="check that a sandbox's agent answers")
    p.add_argument("id", metavar="ID")
    add_json_option(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_ping)

    p = sub.add_parser("branch", help="snapshot a running sandbox (BRANCH); same as "
                                      "`snapshot --from-sandbox ID`")
    p.add_argument("id", metavar="ID")
    p.add_argument("--tag", default=None, help="name of the new snapshot (default: derived "
                                                "from the sandbox id)")
    add_branch_options(p)
    add_daemon_options(p)
    p.set_defaults(func=cmd_branch)


    p = sub.add_parser("workspace", help="named long-lived sandboxes: create, suspend to a "
                                         "snapshot, resume, list, delete")
    ws = p.add_subparsers(dest="workspace_verb", metavar="ACTION", required=True)
    w = ws.add_parser("create", help="spawn a named sandbox")
    w.add_argument("name")
    w.add_argument("--tag", required=True, help="snapshot to start from")
    w.add_argument("--memory-limit-mib", type=int, default=None, metavar="M")
    w.add_argument("--volume", action="append", metavar="SRC:GUEST_PATH[:ro|:rw]",
                   help=VOLUME_HELP + "; a :rw one stays with the workspace while suspended")
    add_json_option(w)
    add_daemon_options(w)
    w.set_defaults(func=cmd_workspace_create)
    for action, help_text in (("suspend", "snapshot it and stop its sandbox"),
                              ("resume", "start its sandbox again from that snapshot"),
                              ("delete", "kill it and remove its snapshot")):
        w = ws.add_parser(action, help=help_text)
        w.add_argument("name")
        if action == "suspend":
            w.add_argument("--diff", action="store_true",
                           help="store only the pages that changed (if the VMM supports it)")
        if action != "delete":
            add_json_option(w)
        add_daemon_options(w)
        w.set_defaults(func=cmd_workspace_action, action=action)
    w = ws.add_parser("list", help="list workspaces")
    add_json_option(w)
    add_daemon_options(w)
    w.set_defaults(func=cmd_workspace_list)


def add_branch_options(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--mode", choices=("full", "diff", "live"), default=None,
                      help="full (default): pause while memory is written; diff/live: "
                           "only the pages that changed, if the VMM supports it")
    mode.add_argument("--diff", action="store_const", const="diff", dest="mode",
                      help="same as --mode diff")
    mode.add_argument("--live", action="store_const", const="live", dest="mode",
                      help="same as --mode live")
    p.add_argument("--no-wait", action="store_true",
                   help="return at once (status writing); poll `vmfork images`")
    p.add_argument("--parent-tag", default=None, help="base of a diff/live BRANCH")
    if not any(a.dest == "json" for a in p._actions):
        add_json_option(p)


def _sandbox_row(s: dict[str, Any]) -> list[str]:
    status = s.get("status", "running")
    if status != "running" and s.get("exit_description"):
        status += f" ({s['exit_description']})"
    return [s["id"], s["snapshot_tag"], str(s.get("pid") or "-"), when(s["created_at_unix"]),
            str(s.get("branch_count", 0)), status]


def cmd_spawn(args: argparse.Namespace) -> int:
    volumes = volume_args(args.volume)
    ctl = controller(args, timeout=600)
    with progress(f"spawning {args.n} sandbox{'es' if args.n != 1 else ''} of {args.tag}"):
        infos = call(ctl, lambda: ctl.spawn_sandboxes(
            args.tag, args.n, memory_limit_mib=args.memory_limit_mib,
            per_child_netns=args.per_child_netns, egress=_egress(args.egress),
            volumes=volumes, timeout_secs=args.timeout, on_timeout=args.on_timeout,
            metadata=_pairs(args.metadata, "--metadata"), envs=parse_env(args.env)))
    if args.json:
        print_json(infos)
    else:
        for info in infos:
            address = f"\t{info['guest_addr']}" if info.get("guest_addr") else ""
            print(f"{info['id']}{address}")
    return 0


def _pairs(pairs: list[str], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"{option} {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _print_sandbox(args: argparse.Namespace, info: dict[str, Any]) -> None:
    if args.json:
        print_json(info)
        return
    ends = (f", ends {when(int(info['end_at_unix']))}" if info.get("end_at_unix")
            else "")
    print(f"{info['id']}: {info['status']}{ends}")


def cmd_set_timeout(args: argparse.Namespace) -> int:
    if args.seconds.lower() in ("none", "never"):
        seconds = None
    else:
        try:
            seconds = float(args.seconds)
        except ValueError:
            raise CliError(f"SECONDS {args.seconds!r}: give a number of seconds or none") from None
    ctl = controller(args)
    _print_sandbox(args, call(ctl, lambda: ctl.set_timeout(args.id, seconds)))
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    ctl = controller(args, timeout=600)
    with progress(f"pausing {args.id}"):
        info = call(ctl, lambda: ctl.pause_sandbox(args.id))
    _print_sandbox(args, info)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    ctl = controller(args, timeout=600)
    with progress(f"resuming {args.id}"):
        info = call(ctl, lambda: ctl.resume_sandbox(args.id, args.timeout))
    _print_sandbox(args, info)
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    ctl = controller(args)
    m = call(ctl, lambda: ctl.sandbox_metrics(args.id))
    if args.json:
        print_json(m)
        return 0

    def mib(value: Any) -> str:
        return "-" if value is None else f"{value / (1 << 20):.1f} MiB"

    print(f"cpu {m['cpu_seconds']} s; memory: cgroup {mib(m['memory_cgroup_bytes'])}, "
          f"rss {mib(m['memory_rss_bytes'])}, private dirty "
          f"{mib(m['memory_private_dirty_bytes'])}; disk {mib(m['disk_used_bytes'])} of "
          f"{mib(m['disk_total_bytes'])}")
    return 0


def _egress(policy: str | None) -> str | None:
    if policy is not None and not policy.strip(","):
        raise CliError("--egress is empty: give allow, deny or a comma-separated allow-list")
    return policy


def cmd_ports_ls(args: argparse.Namespace) -> int:
    ctl = controller(args)
    ports = call(ctl, lambda: ctl.list_ports(args.id))
    if args.json:
        print_json(ports)
        return 0
    print_table(["PROTOCOL", "HOST PORT", "GUEST PORT"],
                [[p["protocol"], str(p["host_port"]), str(p["guest_port"])] for p in ports])
    return 0


def _check_port(value: int, what: str, zero_ok: bool = False) -> None:
    if not (0 if zero_ok else 1) <= value <= 65535:
        raise CliError(f"{what} {value} is not a port number (1-65535)")


def cmd_ports_add(args: argparse.Namespace) -> int:
    _check_port(args.guest_port, "GUEST_PORT")
    _check_port(args.host_port, "--host-port", zero_ok=True)
    ctl = controller(args)
    published = call(ctl, lambda: ctl.expose_port(args.id, args.guest_port, args.host_port,
                                                  "udp" if args.udp else "tcp"))
    print(published["host_port"])
    return 0


def cmd_ports_rm(args: argparse.Namespace) -> int:
    _check_port(args.host_port, "HOST_PORT")
    ctl = controller(args)
    call(ctl, lambda: ctl.unexpose_port(args.id, args.host_port, "udp" if args.udp else "tcp"))
    return 0


def cmd_egress(args: argparse.Namespace) -> int:
    policy = _egress(args.policy)
    assert policy is not None
    ctl = controller(args)
    network = call(ctl, lambda: ctl.set_egress(args.id, policy))
    if args.json:
        print_json(network)
    else:
        print(f"{args.id}: egress {network['egress']}"
              + (f" ({', '.join(network['allowed'])})" if network["allowed"] else ""))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    ctl = controller(args)
    wanted = _pairs(args.metadata, "--metadata")
    sandboxes = call(ctl, lambda: ctl.list_sandboxes(metadata=wanted or None,
                                                     state=args.state))
    if args.json:
        print_json(sandboxes)
        return 0
    print_table(["ID", "SNAPSHOT", "PID", "CREATED", "BRANCHES", "STATUS"],
                [_sandbox_row(s) for s in sandboxes])
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    if not args.ids and not args.all and args.tag is None:
        raise CliError("name the sandboxes to kill: IDs, --all, or --tag TAG")
    if args.ids and (args.all or args.tag):
        raise CliError("give IDs or --all/--tag, not both")
    ctl = controller(args)
    ids = list(args.ids)
    if not ids:
        ids = [s["id"] for s in call(ctl, ctl.list_sandboxes)
               if args.all or s["snapshot_tag"] == args.tag]
    status = 0
    for sandbox in ids:
        try:
            ctl.kill_sandbox(sandbox)
            print(f"killed {sandbox}")
        except ControllerError as err:
            if err.status == 0:
                raise CliError(describe(ctl, err), 1) from err
            print(f"vmfork: {sandbox}: {describe(ctl, err)}", file=sys.stderr)
            status = 1
    return status


def cmd_exec(args: argparse.Namespace) -> int:
    command = command_words(args.command, "vmfork exec ID [options] -- COMMAND [ARG...], "
                                          "e.g. vmfork exec ID -- uname -a")
    ctl = controller(args)
    env: dict[str, str | None] | None = dict(parse_env(args.env)) or None
    if args.json:
        try:
            result = ctl.exec_command(args.id, command, args.timeout, env=env, cwd=args.cwd)
        except ControllerError as err:
            if err.status == 504 and isinstance(err.body, dict):
                print_json(err.body)
                return 124
            raise CliError(describe(ctl, err), 1) from err
        print_json(result)
        return int(result["exit_code"]) if result["exit_code"] >= 0 else 128 - result["exit_code"]
    out, err_out = sys.stdout.buffer, sys.stderr.buffer
    try:
        for event, data in ctl.exec_stream(args.id, command, args.timeout, env=env,
                                           cwd=args.cwd):
            if event in ("stdout", "stderr"):
                stream = out if event == "stdout" else err_out
                stream.write(data["data"].encode())
                stream.flush()
            elif event == "exit":
                code = int(data["exit_code"])
                return code if code >= 0 else 128 - code  # killed by signal N: 128+N
            elif event == "error":
                if data.get("timed_out"):
                    print(f"vmfork: command timed out after {args.timeout} s and was killed "
                          "(raise --timeout to allow longer)", file=sys.stderr)
                    return 124
                raise CliError(str(data.get("error")), 1)
    except ControllerError as err:
        raise CliError(describe(ctl, err), 1) from err
    raise CliError("the exec stream ended without a result (did the daemon stop?)", 1)


def cmd_eval(args: argparse.Namespace) -> int:
    code = sys.stdin.read() if args.code == "-" else args.code
    ctl = controller(args)
    result = call(ctl, lambda: ctl.eval_code(args.id, code, args.timeout))
    if args.json:
        print_json(result)
        return int(result["exit_code"])
    if result.get("stdout"):
        sys.stdout.write(result["stdout"])
    if result.get("stderr"):
        sys.stderr.write(result["stderr"])
    if result["error"] is not None:
        print(result.get("traceback") or result["error"], file=sys.stderr)
        return 1
    if result["result"] is not None:
        print(result["result"])
    return 0


def cmd_ping(args: argparse.Namespace) -> int:
    ctl = controller(args)
    reply = call(ctl, lambda: ctl.ping_sandbox(args.id))
    if args.json:
        print_json(reply)
    else:
        print(f"pong from {args.id}: agent pid {reply.get('pid')}, up "
              f"{float(reply.get('uptime') or 0):.1f} s")
    return 0


def branch(args: argparse.Namespace, sandbox_id: str, tag: str | None) -> int:
    ctl = controller(args)
    wait = not args.no_wait
    with progress(f"branching {sandbox_id}" if wait else "starting BRANCH"):
        info = call(ctl, lambda: ctl.branch_sandbox(sandbox_id, tag=tag, mode=args.mode,
                                                    wait=wait, parent_tag=args.parent_tag))
    if args.json:
        print_json(info)
    elif info["status"] == "writing":
        print(f"snapshot {info['tag']}: being written from {sandbox_id}; "
              "`vmfork images` shows when it is ready")
    else:
        print(f"snapshot {info['tag']}: branched from {sandbox_id}, paused "
              f"{info.get('pause_ms', 0):.1f} ms")
    return 0


def cmd_branch(args: argparse.Namespace) -> int:
    return branch(args, args.id, args.tag)


def _print_workspace(args: argparse.Namespace, info: dict[str, Any]) -> None:
    if args.json:
        print_json(info)
    else:
        where = info["sandbox_id"] if info["state"] == "running" else info["suspended_snapshot"]
        print(f"workspace {info['name']}: {info['state']} ({where})")


def cmd_workspace_create(args: argparse.Namespace) -> int:
    volumes = volume_args(args.volume)
    ctl = controller(args, timeout=600)
    with progress(f"creating workspace {args.name}"):
        info = call(ctl, lambda: ctl.create_workspace(args.name, args.tag,
                                                      memory_limit_mib=args.memory_limit_mib,
                                                      volumes=volumes))
    _print_workspace(args, info)
    return 0


def cmd_workspace_action(args: argparse.Namespace) -> int:
    ctl = controller(args, timeout=600)
    if args.action == "delete":
        call(ctl, lambda: ctl.delete_workspace(args.name))
        print(f"deleted workspace {args.name}")
        return 0
    with progress(f"{args.action[:-1]}ing workspace {args.name}"):
        if args.action == "suspend":
            info = call(ctl, lambda: ctl.suspend_workspace(args.name, diff=args.diff))
        else:
            info = call(ctl, lambda: ctl.resume_workspace(args.name))
    _print_workspace(args, info)
    return 0


def cmd_workspace_list(args: argparse.Namespace) -> int:
    ctl = controller(args)
    workspaces = call(ctl, ctl.list_workspaces)
    if args.json:
        print_json(workspaces)
        return 0
    print_table(["NAME", "STATE", "SANDBOX", "SNAPSHOT", "SUSPENDED-TO", "UPDATED"],
                [[w["name"], w["state"], w["sandbox_id"] or "-", w["snapshot_tag"],
                  w["suspended_snapshot"] or "-", when(w.get("updated_at_unix"))]
                 for w in workspaces])
    return 0
