"""Where a hung test host's CPUs are: QEMU's human monitor, asked before QEMU is killed.

A test host whose kernel stops answering (no heartbeat) leaves no oops on its
console: the emulated CPU spins with interrupts off, or QEMU itself loops while
emulating one instruction. QEMU's monitor still answers from its main thread, so
``info registers -a`` a few times shows each vCPU's instruction pointer and whether it
moves. Addresses are named from the test-host kernel's own ``/proc/kallsyms`` (its
text symbols), which ``/init`` copies out once per kernel version into the cache
(``symbols_path``; Debian's ``System.map`` is only a placeholder). The kernel runs
without KASLR here, so one copy serves every later boot.
"""

from __future__ import annotations

import bisect
import os
import re
import shutil
import socket
import time
from pathlib import Path

from vmfork.paths import cache_dir

PROMPT = b"(qemu) "
SYMBOLS_CACHE = "testhost-kallsyms"
_RIP = re.compile(r"RIP=([0-9a-f]{16})")
_EFER = re.compile(r"EFER=([0-9a-f]{16})")
_CPU = re.compile(r"^CPU#(\d+)", re.MULTILINE)
# EFER.SVME: set in the test host's kernel (its KVM turned SVM on), clear while the
# emulated CPU runs a nested guest (whose EFER the VMCB loaded).
_EFER_SVME = 1 << 12


def symbols_path(kernel_version: str) -> Path:
    """Where the text symbols of test-host kernel ``kernel_version`` are cached."""
    if not kernel_version or "/" in kernel_version or kernel_version.startswith("."):
        raise ValueError(f"not a kernel version: {kernel_version!r}")
    return cache_dir() / SYMBOLS_CACHE / f"{kernel_version}.txt"


def keep_symbols(kernel_version: str, dumped: Path) -> None:
    """Move ``dumped`` (the guest's text symbols) into the cache, atomically; ignore an
    empty or absent dump (the next run asks again)."""
    try:
        if dumped.stat().st_size == 0:
            return
    except FileNotFoundError:
        return
    target = symbols_path(kernel_version)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.copyfile(dumped, tmp)
    os.replace(tmp, target)


def monitor_option(path: str) -> list[str]:
    """QEMU arguments for a human monitor on a Unix socket that never blocks QEMU."""
    return ["-monitor", f"unix:{path},server=on,wait=off"]


def _read_until_prompt(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while not data.endswith(PROMPT):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def ask(path: str, command: str, timeout: float = 3.0) -> str:
    """One monitor command's output (raises ``OSError`` when QEMU does not answer)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        _read_until_prompt(sock, deadline)  # the banner
        sock.sendall(command.encode() + b"\n")
        out = _read_until_prompt(sock, deadline).decode(errors="replace")
    # The monitor echoes the command line (with terminal escapes) before its output.
    lines = out.replace("\r", "").split("\n")
    return "\n".join(line for line in lines[1:] if not line.startswith("(qemu)"))


def instruction_pointers(registers: str) -> dict[int, tuple[int, bool]]:
    """vCPU index -> (RIP, in a nested guest) from ``info registers -a`` output."""
    rips = [int(m.group(1), 16) for m in _RIP.finditer(registers)]
    nested = [not int(m.group(1), 16) & _EFER_SVME for m in _EFER.finditer(registers)]
    cpus = [int(m.group(1)) for m in _CPU.finditer(registers)]
    if len(cpus) != len(rips):
        cpus = list(range(len(rips)))
    if len(nested) != len(rips):
        nested = [False] * len(rips)
    return {cpu: (rip, guest) for cpu, rip, guest in zip(cpus, rips, nested, strict=True)}


class Symbols:
    """Text symbols of a ``System.map``: address -> ``name+0xoffset``."""

    def __init__(self, text: str) -> None:
        entries = []
        for line in text.splitlines():
            parts = line.split()  # address, type, name[, [module]]
            if len(parts) in (3, 4) and parts[1] in ("T", "t"):
                suffix = f" {parts[3]}" if len(parts) == 4 else ""
                entries.append((int(parts[0], 16), parts[2], suffix))
        entries.sort()
        self._addresses = [a for a, _, _ in entries]
        self._names = [(name, suffix) for _, name, suffix in entries]

    @classmethod
    def load(cls, kernel_version: str, fresh_dump: Path | None = None) -> Symbols | None:
        """The cached symbols of that kernel, else a dump this run just made, else None."""
        for path in (symbols_path(kernel_version), fresh_dump):
            try:
                if path is not None:
                    return cls(path.read_text())
            except OSError:
                continue
        return None

    def name(self, address: int) -> str | None:
        """``function+0xoffset [module]``, or None below the kernel's text (user space)."""
        i = bisect.bisect_right(self._addresses, address) - 1
        if i < 0:
            return None
        name, module = self._names[i]
        return f"{name}+{address - self._addresses[i]:#x}{module}"


def where_cpus_are(path: str, symbols: Symbols | None, samples: int = 3,
                   interval: float = 0.5) -> str:
    """A line for an error report: each vCPU's RIP over a few samples, with symbols;
    or why the monitor could not tell."""
    seen: dict[int, list[tuple[int, bool]]] = {}
    try:
        for sample in range(samples):
            if sample:
                time.sleep(interval)
            for cpu, where in instruction_pointers(ask(path, "info registers -a")).items():
                seen.setdefault(cpu, []).append(where)
    except OSError as err:
        return f"QEMU's monitor did not answer ({err}): QEMU itself is stuck"
    if not seen:
        return "QEMU's monitor showed no registers"

    def show(where: tuple[int, bool]) -> str:
        rip, nested = where
        if nested:  # the test host's symbols say nothing about a nested guest's code
            return f"{rip:#x} in a nested guest"
        name = symbols.name(rip) if symbols is not None else None
        return f"{rip:#x}" + (f" {name}" if name else " (user space)")

    parts = []
    for cpu, rips in sorted(seen.items()):
        distinct = list(dict.fromkeys(rips))
        state = "stuck at" if len(distinct) == 1 else f"at {len(distinct)} places:"
        parts.append(f"vCPU {cpu} {state} " + ", ".join(show(r) for r in distinct))
    return "; ".join(parts)
