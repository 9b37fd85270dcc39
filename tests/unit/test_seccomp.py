"""The VMM's seccomp allow-list, installed for real in forked children (no KVM needed).

Each probe forks, installs ``install_vmm_filter()`` in the child (which has the test's
imported modules, like a zygote child), makes one call and reports by exit status;
the parent reads how the child ended. A denied syscall must end the child by SIGSYS.
"""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from vmfork.kvm import ioctls
from vmfork.runtime import seccomp

UNISTD = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")


def _in_filtered_child(probe: Callable[[], None], *, log_only: bool = False,
                       parent: bool = False) -> int:
    """The child's wait status after it installs the filter (the parent VMM's with
    ``parent``) and runs ``probe``."""
    pid = os.fork()
    if pid == 0:
        try:
            if parent:
                seccomp.install_parent_filter(log_only=log_only)
            else:
                seccomp.install_vmm_filter(log_only=log_only)
            probe()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - report by status, never unwind in the child
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return status


def _killed_by_sigsys(status: int) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS


@pytest.mark.skipif(not UNISTD.exists(), reason="needs the kernel headers (linux-libc-dev)")
def test_syscall_numbers_match_the_kernel_headers() -> None:
    defined = {m[1]: int(m[2]) for m in
               re.finditer(r"#define __NR_(\w+) (\d+)", UNISTD.read_text())}
    wrong = {n: (v, defined.get(n)) for n, v in seccomp.SYSCALLS.items() if defined.get(n) != v}
    assert not wrong


def test_what_a_vmm_does_is_allowed() -> None:
    def probe() -> None:
        # Threads (clone3 answered ENOSYS, glibc falls back to clone), futexes, eventfd,
        # epoll, Unix sockets, files, mmap, the pagemap, a fork without exec.
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        fd = os.eventfd(0)
        os.eventfd_write(fd, 1)
        os.close(fd)
        a, b = socket.socketpair(socket.AF_UNIX)
        a.sendall(b"x")
        assert b.recv(1) == b"x"
        a.setblocking(False)   # ioctl(FIONBIO)
        a.close()
        b.close()
        import mmap
        m = mmap.mmap(-1, 1 << 20)
        m[:4] = b"abcd"
        m.close()
        with open("/proc/self/pagemap", "rb") as f:
            f.read(8)
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        if os.path.exists("/dev/kvm"):
            # The _IO requests too (no size field): KVM_GET_API_VERSION, KVM_CREATE_VM,
            # KVM_GET_VCPU_MMAP_SIZE, KVM_CREATE_VCPU; a first jailed e2e run died on one.
            import fcntl
            kvm = os.open("/dev/kvm", os.O_RDWR)
            assert fcntl.ioctl(kvm, ioctls.KVM_GET_API_VERSION) == 12
            assert fcntl.ioctl(kvm, ioctls.KVM_GET_VCPU_MMAP_SIZE) > 0
            vm = fcntl.ioctl(kvm, ioctls.KVM_CREATE_VM, 0)
            os.close(fcntl.ioctl(vm, ioctls.KVM_CREATE_VCPU, 0))
            os.close(vm)
            os.close(kvm)

    status = _in_filtered_child(probe)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@pytest.mark.parametrize("name,probe", [
    ("execve", lambda: os.execv("/bin/true", ["true"])),
    ("socket(AF_INET)", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()),
    ("socket(AF_NETLINK)", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close()),
    ("ptrace", lambda: seccomp._libc.ptrace(16, os.getppid(), 0, 0)),   # PTRACE_ATTACH
    ("unshare", lambda: seccomp._libc.unshare(0x00020000)),   # CLONE_NEWNS
    ("setuid", lambda: os.setuid(0)),
    ("ioctl TIOCSTI", lambda: seccomp._libc.ioctl(0, 0x5412, b"x")),
])
def test_what_a_vmm_never_does_kills_it(name: str, probe: Callable[[], None]) -> None:
    status = _in_filtered_child(probe)
    assert _killed_by_sigsys(status), f"{name}: child ended with status {status:#x}"


def test_log_mode_allows_and_does_not_kill() -> None:
    """The collection mode: a call outside the list runs (and the kernel logs it)."""
    status = _in_filtered_child(lambda: socket.socket(socket.AF_INET).close(), log_only=True)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_the_program_fits_and_names_only_known_syscalls() -> None:
    prog = seccomp.build_filter(seccomp.VMM_ALLOWED, ioctl_requests=seccomp.vmm_ioctls())
    assert len(prog) % 8 == 0 and len(prog) // 8 < 4096
    assert "execve" not in seccomp.VMM_ALLOWED and "ptrace" not in seccomp.VMM_ALLOWED
    with pytest.raises(ValueError, match="no x86-64 number"):
        seccomp.build_filter(["not_a_syscall"])
    assert seccomp.available() is None


def test_the_vmm_program_is_built_once_and_is_the_allow_list() -> None:
    """What a zygote builds in its prefork and every child installs: the same program
    ``build_filter`` gives for the VMM's list, one object per mode."""
    kill = seccomp.vmm_filter()
    assert kill is seccomp.vmm_filter()
    assert kill == seccomp.build_filter(seccomp.VMM_ALLOWED, ioctl_requests=seccomp.vmm_ioctls())
    logging_only = seccomp.vmm_filter(log_only=True)
    assert logging_only != kill and logging_only == seccomp.build_filter(
        seccomp.VMM_ALLOWED, ioctl_requests=seccomp.vmm_ioctls(),
        default=seccomp.SECCOMP_RET_LOG)


