"""A seccomp allow-list for a VMM process, as classic BPF written here (x86-64 only).

Why our own BPF and not a library: the filter is ~500 instructions of one simple shape
(check the architecture, find the syscall number, for four syscalls check one argument).
The PyPI packages that bind libseccomp are a third party's re-packaging
(``mephi42-seccomp``) rather than the libseccomp project's own release, and would be a
native dependency in the jail's most sensitive step; the kernel's interface is stable
and small: ``prctl(PR_SET_NO_NEW_PRIVS)`` then ``seccomp(SECCOMP_SET_MODE_FILTER)``.

The program, in order (Documentation/userspace-api/seccomp_filter.rst):

1. ``arch != AUDIT_ARCH_X86_64`` → kill: a 32-bit ``int 0x80`` uses other numbers.
2. ``nr >= 0x40000000`` (the x32 ABI bit) → kill, for the same reason.
3. The syscall number looked up in a binary search tree of every number the list
   names (``JGE`` splits, a few ``JEQ`` at each leaf), whose leaves say:

   * ``clone3`` → ``ENOSYS``: its flags are behind a pointer BPF cannot read; glibc
     then falls back to ``clone``, whose flags are a register (a parent VMM's
     ``clone`` must have ``CLONE_THREAD``);
   * ``ioctl``: allowed only for the request numbers the VMM uses (KVM's, tun's, and
     the few CPython issues itself: FIONBIO, FIOCLEX, FIONCLEX, TCGETS), upper 32 bits
     zero, the request found by a second tree;
   * ``socket``/``socketpair``: ``AF_UNIX`` only (the vsock back end and the control
     socket): no ``AF_INET``, no netlink, no packet sockets;
   * every other listed syscall: allowed.

   Anything else gets the default action: ``SECCOMP_RET_KILL_PROCESS`` (the whole VMM
   dies with SIGSYS) or, to collect what a workload needs, ``SECCOMP_RET_LOG``
   (allowed, and logged by the kernel's audit as ``type=SECCOMP ... syscall=N``).

Not allowed, so they kill: ``execve``/``execveat``, ``ptrace``, ``process_vm_*``,
``mount``/``umount2``/``pivot_root``/``chroot``, ``unshare``/``setns``, ``bpf``,
``perf_event_open``, ``keyctl``/``add_key``, ``init_module``, ``kexec_*``,
``userfaultfd``, ``io_uring_*``, ``setuid`` and friends, ``socket(AF_INET)``...
"""

from __future__ import annotations

import ctypes
import errno
import functools
import struct
from collections.abc import Iterable

from vmfork.kvm import ioctls

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_LOG = 0x7FFC0000
SECCOMP_RET_ALLOW = 0x7FFF0000
PR_SET_NO_NEW_PRIVS = 38
PR_GET_SECCOMP = 21
SYS_SECCOMP = 317

# BPF opcodes (linux/bpf_common.h)
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JGE_K = 0x35
BPF_JA = 0x05
BPF_RET_K = 0x06
BPF_ALU_AND_K = 0x54
CLONE_THREAD = 0x00010000

# seccomp_data offsets: nr (0), arch (4), instruction_pointer (8), args[6] (16 + 8 i),
# each argument little-endian, so its low word is at +0 and its high word at +4.
_NR, _ARCH = 0, 4


def _arg_lo(i: int) -> int:
    return 16 + 8 * i


def _arg_hi(i: int) -> int:
    return 16 + 8 * i + 4


