"""The guest's PID 1: set up a minimal Linux userland, then serve the agent over vsock.

The initramfs's ``/init`` is a three-line Python script that puts ``/opt/vmfork`` on
``sys.path`` and calls ``main()``. This module imports only ``os``, ``sys`` and ``time``
at the top, so the first console line (``vmfork-agent: init <uptime>``) marks the end of
interpreter start-up in the boot-time breakdown; everything heavier is imported after it.
``vmfork-agent: ready <uptime>`` follows once the vsock socket listens.

PID 1 is special in three ways that shape this file:

* If it exits, the kernel panics. ``main`` therefore never returns: each set-up step is
  run on its own (a failed mount is logged, the rest go on), and the serve loop restarts
  after any exception. Signals without a handler are not delivered to PID 1, so the
  default SIGTERM is harmless; SIGINT (which Python turns into KeyboardInterrupt) gets a
  no-op handler — a handler, not SIG_IGN, because ignored dispositions survive exec and
  the processes ``exec`` starts must see the default SIGINT.
* Orphans are re-parented to it: ``reaper.ZombieReaper`` collects them without taking
  exit statuses that belong to ``exec`` or to eval code (see ``reaper.py`` for why the
  plain ``wait(-1)`` loop of a classic init is wrong here).
* Nothing is set up for it: the kernel hands over an initramfs with no /proc, /sys or
  /dev (beyond the nodes packed in it) and a nearly empty environment.

Outside a VM (pid != 1), ``main`` skips the PID-1 duties; ``--unix PATH`` serves on a
Unix socket instead of vsock, for trying the agent on a development machine.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily at run time, after the "init" line
    import socket
    from collections.abc import Callable

    from vmfork.agent.reaper import OwnedPids

CONSOLE = "/dev/console"
DEFAULT_HOSTNAME = "vmfork"

_console_fd: int | None = None
_console_dropped = 0


def _open_console() -> int | None:
    if os.getpid() != 1:
        return 2  # a development run: the machine's real console is not ours
    # Non-blocking: the console is a serial line, one VM exit per character. When the
    # host is slow to serve those exits (a hundred children starting on a busy host),
    # a blocking write would stall whichever agent thread logs -- a connection's
    # thread, with the host waiting on it -- for as long as the line takes to drain.
    flags = os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK
    for path in (CONSOLE, "/proc/self/fd/2"):  # else the kernel's console, reopened
        try:
            return os.open(path, flags)
        except OSError:
            continue
    return None


def log(message: str) -> None:
    """One line on the guest console (the host's serial log). Never blocks: a line
    the console has no room for is dropped, and the next one that fits says how many
    were."""
    global _console_fd, _console_dropped
    if _console_fd is None:
        _console_fd = _open_console()
    if _console_fd is None:
        return
    data = f"vmfork-agent: {message}\n".encode("utf-8", "backslashreplace")
    if _console_dropped:
        data = (f"vmfork-agent: ({_console_dropped} lines dropped: the console was "
                f"full)\n").encode() + data
    try:
        written = os.write(_console_fd, data)
    except BlockingIOError:
        _console_dropped += 1
        return
    except OSError:
        return
    _console_dropped = 0
    if written < len(data):  # the rest of a line that only partly fitted
        try:
            os.write(_console_fd, b"...\n")
        except OSError:
            pass


def _uptime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


# -- set-up steps, in order ----------------------------------------------------------

_DIRS_MODE = 0o755

# (fstype, target, flags, data); flags from system.MS_*: nosuid=2, nodev=4, noexec=8.
_MOUNTS: tuple[tuple[str, str, int, str], ...] = (
    ("proc", "/proc", 0x2 | 0x4 | 0x8, ""),
    ("sysfs", "/sys", 0x2 | 0x4 | 0x8, ""),
    ("devtmpfs", "/dev", 0x2, "mode=0755"),
    ("devpts", "/dev/pts", 0x2 | 0x8, "mode=0620,gid=5,ptmxmode=0666"),
    ("tmpfs", "/dev/shm", 0x2 | 0x4, "mode=1777"),
    ("tmpfs", "/tmp", 0x2 | 0x4, "mode=1777"),
    ("tmpfs", "/run", 0x2 | 0x4, "mode=0755"),
)


def _mountpoints() -> set[str]:
    try:
        with open("/proc/self/mounts") as f:
            return {line.split()[1] for line in f if len(line.split()) > 1}
    except OSError:
        return set()


def mount_filesystems() -> None:
    from vmfork.agent import system

    for fstype, target, flags, data in _MOUNTS:
        if target == "/proc" and os.path.exists("/proc/self"):
            continue
        if target in _mountpoints():
            continue
        try:
            os.makedirs(target, _DIRS_MODE, exist_ok=True)
            system.mount(fstype, target, fstype, flags, data)
        except OSError as err:
            log(f"mount {fstype} on {target} failed: {err}")


def populate_dev() -> None:
    links = {"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0",
             "/dev/stdout": "/proc/self/fd/1", "/dev/stderr": "/proc/self/fd/2"}
    if not os.path.exists("/dev/ptmx"):
        links["/dev/ptmx"] = "pts/ptmx"
    for link, target in links.items():
        if not os.path.lexists(link):
            try:
                os.symlink(target, link)
            except OSError as err:
                log(f"symlink {link} -> {target} failed: {err}")


def fix_stdio() -> None:
    """Give fds 0-2 and sys.stdout/stderr a home: /dev/null in, the console out. The
    kernel only opens them if the initramfs carries a /dev/console node."""
    global _console_fd
    if _console_fd is not None and _console_fd != 2:
        os.close(_console_fd)
    _console_fd = None  # reopen /dev/console now that devtmpfs is mounted
    for fd, path, flags in ((0, "/dev/null", os.O_RDONLY), (1, CONSOLE, os.O_WRONLY),
                            (2, CONSOLE, os.O_WRONLY)):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        try:
            new = os.open(path, flags | os.O_NOCTTY)
        except OSError:
            continue
        if new != fd:
            os.dup2(new, fd)
            os.close(new)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:
            try:
                stream = open(fd, "w", buffering=1, encoding="utf-8",  # noqa: SIM115 - for
                              errors="backslashreplace", closefd=False)  # PID 1's lifetime
                setattr(sys, name, stream)
            except OSError:
                pass


def set_environment() -> None:
    from vmfork.agent import defaults

    image = defaults.load()
    for problem in image.problems:
        log(problem)
    os.environ.update(image.env)
    os.environ.setdefault("TERM", "linux")
    os.chdir("/")


def kernel_cmdline() -> dict[str, str]:
    try:
        with open("/proc/cmdline") as f:
            words = f.read().split()
    except OSError:
        return {}
    return dict(w.split("=", 1) for w in words if "=" in w)


def set_hostname() -> None:
    import socket

    name = kernel_cmdline().get("vmfork.hostname", DEFAULT_HOSTNAME)
    socket.sethostname(name)


def loopback_up() -> None:
    from vmfork.agent import system

    system.interface_up("lo")


def network_up() -> None:
    from vmfork.agent import network

    line = network.configure_from_cmdline(kernel_cmdline())
    if line is not None:
        log(line)


def install_signal_handlers() -> None:
    import signal

    signal.signal(signal.SIGINT, lambda signum, frame: None)


def install_excepthooks() -> None:
    import threading
    import traceback

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                  args.exc_traceback))
        name = args.thread.name if args.thread is not None else "?"
        log(f"uncaught exception in thread {name}:\n{text}")

    threading.excepthook = thread_hook


def start_reaper() -> OwnedPids:
    import threading

    from vmfork.agent.reaper import OwnedPids, ZombieReaper

    owned = OwnedPids()
    reaper = ZombieReaper(owned, log=log)
    threading.Thread(target=reaper.run_forever, name="reaper", daemon=True).start()
    return owned


PID1_STEPS: tuple[tuple[str, Callable[[], None]], ...] = (
    ("environment", set_environment),
    ("mounts", mount_filesystems),
    ("stdio", fix_stdio),
    ("/dev links", populate_dev),
    ("loopback", loopback_up),
    ("network", network_up),
    ("hostname", set_hostname),
    ("signals", install_signal_handlers),
)


def _run_step(name: str, step: Callable[[], None]) -> None:
    try:
        step()
    except BaseException as err:  # noqa: BLE001 - PID 1 must reach the serve loop
        log(f"set-up step {name!r} failed: {type(err).__name__}: {err}")


# -- serving -----------------------------------------------------------------------


def _listen_vsock() -> socket.socket:
    import socket

    from vmfork.agent.protocol import AGENT_PORT

    sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    try:
        sock.bind((socket.VMADDR_CID_ANY, AGENT_PORT))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _listen_unix(path: str) -> socket.socket:
    import socket

    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(128)
    return sock


def serve(pid1: bool, unix_path: str | None) -> None:
    """Listen and serve; on any failure, log, wait a second and start again. Never
    returns in PID 1."""
    from vmfork.agent import system
    from vmfork.agent.reaper import OwnedPids
    from vmfork.agent.server import AgentServer

    owned = start_reaper() if pid1 else OwnedPids()
    announced = False
    while True:
        try:
            listener = _listen_unix(unix_path) if unix_path else _listen_vsock()
            if not announced:
                log(f"ready {_uptime():.3f}")
                announced = True
            else:
                log("listening again")
            server = AgentServer(listener, owned=owned, log=log,
                                 power=system.power_off if pid1 else None)
            server.serve_forever()
            if not pid1:
                return
        except BaseException as err:  # noqa: BLE001 - PID 1 must not exit
            if not pid1 and isinstance(err, KeyboardInterrupt):
                return
            log(f"serve loop failed: {type(err).__name__}: {err}; restarting in 1 s")
            time.sleep(1.0)


def main(argv: list[str] | None = None) -> None:
    """The agent's entry point (``/init`` calls it with no arguments)."""
    log(f"init {_uptime():.3f}")
    args = sys.argv[1:] if argv is None else argv
    unix_path: str | None = None
    if len(args) == 2 and args[0] == "--unix":
        unix_path = args[1]
    elif args:
        log(f"ignoring arguments {args!r} (usage: main [--unix PATH])")
    pid1 = os.getpid() == 1
    if pid1:
        install_excepthooks()
        for name, step in PID1_STEPS:
            _run_step(name, step)
    elif unix_path is None:
        log("not PID 1: skipping the PID-1 set-up, serving on vsock only")
    serve(pid1, unix_path)


if __name__ == "__main__":
    main()
