"""``vmfork doctor``: check that this host can run vmfork, and say how to fix what cannot.

Each check prints PASS, WARN or FAIL with a one-line finding and, when not
PASS, the fix. The exit status is 1 when any check FAILs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    status: str        # PASS | WARN | FAIL
    finding: str
    fix: str = ""


def register(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check this host and say how to fix what is missing",
                       description=__doc__)
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="also check the certificate `vmfork serve --tls-cert` would use")
    p.add_argument("--tls-key", default=None, metavar="FILE",
                   help="... and its key (given with --tls-cert)")
    p.set_defaults(func=run)


def _kvm_device() -> Check:
    from vmfork.kvm import api
    try:
        fd = api.open_kvm()
    except OSError as err:
        return Check("kvm device", "FAIL", str(err),
                     "load kvm_intel or kvm_amd, enable virtualisation in the firmware, "
                     "or run as a user in the kvm group")
    try:
        version = api.get_api_version(fd)
    finally:
        os.close(fd)
    if version != api.KVM_API_VERSION:
        return Check("kvm device", "FAIL", f"KVM API version {version}",
                     f"vmfork needs KVM API {api.KVM_API_VERSION}")
    return Check("kvm device", "PASS", f"/dev/kvm answers, API version {version}")


def _kvm_caps() -> Check:
    from vmfork.kvm import api
    fd = api.open_kvm()
    try:
        missing = [what for cap, what in api.REQUIRED_CAPS.items()
                   if not api.check_extension(fd, cap)]
        max_vcpus = api.check_extension(fd, api.CAP_MAX_VCPUS)
    finally:
        os.close(fd)
    if missing:
        return Check("kvm capabilities", "FAIL", "missing: " + "; ".join(missing),
                     "use a newer host kernel with a full KVM")
    return Check("kvm capabilities", "PASS",
                 f"all {len(api.REQUIRED_CAPS)} needed capabilities; up to {max_vcpus} vCPUs")


def _native_core() -> Check:
    from vmfork.vmm import native
    try:
        native.require_core()
    except native.CoreMissing as err:
        return Check("native core", "FAIL", "vmfork._core is not built: no VM can run", str(err))
    return Check("native core", "PASS", "vmfork._core is built")


def _kvm_runs_guests() -> Check:
    from vmfork.kvm.probe import run_probe
    result = run_probe()
    if result.ok:
        return Check("kvm runs unmodified guests", "PASS", result.detail)
    qemu = shutil.which("qemu-system-x86_64")
    fix = ("this KVM cannot run a Linux guest's user space; run KVM work inside the emulated "
           "test host: vmfork testhost -- <command>")
    if qemu is None:
        fix += " (install the Debian package qemu-system-x86 first)"
    return Check("kvm runs unmodified guests", "WARN" if qemu else "FAIL", result.detail, fix)


def _userfaultfd() -> Check:
    if os.path.exists("/dev/userfaultfd"):
        return Check("userfaultfd", "PASS", "/dev/userfaultfd present")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(323, os.O_CLOEXEC | os.O_NONBLOCK)  # SYS_userfaultfd on x86-64
    if fd >= 0:
        os.close(fd)
        return Check("userfaultfd", "PASS", "userfaultfd(2) available")
    return Check("userfaultfd", "WARN", "userfaultfd unavailable",
                 "set vm.unprivileged_userfaultfd=1 or run as root (live BRANCH uses it)")


def _cgroup_memory() -> Check:
    controllers = "/sys/fs/cgroup/cgroup.controllers"
    if os.path.exists(controllers) and "memory" in open(controllers).read().split():
        return Check("cgroup memory controller", "PASS", "cgroup v2 with memory.max")
    if os.path.isdir("/sys/fs/cgroup/memory"):
        return Check("cgroup memory controller", "PASS",
                     "cgroup v1 memory controller (memory.limit_in_bytes)")
    return Check("cgroup memory controller", "WARN", "no memory controller mounted",
                 "mount cgroup2 on /sys/fs/cgroup (per-sandbox memory limits need it)")


def _cgroup_moves() -> Check:
    from vmfork.runtime import cgroups
    name = "cgroup joins (favordynmods)"
    mount = cgroups.cgroup2_mount(open("/proc/self/mountinfo").read())
    if mount is None:
        return Check(name, "PASS", "no cgroup2 mount (cgroup v1 only)")
    if "favordynmods" in mount[2]:
        return Check(name, "PASS", "cgroup2 favours dynamic changes: a sandbox's cgroup "
                     "join waits for no RCU grace period")
    if not cgroups.favordynmods_offered():
        return Check(name, "WARN", "this kernel has no favordynmods (before Linux 6.0): each "
                     "sandbox's cgroup join may wait for an RCU grace period",
                     "a 6.0 or later kernel spawns faster")
    if os.environ.get(cgroups.FAVOR_DYNMODS_ENV) == "0":
        return Check(name, "WARN", f"off, and {cgroups.FAVOR_DYNMODS_ENV}=0 keeps it off: on "
                     "6.1 kernels each sandbox's cgroup join waits for an RCU grace period",
                     f"unset {cgroups.FAVOR_DYNMODS_ENV}")
    return Check(name, "PASS", "off for now: vmfork turns it on before its first sandbox's "
                 "cgroup (runtime/cgroups.py)")


def _netns() -> Check:
    if not os.path.exists("/proc/self/ns/net"):
        return Check("network namespaces", "FAIL", "kernel without network namespaces",
                     "use a kernel with CONFIG_NET_NS")
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        os._exit(0 if libc.unshare(0x40000000) == 0 else 1)  # CLONE_NEWNET
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return Check("network namespaces", "WARN", "cannot create a network namespace",
                     "run as root (per-child networking needs CAP_NET_ADMIN)")
    tun = os.path.exists("/dev/net/tun")
    return Check("network namespaces", "PASS" if tun else "WARN",
                 "can create network namespaces" + ("; /dev/net/tun present" if tun else ""),
                 "" if tun else "modprobe tun (guest networking needs /dev/net/tun)")


def _disk() -> Check:
    from vmfork.paths import cache_dir
    path = cache_dir()
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    gib = free / (1 << 30)
    if gib < 1:
        return Check("free disk", "FAIL", f"{gib:.1f} GiB free under {path}",
                     "free space or set VMFORK_CACHE_DIR to a bigger file system")
    if gib < 5:
        return Check("free disk", "WARN", f"{gib:.1f} GiB free under {path}",
                     "snapshots need room: keep 5 GiB or more free")
    return Check("free disk", "PASS", f"{gib:.0f} GiB free under {path}")


def _jail() -> Check:
    from vmfork.runtime import jail, seccomp

    problems = jail.problems()
    no_filter = seccomp.available()
    if no_filter is not None:
        problems.append(no_filter)
    if problems:
        return Check("VMM jail", "FAIL", "; ".join(problems),
                     "run the daemon as root on a kernel with seccomp and mount/IPC/UTS/PID "
                     "namespaces; otherwise `vmfork serve` refuses to start unless given "
                     "--insecure-no-jail (sandboxes then run uncontained)")
    return Check("VMM jail", "PASS", "namespaces (mount, IPC, UTS, PID), pivot_root, uid "
                 "change and seccomp filters (SECCOMP_MODE_FILTER) are available: every VMM, "
                 "a snapshot's parent included, is jailed (docs/security.md)")


def _user_namespaces() -> Check:
    from vmfork.runtime import jail

    detail = jail.user_namespaces()
    if detail is None:
        return Check("user namespaces", "PASS", "unprivileged user namespaces can be made "
                     "(not used yet: the jail needs root, docs/security.md)")
    return Check("user namespaces", "WARN", detail,
                 "not needed today (the jail runs as root and drops to a uid of its own); "
                 "enable them (kernel.unprivileged_userns_clone=1, user.max_user_namespaces "
                 "> 0) for a future rootless daemon")


def _image() -> Check:
    from vmfork.image import ImageError, find_image
    try:
        image = find_image()
    except ImageError as err:
        return Check("guest image", "FAIL", str(err).splitlines()[0], "vmfork image build")
    return Check("guest image", "PASS",
                 f"default: kernel {image.kernel_size >> 20} MiB, "
                 f"initramfs {image.initrd_size >> 20} MiB")


def tls_check(cert: str | None, key: str | None) -> Check:
    """What ``vmfork serve`` would say about these files, before it is started."""
    from pathlib import Path

    from vmfork.server.tls import (
        EXPIRY_WARNING_DAYS,
        TlsConfigError,
        read_certificate,
        server_context,
    )
    if cert is None or key is None:
        return Check("TLS", "FAIL", "--tls-cert and --tls-key go together",
                     "give both files, as to `vmfork serve`")
    try:
        server_context(Path(cert), Path(key))
        info = read_certificate(Path(cert))
    except TlsConfigError as err:
        return Check("TLS", "FAIL", str(err), "give the PEM certificate and its own key")
    names = ", ".join(info.names) or "no subject alternative names"
    finding = (f"{info.subject} for {names}, valid until {info.not_after:%Y-%m-%d}; "
               "TLS 1.2 or later")
    if not info.names:
        return Check("TLS", "WARN", finding, "clients check the host name against the "
                     "certificate's subject alternative names: add the daemon's DNS name "
                     "or IP address")
    if info.days_left() < EXPIRY_WARNING_DAYS:
        return Check("TLS", "WARN", finding, "the certificate expires within "
                     f"{EXPIRY_WARNING_DAYS} days: renew it")
    return Check("TLS", "PASS", finding)


CHECKS: list[Callable[[], Check]] = [
    _kvm_device, _kvm_caps, _native_core, _kvm_runs_guests, _userfaultfd, _cgroup_memory, _cgroup_moves, _netns, _jail, _user_namespaces, _disk,
    _image,
]


def run(args: argparse.Namespace) -> int:
    results = []
    for check in CHECKS:
        try:
            results.append(check())
        except Exception as err:  # noqa: BLE001 - a check that crashes is itself a finding
            name = check.__name__.strip("_").replace("_", " ")
            results.append(Check(name, "FAIL", f"check failed: {err}"))
        if results[-1].status == "FAIL" and check in (_kvm_device,):
            break  # nothing KVM-related can be checked without /dev/kvm
    if args.tls_cert is not None or args.tls_key is not None:
        results.append(tls_check(args.tls_cert, args.tls_key))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        for r in results:
            print(f"{r.status:4}  {r.name}: {r.finding}")
            if r.fix:
                print(f"      fix: {r.fix}")
    return 1 if any(r.status == "FAIL" for r in results) else 0