# x86-64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl; a stable ABI). The
# test compares them with the kernel headers when those are installed.
SYSCALLS: dict[str, int] = {
    "read": 0, "write": 1, "open": 2, "close": 3, "stat": 4, "fstat": 5, "lstat": 6,
    "poll": 7, "lseek": 8, "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12,
    "rt_sigaction": 13, "rt_sigprocmask": 14, "rt_sigreturn": 15, "ioctl": 16,
    "pread64": 17, "pwrite64": 18, "readv": 19, "writev": 20, "access": 21, "pipe": 22,
    "select": 23, "sched_yield": 24, "mremap": 25, "msync": 26, "mincore": 27,
    "madvise": 28, "dup": 32, "dup2": 33, "nanosleep": 35, "getitimer": 36, "alarm": 37,
    "setitimer": 38, "getpid": 39, "sendfile": 40, "socket": 41, "connect": 42,
    "accept": 43, "sendto": 44, "recvfrom": 45, "sendmsg": 46, "recvmsg": 47,
    "shutdown": 48, "bind": 49, "listen": 50, "getsockname": 51, "getpeername": 52,
    "socketpair": 53, "setsockopt": 54, "getsockopt": 55, "clone": 56, "fork": 57,
    "vfork": 58, "execve": 59, "exit": 60, "wait4": 61, "kill": 62, "uname": 63,
    "fcntl": 72, "flock": 73, "fsync": 74, "fdatasync": 75, "truncate": 76,
    "ftruncate": 77, "getdents": 78, "getcwd": 79, "chdir": 80, "fchdir": 81,
    "rename": 82, "mkdir": 83, "rmdir": 84, "link": 86, "unlink": 87, "symlink": 88,
    "readlink": 89, "chmod": 90, "fchmod": 91, "umask": 95, "gettimeofday": 96,
    "getrlimit": 97, "getrusage": 98, "sysinfo": 99, "times": 100, "ptrace": 101,
    "getuid": 102, "getgid": 104, "setuid": 105, "setgid": 106, "geteuid": 107,
    "getegid": 108, "setpgid": 109, "getppid": 110, "getpgrp": 111, "setsid": 112,
    "getgroups": 115, "getresuid": 118, "getresgid": 120, "getpgid": 121, "getsid": 124,
    "capget": 125, "rt_sigpending": 127, "rt_sigtimedwait": 128, "rt_sigqueueinfo": 129,
    "rt_sigsuspend": 130, "sigaltstack": 131, "statfs": 137, "fstatfs": 138,
    "getpriority": 140, "sched_getparam": 143, "sched_getscheduler": 145,
    "mlock": 149, "munlock": 150, "prctl": 157, "arch_prctl": 158, "setrlimit": 160,
    "chroot": 161, "sync": 162, "mount": 165, "umount2": 166, "gettid": 186,
    "readahead": 187, "getxattr": 191, "lgetxattr": 192, "fgetxattr": 193,
    "time": 201, "futex": 202, "sched_setaffinity": 203, "sched_getaffinity": 204,
    "epoll_create": 213, "getdents64": 217, "set_tid_address": 218,
    "restart_syscall": 219, "fadvise64": 221, "timer_create": 222, "timer_settime": 223,
    "timer_gettime": 224, "timer_delete": 226, "clock_gettime": 228,
    "clock_getres": 229, "clock_nanosleep": 230, "exit_group": 231, "epoll_wait": 232,
    "epoll_ctl": 233, "tgkill": 234, "utimes": 235, "waitid": 247, "openat": 257,
    "mkdirat": 258, "newfstatat": 262, "unlinkat": 263, "renameat": 264,
    "readlinkat": 267, "fchmodat": 268, "faccessat": 269, "pselect6": 270, "ppoll": 271,
    "set_robust_list": 273, "get_robust_list": 274, "splice": 275, "tee": 276,
    "sync_file_range": 277, "utimensat": 280, "epoll_pwait": 281, "timerfd_create": 283,
    "eventfd": 284, "fallocate": 285, "timerfd_settime": 286, "timerfd_gettime": 287,
    "accept4": 288, "eventfd2": 290, "epoll_create1": 291, "dup3": 292, "pipe2": 293,
    "preadv": 295, "pwritev": 296, "rt_tgsigqueueinfo": 297, "perf_event_open": 298,
    "recvmmsg": 299, "prlimit64": 302, "sendmmsg": 307, "setns": 308, "getcpu": 309,
    "process_vm_readv": 310, "process_vm_writev": 311, "renameat2": 316, "seccomp": 317,
    "getrandom": 318, "memfd_create": 319, "bpf": 321, "execveat": 322,
    "userfaultfd": 323, "membarrier": 324, "copy_file_range": 326, "preadv2": 327,
    "pwritev2": 328, "statx": 332, "rseq": 334, "pidfd_send_signal": 424,
    "io_uring_setup": 425, "pidfd_open": 434, "clone3": 435, "close_range": 436,
    "faccessat2": 439, "epoll_pwait2": 441, "unshare": 272, "pivot_root": 155,
    "setresuid": 117, "setresgid": 119, "setgroups": 116,
}

