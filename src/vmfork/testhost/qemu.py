"""Running one command in the emulated test host: the QEMU command line and its supervision.

QEMU emulates (TCG, one host thread per vCPU) a q35 PC with an AMD EPYC CPU that has
SVM, so Debian's kernel inside gets a real ``/dev/kvm`` from ``kvm_amd``. Three
channels leave the guest, each a pipe that this process reads in its own thread:

- the serial console (kernel and ``/init`` messages only): kept as a tail for error
  reports, and shown on stderr with ``show_console``; its heartbeat lines tell a hung
  test-host kernel (QEMU is killed after ``HEARTBEAT_LOST_SECONDS`` of silence, a
  test-host failure) from a command that is merely slow (only the timeout stops it);
- the virtio-serial ports ``stdout`` and ``stderr``: the command's two streams, copied to
  ours as they arrive, separately (so ``2>/dev/null`` on the caller's side works);
- QEMU's own stderr (its start-up errors), kept with the console tail.

QEMU opens the pipes as ``file`` chardevs at ``/proc/self/fd/<n>``: a pipe does not
care about the ``O_TRUNC`` QEMU opens files with, and the guest's ``write`` to a port
returns only once QEMU has taken the bytes, so nothing written before ``poweroff``
is lost. The exit status comes back as a file in the per-run control share, never
parsed from a console. QEMU gets its own session, so a Ctrl-C on the caller's
terminal reaches only us; we then kill QEMU (it holds no state worth a clean stop).
QEMU also asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), so
a caller killed outright (SIGKILL, or SIGTERM with no handler: no ``finally`` runs)
never leaves an emulated host running.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from vmfork.paths import run_dir
from vmfork.testhost import monitor
from vmfork.testhost.errors import (
    TesthostBootError,
    TesthostSetupError,
    TesthostTimeout,
)
from vmfork.testhost.initramfs import HostImage
from vmfork.testhost.initscript import (
    BOOT_SECONDS_FILE,
    CTL_TAG,
    HEARTBEAT_PREFIX,
    HEARTBEAT_SECONDS,
    JOB_FILE,
    KALLSYMS_FILE,
    ROOT_TAG,
    STATUS_FILE,
    STDERR_PORT,
    STDOUT_PORT,
    WANT_KALLSYMS_FILE,
    Job,
    render_job,
    rw_tag,
)

log = logging.getLogger(__name__)

QEMU = "qemu-system-x86_64"
QEMU_PACKAGE = "qemu-system-x86"
# quiet + loglevel: the console is slow under TCG and nobody reads it unless a run fails;
# loglevel=4 still prints errors (soft lockups, RCU stalls, hung tasks: the clues to a
# hung test host).
# cryptomgr.notests skips the crypto self-tests (~0.25 s of emulated boot).
# panic=-1 with QEMU's -no-reboot turns a guest panic into a prompt QEMU exit.
# nohz=off highres=off: a periodic local-APIC tick instead of one-shot timers. With
# one-shot timers the test host's kernel was found (through QEMU's monitor) halted in
# its idle loop for good, the wake-up it had programmed never delivered: about half of
# the leak checks' hosts under a stream of nested VMs, none of 8 with the periodic tick,
# which QEMU re-arms itself.
KERNEL_CMDLINE = ("console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init cryptomgr.notests "
                  "nohz=off highres=off")
CONSOLE_TAIL_BYTES = 16384
# Six missed heartbeats: far beyond any scheduling delay of a loaded emulated host.
HEARTBEAT_LOST_SECONDS = 6 * HEARTBEAT_SECONDS
# From QEMU's start to the first heartbeat (the command starting): the emulated boot
# takes 10-40 s on a loaded machine.
BOOT_SECONDS_LIMIT = 300.0


def _qemu_path_arg(path: str) -> str:
    """QEMU option values escape a literal comma by doubling it."""
    return path.replace(",", ",,")


# TCG runs each vCPU in a host thread of its own (multi) or all in one (single);
# $VMFORK_TESTHOST_TCG_THREAD picks, for chasing emulation faults that need parallel vCPUs.
TCG_THREAD_ENV = "VMFORK_TESTHOST_TCG_THREAD"


def _tcg_thread() -> str:
    value = os.environ.get(TCG_THREAD_ENV, "multi")
    if value not in ("multi", "single"):
        raise TesthostSetupError(f"${TCG_THREAD_ENV}={value!r}: use multi or single")
    return value


def qemu_command(qemu: str, image: HostImage, *, ctl_dir: str, rw_paths: Sequence[str],
                 mem_mib: int, cpus: int, console_fd: int, stdout_fd: int,
                 stderr_fd: int, monitor_path: str | None = None) -> list[str]:
    """The full QEMU argv (fds are this process's, passed to QEMU under the same numbers)."""
    cmd = [
        qemu, "-M", "q35", "-accel", f"tcg,thread={_tcg_thread()}", "-smp", str(cpus),
        "-cpu", "EPYC,+svm", "-m", str(mem_mib),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", str(image.kernel), "-initrd", str(image.initramfs),
        "-append", KERNEL_CMDLINE,
        "-chardev", f"file,id=console,path=/proc/self/fd/{console_fd}",
        "-serial", "chardev:console",
        "-device", "virtio-serial-pci,id=ports",
        "-chardev", f"file,id=out,path=/proc/self/fd/{stdout_fd}",
        "-device", f"virtserialport,bus=ports.0,chardev=out,name={STDOUT_PORT}",
        "-chardev", f"file,id=err,path=/proc/self/fd/{stderr_fd}",
        "-device", f"virtserialport,bus=ports.0,chardev=err,name={STDERR_PORT}",
        "-virtfs", (f"local,path=/,mount_tag={ROOT_TAG},security_model=none,readonly=on,"
                    "multidevs=remap"),
        "-virtfs", (f"local,path={_qemu_path_arg(ctl_dir)},mount_tag={CTL_TAG},"
                    "security_model=none"),
    ]
    for index, path in enumerate(rw_paths):
        cmd += ["-virtfs", (f"local,path={_qemu_path_arg(path)},mount_tag={rw_tag(index)},"
                            "security_model=none,multidevs=remap")]
    if monitor_path is not None:
        cmd += monitor.monitor_option(_qemu_path_arg(monitor_path))
    return cmd


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """In the forked child before exec: SIGKILL when the parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


def _binary_stream(stream: object) -> BinaryIO | None:
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else None


@dataclass
class _Relay:
    """Copies one pipe to a stream as data arrives, optionally keeping a tail."""

    fd: int
    sink: BinaryIO | None
    keep_tail: bool = False
    tail: collections.deque[bytes] = field(default_factory=collections.deque)
    _tail_bytes: int = 0
    thread: threading.Thread | None = None
    last_heartbeat: float | None = None  # time.monotonic() of the last heartbeat line seen
    _unmatched: bytes = b""  # the console's last bytes, for a heartbeat split across reads

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"testhost-relay-{self.fd}")
        self.thread.start()

    def _run(self) -> None:
        with open(self.fd, "rb", buffering=0, closefd=True) as pipe:
            while chunk := pipe.read(65536):
                self._watch_for_heartbeat(chunk)
                if self.sink is not None:
                    try:
                        self.sink.write(chunk)
                        self.sink.flush()
                    except (OSError, ValueError):
                        self.sink = None  # the caller closed its stream; keep draining
                if self.keep_tail:
                    self.tail.append(chunk)
                    self._tail_bytes += len(chunk)
                    while self._tail_bytes - len(self.tail[0]) > CONSOLE_TAIL_BYTES:
                        self._tail_bytes -= len(self.tail.popleft())

    def _watch_for_heartbeat(self, chunk: bytes) -> None:
        # The emulated UART hands QEMU one byte at a time, so a heartbeat line usually
        # arrives over many reads: search the bytes kept from before plus this chunk.
        prefix = HEARTBEAT_PREFIX.encode()
        window = self._unmatched + chunk
        found = window.rfind(prefix)
        if found >= 0:
            self.last_heartbeat = time.monotonic()
            window = window[found + len(prefix):]
        self._unmatched = window[-(len(prefix) - 1):]

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def text(self) -> str:
        return b"".join(self.tail)[-CONSOLE_TAIL_BYTES:].decode(errors="replace")


@dataclass(frozen=True)
class RunResult:
    """What one emulated run reports besides the exit status (for logs and benchmarks)."""

    status: int
    boot_seconds: float | None  # guest uptime when the command started
    wall_seconds: float


def _without_tcg_warnings(text: str) -> str:
    """QEMU warns about every EPYC feature TCG lacks, on every start; that is no clue."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if "TCG doesn't support requested feature" not in line)


def _diagnose(returncode: int | None, console: str, qemu_stderr: str) -> str:
    if "Kernel panic" in console:
        line = next(ln for ln in console.splitlines() if "Kernel panic" in ln)
        return f"the test host's kernel panicked: {line.strip()}"
    for line in console.splitlines():
        if line.startswith("vmfork-testhost init:"):
            return f"the test host's /init failed: {line.split(':', 1)[1].strip()}"
    if returncode:
        first = qemu_stderr.strip().splitlines()[:1]
        why = f": {first[0]}" if first else ""
        return f"QEMU exited with status {returncode}{why}"
    return "the test host powered off without reporting an exit status"


RUN_PREFIX = "testhost-"
OWNER_FILE = "owner.pid"
LEGACY_RUN_AGE_S = 24 * 3600.0


def sweep_stale_runs(base: Path) -> list[str]:
    """Remove the control directories (and monitor sockets) of test-host runs whose
    owner is gone: killed with SIGKILL, nothing of ours ran to clean up. A run names
    its owner in ``owner.pid``; a directory without one (made before that file
    existed) goes once it is a day old. Returns the names removed."""
    removed: list[str] = []
    for entry in sorted(base.glob(f"{RUN_PREFIX}*")):
        if not entry.is_dir() or entry.is_symlink() or entry.name.startswith(
                f"{RUN_PREFIX}native-kvm-"):
            continue
        try:
            owner = int((entry / OWNER_FILE).read_text().strip())
        except FileNotFoundError:
            try:
                stale = time.time() - entry.stat().st_mtime > LEGACY_RUN_AGE_S
            except OSError:
                continue
        except (OSError, ValueError):
            continue  # unreadable: not ours to judge
        else:
            stale = not _pid_alive(owner)
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            (base / f"{entry.name}.monitor").unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        log.info("removed %d stale test-host run directories", len(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_emulated(job: Job, image: HostImage, *, mem_mib: int, cpus: int,
                 timeout: float | None, show_console: bool = False) -> RunResult:
    """Boot the test host, run ``job`` in it, and return its exit status.

    Raises ``TesthostTimeout`` (after killing QEMU) when ``timeout`` seconds pass, and
    ``TesthostBootError`` with the console tail when no exit status comes back.
    """
    qemu = shutil.which(QEMU)
    if qemu is None:
        raise TesthostSetupError(f"{QEMU} not found; install it: apt-get install {QEMU_PACKAGE}")
    base = run_dir()
    base.mkdir(parents=True, exist_ok=True)
    sweep_stale_runs(base)
    ctl_dir = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=base))
    (ctl_dir / OWNER_FILE).write_text(f"{os.getpid()}\n")
    # Beside the control share, not in it: the guest sees that directory.
    monitor_path = base / f"{ctl_dir.name}.monitor"
    pipes: list[int] = []
    proc: subprocess.Popen[bytes] | None = None
    try:
        (ctl_dir / JOB_FILE).write_text(render_job(job))
        if not monitor.symbols_path(image.kernel_version).exists():
            (ctl_dir / WANT_KALLSYMS_FILE).touch()
        console_r, console_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        qerr_r, qerr_w = os.pipe()
        pipes = [console_w, out_w, err_w, qerr_w]
        cmd = qemu_command(qemu, image, ctl_dir=str(ctl_dir), rw_paths=job.rw_paths,
                           mem_mib=mem_mib, cpus=cpus, console_fd=console_w,
                           stdout_fd=out_w, stderr_fd=err_w, monitor_path=str(monitor_path))
        log.debug("starting %s", " ".join(cmd))
        relays = [
            _Relay(console_r, _binary_stream(sys.stderr) if show_console else None,
                   keep_tail=True),
            _Relay(out_r, _binary_stream(sys.stdout)),
            _Relay(err_r, _binary_stream(sys.stderr)),
            _Relay(qerr_r, _binary_stream(sys.stderr) if show_console else None,
                   keep_tail=True),
        ]
        for relay in relays:
            relay.start()
        started = time.monotonic()
        parent_pid = os.getpid()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=qerr_w,
                                    stderr=qerr_w, pass_fds=(console_w, out_w, err_w),
                                    start_new_session=True,
                                    preexec_fn=lambda: _die_with_parent(parent_pid))
        except OSError as err:
            raise TesthostSetupError(f"cannot start {qemu}: {err}") from err
        finally:
            # Only QEMU may hold the write ends, so the relays see EOF when it exits.
            for fd in pipes:
                os.close(fd)
            pipes = []
        returncode = _supervise(
            proc, relays, started, timeout,
            where_cpus_are=lambda: monitor.where_cpus_are(
                str(monitor_path), monitor.Symbols.load(image.kernel_version,
                                                        ctl_dir / KALLSYMS_FILE)))
        wall = time.monotonic() - started
        for relay in relays:
            relay.join(5.0)
        status_text = _read(ctl_dir / STATUS_FILE)
        boot_text = _read(ctl_dir / BOOT_SECONDS_FILE)
        if status_text is None or not status_text.strip().isdigit():
            console = relays[0].text()
            qemu_stderr = _without_tcg_warnings(relays[3].text())
            raise TesthostBootError(_diagnose(returncode, console, qemu_stderr),
                                    console_tail=(qemu_stderr + console)[-CONSOLE_TAIL_BYTES:])
        boot = float(boot_text) if boot_text and _is_float(boot_text) else None
        log.info("test host: kernel %s, command started at guest uptime %s s, %.2f s wall",
                 image.kernel_version, boot_text and boot_text.strip(), wall)
        return RunResult(int(status_text), boot, wall)
    finally:
        for fd in pipes:
            os.close(fd)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            monitor.keep_symbols(image.kernel_version, ctl_dir / KALLSYMS_FILE)
        except OSError as err:
            log.warning("could not cache the test host's kernel symbols: %s", err)
        shutil.rmtree(ctl_dir, ignore_errors=True)
        monitor_path.unlink(missing_ok=True)


