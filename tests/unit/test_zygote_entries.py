"""Entry functions the zygote tests fork into (no tests here; stdlib only).

The zygote imports this module by name (``test_zygote_entries:<function>``) with
``tests/unit`` on its PYTHONPATH. Each entry takes the spawn's ``args`` dict and
returns the child's exit status. Files they write go to ``args["out"]``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vmfork.runtime.zygote_child import current
from vmfork.vmm.openfiles import open_device, open_ro

_after_fork_hooks_run: list[int] = []
# Registered in the zygote, which imports this module before it forks anything: a
# child forked by ``os.fork()`` would run it, one forked by ``zygote_child.fork`` does not.
os.register_at_fork(after_in_child=lambda: _after_fork_hooks_run.append(os.getpid()))


def _write(args: dict[str, Any], data: object) -> None:
    out = Path(args["out"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(out)


ZYGOTE_ENTRIES = ("sleep", "exit_with", "raise_error", "segfault", "inspect", "fork_to_entry",
                  "allocate", "grandchild", "fill_run_dir", "jail_probe", "jail_forbidden",
                  "listen_and_sleep", "jail_net_probe", "record_phase", "python_after_fork",
                  "jail_neighbours")
"""Registered with the test zygotes only (``--entries-module test_zygote_entries``)."""


def sleep(args: dict[str, Any]) -> int:
    time.sleep(float(args.get("seconds", 3600)))
    if "out" in args:
        _write(args, {"pid": os.getpid(), "done": time.monotonic()})
    return 0


def exit_with(args: dict[str, Any]) -> int:
    print(f"exiting with {args['code']}", flush=True)
    return int(args["code"])


def raise_error(args: dict[str, Any]) -> int:
    raise RuntimeError("boom from the entry")


def segfault(args: dict[str, Any]) -> int:
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)
    return 0


def inspect(args: dict[str, Any]) -> int:
    """Report what the child inherited: fds, session, signals, cgroup, timing."""
    fds: dict[str, str] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listdir's own fd, already closed
    status = dict(line.split(":\t", 1) for line in
                  Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    ctx = current()
    assert ctx is not None
    _write(args, {
        "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
        "fds": fds, "sigblk": status["SigBlk"].strip(),
        # The kernel's dispositions (the child's set-up is native: Python's own table
        # names the zygote's handlers until an entry installs its own).
        "sigcgt": status["SigCgt"].strip(), "sigign": status["SigIgn"].strip(),
        "cgroup": Path("/proc/self/cgroup").read_text(),
        "ctx": {"vm_id": ctx.vm_id, "zygote_pid": ctx.zygote_pid, "cgroup": ctx.cgroup},
        "fork_to_entry_ns": ctx.entry_started_ns - ctx.forked_ns,
        "oom_score_adj": int(Path("/proc/self/oom_score_adj").read_text()),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        # A thread started now inherits the nice value (Linux keeps one per thread).
        "thread_nice": _thread_nice(),
        "thp_enabled": status["THP_enabled"].strip(),
    })
    time.sleep(float(args.get("linger", 0)))
    return 0


def _thread_nice() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
    thread.start()
    thread.join()
    return seen[0]


def fork_to_entry(args: dict[str, Any]) -> int:
    """Record the time from the zygote's fork() to this entry starting, then exit."""
    ctx = current()
    assert ctx is not None
    now = time.monotonic_ns()
    Path(args["out"], ctx.vm_id).write_text(f"{ctx.entry_started_ns - ctx.forked_ns} {now}")
    return 0


def allocate(args: dict[str, Any]) -> int:
    """Touch ``mib`` MiB of fresh memory (memset, so every page is really charged)."""
    chunks = []
    for _ in range(int(args["mib"])):
        chunks.append(b"\x01" * (1 << 20))
    _write(args, {"allocated_mib": len(chunks)})
    return 0


def grandchild(args: dict[str, Any]) -> int:
    """Start a grandchild that sleeps, report its pid, then sleep (or exit if ``exit``)."""
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    _write(args, {"grandchild": pid})
    if not args.get("exit"):
        time.sleep(3600)
    return 0