# What a VMM process does after its jail is set up: the CPython runtime (memory,
# threads, signals, files in its run directory), KVM (ioctl, mmap of the run structs
# and guest RAM), the event loop (epoll, eventfd), Unix sockets, the live-branch
# writer (fork without exec, copy_file_range, waitid) and the dirty-page scan
# (/proc/self/pagemap, clear_refs). The native control server (control_serve.rs,
# started after the filter) needs nothing more: fcntl (F_DUPFD_CLOEXEC), eventfd2,
# the thread's start, gettid, poll, accept4, recvfrom, sendto, write, close.
VMM_ALLOWED = (
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "preadv2", "pwritev2", "open", "openat", "close", "close_range", "stat", "fstat",
    "lstat", "newfstatat", "statx", "statfs", "fstatfs", "lseek", "access", "faccessat",
    "faccessat2", "readlink", "readlinkat", "getdents64", "getcwd", "fcntl", "flock",
    "dup", "dup2", "dup3", "pipe", "pipe2", "fsync", "fdatasync", "ftruncate",
    "fallocate", "sync_file_range", "copy_file_range", "sendfile", "splice", "fadvise64",
    "readahead", "rename", "renameat", "renameat2", "unlink", "unlinkat", "mkdir",
    "mkdirat", "rmdir", "fchmod", "chmod", "fchmodat", "utimensat", "umask",
    "fgetxattr", "getxattr", "lgetxattr",
    "mmap", "munmap", "mprotect", "mremap", "madvise", "mincore", "msync", "brk",
    "mlock", "munlock", "memfd_create", "membarrier",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending",
    "rt_sigtimedwait", "rt_sigsuspend", "sigaltstack", "kill", "tgkill",
    "rt_tgsigqueueinfo", "rt_sigqueueinfo", "alarm", "getitimer", "setitimer",
    "clone", "exit", "exit_group", "wait4", "waitid", "set_tid_address",
    "set_robust_list", "get_robust_list", "rseq", "futex", "sched_yield",
    "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_getscheduler",
    "getpriority", "restart_syscall", "arch_prctl", "prctl", "pidfd_open",
    "pidfd_send_signal",
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1",
    "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2",
    "timerfd_create", "timerfd_settime", "timerfd_gettime", "timer_create",
    "timer_settime", "timer_gettime", "timer_delete",
    "connect", "accept", "accept4", "bind", "listen", "sendto", "recvfrom", "sendmsg",
    "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "getsockname", "getpeername",
    "setsockopt", "getsockopt",
    "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday",
    "time", "getrandom", "uname", "sysinfo", "getrusage", "times", "getrlimit",
    "prlimit64", "getcpu", "capget",
    "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid",
    "getresuid", "getresgid", "getgroups", "getpgrp", "getpgid", "getsid",
)

AF_UNIX = 1
FIONBIO = 0x5421
FIOCLEX = 0x5451
FIONCLEX = 0x5450
FIONREAD = 0x541B
TCGETS = 0x5401
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUNSETVNETHDRSZ = 0x400454D8


def vmm_ioctls() -> list[int]:
    """Every KVM ioctl vmfork defines, tun's three, and CPython's own four."""
    # Every request whose _IOC type byte is KVMIO: the _IO ones (KVM_RUN 0xAE80,
    # KVM_CREATE_VM 0xAE01...) as much as those with a size.
    kvm = sorted({v for k, v in vars(ioctls).items()
                  if k.startswith("KVM_") and isinstance(v, int) and (v >> 8) & 0xFF == 0xAE})
    return kvm + [TUNSETIFF, TUNSETOFFLOAD, TUNSETVNETHDRSZ, FIONBIO, FIOCLEX, FIONCLEX,
                  FIONREAD, TCGETS]


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)