def test_a_parent_vmm_makes_threads_but_never_forks() -> None:
    """The parent's list: threads (clone with CLONE_THREAD) and files as a VMM; a fork
    (clone without CLONE_THREAD) dies, as do the VMM's forbidden calls."""
    def threads_and_files() -> None:
        done = []
        t = threading.Thread(target=lambda: done.append(1))
        t.start()
        t.join()
        assert done == [1]
        a, b = socket.socketpair(socket.AF_UNIX)
        a.close()
        b.close()

    status = _in_filtered_child(threads_and_files, parent=True)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert _killed_by_sigsys(_in_filtered_child(lambda: os._exit(0) if os.fork() == 0
                                                else None, parent=True))
    assert _killed_by_sigsys(_in_filtered_child(
        lambda: socket.socket(socket.AF_INET).close(), parent=True))
    assert _killed_by_sigsys(_in_filtered_child(
        lambda: os.execv("/bin/true", ["true"]), parent=True))


def _evaluate(program: bytes, nr: int, args: tuple[int, ...] = (0,) * 6,
              arch: int = seccomp.AUDIT_ARCH_X86_64) -> tuple[int, int]:
    """What the kernel would return for one ``seccomp_data``, and how many instructions
    it ran: classic BPF as the kernel runs it, for the opcodes the builder uses. Jumps
    must go forward and stay inside the program, or this fails (the kernel's checker
    refuses such a program at install time)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    insns = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    acc, pc, steps = 0, 0, 0
    while True:
        assert 0 <= pc < len(insns), f"jump out of the program at {pc}"
        code, jt, jf, k = insns[pc]
        steps += 1
        pc += 1
        if code == seccomp.BPF_LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == seccomp.BPF_ALU_AND_K:
            acc &= k
        elif code == seccomp.BPF_JA:
            pc += k
        elif code == seccomp.BPF_JEQ_K:
            pc += jt if acc == k else jf
        elif code == seccomp.BPF_JGE_K:
            pc += jt if acc >= k else jf
        elif code == seccomp.BPF_RET_K:
            return k, steps
        else:
            raise AssertionError(f"opcode {code:#x} at {pc - 1}")


def test_the_program_decides_every_syscall_as_the_list_says() -> None:
    """Every syscall number (and the ones past the table, and the x32 ABI's), every
    ioctl request the VMM uses and many it does not, each socket domain: the search
    trees give what the allow-list means, in a few dozen instructions at most."""
    kill, allow = seccomp.SECCOMP_RET_KILL_PROCESS, seccomp.SECCOMP_RET_ALLOW
    requests = seccomp.vmm_ioctls()
    prog = seccomp.vmm_filter()
    allowed = {seccomp.SYSCALLS[n] for n in seccomp.VMM_ALLOWED} - {
        seccomp.SYSCALLS[n] for n in ("socket", "socketpair", "ioctl")}
    longest = 0
    for nr in [*range(1024), 0x40000000, 0x40000001, 0x7FFFFFFF, -1]:
        verdict, steps = _evaluate(prog, nr)
        longest = max(longest, steps)
        if nr == seccomp.SYSCALLS["clone3"]:
            assert verdict == seccomp.SECCOMP_RET_ERRNO | errno.ENOSYS
        elif nr == seccomp.SYSCALLS["ioctl"]:
            assert verdict == kill     # request 0 is not one of ours
        elif nr in (seccomp.SYSCALLS["socket"], seccomp.SYSCALLS["socketpair"]):
            assert verdict == kill     # domain 0 is AF_UNSPEC
            assert _evaluate(prog, nr, (socket.AF_UNIX, 0, 0, 0, 0, 0))[0] == allow
            assert _evaluate(prog, nr, (socket.AF_INET, 0, 0, 0, 0, 0))[0] == kill
        else:
            assert verdict == (allow if nr in allowed else kill), nr
        assert _evaluate(prog, nr, arch=0x40000003)[0] == kill   # i386
    rng = random.Random(19)
    ioctl = seccomp.SYSCALLS["ioctl"]
    others = {rng.getrandbits(32) for _ in range(3000)} | {r + 1 for r in requests} | {
        r - 1 for r in requests} | {0x5412}   # TIOCSTI
    for request in sorted(set(requests) | others):
        verdict, steps = _evaluate(prog, ioctl, (3, request, 0, 0, 0, 0))
        longest = max(longest, steps)
        assert verdict == (allow if request in requests else kill), hex(request)
        assert _evaluate(prog, ioctl, (3, request | 1 << 32, 0, 0, 0, 0))[0] == kill
    assert longest <= 32, longest   # the linear program ran up to ~480 for an ioctl


def test_a_parent_vmm_program_checks_clone_flags_by_search_too() -> None:
    prog = seccomp.build_filter(seccomp.PARENT_ALLOWED, ioctl_requests=seccomp.vmm_ioctls(),
                                threads_only=True)
    clone = seccomp.SYSCALLS["clone"]
    thread_flags = 0x3D0F00   # what glibc's pthread_create passes
    assert _evaluate(prog, clone, (thread_flags, 0, 0, 0, 0, 0))[0] == seccomp.SECCOMP_RET_ALLOW
    assert _evaluate(prog, clone, (0x11, 0, 0, 0, 0, 0))[0] == seccomp.SECCOMP_RET_KILL_PROCESS
    for name in ("fork", "vfork", "wait4", "execve"):
        assert _evaluate(prog, seccomp.SYSCALLS[name])[0] == seccomp.SECCOMP_RET_KILL_PROCESS
