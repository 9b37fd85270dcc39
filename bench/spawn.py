"""Spawn benchmark: N VMs of one warm guest, vmfork vs QEMU vs the KVM floor.

For each N (default 1, 10, 100), in one run and on the same image (our kernel
and initramfs, 256 MiB, 1 vCPU), four peers start N VMs in parallel:

* **vmfork**: a warm parent (``--warm`` code run by the agent) is snapshotted
  once; the zygote forks N VMM processes that restore it by mapping its
  ``memory.bin`` ``MAP_PRIVATE``. Timed from the spawn request to all children
  restored and running (host side, ``ForkReport.restored_s``) and to all agents
  answered (``ready_s``: the agent answered a ping and the guest was reseeded
  and its clock set).
* **QEMU cold boot**: N ``qemu-system-x86_64 -M microvm -enable-kvm`` booting
  the same kernel, initramfs and command line. Timed from the first process
  start to every QMP ``query-status`` saying ``running`` and to every agent
  answering a ping over vhost-vsock (or printing its ``ready`` console line
  where the host has no ``/dev/vhost-vsock``).
* **QEMU templating** (the Kata Containers method): one parent boots with its
  RAM in a ``memory-backend-file`` with ``share=on`` (so guest RAM *is* the
  file), is warmed like vmfork's parent, paused and migrated to a file with the
  ``x-ignore-shared`` capability -- which leaves shared RAM blocks out of the
  stream, so the state file holds only device/vCPU state. N clones map the same
  file with ``share=off`` (``MAP_PRIVATE``: copy-on-write, like vmfork) and load
  the state through ``-incoming defer`` + ``migrate-incoming`` with the same
  capability set (else they would expect RAM pages in the stream). The parent
  was paused when it migrated, so a clone comes up paused and is sent ``cont``.
  Timed from the first clone start to all ``running`` and to all pings.
* **the floor** (``bench/kvm_floor.c``, compiled here with ``cc``): per child
  a ``fork`` and only the KVM calls a restore needs, no VMM around them.
* **vmfork, native children** (``--peers ...,native``): the same spawns from a second
  zygote started with ``VMFORK_NATIVE_CHILD=1``, whose children run no Python after
  the fork (``native/src/native_fork.rs``); the ``vmfork`` peer's zygote then runs
  Python children (``VMFORK_NATIVE_CHILD=0``), so the two are measured side by side,
  alternated per N. Without the ``native`` peer the ``vmfork`` peer's children are the
  default's (native, unless ``VMFORK_NATIVE_CHILD=0``).
  ``--b-env NAME=VALUE`` (repeatable) adds **native children, B** (``native_b``): a
  third zygote whose environment adds those (and the spawner's while it spawns from
  it), alternated with ``native``, so a knob's before and after are measured in one run.

``--phases`` starts the zygotes with ``VMFORK_SPAWN_PROFILE=1``: each child, Python or
native, records the end of each step from ``fork()`` to ready in its
``spawn-profile.json`` (``runtime/spawnprofile.py``; ``native/src/spawn_profile.rs``
writes the same record under the same phase names), and the results get a table of
the median of each phase per peer and N, beside the agent's retries.

Memory per idle child is read from ``/proc/<pid>/smaps`` (the whole process and the
guest-RAM mapping alone, from one read), once every agent has answered and the VMs
have been idle for ``--settle`` seconds; see ``read_memory`` for what is counted where.

``--breakdown`` adds where each idle vmfork child's own Private_Dirty is, by mapping
class (``runtime/memphases.py``: Python's arenas, the brk heap, thread stacks, the
interpreter's data and bss, ...), by phase of the child's life (each child records its
own at fork, set-up, jail, restore, agent answered, start-up memory given back, and
idle: the zygote runs with ``VMFORK_MEMORY_PHASES``), and its threads' wake-ups per
second while idle. The probe costs the child a little memory of its own, and time:
each phase reads the child's ``smaps`` (tens of ms in the emulated host; one run's
jailed children took 181 ms from fork to their entry with it, against ~40 ms in
``bench/spawn_profile.py``), so compare runs made with the same flags, and take spawn
times from runs without it.

``--network`` runs the networking benchmark instead (issue 7), written to
``bench/results/spawn-network.{json,md}``: vmfork spawns of N children without
and with per-child network namespaces, interleaved: made for the spawn, or
taken from a pool of spares filled before the request (plus the time to make,
pool and remove the namespaces), and guest TCP throughput to the host. The guest image
has no iperf3, so the guest sends with a Python socket loop; the peers,
measured in the same run, are that same Python sender in a plain network
namespace (what Python sockets can push here, without a VM) and Debian's
iperf3 over the same kind of veth path (what the host's network path carries).

``--vsock`` runs the vsock benchmark instead, written to
``bench/results/spawn-vsock.{json,md}``: one child, and ``--vsock-mib`` MiB moved
through its agent over vsock each way, ``--reps`` times: host -> guest (``write_file``
into the guest's RAM-backed ``/tmp``) and guest -> host (``read_file`` of it back).
What it measures is the whole path users see (the vsock device, the host Unix socket
and the agent's framing), so the agent's share stays in both columns alike. It has one
peer: vsock has one implementation, the native server; the Python device it was
compared with (``VMFORK_NATIVE_VSOCK_SERVE=0``) is gone, and its figures against the
server are in docs/design-notes.md's session-15 entry "vsock served on the loop without
the GIL".

Writes ``bench/results/spawn.{json,md}``. On a host whose KVM cannot run
unmodified guests it re-runs itself inside the emulated test host, where only
ratios between peers of the same run mean anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BENCH_DIR, RESULTS, ensure_kvm_host, summary, where, write_results

READY_MARKER = b"vmfork-agent: ready"
MIB = 1 << 20
# Run in this order at each N; templating last, because 100 clones (100 vhost
# workers) is what has crashed the emulated host's kernel.
PEERS = ("vmfork", "native", "native_b", "floor", "cold", "template")
# The peers that are vmfork spawns: Python children, and children that run no Python.
VMFORK_PEERS = ("vmfork", "native", "native_b")
# --network: no network, a namespace made per child, a namespace taken from the pool.
NETWORK_MODES = ("plain", "netns", "pooled")
PEER_TITLES = {"vmfork": "vmfork", "native": "vmfork, native children",
               "native_b": "native children, B",
               "floor": "floor (C, KVM calls only)",
               "template": "QEMU templating", "cold": "QEMU cold boot"}
# vhost-vsock CIDs are global on the host; give each QEMU peer its own range.
COLD_CID_BASE = 1000
TEMPLATE_PARENT_CID = 2999
TEMPLATE_CID_BASE = 3000
# A peer is run at N only if N times its per-child memory (measured at a smaller
# N) fits in this share of MemAvailable; the rest is headroom for the kernel.
MEMORY_HEADROOM = 0.75


class BenchError(RuntimeError):
    """One step of the benchmark failed; the message names the peer and the step."""


# --------------------------------------------------------------------------- memory

@dataclass(frozen=True)
class MemUse:
    """One process's memory, KiB.

    ``pss``/``private_dirty`` are the whole process, the ``guest_*`` figures the
    guest-RAM mapping alone, both summed from one read of ``smaps``. ``own_*``
    (process minus guest RAM) is the VMM process itself. One read, not
    ``smaps_rollup`` and then ``smaps``: a guest's balloon discards its free pages
    when it likes, and a discard between two reads counted megabytes of guest RAM as
    the VMM's own (an idle N = 1 child read 6.4-8.0 MiB instead of ~5.0 in a run of
    four, session 18).

    Guest pages a VM copied on write are the mapping's ``Anonymous`` pages: in a
    ``MAP_PRIVATE`` file mapping (vmfork, QEMU clones) a page becomes anonymous
    exactly when it is written; for QEMU cold boot the guest RAM is anonymous,
    so it is every page the guest touched. The mapping's Private_Dirty is *not*
    that measure here: the snapshot files live on tmpfs, whose page-cache pages
    are always dirty, so a page the guest only read counts as Private_Dirty when
    one process maps it (N = 1) and as Shared_Dirty once siblings map it too.
    For the process as a whole, Private_Dirty counts pages mapped by this
    process alone: pages a forked child still shares copy-on-write with the
    zygote (or siblings) are Shared_Dirty, and only their 1/n share is in Pss.
    """

    pss: int
    private_dirty: int
    guest_pss: int
    guest_private_dirty: int
    guest_rss: int  # guest pages mapped in this process at all (read or written)
    guest_cow: int  # guest pages this VM wrote: its own copies (Anonymous)

    @property
    def own_pss(self) -> int:
        return self.pss - self.guest_pss

    @property
    def own_private_dirty(self) -> int:
        return self.private_dirty - self.guest_private_dirty


_MAPPING_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def _kib_fields(text: str, names: tuple[str, ...]) -> dict[str, int]:
    out = dict.fromkeys(names, 0)
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in out:
            out[key] += int(rest.split()[0])
    return out


def read_memory(pid: int, is_guest_ram: Callable[[int, str], bool]) -> MemUse:
    """``is_guest_ram(size_bytes, path)`` picks the guest-RAM mapping(s) in smaps."""
    try:
        smaps = Path(f"/proc/{pid}/smaps").read_text()
    except OSError as err:
        raise BenchError(f"read memory of pid {pid}: {err} (the VM exited?)") from err
    total = {"Pss": 0, "Private_Dirty": 0}
    guest = {"Pss": 0, "Private_Dirty": 0, "Rss": 0, "Anonymous": 0}
    in_guest = False
    for line in smaps.splitlines():
        header = _MAPPING_HEADER.match(line)
        if header is not None:
            size = int(header.group(2), 16) - int(header.group(1), 16)
            in_guest = is_guest_ram(size, header.group(3).strip())
            continue
        key, _, rest = line.partition(":")
        if key not in total and not (in_guest and key in guest):
            continue
        kib = int(rest.split()[0])
        if key in total:
            total[key] += kib
        if in_guest and key in guest:
            guest[key] += kib
    return MemUse(total["Pss"], total["Private_Dirty"], guest["Pss"], guest["Private_Dirty"],
                  guest["Rss"], guest["Anonymous"])


def mem_available_kib() -> int:
    return _kib_fields(Path("/proc/meminfo").read_text(), ("MemAvailable",))["MemAvailable"]


def memory_summary(uses: list[MemUse]) -> dict[str, float]:
    """Median per child, MiB."""
    def med(values: list[int]) -> float:
        return statistics.median(values) / 1024 if values else float("nan")
    return {"pss_mib": med([u.pss for u in uses]),
            "own_pss_mib": med([u.own_pss for u in uses]),
            "own_private_dirty_mib": med([u.own_private_dirty for u in uses]),
            "guest_pss_mib": med([u.guest_pss for u in uses]),
            "guest_private_dirty_mib": med([u.guest_private_dirty for u in uses]),
            "guest_rss_mib": med([u.guest_rss for u in uses]),
            "guest_cow_mib": med([u.guest_cow for u in uses]),
            "children": len(uses)}


# --------------------------------------------------------------------------- QMP

class QmpError(BenchError):
    pass


class Qmp:
    """A minimal QMP client: one command at a time, events skipped."""

    def __init__(self, path: Path, deadline: float, proc: subprocess.Popen[bytes]) -> None:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
                break
            except OSError as err:
                sock.close()
                if proc.poll() is not None:
                    raise QmpError(f"QEMU (pid {proc.pid}) exited with status "
                                   f"{proc.returncode} before its QMP socket answered") from err
                if time.monotonic() > deadline:
                    raise QmpError(f"QMP socket {path} did not answer: {err}") from err
                time.sleep(0.005)
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        self.sock = sock
        self.reader = sock.makefile("rb")
        greeting = json.loads(self.reader.readline() or b"null")
        if not isinstance(greeting, dict) or "QMP" not in greeting:
            raise QmpError(f"{path}: not a QMP greeting: {greeting!r}")
        self.execute("qmp_capabilities")

    def execute(self, command: str, **arguments: Any) -> Any:
        message: dict[str, Any] = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        while True:
            line = self.reader.readline()
            if not line:
                raise QmpError(f"QMP {command}: QEMU closed the connection")
            reply = json.loads(line)
            if "event" in reply:
                continue
            if "error" in reply:
                raise QmpError(f"QMP {command}: {reply['error'].get('desc', reply['error'])}")
            return reply.get("return")

    def status(self) -> str:
        return str(self.execute("query-status")["status"])

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


# --------------------------------------------------------------------------- QEMU

@dataclass
class QemuVM:
    name: str
    cid: int
    run_dir: Path
    proc: subprocess.Popen[bytes]
    started: float

    @property
    def qmp_path(self) -> Path:
        return self.run_dir / "qmp.sock"

    @property
    def console_path(self) -> Path:
        return self.run_dir / "console.log"

    def guest_panicked(self) -> bool:
        # -no-reboot cannot end a microvm guest that panics (reboot=k needs a
        # keyboard controller it lacks), so QEMU lives on; read the console.
        try:
            return b"Kernel panic" in self.console_path.read_bytes()
        except FileNotFoundError:
            return False

    def describe_failure(self) -> str:
        def tail(path: Path) -> str:
            try:
                return path.read_bytes()[-1500:].decode(errors="replace")
            except OSError:
                return "(none)"
        return (f"{self.name} (pid {self.proc.pid}, exit {self.proc.poll()}): "
                f"stderr: {tail(self.run_dir / 'stderr.log')}\nconsole: {tail(self.console_path)}")


class QemuFleet:
    """Every QEMU process this benchmark started; ``kill_all`` ends them (by pid)."""

    def __init__(self, image: Any, mem_mib: int, root: Path, vsock: bool) -> None:
        qemu = shutil.which("qemu-system-x86_64")
        if qemu is None:
            raise BenchError("qemu-system-x86_64 is not installed (Debian: qemu-system-x86)")
        self.qemu = qemu
        self.image = image
        self.mem_mib = mem_mib
        self.root = root
        self.vsock = vsock
        self.vms: list[QemuVM] = []

    def command(self, vm_dir: Path, cid: int, memory: list[str]) -> list[str]:
        from vmfork.vmm.machine import BASE_CMDLINE
        # acpi=off: our kernel has no ACPI, and only without ACPI does QEMU add the
        # virtio_mmio.device= entries to the command line; with ACPI the guest
        # finds no virtio device (no rng: Python as PID 1 dies for want of
        # random numbers; no vsock).
        cmd = [self.qemu, "-M", "microvm,x-option-roms=off,rtc=off,isa-serial=on,acpi=off"
               + ("," + memory[0] if memory else ""),
               "-enable-kvm", "-cpu", "host", "-m", f"{self.mem_mib}M", "-smp", "1",
               "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
               "-serial", f"file:{vm_dir / 'console.log'}",
               "-qmp", f"unix:{vm_dir / 'qmp.sock'},server=on,wait=off",
               "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd),
               "-append", f"{BASE_CMDLINE} {self.image.cmdline}",
               "-device", "virtio-rng-device", *memory[1:]]
        if self.vsock:
            cmd += ["-device", f"vhost-vsock-device,guest-cid={cid}"]
        return cmd

    def start(self, name: str, cid: int, memory: list[str] | None = None,
              extra: list[str] | None = None) -> QemuVM:
        """``memory``: [machine option, further args] for a file-backed RAM."""
        vm_dir = self.root / name
        vm_dir.mkdir(parents=True)
        cmd = self.command(vm_dir, cid, memory or []) + (extra or [])
        with open(vm_dir / "stderr.log", "wb") as err:
            started = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        vm = QemuVM(name, cid, vm_dir, proc, started)
        self.vms.append(vm)
        return vm

    def kill_all(self) -> None:
        for vm in self.vms:
            if vm.proc.poll() is None:
                vm.proc.kill()
        for vm in self.vms:
            vm.proc.wait()
        for vm in self.vms:
            shutil.rmtree(vm.run_dir, ignore_errors=True)
        self.vms.clear()


def wait_agent(vm: QemuVM, vsock: bool, deadline: float) -> float:
    """Block until the agent in ``vm`` answers a ping (or, without vsock, logs
    its ready line); fail as soon as QEMU exits."""
    from vmfork.agent.client import AgentClient, AgentError, vsock_connector
    agent = AgentClient(vsock_connector(vm.cid, timeout=2.0))
    last = "no attempt"
    while True:
        if vsock:
            try:
                agent.ping()
                return time.monotonic()
            except AgentError as err:
                last = str(err)
        else:
            try:
                if READY_MARKER in vm.console_path.read_bytes():
                    return time.monotonic()
            except FileNotFoundError:
                pass
        if (vm.proc.poll() is not None or time.monotonic() > deadline
                or vm.guest_panicked()):
            raise BenchError(f"agent not ready ({last}): {vm.describe_failure()}")
        time.sleep(0.01)


def run_parallel(vms: list[QemuVM], one: Callable[[QemuVM], dict[str, float]]
                 ) -> list[dict[str, float]]:
    """Run ``one`` for every VM in its own thread (the waits are all I/O)."""
    results: list[dict[str, float] | None] = [None] * len(vms)
    errors: list[Exception] = []

    def body(i: int) -> None:
        try:
            results[i] = one(vms[i])
        except Exception as err:  # noqa: BLE001 -- re-raised in the calling thread below
            errors.append(err)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(vms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def guest_ram_anonymous(mem_bytes: int) -> Callable[[int, str], bool]:
    # QEMU allocates a -m RAM block as one anonymous mapping of exactly its size
    # (the guard page QEMU adds is a separate PROT_NONE mapping).
    return lambda size, path: path == "" and size >= mem_bytes


def guest_ram_file(path: Path) -> Callable[[int, str], bool]:
    """The mapping of ``path`` in a peer's smaps (as the children's own breakdown
    finds it: also when mapped in another mount namespace, ``memphases``)."""
    from vmfork.runtime import memphases
    return memphases.guest_ram_paths([str(path)])


def qemu_cold(fleet: QemuFleet, n: int, settle: float, timeout: float) -> dict[str, Any]:
    """N cold boots in parallel; time to all running and to all agents ready."""
    fleet.kill_all()
    started = time.monotonic()
    vms = [fleet.start(f"cold-{i}", COLD_CID_BASE + i) for i in range(n)]
    deadline = started + timeout

    def one(vm: QemuVM) -> dict[str, float]:
        qmp = Qmp(vm.qmp_path, deadline, vm.proc)
        try:
            while qmp.status() != "running":
                if time.monotonic() > deadline:
                    raise BenchError(f"never running: {vm.describe_failure()}")
                time.sleep(0.002)
            running = time.monotonic()
        finally:
            qmp.close()
        return {"running": running, "ready": wait_agent(vm, fleet.vsock, deadline)}

    marks = run_parallel(vms, one)
    time.sleep(settle)
    is_guest = guest_ram_anonymous(fleet.mem_mib * MIB)
    memory = [read_memory(vm.proc.pid, is_guest) for vm in vms]
    result = {"running_s": max(m["running"] for m in marks) - started,
              "ready_s": max(m["ready"] for m in marks) - started,
              "memory": [asdict(m) for m in memory], "memory_summary": memory_summary(memory)}
    fleet.kill_all()
    return result


@dataclass
class Template:
    memory_file: Path
    state_file: Path
    boot_s: float
    migrate_s: float
    state_bytes: int


def template_make(fleet: QemuFleet, workdir: Path, warm_code: str, timeout: float) -> Template:
    """Boot the template parent (RAM = a shared file), warm it, migrate its state out."""
    memory_file = workdir / "template-memory"
    state_file = workdir / "template-state"
    with open(memory_file, "wb") as f:
        f.truncate(fleet.mem_mib * MIB)
    # share=on: guest RAM is MAP_SHARED on the file, so after the parent stops
    # the file holds the guest's memory. Migrating with x-ignore-shared then
    # skips that RAM block (it is "shared"), and the state is only devices+vCPU.
    backend = ["memory-backend=mem", "-object",
               f"memory-backend-file,id=mem,size={fleet.mem_mib}M,mem-path={memory_file},share=on"]
    started = time.monotonic()
    vm = fleet.start("template-parent", TEMPLATE_PARENT_CID, backend)
    deadline = started + timeout
    wait_agent(vm, fleet.vsock, deadline)
    if fleet.vsock:
        from vmfork.agent.client import AgentClient, vsock_connector
        result = AgentClient(vsock_connector(vm.cid, timeout=5.0)).eval(warm_code)
        if result.exception is not None:
            raise BenchError(f"templating parent: warm-up raised {result.exception.type}: "
                             f"{result.exception.message}")
    booted = time.monotonic()
    qmp = Qmp(vm.qmp_path, deadline, vm.proc)
    try:
        qmp.execute("stop")
        qmp.execute("migrate-set-capabilities",
                    capabilities=[{"capability": "x-ignore-shared", "state": True}])
        # QEMU 7.2 has no file: transport (8.2 added it); exec: with cat does it.
        qmp.execute("migrate", uri=f"exec:cat > {state_file}")
        while True:
            info = qmp.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled") or time.monotonic() > deadline:
                raise BenchError(f"templating parent: migration {status}: "
                                 f"{info.get('error-desc', info)}")
            time.sleep(0.01)
        migrated = time.monotonic()
        qmp.execute("quit")
    finally:
        qmp.close()
    vm.proc.wait(30)
    fleet.kill_all()
    return Template(memory_file, state_file, booted - started, migrated - booted,
                    state_file.stat().st_size)


def qemu_template(fleet: QemuFleet, template: Template, n: int, settle: float,
                  timeout: float) -> dict[str, Any]:
    """N clones of the template in parallel; time to all running and all agents ready."""
    fleet.kill_all()
    # share=off: each clone maps the parent's RAM file MAP_PRIVATE (copy on
    # write). x-ignore-shared must be set on the clone too, or it would expect
    # the RAM pages in the stream; with it set the RAM block is not loaded at
    # all (and QEMU does not fill RAM with ROM blobs while in "inmigrate"), so
    # the clone's RAM is exactly the file's contents.
    backend = ["memory-backend=mem", "-object",
               (f"memory-backend-file,id=mem,size={fleet.mem_mib}M,"
               f"mem-path={template.memory_file},share=off")]
    started = time.monotonic()
    vms = [fleet.start(f"clone-{i}", TEMPLATE_CID_BASE + i, backend, ["-incoming", "defer"])
           for i in range(n)]
    deadline = started + timeout

    def one(vm: QemuVM) -> dict[str, float]:
        qmp = Qmp(vm.qmp_path, deadline, vm.proc)
        try:
            qmp.execute("migrate-set-capabilities",
                        capabilities=[{"capability": "x-ignore-shared", "state": True}])
            qmp.execute("migrate-incoming", uri=f"exec:cat {template.state_file}")
            while (status := qmp.status()) == "inmigrate":
                if time.monotonic() > deadline:
                    raise BenchError(f"incoming migration never ended: {vm.describe_failure()}")
                time.sleep(0.002)
            # The parent was stopped when it migrated, so the clone stays paused.
            if status != "running":
                qmp.execute("cont")
            while qmp.status() != "running":
                if time.monotonic() > deadline:
                    raise BenchError(f"clone never running: {vm.describe_failure()}")
                time.sleep(0.002)
            running = time.monotonic()
        finally:
            qmp.close()
        ready = wait_agent(vm, True, deadline) if fleet.vsock else float("nan")
        return {"running": running, "ready": ready}

    marks = run_parallel(vms, one)
    time.sleep(settle)
    is_guest = guest_ram_file(template.memory_file)
    memory = [read_memory(vm.proc.pid, is_guest) for vm in vms]
    result = {"running_s": max(m["running"] for m in marks) - started,
              "ready_s": (max(m["ready"] for m in marks) - started) if fleet.vsock else None,
              "memory": [asdict(m) for m in memory], "memory_summary": memory_summary(memory)}
    fleet.kill_all()
    return result


# --------------------------------------------------------------------------- vmfork

def thread_switches(pid: int) -> dict[str, int]:
    """Context switches (voluntary + not) so far of each thread of ``pid``: ``main``, then
    the others by name and rank of thread id (Python's threads are all named after the
    interpreter). A thread that wakes up while the VM is idle runs code, and every page
    it writes on the way is the child's own."""
    out: dict[str, int] = {}
    tasks = sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda t: int(t.name))
    for rank, task in enumerate(tasks):
        try:
            name = ("main" if task.name == str(pid)
                    else f"{(task / 'comm').read_text().strip()}-{rank}")
            fields = _kib_fields((task / "status").read_text(),
                                 ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        except OSError:
            continue   # the thread ended
        out[name] = sum(fields.values())
    return out


def memory_breakdown(pid: int, memory_path: Path) -> dict[str, int]:
    """Private_Dirty KiB of ``pid`` per mapping class (``runtime.memphases.CLASSES``)."""
    from vmfork.runtime import memphases
    try:
        smaps = Path(f"/proc/{pid}/smaps").read_bytes()
    except OSError as err:
        raise BenchError(f"read smaps of pid {pid}: {err} (the VM exited?)") from err
    return memphases.classify(smaps, memphases.guest_ram_paths([str(memory_path)]))


def daemon_memory_limit_mib(snapshot: Any) -> int:
    """The memory limit the daemon gives a sandbox spawned without one: the bench's
    children get it too, so each has its cgroup as in the product (and the spawn pays
    for making it)."""
    from vmfork.server.spawner import default_memory_limit_mib
    return default_memory_limit_mib(snapshot.meta.mem_mib)


def vmfork_spawn(zygote: Any, snapshot: Any, n: int, run_root: Path, settle: float,
                 timeout: float, network: Any = None, breakdown: bool = False,
                 phases: bool = False) -> dict[str, Any]:
    """``network``: a ``HostNetwork``; each child then gets a namespace of its own.
    ``breakdown``: also each child's memory per mapping class, the phases it recorded
    (the zygote must run with ``VMFORK_MEMORY_PHASES``) and its threads' wake-ups
    while idle. ``phases``: also each child's steps from fork to ready (the zygote
    must run with ``VMFORK_SPAWN_PROFILE``)."""
    from vmfork.runtime.spawn import SpawnFailed, fork_children
    # Every request may wait behind the zygote's fork loop, which for 100 children
    # on a loaded emulated host can take minutes.
    client = zygote.client(timeout=max(120.0, timeout))
    # fork_children raises on timeout; the progress callback keeps the instant
    # all were restored, so a run whose agents are too slow still has that.
    started = time.monotonic()
    restored_at: list[float] = []

    def progress(restored: int, ready: int, failed: int) -> None:
        if not restored_at and restored + failed >= n:
            restored_at.append(time.monotonic())

    out: dict[str, Any] = {}
    batch = daemon_batch_dir(run_root)
    try:
        try:
            report = fork_children(client, snapshot, n, batch, timeout=timeout,
                                   memory_limit_mib=daemon_memory_limit_mib(snapshot),
                                   progress=progress, per_child_netns=network is not None,
                                   network=network, runs_in=run_root)
        except SpawnFailed as err:
            statuses = [json.loads(p.read_bytes()) for p in batch.glob("*/status.json")]
            ready = [s for s in statuses if s.get("state") == "ready"]
            host_pids: list[int] = []   # the zygote's pids went with the failed call
            run_dirs: list[Path] = []
            out = {"running_s": restored_at[0] - started if restored_at else None,
                   "ready_s": None,
                   "incomplete": f"{err}; {len(ready)} of {n} agents had answered"}
        else:
            ready = [c.read_status() for c in report.children]
            # The zygote's pid of each child: the pid a jailed child reports in its
            # status is its own in its PID namespace (1), not one /proc here shows.
            host_pids = [c.pid for c in report.children if c.status.get("state") == "ready"]
            run_dirs = [c.run_dir for c in report.children if c.status.get("state") == "ready"]
            out = {"spawn_s": report.spawn_s, "running_s": report.restored_s,
                   "ready_s": report.ready_s, "network_s": report.network_s,
                   "networks": [c.network for c in report.children if c.network is not None]}
            if report.failed:
                # A child that gives up waiting for its agent says why in its status
                # and its log; the zygote removes the status with the run directory
                # when it reaps the child, so the spawner's reason (which carries
                # the log's tail) is the one that survives.
                reasons = sorted({reason[-300:] for _, reason in report.failed})
                out.update(ready_s=None, incomplete=(
                    f"{len(report.failed)} of {n} children failed ({'; '.join(reasons[:3])}); "
                    f"{len(ready)} agents answered, the last after {report.ready_s:.1f} s"))
        time.sleep(settle)
        statuses = ready
        if breakdown:
            from vmfork.runtime import memphases
            out["breakdown"] = [memory_breakdown(pid, snapshot.memory_path) for pid in host_pids]
            time.sleep(1.0)   # the children's own idle probe fires ~settle s after ready
            out["phases"] = [memphases.read_phases(str(d)) for d in run_dirs]
            # Wake-ups over a window of its own, once every child has settled and run
            # its idle probe: what an idle child does, not its last start-up steps.
            switches_before = [thread_switches(pid) for pid in host_pids]
            time.sleep(settle)
            out["wakeups_per_s"] = [
                {name: (count - before.get(name, 0)) / settle
                 for name, count in thread_switches(pid).items()}
                for pid, before in zip(host_pids, switches_before)]
        if phases:
            # The spawn call's instant as `restored_s` counts it (fork_children's own
            # start, after its FIFOs are made), so the rows add up to `running_s`.
            called = (restored_at[0] - out["running_s"] if restored_at and out.get("spawn_s")
                      is not None else started)
            out["spawn_phases"] = [read_spawn_phases(d, called, restored_at[0] if restored_at
                                                     else None) for d in run_dirs]
        fork_to_entry = [float(s["fork_to_entry_s"]) for s in statuses
                         if s.get("fork_to_entry_s") is not None]
        is_guest = guest_ram_file(snapshot.memory_path)
        memory = [read_memory(pid, is_guest) for pid in host_pids]
        return {**out,
                "child_restore_s": [float(s["restore_s"]) for s in statuses],
                "child_fork_to_entry_s": fork_to_entry,
                # restored state, then waited at the batch's start gate (not in restore_s)
                "child_start_wait_s": [float(s.get("start_wait_s", 0.0)) for s in statuses],
                "child_ready_s": [float(s["ready_s"]) for s in statuses],
                # inside ready_s: the agent's first answer (after_fork: clock, reseed and
                # network refresh in one round trip; an agent older than after_fork takes
                # them one call each, agent_op_by_op)
                "child_agent_ready_s": [float(s.get("agent_ready", "nan")) for s in statuses],
                # after_fork calls that found the agent unavailable, each 50 ms apart
                "child_agent_retries": [float(s.get("agent_retries", "nan")) for s in statuses],
                # the answering call: the VMM's OK to its CONNECT, the agent's first frame
                "child_agent_connected_s": [float(s.get("agent_connected", "nan"))
                                            for s in statuses],
                "child_agent_first_frame_s": [float(s.get("agent_first_frame", "nan"))
                                              for s in statuses],
                "memory": [asdict(m) for m in memory], "memory_summary": memory_summary(memory)}
    finally:
        kill_children(client)
        client.close()
        for status_file in batch.glob("*/status.json"):
            status_file.unlink()


def daemon_batch_dir(run_root: Path) -> Path:
    """A spawn's own directory of run directories in ``run_root``, as the daemon makes
    one per spawn in its ``run/`` (``server/spawner.py``), which it names the jails'
    ``runs_in``: where the zygote keeps one jail base for every spawn."""
    run_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Path(tempfile.mkdtemp(prefix="spawn-", dir=run_root))


def read_spawn_phases(run_dir: Path, called: float,
                      all_restored: float | None) -> list[dict[str, float | str]]:
    """A child's steps from fork to ready, as its ``spawn-profile.json`` has them
    (``spawnprofile.phases``); none if it wrote none. Two rows are the spawner's, on the
    same CLOCK_MONOTONIC (``time.monotonic``) as the children's marks: ``fork`` runs
    from the spawn call (``called``) to the zygote's fork of this child, and
    ``restored_seen`` from the child's ``restored`` report to the spawner's knowing
    every child restored (``all_restored``), so the rows add up to ``restored``."""
    from vmfork.runtime import spawnprofile
    try:
        record = json.loads((run_dir / spawnprofile.PROFILE_FILE).read_text())
    except (OSError, ValueError):
        return []
    marks = record["marks"]
    called_mark = {"phase": "spawn_call", "mono_ns": int(called * 1e9),
                   "thread_cpu_ns": 0, "process_cpu_ns": 0}
    rows = spawnprofile.phases([called_mark, *marks])
    reported = [m for m in marks if m["phase"] == "restored_report"]
    if all_restored is not None and reported:
        at = next(i for i, r in enumerate(rows) if r["phase"] == "restored_report") + 1
        rows.insert(at, {"phase": "restored_seen",
                         "wall_s": all_restored - int(reported[0]["mono_ns"]) / 1e9,
                         "thread_cpu_s": 0.0, "process_cpu_s": 0.0})
    return rows


def render_phases(results: dict[str, dict[int, list[dict[str, Any]]]],
                  ns: list[int]) -> list[str]:
    """The ``--phases`` table (none without it): per N, each step's median wall time
    (and the child's main-thread CPU in it) over the children of each vmfork peer."""
    md: list[str] = []
    for n in ns:
        by_peer = {p: [c for r in results[p].get(n, []) for c in r.get("spawn_phases", [])]
                   for p in VMFORK_PEERS}
        by_peer = {p: children for p, children in by_peer.items() if any(children)}
        if not by_peer:
            continue
        names: list[str] = []
        for children in by_peer.values():
            for child in children:
                names += [str(p["phase"]) for p in child if p["phase"] not in names]
        md += ["", f"### Where a child's time goes, fork to ready, N = {n} (medians)", "",
               ("Each phase ends at its name (`runtime/spawnprofile.py`'s marks; a native "
                "child writes the same ones, `native/src/spawn_profile.rs`, and its jail's "
                "steps, `jail_*`): wall ms, and in brackets the child's main-thread CPU ms. "
                "`fork`: from the spawn call to the zygote's clock before this child's "
                "fork(); `forked`: the child's first step (its clock starts there); "
                "`restored_seen`: from its `restored` report to the spawner's knowing every "
                "child restored."), "",
               "| phase | " + " | ".join(PEER_TITLES[p] for p in by_peer) + " |",
               "|---|" + "---|" * len(by_peer)]
        for name in names:
            cells = []
            for children in by_peer.values():
                rows = [p for child in children for p in child if p["phase"] == name]
                if not rows:
                    cells.append("–")
                    continue
                wall = statistics.median(float(p["wall_s"]) for p in rows)
                cpu = statistics.median(float(p["thread_cpu_s"]) for p in rows)
                cells.append(f"{wall * 1000:.1f} ({cpu * 1000:.1f})")
            md.append(f"| {name} | " + " | ".join(cells) + " |")
    return md


def vmfork_first_spawn(zygote: Any, snapshot: Any, run_root: Path, timeout: float) -> float:
    """One child from the cold zygote, killed once ready; returns its restored time.

    On its first spawn from a snapshot the zygote decodes it and warms its restore
    path up (``vmmchild.prefork``) and builds the jail base its spawns join
    (``jail.KeptBases``), once -- as the floor's parent asks /dev/kvm its per-host
    answers once before it forks; that first child, native, is also the snapshot's
    learner, which saves its write set at ready (``native/src/write_set.rs``), once.
    The measured runs spawn from then on.
    """
    from vmfork.runtime.spawn import fork_children
    client = zygote.client(timeout=max(120.0, timeout))
    try:
        return float(fork_children(client, snapshot, 1, daemon_batch_dir(run_root),
                                   timeout=timeout,
                                   memory_limit_mib=daemon_memory_limit_mib(snapshot),
                                   wait_for="ready", runs_in=run_root).restored_s)
    finally:
        kill_children(client)
        client.close()


def kill_children(client: Any) -> None:
    """Kill every child the zygote has (also those of a failed or timed-out spawn)."""
    children = client.list()
    for child in children:
        client.kill(child.vm_id)
    for child in children:
        client.wait(child.vm_id, timeout=60.0)


# --------------------------------------------------------------------------- floor

def build_floor(workdir: Path) -> Path:
    cc = shutil.which("cc")
    if cc is None:
        raise BenchError("no C compiler (cc) to build bench/kvm_floor.c: apt-get install gcc")
    binary = workdir / "kvm_floor"
    done = subprocess.run([cc, "-O2", "-Wall", "-o", str(binary), str(BENCH_DIR / "kvm_floor.c")],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"compiling bench/kvm_floor.c failed:\n{done.stderr}")
    return binary


def floor_run(binary: Path, memory_file: Path, mem_bytes: int, n: int,
              timeout: float) -> dict[str, Any]:
    done = subprocess.run([str(binary), str(memory_file), str(mem_bytes), str(n)],
                          capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise BenchError(f"kvm_floor with N={n} failed (status {done.returncode}): "
                         f"{done.stderr.strip()[-1500:]}")
    out = json.loads(done.stdout)
    return {"running_s": out["wall_s"], "child_restore_s": out["child_s"]}


# --------------------------------------------------------------------------- report

def fmt_s(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def fmt_x(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}×"


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median_kib(values: list[float]) -> str:
    return f"{statistics.median(values) / 1024:.2f}" if values else "n/a"


def render_breakdown(runs_by_n: dict[int, list[dict[str, Any]]], ns: list[int]) -> list[str]:
    """The ``--breakdown`` tables (none without it): vmfork's idle children by mapping
    class, by phase, and their threads' wake-ups."""
    from vmfork.runtime.memphases import CLASSES
    with_breakdown = [n for n in ns if any("breakdown" in r for r in runs_by_n.get(n, []))]
    if not with_breakdown:
        return []
    md = ["", "## Where an idle vmfork child's own Private_Dirty is (median over the "
          "children, MiB)", "",
          ("Read from outside (`/proc/<pid>/smaps`) when the memory above is; classes as "
           "in `runtime/memphases.py`. Guest RAM is shown, not counted in \"own\"."), "",
          "| class | " + " | ".join(f"N = {n}" for n in with_breakdown) + " |",
          "|---|" + "---|" * len(with_breakdown)]
    for name in (*CLASSES, "own"):
        cells = []
        for n in with_breakdown:
            children = [c for r in runs_by_n[n] for c in r.get("breakdown", [])]
            cells.append(_median_kib([
                float(sum(v for k, v in c.items() if k != "guest_ram") if name == "own"
                      else c[name]) for c in children]))
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    for n in with_breakdown:
        phases = [p for r in runs_by_n[n] for p in r.get("phases", [])]
        names: list[str] = []
        for child in phases:
            names += [str(p["phase"]) for p in child if p["phase"] not in names]
        if not names:
            continue
        md += ["", f"### By phase, recorded by each child itself, N = {n} (median, MiB)", "",
               ("Own Private_Dirty (guest RAM excluded) at each phase, and the classes "
                "that changed most since the previous one."), "",
               "| phase | own Private_Dirty | threads | Δ own | largest Δ by class |",
               "|---|---|---|---|---|"]
        previous: dict[str, float] | None = None
        previous_own: float | None = None
        for phase in names:
            rows = [p for child in phases for p in child if p["phase"] == phase]
            own = statistics.median(float(p["own_private_dirty_kib"]) for p in rows)
            threads = statistics.median(int(p["threads"]) for p in rows)
            classes = {c: statistics.median(float(p["classes_kib"][c]) for p in rows)
                       for c in CLASSES}
            delta = "" if previous_own is None else f"{(own - previous_own) / 1024:+.2f}"
            moved = "" if previous is None else ", ".join(
                f"{c} {(classes[c] - previous[c]) / 1024:+.2f}"
                for c in sorted(CLASSES, key=lambda c: -abs(classes[c] - previous[c]))[:3]
                if classes[c] != previous[c])
            md.append(f"| {phase} | {own / 1024:.2f} | {threads:g} | {delta} | {moved} |")
            previous, previous_own = classes, own
    md += ["", "### Thread wake-ups while idle (context switches per second, median "
           "over the children)", "", "| N | thread: switches/s |", "|---|---|"]
    for n in with_breakdown:
        wakeups = [w for r in runs_by_n[n] for w in r.get("wakeups_per_s", [])]
        names = sorted({t for w in wakeups for t in w})
        md.append(f"| {n} | " + ", ".join(
            f"{t}: {statistics.median(w.get(t, 0.0) for w in wakeups):.1f}"
            for t in names) + " |")
    return md


def runs_at(args: argparse.Namespace, n: int) -> int:
    """How many runs each peer makes at ``n``: ``--reps``, and at N = 1 at least
    ``--lone-reps``."""
    return max(args.reps, args.lone_reps) if n == 1 else args.reps


def render(args: argparse.Namespace, results: dict[str, dict[int, list[dict[str, Any]]]],
           skipped: dict[str, dict[int, str]], setup: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    ns: list[int] = args.n
    md = [(f"# Spawn: N VMs of one warm guest ({args.mem_mib} MiB, 1 vCPU, warm-up "
          f"`{args.warm}`; median of {args.reps} run(s) per N"
          + (f", {runs_at(args, 1)} at N = 1" if 1 in ns and runs_at(args, 1) != args.reps
             else "") + ")"), "",
          f"Measured in: {where()}.", ""]
    if not setup["vsock"]:
        md += [("No `/dev/vhost-vsock`: QEMU cold boot is timed to the agent's `ready` console "
               "line, and QEMU templating clones cannot be pinged (their ready time is n/a)."), ""]

    def peer(name: str, n: int, key: str) -> float | None:
        return median_of(results[name].get(n, []), key)

    # The tables against QEMU, the floor and the targets: the default child (native)
    # where it ran, else the Python child.
    head = "native" if any(results["native"].values()) else "vmfork"
    title = PEER_TITLES[head]

    natives = [p for p in ("native", "native_b") if any(results[p].values())]
    if natives:
        md += ["## vmfork's children: Python and native, side by side", ""]
        if "native_b" in natives:
            md += [f"Native children B: {PEER_TITLES['native_b']}.", ""]
        heads = [f"{PEER_TITLES[p]} {what}" for p in natives
                 for what in ("restored", "ready", "restored / floor")]
        md += ["| N | Python restored | Python ready | " + " | ".join(heads) + " |",
               "|---|---|---|" + "---|" * len(heads)]
        for n in ns:
            cells = [c for p in natives for c in (
                fmt_s(peer(p, n, "running_s")), fmt_s(peer(p, n, "ready_s")),
                fmt_x(ratio(peer(p, n, "running_s"), peer("floor", n, "running_s"))))]
            md.append(f"| {n} | {fmt_s(peer('vmfork', n, 'running_s'))} | "
                      f"{fmt_s(peer('vmfork', n, 'ready_s'))} | " + " | ".join(cells) + " |")
        md.append("")
    md += ["## Time until all N VMs run / all N agents answer", "",
           (f"| N | {title} restored | {title} ready | QEMU cold running | QEMU cold ready | "
           "QEMU templating running | QEMU templating ready | floor |"),
           "|---|---|---|---|---|---|---|---|"]
    for n in ns:
        md.append(f"| {n} | {fmt_s(peer(head, n, 'running_s'))} | "
                  f"{fmt_s(peer(head, n, 'ready_s'))} | {fmt_s(peer('cold', n, 'running_s'))} | "
                  f"{fmt_s(peer('cold', n, 'ready_s'))} | {fmt_s(peer('template', n, 'running_s'))} | "
                  f"{fmt_s(peer('template', n, 'ready_s'))} | {fmt_s(peer('floor', n, 'running_s'))} |")
    md += ["", f"## Ratios ({title})", "",
           ("| N | ready / QEMU cold ready | restored / QEMU cold running | "
           "ready / templating ready | restored / templating running | "
           "restored / floor | (restored − floor) / N | "
           "per-child restore − per-child floor (medians) |"),
           "|---|---|---|---|---|---|---|---|"]
    derived: dict[int, dict[str, float | None]] = {}
    for n in ns:
        v_run, v_ready = peer(head, n, "running_s"), peer(head, n, "ready_s")
        floor = peer("floor", n, "running_s")
        child_v = [x for r in results[head].get(n, []) for x in r["child_restore_s"]]
        child_f = [x for r in results["floor"].get(n, []) for x in r["child_restore_s"]]
        per_child = (statistics.median(child_v) - statistics.median(child_f)
                     if child_v and child_f else None)
        beyond = (v_run - floor) / n if v_run is not None and floor is not None else None
        derived[n] = {"per_child_beyond_floor_s": per_child, "wall_beyond_floor_per_child_s": beyond,
                      "restored_over_floor": ratio(v_run, floor)}
        md.append(f"| {n} | {fmt_x(ratio(v_ready, peer('cold', n, 'ready_s')))} | "
                  f"{fmt_x(ratio(v_run, peer('cold', n, 'running_s')))} | "
                  f"{fmt_x(ratio(v_ready, peer('template', n, 'ready_s')))} | "
                  f"{fmt_x(ratio(v_run, peer('template', n, 'running_s')))} | "
                  f"{fmt_x(ratio(v_run, floor))} | {fmt_s(beyond)} | {fmt_s(per_child)} |")

    md += ["", "## Per child (medians over all children of all runs)", "",
           ("| peer | N | fork → entry (child set-up) | restore, in the child | "
           "… then the agent's first answer (after_fork: clock, reseed) | its retries | "
           "… its answering call: CONNECT answered | … the agent's first frame | "
           "floor, in the child |"),
           "|---|---|---|---|---|---|---|---|---|"]
    def child_median(name: str, n: int, key: str) -> float | None:
        values = [x for r in results[name].get(n, []) for x in r.get(key, [])
                  if not math.isnan(x)]
        return statistics.median(values) if values else None

    for name in VMFORK_PEERS:
        for n in ns:
            if not results[name].get(n):
                continue
            retries = child_median(name, n, "child_agent_retries")
            md.append(f"| {PEER_TITLES[name]} | {n} | "
                      f"{fmt_s(child_median(name, n, 'child_fork_to_entry_s'))} | "
                      f"{fmt_s(child_median(name, n, 'child_restore_s'))} | "
                      f"{fmt_s(child_median(name, n, 'child_agent_ready_s'))} | "
                      f"{'n/a' if retries is None else f'{retries:g}'} | "
                      f"{fmt_s(child_median(name, n, 'child_agent_connected_s'))} | "
                      f"{fmt_s(child_median(name, n, 'child_agent_first_frame_s'))} | "
                      f"{fmt_s(child_median('floor', n, 'child_restore_s'))} |")

    md += ["", "## Memory per idle child (median over the children, MiB)", "",
           ("VMM own = whole process minus the guest-RAM mapping (one read of smaps). Guest "
            "pages dirtied = `Anonymous` pages of the guest-RAM mapping: for vmfork and the "
            "templating clones, the pages the VM copied on write from the shared file; for a "
            "cold boot the guest RAM is anonymous, so it is every page the guest has touched. "
            "(Private_Dirty of that mapping would overstate it: the files are on tmpfs, whose "
            "pages are always dirty, so a page only read counts as Private_Dirty at N = 1.)"),
           "",
           ("| peer | N | process Pss | VMM own Pss | VMM own Private_Dirty | guest-RAM Rss | "
            "guest-RAM Pss | guest pages dirtied (own copies) |"),
           "|---|---|---|---|---|---|---|---|"]
    for name in ("vmfork", "native", "native_b", "template", "cold"):
        for n in ns:
            runs = results[name].get(n, [])
            if not runs:
                continue
            m = runs[-1]["memory_summary"]
            md.append(f"| {PEER_TITLES[name]} | {n} | {m['pss_mib']:.2f} | {m['own_pss_mib']:.2f} | "
                      f"{m['own_private_dirty_mib']:.2f} | {m['guest_rss_mib']:.2f} | "
                      f"{m['guest_pss_mib']:.2f} | {m['guest_cow_mib']:.2f} |")

    md += render_phases(results, ns)
    md += render_breakdown(results[head], ns)
    md += ["", f"## Targets (issue 3; {title})", ""]
    comparable = [n for n in ns if peer(head, n, "running_s") is not None
                  and peer("floor", n, "running_s") is not None]
    big = max(comparable, default=None)
    targets: list[dict[str, Any]] = []
    if big is not None:
        d = derived[big]
        v_run = peer(head, big, "running_s")
        floor = peer("floor", big, "running_s")
        mem = results[head][big][-1]["memory_summary"]
        # Per child at the smallest N: at larger N the children of both share
        # 2 cores, which stretches each one's own time by contention.
        small = min(comparable)
        per_child = derived[small]["per_child_beyond_floor_s"]
        beyond = d["wall_beyond_floor_per_child_s"]
        assert v_run is not None and floor is not None
        targets = [
            {"target": "host-side restore ≤ 1 ms per child beyond the floor "
                       f"(in-child restore time minus in-child floor, medians, N={small})",
             "measured": fmt_s(per_child), "met": per_child is not None and per_child <= 0.001},
            {"target": f"same, as wall time over N={big}: (restored − floor) / N",
             "measured": fmt_s(beyond), "met": beyond is not None and beyond <= 0.001},
            {"target": f"{big} children restored in ≤ 100 ms",
             "measured": fmt_s(v_run), "met": big >= 100 and v_run <= 0.100},
            {"target": f"… or ≤ 1.5× the floor ({fmt_s(floor)} for N={big})",
             "measured": fmt_x(v_run / floor), "met": big >= 100 and v_run <= 1.5 * floor},
            {"target": "≤ 0.5 MiB VMM-process memory per idle child (own Private_Dirty)",
             "measured": f"{mem['own_private_dirty_mib']:.2f} MiB",
             "met": mem["own_private_dirty_mib"] <= 0.5},
            {"target": "… and as own Pss (adds the child's share of pages still shared "
                       "with the zygote and its siblings)",
             "measured": f"{mem['own_pss_mib']:.2f} MiB", "met": mem["own_pss_mib"] <= 0.5},
        ]
        md += ["| target | measured | met? |", "|---|---|---|"]
        for t in targets:
            md.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |")
        if big < 100:
            md += ["", f"The 100-children targets need N = 100; this run went to N = {big}."]
        if os.environ.get("VMFORK_IN_TESTHOST") == "1":
            md += ["", ("In the emulated test host absolute times are ~10–40× those on "
                   "hardware: the absolute 100 ms and 1 ms targets cannot be judged here; "
                   "the ratios to the floor, measured in the same run, can.")]
    md += ["", "## What each peer measures", "",
           ("- vmfork restored: spawn request to the zygote → every child's `status.json` says "
           "`restored` (state restored, vCPU thread started; the children of a batch start "
           "their vCPUs together, once all have restored their state). vmfork ready: → every "
           "child's agent answered a ping over vsock **and** the child reseeded the guest and "
           "set its clock (`ready`). In-child restore time excludes the wait for siblings."),
           ("- vmfork, native children (the default) and vmfork, Python children: the same, "
            "from two zygotes, one whose children run no Python after the fork "
            "(`VMFORK_NATIVE_CHILD=1`), one whose children run Python "
            "(`VMFORK_NATIVE_CHILD=0`). The tables against QEMU, the floor and the targets "
            "read the native children where they ran."),
           ("- QEMU cold boot: first `qemu-system-x86_64` started → every QMP `query-status` says "
           "`running` (QEMU set up, vCPU started at the kernel entry) / → every agent answered "
           "a ping over vhost-vsock after a full kernel boot."),
           ("- QEMU templating: first clone started → every clone has loaded the device state "
           "(`migrate-incoming`, x-ignore-shared), got `cont` and says `running` / → every "
           "agent answered a ping. No reseed, no clock set."),
           ("- floor: first `fork` → every child finished the KVM calls of a restore "
           "(`bench/kvm_floor.c`), with no VMM, no vCPU run, no guest page touched."),
           ("- Times include each harness's own waiting (vmfork: the spawner sleeps on a FIFO "
           "each child writes a line to after each `status.json` change; QEMU: QMP round trips "
           "and ping attempts every 10 ms, one thread per VM).")]
    skipped_lines = [f"- {PEER_TITLES[p]}, N = {n}: {why}"
                     for p, by_n in skipped.items() for n, why in sorted(by_n.items())]
    if skipped_lines:
        md += ["", "## Not measured", "", *skipped_lines]
    md += ["", "## Set-up (once per run)", "",
           (f"- vmfork parent: boot {setup['vmfork_boot_s']:.2f} s, warm-up "
           f"{setup['vmfork_warm_s']:.2f} s, snapshot pause {setup['vmfork_pause_ms']:.1f} ms, "
           f"memory file {setup['vmfork_memory_bytes'] / MIB:.0f} MiB; children "
           + ("run no Python (the default)" if setup.get("native_child")
              else "run Python (VMFORK_NATIVE_CHILD=0, or beside the native peer)")),
           (f"- vmfork zygote's first spawn from the snapshot (decodes it and warms the restore "
            "path up, once; a native zygote's child learns the snapshot's write set; waited "
            f"for until ready), restored: {fmt_s(setup.get('vmfork_first_spawn_s'))}"
            + (f"; the native children's zygote's: {fmt_s(setup['native_first_spawn_s'])}"
               if "native_first_spawn_s" in setup else "")),
           (f"- QEMU template parent: boot + warm-up {setup['template_boot_s']:.2f} s, "
            f"state migration {setup['template_migrate_s'] * 1000:.1f} ms, state file "
            f"{setup['template_state_bytes'] / 1024:.0f} KiB" if "template_boot_s" in setup
            else "- QEMU template parent: not made"),
           ""]
    data = {"derived": {str(n): d for n, d in derived.items()}, "targets": targets}
    return "\n".join(md) + "\n", data


# --------------------------------------------------------------------------- network

NET_PREFIX = "vmfb"
SINK_PORT = 5201
# The guest's (and the plain namespace's) sender: as many bytes as it can for a
# while, in 256 KiB writes; prints what it sent.
PY_SENDER = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((host, port), timeout=30)
chunk = bytes(256 * 1024)
sent = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(chunk)
    sent += len(chunk)
s.close()
print(sent)
"""


def tcp_sink(port: int) -> tuple[socket.socket, Callable[[], dict[str, float]]]:
    """A host-side receiver on every address: bytes and seconds from first byte to EOF."""
    listener = socket.create_server(("0.0.0.0", port), reuse_port=False)
    listener.settimeout(120)
    result: dict[str, float] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            total = 0
            first = None
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    break
                if first is None:
                    first = time.monotonic()
                total += len(data)
            result.update(bytes=float(total),
                          seconds=time.monotonic() - first if first is not None else 0.0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def wait() -> dict[str, float]:
        thread.join(300)
        listener.close()
        if not result.get("seconds"):
            raise BenchError(f"throughput sink on port {port} received nothing")
        return {**result, "mbit_s": result["bytes"] * 8 / result["seconds"] / 1e6}

    return listener, wait


@contextmanager
def plain_netns(name: str, address: str, host_address: str) -> Iterator[None]:
    """A namespace with a veth to the host and nothing else (the no-VM peers)."""
    def ip(*a: str) -> None:
        subprocess.run(["ip", *a], check=True, capture_output=True)

    ip("netns", "add", name)
    try:
        ip("link", "add", f"{name}h", "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("addr", "add", f"{host_address}/31", "dev", f"{name}h")
        ip("link", "set", f"{name}h", "up")
        for cmd in (["link", "set", "lo", "up"], ["addr", "add", f"{address}/31", "dev", "eth0"],
                    ["link", "set", "eth0", "up"]):
            ip("-n", name, *cmd)
        yield
    finally:
        subprocess.run(["ip", "link", "del", f"{name}h"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def throughput_peers(seconds: float) -> dict[str, dict[str, float]]:
    """Python sender and iperf3 from a plain namespace to the host, over a veth."""
    out: dict[str, dict[str, float]] = {}
    with plain_netns("vmfbplain", "10.201.255.1", "10.201.255.0"):
        _, wait = tcp_sink(SINK_PORT)
        subprocess.run(["ip", "netns", "exec", "vmfbplain", sys.executable, "-c", PY_SENDER,
                        "10.201.255.0", str(SINK_PORT), str(seconds)],
                       check=True, capture_output=True, timeout=seconds + 120)
        out["python_veth"] = wait()
        iperf3 = shutil.which("iperf3")
        if iperf3 is not None:
            server = subprocess.Popen([iperf3, "-s", "-1", "-p", str(SINK_PORT + 1)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                time.sleep(0.5)
                done = subprocess.run(["ip", "netns", "exec", "vmfbplain", iperf3, "-J", "-c",
                                       "10.201.255.0", "-p", str(SINK_PORT + 1), "-t",
                                       str(max(1, int(seconds)))],
                                      check=True, capture_output=True, timeout=seconds + 120)
                end = json.loads(done.stdout)["end"]["sum_received"]
                out["iperf3_veth"] = {"bytes": float(end["bytes"]),
                                      "seconds": float(end["seconds"]),
                                      "mbit_s": float(end["bits_per_second"]) / 1e6}
            finally:
                server.kill()
                server.wait()
    return out


def guest_throughput(child: Any, seconds: float) -> dict[str, float]:
    _, wait = tcp_sink(SINK_PORT)
    done = child.agent.exec(["python3", "-c", PY_SENDER, child.network.host_address,
                             str(SINK_PORT), str(seconds)], timeout=seconds + 120)
    if done.exit_code != 0:
        raise BenchError(f"guest sender exited {done.exit_code}: "
                         f"{done.stderr.decode(errors='replace')[-300:]}")
    return wait()


def network_main(args: argparse.Namespace) -> int:
    from vmfork.image import find_image
    from vmfork.runtime import network as net
    from vmfork.runtime.parent import snapshot_parent
    from vmfork.runtime.zygote_client import start_zygote
    from vmfork.store import Store

    def log(msg: str) -> None:
        print(f"spawn --network: {msg}", file=sys.stderr, flush=True)

    image = find_image()
    results: dict[str, Any] = {"plain": {}, "netns": {}, "pooled": {}, "teardown": {},
                               "pool_fill": {}, "failed": {}}
    setup: dict[str, Any] = {"image": image.name}
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="vmfork-bench-net-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        home = stack.enter_context(vmfork_home(workdir))
        net.cleanup_stale(NET_PREFIX)
        hostnet = net.HostNetwork(net.GuestNetwork(), prefix=NET_PREFIX)
        hostnet.setup()
        stack.callback(net.cleanup_stale, NET_PREFIX)
        stack.callback(hostnet.close)
        log("snapshotting a parent with a network device")
        report = snapshot_parent(Store.open(home), "bench-net", image, mem_mib=args.mem_mib,
                                 warm_code=args.warm, network=net.GuestNetwork())
        snapshot = report.snapshot
        if args.breakdown:
            # Each child records its own phases (runtime/memphases.py), the last one
            # when the bench reads its memory from outside.
            from vmfork.runtime import memphases
            os.environ[memphases.ENV] = str(args.settle)
        with open(workdir / "zygote.log", "wb") as zlog:
            zygote = start_zygote(str(workdir / "zygote.sock"), stderr=zlog, timeout=300.0)
        stack.callback(zygote.close)

        def save() -> None:
            left = net.leftovers(NET_PREFIX)
            setup["leftovers_after_teardown"] = {"namespaces": left.namespaces,
                                                 "links": left.links}
            write_results("spawn-network", {"n": args.n, "reps": args.reps,
                                            "mem_mib": args.mem_mib, "setup": setup,
                                            "results": results},
                          render_network(args, results, setup))

        # Throughput first, then N in rising order: on a busy machine a large N may not
        # finish, and whatever did is saved after every step.
        try:
            results["throughput"] = network_throughput(zygote, snapshot, hostnet, workdir, args,
                                                       log)
        except Exception as err:  # noqa: BLE001 -- recorded, the spawn runs still go on
            results["failed"]["throughput"] = str(err)
            log(f"throughput: FAILED: {err}")
        save()
        for rep in range(args.reps):
            for n in args.n:
                timeout = max(args.timeout, args.timeout_per_vm * n)
                for mode in NETWORK_MODES:
                    log(f"{mode} N={n} (run {rep + 1}/{args.reps})")
                    if mode == "pooled":  # spares made before the request, not timed
                        started = time.monotonic()
                        hostnet.resize_pool(n)
                        ready = hostnet.wait_for_pool(timeout)
                        results["pool_fill"].setdefault(n, []).append(
                            {"seconds": time.monotonic() - started, "spares": ready})
                    try:
                        out = vmfork_spawn(zygote, snapshot, n, workdir / "vms", 0.0, timeout,
                                           network=None if mode == "plain" else hostnet)
                    except Exception as err:  # noqa: BLE001 -- recorded, the run goes on
                        results["failed"][f"{mode} N={n}"] = str(err)
                        log(f"{mode} N={n}: FAILED: {err}")
                        hostnet.resize_pool(0)
                        for child_net in list(hostnet.children.values()):
                            hostnet.destroy(child_net)
                        save()
                        continue
                    hostnet.resize_pool(0)
                    networks = out.pop("networks", [])
                    out.pop("memory", None)
                    started = time.monotonic()
                    for child_net in networks:
                        hostnet.destroy(child_net)
                    if networks and mode == "netns":
                        results["teardown"].setdefault(n, []).append(
                            {"seconds": time.monotonic() - started, "count": len(networks)})
                    results[mode].setdefault(n, []).append(out)
                    log(f"{mode} N={n}: restored {fmt_s(out.get('running_s'))}, ready "
                        f"{fmt_s(out.get('ready_s'))}, networks {fmt_s(out.get('network_s'))}"
                        + (f" ({out['incomplete']})" if out.get("incomplete") else ""))
                    save()
    return 0


def vsock_main(args: argparse.Namespace) -> int:
    from vmfork.image import find_image
    from vmfork.runtime.parent import snapshot_parent
    from vmfork.runtime.spawn import fork_children
    from vmfork.runtime.zygote_client import start_zygote
    from vmfork.store import Store

    def log(msg: str) -> None:
        print(f"spawn --vsock: {msg}", file=sys.stderr, flush=True)

    image = find_image()
    size = args.vsock_mib << 20
    # Incompressible and not all one byte, so nothing on the way can take a short cut.
    data = os.urandom(size)
    runs: list[dict[str, float]] = []
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="vmfork-bench-vsock-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        home = stack.enter_context(vmfork_home(workdir))
        log("snapshotting a parent")
        snapshot = snapshot_parent(Store.open(home), "bench-vsock", image,
                                   mem_mib=args.mem_mib, warm_code=args.warm).snapshot
        if args.breakdown:
            # Each child records its own phases (runtime/memphases.py), the last one
            # when the bench reads its memory from outside.
            from vmfork.runtime import memphases
            os.environ[memphases.ENV] = str(args.settle)
        with open(workdir / "zygote.log", "wb") as zlog:
            zygote = start_zygote(str(workdir / "zygote.sock"), stderr=zlog, timeout=300.0)
        stack.callback(zygote.close)
        client = zygote.client(timeout=300.0)
        stack.callback(client.close)
        spawn = fork_children(client, snapshot, 1, workdir / "vms", timeout=args.timeout)
        stack.callback(kill_children, client)
        if spawn.failed:
            raise BenchError(f"vsock child failed: {spawn.failed}")
        agent = spawn.children[0].agent
        for rep in range(args.reps):
            started = time.monotonic()
            agent.write_file("/tmp/vsock-bench", data)
            to_guest = time.monotonic() - started
            started = time.monotonic()
            back = agent.read_file("/tmp/vsock-bench")
            to_host = time.monotonic() - started
            if back != data:
                raise BenchError("the bytes read back differ from those written")
            runs.append({"to_guest_s": to_guest, "to_host_s": to_host})
            log(f"run {rep + 1}/{args.reps}: host->guest {args.vsock_mib / to_guest:.1f} MiB/s, "
                f"guest->host {args.vsock_mib / to_host:.1f} MiB/s")
    to_guest_med = statistics.median(r["to_guest_s"] for r in runs)
    to_host_med = statistics.median(r["to_host_s"] for r in runs)
    md = [(f"# vsock throughput through the agent ({args.vsock_mib} MiB each way, median "
           f"of {args.reps} run(s))"), "", f"Measured in: {where()}.", "",
          "| direction | seconds | MiB/s |", "|---|---|---|",
          (f"| host -> guest (write_file) | {to_guest_med:.2f} | "
           f"{args.vsock_mib / to_guest_med:.1f} |"),
          (f"| guest -> host (read_file) | {to_host_med:.2f} | "
           f"{args.vsock_mib / to_host_med:.1f} |"), ""]
    write_results("spawn-vsock", {"mib": args.vsock_mib, "reps": args.reps,
                                  "runs": runs}, "\n".join(md))
    return 0


def network_throughput(zygote: Any, snapshot: Any, hostnet: Any, workdir: Path,
                       args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from vmfork.runtime import network as net
    from vmfork.runtime.spawn import fork_children

    log("throughput: guest -> host")
    client = zygote.client(timeout=300.0)
    # The sink listens on the host: every egress policy refuses the host unless asked.
    spawn = fork_children(client, snapshot, 1, workdir / "vms", timeout=args.timeout,
                          per_child_netns=True, network=hostnet,
                          egress=net.EgressPolicy(reach_host=True))
    if spawn.failed:
        raise BenchError(f"throughput child failed: {spawn.failed}")
    child = spawn.children[0]
    try:
        out: dict[str, Any] = {"vmfork_guest": guest_throughput(child, args.throughput_seconds)}
    finally:
        kill_children(client)
        client.close()
        if child.network is not None:
            hostnet.destroy(child.network)
    log("throughput: peers without a VM")
    out.update(throughput_peers(args.throughput_seconds))
    return out


def render_network(args: argparse.Namespace, results: dict[str, Any],
                   setup: dict[str, Any]) -> str:
    def med(mode: str, n: int, key: str) -> float | None:
        return median_of(results[mode].get(n, []), key)

    md = [f"# Spawn with per-child networks ({args.mem_mib} MiB, median of {args.reps} run(s))",
          "", f"Measured in: {where()}.", "",
          "## Spawn time without / with a network namespace per child", "",
          ("| N | restored, no network | restored, netns | ready, no network | ready, netns | "
           "ready ratio | ready, pooled netns | ready ratio | making the N namespaces "
           "(inside 'netns') | taking N spares (inside 'pooled') | filling the pool "
           "beforehand | removing N |"),
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in args.n:
        teardown = [r["seconds"] for r in results["teardown"].get(n, [])]
        fill = [r["seconds"] for r in results["pool_fill"].get(n, [])]
        plain_ready = med("plain", n, "ready_s")
        totals = {}
        for mode in ("netns", "pooled"):
            ready = med(mode, n, "ready_s")
            totals[mode] = (ready + (med(mode, n, "network_s") or 0.0)
                            if ready is not None else None)
        md.append(f"| {n} | {fmt_s(med('plain', n, 'running_s'))} | "
                  f"{fmt_s(med('netns', n, 'running_s'))} | {fmt_s(plain_ready)} | "
                  f"{fmt_s(totals['netns'])} | {fmt_x(ratio(totals['netns'], plain_ready))} | "
                  f"{fmt_s(totals['pooled'])} | "
                  f"{fmt_x(ratio(totals['pooled'], plain_ready))} | "
                  f"{fmt_s(med('netns', n, 'network_s'))} | "
                  f"{fmt_s(med('pooled', n, 'network_s'))} | "
                  f"{fmt_s(statistics.median(fill) if fill else None)} | "
                  f"{fmt_s(statistics.median(teardown) if teardown else None)} |")
    tp = results.get("throughput", {})
    md += ["", ("'netns' ready counts from the request and includes making the namespaces "
                "(in parallel, 4 workers), which happens before the spawn; 'pooled' takes "
                "them from a pool of spares filled before the request (``--netns-pool``); "
                "'restored' counts from the spawn."), "",
           "## TCP throughput to the host (one stream)", "",
           "| sender | path | Mbit/s |", "|---|---|---|"]
    rows = (("vmfork_guest", "Python socket loop in the guest",
             "virtio-net → tap → child netns (SNAT) → veth → host"),
            ("python_veth", "the same Python loop in a plain namespace", "veth → host"),
            ("iperf3_veth", "iperf3 (Debian) in a plain namespace", "veth → host"))
    for key, sender, path in rows:
        if key in tp:
            md.append(f"| {sender} | {path} | {tp[key]['mbit_s']:.0f} |")
    if "vmfork_guest" in tp and "python_veth" in tp:
        md += ["", (f"Guest / same sender without a VM: "
                    f"{tp['vmfork_guest']['mbit_s'] / tp['python_veth']['mbit_s']:.2f}×.")]
    if results["failed"]:
        md += ["", "## Not measured", "",
               *(f"- {what}: {why}" for what, why in results["failed"].items())]
    incomplete = [f"- {mode} N={n}: {r['incomplete']}" for mode in NETWORK_MODES
                  for n, runs in results[mode].items() for r in runs if r.get("incomplete")]
    if incomplete:
        md += ["", "## Incomplete runs (restored time kept)", "", *incomplete]
    left = setup["leftovers_after_teardown"]
    md += ["", (f"Left behind after every child was removed: {len(left['namespaces'])} "
                f"namespaces, {len(left['links'])} host links."), ""]
    return "\n".join(md) + "\n"


# --------------------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 10, 100], help="comma-separated N values (default 1,10,100)")
    parser.add_argument("--quick", action="store_true", help="N = 1,10 (for iterating)")
    parser.add_argument("--reps", type=int, default=1, help="runs per N and peer")
    parser.add_argument("--lone-reps", type=int, default=5,
                        help="runs per peer at N = 1, at least --reps: one spawn is one "
                        "sample, and a lone spawn's spread on a shared host is as large as "
                        "the differences between peers (default 5)")
    parser.add_argument("--peers", type=lambda s: s.split(","), default=list(PEERS),
                        help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--mem-mib", type=int, default=256)
    parser.add_argument("--warm", default="import json, random",
                        help="Python the agent runs in each parent before the snapshot")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds idle after all agents answered, before reading memory")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds per peer and N (and per parent boot), at least")
    parser.add_argument("--timeout-per-vm", type=float, default=25.0,
                        help="seconds per VM: the timeout for N VMs is the larger of the two")
    parser.add_argument("--host-mem-mib", type=int, default=12288,
                        help="memory of the emulated test host, when one is needed")
    parser.add_argument("--host-timeout", type=float, default=3 * 3600.0,
                        help="seconds for the whole run in the emulated test host")
    parser.add_argument("--free-volume-slots", type=int, default=None,
                        help="empty volume slots of the vmfork parent (default: "
                             "snapshot_parent's)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also: each vmfork child's memory by mapping class and by phase, "
                             "and its threads' wake-ups while idle")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                        help="the native_b peer: native children from a third zygote whose "
                             "environment adds NAME=VALUE (repeatable), alternated with the "
                             "native peer in the same run: a knob's before and after")
    parser.add_argument("--phases", action="store_true",
                        help="also: each vmfork child's steps from fork to ready "
                             "(VMFORK_SPAWN_PROFILE=1 in the zygotes)")
    parser.add_argument("--network", action="store_true",
                        help="run the networking benchmark (N default 10,100) instead")
    parser.add_argument("--throughput-seconds", type=float, default=10.0,
                        help="--network: seconds each TCP throughput run sends")
    parser.add_argument("--vsock", action="store_true",
                        help="run the vsock throughput benchmark (one child) instead")
    parser.add_argument("--vsock-mib", type=int, default=32,
                        help="--vsock: MiB moved each way per run")
    args = parser.parse_args()
    if args.network and args.n == [1, 10, 100]:
        args.n = [10, 100]
    if args.quick:
        args.n = [1, 10]
    unknown = set(args.peers) - set(PEERS)
    if unknown or not {"vmfork", "native"} & set(args.peers):
        parser.error(f"--peers: need vmfork or native, and only {','.join(PEERS)} "
                     f"(got {args.peers})")
    if ("native_b" in args.peers) != bool(args.b_env):
        parser.error("--b-env goes with the native_b peer, and the native_b peer with it")
    args.b_env = dict(item.split("=", 1) for item in args.b_env)
    PEER_TITLES["native_b"] = ("native children, B (" + ", ".join(
        f"{k}={v}" for k, v in args.b_env.items()) + ")")
    return args


@contextmanager
def vmfork_home(workdir: Path) -> Iterator[Path]:
    home = workdir / "home"
    home.mkdir()
    old = os.environ.get("VMFORK_HOME")
    os.environ["VMFORK_HOME"] = str(home)
    try:
        yield home
    finally:
        if old is None:
            os.environ.pop("VMFORK_HOME", None)
        else:
            os.environ["VMFORK_HOME"] = old


@contextmanager
def environment(changes: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``changes`` while the block runs: ``native_b``'s
    spawns see its ``--b-env`` in the spawner (``runtime/spawn.py``) as its zygote does."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def alternated(peers: list[str], rep: int) -> list[str]:
    """``peers`` in their order for an even ``rep``; for an odd one, the vmfork peers
    among them in reverse (each in the other's place), so neither always goes first."""
    if rep % 2 == 0:
        return peers
    swapped = iter([p for p in peers if p in VMFORK_PEERS][::-1])
    return [next(swapped) if p in VMFORK_PEERS else p for p in peers]


def fits(name: str, n: int, results: dict[str, dict[int, list[dict[str, Any]]]]) -> str | None:
    """Why ``name`` cannot run N VMs in this host's memory, or None if it can."""
    smaller = [m for m in results[name] if m < n]
    if name == "floor" or not smaller:  # the floor's children map no guest page
        return None
    per_child_kib = max(results[name][max(smaller)][-1]["memory_summary"]["pss_mib"] * 1024,
                        1.0)
    need = n * per_child_kib
    have = mem_available_kib() * MEMORY_HEADROOM
    if need <= have:
        return None
    return (f"needs ~{need / 1024 / 1024:.1f} GiB ({per_child_kib / 1024:.0f} MiB Pss per child "
            f"at N={max(smaller)} × {n}) but this host has {have / 1024 / 1024:.1f} GiB "
            f"({MEMORY_HEADROOM:.0%} of MemAvailable)")


def main() -> int:
    args = parse_args()
    ensure_kvm_host(__file__, sys.argv[1:], mem_mib=args.host_mem_mib,
                    timeout=args.host_timeout)
    # SIGTERM (e.g. the test host's timeout) must still run the clean-up below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.network:
        return network_main(args)
    if args.vsock:
        return vsock_main(args)

    from vmfork.image import find_image
    from vmfork.runtime.parent import snapshot_parent
    from vmfork.runtime.spawnprofile import ENV as SPAWN_PROFILE_ENV
    from vmfork.runtime.zygote_child import NATIVE_CHILD, NATIVE_CHILD_ENV
    from vmfork.runtime.zygote_client import start_zygote
    from vmfork.store import Store

    image = find_image()
    vsock = os.path.exists("/dev/vhost-vsock")
    results: dict[str, dict[int, list[dict[str, Any]]]] = {p: {} for p in PEERS}
    skipped: dict[str, dict[int, str]] = {p: {} for p in PEERS}
    setup: dict[str, Any] = {"vsock": vsock, "image": image.name,
                             "kernel": str(image.kernel), "initrd": str(image.initrd),
                             "native_child": NATIVE_CHILD and "native" not in args.peers}
    # Which children the vmfork peer's are (the default's, or Python ones beside the
    # native peer): its tables say so.
    PEER_TITLES["vmfork"] = ("vmfork, native children (the default)" if setup["native_child"]
                             else "vmfork, Python children")
    slots = {} if args.free_volume_slots is None else {"free_volume_slots":
                                                       args.free_volume_slots}

    def log(msg: str) -> None:
        print(f"spawn: {msg}", file=sys.stderr, flush=True)

    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="vmfork-bench-spawn-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        home = stack.enter_context(vmfork_home(workdir))
        fleet = QemuFleet(image, args.mem_mib, workdir / "qemu", vsock)
        stack.callback(fleet.kill_all)

        log("snapshotting the vmfork parent")
        report = snapshot_parent(Store.open(home), "bench-spawn", image, mem_mib=args.mem_mib,
                                 warm_code=args.warm, **slots)
        snapshot = report.snapshot
        setup.update(vmfork_boot_s=report.boot_s, vmfork_warm_s=report.warm_s,
                     vmfork_pause_ms=report.pause_ms, vmfork_memory_bytes=report.memory_bytes)
        if args.breakdown:
            # Each child records its own phases (runtime/memphases.py), the last one
            # when the bench reads its memory from outside.
            from vmfork.runtime import memphases
            os.environ[memphases.ENV] = str(args.settle)
        zygotes: dict[str, Any] = {}
        for name in (p for p in VMFORK_PEERS if p in args.peers):
            env = dict(os.environ)
            if "native" in args.peers:
                # Side by side: the vmfork peer's children run Python, the native's none.
                env[NATIVE_CHILD_ENV] = "0"
            if name in ("native", "native_b"):
                env[NATIVE_CHILD_ENV] = "1"
            if name == "native_b":
                env.update(args.b_env)
            if args.phases:
                env[SPAWN_PROFILE_ENV] = "1"
            with open(workdir / f"zygote-{name}.log", "wb") as zlog:
                zygotes[name] = start_zygote(str(workdir / f"zygote-{name}.sock"), stderr=zlog,
                                             timeout=300.0, env=env)
            stack.callback(zygotes[name].close)
            log(f"{name}: first spawn from the cold zygote (per-snapshot preparation, "
                "not in the runs)")
            setup[f"{name}_first_spawn_s"] = vmfork_first_spawn(
                zygotes[name], snapshot, workdir / "vms", args.timeout)
        floor_bin = build_floor(workdir) if "floor" in args.peers else None
        template: Template | None = None
        if "template" in args.peers:
            log("making the QEMU template")
            try:
                template = template_make(fleet, workdir, args.warm, args.timeout)
                setup.update(template_boot_s=template.boot_s,
                             template_migrate_s=template.migrate_s,
                             template_state_bytes=template.state_bytes)
            except BenchError as err:
                fleet.kill_all()
                for n in args.n:
                    skipped["template"][n] = f"template parent failed: {err}"
                log(f"QEMU templating disabled: {err}")

        partial = RESULTS / "spawn.partial.json"
        RESULTS.mkdir(exist_ok=True)
        for rep in range(max(runs_at(args, n) for n in args.n)):
            for n in args.n:
                if rep >= runs_at(args, n):
                    continue
                # Interleaved per N, so drift on a shared machine hits every peer alike;
                # the two vmfork peers swap places every other run.
                for name in alternated(args.peers, rep):
                    if name == "template" and template is None:
                        continue
                    why = fits(name, n, results)
                    if why is not None:
                        skipped[name][n] = why
                        log(f"{name} N={n}: skipped: {why}")
                        continue
                    log(f"{name} N={n} (run {rep + 1}/{runs_at(args, n)})")
                    timeout = max(args.timeout, args.timeout_per_vm * n)
                    try:
                        if name in VMFORK_PEERS:
                            with environment(args.b_env if name == "native_b" else {}):
                                out = vmfork_spawn(zygotes[name], snapshot, n,
                                                   workdir / "vms", args.settle, timeout,
                                                   breakdown=args.breakdown,
                                                   phases=args.phases)
                        elif name == "floor":
                            assert floor_bin is not None
                            out = floor_run(floor_bin, snapshot.memory_path,
                                            args.mem_mib * MIB, n, timeout)
                        elif name == "template":
                            assert template is not None
                            out = qemu_template(fleet, template, n, args.settle, timeout)
                        else:
                            out = qemu_cold(fleet, n, args.settle, timeout)
                    # Any failure of one peer at one N is reported in the results and
                    # the run goes on: the other figures are still worth having.
                    except Exception as err:  # noqa: BLE001
                        fleet.kill_all()
                        skipped[name][n] = f"failed: {err}"
                        log(f"{name} N={n}: FAILED: {err}")
                        continue
                    results[name].setdefault(n, []).append(out)
                    if out.get("incomplete"):
                        skipped[name][n] = f"incomplete: {out['incomplete']}"
                    log(f"{name} N={n}: running {fmt_s(out.get('running_s'))}, "
                        f"ready {fmt_s(out.get('ready_s'))}"
                        + (f" (incomplete: {out['incomplete']})" if out.get("incomplete")
                           else ""))
                    # If the emulated host dies later, what was measured survives.
                    partial.write_text(json.dumps({"setup": setup, "results": results,
                                                   "skipped": skipped}, indent=1, default=str))

        markdown, derived = render(args, results, skipped, setup)
        partial.unlink(missing_ok=True)
        write_results("spawn", {
            "n": args.n, "reps": args.reps, "lone_reps": runs_at(args, 1),
            "mem_mib": args.mem_mib, "warm": args.warm,
            "setup": setup, "results": {p: {str(n): runs for n, runs in by_n.items()}
                                        for p, by_n in results.items()},
            "summaries": {p: {str(n): {k: summary([float(r[k]) for r in runs])
                                       for k in ("running_s", "ready_s")
                                       if all(r.get(k) is not None for r in runs)}
                              for n, runs in by_n.items()} for p, by_n in results.items()},
            "skipped": {p: {str(n): w for n, w in by_n.items()} for p, by_n in skipped.items()},
            **derived}, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