# A leaf of the search trees below: what a matched number does. ``bytes`` is the
# instruction to run (a return); a ``str`` names an out-of-line block (the argument
# checks of ioctl, socket, clone) that the leaf jumps to.
_Action = bytes | str
# Where a block's jump is patched in once the blocks are placed.
_JumpTo = tuple[str]

# A leaf compares at most this many numbers one after another: below it a further
# split costs more than the comparisons it saves.
_LEAF = 3
_MAX_COND_JUMP = 255   # a conditional jump's offsets are 8 bits


def _search(entries: list[tuple[int, _Action]], deny: bytes) -> list[bytes | _JumpTo]:
    """Code that finds the accumulator's value among ``entries`` (sorted, distinct) by
    binary search and runs its action, or ``deny``. Each split is one ``JGE``; when the
    lower half is longer than a conditional jump reaches, the split takes an ``JA``
    (32-bit offset) over it. A path runs about log2(len/3) + 3 comparisons."""
    if len(entries) <= _LEAF:
        code: list[bytes | _JumpTo] = []
        for number, action in entries:
            code.append(_insn(BPF_JEQ_K, number, 0, 1))
            code.append(action if isinstance(action, bytes) else (action,))
        code.append(deny)
        return code
    mid = len(entries) // 2
    lower, upper = _search(entries[:mid], deny), _search(entries[mid:], deny)
    if len(lower) <= _MAX_COND_JUMP:
        return [_insn(BPF_JGE_K, entries[mid][0], len(lower), 0), *lower, *upper]
    return [_insn(BPF_JGE_K, entries[mid][0], 0, 1), _insn(BPF_JA, len(lower)),
            *lower, *upper]


def _link(main: list[bytes | _JumpTo], blocks: dict[str, list[bytes | _JumpTo]]) -> bytes:
    """``main`` followed by the blocks, each ``(label,)`` made an ``JA`` to its block."""
    code = list(main)
    starts: dict[str, int] = {}
    for label, block in blocks.items():
        starts[label] = len(code)
        code += block
    return b"".join(insn if isinstance(insn, bytes) else
                    _insn(BPF_JA, starts[insn[0]] - pc - 1) for pc, insn in enumerate(code))


