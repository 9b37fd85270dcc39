"""Boot benchmark: process start to agent ready, vmfork vs QEMU, same guest.

For each run a fresh process is started (so interpreter start-up counts) and
the clock runs until the guest agent answers a ``ping`` over vsock:

* vmfork: ``python -m vmfork.runtime.bootprobe``, our VMM in a new process;
  reports its own breakdown (VMM set-up, kernel to init, init to agent ready)
  and the VM exits by reason.
* QEMU: ``qemu-system-x86_64 -M microvm -enable-kvm`` with the same kernel,
  initramfs and command line, a virtio-mmio vsock device (vhost) when the host
  has ``/dev/vhost-vsock``; timed to the agent's ``ready`` console line and,
  with vsock, to its first ``ping`` answer.

Writes ``bench/results/boot.{json,md}``. Run it anywhere: on a host whose KVM
cannot run unmodified guests it re-runs itself inside the emulated test host,
where only the ratio between the two is meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_kvm_host, summary, where, write_results

READY_MARKER = b"vmfork-agent: ready"
INIT_MARKER = b"vmfork-agent: init"


def boot_vmfork(mem_mib: int, timeout: float) -> dict[str, object]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vmfork.runtime.bootprobe",
                           "--mem-mib", str(mem_mib)], capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"vmfork boot failed: {proc.stderr.decode(errors='replace')[-2000:]}")
    report = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    report["process_to_ready_s"] = report["ready_at"] - started
    report["wall_s"] = time.monotonic() - started
    return report


def boot_qemu(image: object, mem_mib: int, timeout: float, cid: int) -> dict[str, object]:
    from vmfork.vmm.machine import BASE_CMDLINE
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise RuntimeError("qemu-system-x86_64 not installed (Debian package qemu-system-x86)")
    vsock = os.path.exists("/dev/vhost-vsock")
    # acpi=off: our kernel has no ACPI, and microvm only puts its virtio-mmio
    # devices on the kernel command line (virtio_mmio.device=...) without ACPI.
    cmd = [qemu, "-M", "microvm,x-option-roms=off,rtc=off,isa-serial=on,acpi=off", "-enable-kvm",
           "-cpu", "host", "-m", str(mem_mib), "-smp", "1", "-nodefaults", "-no-user-config",
           "-nographic", "-no-reboot", "-serial", "stdio",
           "-kernel", str(image.kernel), "-initrd", str(image.initrd),  # type: ignore[attr-defined]
           "-append", f"{BASE_CMDLINE} {image.cmdline}",  # type: ignore[attr-defined]
           "-device", "virtio-rng-device"]
    if vsock:
        cmd += ["-device", f"vhost-vsock-device,guest-cid={cid}"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    marks: dict[str, float] = {}
    output = b""
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while "ready" not in marks:
            if time.monotonic() - started > timeout:
                raise RuntimeError("QEMU guest not ready in time:\n"
                                   + output.decode(errors="replace")[-2000:])
            if not sel.select(0.5):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError("QEMU exited:\n" + output.decode(errors="replace")[-2000:])
            output += chunk
            now = time.monotonic()
            if INIT_MARKER in output and "init" not in marks:
                marks["init"] = now
            if READY_MARKER in output:
                marks["ready"] = now
        result: dict[str, object] = {
            "process_to_init_s": marks["init"] - started,
            "process_to_ready_line_s": marks["ready"] - started,
            "vsock": vsock,
        }
        result["process_to_ready_s"] = result["process_to_ready_line_s"]
        if vsock:
            from vmfork.agent.client import AgentClient, AgentUnavailable, vsock_connector
            agent = AgentClient(vsock_connector(cid, timeout=5.0))
            try:
                agent.wait_until_ready(min(timeout, 60.0))
                result["process_to_ready_s"] = time.monotonic() - started
                result["ready_by"] = "vsock ping"
            except AgentUnavailable as err:
                # Timed to the agent's ready line instead (a lower bound for QEMU,
                # so the ratio can only flatter QEMU); say why.
                result["ready_by"] = f"ready console line (vsock ping failed: {err})"
        else:
            result["ready_by"] = "ready console line (no /dev/vhost-vsock)"
        return result
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mem-mib", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    ensure_kvm_host(__file__, sys.argv[1:])

    from vmfork.image import find_image
    image = find_image()
    ours: list[dict[str, object]] = []
    theirs: list[dict[str, object]] = []
    for i in range(args.runs):
        # interleave, so drift in a noisy machine hits both alike
        ours.append(boot_vmfork(args.mem_mib, args.timeout))
        theirs.append(boot_qemu(image, args.mem_mib, args.timeout, cid=100 + i))
        print(f"run {i + 1}: vmfork {ours[-1]['process_to_ready_s']:.2f} s, "
              f"qemu {theirs[-1]['process_to_ready_s']:.2f} s", file=sys.stderr)

    def col(rows: list[dict[str, object]], key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key) is not None]  # type: ignore[arg-type]

    v_ready = summary(col(ours, "process_to_ready_s"))
    q_ready = summary(col(theirs, "process_to_ready_s"))
    breakdown = {key: summary(col(ours, key)) for key in
                 ("interpreter_s", "vmm_setup_s", "kernel_to_init_s", "init_to_ready_s")}
    exits = ours[-1]["exits"]
    ratio = v_ready["median"] / q_ready["median"]
    md = [f"# Boot: process start to agent ready ({args.runs} runs, {args.mem_mib} MiB, 1 vCPU)",
          "", f"Measured in: {where()}.", "",
          "| | median | min | max |", "|---|---|---|---|",
          f"| vmfork | {v_ready['median']:.2f} s | {v_ready['min']:.2f} s | {v_ready['max']:.2f} s |",
          f"| QEMU microvm | {q_ready['median']:.2f} s | {q_ready['min']:.2f} s | "
          f"{q_ready['max']:.2f} s |",
          f"| **ratio vmfork / QEMU** | **{ratio:.2f}** | | |", "",
          "vmfork breakdown (median):", ""]
    for key, s in breakdown.items():
        md.append(f"- {key.removesuffix('_s').replace('_', ' ')}: {s['median']:.3f} s")
    md += ["", f"VM exits by reason (last run): {exits}", ""]
    md.append(f"QEMU readiness measured by: {theirs[-1].get('ready_by')}. vmfork's is always "
              "a ping answered over vsock (after the same console line).")
    write_results("boot", {"runs": args.runs, "mem_mib": args.mem_mib, "vmfork": ours,
                           "qemu": theirs, "vmfork_ready_s": v_ready, "qemu_ready_s": q_ready,
                           "ratio_vmfork_over_qemu": ratio, "breakdown": breakdown},
                  "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