def fill_run_dir(args: dict[str, Any]) -> int:
    run_dir = Path(args["run_dir"])
    (run_dir / "sub").mkdir()
    (run_dir / "sub" / "state.bin").write_bytes(b"x" * 4096)
    (run_dir / "vm.sock").write_text("")
    print("run dir filled", flush=True)
    time.sleep(float(args.get("seconds", 3600)))
    return 0


def listen_and_sleep(args: dict[str, Any]) -> int:
    """A stand-in sandbox: a control socket in its run directory, then sleep."""
    import socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(Path(args["run_dir"]) / "control.sock"))
    sock.listen()
    time.sleep(float(args.get("seconds", 60)))
    return 0


def jail_probe(args: dict[str, Any]) -> int:
    """From inside a jail, try what a compromised VMM would: print what it got."""
    import fcntl
    import json
    import socket

    def attempt(what: str, action: Any) -> str:
        try:
            action()
            return "allowed"
        except OSError as err:
            return f"refused: {type(err).__name__} {err.errno}"

    def connect(path: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)

    status = dict(line.split(":\t", 1) for line in
                  Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    # No device node in the jail: /dev/kvm is the descriptor the jail opened first.
    kvm = open_device("/dev/kvm")
    assert kvm is not None
    import vmfork
    source = os.path.dirname(vmfork.__file__)
    report = {
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "cap_eff": status["CapEff"].strip(), "cap_bnd": status["CapBnd"].strip(),
        "no_new_privs": status["NoNewPrivs"].strip(), "env": dict(os.environ),
        "root": sorted(os.listdir("/")),
        "root_links": {name: os.readlink("/" + name) for name in os.listdir("/")
                       if os.path.islink("/" + name)},
        "dev_node": attempt("dev", lambda: os.open("/dev/kvm", os.O_RDWR)),
        # Python's paths (the zygote's shared tree): readable, importable, read-only.
        "late_import": ("fresh " if "colorsys" not in sys.modules else "") + attempt(
            "import", lambda: __import__("colorsys")),
        "source_write": attempt("src", lambda: open(os.path.join(source, "x.py"), "w").close()),
        "shared_write": attempt("shared", lambda: open("/.vmfork-shared/x", "w").close()),
        "shadow": attempt("shadow", lambda: open("/etc/shadow", "rb").close()),
        "peer_socket": attempt("peer", lambda: connect(args["peer_socket"])),
        "peer_mem": attempt("mem", lambda: open(f"/proc/{args['peer_pid']}/mem", "rb").close()),
        "zygote_environ": attempt("env", lambda: open(
            f"/proc/{current().zygote_pid}/environ", "rb").close()),  # type: ignore[union-attr]
        # Its own PID namespace: pid 1 is itself, and no host process can be named.
        "pid": os.getpid(), "ppid": os.getppid(),
        "procs": sorted(p for p in os.listdir("/proc") if p.isdigit()),
        "peer_signal": attempt("kill", lambda: os.kill(args["peer_pid"], 0)),
        "zygote_signal": attempt("kill", lambda: os.kill(
            current().zygote_pid, 0)),  # type: ignore[union-attr]
        "kvm_api": fcntl.ioctl(kvm, 0xAE00),   # KVM_GET_API_VERSION
        # Its network namespace, and the interfaces in it.
        "netns": os.readlink("/proc/self/ns/net"),
        "interfaces": sorted(line.split(":")[0].strip() for line in
                             Path("/proc/self/net/dev").read_text().splitlines()[2:]),
        "run_dir_write": attempt("run", lambda: Path(args["run_dir"], "x").write_text("x")),
        "snapshot_write": attempt("snap", lambda: open(args["snapshot_file"], "r+b").close()),
        "snapshot_read": Path(args["snapshot_file"]).read_bytes().decode(),
        "private_open": attempt("private", lambda: open(args["private_file"], "rb").close()),
        "private_preopened": os.read(open_ro(args["private_file"]), 100).decode(),
    }
    os.close(kvm)
    print(json.dumps(report), flush=True)
    return 0


def jail_neighbours(args: dict[str, Any]) -> int:
    """From inside a jail, while a sibling of its batch runs beside it: what its run
    directory's parent and the host directory above it list, whether the sibling's file
    and directory (their host paths) can be reached, and every mount point it has."""
    import json

    def attempt(action: Any) -> str:
        try:
            action()
            return "allowed"
        except OSError as err:
            return f"refused: {type(err).__name__} {err.errno}"

    run_dir = Path(args["run_dir"])
    time.sleep(float(args.get("linger", 0.5)))   # the sibling builds its jail meanwhile
    mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    report = {
        "parent": sorted(os.listdir(run_dir.parent)),
        "host": sorted(os.listdir(args["host_dir"])),
        "own": sorted(os.listdir(run_dir)),
        "sibling_file": attempt(lambda: open(args["sibling_file"], "rb").close()),
        "sibling_dir": attempt(lambda: os.listdir(args["sibling_dir"])),
        "fifo": "fifo" if stat.S_ISFIFO(os.stat(args["fifo"]).st_mode) else "not a fifo",
        "fifo_options": next((line.split()[5].split(",") for line in mountinfo
                              if line.split()[4] == args["fifo"]), []),
        "mounts": sorted({line.split()[4] for line in mountinfo}),
    }
    if "state" in args:
        report["state"] = Path(args["state"]).read_text()
    print(json.dumps(report), flush=True)
    return 0


def jail_forbidden(args: dict[str, Any]) -> int:
    """Install the VMM's seccomp filter, as a jailed VMM does, then make one call it
    must never make: the child should die with SIGSYS before returning."""
    import ctypes
    import socket

    from vmfork.runtime import seccomp

    seccomp.install_vmm_filter()
    call = args["call"]
    if call == "execve":
        os.execv("/bin/true", ["true"])
    elif call == "socket_inet":
        socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    elif call == "ptrace":
        ctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0)   # PTRACE_ATTACH the zygote
    return 0


