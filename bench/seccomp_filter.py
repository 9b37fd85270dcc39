"""What the VMM's seccomp filter costs per system call, and what its search trees save.

Every system call a jailed VMM makes runs its filter first: each ``KVM_RUN`` after each
exit, each ``epoll_wait``, each ``read`` of an eventfd. The filter used to compare the
syscall number with each allowed one in turn and then the ioctl request with each
allowed request (up to ~480 instructions for an ioctl); ``runtime/seccomp.py`` now
looks both up in binary search trees. This measures, side by side in one run, in forked
children that each install one program (no KVM needed: the filter runs before the
call, whatever the call does):

* ``none``: no filter (the call's own cost);
* ``linear``: the old layout, the same allow-list compared one number after another
  (built here as the peer; same verdicts, only the order of the comparisons differs);
* ``tree``: the program the VMM installs (``seccomp.vmm_filter()``).

Three calls, at the ends of the old lists: ``getppid`` (a cheap call the old list
reached after ~100 comparisons), ``ioctl(FIONREAD)`` on a pipe (a request the old
list reached near its end) and ``epoll_wait`` with a zero timeout. Reports the median
ns per call over ``--rounds`` rounds of ``--calls`` calls, and the filter's share
(``linear``/``tree`` minus ``none``). Natively on any Linux host; in the emulated test
host only ratios mean anything.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import select
import statistics
import struct
import sys
import termios
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import where, write_results

from vmfork.runtime import seccomp


def linear_filter() -> bytes:
    """The peer: the same allow-list, each number and each request compared in turn."""
    ins = seccomp._insn
    deny = ins(seccomp.BPF_RET_K, seccomp.SECCOMP_RET_KILL_PROCESS)
    allow = ins(seccomp.BPF_RET_K, seccomp.SECCOMP_RET_ALLOW)
    names = sorted(set(seccomp.VMM_ALLOWED) - {"ioctl", "socket", "socketpair", "clone3"})
    prog = [ins(seccomp.BPF_LD_W_ABS, seccomp._ARCH), ins(seccomp.BPF_JEQ_K, seccomp.AUDIT_ARCH_X86_64, 1, 0),
            deny, ins(seccomp.BPF_LD_W_ABS, seccomp._NR),
            ins(seccomp.BPF_JEQ_K, seccomp.SYSCALLS["clone3"], 0, 1),
            ins(seccomp.BPF_RET_K, seccomp.SECCOMP_RET_ERRNO | errno.ENOSYS)]
    for name in names:
        prog += [ins(seccomp.BPF_JEQ_K, seccomp.SYSCALLS[name], 0, 1), allow]
    for name in ("socket", "socketpair"):
        prog += [ins(seccomp.BPF_JEQ_K, seccomp.SYSCALLS[name], 0, 4),
                 ins(seccomp.BPF_LD_W_ABS, seccomp._arg_lo(0)), ins(seccomp.BPF_JEQ_K, 1, 0, 1), allow, deny]
    block = [ins(seccomp.BPF_LD_W_ABS, seccomp._arg_hi(1)), ins(seccomp.BPF_JEQ_K, 0, 1, 0), deny,
             ins(seccomp.BPF_LD_W_ABS, seccomp._arg_lo(1))]
    for req in sorted(set(seccomp.vmm_ioctls())):
        block += [ins(seccomp.BPF_JEQ_K, req, 0, 1), allow]
    block.append(deny)
    prog += [ins(seccomp.BPF_JEQ_K, seccomp.SYSCALLS["ioctl"], 0, len(block))] + block
    prog.append(deny)
    return b"".join(prog)


def measure(program: bytes | None, calls: int, rounds: int) -> dict[str, float]:
    """Median ns per call of each probe, in a child that installed ``program``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            if program is not None:
                seccomp.install(program)
            rfd, _ = os.pipe()
            ep = select.epoll()
            libc = ctypes.CDLL(None)
            buf = ctypes.c_int(0)
            probes = {
                "getppid": lambda: libc.getppid(),
                "ioctl(FIONREAD)": lambda: libc.ioctl(rfd, termios.FIONREAD, ctypes.byref(buf)),
                "epoll_wait": lambda: ep.poll(0),
            }
            result = {}
            for name, probe in probes.items():
                samples = []
                for _ in range(rounds):
                    start = time.perf_counter_ns()
                    for _ in range(calls):
                        probe()
                    samples.append((time.perf_counter_ns() - start) / calls)
                result[name] = statistics.median(samples)
            os.write(write_end, struct.pack("<3d", *result.values()))
            os._exit(0)
        except BaseException:  # noqa: BLE001 - a child reports by status, never unwinds
            os._exit(3)
    os.close(write_end)
    data = os.read(read_end, 64)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or len(data) != 24:
        raise SystemExit(f"the measuring child failed (wait status {status:#x})")
    return dict(zip(("getppid", "ioctl(FIONREAD)", "epoll_wait"), struct.unpack("<3d", data)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if (why := seccomp.available()) is not None:
        raise SystemExit(f"seccomp filters are not available here: {why}")
    programs = {"none": None, "linear": linear_filter(), "tree": seccomp.vmm_filter()}
    # Interleaved, so a change in the machine's load touches every peer alike.
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in programs}
    for _ in range(3):
        for name, program in programs.items():
            runs[name].append(measure(program, args.calls, args.rounds))
    ns = {name: {probe: statistics.median(r[probe] for r in results)
                 for probe in results[0]} for name, results in runs.items()}
    lines = ["# seccomp filter cost per system call (`bench/seccomp_filter.py`)\n",
             f"Measured in: {where()}; median ns per call (3 interleaved runs of "
             f"{args.rounds} rounds of {args.calls} calls, each in a forked child); the "
             f"programs: linear {len(programs['linear'] or b'') // 8} instructions, tree "
             f"{len(programs['tree'] or b'') // 8}.\n",
             "| call | no filter | linear | tree | filter's share: linear | tree |",
             "|---|---|---|---|---|---|"]
    for probe in ns["none"]:
        base = ns["none"][probe]
        lines.append(f"| {probe} | {base:.0f} | {ns['linear'][probe]:.0f} | "
                     f"{ns['tree'][probe]:.0f} | {ns['linear'][probe] - base:.0f} | "
                     f"{ns['tree'][probe] - base:.0f} |")
    write_results("seccomp_filter", {"ns_per_call": ns, "calls": args.calls,
                                     "rounds": args.rounds}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