def _supervise(proc: subprocess.Popen[bytes], relays: list[_Relay], started: float,
               timeout: float | None, where_cpus_are: Callable[[], str] | None = None) -> int:
    """Wait for QEMU to exit; kill it on the timeout or when the heartbeat stops (first
    asking ``where_cpus_are`` for the report)."""
    console = relays[0]
    while True:
        now = time.monotonic()
        wait = 5.0 if timeout is None else min(5.0, max(0.0, started + timeout - now))
        try:
            return proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        # The first heartbeat comes as the command starts; until then the host boots.
        if console.last_heartbeat is None:
            silent, limit = now - started, BOOT_SECONDS_LIMIT
        else:
            silent, limit = now - console.last_heartbeat, HEARTBEAT_LOST_SECONDS
        timed_out = timeout is not None and now - started >= timeout
        if not timed_out and silent < limit:
            continue
        cpus = where_cpus_are() if where_cpus_are is not None and not timed_out else None
        proc.kill()
        proc.wait()
        for relay in relays:
            relay.join(2.0)
        if timed_out:
            raise TesthostTimeout(
                f"the command did not finish within {timeout:g} s; QEMU was killed "
                "(raise --timeout, or find what hangs with --console)",
                console_tail=console.text())
        if console.last_heartbeat is None:
            what = f"the test host did not start the command within {silent:.0f} s"
        else:
            what = (f"the test host stopped answering: no heartbeat on its console for "
                    f"{silent:.0f} s (its kernel hung)")
        raise TesthostBootError(
            f"{what}; QEMU was killed {now - started:.0f} s after it started"
            + (f"; {cpus}" if cpus else ""), console_tail=console.text())


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