def jail_net_probe(args: dict[str, Any]) -> int:
    """From inside a networked jail: the tap its jail attached, the namespace it is in,
    what else of the network it can reach, and its own dirty-page tracking files."""
    import fcntl
    import json

    from vmfork.vmm import openfiles

    tap = openfiles.take_tap(str(args["net_tap"]))
    name = ""
    if tap is not None:
        ifreq = fcntl.ioctl(tap, 0x800454D2, b"\0" * 40)   # TUNGETIFF
        name = ifreq[:16].rstrip(b"\0").decode()
    try:
        os.open("/dev/net/tun", os.O_RDWR)
        tun = "allowed"
    except OSError as err:
        tun = f"refused: {type(err).__name__}"
    pagemap = openfiles.open_proc_self("pagemap", os.O_RDONLY)
    entry = os.pread(pagemap, 8, 0)
    report = {"tap": name, "netns": os.stat("/proc/self/ns/net").st_ino, "tun": tun,
              "pagemap_bytes": len(entry),
              "clear_refs": os.write(openfiles.open_proc_self("clear_refs", os.O_WRONLY),
                                     b"4"),
              "uid": os.getuid()}
    print(json.dumps(report), flush=True)
    return 0


def record_phase(args: dict[str, Any]) -> int:
    """Record a memory phase of the entry's own (``runtime.memphases``), then sleep
    until killed."""
    from vmfork.runtime import memphases
    memphases.record("entry", args["run_dir"])
    time.sleep(3600)
    return 0


def python_after_fork(args: dict[str, Any]) -> int:
    """Report what a child forked without CPython's after-fork work can still do: run
    threads, log, install a signal handler (which needs the main thread)."""
    seen: list[str] = []
    threads = [threading.Thread(target=lambda i=i: seen.append(f"thread {i}")) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("python_after_fork")
    logger.addHandler(Keep())
    logger.warning("logged from pid %d", os.getpid())
    signal.signal(signal.SIGUSR1, lambda *_: seen.append("SIGUSR1"))
    signal.raise_signal(signal.SIGUSR1)
    _write(args, {"hooks_run": _after_fork_hooks_run, "seen": sorted(seen), "logged": records,
                  "main": threading.current_thread() is threading.main_thread(),
                  "pid": os.getpid()})
    return 0