def build_filter(allowed: Iterable[str], *, ioctl_requests: Iterable[int] = (),
                 default: int = SECCOMP_RET_KILL_PROCESS,
                 threads_only: bool = False) -> bytes:
    """The BPF program (a sequence of 8-byte ``sock_filter``), as described above.
    ``threads_only``: ``clone`` only with ``CLONE_THREAD`` (new threads, never a new
    process: ``fork`` dies), for a process that never forks.

    The syscall number, then the ioctl request, is found by binary search rather than
    compared with each allowed one in turn: every system call a VMM makes runs the
    filter (each ``KVM_RUN`` after each exit), and a linear list of ~200 numbers and
    ~100 requests ran up to ~480 instructions for an ioctl; the trees run ~20."""
    deny = _insn(BPF_RET_K, default)
    allow = _insn(BPF_RET_K, SECCOMP_RET_ALLOW)
    allowed = set(allowed)
    names = sorted(allowed - {"ioctl", "socket", "socketpair", "clone3"}
                   - ({"clone", "fork", "vfork"} if threads_only else set()))
    unknown = [n for n in names if n not in SYSCALLS]
    if unknown:
        raise ValueError(f"no x86-64 number known for {unknown}")
    actions: dict[int, _Action] = {SYSCALLS[name]: allow for name in names}
    # clone3's flags are behind a pointer BPF cannot read: ENOSYS makes glibc use clone.
    actions[SYSCALLS["clone3"]] = _insn(BPF_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS)
    blocks: dict[str, list[bytes | _JumpTo]] = {}
    if threads_only and "clone" in allowed:
        # clone's flags are argument 0 (a register, unlike clone3's).
        actions[SYSCALLS["clone"]] = "clone"
        blocks["clone"] = [_insn(BPF_LD_W_ABS, _arg_lo(0)),
                           _insn(BPF_ALU_AND_K, CLONE_THREAD),
                           _insn(BPF_JEQ_K, CLONE_THREAD, 0, 1), allow, deny]
    # socket / socketpair: the domain (argument 0) must be AF_UNIX.
    for name in ("socket", "socketpair"):
        actions[SYSCALLS[name]] = "unix-only"
    blocks["unix-only"] = [_insn(BPF_LD_W_ABS, _arg_lo(0)),
                           _insn(BPF_JEQ_K, AF_UNIX, 0, 1), allow, deny]
    # ioctl: the request (argument 1) must be one we use, its high word zero.
    requests = sorted(set(ioctl_requests))
    if requests:
        actions[SYSCALLS["ioctl"]] = "ioctl"
        blocks["ioctl"] = [_insn(BPF_LD_W_ABS, _arg_hi(1)), _insn(BPF_JEQ_K, 0, 1, 0), deny,
                           _insn(BPF_LD_W_ABS, _arg_lo(1)),
                           *_search([(req, allow) for req in requests], deny)]
    main: list[bytes | _JumpTo] = [
        _insn(BPF_LD_W_ABS, _ARCH),
        _insn(BPF_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        _insn(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        _insn(BPF_LD_W_ABS, _NR),
        _insn(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1),
        _insn(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        *_search(sorted(actions.items()), deny),
    ]
    program = _link(main, blocks)
    if len(program) // 8 > 4096:   # BPF_MAXINSNS
        raise ValueError(f"seccomp program of {len(program) // 8} instructions is over 4096")
    return program


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("_pad", ctypes.c_ushort * 3),
                ("filter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None, use_errno=True)


def install(program: bytes) -> None:
    """Set no-new-privs and install ``program`` on every thread of this process
    (TSYNC: a VMM's threads are already running when its set-up ends)."""
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {errno.errorcode.get(err)}")
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, (0, 0, 0), ctypes.addressof(buf))
    rc = _libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC,
                       ctypes.byref(prog))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp(SET_MODE_FILTER): {errno.errorcode.get(err, err)}"
                      + (f" (thread {rc} could not be synchronised)" if rc > 0 else ""))


@functools.cache
def vmm_filter(*, log_only: bool = False) -> bytes:
    """The VMM's program, built once per process and kept: the zygote builds it before
    it forks (``vmmchild.prefork``), so that no child spends its own memory on the
    few hundred objects and the cold code the build takes (each object it allocates,
    each code object it runs for the first time, is a page copied into that child)."""
    return build_filter(VMM_ALLOWED, ioctl_requests=vmm_ioctls(),
                        default=SECCOMP_RET_LOG if log_only else SECCOMP_RET_KILL_PROCESS)


def install_vmm_filter(*, log_only: bool = False) -> None:
    """The VMM's allow-list; ``log_only`` logs instead of killing (to collect a
    workload's syscalls: ``journalctl -k``/``dmesg`` show ``type=1326``)."""
    install(vmm_filter(log_only=log_only))


# What a parent VMM does once its jail is set up and its machine built: boot a kernel,
# run the warm-up over vsock, capture into its run directory. The VMM's list, but it
# never forks (no live capture; a fork would also be a way out of its process group).
PARENT_ALLOWED = tuple(n for n in VMM_ALLOWED
                       if n not in {"wait4", "waitid", "pidfd_open", "pidfd_send_signal"})


def install_parent_filter(*, log_only: bool = False) -> None:
    """The parent VMM's allow-list (``PARENT_ALLOWED``, ``clone`` for threads only)."""
    install(build_filter(PARENT_ALLOWED, ioctl_requests=vmm_ioctls(), threads_only=True,
                         default=SECCOMP_RET_LOG if log_only else SECCOMP_RET_KILL_PROCESS))


def available() -> str | None:
    """None if this kernel offers seccomp filters, else why not."""
    rc = _libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0)
    if rc < 0:
        return f"prctl(PR_GET_SECCOMP): {errno.errorcode.get(ctypes.get_errno())}"
    return None
